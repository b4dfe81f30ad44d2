"""The plain local training loop every method reuses, and optimiser construction."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.errors import NonFiniteError
from pfl_core.spec import TrainingSection
from pfl_core.spec.validators import ADAM_BETAS, optimizer_step_problem

# ``loss_fn(model, x, y, logits) -> scalar tensor``: the whole loss of one mini-batch (``x`` its
# inputs, ``y`` its labels, ``logits = model(x)``), the value ``backward()`` is called on.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_optimizer(params: Iterable[torch.nn.Parameter], training: TrainingSection, lr: float | None = None):
    lr = training.lr if lr is None else lr
    problem = optimizer_step_problem(training.optimizer, lr, training.momentum)
    if problem:  # a plugin's own step size (the spec's training.lr was checked when it was read)
        raise NonFiniteError(f"a learning rate of {problem}")
    if training.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, weight_decay=training.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=training.momentum, weight_decay=training.weight_decay)


def reset_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Forget momentum/Adam moments so a reused optimiser starts fresh for the next client."""
    optimizer.state.clear()
    return optimizer


def batch_order(n: int, generator: torch.Generator | None, shuffle: bool) -> torch.Tensor:
    return torch.randperm(n, generator=generator) if shuffle else torch.arange(n)


def batch_starts(n: int, batch_size: int, drop_last: bool) -> range:
    """Start index of every mini-batch of an epoch over n samples.

    With ``drop_last`` the epoch's last partial batch is skipped: a step on 1-2 samples at the
    full learning rate is a high-variance step that measurably hurt small clients (docs/
    spec-reference.md, ``training.drop_last``). Shuffling changes which samples are left out
    each epoch. A client with fewer samples than one batch still trains on its one partial
    batch, so no client is silently left untrained.
    """
    if drop_last and n >= batch_size:
        return range(0, n - n % batch_size, batch_size)
    return range(0, n, batch_size)


def run_epochs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    loss_fn: LossFn,
    generator: torch.Generator | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    counter=None,
    take_batch: Callable[[], bool] | None = None,
    before_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Mini-batch training over (x, y) sliced by index: no DataLoader, no copies of the data.

    Each step's loss is ``loss_fn(model, xb, yb, model(xb))`` and nothing else (``Client.train``
    passes ``client.objective``, the sum of every ``local_objective`` term, unless given one).
    ``counter(samples)`` is told n after every epoch (work accounting: an epoch is one pass
    over the n samples, its dropped remainder included). ``take_batch()`` is asked before
    every step (``Client.take_batch``, a straggler's batch budget): False stops the training
    there, and the partial epoch counts only the samples of the batches it ran.
    ``before_step()`` is called between ``backward()`` and ``optimizer.step()`` when given
    (``Client.gradient_adjuster``: the ``adjust_gradients`` hook).
    """
    model.train()
    n = len(y)
    total = torch.zeros(())
    steps = 0
    for _ in range(epochs):
        order = batch_order(n, generator, shuffle)
        seen = 0
        for start in batch_starts(n, batch_size, drop_last):
            if take_batch is not None and not take_batch():
                if counter is not None and seen:
                    counter(seen)
                return mean_training_loss(total, steps)
            idx = order[start : start + batch_size]
            seen += len(idx)
            xb, yb = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = loss_fn(model, xb, yb, logits)
            loss.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            total += loss.detach().cpu()
            steps += 1
        if counter is not None:
            counter(n)
    return mean_training_loss(total, steps)


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy as a ``run_epochs`` loss: a server-side classifier trained on labelled
    features (CCVR's calibration, FedGH's header)."""
    return F.cross_entropy(logits, y)


def add_to_gradients(model: nn.Module, shifts: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    """``p.grad += scale * shifts[name]`` for every parameter of ``model`` that got a gradient:
    a gradient correction in ``adjust_gradients`` (SCAFFOLD's c - c_i, FedDyn's linear term)."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            p.grad.add_(shifts[name], alpha=scale)


def mean_training_loss(losses, steps: int | None = None) -> dict[str, float]:
    """``{"train_loss": mean}`` of a list of step losses (or of their ``total`` over ``steps``);
    {} when no step ran. A non-finite loss stops the run (NonFiniteError: the engine names the
    round, client and fix)."""
    if steps is None:
        steps = len(losses)
        losses = torch.stack(losses).sum() if steps else losses
    if not steps:
        return {}
    mean = float(losses) / steps
    if not math.isfinite(mean):
        raise NonFiniteError(f"the training loss became {mean}")
    return {"train_loss": mean}
