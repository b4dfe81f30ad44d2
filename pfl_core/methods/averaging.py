"""Weight averaging: FedAvg's server and client (McMahan et al. 2017, Algorithm 1) as a base
class for the methods that build on it (partial models, proximal terms, personal models beside a
global one). The ``fedavg`` plugin is this class under its name.
"""

from __future__ import annotations

from pfl_core.errors import SpecError
from pfl_core.registry import Plugin
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.aggregate import weighted_average
from pfl_core.runtime.context import clone_state, load_state


def require_single_architecture(spec, method: str) -> None:
    """Weight averaging needs every client to share one architecture."""
    archs = set(spec.model.clients or spec.model.pool or [spec.model.name])
    if len(archs) > 1:
        raise SpecError(model_key(spec), f"{method} averages weights, so every client needs the same architecture; "
                             f"got {', '.join(sorted(archs))}")


def model_key(spec) -> str:
    return "model.clients" if spec.model.clients else "model.pool" if spec.model.pool else "model.name"


class WeightAveraging(Plugin):
    """Broadcast the global weights, train locally, average the uploads weighted by train size;
    each client is evaluated on the global model (FedAvg's hooks, for subclasses to extend)."""

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
