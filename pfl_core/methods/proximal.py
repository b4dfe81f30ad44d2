"""Proximal terms and their anchor: FedProx's mu/2 ||w - w_t||^2 (Li et al. 2020, Eq. 2), which
Ditto and pFedMe use too, and weight averaging whose clients keep w_t as the anchor."""

from __future__ import annotations

from pfl_core.methods.averaging import WeightAveraging
from pfl_core.registry.hookspecs import hookimpl


def proximal_term(model, anchor, coefficient: float):
    """coefficient / 2 * ||theta - anchor||^2 over ``model``'s parameters (``anchor``: one
    tensor per parameter, in ``model.parameters()`` order, a constant). FedProx's term (Eq. 2);
    Ditto and pFedMe use the same one."""
    distance = sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))
    return coefficient / 2 * distance


class AnchoredAveraging(WeightAveraging):
    """FedAvg whose clients keep w_t, the model they just received, as constants in
    ``client.scratch["w_t"]``: the anchor of a proximal term (FedProx, Ditto)."""

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)
        client.scratch["w_t"] = [p.detach().clone() for p in client.model.parameters()]
        return True
