"""Issue 35, item 3: ``task_loss`` replaces the core's cross-entropy while every other
``local_objective`` term (FedProx's proximal term) still applies; ``loss_fn`` replaces the whole
loss; no ``task_loss`` plugin leaves the loss bit for bit as it was. The FedLC add-on under test
is the one docs/writing-a-plugin.md shows, executed from the guide itself."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_raw

from pfl_core import registry
from pfl_core.engine import Engine, resolve
from pfl_core.execution.batched import why_not_batched
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.context import load_state

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md"
LINEAR = {"model.params.hidden": [], "experiment.rounds": 1, "executor.name": "sequential"}


def guide_fedlc():
    """The FedLC add-on class exactly as the guide writes it."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    (source,) = [b for b in blocks if "class FedLC(Plugin)" in b]
    namespace: dict = {}
    exec(compile(source, f"{GUIDE}:FedLC", "exec"), namespace)  # noqa: S102 (the guide's own code)
    return namespace["FedLC"]


def fedlc(tau: float):
    cls = guide_fedlc()
    return cls(cls.Params(tau=tau))


def prepared_with(*plugins, **overrides):
    """An engine prepared (setup run) with ``plugins`` registered as add-ons, listed first to last."""
    resolved = resolve(tiny_raw(**{**LINEAR, **overrides}))
    for plugin in reversed(plugins):
        resolved.plugins.insert(0, plugin)
    engine = Engine(resolved, progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def received(ctx, client_id: int = 0):
    client = ctx.client(client_id)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=client_id))
    return client


# -- FedLC's calibrated cross-entropy by hand ---------------------------------------------


def test_guide_fedlc_calibrates_logits_by_hand():
    # counts (16, 1), tau = 1: offsets 16^(-1/4) = 0.5 and 1^(-1/4) = 1
    client = SimpleNamespace(data=SimpleNamespace(label_counts=lambda: [16, 1]))
    logits = torch.zeros(1, 2)
    loss = fedlc(1.0).task_loss(ctx=None, client=client, logits=logits, y=torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.5)), abs=1e-6)  # -log(e^-.5 / (e^-.5 + e^-1))
    loss = fedlc(1.0).task_loss(ctx=None, client=client, logits=logits, y=torch.tensor([1]))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(0.5)), abs=1e-6)
    # an absent class counts as one sample: finite, and tau = 0 is the plain cross-entropy exactly
    absent = SimpleNamespace(data=SimpleNamespace(label_counts=lambda: [3, 0]))
    logits = torch.tensor([[0.3, -1.2]])
    assert torch.isfinite(fedlc(2.0).task_loss(ctx=None, client=absent, logits=logits, y=torch.tensor([0])))
    assert torch.equal(fedlc(0.0).task_loss(ctx=None, client=absent, logits=logits, y=torch.tensor([0])),
                       F.cross_entropy(logits, torch.tensor([0])))


# -- through the engine: the task loss is replaced, the proximal term is still added ---------


def test_task_loss_replaces_cross_entropy_and_the_proximal_term_is_still_added():
    _, ctx = prepared_with(fedlc(1.0), **{"algorithm.name": "fedprox", "algorithm.params.mu": 0.5})
    client = received(ctx)
    model = client.model
    with torch.no_grad():
        model.fc1.weight.add_(0.1)  # 0.1 from the global model in each of its 200 weights
    assert model.fc1.weight.numel() == 200
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    logits = model(x)
    counts = torch.bincount(client.data.train_y, minlength=ctx.num_classes).float()
    offsets = 1.0 * counts.clamp_min(1) ** -0.25
    proximal = 0.5 / 2 * 200 * 0.01
    calibrated = F.cross_entropy(logits - offsets, y).item()
    plain = F.cross_entropy(logits, y).item()
    assert abs(calibrated - plain) > 1e-3  # the two are told apart
    assert client.objective(model, x, y, logits).item() == pytest.approx(calibrated + proximal, rel=1e-5)


def test_without_a_task_loss_plugin_the_loss_is_bit_identical():
    _, ctx = prepared_with(**{"algorithm.name": "local"})
    client = received(ctx)
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    logits = client.model(x)
    assert torch.equal(client.objective(client.model, x, y, logits), F.cross_entropy(logits, y))

    start = {k: v.clone() for k, v in client.model.state_dict().items()}

    def trained(**kwargs):
        load_state(client.model, start)
        client.train(**kwargs)
        return {k: v.clone() for k, v in client.model.state_dict().items()}

    default = trained()
    plain = trained(loss_fn=lambda model, x, y, logits: F.cross_entropy(logits, y))  # the loop before the hook
    for key, value in plain.items():
        assert torch.equal(default[key], value), key
    assert any(not torch.equal(default[k], start[k]) for k in start)  # it did train


class Answer(registry.Plugin):
    """An add-on whose ``task_loss`` answers ``value`` (None: defers)."""

    kind = registry.ADDON

    def __init__(self, name, value):
        super().__init__()
        self.name, self.value, self.asked = name, value, 0

    @hookimpl
    def task_loss(self, ctx, client, logits, y):
        self.asked += 1
        return None if self.value is None else torch.tensor(self.value)


def test_the_first_non_none_answer_wins_and_none_defers():
    first, second = Answer("first", 7.0), Answer("second", None)
    _, ctx = prepared_with(first, second, **{"algorithm.name": "fedavg"})
    client = received(ctx)
    x, y = client.data.train_x[:4], client.data.train_y[:4]
    logits = client.model(x)
    assert client.objective(client.model, x, y, logits).item() == 7.0  # the last listed defers to the first
    assert (first.asked, second.asked) == (1, 1)

    _, ctx = prepared_with(Answer("first", 7.0), Answer("second", 3.0), **{"algorithm.name": "fedavg"})
    client = received(ctx)
    assert client.objective(client.model, x, y, logits).item() == 3.0  # the last listed is asked first

    _, ctx = prepared_with(Answer("only", None), **{"algorithm.name": "fedavg"})
    client = received(ctx)
    assert torch.equal(client.objective(client.model, x, y, logits), F.cross_entropy(logits, y))


def test_loss_fn_replaces_the_task_loss_and_every_term():
    _, ctx = prepared_with(Answer("seven", 7.0), **{"algorithm.name": "fedprox", "algorithm.params.mu": 0.5})
    client = received(ctx)
    with torch.no_grad():
        client.model.fc1.weight.add_(0.1)
    seen = []

    def only_this(model, x, y, logits):
        loss = F.cross_entropy(logits, y)
        seen.append(loss.item())
        return loss

    metrics = client.train(epochs=1, loss_fn=only_this)
    assert metrics["train_loss"] == pytest.approx(sum(seen) / len(seen), rel=1e-5)  # no 7, no proximal term
    assert client.ctx.hooks is ctx.hooks and all(v < 7.0 for v in seen)


def test_a_task_loss_plugin_trains_clients_one_after_another_under_batched():
    _, ctx = prepared_with(**{"algorithm.name": "fedavg"})
    assert why_not_batched(ctx, [0, 1]) is None
    _, ctx = prepared_with(fedlc(1.0), **{"algorithm.name": "fedavg"})
    assert why_not_batched(ctx, [0, 1]) == "task_loss of fedlc_loss#0 replaces the cross-entropy"


def test_a_run_with_the_guide_fedlc_trains_on_the_calibrated_loss():
    """A whole round: FedLC's global model differs from FedAvg's, and tau = 0 is FedAvg exactly."""
    def run(*plugins):
        resolved = resolve(tiny_raw(**LINEAR))
        resolved.plugins[:0] = list(plugins)
        engine = Engine(resolved, progress=False)
        engine.run()
        return engine.ctx.server["global"]

    base_global = run()
    zero_global = run(fedlc(0.0))
    calibrated_global = run(fedlc(1.0))
    for key, value in base_global.items():
        assert torch.equal(zero_global[key], value), key
    assert any(not torch.equal(calibrated_global[k], v) for k, v in base_global.items())
