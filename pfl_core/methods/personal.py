"""A client's own model, kept in its state between rounds (Local, and the methods whose clients
keep a personal model of their own architecture)."""

from __future__ import annotations

from pfl_core.registry import Plugin
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.context import load_state


def load_personal(ctx, client):
    """The client's own weights in its working model (initial weights before any training)."""
    return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))



class KeepsOwnEntries(Plugin):
    """Client side of a method whose server sends each client a whole model
    (``message["weights"]``) while the client keeps some state-dict entries of its own
    (``kept_keys``: its buffers, a personal classifier). They go into the working model under
    the received weights, are taken back after training, and the evaluated model is the received
    one with them. The received weights stay in ``client.scratch["received"]`` for the upload
    (pFedHN, pFedLA, FedCAC)."""

    def kept_keys(self, ctx, arch: str) -> list[str]:
        raise NotImplementedError

    def load_received(self, ctx, client, message):
        kept = client.state.get("kept")
        if kept is None:  # before its first training: the initial entries
            initial = ctx.models.initial_state(client.arch)
            kept = {k: initial[k] for k in self.kept_keys(ctx, client.arch)}
        load_state(client.model, kept)
        return load_state(client.model, message["weights"])

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_received(ctx, client, message)
        client.scratch["received"] = message["weights"]
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        keys = self.kept_keys(ctx, client.arch)
        if keys:
            state = client.model.state_dict()
            client.state["kept"] = {k: state[k].detach().clone() for k in keys}
        return metrics

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_received(ctx, client, message)}
