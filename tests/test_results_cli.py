"""``pfl results``: a stored study's table is the table pfl-run printed, rebuilt from the MLflow
store alone; studies are found by id, prefix, experiment name and "last"; exports and curves."""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, write_spec
from tiny import tiny_raw

from pfl_core.cli import main
from pfl_core.study import run_spec_file, stats
from pfl_core.study.report import p_text
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
    results = run_spec_file(write_spec(folder, raw), [], quiet=True, tracking_uri=uri, out=printed,
                            out_dir=str(folder / "out"))
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
    assert md.splitlines()[0] == ("| run | seeds | rounds | acc_mean | acc_p10 | comm_up_bytes | budget.private_epochs "
                                  "| budget.private_steps | Δacc_mean vs fedavg | Δacc_p10 vs fedavg |")
    row = next(line for line in md.splitlines() if line.startswith(f"| {best.name} |"))
    assert row.split(" | ")[1:3] == ["2", "2"]  # 2 seeds, 2 rounds
    budget = [f"{best.summary[k].mean:g}" for k in ("budget.private_epochs", "budget.private_steps")]
    assert row.split(" | ")[6:8] == budget and float(budget[1]) > float(budget[0])  # both units, each its own
    assert f"**{best.summary['acc_mean'].mean:.4f} ± {best.summary['acc_mean'].ci95:.4f}**" in row
    assert sum(line.count("**") for line in md.splitlines() if "acc_mean" not in line) == 2 * 2  # one per column
    _, tex, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "latex")
    assert tex.startswith(r"\begin{tabular}") and rf"\textbf{{{best.summary['acc_mean'].mean:.4f}}} \pm" in tex
    assert "fedavg" in tex and r"\bottomrule" in tex
    assert (r"run & seeds & rounds & acc\_mean & acc\_p10 & comm\_up\_bytes & budget.private\_epochs & "
            r"budget.private\_steps & $\Delta$ acc\_mean vs fedavg & $\Delta$ acc\_p10 vs fedavg \\") in tex
    _, text, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "csv")
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(text))}
    for name in ("fedavg", "local", "fedprox"):
        assert float(rows[name]["acc_mean"]) == by_name[name].summary["acc_mean"].mean  # unrounded
        assert float(rows[name]["acc_mean_ci95"]) == by_name[name].summary["acc_mean"].ci95
        assert (rows[name]["seeds"], rows[name]["rounds"]) == ("2", "2")


def _header_cells(line: str) -> list[str]:
    return re.split(r" {2,}", line.strip())


def test_every_format_has_the_terminals_columns_and_the_same_numbers(store, capsys):
    """One table model: the terminal, Markdown, LaTeX and CSV name the same columns in the same
    order (CSV: a mean and its _ci95, a difference's mean, _low, _high, _p, _p_adjusted), and
    the CSV's unrounded numbers print as the terminal's cells."""
    uri, _, results = store
    _, out, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri)
    block = comparison_block(out).splitlines()
    terminal = _header_cells(block[1])
    assert terminal == ["run", "seeds", "rounds", "acc_mean", "acc_p10", "comm_up_bytes", "budget.private_epochs",
                        "budget.private_steps", "Δacc_mean vs fedavg", "Δacc_p10 vs fedavg"]
    _, md, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "markdown")
    assert md.splitlines()[0].strip("| ").split(" | ") == terminal
    _, tex, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "latex")
    header = next(line for line in tex.splitlines() if line.startswith("run & "))
    assert [c.replace("$\\Delta$ ", "Δ").replace("\\_", "_") for c in header.removesuffix(r" \\").split(" & ")] == terminal
    _, text, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "csv")
    table = list(csv.DictReader(io.StringIO(text)))
    assert list(table[0]) == ["run", "seeds", "rounds", "acc_mean", "acc_mean_ci95", "acc_p10", "acc_p10_ci95",
                              "comm_up_bytes", "budget.private_epochs", "budget.private_steps",
                              *[f"delta_{k}{part}" for k in ("acc_mean", "acc_p10")
                                for part in ("", "_low", "_high", "_p", "_p_adjusted")]]
    for line, row in zip(block[2:2 + len(results)], table):
        cells = re.split(r" {2,}", line.strip())
        assert cells[:3] == [row["run"], row["seeds"], row["rounds"]]
        assert cells[3] == f"{float(row['acc_mean']):.4f} ± {float(row['acc_mean_ci95']):.4f}"
        assert cells[6:8] == [f"{float(row[k]):g}" for k in ("budget.private_epochs", "budget.private_steps")]
        if row["run"] == "fedavg":  # the compared-to run: no difference from itself
            assert cells[8:] == ["-", "-"] and row["delta_acc_mean"] == ""
            continue
        d = stats.Summary(float(row["delta_acc_mean"]), math.nan, math.nan, 2, float(row["delta_acc_mean_p"]),
                          float(row["delta_acc_mean_p_adjusted"]))
        low, high = float(row["delta_acc_mean_low"]), float(row["delta_acc_mean_high"])
        assert cells[8] == (f"{d.mean:+.4f} [{low:+.4f}, {high:+.4f}] {p_text(d.p_adjusted)}"
                            + (" *" if d.significant else ""))


def test_pfl_results_shows_the_rounds_each_point_ran(tmp_path, capsys):
    """A sweep over experiment.rounds: each row says its own rounds, in the table and the CSV."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"tracking.enabled": True})
    raw["sweep"] = {"experiment.rounds": [1, 3]}
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=io.StringIO())
    mlflow.set_tracking_uri(None)
    _, out, _ = pfl(capsys, "results", "last", "--tracking-uri", uri)
    rows = comparison_block(out).splitlines()[2:4]
    assert [row.split()[:3] for row in rows] == [["fedavg", "rounds=1", "1"], ["fedavg", "rounds=3", "1"]]
    assert [_header_cells(row)[2] for row in rows] == ["1", "3"]
    _, text, _ = pfl(capsys, "results", "last", "--tracking-uri", uri, "--format", "csv")
    assert [(r["run"], r["rounds"]) for r in csv.DictReader(io.StringIO(text))] == [("fedavg rounds=1", "1"),
                                                                                   ("fedavg rounds=3", "3")]


def test_out_writes_the_same_table_csv_as_pfl_results(store, capsys):
    """pfl-run --out's table.csv is the printed table, as `pfl results --format csv` exports it."""
    uri, _, _ = store
    folder = uri.removeprefix("sqlite:///").removesuffix("/mlflow.db")
    _, text, _ = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--format", "csv")
    assert (Path(folder) / "out" / "table.csv").read_bytes().decode() == text


def test_the_plot_draws_each_methods_mean_curve_over_its_seeds(store, capsys, tmp_path, monkeypatch):
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
    code, out, err = pfl(capsys, "results", "last", "--tracking-uri", uri, "--plot", str(picture), "--format", "csv")
    assert code == 0, err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # where the picture went, on stderr: stdout is the CSV alone
    said = f"plot: {picture} (acc_mean by round, each point's mean over 1 seed(s) with its 95% band)"
    assert err.splitlines() == [said]
    assert out.splitlines()[0].startswith("run,seeds,rounds,")
    # a relative path is said in full
    monkeypatch.chdir(tmp_path)
    _, _, err = pfl(capsys, "results", "sweep", "--tracking-uri", uri, "--plot", "rel.png")
    said = f"plot: {tmp_path / 'rel.png'} (acc_mean by round, each point's mean over 2 seed(s) with its 95% band)"
    assert err.splitlines() == [said] and (tmp_path / "rel.png").is_file()
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
        assert p_text(d.p_adjusted) in row[4]
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
        got = [float(row[k]) for k in ("difference", "difference_low", "difference_high", "difference_p",
                                       "difference_p_adjusted")]
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
