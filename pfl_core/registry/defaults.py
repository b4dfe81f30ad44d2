"""Generic behaviour every run gets unless a method answers first: nothing method-specific.

Registered first in each run's PluginManager, so any plugin's answer to a firstresult hook
comes before these (pluggy calls later registrations first).
"""

from __future__ import annotations

import torch.nn.functional as F

from pfl_core.registry.hookspecs import hookimpl


class CoreDefaults:
    @hookimpl
    def select_clients(self, ctx, round):
        """``experiment.participation`` of the clients, drawn with the round's seeded RNG."""
        pool = ctx.training_clients
        rate = ctx.spec.experiment.participation
        k = max(1, round_half_up(rate * len(pool)))
        if k >= len(pool):
            return list(pool)
        chosen = ctx.rng("select_clients").choice(len(pool), size=k, replace=False)
        return sorted(pool[i] for i in chosen)

    @hookimpl
    def client_weighting(self, ctx, participants):
        """FedAvg's weights: each participant's share of the participants' training samples."""
        sizes = {i: ctx.data.clients[i].num_train for i in participants}
        total = sum(sizes.values())
        return {i: n / total for i, n in sizes.items()}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {}

    @hookimpl
    def on_receive(self, ctx, client, message):
        return True

    @hookimpl
    def local_train(self, ctx, client):
        return client.train()

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """The task term: a plugin's ``task_loss`` when one answers, else cross-entropy."""
        task = ctx.hooks.task_loss(ctx=ctx, client=client, logits=logits, y=y)
        return F.cross_entropy(logits, y) if task is None else task

    @hookimpl
    def client_upload(self, ctx, client):
        return {}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        """Fine-tune what the method sends a newcomer (``message``, the engine's broadcast to it:
        the final global model for weight-sharing methods) on the newcomer's own data."""
        ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
        client.train(epochs=ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        for _ in uploads:  # run every client even when nothing is aggregated
            pass
        return True


def round_half_up(x: float) -> int:
    return int(x + 0.5)
