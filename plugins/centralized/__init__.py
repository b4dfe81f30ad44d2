"""Centralized: one model trained on the pooled training data of all clients, evaluated on
every client's own test split. The non-federated reference (no client ever communicates;
the pooling itself is not counted as communication).

One round = ``training.local_epochs`` epochs over the pooled data, with the same optimiser,
batch size and loss as clients use.
"""

from __future__ import annotations

import torch.nn.functional as F

from pfl_core import Plugin, hookimpl
from pfl_core.context import clone_state, load_state
from pfl_core.training import make_optimizer, run_epochs
from plugins.fedavg import require_single_architecture


def cross_entropy(model, x, y, logits):
    return F.cross_entropy(logits, y)


class Centralized(Plugin):
    name = "centralized"

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        ctx.server["global"] = clone_state(ctx.models.initial_state(ctx.models.arch_of(0)))
        ctx.server["pooled_x"], ctx.server["pooled_y"] = ctx.data.pooled_train(ctx.training_clients)

    @hookimpl
    def select_clients(self, ctx, round):
        return []

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        model = load_state(ctx.models.working(ctx.models.arch_of(0)), ctx.server["global"])
        training = ctx.spec.training
        run_epochs(model, make_optimizer(model.parameters(), training),
                   ctx.server["pooled_x"], ctx.server["pooled_y"],
                   epochs=training.local_epochs, batch_size=training.batch_size,
                   loss_fn=cross_entropy, generator=ctx.generator("train"), shuffle=training.shuffle)
        ctx.server["global"] = clone_state(model)
        return True

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": load_state(client.model, ctx.server["global"])}
