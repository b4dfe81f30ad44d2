"""A client's own model, kept in its state between rounds (Local, and the methods whose clients
keep a personal model of their own architecture)."""

from __future__ import annotations

from pfl_core.runtime.context import load_state


def load_personal(ctx, client):
    """The client's own weights in its working model (initial weights before any training)."""
    return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))
