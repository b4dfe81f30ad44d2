"""``tune.sampler = "shared"`` (the default): every method of a tuned sweep tries the same values
of the keys they share (one seeded Sobol design), its own keys crossed with them trial by trial;
a resumed tuning runs only the design points not yet run; a best value on the edge of the values
tried is reported."""

from __future__ import annotations

import io
import math

import mlflow
import numpy as np
import optuna
import pytest
from scipy.stats import qmc
from test_cli import write_spec
from test_tune import kill_then_resume, runs_of, trials_of, tune_raw

from pfl_core.cli import main
from pfl_core.study import run_spec_file
from pfl_core.study import tune as tune_module
from pfl_core.study.points import resolve_points
from pfl_core.study.tune import DESIGN_POINT, Dimension, design, edges, plan_tuning, study_name

LR = {"training.lr": {"low": 0.001, "high": 0.5, "log": True}}
MU = {"fedprox": {"algorithm.params.mu": {"low": 0.001, "high": 1.0, "log": True}}}


def sobol_by_hand(points: int, seed: int, dimensions: int = 1) -> np.ndarray:
    """scipy's scrambled Sobol design, seeded as the docs say (a Generator from experiment.seed)."""
    return qmc.Sobol(dimensions, scramble=True, seed=np.random.default_rng(seed)).random_base2(int(math.log2(points)))


def log_uniform(units, low, high) -> list[float]:
    return [math.exp(math.log(low) + u * (math.log(high) - math.log(low))) for u in units]


def plans_of(raw):
    return plan_tuning(resolve_points(raw, []), ["fedavg", "fedprox"])


def by_design_point(trials) -> list:
    """The finished trials' params in the order of the design."""
    done = [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    return [t.params for t in sorted(done, key=lambda t: t.user_attrs[DESIGN_POINT])]


def test_two_methods_try_the_same_learning_rates_and_the_own_knob_is_crossed_with_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tune_raw(trials=4, space=LR, method=MU, **{"experiment.seed": 3, "tune.pruner": "none"})
    assert "sampler" not in raw["tune"]  # the default
    out = io.StringIO()
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=out)
    studies = {name.split("/")[1]: by_design_point(trials)
               for name, trials in trials_of(tmp_path / "optuna.db").items()}
    fedavg_lr = [p["training.lr"] for p in studies["fedavg"]]
    fedprox_lr = [p["training.lr"] for p in studies["fedprox"]]
    assert fedavg_lr == fedprox_lr  # the same values, in the same order, for both methods
    # ... and they are scipy's Sobol design on seed 3, mapped log-uniformly onto [0.001, 0.5]
    assert fedavg_lr == pytest.approx(log_uniform(sobol_by_hand(4, 3)[:, 0], 0.001, 0.5), rel=1e-12)
    assert len(set(fedavg_lr)) == 4
    mus = [p["algorithm.params.mu"] for p in studies["fedprox"]]
    assert len(set(mus)) == 4 and all(0.001 <= mu <= 1.0 for mu in mus)  # its own knob varies
    assert all(set(p) == {"training.lr"} for p in studies["fedavg"])
    assert "shared Sobol design" in out.getvalue()  # the table's header says which sampler


def test_the_design_is_reproducible_and_the_seed_changes_it():
    first = plans_of(tune_raw(trials=8, space=LR, method=MU, **{"experiment.seed": 5}))
    again = plans_of(tune_raw(trials=8, space=LR, method=MU, **{"experiment.seed": 5}))
    other = plans_of(tune_raw(trials=8, space=LR, method=MU, **{"experiment.seed": 6}))
    assert design(first[1], 8, 5) == design(again[1], 8, 5)
    lrs = [row["training.lr"] for row in design(first[0], 8, 5)]
    assert lrs == [row["training.lr"] for row in design(first[1], 8, 5)]  # the shared key: one design
    assert lrs != [row["training.lr"] for row in design(other[0], 8, 6)]
    # the own key is not the shared one's twin: mu is not lr's quantile again (a design of its own)
    lr_rank = np.argsort(lrs)
    mu_rank = np.argsort([row["algorithm.params.mu"] for row in design(first[1], 8, 5)])
    assert list(lr_rank) != list(mu_rank)
    # lr and mu together: one point in every cell of a 2 x 4 and a 4 x 2 grid of the (log) square
    units = [(math.log(r["training.lr"] / 0.001) / math.log(500),
              math.log(r["algorithm.params.mu"] / 0.001) / math.log(1000)) for r in design(first[1], 8, 5)]
    for rows, cols in ((2, 4), (4, 2), (8, 1), (1, 8)):
        assert len({(int(u * rows), int(v * cols)) for u, v in units}) == 8
    # a count that is not a power of two: the first points of the same sequence
    assert [row["training.lr"] for row in design(first[0], 5, 5)] == lrs[:5]
    # Optuna's storage names the sampler in effect: the default is "shared", and a tuning made
    # under the earlier default (tpe) is another study
    named = plans_of(tune_raw(trials=8, space=LR, method=MU, **{"experiment.seed": 5, "tune.sampler": "shared"}))
    tpe = plans_of(tune_raw(trials=8, space=LR, method=MU, **{"experiment.seed": 5, "tune.sampler": "tpe"}))
    assert study_name(named[0]) == study_name(first[0]) != study_name(tpe[0])


def test_log_step_and_choices_map_the_unit_interval():
    log = Dimension("training.lr", "tune.space.training.lr", low=0.001, high=0.1, log=True)
    assert log.at(0.0) == pytest.approx(0.001) and log.at(0.5) == pytest.approx(0.01)
    values = [log.at(u) for u in sobol_by_hand(16, 0)[:, 0]]
    assert all(0.001 <= v <= 0.1 for v in values)
    # log-uniform: one value in each of 16 equal slices of [log 0.001, log 0.1]
    assert sorted(int((math.log10(v) + 3) / 2 * 16) for v in values) == list(range(16))
    linear = Dimension("training.momentum", "p", low=0.0, high=0.8)
    assert linear.at(0.25) == pytest.approx(0.2)
    step = Dimension("training.lr", "p", low=0.1, high=0.5, step=0.1)  # 0.1, 0.2, ..., 0.5 in equal shares
    assert [step.at(u) for u in (0.0, 0.19, 0.2, 0.45, 0.99)] == [0.1, 0.1, 0.2, 0.3, 0.5]
    integer = Dimension("training.local_epochs", "p", low=1, high=4)
    assert [integer.at(u) for u in (0.0, 0.3, 0.99)] == [1, 2, 4] and isinstance(integer.at(0.3), int)
    log_int = Dimension("training.batch_size", "p", low=8, high=128, log=True)
    assert log_int.at(0.5) == 32 and log_int.at(0.999999) == 128
    choices = Dimension("training.optimizer", "p", choices=("sgd", "adam", "adamw"))
    assert [choices.at(u) for u in (0.0, 0.34, 0.67, 0.9999)] == ["sgd", "adam", "adamw", "adamw"]
    # a design of 8 over 4 choices: each choice twice
    (plan, _) = plans_of(tune_raw(trials=8, space={"training.lr": {"choices": [0.01, 0.03, 0.1, 0.3]}}))
    chosen = [row["training.lr"] for row in design(plan, 8, 0)]
    assert sorted(chosen) == [0.01, 0.01, 0.03, 0.03, 0.1, 0.1, 0.3, 0.3]


def test_enqueuing_twice_queues_each_design_point_once_and_a_lowered_budget_fails_the_rest():
    (plan, _) = plans_of(tune_raw(trials=4, space=LR))
    study = optuna.create_study()
    tune_module._enqueue_design(study, plan, 4, 0, [])
    tune_module._enqueue_design(study, plan, 4, 0, [])
    assert [t.user_attrs[DESIGN_POINT] for t in study.trials] == [0, 1, 2, 3]
    study.optimize(lambda trial: plan.space[0].suggest(trial), n_trials=2)  # design points 0 and 1 ran
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    tune_module._enqueue_design(study, plan, 3, 0, done)  # resumed with tune.trials = 3
    states = {t.user_attrs[DESIGN_POINT]: t.state for t in study.trials}
    assert len(study.trials) == 4 and states[2] == optuna.trial.TrialState.WAITING
    assert states[3] == optuna.trial.TrialState.FAIL  # no longer in the design: never run


def test_a_killed_tuning_resumes_with_the_design_points_not_yet_run(tmp_path):
    raw = tune_raw(trials=4, sweep=None, space=LR, **{"tracking.enabled": True, "tracking.progress": False,
                                                      "tune.pruner": "none"})
    before, after = kill_then_resume(tmp_path, raw, kill_at=3)
    assert [t.state for t in before].count(optuna.trial.TrialState.COMPLETE) == 2
    complete = [t for t in after if t.state == optuna.trial.TrialState.COMPLETE]
    # every design point ran exactly once: the killed one again, none twice, nothing left queued
    assert sorted(t.user_attrs[DESIGN_POINT] for t in complete) == [0, 1, 2, 3]
    assert not [t for t in after if t.state == optuna.trial.TrialState.WAITING]
    (plan,) = plan_tuning(resolve_points(raw, []), ["fedavg"])
    assert [p["training.lr"] for p in by_design_point(after)] == [row["training.lr"] for row in design(plan, 4, 0)]


def fake_objective(target_rank: int):
    """An objective that trains nothing: the best trial is the lr of rank ``target_rank`` among the design's."""
    def objective(trial, plan, **_):
        lrs = sorted(row["training.lr"] for row in design(plan, plan.point.resolved.spec.tune.trials,
                                                           plan.point.resolved.spec.experiment.seed))
        lr = plan.space[0].suggest(trial)
        return -abs(math.log(lr) - math.log(lrs[target_rank]))
    return objective


@pytest.mark.parametrize("target_rank, edge", [(0, True), (2, False)])
def test_a_best_value_on_the_edge_of_those_tried_is_a_warning_and_a_tag(tmp_path, monkeypatch, capsys,
                                                                         target_rank, edge):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tune_module, "_objective", fake_objective(target_rank))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tune_raw(trials=4, sweep=None, space=LR, **{"tracking.enabled": True, "experiment.rounds": 1,
                                                      "experiment.seeds": [0]})
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=io.StringIO())
    mlflow.set_tracking_uri(None)
    (parent,) = [r for r in runs_of(uri) if r.info.run_name == "fedavg (tuning)"]
    smallest = min(row["training.lr"] for row in design(plan_tuning(resolve_points(raw, []), ["fedavg"])[0], 4, 0))
    err = capsys.readouterr().err
    if edge:
        assert float(parent.data.params["best.training.lr"]) == pytest.approx(smallest)
        assert "pfl: warning: fedavg: training.lr=" in err and "is the smallest value tried" in err
        assert "[0.001, 0.5] (tune.space.training.lr); widen the range" in err
        assert "smallest" in parent.data.tags["pfl.tune.edge.training.lr"]
    else:
        assert "value tried" not in err and "pfl.tune.edge.training.lr" not in parent.data.tags
    assert main(["results", "last", "--tracking-uri", uri]) == 0  # the header line of its table says it
    tuned_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tuned:"))
    assert ("; on the edge: fedavg training.lr=" in tuned_line and "is the smallest value tried" in tuned_line) == edge


def test_edges_on_hand_built_trials():
    lr = Dimension("training.lr", "tune.space.training.lr", low=0.001, high=0.5, log=True)
    opt = Dimension("training.optimizer", "tune.space.training.optimizer", choices=("sgd", "adam"))
    distributions = {"training.lr": optuna.distributions.FloatDistribution(0.001, 0.5, log=True),
                     "training.optimizer": optuna.distributions.CategoricalDistribution(["sgd", "adam"])}
    trials = [optuna.trial.create_trial(params={"training.lr": value, "training.optimizer": "sgd"},
                                        distributions=distributions, value=0.0) for value in (0.01, 0.2, 0.05)]
    assert set(edges(trials, [lr, opt], {"training.lr": 0.2, "training.optimizer": "sgd"})) == {"training.lr"}
    assert "largest" in edges(trials, [lr], {"training.lr": 0.2})["training.lr"]
    assert edges(trials, [lr], {"training.lr": 0.05}) == {}
    assert edges(trials[:1], [lr], {"training.lr": 0.01}) == {}  # one value tried: no edge to speak of
