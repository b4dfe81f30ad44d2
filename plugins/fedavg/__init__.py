"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017, Algorithm 1 (FederatedAveraging).

    server: w_0 initialised
    each round t: S_t = sample max(C*K, 1) clients            (engine: select_clients)
        each k in S_t: w_{t+1}^k <- ClientUpdate(k, w_t)       (broadcast, local_train, upload)
        w_{t+1} <- sum_k n_k / n * w_{t+1}^k                   (server_aggregate)
    ClientUpdate: E epochs of minibatch SGD (batch B) on the client's data

The personalized model of every client is the global model.
"""

from __future__ import annotations

from pfl_core.api import WeightAveraging


class FedAvg(WeightAveraging):
    """FedAvg (McMahan et al. 2017): broadcast the global weights, local SGD, average weighted
    by train size; each client is evaluated on the global model. The hooks are
    ``pfl_core.api.WeightAveraging``'s, which the methods built on FedAvg share."""

    name = "fedavg"
