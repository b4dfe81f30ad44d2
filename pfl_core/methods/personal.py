"""A client's own model, kept in its state between rounds (Local, and the methods whose clients
keep a personal model of their own architecture)."""

from __future__ import annotations

from pfl_core.runtime.context import load_state


def load_personal(ctx, client):
    """The client's own weights in its working model (initial weights before any training)."""
    return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))


def load_kept(ctx, client, keys) -> None:
    """The state-dict entries a client keeps for itself (``keys``: its buffers, a personal
    classifier) into its working model: its own after it trained, the initial ones before."""
    kept = client.state.get("kept")
    if kept is None:
        initial = ctx.models.initial_state(client.arch)
        kept = {k: initial[k] for k in keys}
    load_state(client.model, kept)


def keep_entries(client, keys) -> None:
    """After training: the working model's ``keys`` into ``client.state["kept"]`` (for ``load_kept``)."""
    if keys:
        state = client.model.state_dict()
        client.state["kept"] = {k: state[k].detach().clone() for k in keys}
