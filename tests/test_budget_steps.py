"""The budget in optimiser steps (``budget.private_steps``, summed over a client's models) beside
passes (``budget.private_epochs``), against steps counted by hand; evaluation-time fine-tuning
as its own entry (``budget.finetune_steps``); and the comparison's budget columns and warning."""

from __future__ import annotations

import pytest
from test_cli import write_spec
from tiny import run_tiny, tiny_raw

from pfl_core.study import run_spec_file

ROUNDS = 2
BATCH = 10


def batches_per_epoch(engine) -> int:
    """Mini-batch steps of one epoch over a client's train split (drop_last: floor(n / batch))."""
    sizes = {c.num_train for c in engine.ctx.data.clients}
    assert len(sizes) == 1, sizes  # tiny's clients are the same size: one number per client
    return sizes.pop() // BATCH


def final_budget(**overrides):
    result, engine = run_tiny(**{"experiment.rounds": ROUNDS, "training.batch_size": BATCH, **overrides})
    return result.final, batches_per_epoch(engine)


@pytest.mark.parametrize("local_epochs, personal_epochs", [(1, 1), (2, 1), (1, 3)])
def test_fedalt_steps_are_its_personal_and_shared_epochs_batches(local_epochs, personal_epochs):
    final, b = final_budget(**{"algorithm.name": "fedalt", "training.local_epochs": local_epochs,
                               "algorithm.params.personal_epochs": personal_epochs})
    assert final["budget.private_steps"] == ROUNDS * b * (personal_epochs + local_epochs)
    assert final["budget.private_epochs"] == ROUNDS * (personal_epochs + local_epochs)


@pytest.mark.parametrize("local_epochs, personal_epochs", [(1, 1), (2, 3)])
def test_ditto_steps_count_the_global_and_the_personal_model(local_epochs, personal_epochs):
    final, b = final_budget(**{"algorithm.name": "ditto", "training.local_epochs": local_epochs,
                               "algorithm.params.personal_epochs": personal_epochs})
    assert final["budget.private_steps"] == ROUNDS * b * (local_epochs + personal_epochs)


@pytest.mark.parametrize("k", [1, 5])
def test_pfedme_steps_are_k_inner_steps_and_the_local_update_per_batch(k):
    final, b = final_budget(**{"algorithm.name": "pfedme", "training.local_epochs": 2, "algorithm.params.k": k})
    assert final["budget.private_steps"] == ROUNDS * b * 2 * (k + 1)
    assert final["budget.private_epochs"] == ROUNDS * 2 * k  # passes: k per batch (its declared budget)


def test_fedavg_steps_and_no_finetuning():
    final, b = final_budget(**{"algorithm.name": "fedavg", "training.local_epochs": 3})
    assert final["budget.private_steps"] == ROUNDS * 3 * b
    assert final["budget.public_steps"] == 0 and final["budget.finetune_steps"] == 0


def test_fedbabu_finetuning_before_each_evaluation_is_its_own_entry():
    final, b = final_budget(**{"algorithm.name": "fedbabu", "algorithm.params.finetune_epochs": 2})
    assert final["budget.private_steps"] == ROUNDS * b  # the body's training only
    # every round is evaluated (evaluation.every = 1): 2 epochs of head fine-tuning each time
    assert final["budget.finetune_steps"] == ROUNDS * 2 * b


def _sweep_raw(budget: str):
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1], "report.budget": budget})
    raw["sweep"] = {"algorithm.name": ["fedavg", "ditto"]}
    return raw


@pytest.mark.parametrize("budget, column, unequal", [("passes", "budget.private_epochs", True),
                                                     ("steps", "budget.private_steps", True)])
def test_the_comparison_shows_the_budget_in_the_chosen_unit_and_warns_when_it_differs(
        tmp_path, capsys, budget, column, unequal):
    out = tmp_path / "out.txt"
    with open(out, "w") as fh:
        run_spec_file(write_spec(tmp_path, _sweep_raw(budget)), [], quiet=True, no_tracking=True, out=fh)
    text = out.read_text()
    table = text[text.index("== comparison"):]
    assert column in table.splitlines()[1]  # the header
    err = capsys.readouterr().err
    # Ditto trains two models: twice FedAvg's steps and passes
    assert ("differ by more than 10%" in err) is unequal and f"budgets ({budget})" in err
    assert "ditto" in err and "fedavg" in err


def test_equal_budgets_give_no_warning(tmp_path, capsys):
    raw = _sweep_raw("steps")
    raw["sweep"] = {"algorithm.name": ["fedavg", "fedprox"]}
    with open(tmp_path / "out.txt", "w") as fh:
        run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=fh)
    assert "differ by more than 10%" not in capsys.readouterr().err


@pytest.mark.parametrize("local_epochs", [1, 2])
def test_apfl_steps_count_w_and_v_on_every_batch(local_epochs):
    final, b = final_budget(**{"algorithm.name": "apfl", "training.local_epochs": local_epochs})
    assert final["budget.private_steps"] == ROUNDS * b * local_epochs * 2


@pytest.mark.parametrize("eval_steps", [1, 3])
def test_perfedavg_adaptation_before_each_evaluation_is_fine_tuning(eval_steps):
    final, _ = final_budget(**{"algorithm.name": "perfedavg", "algorithm.params.eval_steps": eval_steps})
    assert final["budget.finetune_steps"] == ROUNDS * eval_steps  # every round is evaluated


@pytest.mark.parametrize("local_epochs", [1, 3])
def test_centralized_counts_its_pooled_steps_shared_over_the_training_clients(local_epochs):
    """Issue 35: centralized showed budget.private_steps 0 beside its epochs. Its steps are the
    pooled data's batches per epoch (tiny: 4 clients of 84 -> 336 samples, drop_last: 33 batches
    of 10), shared over the 4 training clients as their own steps are: 33 / 4 per epoch."""
    result, engine = run_tiny(**{"algorithm.name": "centralized", "experiment.rounds": ROUNDS,
                                 "training.batch_size": BATCH, "training.local_epochs": local_epochs})
    assert [c.num_train for c in engine.ctx.data.clients] == [84] * 4 and engine.spec.training.drop_last
    assert result.final["budget.private_epochs"] == ROUNDS * local_epochs
    assert result.final["budget.private_steps"] == ROUNDS * local_epochs * 33 / 4
