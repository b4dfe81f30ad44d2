"""``report.correction_family``: Holm over the whole table (the default) or over each metric's
comparisons, hand-computed on a hand-built table of 3 methods against a reference on 2 metrics,
in every place the table is shown (terminal, differences.csv, ``pfl results`` exports), and the
family named under the table (issue 34)."""

from __future__ import annotations

import csv
import io
import math
import sqlite3

import mlflow
import pytest
from scipy import stats as scipy_stats
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.cli import main
from pfl_core.engine import RunResult
from pfl_core.study import run_spec_file, stats
from pfl_core.study.compare import comparisons
from pfl_core.study.points import PointResult
from pfl_core.study.report import print_comparison
from pfl_core.study.results import differences_csv
from pfl_core.study.stored import Table, latex, markdown

SEEDS = [0, 1, 2]
REFERENCE = {"acc_mean": [0.80, 0.85, 0.90], "acc_p10": [0.50, 0.55, 0.60]}
# (method, metric) -> (mean, spread) of the per-seed differences mean - spread, mean, mean + spread
DIFFERENCES = {("a", "acc_mean"): (0.05, 0.0095), ("b", "acc_mean"): (0.03, 0.02), ("c", "acc_mean"): (0.01, 0.03),
               ("a", "acc_p10"): (0.04, 0.004), ("b", "acc_p10"): (0.02, 0.01), ("c", "acc_p10"): (-0.01, 0.02)}
METRICS = ["acc_mean", "acc_p10"]


def _point(name: str, values: dict[str, list[float]]) -> PointResult:
    runs = [RunResult(history=[], client_rows=[], final={k: v[i] for k, v in values.items()}) for i in range(3)]
    return PointResult(name, SEEDS, runs, {k: stats.summarize(v) for k, v in values.items()})


def _table() -> list[PointResult]:
    """The reference "ref", then a, b, c: each seed's value is the reference's plus the difference."""
    points = [_point("ref", REFERENCE)]
    for method in ("a", "b", "c"):
        values = {}
        for metric in METRICS:
            mean, spread = DIFFERENCES[(method, metric)]
            values[metric] = [r + d for r, d in zip(REFERENCE[metric], (mean - spread, mean, mean + spread))]
        points.append(_point(method, values))
    return points


def _raw_p(key) -> float:
    """The paired t-test's two-sided p of 3 differences with sample std ``spread``: t = mean √3 / spread."""
    mean, spread = DIFFERENCES[key]
    return 2 * scipy_stats.t.sf(abs(mean) * math.sqrt(3) / spread, df=2)


def _holm(p: dict) -> dict:
    """By hand: sort ascending, multiply the i-th smallest (i from 0) by m - i, running max, clip at 1."""
    out, running = {}, 0.0
    for i, (key, value) in enumerate(sorted(p.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (len(p) - i) * value))
        out[key] = running
    return out


def _expected(family: str) -> dict:
    raw = {key: _raw_p(key) for key in DIFFERENCES}
    if family == "table":
        return _holm(raw)
    return {k: v for metric in METRICS for k, v in _holm({k: p for k, p in raw.items() if k[1] == metric}).items()}


@pytest.mark.parametrize("family", ["table", "metric"])
def test_holm_over_a_hand_built_table_for_both_families(family):
    points = _table()
    found = comparisons(points, points[0], METRICS, "holm", family)
    expected = _expected(family)
    assert sorted(found) == sorted(expected)
    for key, d in found.items():
        assert d.p == pytest.approx(_raw_p(key), rel=1e-9)
        assert d.p_adjusted == pytest.approx(expected[key], rel=1e-9), key
    assert [k for k in found] == [(m, metric) for metric in METRICS for m in ("a", "b", "c")]  # the table's order


def test_the_two_families_differ_where_the_hand_computation_says():
    table, metric = _expected("table"), _expected("metric")
    # a's acc_mean: p 0.0118; Holm x3 over its metric = 0.035 (significant), x5 over the table
    # (second smallest of 6) = 0.059 (not); a's acc_p10 (the smallest p) is significant under both
    assert metric[("a", "acc_mean")] == pytest.approx(3 * _raw_p(("a", "acc_mean")))
    assert table[("a", "acc_mean")] == pytest.approx(5 * _raw_p(("a", "acc_mean")))
    assert table[("a", "acc_p10")] == pytest.approx(6 * _raw_p(("a", "acc_p10")))
    points = _table()
    by_family = {f: comparisons(points, points[0], METRICS, "holm", f) for f in ("table", "metric")}
    assert by_family["metric"][("a", "acc_mean")].significant
    assert not by_family["table"][("a", "acc_mean")].significant
    assert all(by_family[f][("a", "acc_p10")].significant for f in by_family)
    # no correction: the raw p in both families
    for f in ("table", "metric"):
        raw = comparisons(points, points[0], METRICS, "none", f)
        assert all(d.p_adjusted == d.p for d in raw.values())


def _row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(f"{name} "))


def test_the_printed_table_shows_the_familys_p_and_names_the_family_and_its_size():
    points = _table()
    printed = {}
    for family in ("table", "metric"):
        out = io.StringIO()
        print_comparison(points, "ref", out, "holm", family=family)
        printed[family] = out.getvalue()
    a_table, a_metric = _row(printed["table"], "a"), _row(printed["metric"], "a")
    assert f"p={_expected('table')[('a', 'acc_mean')]:.3f}" in a_table  # p=0.059, no star on it
    assert f"p={_expected('metric')[('a', 'acc_mean')]:.3f} *" in a_metric  # p=0.035 *
    assert a_table.count("*") == 1 and a_metric.count("*") == 2
    assert ("p adjusted by Holm's method over all 6 comparisons of this table "
            '(report.correction_family = "table")') in printed["table"]
    assert "over each metric's 3 comparisons, a family per metric" in printed["metric"]
    assert 'report.correction_family = "metric"' in printed["metric"]
    out = io.StringIO()
    print_comparison(points, "ref", out, "none", family="table")
    assert 'p not adjusted for multiple comparisons (report.correction = "none")' in out.getvalue()


@pytest.mark.parametrize("family", ["table", "metric"])
def test_differences_csv_has_the_printed_p_and_names_its_family(family):
    rows = {(r["run"], r["metric"]): r for r in csv.DictReader(io.StringIO(differences_csv(_table(), "ref", "holm",
                                                                                          family)))}
    for key, p in _expected(family).items():
        assert float(rows[key]["p_adjusted"]) == pytest.approx(p, abs=1e-6)  # the CSV has 6 digits
        assert rows[key]["p_family"] == ("table" if family == "table" else key[1])
    assert rows[("a", "acc_mean")]["significant"] == ("true" if family == "metric" else "false")


@pytest.mark.parametrize("family", ["table", "metric"])
def test_the_markdown_and_latex_exports_carry_the_familys_p_and_name_it(family):
    table = Table(_table(), "ref", "holm", "passes", "", family=family)
    p = _expected(family)[("a", "acc_mean")]
    md, tex = markdown(table), latex(table)
    a_line = next(line for line in md.splitlines() if line.startswith("| a "))
    assert f"p={p:.3f}" in a_line
    tex_line = next(line for line in tex.splitlines() if line.startswith("a &"))
    assert f"p={p:.3f}" in tex_line
    words = "all 6 comparisons of this table" if family == "table" else "each metric's 3 comparisons, a family per metric"
    assert words in md and "% comparison (3 seeds, mean ± 95% interval)" in tex and words in tex


def test_the_family_is_a_spec_key_and_a_bad_value_is_one_line_naming_it(tmp_path, capsys):
    code, out, _ = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--dry-run")
    assert code == 0 and 'correction_family = "table"' in out  # the default, shown in the resolved spec
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--set", "report.correction_family=each",
                           "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "report.correction_family" in line and "'table'" in line and "'metric'" in line


def test_pfl_results_uses_the_stored_family_and_a_study_stored_before_it_existed_per_metric(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1, 2], "tracking.enabled": True})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local", "fedprox"]}
    printed = io.StringIO()
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=printed)
    mlflow.set_tracking_uri(None)
    assert "comparisons of this table" in printed.getvalue()

    def shown() -> str:
        assert main(["results", "last", "--tracking-uri", uri]) == 0
        return capsys.readouterr().out

    assert _legend(shown()) == _legend(printed.getvalue())
    # a store written before report.correction_family existed: that study's p were per metric
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("DELETE FROM params WHERE key = 'report.correction_family'")
    assert 'report.correction_family = "metric"' in _legend(shown())


def _legend(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("(Δ: paired difference"))
