"""FedSim: Pillutla et al., "Federated Learning with Partial Model Personalization", ICML 2022
(Algorithm 1 with simultaneous updates).

The model is split into shared parameters u (the base, layers 1..k) and personal parameters
v_i (the head, the last ``head_layers`` layers k+1..L; default: the middle, k = L // 2, which is
the pMixFed paper's "layers [1, 2] are shared" for its CNNs).

    each round t, each participant i:
        (u, v_i) <- (u_t, v_i)                     receive u_t; v_i kept on the client
        tau local epochs of SGD on (u, v_i) jointly  -- u and v_i updated simultaneously
        upload u_i
    u_{t+1} <- sum_i n_i/n u_i

Only u is sent in either direction. A cold-start client (never trained) starts its head from
the run's seeded initial weights and trains u and v jointly for ``experiment.coldstart_epochs``
(the core default ``coldstart_personalize``: the broadcast plus simultaneous local training).
"""

from __future__ import annotations

from pfl_core.api import PartialModel


class FedSim(PartialModel):
    name = "fedsim"
    shared_part = "base"
