"""Shared machinery for methods whose clients exchange soft predictions on the public set U
(COSMOS, COMET): model-agnostic, every client keeps its own model of its own architecture.

One round, as every such method runs it here::

    client i:  distil from the targets the server sent last round (none in round 1)
               train on D_i (round 1: pretrain_epochs, later: training.local_epochs)
               send f_i(U) = softmax(f_i(x) / T) for x in U        (float32 or float16)
    server:    method-specific: turn the predictions into each client's next targets

The client-side distillation of round t's targets happens at the start of round t + 1's
client work, which is where the next local step starts from it anyway (COSMOS's
f_i^(t,2) -> f_i^(t+1,1)); evaluation after round t therefore scores f_i^(t,1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core import Plugin, SpecError, hookimpl
from pfl_core.context import clone_state, load_state
from pfl_core.spec import FieldError, at_least, finite, greater_than, one_of
from plugins.local import load_personal

DTYPES = {"float32": torch.float32, "float16": torch.float16}


@define
class CodistillParams:
    pretrain_epochs: int = field(default=5, validator=at_least(0))  # E0, round 1 only
    distill_epochs: int = field(default=1, validator=at_least(0))  # client distillation on U
    temperature: float = field(default=1.0, validator=[finite, greater_than(0)])
    label_dtype: str = field(default="float32", validator=one_of(*DTYPES))
    distill_batch_size: int = field(default=64, validator=at_least(1))


def require_public(spec, method: str) -> None:
    if spec.public is None:
        raise SpecError("public", f"{method} needs a public unlabeled set U: add a [public] table "
                                  "(public.size or public.fraction)")


@torch.no_grad()
def predict_logits(model, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """model(x) in eval mode, batched, without gradients."""
    was_training = model.training
    model.eval()
    out = torch.cat([model(x[s : s + batch_size]) for s in range(0, len(x), batch_size)])
    model.train(was_training)
    return out


def predict(model: torch.nn.Module, x: torch.Tensor, temperature: float, batch_size: int = 1024) -> torch.Tensor:
    """Soft predictions softmax(model(x) / T)."""
    return F.softmax(predict_logits(model, x, batch_size) / temperature, dim=1)


def kl_to_target(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(target || softmax(logits / T)), averaged over the batch."""
    return F.kl_div(F.log_softmax(logits / temperature, dim=1), target, reduction="batchmean")


def distill(model, optimizer, x, targets, *, epochs, batch_size, temperature, generator, extra_term=None):
    """Fit ``model`` to soft ``targets`` on ``x`` (mini-batch KL), plus an optional term."""
    model.train()
    n = len(x)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            xb = x[idx]
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = kl_to_target(logits, targets[idx].float(), temperature)
            if extra_term is not None:
                loss = loss + extra_term(model, xb, logits)
            loss.backward()
            optimizer.step()


class PublicPredictionMethod(Plugin):
    """Base: per-client models, predictions on U up, per-client targets on U down."""

    Params = CodistillParams

    @hookimpl
    def check_spec(self, spec):
        require_public(spec, self.name)

    # -- server -> client -------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        targets = ctx.server.get("targets", {}).get(client_id)
        return {} if targets is None else {"targets": targets}

    # -- client -----------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = load_personal(ctx, client)
        if "targets" in message:
            self.client_distill(ctx, client, model, message["targets"])
        return True

    def client_distill(self, ctx, client, model, targets):
        p = self.params
        distill(model, client.optimizer(), ctx.data.public.x, targets, epochs=p.distill_epochs,
                batch_size=p.distill_batch_size, temperature=p.temperature,
                generator=client.generator("distill"), extra_term=self.client_regulariser(ctx, client))

    def client_regulariser(self, ctx, client):
        return None

    @hookimpl
    def local_train(self, ctx, client):
        epochs = self.params.pretrain_epochs if ctx.round == 1 else ctx.spec.training.local_epochs
        metrics = client.train(epochs=epochs)
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        soft = predict(client.model, ctx.data.public.x, self.params.temperature)
        return {"soft_labels": soft.to(DTYPES[self.params.label_dtype])}

    # -- evaluation -------------------------------------------------------------------

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": load_personal(ctx, client)}

    @staticmethod
    def collect_predictions(uploads) -> dict[int, torch.Tensor]:
        return {i: message["soft_labels"].float() for i, message in uploads}


def mean_l1_distances(predictions: torch.Tensor) -> torch.Tensor:
    """d(i, j) = mean over U of ||p_i(x) - p_j(x)||_1, in [0, 2] (scale-free in |U|).

    ``predictions``: (clients, |U|, C) probabilities.
    """
    n = predictions.shape[0]
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        out[i] = (predictions - predictions[i]).abs().sum(dim=2).mean(dim=1).double()
    return out


def positive_or_auto(_instance, attribute, value):
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0) or value != value:
        raise FieldError(attribute.name, f'must be a number > 0 or "auto", got {value!r}')


def as_any(value: Any) -> Any:
    return value
