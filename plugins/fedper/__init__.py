"""FedPer: Arivazhagan et al., "Federated Learning with Personalization Layers", 2019, Alg. 1.

The model is base layers W_B (shared) followed by personalization layers W_P (kept on the
client). Each round:

    server: sends W_B to the participants                          (Alg. 1, server)
    client j: W_B, W_Pj <- E epochs of SGD on both, jointly         (Alg. 1, client)
              uploads W_B only
    server: W_B <- sum_j n_j / n W_Bj (FedAvg on the base)          (Alg. 1, server)

The personalized model of client j is W_B (the current global base) + W_Pj (its own layers;
the seeded initial ones until it first trains).

``head_layers``: how many parameterised layers, counted from the output, form the personal
head (the paper varies K_P from 1 to 4; default 1, the classifier, as for FedRep's head; the
same parameter as the partial-model methods', whose default is the middle). Layers are counted with
``pfl_core.models.layers`` (a BatchNorm is its own layer).
"""

from __future__ import annotations

from attrs import define, field

from pfl_core.api import (
    Plugin,
    SpecError,
    at_least,
    hookimpl,
    load_state,
    parameterised_layers,
    per_run,
    require_single_architecture,
    split_at,
    weighted_average,
)


@define
class FedPerParams:
    head_layers: int = field(default=1, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the personal head (the paper "
               "varies K_P from 1 to 4; 1: the classifier)"})


def body_head_keys(ctx, arch: str, head_layers: int, spec_path: str) -> tuple[list[str], list[str]]:
    """(body keys, head keys) of ``arch`` in state_dict order; the head is the last layers."""
    model = ctx.models.working(arch)
    n = len(parameterised_layers(model))
    if head_layers >= n:
        raise SpecError(f"{spec_path}.params.head_layers",
                        f"must leave at least one shared layer: {arch} has {n} parameterised layers")
    _, head = split_at(model, -head_layers)
    keys = list(model.state_dict())
    return [k for k in keys if k not in head], [k for k in keys if k in head]


class FedPer(Plugin):
    name = "fedper"
    Params = FedPerParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)  # the base is averaged

    def split(self, ctx) -> tuple[list[str], list[str]]:
        """(body keys, head keys) of the run's one architecture: computed by whichever side needs
        them (a function of the model and ``head_layers``), once per run."""
        arch = ctx.models.arch_of(0)  # one architecture (check_spec)
        return per_run(ctx, self, "body_head", lambda: body_head_keys(ctx, arch, self.params.head_layers,
                                                                      self.spec_path))

    def body_keys(self, ctx) -> list[str]:
        return self.split(ctx)[0]

    def head_keys(self, ctx) -> list[str]:
        return self.split(ctx)[1]

    @hookimpl
    def setup(self, ctx):
        body = self.body_keys(ctx)  # a head_layers the model cannot take fails here
        initial = ctx.models.initial_state(ctx.models.arch_of(0))
        ctx.server["body"] = {k: initial[k].clone() for k in body}

    def load_personal(self, ctx, client, body):
        """``body`` + the client's own head (seeded initial head before it first trains)."""
        load_state(client.model, body)
        head_keys = set(self.head_keys(ctx))
        head = client.state.get("head") or {k: v for k, v in ctx.models.initial_state(client.arch).items()
                                             if k in head_keys}
        return load_state(client.model, head)

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"body": ctx.server["body"]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_personal(ctx, client, message["body"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()  # W_B and W_P together, training.local_epochs epochs
        self.keep_head(ctx, client)
        return metrics

    def keep_head(self, ctx, client):
        state = client.model.state_dict()
        client.state["head"] = {k: state[k].detach().clone() for k in self.head_keys(ctx)}

    @hookimpl
    def client_upload(self, ctx, client):
        state = client.model.state_dict()
        return {"body": {k: state[k] for k in self.body_keys(ctx)}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        averaged = weighted_average((weights[i], message["body"]) for i, message in uploads)
        if averaged is not None:
            ctx.server["body"] = averaged
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"body": ctx.server["body"]}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_personal(ctx, client, message["body"])}


__all__ = ["FedPer", "FedPerParams", "body_head_keys"]
