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

from pfl_core import Plugin, SpecError, hookimpl
from pfl_core.aggregate import weighted_average
from pfl_core.context import clone_state, load_state


def require_single_architecture(spec, method: str) -> None:
    """Weight averaging needs every client to share one architecture."""
    archs = set(spec.model.clients or spec.model.pool or [spec.model.name])
    if len(archs) > 1:
        key = "model.clients" if spec.model.clients else "model.pool"
        raise SpecError(key, f"{method} averages weights, so every client needs the same architecture; "
                             f"got {', '.join(sorted(archs))}")


class FedAvg(Plugin):
    """FedAvg (McMahan et al. 2017): broadcast the global weights, local SGD, average weighted
    by train size; each client is evaluated on the global model."""

    name = "fedavg"

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        ctx.server["global"] = clone_state(ctx.models.initial_state(ctx.models.arch_of(0)))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"weights": ctx.server["global"]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["weights"])
        return True

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": client.model.state_dict()}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        averaged = weighted_average((weights[i], message["weights"]) for i, message in uploads)
        if averaged is not None:  # nobody took part: keep the previous global model
            ctx.server["global"] = averaged
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": ctx.server["global"]}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_state(client.model, message["weights"])}
