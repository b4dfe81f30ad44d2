"""Shared machinery for methods whose clients exchange soft predictions on the public set U
(COSMOS, COMET): model-agnostic, every client keeps its own model of its own architecture.

One round, as every such method runs it here::

    client i:  distil from the targets the server sent last round (none in round 1):
                   distill_epochs epochs of KL(target || f_i) on U    (+ a method's term)
               train on D_i: pretrain_epochs (E0) in the client's first round,
                   finetune_epochs (default training.local_epochs) in every later one
               send f_i(U) = softmax(f_i(x) / T) for x in U        (float32 or float16)
    server:    method-specific: turn the predictions into each client's next targets

The client-side distillation of round t's targets happens at the start of round t + 1's
client work, which is where the next local step starts from it anyway (COSMOS's
f_i^(t,2) -> f_i^(t+1,1)); evaluation after round t therefore scores f_i^(t,1), and the
targets of the last round are never distilled.

Budget (``local_work``): the first round trains E0 epochs *instead of* a round's
fine-tuning and distils nothing, so over R rounds a client does E0 + (R - 1) * finetune
private epochs and (R - 1) * distill_epochs public ones; declared as per-round work plus a
first-round correction (E0 - finetune private, -distill_epochs public; these can be
negative). The distillation loop counts its samples with ``client.count_work(public=...)``;
the consistency term's augmented forward passes are not counted as extra samples.

Devices: data, models and predictions live on ``ctx.device``; every random draw uses a
seeded CPU ``torch.Generator`` (batch order, augmentations) and is moved to the data's
device afterwards, so CPU results are bit-identical to the pre-device-clean code and a
CUDA run draws the same numbers. Anything turned into numpy goes through ``.cpu()`` first.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.errors import SpecError
from pfl_core.methods.personal import load_personal
from pfl_core.registry import Plugin
from pfl_core.registry.budget import LocalWork
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.context import clone_state
from pfl_core.runtime.training import run_epochs
from pfl_core.spec import at_least, finite, greater_than, one_of

DTYPES = {"float32": torch.float32, "float16": torch.float16}


@define
class CodistillParams:
    pretrain_epochs: int = field(default=5, validator=at_least(0), metadata={
        "doc": "E0: epochs on D_i in the client's first round only (instead of finetune_epochs)"})
    finetune_epochs: Optional[int] = field(default=None, validator=at_least(0), metadata={
        "doc": "local fine-tuning epochs on D_i in every later round; none: training.local_epochs"})
    distill_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs of the client's distillation on U from the server's targets, a round"})
    temperature: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "T: the uploaded predictions are softmax(f_i(x) / T); the distillation uses the same T"})
    label_dtype: str = field(default="float32", validator=one_of(*DTYPES), metadata={
        "doc": "precision of the uploaded predictions (float16 halves the bytes)"})
    distill_batch_size: int = field(default=64, validator=at_least(1),
                                    metadata={"doc": "batch size of every distillation on U"})


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


def distill(model, optimizer, x, targets, *, epochs, batch_size, temperature, generator, extra_term=None,
            drop_last=False, counter=None, take_batch=None):
    """Fit ``model`` to soft ``targets`` on ``x``: mini-batch KL(target || model), plus an
    optional ``extra_term(model, xb, logits)``; pfl's shared loop (``run_epochs``) with the
    targets in place of labels. ``counter(samples)`` is told each step's batch size;
    ``take_batch`` is a client's batch budget (``Client.take_batch``)."""

    def loss(model, xb, target, logits):
        value = kl_to_target(logits, target.float(), temperature)
        return value if extra_term is None else value + extra_term(model, xb, logits)

    return run_epochs(model, optimizer, x, targets, epochs=epochs, batch_size=batch_size, loss_fn=loss,
                      generator=generator, drop_last=drop_last, counter=counter, take_batch=take_batch)


class PublicPredictionMethod(Plugin):
    """Base: per-client models, predictions on U up, per-client targets on U down."""

    Params = CodistillParams

    @hookimpl
    def check_spec(self, spec):
        require_public(spec, self.name)

    def finetune_epochs(self, spec) -> int:
        p = self.params
        return spec.training.local_epochs if p.finetune_epochs is None else p.finetune_epochs

    def local_work(self, spec) -> LocalWork:
        """E0 in the first round instead of a round's fine-tuning, no distillation before it."""
        p, finetune = self.params, self.finetune_epochs(spec)
        return LocalWork(private_epochs_per_round=float(finetune), public_epochs_per_round=float(p.distill_epochs),
                         pretrain_private_epochs=float(p.pretrain_epochs - finetune),
                         pretrain_public_epochs=-float(p.distill_epochs))

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
        """``distill_epochs`` epochs of KL(target || f_i) on U, w_i(x) = 1."""
        p = self.params
        return distill(model, client.optimizer(), ctx.data.public.x, targets, epochs=p.distill_epochs,
                       batch_size=p.distill_batch_size, temperature=p.temperature,
                       generator=client.generator("distill"), drop_last=ctx.spec.training.drop_last,
                       counter=lambda n: client.count_work(public=n), take_batch=lambda: client.take_batch("public"))

    @hookimpl
    def local_train(self, ctx, client):
        first = "weights" not in client.state  # never trained: pre-training (E0), then the first upload
        epochs = self.params.pretrain_epochs if first else self.finetune_epochs(ctx.spec)
        metrics = client.train(epochs=epochs)
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        soft = predict(client.model, ctx.data.public.x, self.params.temperature)
        return {"soft_labels": soft.to(DTYPES[self.params.label_dtype])}

    # -- evaluation -------------------------------------------------------------------

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}

    @staticmethod
    def collect_predictions(uploads) -> dict[int, torch.Tensor]:
        return {i: message["soft_labels"].float() for i, message in uploads}


def mean_l1_distances(predictions: torch.Tensor) -> torch.Tensor:
    """d(i, j) = mean over U of ||p_i(x) - p_j(x)||_1, in [0, 2] (scale-free in |U|).

    ``predictions``: (clients, |U|, C) probabilities, on any device; the result is on the CPU.
    """
    n = predictions.shape[0]
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        out[i] = (predictions - predictions[i]).abs().sum(dim=2).mean(dim=1).double().cpu()
    return out
