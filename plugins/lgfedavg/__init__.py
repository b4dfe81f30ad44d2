"""LG-FedAvg: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", 2020 (Algorithm 1).

The opposite split from FedAlt/FedSim: each client keeps its *local representation* (the
base, layers 1..k) and only the *global* head (the last ``head_layers`` layers k+1..L) is
shared and averaged (default: the middle, k = L // 2).

    each round t, each participant i:
        (theta_i^l, theta^g) <- (own base, received head theta^g_t)
        tau local epochs of SGD on the whole model
        upload theta^g_i
    theta^g_{t+1} <- sum_i n_i/n theta^g_i

A cold-start client receives the global head, starts its base from the seeded initial weights
and trains the whole model for ``experiment.coldstart_epochs`` (the core default).
"""

from __future__ import annotations

from pfl_core.api import PartialModel


class LGFedAvg(PartialModel):
    name = "lgfedavg"
    shared_part = "head"
