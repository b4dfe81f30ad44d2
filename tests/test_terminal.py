"""Terminal output: human-readable bytes, the tqdm progress bar, run k/n, where results are."""

import io
import json
import sys

import mlflow
import pytest
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.spec import dump_toml
from pfl_core.tracking.terminal import Progress, human_bytes, human_seconds


@pytest.mark.parametrize("value, text", [
    (0, "0 B"), (0.0, "0 B"), (512, "512 B"), (999, "999 B"), (1000, "1.0 kB"), (16192, "16.2 kB"),
    (1_600_000, "1.6 MB"), (999_960, "1.0 MB"), (3_100_000_000, "3.1 GB"), (-2500, "-2.5 kB"),
    (float("nan"), "-"),
])
def test_human_bytes(value, text):
    assert human_bytes(value) == text


def test_human_seconds():
    assert human_seconds(0.42) == "0.4 s"
    assert human_seconds(125) == "2 min 05 s"
    assert human_seconds(3720) == "1 h 02 min"


def test_progress_bar_shows_elapsed_eta_and_metrics():
    stream = io.StringIO()
    bar = Progress(4, "run 2/6 fedprox", stream=stream)
    bar.update(1)
    bar.update(2, {"acc_mean": 0.5, "comm_up_bytes": 1_600_000.0})
    bar.update(4, {"acc_mean": 0.75, "comm_up_bytes": 3_200_000.0})
    text = stream.getvalue()
    assert "run 2/6 fedprox" in text and "4/4 rounds" in text
    assert "00:00<" in text  # elapsed < remaining
    assert "acc_mean 0.750" in text and "comm_up_bytes 3.2 MB" in text and "0.000" not in text
    Progress(4, "off", enabled=False).update(4, {"acc_mean": 1.0})  # disabled: nothing, no error


def write_spec(tmp_path, raw) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    return str(path)


def test_sweep_shows_run_k_of_n_and_a_loading_line_and_ends_with_the_mlflow_location(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny_raw(**{"experiment.rounds": 1, "tracking.enabled": True, "tracking.progress": True})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the loading line is for terminals
    code = run_main([write_spec(tmp_path, raw), "--tracking-uri", uri])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "run 1/2 fedavg" in err and "run 2/2 local" in err and "loading synthetic" in err
    assert "== comparison" in out and "per-client results" not in out
    assert f"tracking: {uri}, experiment 'tiny' (id " in out
    assert f"mlflow ui --backend-store-uri {uri}" in out
    experiment = mlflow.get_experiment_by_name("tiny")
    runs = f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    # a new browser would open GenAI without workflowType; the view holds the study's filter
    study = mlflow.search_runs([experiment.experiment_id], output_format="list")[0].data.tags["pfl.study"]
    assert f"charts: {runs}&viewStateShareKey=pfl-study-{study}&compareRunsMode=CHART" in out
    assert f"table:  {runs}&viewStateShareKey=pfl-study-{study}&compareRunsMode=TABLE" in out
    view = json.loads(json.loads(experiment.tags[f"mlflow.sharedViewState.pfl-study-{study}"])["state"])
    assert view["searchFilter"] == f"tags.`pfl.point` = '{study}'" and "metrics.`acc_mean`" in view["selectedColumns"]
    view = json.loads(experiment.tags["mlflow.sharedViewState.pfl-key-metrics"])  # the view that link opens
    assert json.loads(view["state"])["selectedColumns"] == ["metrics.`acc_mean`", "metrics.`acc_p10`",
                                                             "metrics.`comm_up_bytes`"]
    local = next(line for line in out.splitlines() if line.lstrip().startswith("local "))
    assert "0 B" in local and "0.0000" not in local.split("±")[-1]  # bytes column: never 0.0000


def test_quiet_prints_only_summaries_and_the_comparison(tmp_path, capsys):
    raw = tiny_raw(**{"experiment.rounds": 1, "tracking.progress": True})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    code = run_main([write_spec(tmp_path, raw), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0].startswith("-- fedavg: acc_mean") and lines[1].startswith("-- local: acc_mean")
    assert lines[2].startswith("== comparison (same seed, same partition) ==")
    assert lines[3].split() == ["run", "seeds", "rounds", "acc_mean", "acc_p10", "comm_up_bytes",
                                "budget.private_epochs", "budget.private_steps"]
    assert lines[4].split()[:3] == ["fedavg", "1", "1"]  # one run of 1 round
    assert len(lines) == 6 and "tracking:" not in out
