"""Local: every client trains its own model on its own data and never communicates.

The reference for personalization: a method is only worth its communication if it beats
this. Each client's model starts from the run's seeded initial weights.
"""

from __future__ import annotations

from pfl_core.api import Plugin, clone_state, hookimpl, load_personal


class Local(Plugin):
    """Every client trains its own model from the seeded initial weights and never communicates
    (0 bytes): the reference a personalized method has to beat."""

    name = "local"

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": load_personal(ctx, client)}
