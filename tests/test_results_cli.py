"""``pfl results``: a stored study's table is the table pfl-run printed, rebuilt from the MLflow
store alone; studies are found by id, prefix, experiment name and "last"; exports and curves."""

from __future__ import annotations

import csv
import io
import re

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, write_spec
from tiny import tiny_raw

from pfl_core.cli import main
from pfl_core.study import run_spec_file, stats
from pfl_core.study.stored import curves, find, load, studies


def pfl(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def comparison_block(text: str) -> str:
    return text[text.index("== comparison"):].split("\n\n")[0].strip()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two studies in one store: a 3-method sweep over 2 seeds (printed output kept), then one run."""
    folder = tmp_path_factory.mktemp("results")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 1], "tracking.enabled": True,
                      "evaluation.every": 1, "experiment.name": "sweep_study"})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local", "fedprox"]}
    printed = io.StringIO()
    results = run_spec_file(write_spec(folder, raw), [], quiet=True, tracking_uri=uri, out=printed)
    single = tiny_raw(**{"experiment.rounds": 1, "tracking.enabled": True, "experiment.name": "single_study"})
    run_spec_file(write_spec(folder, single, "single.toml"), [], quiet=True, tracking_uri=uri, out=io.StringIO())
    mlflow.set_tracking_uri(None)
    return uri, printed.getvalue(), results


def test_a_stored_studys_table_is_the_table_pfl_run_printed(store, capsys):
    uri, printed, _ = store
    code, out, err = pfl(capsys, "results", "sweep", "--tracking-uri", uri)
    assert code == 0, err
    assert comparison_block(out) == comparison_block(printed)


def test_the_list_names_each_study_newest_first(store, capsys):
    uri, _, _ = store
    code, out, _ = pfl(capsys, "results", "--tracking-uri", uri)
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split() == ["study", "date", "experiment", "methods", "seeds", "tuned", "status", "runs"]
    assert "single_study" in lines[1] and "sweep_study" in lines[2] and len(lines) == 3
    assert "fedavg, local, fedprox" in lines[2] and lines[2].split()[-3:] == ["no", "FINISHED", "10"]
    assert re.match(r"\w{12} +\d{4}-\d\d-\d\d \d\d:\d\d ", lines[2]), lines[2]  # id, then the date


def test_a_study_is_found_by_last_id_prefix_and_name(store):
    uri, _, results = store
    found = studies(MlflowClient(tracking_uri=uri))
    sweep_id = MlflowClient(tracking_uri=uri).get_run(results[0].run_id).data.tags["pfl.study"]
    assert find(found, "last").experiment == "single_study"
    assert find(found, sweep_id).id == find(found, sweep_id[:5]).id == find(found, "sweep").id == sweep_id


@pytest.mark.parametrize("args, words", [
    (["nosuch"], "no study 'nosuch' in this store"),
    (["swep_study"], "did you mean 'sweep_study'"),
])
def test_an_unknown_study_is_one_line_and_exit_2(store, capsys, args, words):
    uri, _, _ = store
    code, _, err = pfl(capsys, "results", *args, "--tracking-uri", uri)
    assert code == 2 and words in one_line_error(err)


def test_a_missing_store_is_one_line_and_creates_nothing(tmp_path, capsys):
    code, _, err = pfl(capsys, "results", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}")
    assert code == 2 and "no MLflow store at" in one_line_error(err)
    assert not (tmp_path / "none.db").exists()


def test_exports_bold_the_best_and_carry_the_numbers(store, capsys):
    uri, _, results = store
    by_name = {r.name: r for r in results}
    best = max(results, key=lambda r: r.summary["acc_mean"].mean)
    _, md, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "markdown")
    assert md.splitlines()[0] == ("| run | seeds | acc_mean | acc_p10 | budget.private_epochs | budget.private_steps "
                                  "| Δacc_mean vs fedavg | Δacc_p10 vs fedavg |")
    row = next(line for line in md.splitlines() if line.startswith(f"| {best.name} |"))
    budget = [f"{best.summary[k].mean:g}" for k in ("budget.private_epochs", "budget.private_steps")]
    assert row.split(" | ")[4:6] == budget and float(budget[1]) > float(budget[0])  # both units, each its own
    assert f"**{best.summary['acc_mean'].mean:.4f} ± {best.summary['acc_mean'].ci95:.4f}**" in row
    assert sum(line.count("**") for line in md.splitlines() if "acc_mean" not in line) == 2 * 2  # one per column
    _, tex, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "latex")
    assert tex.startswith(r"\begin{tabular}") and rf"\textbf{{{best.summary['acc_mean'].mean:.4f}}} \pm" in tex
    assert "fedavg" in tex and r"\bottomrule" in tex
    assert r"run & acc\_mean & acc\_p10 & $\Delta$ acc\_mean vs fedavg & $\Delta$ acc\_p10 vs fedavg \\" in tex
    _, text, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "csv")
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(text))}
    for name in ("fedavg", "local", "fedprox"):
        assert float(rows[name]["acc_mean_mean"]) == pytest.approx(by_name[name].summary["acc_mean"].mean)
        assert float(rows[name]["acc_mean_ci95"]) == pytest.approx(by_name[name].summary["acc_mean"].ci95)


def test_the_plot_draws_each_methods_mean_curve_over_its_seeds(store, capsys, tmp_path):
    uri, _, results = store
    client = MlflowClient(tracking_uri=uri)
    table = load(client, find(studies(client), "sweep"))
    drawn = {name: (steps, means, half) for name, steps, means, half in curves(client, table, "acc_mean")}
    assert set(drawn) == {"fedavg", "local", "fedprox"}
    for result in results:
        steps, means, half = drawn[result.name]
        assert steps == [1, 2]
        for i, step in enumerate(steps):
            expected = stats.summarize([row["acc_mean"] for run in result.runs for row in run.history
                                        if row["round"] == step])
            assert means[i] == pytest.approx(expected.mean) and half[i] == pytest.approx(expected.ci95)
    picture = tmp_path / "curves.png"
    code, _, err = pfl(capsys, "results", "last", "--tracking-uri", uri, "--plot", str(picture), "--format", "csv")
    assert code == 0, err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--plot", str(tmp_path / "x.png"),
                       "--metric", "acc_meen")
    assert code == 2 and "did you mean 'acc_mean'" in one_line_error(err)


def test_a_tuned_study_says_so_in_the_list_and_above_its_table(tmp_path, capsys, monkeypatch):
    from test_tune import tune_raw

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    printed = io.StringIO()
    run_spec_file(write_spec(tmp_path, tune_raw(trials=2, **{"tracking.enabled": True})), [], quiet=True,
                  tracking_uri=uri, out=printed)
    mlflow.set_tracking_uri(None)
    _, listing, _ = pfl(capsys, "results", "--tracking-uri", uri)
    assert listing.splitlines()[1].split()[-3:] == ["yes", "FINISHED", str(len(studies(MlflowClient(uri))[0].runs))]
    _, out, _ = pfl(capsys, "results", "last", "--tracking-uri", uri)
    tuned_line = next(line for line in printed.getvalue().splitlines() if line.startswith("tuned: "))
    assert tuned_line in out.splitlines()
    assert comparison_block(out) == comparison_block(printed.getvalue())


def test_a_study_with_reference_runs_is_rebuilt_with_its_gains(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1], "tracking.enabled": True,
                      "experiment.reference": ["local"]})
    raw["sweep"] = {"algorithm.name": ["fedavg", "fedprox"]}
    printed = io.StringIO()
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=printed)
    mlflow.set_tracking_uri(None)
    code, out, err = pfl(capsys, "results", "last", "--tracking-uri", uri)
    assert code == 0, err
    assert "gain_vs_local" in comparison_block(out) and "local (reference)" in comparison_block(out)
    assert comparison_block(out) == comparison_block(printed.getvalue())


def test_a_point_left_out_by_pfl_run_is_left_out_of_its_stored_table(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 1], "tracking.enabled": True,
                      "experiment.name": "diverging", "experiment.compare_to": "fedavg"})
    raw["sweep"] = {"points": [{"algorithm": {"name": "fedavg"}},
                               {"algorithm": {"name": "fedprox"}, "training.lr": 1e9},
                               {"algorithm": {"name": "local"}}]}
    printed = io.StringIO()
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=printed)
    mlflow.set_tracking_uri(None)
    _, listing, _ = pfl(capsys, "results", "--tracking-uri", uri)
    assert "FINISHED" in listing.splitlines()[1]  # the study finished, though one of its points stopped
    _, table, _ = pfl(capsys, "results", "last", "--tracking-uri", uri)
    block = printed.getvalue()[printed.getvalue().index("== comparison"):]
    assert table.splitlines()[-len(block.splitlines()) + 1:] == block.splitlines()[1:]  # as pfl-run printed it
    _, md, _ = pfl(capsys, "results", "last", "--tracking-uri", uri, "--format", "markdown")
    assert "| fedprox" not in md and "left out: fedprox lr=1000000000.0 diverged on seed 0 (round 1" in md


def test_paired_compares_two_metrics_of_the_same_runs_per_point_holm_adjusted(store, capsys):
    """acc_mean - acc_p10 per seed run, hand-computed from the run results, Holm over the 3 points."""
    uri, _, results = store
    code, md, err = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--paired", "acc_mean,acc_p10")
    assert code == 0, err
    assert md.splitlines()[0] == "| run | seeds | acc_mean | acc_p10 | acc_mean - acc_p10 |"
    diffs = [stats.paired_difference([r.final["acc_mean"] for r in p.runs], [r.final["acc_p10"] for r in p.runs])
             for p in results]
    adjusted = stats.adjust(diffs, "holm")
    for point, d in zip(results, adjusted):
        row = next(line for line in md.splitlines() if line.startswith(f"| {point.name} |")).split(" | ")
        assert row[1] == "2"
        assert row[2].startswith(f"{point.summary['acc_mean'].mean:.4f} ± ")
        assert row[3].startswith(f"{point.summary['acc_p10'].mean:.4f} ± ")
        assert row[4].startswith(f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]")
        if d.p_adjusted >= 0.001:
            assert f"p={d.p_adjusted:.3f}" in row[4]
    # reversed, the difference changes sign and nothing else
    _, reverse, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--paired", "acc_p10,acc_mean")
    first = next(line for line in reverse.splitlines() if line.startswith(f"| {results[0].name} |"))
    assert first.split(" | ")[4].startswith(f"{-adjusted[0].mean:+.4f} [{-adjusted[0].high:+.4f}, {-adjusted[0].low:+.4f}]")


def test_paired_csv_holds_the_unrounded_numbers_and_latex_the_markdown_cells(store, capsys):
    """--format csv: per point the means, intervals, the paired difference and both p-values,
    hand-computed (Holm over the 3 points); latex: the Markdown's cells, names escaped."""
    uri, _, results = store
    code, text, err = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--paired", "acc_mean,acc_p10",
                          "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(text)))
    diffs = stats.adjust([stats.paired_difference([r.final["acc_mean"] for r in p.runs],
                                                  [r.final["acc_p10"] for r in p.runs]) for p in results], "holm")
    assert [row["run"] for row in rows] == [p.name for p in results]
    for row, point, d in zip(rows, results, diffs):
        assert int(row["seeds"]) == 2
        assert float(row["acc_mean"]) == pytest.approx(point.summary["acc_mean"].mean)
        assert float(row["acc_p10_ci95"]) == pytest.approx(point.summary["acc_p10"].ci95)
        got = [float(row[k]) for k in ("difference", "difference_low", "difference_high", "p", "p_adjusted")]
        assert got == pytest.approx([d.mean, d.low, d.high, d.p, d.p_adjusted])
    _, tex, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--paired", "acc_mean,acc_p10",
                    "--format", "latex")
    assert r"run & seeds & acc\_mean & acc\_p10 & acc\_mean $-$ acc\_p10 \\" in tex
    line = next(x for x in tex.splitlines() if x.startswith(results[0].name.replace("_", r"\_") + " & "))
    d = diffs[0]
    assert f"${d.mean:+.4f}$ [{d.low:+.4f}, {d.high:+.4f}]" in line
    assert line.count(r" \pm ") == 2 and tex.rstrip().endswith("* = adjusted p < 0.05")


@pytest.mark.parametrize("study, value, words", [
    ("sweep", "acc_mean", "give two different metrics as A,B (got 'acc_mean')"),
    ("sweep", "acc_mean,acc_mean", "give two different metrics"),
    ("sweep", "acc_mean,acc_p1", "'acc_p1' is missing (did you mean 'acc_p10'?)"),
    ("sweep", "acc_p1,acc_mean", "'acc_p1' is missing (did you mean 'acc_p10'?)"),  # either side
    (None, "acc_mean,acc_p10", "give STUDY"),
])
def test_paired_bad_input_is_one_line_and_exit_2(store, capsys, study, value, words):
    uri, _, _ = store
    code, _, err = pfl(capsys, "results", *([study] if study else []), "--tracking-uri", uri, "--paired", value)
    assert code == 2 and words in one_line_error(err)


def test_paired_leaves_out_a_point_whose_runs_did_not_all_log_both_metrics():
    """A hand-made table: 'partial' lacks B on one seed run (left out, not paired over the rest);
    'complete' has both on all three: B - A = 1, 2, 3 -> mean 2, p from the t-test on (1, 2, 3)."""
    from pfl_core.engine import RunResult
    from pfl_core.study.points import PointResult
    from pfl_core.study.stored import Table, within_runs

    def point(name, finals):
        runs = [RunResult(history=[], client_rows=[], final=f, run_id=None) for f in finals]
        return PointResult(name, list(range(len(runs))), runs, {})

    complete = point("complete", [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 3.0}, {"a": 1.0, "b": 4.0}])
    partial = point("partial", [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.5}, {"a": 1.0}])
    rows = within_runs(Table([partial, complete], "complete", "holm", "passes", ""), "b", "a")
    assert [name for name, *_ in rows] == ["complete"]
    _, b, a, d = rows[0]
    assert (a.mean, b.mean, d.mean, d.n) == (1.0, 3.0, 2.0, 3)
    assert d.p == pytest.approx(stats.paired_difference([2.0, 3.0, 4.0], [1.0, 1.0, 1.0]).p)
