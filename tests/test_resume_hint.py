"""Issue 35, item 2: the resume hint. An interrupted study of several runs says the command that
completes the whole study (``pfl-run SPEC --resume`` with the options it was given), not the
``--resume RUN`` that finishes the one interrupted run; and ``pfl-run --resume RUN`` on a run of a
study says, once the run finished, which command completes the rest of its study."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import Engine
from pfl_core.state import provenance
from pfl_core.tracking.study import RESUME_TAG

SEEDS_SET = "experiment.seeds=[0,1]"  # as the issue's `--set 'experiment.seeds=[0,1,2]'`: it needs quoting


def study_raw(db: Path) -> dict:
    """Two methods x two seeds (4 runs), each 3 rounds, one checkpoint per round."""
    return tiny_raw(**{"tracking.enabled": True, "tracking.uri": f"sqlite:///{db}", "executor.name": "sequential",
                       "checkpoint.every": 1, "sweep": {"algorithm.name": ["local", "fedavg"]}})


@pytest.fixture
def fixed_code(monkeypatch):
    """The code version checkpoints record, fixed: other work on the tree must not refuse a resume."""
    version = provenance.code_version(["fedavg"])
    monkeypatch.setattr(provenance, "code_version", lambda names: version)


def interrupt_second_run(monkeypatch, at_round: int = 2):
    """SIGINT as the study's second run starts round ``at_round`` (its earlier rounds
    checkpointed); returns Engine.run_round as it was, to put back."""
    run_round = Engine.run_round
    runs: list[int] = []

    def interrupting(self, ctx, round, *args, **kwargs):
        if round == 1:
            runs.append(1)
        if len(runs) == 2 and round == at_round:
            os.kill(os.getpid(), signal.SIGINT)  # the command line's handler raises here
        return run_round(self, ctx, round, *args, **kwargs)

    monkeypatch.setattr(Engine, "run_round", interrupting)
    return run_round


def statuses(db: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return dict(con.execute("select name, status from runs").fetchall())


def study_of(uri: str, run_name: str, status: str) -> list:
    """The seed runs of the study whose run ``run_name`` has ``status``."""
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    study = next(r.data.tags["pfl.study"] for r in runs if r.info.run_name == run_name and r.info.status == status)
    return [r for r in runs if r.data.tags.get("pfl.study") == study and "seed=" in r.info.run_name]


def test_an_interrupted_study_says_the_command_that_completes_it_and_that_command_does(
        tmp_path, monkeypatch, capsys, fixed_code):
    """The issue's scenario: Ctrl-C in a study of methods x seeds printed `pfl-run --resume RUN`,
    which finished one run; the other runs never ran and no comparison was printed."""
    monkeypatch.chdir(tmp_path)
    db, out_dir = tmp_path / "store.db", tmp_path / "results"
    uri = f"sqlite:///{db}"
    spec = write_spec(tmp_path, study_raw(tmp_path / "elsewhere.db"))  # --tracking-uri overrides it
    run_round = interrupt_second_run(monkeypatch)
    args = [spec, "--set", SEEDS_SET, "--sweep", "training.lr=0.1", "--tracking-uri", uri, "--out", str(out_dir)]
    assert run_main([*args, "--quiet"]) == 130
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert "interrupted (SIGINT) at round 2 of 3 of run 'local lr=0.1 seed=1'" in line, line
    assert "continue it with" not in line and "--resume RUN" not in line, line
    command = line.split("continue the whole study (4 runs; those that finished are kept) with: ")[1]
    assert command == (f"pfl-run {spec} --resume --set '{SEEDS_SET}' --sweep training.lr=0.1 --tracking-uri {uri} "
                       f"--out {out_dir} --overwrite")
    assert statuses(db)["local lr=0.1 seed=1"] == "KILLED" and (out_dir / "INCOMPLETE").exists()

    monkeypatch.setattr(Engine, "run_round", run_round)
    words = shlex.split(command)
    assert words[0] == "pfl-run"
    assert run_main(words[1:]) == 0
    printed = capsys.readouterr().out
    assert "== comparison" in printed and "local" in printed and "fedavg" in printed, printed
    assert "kept: run" in printed  # the seed that finished before the stop is not run again
    finished = study_of(uri, "local lr=0.1 seed=1", "FINISHED")
    names = [f"{method} lr=0.1 seed={seed}" for method in ("fedavg", "local") for seed in (0, 1)]
    assert sorted(r.info.run_name for r in finished) == names
    assert {r.info.status for r in finished} == {"FINISHED"}
    assert not (out_dir / "INCOMPLETE").exists() and (out_dir / "comparison.csv").exists()
    mlflow.set_tracking_uri(None)


@pytest.mark.parametrize("seeds", [False, True], ids=["two methods", "one method, two seeds"])
def test_an_interrupted_untracked_study_says_the_command_that_runs_it_again(tmp_path, monkeypatch, capsys, seeds):
    """Nothing of an untracked study is kept: the hint runs it again, with --no-tracking as given.
    One point over seeds is a study too: --resume RUN would finish one seed of it."""
    monkeypatch.chdir(tmp_path)
    raw = study_raw(tmp_path / "store.db")
    if seeds:
        raw.pop("sweep")
        raw["experiment"]["seeds"] = [0, 1]
    spec = write_spec(tmp_path, raw)
    interrupt_second_run(monkeypatch)
    assert run_main([spec, "--no-tracking", "--quiet"]) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"; run the whole study (2 runs; untracked, nothing is kept) again with: "
                         f"pfl-run {spec} --no-tracking"), line
    assert not (tmp_path / "store.db").exists() and not (tmp_path / "mlflow.db").exists()


def test_resume_of_one_run_of_a_study_says_the_command_that_completes_the_rest(
        tmp_path, monkeypatch, capsys, fixed_code):
    """`pfl-run --resume RUN` finishes the run, then names the study's command (from the run's
    tag: the spec's absolute path and the options it was started with), which keeps that run."""
    db = tmp_path / "store.db"
    uri = f"sqlite:///{db}"
    spec = write_spec(tmp_path, study_raw(db))
    monkeypatch.chdir(tmp_path)
    run_round = interrupt_second_run(monkeypatch)
    assert run_main([Path(spec).name, "--set", SEEDS_SET, "--quiet"]) == 130  # the spec by a relative path
    capsys.readouterr()
    monkeypatch.setattr(Engine, "run_round", run_round)
    monkeypatch.chdir(tmp_path.parent)  # elsewhere: the recorded spec path is absolute
    (killed,) = [r for r in study_of(uri, "local seed=1", "KILLED") if r.info.status == "KILLED"]
    expected = f"pfl-run {Path(spec).resolve()} --resume --set '{SEEDS_SET}'"
    assert killed.data.tags[RESUME_TAG] == expected

    assert run_main(["--resume", killed.info.run_id, "--tracking-uri", uri, "--quiet"]) == 0
    err = capsys.readouterr().err
    (note,) = err.strip().splitlines()
    assert note == (f"note: run 'local seed=1' is one run of study {killed.data.tags['pfl.study']}; complete the "
                    f"rest of the study with: {expected} --tracking-uri {uri}"), err
    assert statuses(db)["local seed=1"] == "FINISHED"

    command = note.split("complete the rest of the study with: ")[1]
    assert run_main(shlex.split(command)[1:] + ["--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "== comparison" in printed
    assert printed.count("kept: run") == 2  # local's two seeds: the first, and the one --resume RUN finished
    mlflow.set_tracking_uri(None)


def test_resume_of_a_run_of_a_study_logged_without_the_command_says_how_to_write_it(
        tmp_path, monkeypatch, capsys, fixed_code):
    """A study logged before pfl recorded its command: the note says to give its spec and options."""
    db = tmp_path / "store.db"
    uri = f"sqlite:///{db}"
    monkeypatch.chdir(tmp_path)
    run_round = interrupt_second_run(monkeypatch)
    assert run_main([write_spec(tmp_path, study_raw(db)), "--set", SEEDS_SET, "--quiet"]) == 130
    capsys.readouterr()
    (killed,) = [r for r in study_of(uri, "local seed=1", "KILLED") if r.info.status == "KILLED"]
    MlflowClient(tracking_uri=uri).delete_tag(killed.info.run_id, RESUME_TAG)
    monkeypatch.setattr(Engine, "run_round", run_round)
    assert run_main(["--resume", killed.info.run_id, "--tracking-uri", uri, "--quiet"]) == 0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.endswith(f"complete the rest of the study with its spec: pfl-run SPEC --resume --tracking-uri {uri}, "
                         f"adding the --set and --sweep options the study was started with"), note
    mlflow.set_tracking_uri(None)


def test_resume_of_a_single_run_says_nothing_more(tmp_path, monkeypatch, capsys, fixed_code):
    """A run on its own: its --resume finishes everything there was; no note."""
    db = tmp_path / "store.db"
    monkeypatch.chdir(tmp_path)
    raw = study_raw(db)
    del raw["sweep"]
    run_round = Engine.run_round

    def interrupting(self, ctx, round, *args, **kwargs):
        if round == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return run_round(self, ctx, round, *args, **kwargs)

    monkeypatch.setattr(Engine, "run_round", interrupting)
    assert run_main([write_spec(tmp_path, raw), "--quiet"]) == 130
    line = capsys.readouterr().err.strip()
    assert "; continue it with: pfl-run --resume " in line and "whole study" not in line, line
    monkeypatch.setattr(Engine, "run_round", run_round)
    assert run_main(shlex.split(line.split("continue it with: ")[1])[1:] + ["--quiet"]) == 0
    assert capsys.readouterr().err.strip() == ""
    mlflow.set_tracking_uri(None)


def test_the_note_reads_the_study_s_command_from_the_run_and_none_for_a_superseded_or_lone_run(tmp_path):
    from pfl_core.study.resume import rest_of_study
    from pfl_core.study.reuse import SUPERSEDED_TAG

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("e")
    command = "pfl-run '/a b/spec.toml' --resume"

    def run_with(**tags) -> str:
        return client.create_run(experiment, tags=tags, run_name="r").info.run_id

    assert rest_of_study(run_with(**{"pfl.study": "s1", RESUME_TAG: command}), uri, "r") == (
        f"run 'r' is one run of study s1; complete the rest of the study with: {command} --tracking-uri {uri}")
    assert rest_of_study(run_with(**{"pfl.study": "s1", RESUME_TAG: command, SUPERSEDED_TAG: "s2"}), uri, "r") is None
    assert rest_of_study(run_with(**{"pfl.study": "s1"}), uri, "r") is None  # a run on its own
    assert rest_of_study("no-such-run", uri, "r") is None
