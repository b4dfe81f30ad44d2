"""The core's training loop, budget accounting, hook-name checking and late-failure handling."""

import pytest
import torch
from harness import NEEDS, builtin_algorithms
from tiny import tiny_raw
from torch import nn

from pfl_core import Plugin, hookimpl, registry
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.registry import make_plugin_manager
from pfl_core.runtime.training import batch_starts, run_epochs

# -- mini-batches and the last partial batch -----------------------------------------------


@pytest.mark.parametrize("n, batch, drop_last, expected", [
    (23, 10, True, [0, 10]),          # remainder of 3 skipped
    (23, 10, False, [0, 10, 20]),     # remainder kept
    (20, 10, True, [0, 10]),          # nothing to drop
    (7, 10, True, [0]),               # fewer samples than a batch: the one batch is kept
    (10, 10, True, [0]),
])
def test_batch_starts(n, batch, drop_last, expected):
    assert list(batch_starts(n, batch, drop_last)) == expected


def _sizes_seen(n, batch, drop_last, epochs=1):
    model = nn.Linear(2, 2)
    seen = []

    def loss_fn(model, x, y, logits):
        seen.append(len(y))
        return nn.functional.cross_entropy(logits, y)

    counted = []
    run_epochs(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(n, 2), torch.zeros(n, dtype=torch.long),
               epochs=epochs, batch_size=batch, loss_fn=loss_fn, generator=torch.Generator().manual_seed(0),
               drop_last=drop_last, counter=counted.append)
    return seen, counted


def test_training_loop_takes_no_step_on_a_tiny_remainder_unless_asked():
    assert _sizes_seen(22, 10, True)[0] == [10, 10]
    assert _sizes_seen(22, 10, False)[0] == [10, 10, 2]
    assert _sizes_seen(4, 10, True)[0] == [4]  # a client smaller than a batch still trains
    seen, counted = _sizes_seen(22, 10, True, epochs=3)
    assert seen == [10] * 6 and counted == [22, 22, 22]  # an epoch counts as one pass over n


def test_drop_last_is_the_default_used_by_client_training():
    # 4 clients with train sizes that leave a remainder: count the steps of one local epoch.
    steps = {}

    class CountSteps(Plugin):
        name = "count_steps"
        kind = registry.ADDON

        @hookimpl
        def local_objective(self, ctx, client, model, x, y, logits):
            steps.setdefault(client.id, []).append(len(y))
            return torch.zeros(())

    raw = tiny_raw(**{"experiment.rounds": 1, "algorithm.name": "local", "training.batch_size": 16})
    resolved = resolve(raw)
    resolved.plugins.insert(0, CountSteps())
    engine = Engine(resolved, progress=False)
    engine.run()
    for cid, sizes in steps.items():
        n = engine.ctx.data.clients[cid].num_train
        assert sizes == [16] * (n // 16), (cid, n, sizes)
    resolved = resolve(tiny_raw(**{**{"experiment.rounds": 1, "algorithm.name": "local", "training.batch_size": 16},
                                   "training.drop_last": False}))
    steps.clear()
    resolved.plugins.insert(0, CountSteps())
    Engine(resolved, progress=False).run()
    assert any(len(s) and s[-1] < 16 for s in steps.values())


# -- the local-work budget: declared == measured, for every built-in method ------------------

# Methods whose first rounds' work depends on the data: FedALA learns its aggregation weights
# until they converge the first time (a data-dependent number of epochs). Their declared
# budget is the steady state: it must hold for every round after the start phase.
# FedPCL trains nobody in round 1 (no prototypes to contrast with yet).
STEADY_STATE_FROM = {"fedala": 3, "fedah": 2, "fedpcl": 2}  # fedala: round 1 no local model yet; round 2 the start phase
# fedah: round 1 has no head of its own yet, so no W learning


@pytest.mark.parametrize("name", builtin_algorithms())
def test_measured_private_epochs_equal_the_declared_budget(name):
    start = STEADY_STATE_FROM.get(name)
    rounds = 2 if start is None else start + 1
    raw = tiny_raw(**{"algorithm.name": name, "experiment.rounds": rounds, "evaluation.every": 1,
                      **NEEDS.get(name, {})})
    resolved = resolve(raw)
    declared = resolved.as_dict["budget"]
    engine = Engine(resolved, progress=False)
    result = engine.run()
    if start is not None:  # the steady-state rounds: each adds exactly the declared work per round
        by_round = {row["round"]: row for row in result.history}
        for key in ("private_epochs", "public_epochs"):
            added = by_round[rounds][f"budget.{key}"] - by_round[start - 1][f"budget.{key}"]
            # within 1%: W learns on s% of each client's samples, rounded to whole samples
            assert added == pytest.approx(declared[f"{key}_per_round"] * (rounds - start + 1), rel=0.01), declared
        return
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(declared["private_epochs"]), declared
    assert result.history[-1]["budget.public_epochs"] == pytest.approx(declared["public_epochs"]), declared


def test_budget_table_is_in_the_resolved_spec():
    resolved = resolve(tiny_raw(**{"experiment.rounds": 3, "training.local_epochs": 2}))
    assert resolved.as_dict["budget"]["private_epochs"] == 6
    assert "[budget]" in resolved.toml()
    assert resolve(tiny_raw(**{"budget": {"private_epochs": 99}})).as_dict["budget"]["private_epochs"] == 3  # computed


# -- a misspelled hook ------------------------------------------------------------------------


def test_a_misspelled_hook_is_refused_naming_plugin_hook_and_nearest_name():
    class Typo(Plugin):
        name = "typo"

        @hookimpl
        def local_trian(self, ctx, client):
            return {}

    with pytest.raises(SpecError) as info:
        make_plugin_manager([Typo()])
    message = str(info.value)
    assert "typo" in message and "'local_trian'" in message and "did you mean 'local_train'" in message
    assert info.value.path == "algorithm"


# -- a failure after training keeps the run ----------------------------------------------------


def test_a_failing_coldstart_step_keeps_the_trained_results():
    class BrokenColdstart(Plugin):
        name = "broken_coldstart"
        kind = registry.ADDON

        @hookimpl
        def coldstart_personalize(self, ctx, client):
            raise KeyError("no model for this newcomer")

    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.coldstart_clients": 1})
    resolved = resolve(raw)
    resolved.plugins.insert(0, BrokenColdstart())
    result = Engine(resolved, progress=False).run()
    assert result.final["acc_mean"] > 0 and len(result.history) == 2
    assert "coldstart_acc_mean" not in result.final
    assert len(result.errors) == 1 and "cold-start" in result.errors[0] and "KeyError" in result.errors[0]


# -- divergence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_a_diverging_run_stops_naming_round_client_method_and_the_fix(algorithm):
    from pfl_core.errors import NonFiniteError

    raw = tiny_raw(**{"algorithm.name": algorithm, "training.lr": 1e30, "experiment.rounds": 3})
    with pytest.raises(NonFiniteError) as info:
        Engine(resolve(raw), progress=False).run()
    message = str(info.value)
    assert "round 1, client 0" in message and f"method {algorithm}" in message and "lower training.lr" in message


def test_a_nonfinite_upload_is_caught_even_when_the_loss_looked_finite():
    from pfl_core.errors import NonFiniteError
    from pfl_core.runtime.client import check_finite

    check_finite({"weights": {"w": torch.ones(3)}, "n": 3})
    with pytest.raises(NonFiniteError):
        check_finite({"weights": {"w": torch.tensor([1.0, float("nan")])}})
    with pytest.raises(NonFiniteError):
        check_finite([torch.tensor([float("inf")])])
    check_finite({"labels": torch.tensor([1, 2])})  # integer payloads are never non-finite
