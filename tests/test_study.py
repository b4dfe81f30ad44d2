"""One pfl-run invocation is one MLflow study: a parent run over the sweep points (seeds nested
under their point), every run tagged with the study id, the spec's git commit, its
description, the tracking URI; model-training experiments with artifacts beside the store."""

import csv
import os
import subprocess
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from tiny import tiny_raw

from pfl_core.runtime.context import RunContext
from pfl_core.spec import dump_toml
from pfl_core.state.locations import artifact_root_for
from pfl_core.study import run_spec_file
from pfl_core.tracking.study import spec_header
from pfl_core.tracking.tracker import NullTracker

GIT_COMMIT = "mlflow.source.git.commit"
PARENT = "mlflow.parentRunId"


def git(cwd, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def write(path: Path, raw: dict, header: str = "") -> str:
    path.write_text(header + dump_toml(raw))
    return str(path)


def all_runs(uri: str, experiment: str):
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client, exp, client.search_runs([exp.experiment_id])


def test_a_sweep_with_seeds_is_one_study_tree_with_git_note_uri_and_kind(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1], "tracking.enabled": True,
                      "experiment.description": "Does FedAvg beat Local here?"})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    spec = write(repo / "spec.toml", raw, "# the header, not the note\n")
    git(repo, "init", "-q")
    git(repo, "add", "spec.toml")
    git(repo, "commit", "-q", "-m", "spec")
    commit = git(repo, "rev-parse", "HEAD")
    uri = f"sqlite:///{tmp_path / 'store' / 'runs.db'}"
    (tmp_path / "store").mkdir()
    shown = run_spec_file(spec, [], quiet=True, tracking_uri=uri, out=open(tmp_path / "out.txt", "w"))
    client, exp, runs = all_runs(uri, "tiny")

    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert Path(exp.artifact_location.removeprefix("file://")) == tmp_path / "store" / "runs-artifacts"
    assert len(runs) == 1 + 2 + 4
    tops = [r for r in runs if PARENT not in r.data.tags]
    assert len(tops) == 1
    study = tops[0]
    points = [r for r in runs if r.data.tags.get(PARENT) == study.info.run_id]
    assert sorted(r.info.run_name for r in points) == ["fedavg", "local"]
    assert {r.info.run_id for r in points} == {p.run_id for p in shown}
    for point in points:
        seeds = [r for r in runs if r.data.tags.get(PARENT) == point.info.run_id]
        assert sorted(r.info.run_name for r in seeds) == [f"{point.info.run_name} seed=0",
                                                           f"{point.info.run_name} seed=1"]
    study_id = study.data.tags["pfl.study"]
    assert study.info.run_name.startswith("tiny ") and study_id[:6] in study.info.run_name
    for run in runs:
        tags = run.data.tags
        assert tags["pfl.study"] == study_id
        assert tags[GIT_COMMIT] == commit
        assert tags["mlflow.note.content"] == "Does FedAvg beat Local here?"
        assert tags["pfl.tracking_uri"] == uri
        assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path / "store")
    # the study's params: what the points share; its artefact: the comparison table
    assert study.data.params["training.lr"] == "0.1" and "algorithm.name" not in study.data.params
    assert study.data.tags["pfl.sweep"] == "algorithm.name" and study.info.status == "FINISHED"
    assert study.data.tags["pfl.best_run"] in ("fedavg", "local") and "best_acc_mean" in study.data.metrics
    path = client.download_artifacts(study.info.run_id, "results/comparison.csv", str(tmp_path))
    rows = list(csv.DictReader(open(path)))
    assert [r["run"] for r in rows] == ["fedavg", "local"] and rows[0]["seeds"] == "2"
    assert float(rows[0]["acc_mean"]) == pytest.approx(shown[0].summary["acc_mean"].mean, rel=1e-5)
    # the clients' final accuracy: one picture on the study (a box per point) and on each point (per seed)
    for run in [study, *points]:
        assert "results/client_accuracy.png" in {a.path for a in client.list_artifacts(run.info.run_id, "results")}
    assert study.data.params["tracking.uri"] == uri and points[0].data.params["tracking.uri"] == uri

    # a second invocation: its own study, its own top-level name
    run_spec_file(spec, [], quiet=True, tracking_uri=uri, out=open(tmp_path / "out.txt", "w"))
    _, _, runs = all_runs(uri, "tiny")
    tops = [r for r in runs if PARENT not in r.data.tags]
    assert len(tops) == 2 and len({r.info.run_name for r in tops}) == 2
    assert len({r.data.tags["pfl.study"] for r in runs}) == 2


def test_a_single_run_has_no_parent_no_git_outside_a_checkout_and_the_header_as_note(tmp_path):
    if subprocess.run(["git", "-C", str(tmp_path), "rev-parse"], capture_output=True).returncode == 0:
        pytest.skip("the temporary directory is inside a git checkout")
    raw = tiny_raw(**{"experiment.rounds": 1, "tracking.enabled": True, "algorithm.name": "fedalt"})
    header = "# FedAlt on the tiny data.\n#\n#   pfl-run spec.toml\n\n"
    spec = write(tmp_path / "spec.toml", raw, header)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (point,) = run_spec_file(spec, [], quiet=True, tracking_uri=uri, out=open(tmp_path / "out.txt", "w"))
    _, exp, runs = all_runs(uri, "tiny")
    (run,) = runs
    assert run.info.run_id == point.run_id and run.info.run_name == "fedalt"
    tags = run.data.tags
    assert PARENT not in tags and tags["pfl.study"]
    assert not any(k.startswith("mlflow.source.git.") for k in tags)  # not even pfl-run's own checkout
    assert tags["mlflow.note.content"] == "FedAlt on the tiny data.\n\n  pfl-run spec.toml"
    assert tags["pfl.tracking_uri"] == uri
    assert Path(exp.artifact_location.removeprefix("file://")) == tmp_path / "mlflow-artifacts"
    # the partial-model plugins' head, as resolved for the model (head_layers = none: L - L // 2)
    resolved = {k: v for k, v in run.data.params.items() if k.startswith("resolved.head_layers.")}
    assert list(resolved.values()) == ["1"], run.data.params


def test_one_point_with_seeds_keeps_its_parent_as_the_top_run(tmp_path):
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1], "tracking.enabled": True})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (point,) = run_spec_file(write(tmp_path / "s.toml", raw), [], quiet=True, tracking_uri=uri,
                             out=open(tmp_path / "out.txt", "w"))
    _, _, runs = all_runs(uri, "tiny")
    (top,) = [r for r in runs if PARENT not in r.data.tags]
    assert top.info.run_id == point.run_id and len(runs) == 3
    assert len({r.data.tags["pfl.study"] for r in runs}) == 1


def test_artifact_root_beside_a_sqlite_file_only():
    assert artifact_root_for("sqlite:////tmp/x.db") == "file:///tmp/x-artifacts"
    assert artifact_root_for("sqlite:///rel/x.db") == Path("rel/x-artifacts").resolve().as_uri()
    assert artifact_root_for("http://localhost:5000") is None
    assert artifact_root_for("file:///tmp/mlruns") is None


def test_spec_header_stops_at_the_first_line_that_is_not_a_comment(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("# one\n#two\n#\n# three\n[experiment]\n# not this\n")
    assert spec_header(str(path)) == "one\ntwo\n\nthree"
    assert spec_header(str(tmp_path / "missing.toml")) == ""


def test_resolved_value_is_logged_once_as_a_resolved_param():
    class Params(NullTracker):
        def __init__(self):
            self.params = []

        def log_param(self, key, value):
            self.params.append((key, value))

    ctx = RunContext.__new__(RunContext)
    ctx.resolved_values, ctx.tracker = {}, Params()
    ctx.resolved_value("num_clusters", 3)
    ctx.resolved_value("num_clusters", 3)
    assert ctx.tracker.params == [("resolved.num_clusters", 3)] and ctx.resolved_values == {"num_clusters": 3}


def _sweep_spec(tmp_path, values, **overrides):
    from test_cli import write_spec
    from tiny import tiny_raw

    raw = tiny_raw(**{"experiment.rounds": 1, **overrides})
    raw["sweep"] = {"training.lr": values}
    return write_spec(tmp_path, raw)


def test_a_study_of_more_than_100_runs_needs_yes_and_a_dry_run_says_its_size(tmp_path, capsys, monkeypatch):
    from pfl_core.cli import run_main
    from pfl_core.errors import PflError
    from pfl_core.study import run as study_run

    spec = _sweep_spec(tmp_path, [0.01 + i / 1000 for i in range(34)], **{"experiment.seeds": [0, 1, 2]})
    assert run_main([spec, "--quiet"]) == 2  # 34 points x 3 seeds = 102 runs
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "34 sweep point(s) x 3 seed(s): 102 runs, more than 100; run it with --yes" in err

    def stop(*args, **kwargs):
        raise PflError("stopped at the first run")

    monkeypatch.setattr(study_run, "run_point", stop)
    assert run_main([spec, "--quiet", "--yes"]) == 2
    assert "stopped at the first run" in capsys.readouterr().err  # --yes: past the size check

    small = _sweep_spec(tmp_path, [0.01, 0.02], **{"experiment.seeds": [0, 1, 2]})
    assert run_main([small, "--quiet"]) == 2 and "stopped at the first run" in capsys.readouterr().err


def test_a_dry_run_of_a_large_study_says_its_size_first(tmp_path, capsys, monkeypatch):
    from pfl_core.cli import run_main
    from pfl_core.study import run as study_run

    monkeypatch.setattr(study_run, "dry_run_report", lambda points, out: None)  # the size line is the point
    spec = _sweep_spec(tmp_path, [0.01 + i / 1000 for i in range(101)])
    assert run_main([spec, "--dry-run"]) == 0
    assert "note: a dry run of 101 sweep point(s) x 1 seed(s): 101 runs" in capsys.readouterr().err


def test_a_bad_value_in_the_last_sweep_point_is_said_before_the_first_point_trains(tmp_path, capsys, monkeypatch):
    """The last point's partition cannot be made (more samples per client than the data holds,
    which only building the data finds): the study stops with its one line before any trains."""
    from test_cli import write_spec
    from tiny import tiny_raw

    from pfl_core.cli import run_main
    from pfl_core.engine import Engine

    monkeypatch.setattr(Engine, "run_round", lambda *a, **k: pytest.fail("a round trained"))
    raw = tiny_raw(**{"experiment.rounds": 1})
    raw["sweep"] = {"partition.min_samples": [10, 10_000]}
    assert run_main([write_spec(tmp_path, raw), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "min_samples" in err, err
