"""Collaboration gain: reference baselines run once per spec on the same data and seeds, and
every run's gain over them is paired by seed."""

import math

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.engine import RunResult
from pfl_core.study import points as study_points
from pfl_core.study import run as study_run
from pfl_core.study import run_spec_file, stats
from pfl_core.study.points import PointResult
from pfl_core.study.seeds import gains


def _result(name, algorithm, seeds, accs):
    runs = [RunResult(history=[], client_rows=[], final={"acc_mean": a}) for a in accs]
    return PointResult(name, seeds, runs, {"acc_mean": stats.summarize(accs)}, None, algorithm, "")


def test_gains_are_paired_per_seed_against_the_best_reference_of_that_seed():
    local = _result("local (reference)", "local", [0, 1, 2], [0.80, 0.60, 0.70])
    central = _result("centralized (reference)", "centralized", [0, 1, 2], [0.70, 0.75, 0.72])
    method = _result("fedx", "fedx", [0, 1, 2], [0.85, 0.70, 0.71])
    g = gains(method, [local, central])
    # best reference per seed: 0.80, 0.75, 0.72 -> differences 0.05, -0.05, -0.01
    assert g["gain_vs_best_reference"].mean == pytest.approx((0.05 - 0.05 - 0.01) / 3)
    assert g["gain_vs_best_reference"].std == pytest.approx(stats.summarize([0.05, -0.05, -0.01]).std)
    # vs local: 0.05, 0.10, 0.01
    assert g["gain_vs_local"].mean == pytest.approx(0.16 / 3)
    without_local = gains(method, [central])
    assert "gain_vs_local" not in without_local
    assert without_local["gain_vs_best_reference"].mean == pytest.approx((0.15 - 0.05 - 0.01) / 3)


def test_bad_reference_names_are_one_line_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw(**{"experiment.reference": ["local", "lcoal"]})),
                           "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "experiment.reference[1]" in line and "did you mean 'local'" in line
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw(**{"experiment.reference": ["local", "local"]})),
                           "--dry-run")
    assert code == 2 and "experiment.reference" in one_line_error(err) and "more than once" in err


def test_references_run_once_per_spec_and_a_sweep_point_equal_to_one_is_reused(tmp_path, monkeypatch):
    ran = []
    real = study_run.run_point

    def counting(point, name, *args):
        ran.append(name)
        return real(point, name, *args)

    monkeypatch.setattr(study_run, "run_point", counting)
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1],
                      "experiment.reference": ["local", "centralized"]})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local", "fedprox"]}
    shown = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True,
                          out=open(tmp_path / "out.txt", "w"))
    assert ran == ["local (reference)", "centralized (reference)", "fedavg", "fedprox"]
    names = [r.name for r in shown]
    assert names == ["fedavg", "local", "fedprox", "centralized (reference)"]
    by_name = {r.name: r for r in shown}
    assert by_name["local"].summary["gain_vs_local"].mean == 0
    for name in ("fedavg", "fedprox", "centralized (reference)"):
        g = by_name[name].summary["gain_vs_best_reference"]
        per_seed = [by_name[name].runs[i].final["acc_mean"]
                    - max(by_name["local"].runs[i].final["acc_mean"],
                          by_name["centralized (reference)"].runs[i].final["acc_mean"]) for i in range(2)]
        assert g.mean == pytest.approx(sum(per_seed) / 2)
    out = open(tmp_path / "out.txt").read()
    assert "gain_vs_best_reference" in out


def test_references_follow_a_non_algorithm_sweep_axis(tmp_path, monkeypatch):
    ran = []
    real = study_run.run_point
    monkeypatch.setattr(study_run, "run_point", lambda p, name, *a: ran.append(name) or real(p, name, *a))
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.reference": ["local"]})
    raw["sweep"] = {"algorithm.name": ["fedavg", "fedprox"], "training.lr": [0.1, 0.05]}
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=open(tmp_path / "o.txt", "w"))
    assert sorted(n for n in ran if "reference" in n) == ["local (reference) lr=0.05", "local (reference) lr=0.1"]


def test_gains_are_logged_to_the_parent_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1], "tracking.enabled": True,
                      "experiment.reference": ["local"]})
    shown = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri,
                          out=open(tmp_path / "out.txt", "w"))
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    fedavg = next(r for r in shown if r.name == "fedavg")
    metrics = client.get_run(fedavg.run_id).data.metrics
    assert metrics["gain_vs_local"] == pytest.approx(fedavg.summary["gain_vs_local"].mean)
    assert math.isclose(metrics["gain_vs_local_ci95"], fedavg.summary["gain_vs_local"].ci95, rel_tol=1e-9)


def test_sweep_points_are_methods_with_their_own_budget_and_share_the_references(tmp_path, monkeypatch):
    ran = []
    real = study_run.run_point
    monkeypatch.setattr(study_run, "run_point", lambda p, name, *a: ran.append(name) or real(p, name, *a))
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.reference": ["local"]})
    raw["sweep"] = {"points": [{"algorithm": {"name": "fedavg"}},
                               {"algorithm": {"name": "local"}, "training.local_epochs": 2}]}
    shown = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True,
                          out=open(tmp_path / "o.txt", "w"))
    assert ran == ["local (reference)", "fedavg", "local local_epochs=2"]
    twice = next(r for r in shown if r.name == "local local_epochs=2")
    assert twice.runs[0].final["budget.private_epochs"] == 4  # 2 rounds x 2 epochs


def test_two_sweep_points_of_one_method_are_named_by_the_parameters_that_differ():
    raw = tiny_raw(**{"sweep.algorithm": [
        {"name": "fedrep", "params": {"head_epochs": 1, "body_epochs": 1}},
        {"name": "fedrep", "params": {"head_epochs": 10, "body_epochs": 1}},
        {"name": "fedavg"},
    ]})
    points = study_points.resolve_points(raw, [], [], False, [])
    assert study_points.run_names(points) == ["fedrep head_epochs=1", "fedrep head_epochs=10", "fedavg"]


def test_a_reference_never_takes_a_sweep_points_method_overrides():
    """References start from the spec's own settings: the first point's budget override (here
    FedAlt-style local_epochs = 1) must not become Local's budget."""
    raw = tiny_raw(**{"experiment.reference": ["local"], "training.local_epochs": 2})
    raw["sweep"] = {"points": [{"algorithm": {"name": "fedavg"}, "training.local_epochs": 1},
                               {"algorithm": {"name": "fedprox"}}]}
    points = study_points.resolve_points(raw, ["experiment.rounds=3"], [], False, [])
    [(label, reference)] = study_points.reference_points(points)
    assert label == "local (reference)"
    assert reference.resolved.spec.training.local_epochs == 2
    assert reference.resolved.spec.experiment.rounds == 3  # --set still applies
    assert points[0].resolved.spec.training.local_epochs == 1


def test_a_reference_follows_its_groups_data_settings():
    raw = tiny_raw(**{"experiment.reference": ["local"]})
    raw["sweep"] = {"partition.num_clients": [3, 5], "algorithm.name": ["fedavg", "fedprox"]}
    points = study_points.resolve_points(raw, [], [], False, [])
    references = study_points.reference_points(points)
    assert [r.resolved.spec.partition.num_clients for _, r in references] == [3, 5]
