"""Element-wise learned mixing of a client's own weights with the global model's, W in [0, 1]:
own + (global - own) (.) W, with W learned by clipped gradient steps through the mixed model
(FedALA's adaptive local aggregation, FedAH's aggregated head)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def elementwise_mix(base: dict, own: dict, global_: dict, weights: dict) -> dict:
    """``base`` with each key of ``weights`` replaced by own + (global - own) (.) W."""
    out = dict(base)
    for key, w in weights.items():
        out[key] = own[key] + (global_[key] - own[key]) * w
    return out


class ClippedSGD(torch.optim.SGD):
    """A plain gradient step on W, then every element clipped to [0, 1]."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for w in group["params"]:
                w.clamp_(0.0, 1.0)
        return loss


class LearnedMix(nn.Module):
    """The mixed model as a module whose only parameters are W: the forward pass runs ``model``
    with ``fixed`` (every entry not mixed) and own + (global - own) (.) W on the keys of
    ``weights``, so autograd gives grad_W = grad_mixed (.) (global - own)."""

    def __init__(self, model: nn.Module, own: dict, global_: dict, weights: dict, fixed: dict):
        super().__init__()
        self.names = list(weights)
        self.W = nn.ParameterList([nn.Parameter(weights[k].detach().clone()) for k in self.names])
        self._model = [model]  # not a submodule: W is this module's only parameter
        self.own = {k: own[k].detach() for k in self.names}
        self.delta = {k: (global_[k] - own[k]).detach() for k in self.names}
        # copies: BatchNorm statistics updated while W learns are dropped
        self.fixed = {k: v.detach().clone() for k, v in fixed.items()}

    def weights(self) -> dict:
        return {k: w.detach().clone() for k, w in zip(self.names, self.W)}

    def forward(self, x):
        model = self._model[0]
        model.train(self.training)
        mixed = {k: self.own[k] + self.delta[k] * w for k, w in zip(self.names, self.W)}
        return functional_call(model, {**self.fixed, **mixed}, (x,))
