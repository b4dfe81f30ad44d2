"""The client side of a round: receive, train, upload.

What an executor runs for each participant, touching only the task (the message and the
client's own state) and the read-only ``ClientView`` (docs/architecture.md, "The client-side
contract"). It sits below the executors, which only move tasks and results.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from pfl_core.errors import NonFiniteError
from pfl_core.runtime.context import Client
from pfl_core.runtime.precision import precision_autocast
from pfl_core.seeding import seed_torch


@attrs.define
class ClientTask:
    """One participant's work item: what the server hands an executor."""

    round: int
    client_id: int
    message: dict
    state: dict
    skip: bool = False  # training.on_nonfinite = "skip_client"

    def __str__(self) -> str:  # how a failed item is named in errors
        return f"client {self.client_id} in round {self.round}"


@attrs.define
class ClientResult:
    """What comes back from one participant: its upload and what the server must record."""

    client_id: int
    upload: dict | None
    state: dict
    work: Any
    train_loss: float | None = None
    logged: list = attrs.Factory(list)  # client.log(...) calls: (client_id, {name: value})
    resolved: list = attrs.Factory(list)  # ctx.resolved_value(...) calls
    diverged: str | None = None  # the NonFiniteError's text
    staged: dict = attrs.Factory(dict)  # client.staged: merged into its state only if the upload arrives


def run_client(view, task: ClientTask) -> ClientResult:
    """The client side of a round: receive, train, upload. Runs wherever the executor puts it,
    touching only the task (message and the client's state) and the read-only ``view``."""
    hooks = view.hooks
    seed_torch(view.seed_for("client", task.client_id))  # dropout etc.: order-independent
    client = Client(view, task.client_id, state=task.state)
    before = copy_payload(dict(client.state)) if task.skip else None
    upload, train_loss, diverged = None, None, None
    try:
        with precision_autocast(view.spec.training, view.device):  # a method may train on receipt (codistillation)
            hooks.on_receive(ctx=view, client=client, message=task.message)
            train_metrics = hooks.local_train(ctx=view, client=client)
        if train_metrics and "train_loss" in train_metrics:
            train_loss = float(train_metrics["train_loss"])
        upload = float32_upload(hooks.client_upload(ctx=view, client=client))
        check_finite(upload)
    except (NonFiniteError, RuntimeError) as exc:
        if not isinstance(exc, NonFiniteError) and not is_overflow(exc):
            raise
        diverged = str(exc) if isinstance(exc, NonFiniteError) else f"a step left float32's range (torch: {exc})"
        upload = None
        if task.skip:  # the round never happened for this client
            client.state.clear()
            client.state.update(before)
    if task.skip and upload is not None:
        upload = copy_payload(upload)  # kept until every client ran
    logged, resolved = view.take_reports()
    staged = client.staged if upload is not None else {}  # a diverged client's round never happened
    return ClientResult(task.client_id, upload, client.state, client.work, train_loss, logged, resolved, diverged,
                        staged)


def float32_upload(payload):
    """``payload`` with every bfloat16 tensor in it as float32: what a bf16 run's client computed
    under autocast (prototypes, predictions kept from training) is aggregated in float32, and
    counted as the same bytes as in an fp32 run. Anything else is returned as it is."""
    if isinstance(payload, torch.Tensor):
        return payload.float() if payload.dtype == torch.bfloat16 else payload
    if isinstance(payload, dict):
        return {k: float32_upload(v) for k, v in payload.items()} if _holds_bf16(payload) else payload
    if isinstance(payload, (list, tuple)) and not hasattr(payload, "_fields") and _holds_bf16(payload):
        return type(payload)(float32_upload(v) for v in payload)
    return payload


def _holds_bf16(payload) -> bool:
    if isinstance(payload, torch.Tensor):
        return payload.dtype == torch.bfloat16
    if isinstance(payload, dict):
        return any(_holds_bf16(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return any(_holds_bf16(v) for v in payload)
    return False


def is_overflow(exc: BaseException) -> bool:
    """Whether torch refused a scalar beyond its tensor's float range (a step size a method
    derived from its parameters, e.g. ``alpha=lr * scale``): the update diverged before it was
    taken, so it is reported as divergence, not as an internal error."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "cannot be converted to type" in text and "without overflow" in text


def check_finite(payload) -> None:
    """Raise NonFiniteError if any floating tensor in a message holds NaN or inf."""
    if isinstance(payload, torch.Tensor):
        if payload.is_floating_point() and not bool(torch.isfinite(payload).all()):
            raise NonFiniteError("a sent parameter became NaN or infinite")
    elif isinstance(payload, dict):
        for value in payload.values():
            check_finite(value)
    elif isinstance(payload, (list, tuple)):
        for value in payload:
            check_finite(value)


def copy_payload(payload):
    """A copy whose tensors no longer share memory with the working models (dicts, lists and
    tuples copied; other values as they are)."""
    if isinstance(payload, torch.Tensor):
        return payload.detach().clone()
    if isinstance(payload, dict):
        return {k: copy_payload(v) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return type(payload)(copy_payload(v) for v in payload) if not hasattr(payload, "_fields") else payload
    try:  # numpy arrays and other mutable values a plugin keeps
        return copy.deepcopy(payload)
    except Exception:
        return payload
