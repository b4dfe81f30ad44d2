"""Repeats over seeds: every seed is a whole experiment, the parent run holds mean, std and the
95% interval, the comparison shows paired differences; bad seeds are one-line errors."""

import math

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.engine import Engine, RunResult, resolve
from pfl_core.study import stats
from pfl_core.study import run_spec_file
from pfl_core.study.points import PointResult
from pfl_core.study.report import COMPARED, print_comparison

# -- statistics ------------------------------------------------------------------------------


def test_summary_matches_a_hand_computed_t_interval():
    s = stats.summarize([0.70, 0.74, 0.78])
    assert s.mean == pytest.approx(0.74)
    assert s.std == pytest.approx(0.04)  # sample std (ddof = 1), not the population's 0.0327
    # t_{0.975, 2} = 4.302653; half-width = t * s / sqrt(3)
    assert s.ci95 == pytest.approx(4.302653 * 0.04 / math.sqrt(3), rel=1e-6)
    assert not math.isnan(s.ci95)
    one = stats.summarize([0.5])
    assert one.mean == 0.5 and math.isnan(one.std) and math.isnan(one.ci95) and not one.excludes_zero


def test_paired_difference_uses_the_pairs_not_the_two_means():
    # Both methods vary a lot across seeds, but B is always exactly 0.01 above A.
    a = [0.50, 0.70, 0.90]
    b = [0.51, 0.71, 0.91]
    d = stats.paired_difference(b, a)
    assert d.mean == pytest.approx(0.01)
    assert d.ci95 == pytest.approx(0.0, abs=1e-12)
    assert d.excludes_zero
    # unpaired, the intervals of the two means overlap completely
    assert stats.summarize(a).high > stats.summarize(b).low
    with pytest.raises(ValueError):
        stats.paired_difference([1.0, 2.0], [1.0])


def test_an_interval_that_contains_zero_is_not_marked():
    d = stats.paired_difference([0.52, 0.48, 0.51], [0.50, 0.50, 0.50])
    assert d.low < 0 < d.high and not d.excludes_zero
    assert stats.paired_difference([0.40, 0.42, 0.41], [0.50, 0.50, 0.51]).excludes_zero  # below 0 too


def _point(name, seeds, accs):
    runs = [RunResult(history=[], client_rows=[], final={"acc_mean": a, "comm_up_bytes": 0.0}) for a in accs]
    return PointResult(name, seeds, runs, {"acc_mean": stats.summarize(accs),
                                           "comm_up_bytes": stats.summarize([0.0] * len(accs))})


def test_comparison_marks_only_significant_differences(capsys):
    import sys

    ref = _point("local", [0, 1, 2], [0.80, 0.85, 0.90])
    better = _point("steady", [0, 1, 2], [0.82, 0.87, 0.92])  # +0.02 on every seed
    noisy = _point("noisy", [0, 1, 2], [0.90, 0.80, 0.90])  # +0.10, -0.05, 0.00
    print_comparison([ref, better, noisy], "noisy", sys.stdout)  # compare_to another entry
    out = capsys.readouterr().out
    assert "Δacc_mean vs noisy" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().split(" ")[0] in ("local", "steady")}
    assert rows["steady"].rstrip().endswith("*") is False  # steady vs noisy: not significant
    print_comparison([ref, better, noisy], "local", sys.stdout)
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("steady"))
    assert "+0.0200 [+0.0200, +0.0200] p<0.001 *" in line  # equal gains on every seed: p = 0
    line = next(l for l in out.splitlines() if l.strip().startswith("noisy"))
    assert "*" not in line


def test_the_paired_p_is_the_t_test_of_the_differences_by_hand():
    # differences 0.01, 0.03, 0.02: mean 0.02, std 0.01, t = 0.02 / (0.01 / sqrt 3) = sqrt 12;
    # with 2 degrees of freedom the t tail is closed-form: P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2
    d = stats.paired_difference([0.51, 0.53, 0.52], [0.50, 0.50, 0.50])
    t = math.sqrt(12)
    assert d.p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9) and d.p_adjusted == d.p
    assert stats.paired_difference([0.49, 0.47, 0.48], [0.50, 0.50, 0.50]).p == pytest.approx(d.p)  # two-sided
    assert math.isnan(stats.paired_difference([0.5], [0.4]).p)  # one seed: no test


def test_the_edges_of_the_statistics():
    assert stats.summarize([]).n == 0 and math.isnan(stats.summarize([]).mean)
    two = stats.summarize([0.5, 0.7])  # two values: an interval (t with 1 degree of freedom)
    assert two.ci95 == pytest.approx(12.706205 * two.std / math.sqrt(2), rel=1e-6)
    assert math.isnan(stats.summarize([0.5, 0.7]).p)  # a summary is not a test; only differences are
    # equal differences on every seed: p 0 for a nonzero mean, 1 for none at all
    assert stats.paired_difference([0.6, 0.7], [0.5, 0.6]).p == 0.0
    assert stats.paired_difference([0.5, 0.6], [0.5, 0.6]).p == 1.0
    # two seeds test too: differences 0.02, 0.04, t = 0.03 / (0.01414 / sqrt 2) = 3 with one degree of
    # freedom (Cauchy): p = 1 - 2 atan(t) / pi
    d = stats.paired_difference([0.52, 0.54], [0.50, 0.50])
    assert d.p == pytest.approx(1 - 2 * math.atan(3) / math.pi, rel=1e-9)
    at_alpha = stats.Summary(0.1, 0.1, 0.1, 3, p=0.05, p_adjusted=0.05)
    assert not at_alpha.significant  # "below 0.05"
    touching = stats.Summary(0.1, 0.1, 0.1, 3)  # low = 0 exactly: the interval does not exclude 0
    assert not touching.excludes_zero and not stats.Summary(-0.1, 0.1, 0.1, 3).excludes_zero


def test_the_gains_are_a_family_each_over_the_runs():
    from pfl_core.study.compare import adjust_gains, paired

    def with_gains(name, p_best, p_local):
        point = _point(name, [0, 1, 2], [0.8, 0.8, 0.8])
        point.summary["gain_vs_best_reference"] = stats.Summary(0.1, 0.1, 0.1, 3, p=p_best, p_adjusted=p_best)
        point.summary["gain_vs_local"] = stats.Summary(0.1, 0.1, 0.1, 3, p=p_local, p_adjusted=p_local)
        return point

    results = [with_gains("a", 0.01, 0.02), with_gains("b", 0.04, 0.03), _point("c", [0, 1, 2], [0.8, 0.8, 0.8])]
    adjust_gains(results, "holm")
    assert [r.summary["gain_vs_best_reference"].p_adjusted for r in results[:2]] == pytest.approx([0.02, 0.04])
    assert [r.summary["gain_vs_local"].p_adjusted for r in results[:2]] == pytest.approx([0.04, 0.04])
    assert "gain_vs_local" not in results[2].summary
    # a metric only one side has: nothing to pair
    ref = _point("ref", [0, 1, 2], [0.7, 0.7, 0.7])
    del ref.summary["acc_mean"]
    assert paired(results[2], ref, "acc_mean") is None


def test_holm_adjusts_by_hand():
    def with_p(p):
        return stats.Summary(0.1, 0.1, 0.1, 3, p=p, p_adjusted=p)

    # sorted 0.01, 0.03, 0.04 times 3, 2, 1 = 0.03, 0.06, 0.04; made monotone: 0.03, 0.06, 0.06
    adjusted = stats.adjust([with_p(0.01), with_p(0.04), with_p(0.03), with_p(math.nan)], "holm")
    assert [d.p_adjusted for d in adjusted[:3]] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(adjusted[3].p_adjusted) and [d.p for d in adjusted[:3]] == [0.01, 0.04, 0.03]
    assert [d.p_adjusted for d in stats.adjust([with_p(0.01), with_p(0.04)], "none")] == [0.01, 0.04]
    assert [d.significant for d in adjusted] == [True, False, False, False]


def test_a_difference_significant_alone_is_not_once_corrected_for_the_table(capsys):
    import sys

    ref = _point("local", [0, 1, 2], [0.80, 0.85, 0.90])
    # +0.0226, +0.0326, +0.0426: t = 0.0326 / (0.01 / sqrt 3) = 5.646, p = 0.030 alone
    a = _point("a", [0, 1, 2], [0.8226, 0.8826, 0.9426])
    b = _point("b", [0, 1, 2], [0.8226, 0.8826, 0.9426])
    print_comparison([ref, a, b], "local", sys.stdout, correction="none")
    raw = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(("a ", "b "))]
    assert len(raw) == 2 and all("p=0.030 *" in line for line in raw)
    print_comparison([ref, a, b], "local", sys.stdout)  # Holm over the two: 2 x 0.030
    out = capsys.readouterr().out
    held = [line for line in out.splitlines() if line.strip().startswith(("a ", "b "))]
    assert all("p=0.060" in line and "*" not in line for line in held)
    assert "p adjusted by Holm's method" in out


# -- the spec key ----------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("[]", "at least one seed"),
    ("[0, 0]", "more than once"),
    ("[1, -2]", ">= 0"),
    ("[0, 1.5]", "integer"),
    ('"0,1"', "expected a list"),
    ("[true]", "integer"),
])
def test_bad_seeds_are_one_line_naming_the_key(tmp_path, capsys, value, message):
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--set", f"experiment.seeds={value}", "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "experiment.seeds" in line and message in line


def test_dry_run_shows_the_seeds(tmp_path, capsys):
    code, out, _ = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--set", "experiment.seeds=[3,1]", "--dry-run")
    assert code == 0
    assert "seeds = [\n    3,\n    1,\n]" in out and "# seeds: 3, 1 (2 runs" in out  # tomli-w: one item a line


def test_compare_to_must_name_a_run(tmp_path, capsys):
    raw = tiny_raw(**{"experiment.compare_to": "fedprox"})
    raw["sweep"] = {"algorithm.name": ["local", "fedavg"]}
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "experiment.compare_to" in line and "local, fedavg" in line


# -- a repeated run --------------------------------------------------------------------------


def test_each_seed_is_a_whole_experiment_equal_to_a_single_run_with_that_seed(tmp_path):
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 5], "algorithm.name": "local"})
    results = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True,
                            out=open(tmp_path / "out.txt", "w"))
    (point,) = results
    assert point.seeds == [0, 5]
    for seed, run in zip(point.seeds, point.runs):
        single = Engine(resolve(tiny_raw(**{"experiment.rounds": 2, "experiment.seed": seed,
                                            "algorithm.name": "local"})), progress=False).run()
        assert run.final["acc_mean"] == single.final["acc_mean"]
        assert [r["num_train"] for r in run.client_rows] == [r["num_train"] for r in single.client_rows]
    # the seeds differ in partition (domain sizes are drawn) or training: not the same run twice
    assert point.runs[0].client_rows != point.runs[1].client_rows
    assert point.summary["acc_mean"].mean == pytest.approx(np.mean([r.final["acc_mean"] for r in point.runs]))


def test_parent_run_holds_mean_std_ci95_and_the_seed_table_children_are_nested(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1, 2], "tracking.enabled": True})
    (point,) = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri,
                             out=open(tmp_path / "out.txt", "w"))
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(point.run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{point.run_id}'")
    assert sorted(c.data.params["experiment.seed"] for c in children) == ["0", "1", "2"]
    accs = [c.data.metrics["acc_mean"] for c in children]
    expected = stats.summarize(accs)
    m = parent.data.metrics
    assert m["acc_mean"] == pytest.approx(expected.mean)
    assert m["acc_mean_std"] == pytest.approx(expected.std)
    assert m["acc_mean_ci95"] == pytest.approx(expected.ci95)
    assert parent.info.status == "FINISHED" and parent.data.params["experiment.seeds"] == "[0, 1, 2]"
    path = client.download_artifacts(point.run_id, "results/seeds.csv", str(tmp_path))
    lines = open(path).read().splitlines()
    assert lines[0].startswith("seed,") and len(lines) == 4


def test_the_points_parent_runs_hold_the_tables_differences_and_the_csv_agrees(tmp_path):
    import csv

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1, 2], "tracking.enabled": True})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local", "fedprox"]}
    results = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out_dir=str(tmp_path / "o"),
                            out=open(tmp_path / "out.txt", "w"))
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    by_name = {r.name: r for r in results}
    rows = {(r["run"], r["metric"]): r for r in csv.DictReader(open(tmp_path / "o" / "differences.csv"))}
    # the default family (report.correction_family = "table"): every compared metric x both runs
    compared = [(k, n) for k in COMPARED if k in by_name["fedavg"].summary for n in ("local", "fedprox")]
    assert len(compared) >= 4
    family = [stats.paired_difference(by_name[n].values(k), by_name["fedavg"].values(k)) for k, n in compared]
    holm = dict(zip(compared, stats.adjust(family, "holm")))
    for name, expected in ((n, holm[("acc_mean", n)]) for n in ("local", "fedprox")):
        m = client.get_run(by_name[name].run_id).data.metrics
        assert m["delta_acc_mean"] == pytest.approx(expected.mean)
        assert m["delta_acc_mean_ci95"] == pytest.approx(expected.ci95)
        if not math.isnan(expected.p):
            assert m["delta_acc_mean_p"] == pytest.approx(expected.p)
            assert m["delta_acc_mean_p_adjusted"] == pytest.approx(expected.p_adjusted)
            assert float(rows[(name, "acc_mean")]["p_adjusted"]) == pytest.approx(expected.p_adjusted, abs=1e-5)
        assert float(rows[(name, "acc_mean")]["mean"]) == pytest.approx(expected.mean, abs=1e-5)
    assert "delta_acc_mean" not in client.get_run(by_name["fedavg"].run_id).data.metrics  # the reference


def test_a_points_parent_holds_the_per_round_mean_curve_and_band_and_the_study_its_pictures(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 3, "experiment.seeds": [0, 1, 2], "tracking.enabled": True,
                      "evaluation.every": 1})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    results = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri,
                            out=open(tmp_path / "out.txt", "w"))
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    for point in results:
        children = client.search_runs([client.get_run(point.run_id).info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{point.run_id}'")
        by_seed = {c.info.run_id: {m.step: m.value for m in client.get_metric_history(c.info.run_id, "acc_mean")}
                   for c in children}
        mean = {m.step: m.value for m in client.get_metric_history(point.run_id, "acc_mean")}
        band = {m.step: m.value for m in client.get_metric_history(point.run_id, "acc_mean_ci95")}
        assert sorted(mean) == sorted(band) == [1, 2, 3]  # one value per evaluation round, no step 0
        for step in (1, 2, 3):
            expected = stats.summarize([history[step] for history in by_seed.values()])
            assert mean[step] == pytest.approx(expected.mean) and band[step] == pytest.approx(expected.ci95)
        assert client.get_run(point.run_id).data.tags["pfl.point"] == client.get_run(point.run_id).data.tags["pfl.study"]
    study_parent = client.get_run(results[0].run_id).data.tags["mlflow.parentRunId"]
    pictures = {a.path for a in client.list_artifacts(study_parent, "results")}
    assert {"results/acc_mean_curves.png", "results/final_acc_mean.png"} <= pictures
    assert "pfl.point" not in client.get_run(study_parent).data.tags  # the links list the points only
