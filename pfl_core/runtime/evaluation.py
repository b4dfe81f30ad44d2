"""Evaluation: every client's personalized model on its own test split, batched."""

from __future__ import annotations

import functools

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.runtime.context import Client
from pfl_core.runtime.precision import precision_autocast
from pfl_core.seeding import numpy_rng, seed_torch


@attrs.frozen
class Score:
    correct: int
    loss_sum: float
    count: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")


@torch.no_grad()
def score(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> Score:
    """Accuracy and summed cross-entropy of ``model`` on (x, y), in eval mode."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return Score(correct, loss_sum, len(y))


def summarize(accuracies: list[float], losses: list[float], prefix: str = "") -> dict[str, float]:
    """The metrics logged per evaluation round (docs/metrics.md)."""
    acc = np.asarray(accuracies, dtype=float)
    return {
        f"{prefix}acc_mean": float(acc.mean()),
        f"{prefix}acc_std": float(acc.std()),
        f"{prefix}acc_p10": float(np.percentile(acc, 10)),
        f"{prefix}loss_mean": float(np.mean(losses)),
    }


def evaluated_models(ctx, client) -> dict[str, nn.Module]:
    """``personalized_models`` for one client: the server's ``evaluation_message`` for it
    (computed with the run context ``ctx``; not counted as communication), then the client-side
    hook with the client's own context (``client.ctx``: a :class:`ClientView` in evaluation)."""
    message = ctx.hooks.evaluation_message(ctx=ctx, client_id=client.id)
    return ctx.hooks.personalized_models(ctx=client.ctx, client=client, message=message)


def coldstart_models(ctx, client) -> dict[str, nn.Module]:
    """``coldstart_personalize`` for one held-out client, under its cold-start seed: the
    server's broadcast to it (``ctx.broadcast``: bytes counted down), then the client-side hook
    with the client's own context."""
    seed_torch(ctx.seed_for("coldstart", client.id))
    message = ctx.broadcast(client.id)
    return ctx.hooks.coldstart_personalize(ctx=client.ctx, client=client, message=message)


@attrs.define
class EvaluationTask:
    """One client's evaluation, as the server hands it to an executor."""

    client_id: int
    message: dict | None  # the server's evaluation_message (None: ``models_for`` builds the models)
    state: dict
    split: str
    batch_size: int

    def __str__(self) -> str:  # how a failed item is named in errors
        return f"the evaluation of client {self.client_id}"


def evaluate_client(view, task: EvaluationTask, models_for=None) -> tuple[dict, dict, list, list, int]:
    """The client side of one evaluation: build the model(s) and score them on the client's own
    split. Runs wherever the executor puts it; returns (row, {prefix: Score}, logged, resolved,
    the optimiser steps of any fine-tuning before scoring)."""
    client = Client(view, task.client_id, state=task.state)
    with precision_autocast(view.spec.training, view.device):  # any fine-tuning before scoring too
        if models_for is None:
            models = view.hooks.personalized_models(ctx=view, client=client, message=task.message)
        else:
            models = models_for(client)
    if not models:
        raise RuntimeError("no plugin answered personalized_models: the algorithm must say which model to evaluate")
    x = getattr(client.data, f"{task.split}_x")
    y = getattr(client.data, f"{task.split}_y")
    row = {"client": task.client_id, "arch": client.arch, "num_train": client.num_train, f"num_{task.split}": len(y)}
    scores = {}
    for model_prefix, model in models.items():
        with precision_autocast(view.spec.training, view.device):
            scores[model_prefix] = s = score(model, x, y, task.batch_size)
        row[f"{model_prefix}acc"] = s.accuracy
        row[f"{model_prefix}loss"] = s.loss
    logged, resolved = view.take_reports()
    return row, scores, logged, resolved, client.work.steps  # the steps of fine-tuning before scoring


MANY_TO_EVALUATE = 10_000  # training clients above which evaluating them all is said: hours at a million


def evaluation_sample(ctx, note=None) -> list[int] | None:
    """The training clients every evaluation of this run scores when ``evaluation.clients`` is
    fewer than them: a sample drawn once from ``experiment.seed`` alone (the same clients at every
    round, in every sweep point and on resume), sorted; None: all of them. A sample is said, as
    its metrics are not over every client: ``note(text)`` (the engine's stderr line) and the
    run's tag ``pfl.evaluation_sample``."""
    wanted, pool = ctx.spec.evaluation.clients, ctx.training_clients
    if wanted == 0 and len(pool) > MANY_TO_EVALUATE and note is not None:
        note(f"every evaluation scores all {len(pool)} training clients (evaluation.clients = 0); "
             f"evaluation.clients = N scores a fixed sample of N instead")
    if wanted == 0 or wanted >= len(pool):
        return None
    chosen = numpy_rng(ctx.spec.experiment.seed, "evaluation_clients").choice(len(pool), size=wanted, replace=False)
    share = f"{wanted} of {len(pool)} clients"
    if note is not None:
        note(f"evaluation metrics are over a sample of {share} (evaluation.clients = {wanted}), the same clients "
             "at every evaluation")
    if ctx.tracker is not None:
        ctx.tracker.set_tag("pfl.evaluation_sample", share)
    return sorted(int(pool[i]) for i in chosen)


def evaluate_clients(ctx, split: str = "test", client_ids=None, models_for=None,
                     prefix: str = "") -> tuple[dict[str, float], list[dict]]:
    """Evaluate each client's personalized model(s) on its own ``split``.

    ``client_ids`` defaults to the training clients. By default each client's part
    (``personalized_models`` with the server's ``evaluation_message`` for it, then scoring)
    runs through the run's executor, in parallel where it has workers; ``models_for(client)``
    instead builds the models in this process (cold start: it broadcasts, server side).
    Returns the summary metrics (per model prefix, each prefixed again by ``prefix``) and one
    row per client.
    """
    batch_size = ctx.spec.evaluation.batch_size
    client_ids = ctx.training_clients if client_ids is None else client_ids
    view = ctx.client_view()  # the client-side part sees what a round's client hooks see
    if models_for is None:
        tasks = (EvaluationTask(cid, ctx.hooks.evaluation_message(ctx=ctx, client_id=cid), ctx.store[cid], split,
                                batch_size) for cid in client_ids)
        results = ctx.executor.map(functools.partial(evaluate_client, view), tasks)
    else:
        results = (evaluate_client(view, EvaluationTask(cid, None, ctx.store[cid], split, batch_size), models_for)
                   for cid in client_ids)
    per_prefix: dict[str, tuple[list[float], list[float]]] = {}
    rows = []
    for row, scores, logged, resolved, finetune_steps in results:
        ctx.finetune_steps += finetune_steps
        for logged_id, values in logged:  # as the engine does with a round's client
            ctx.log_client(logged_id, **values)
        for name, value in resolved:
            ctx.resolved_value(name, value)
        for model_prefix, s in scores.items():
            accs, losses = per_prefix.setdefault(model_prefix, ([], []))
            accs.append(s.accuracy)
            losses.append(s.loss)
        rows.append(row)
    metrics: dict[str, float] = {}
    for model_prefix, (accs, losses) in per_prefix.items():
        metrics.update(summarize(accs, losses, prefix + model_prefix))
    return metrics, rows
