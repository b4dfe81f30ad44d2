"""Issue 23: what SCAFFOLD needed from the plugin API, checked on its own.

- ``adjust_gradients``: called in every step of ``client.train`` between ``backward()`` and
  ``optimizer.step()`` (a hand-computed SGD step), asked once per training call, never when
  nothing implements it, and the batched executor steps aside for it;
- ``client.steps``: the round's optimiser steps, what ``budget.private_steps`` adds up;
- ``client.staged``: merged into the client's state when its upload arrives, dropped when it
  is lost (``dropout``) or the client is skipped (non-finite), on every executor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import linear, prepared
from test_faults import seeded_lost
from tiny import tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.execution.batched import why_not_batched
from pfl_core.runtime.training import batch_order, batch_starts, run_epochs

LINEAR = {"model.params.hidden": [], "experiment.rounds": 1}


def add_plugins(raw, *plugins):
    """An engine for ``raw`` whose run also registers ``plugins`` (before the add-ons)."""
    resolved = resolve(raw)
    for plugin in plugins:
        resolved.plugins.insert(0, plugin)
    return Engine(resolved, progress=False)


# -- adjust_gradients ------------------------------------------------------------------------

def test_run_epochs_calls_before_step_between_backward_and_step():
    """One full-batch SGD step on a linear model: w <- w - lr (grad + 1) when the hook adds 1."""
    model = linear([1.0, -1.0], [0.0])
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])
    seen = []

    def before_step():
        seen.append([p.grad.clone() for p in model.parameters()])  # the gradient is there ...
        for p in model.parameters():
            p.grad.add_(1.0)

    def loss(model, xb, yb, out):
        return 0.5 * ((out - yb) ** 2).sum()

    run_epochs(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, epochs=1, batch_size=1, loss_fn=loss,
               shuffle=False, before_step=before_step)
    # out = 1 - 2 = -1, residual -4: grad w = -4 * (1, 2) = (-4, -8), grad b = -4
    assert [g.tolist() for g in seen[0]] == [[[-4.0, -8.0]], [-4.0]]
    # ... and the step used the changed one: w - 0.1 * (grad + 1)
    assert model.weight.detach()[0].tolist() == pytest.approx([1.3, -0.3])
    assert model.bias.detach().tolist() == pytest.approx([0.3])


class AddToGradients(Plugin):
    """Adds ``shift`` to every gradient of the client's model; counts its calls per client."""

    name = "add_to_gradients"

    def __init__(self, shift=0.0):
        super().__init__()
        self.shift, self.calls = shift, {}

    @hookimpl
    def adjust_gradients(self, ctx, client, model, optimizer):
        assert optimizer.param_groups[0]["params"][0] is next(model.parameters()) and ctx is client.ctx
        self.calls[(client.round, client.id)] = self.calls.get((client.round, client.id), 0) + 1
        for p in model.parameters():
            p.grad.add_(self.shift)


def test_client_train_steps_with_the_adjusted_gradient():
    """client.train with the hook = plain SGD whose every gradient is shifted by the constant."""
    shift = 0.5
    plugin = AddToGradients(shift)
    engine = add_plugins(tiny_raw(**LINEAR), plugin)
    ctx = engine.ctx = engine.prepare()
    ctx.round = 1
    client = ctx.client(0)
    model = client.model
    start = [p.detach().clone() for p in model.parameters()]
    client.train()
    # by hand: the same batches, plain SGD on cross-entropy, every gradient + shift
    reference = ctx.models.build("mlp")
    with torch.no_grad():
        for p, s in zip(reference.parameters(), start):
            p.copy_(s)
    optimizer = torch.optim.SGD(reference.parameters(), lr=ctx.spec.training.lr)
    data, training = client.data, ctx.spec.training
    order = batch_order(data.num_train, client.generator("train"), training.shuffle)
    steps = 0
    for begin in batch_starts(data.num_train, training.batch_size, training.drop_last):
        idx = order[begin:begin + training.batch_size]
        optimizer.zero_grad()
        F.cross_entropy(reference(data.train_x[idx]), data.train_y[idx]).backward()
        for p in reference.parameters():
            p.grad.add_(shift)
        optimizer.step()
        steps += 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert plugin.calls == {(1, 0): steps} and client.steps == steps
    unshifted = [p.detach().clone() for p in model.parameters()]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(unshifted, start))


def test_the_hook_is_asked_for_once_per_training_call_and_not_called_when_nobody_implements_it(monkeypatch):
    from pfl_core.runtime import context
    from pfl_core.runtime.context import Client

    _, ctx = prepared(**LINEAR)
    ctx.round = 1
    client = ctx.client(0)
    asked, handed = [], []
    original, loop = Client.gradient_adjuster, context.run_epochs
    monkeypatch.setattr(Client, "gradient_adjuster", lambda *a: asked.append(1) or original(*a))
    monkeypatch.setattr(context, "run_epochs", lambda *a, **k: handed.append(k["before_step"]) or loop(*a, **k))
    assert client.gradient_adjuster(client.model, client.optimizer()) is None
    client.train(epochs=3)
    assert len(asked) == 2 and client.steps > 3  # once above, once for train's 3 epochs of steps
    assert handed == [None]  # nothing implements it: the loop gets nothing to call


def test_every_step_of_every_participant_calls_the_hook_once_also_for_stragglers():
    plugin = AddToGradients()
    raw = tiny_raw(**{"experiment.rounds": 2, "addons": [{"name": "stragglers", "params": {"fraction": 0.5}}]})
    engine = add_plugins(raw, plugin)
    steps = {}
    original = engine._absorb

    def record(ctx, result):
        steps[(ctx.round, result.client_id)] = result.work.steps
        return original(ctx, result)

    engine._absorb = record
    engine.run()
    assert plugin.calls == steps and len(set(steps.values())) > 1  # some clients straggled


def test_the_batched_executor_steps_aside_for_a_gradient_hook():
    engine = add_plugins(tiny_raw(**{"algorithm.name": "fedavg"}), AddToGradients())
    ctx = engine.ctx = engine.prepare()
    reason = why_not_batched(ctx.client_view(), [0, 1])
    assert reason.startswith("adjust_gradients of add_to_gradients") and reason.endswith("changes the gradients")
    plain = Engine(resolve(tiny_raw()), progress=False)
    assert why_not_batched(plain.prepare().client_view(), [0, 1]) is None


# -- client.steps ----------------------------------------------------------------------------

class StepsAtUpload(Plugin):
    """Records ``client.steps`` as client_upload sees it (a wrapper: after the algorithm's)."""

    name = "steps_at_upload"

    def __init__(self):
        super().__init__()
        self.steps = {}

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.steps[(client.round, client.id)] = client.steps
        return upload


@pytest.mark.parametrize("algorithm, overrides", [
    ("fedavg", {"training.local_epochs": 2}),
    ("fedavg", {"addons": [{"name": "stragglers", "params": {"fraction": 0.7}}]}),
    ("ditto", {}),  # two models trained per round: both counted
])
def test_client_steps_at_upload_are_what_the_budget_adds_up(algorithm, overrides):
    spy = StepsAtUpload()
    engine = add_plugins(tiny_raw(**{"algorithm.name": algorithm, "experiment.rounds": 2, **overrides}), spy)
    result = engine.run()
    clients = len(engine.ctx.training_clients)
    assert result.final["budget.private_steps"] == sum(spy.steps.values()) / clients
    assert len(spy.steps) == 2 * clients and min(spy.steps.values()) > 0


# -- client.staged ---------------------------------------------------------------------------

class Stages(Plugin):
    """Each round each participant counts in its state ("kept") and stages a count ("staged")."""

    name = "stages"

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        client.state["kept"] = client.state.get("kept", 0) + 1
        client.staged["staged"] = client.state.get("staged", 0) + 1
        client.staged["last"] = torch.tensor([float(client.round)])
        return upload


def staged_run(executor="sequential", rounds=3, p=None, **overrides):
    addons = [{"name": "dropout", "params": {"p": p}}] if p is not None else []
    raw = tiny_raw(**{"experiment.rounds": rounds, "executor.name": executor, "addons": addons, **overrides})
    engine = add_plugins(raw, Stages())
    engine.run()
    return engine.ctx


def test_staged_state_is_kept_when_the_upload_arrives():
    ctx = staged_run()
    for i in ctx.training_clients:
        state = ctx.store[i]
        assert (state["kept"], state["staged"], state["last"].tolist()) == (3, 3, [3.0])


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_lost_upload_drops_the_staged_state_and_keeps_the_rest(executor):
    p, rounds = 0.5, 3
    ctx = staged_run(executor, rounds, p=p, **{"executor.workers": 2} if executor == "process" else {})
    lost = {r: seeded_lost(0, r, ctx.training_clients, p) for r in range(1, rounds + 1)}
    assert any(lost.values()) and not all(len(v) == len(ctx.training_clients) for v in lost.values())
    for i in ctx.training_clients:
        state = ctx.store[i]
        arrived = [r for r in range(1, rounds + 1) if i not in lost[r]]
        assert state["kept"] == rounds  # it trained every round: its own state moved on
        assert state.get("staged", 0) == len(arrived)
        if arrived:
            assert state["last"].tolist() == [float(arrived[-1])]


def test_every_upload_lost_leaves_no_staged_state():
    ctx = staged_run(p=1.0)
    for i in ctx.training_clients:
        assert ctx.store[i]["kept"] == 3 and "staged" not in ctx.store[i]


class NonFiniteUpload(Plugin):
    """Client ``bad`` stages a value, then sends a NaN (an update that diverged after training)."""

    name = "nonfinite_upload"

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        if client.id == self.bad:
            client.staged["staged"] = 99
            return {**upload, "oops": torch.tensor([float("nan")])}
        return upload


def test_a_skipped_client_keeps_no_staged_state():
    """training.on_nonfinite = "skip_client": the round never happened for the diverged client."""
    bad = 2
    raw = tiny_raw(**{"experiment.rounds": 2, "training.on_nonfinite": "skip_client", "executor.name": "sequential"})
    engine = add_plugins(raw, NonFiniteUpload(bad), Stages())  # Stages is inner: it runs first
    engine.run()
    assert engine.ctx.store[bad].get("staged") is None and "kept" not in engine.ctx.store[bad]
    assert all(engine.ctx.store[i]["staged"] == 2 for i in engine.ctx.training_clients if i != bad)
