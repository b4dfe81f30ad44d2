"""Centralized: one model trained on the pooled training data of all (training) clients,
evaluated on every client's own test split. The non-federated reference: no client ever
communicates, and the pooling itself is not counted as communication.

It is FedAvg's global model without the federation: one round = ``training.local_epochs``
epochs over the pooled data, with the same optimiser, batch size and loss as clients use.
"""

from __future__ import annotations

import torch.nn.functional as F

from pfl_core.api import clone_state, hookimpl, load_state, make_optimizer, precision_autocast, run_epochs
from pfl_plugins.fedavg import FedAvg


def cross_entropy(model, x, y, logits):
    return F.cross_entropy(logits, y)


class Centralized(FedAvg):
    """One model trained on the pooled training data of all training clients
    (``training.local_epochs`` epochs per round), evaluated on each client's test split; no
    communication is counted."""

    name = "centralized"

    def not_deployable(self) -> str:
        """Why the client side cannot run on Flower nodes (pfl_core/deploy/flower.py)."""
        return "it trains one model on every client's data pooled on the server: there is nothing to deploy"

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        ctx.server["pooled_x"], ctx.server["pooled_y"] = ctx.data.pooled_train(ctx.training_clients)

    @hookimpl
    def select_clients(self, ctx, round):
        return []

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        model = load_state(ctx.models.working(ctx.models.arch_of(0)), ctx.server["global"])
        training = ctx.spec.training

        def pooled_step() -> bool:  # counts each step for budget.private_steps; the server has no batch limit
            ctx.record_pooled_work(steps=1)
            return True

        with precision_autocast(training, ctx.device):  # the pooled training, as a client's
            run_epochs(model, make_optimizer(model.parameters(), training),
                       ctx.server["pooled_x"], ctx.server["pooled_y"],
                       epochs=training.local_epochs, batch_size=training.batch_size,
                       loss_fn=cross_entropy, generator=ctx.generator("train"), shuffle=training.shuffle,
                       drop_last=training.drop_last, counter=lambda n: ctx.record_pooled_work(epochs=1),
                       take_batch=pooled_step)
        ctx.server["global"] = clone_state(model)
        return True
