"""Simulated client faults (plugins/faults): dropout of uploads and stragglers' partial work.

The expected draws are written out from the documented seeding (``numpy_rng(seed, purpose,
round, client)``), not taken from the plugin, so a plugin drawing from another stream, a
shared stream or in another order fails here.
"""

import math

import pytest
import torch
from harness import assert_close, mean_of, prepared, shrink, train_reference
from test_core_loop import NEEDS, builtin_algorithms
from tiny import run_tiny, tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.runtime.training import batch_starts, run_epochs
from pfl_core.seeding import numpy_rng

DROPOUT = "dropout"
STRAGGLERS = "stragglers"


def addon(name, **params):
    return {"addons": [{"name": name, "params": params}]}


def seeded_lost(seed, round, clients, p):
    return {i for i in clients if numpy_rng(seed, "dropout", round, i).random() < p}


def seeded_budget(seed, round, client, fraction, full):
    """None (does all its work) or the straggler's batch budget, uniform in 1 .. full - 1."""
    rng = numpy_rng(seed, "stragglers", round, client)
    if not rng.random() < fraction:
        return None
    return int(rng.integers(1, max(full - 1, 1), endpoint=True))


class Spy(Plugin):
    """Records, per round, the participants, the weights the aggregate got (keyed by the
    clients whose uploads reach it), and each client's training steps."""

    name = "spy"

    def __init__(self):
        super().__init__()
        self.participants, self.weights, self.steps = {}, {}, {}

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        self.participants[round] = list(participants)

    @hookimpl(wrapper=True)
    def server_aggregate(self, ctx, uploads, weights):
        self.weights[ctx.round] = dict(weights)  # the engine renormalises over the arrivals
        return (yield)

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        key = (client.round, client.id)
        self.steps[key] = self.steps.get(key, 0) + 1
        return torch.zeros(())


def run_with_spy(**overrides):
    resolved = resolve(tiny_raw(**overrides))
    spy = Spy()
    resolved.plugins.insert(0, spy)
    engine = Engine(resolved, progress=False)
    return engine.run(), engine, spy


def comparable(history):
    return [{k: v for k, v in h.items() if not k.endswith("seconds") and k != "dropped_clients"} for h in history]


# -- dropout ---------------------------------------------------------------------------------


def test_dropout_with_p_zero_is_identical_to_no_addon():
    # The filtered path (every client first, uploads copied) must aggregate exactly what the
    # streamed path does: same uploads, same order, same weights, same bytes.
    plain, e1 = run_tiny(**{"experiment.rounds": 2})
    faulty, e2 = run_tiny(**{"experiment.rounds": 2}, **addon(DROPOUT, p=0.0))
    for key, value in e1.ctx.server["global"].items():
        assert torch.equal(value, e2.ctx.server["global"][key]), key
    assert comparable(plain.history) == comparable(faulty.history)
    assert [h["dropped_clients"] for h in faulty.history] == [0.0, 0.0]


def test_dropout_with_p_one_keeps_the_initial_state_counts_the_work_and_no_upload_bytes():
    result, engine = run_tiny(**{"experiment.rounds": 2, "evaluation.every": 1}, **addon(DROPOUT, p=1.0))
    ctx = engine.ctx
    initial = ctx.models.initial_state(ctx.models.arch_of(0))
    for key, value in initial.items():
        assert torch.equal(ctx.server["global"][key], value), key
    assert [h["dropped_clients"] for h in result.history] == [4.0, 4.0]
    assert [h["comm_up_bytes"] for h in result.history] == [0.0, 0.0]  # never received
    assert result.history[-1]["comm_down_bytes"] > 0  # the broadcasts did go out
    assert [h["budget.private_epochs"] for h in result.history] == [1.0, 2.0]  # trained, wasted


def test_the_dropped_set_is_the_seeded_draw_and_the_aggregate_averages_the_arrivals_renormalised():
    p, seed = 0.5, 5
    lost = seeded_lost(seed, 1, range(4), p)
    assert 0 < len(lost) < 3, lost  # a round where some, but not all, uploads arrive
    engine, ctx = prepared(**{"experiment.seed": seed}, **addon(DROPOUT, p=p))
    shrink(ctx, {0: 30, 1: 50, 2: 70, 3: 84})  # unequal sizes: renormalised weights differ from 1/k
    initial = {k: v.clone() for k, v in ctx.server["global"].items()}
    model_bytes = sum(v.numel() * v.element_size() for v in initial.values())
    engine.run_round(ctx, 1)
    arrived = [i for i in range(4) if i not in lost]
    assert ctx.round_metrics["dropped_clients"] == len(lost)
    assert ctx.comm_up == model_bytes * len(arrived)
    total = sum(ctx.data.clients[i].num_train for i in arrived)
    expected = mean_of((ctx.data.clients[i].num_train / total, train_reference(ctx, i, initial)) for i in arrived)
    assert_close(ctx.server["global"], expected, atol=1e-5)


def test_dropped_uploads_never_reach_the_aggregate_and_weights_sum_to_one():
    # seed 6: one upload lost in round 1, all four in round 2
    result, _, spy = run_with_spy(**{"experiment.rounds": 2, "experiment.seed": 6, "evaluation.every": 1},
                                  **addon(DROPOUT, p=0.5))
    assert [len(seeded_lost(6, r, range(4), 0.5)) for r in (1, 2)] == [1, 4]
    for round in (1, 2):
        lost = seeded_lost(6, round, spy.participants[round], 0.5)
        arrived = [i for i in spy.participants[round] if i not in lost]
        if arrived:
            assert sorted(spy.weights[round]) == arrived
            assert sum(spy.weights[round].values()) == pytest.approx(1.0)
        else:
            assert round not in spy.weights  # the aggregate was not called
        assert result.history[round - 1]["dropped_clients"] == len(lost)


def test_a_bad_dropout_probability_names_its_key():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(Exception) as info:
            resolve(tiny_raw(**addon(DROPOUT, p=bad)))
        assert "addons[0].params.p" in str(info.value)


# -- stragglers ------------------------------------------------------------------------------


def test_run_epochs_stops_when_the_batch_budget_is_spent_and_counts_the_partial_epoch():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(25, 3), torch.randint(0, 2, (25,))
    counted, allowed = [], iter([True] * 3 + [False])
    steps = []

    def loss(model, xb, yb, logits):
        steps.append(len(yb))
        return torch.nn.functional.cross_entropy(logits, yb)

    run_epochs(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, epochs=3, batch_size=10, loss_fn=loss,
               drop_last=True, counter=counted.append, take_batch=lambda: next(allowed))
    # 2 batches an epoch (the 5 left over dropped): epoch 1 whole (25 counted, as without a
    # budget), then one batch of epoch 2 (its 10 samples), then nothing
    assert steps == [10, 10, 10]
    assert counted == [25, 10]


def test_straggler_batch_counts_follow_the_seeded_draw_and_the_work_counters():
    seed, fraction = 2, 0.5
    sizes = {0: 30, 1: 47, 2: 70, 3: 84}
    overrides = {"experiment.seed": seed, "experiment.rounds": 1, "training.local_epochs": 2,
                 "training.drop_last": False, **addon(STRAGGLERS, fraction=fraction)}
    resolved = resolve(tiny_raw(**overrides))
    spy = Spy()
    resolved.plugins.insert(0, spy)
    engine = Engine(resolved, progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    shrink(ctx, sizes)
    engine.run_round(ctx, 1)
    budgets = {}
    for i, n in sizes.items():
        per_epoch = [min(10, n - s) for s in batch_starts(n, 10, False)]
        budgets[i] = seeded_budget(seed, 1, i, fraction, 2 * len(per_epoch))
    stragglers = [i for i, b in budgets.items() if b is not None]
    assert 0 < len(stragglers) < 4, budgets  # both kinds in this round
    assert ctx.round_metrics["stragglers"] == len(stragglers)
    epochs = 0.0
    for i, n in sizes.items():
        per_epoch = [min(10, n - s) for s in batch_starts(n, 10, False)]
        full = 2 * len(per_epoch)
        taken = full if budgets[i] is None else budgets[i]
        assert taken < full or budgets[i] is None
        assert spy.steps[(1, i)] == taken, (i, budgets[i])
        whole, part = divmod(taken, len(per_epoch))
        epochs += (whole * n + sum(per_epoch[:part])) / n  # a whole epoch counts n
    assert ctx.budget_metrics()["budget.private_epochs"] == pytest.approx(epochs / 4)


def test_stragglers_with_fraction_zero_are_identical_to_no_addon():
    plain, e1 = run_tiny(**{"experiment.rounds": 2})
    faulty, e2 = run_tiny(**{"experiment.rounds": 2}, **addon(STRAGGLERS, fraction=0.0))
    for key, value in e1.ctx.server["global"].items():
        assert torch.equal(value, e2.ctx.server["global"][key]), key
    assert [h["stragglers"] for h in faulty.history] == [0.0, 0.0]


def test_a_coldstart_client_is_never_a_straggler():
    result, engine, spy = run_with_spy(**{"experiment.rounds": 1, "experiment.coldstart_clients": 1,
                                          "experiment.coldstart_epochs": 1, **addon(STRAGGLERS, fraction=1.0)})
    (held_out,) = engine.ctx.coldstart_clients
    n = engine.ctx.data.clients[held_out].num_train
    assert spy.steps[(1, held_out)] == len(batch_starts(n, 10, True))  # its whole fine-tuning epoch


# -- every built-in method with each add-on ----------------------------------------------------


@pytest.mark.parametrize("fault", [DROPOUT, STRAGGLERS])
@pytest.mark.parametrize("name", builtin_algorithms())
def test_every_method_runs_with_each_fault_addon(name, fault):
    params = {"p": 0.5} if fault == DROPOUT else {"fraction": 1.0}
    overrides = {"algorithm.name": name, "experiment.rounds": 2, "evaluation.every": 1,
                 **addon(fault, **params), **NEEDS.get(name, {})}
    result, engine, spy = run_with_spy(**overrides)
    assert len(result.history) == 2
    for h in result.history:
        bad = {k: v for k, v in h.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert h["acc_mean"] >= 0
    for round, h in enumerate(result.history, start=1):
        participants = spy.participants[round]
        if fault == DROPOUT:
            assert h["dropped_clients"] == len(seeded_lost(0, round, participants, 0.5))
        else:
            assert h["stragglers"] == len(participants)  # fraction 1: every participant
    if fault == STRAGGLERS and any(spy.participants.values()):
        declared = resolve(tiny_raw(**overrides)).as_dict["budget"]
        measured = result.history[-1]["budget.private_epochs"] + result.history[-1]["budget.public_epochs"]
        assert measured < declared["private_epochs"] + declared["public_epochs"]  # every client did less
