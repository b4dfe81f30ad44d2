"""Edges of the MLflow SQLite store (issue 33): a working directory or store path with a space,
a non-ASCII character, a ``%``, ``?`` or ``#`` (MLflow percent-encodes the URIs it makes,
SQLAlchemy decodes them); a new store on a full disk; the temporary files of a store creation
killed on the way (SQLite's ``-journal`` beside it)."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from test_cli import write_spec
from test_disk_faults import disk, empty, fill, one_error_line  # noqa: F401 - disk is a fixture
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.errors import PflError
from pfl_core.state.locations import artifact_root_for, plain_uri, sqlite_file, sqlite_uri

# -- the URI of a path and the path of a URI ---------------------------------------------------


def test_a_store_uri_is_percent_decoded_into_its_file():
    assert sqlite_file("sqlite:////home/u/My%20Runs/mlflow.db") == Path("/home/u/My Runs/mlflow.db")
    assert sqlite_file("sqlite:////tmp/a%20b%20%C3%A9/x.db?mode=ro") == Path("/tmp/a b é/x.db")
    assert sqlite_file("sqlite:////tmp/p%2541q%3Fx%23y/x.db") == Path("/tmp/p%41q?x#y/x.db")
    assert sqlite_file("sqlite:////tmp/a b/x.db") == Path("/tmp/a b/x.db")  # unencoded: as SQLAlchemy reads it
    assert sqlite_file("sqlite:///rel%20dir/x.db") == Path("rel dir/x.db")


def test_a_path_is_made_a_uri_with_only_what_sqlalchemy_decodes_encoded():
    assert sqlite_uri("/tmp/a b é/x.db") == "sqlite:////tmp/a b é/x.db"
    assert sqlite_uri("/tmp/p%41q?x#y/x.db") == "sqlite:////tmp/p%2541q%3Fx%23y/x.db"
    assert plain_uri("sqlite:////home/u/My%20Runs%20%C3%A9/mlflow.db") == "sqlite:////home/u/My Runs é/mlflow.db"
    assert plain_uri("sqlite:////tmp/p%2541q/x.db?mode=ro") == "sqlite:////tmp/p%2541q/x.db?mode=ro"
    assert plain_uri("sqlite:///mlflow.db") == "sqlite:///mlflow.db"
    assert plain_uri("http://localhost:5000/a%20b") == "http://localhost:5000/a%20b"
    assert artifact_root_for("sqlite:////tmp/p%2541q%20%C3%A9/x.db") == "file:///tmp/p%2541q%20%C3%A9/x-artifacts"


def test_pfl_results_reads_a_percent_encoded_store_uri(tmp_path):
    from pfl_core.study.stored import store_uri

    folder = tmp_path / "a b é"
    folder.mkdir()
    (folder / "mlflow.db").write_bytes(b"")
    uri = f"sqlite:///{tmp_path}/a%20b%20%C3%A9/mlflow.db"
    assert store_uri(uri) == f"sqlite:///{tmp_path}/a b é/mlflow.db"
    with pytest.raises(PflError, match="a b é/other.db does not exist"):
        store_uri(f"sqlite:///{tmp_path}/a%20b%20%C3%A9/other.db")


# -- a run and its resume in such a folder -----------------------------------------------------


@pytest.fixture
def stopped_at_round_3(monkeypatch):
    """SIGTERM as round 3 of 4 starts (round 2's checkpoint is written on the way out); the code
    version is frozen (other work on the tree must not make the resume refuse the checkpoint).
    Call the returned function to let the runs finish."""
    from pfl_core.engine import Engine
    from pfl_core.state import provenance

    run_round = Engine.run_round

    def interrupted_at_3(self, ctx, round, *args, **kwargs):
        if round == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return run_round(self, ctx, round, *args, **kwargs)

    monkeypatch.setattr(Engine, "run_round", interrupted_at_3)
    version = provenance.code_version(["fedavg"])
    monkeypatch.setattr(provenance, "code_version", lambda names: version)
    return lambda: monkeypatch.setattr(Engine, "run_round", run_round)


def tracked_spec(tmp_path, **overrides) -> str:
    raw = tiny_raw(**{"experiment.rounds": 4, "tracking.enabled": True, "executor.name": "sequential",
                      "checkpoint.every": 100, **overrides})
    return write_spec(tmp_path, raw)


def runs_and_steps(db: Path) -> tuple[dict[str, str], list[int]]:
    with sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True) as con:  # a SQLite URI: % ? # encoded
        runs = dict(con.execute("select run_uuid, status from runs").fetchall())
        steps = [s for (s,) in con.execute("select step from metrics where key = 'acc_mean' order by step")]
    return runs, steps


def assert_beside(folder: Path, db: Path, run_id: str) -> None:
    """The store, its checkpoints and artifacts all in ``folder``, under the names given."""
    assert {"mlflow.db", "checkpoints", "mlflow-artifacts"} <= {p.name for p in folder.iterdir()}
    assert (folder / "checkpoints" / run_id).is_dir()
    assert (folder / "mlflow-artifacts" / run_id / "artifacts" / "resolved_spec.toml").is_file()
    assert not list(folder.glob(".mlflow.db.creating-*"))


def test_the_default_store_in_a_folder_with_a_space_and_an_accent_runs_and_resumes(
        tmp_path, monkeypatch, capsys, stopped_at_round_3):
    """``cd "/tmp/a b é" && pfl-run SPEC`` then ``pfl-run --resume RUN_ID`` there: MLflow's
    default URI is ``sqlite:////tmp/a%20b%20%C3%A9/mlflow.db`` (both exited 2 saying the folder
    does not exist)."""
    import mlflow
    import mlflow.tracking._tracking_service.utils as tracking_utils

    folder = tmp_path / "My Runs é"
    folder.mkdir()
    spec = tracked_spec(tmp_path)  # no tracking.uri: MLflow's default, in the working directory
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)  # no store an earlier test chose
    assert "My%20Runs%20%C3%A9/mlflow.db" in mlflow.get_tracking_uri()

    assert run_main([spec, "--quiet"]) == 143, capsys.readouterr().err
    (run_id, status), = runs_and_steps(folder / "mlflow.db")[0].items()
    assert status == "KILLED"
    stopped_at_round_3()
    assert run_main(["--resume", run_id, "--quiet"]) == 0, capsys.readouterr().err
    assert runs_and_steps(folder / "mlflow.db") == ({run_id: "FINISHED"}, [1, 2, 3, 4])
    assert_beside(folder, folder / "mlflow.db", run_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["My Runs é", "spec.toml"]


def test_an_explicit_percent_encoded_tracking_uri_runs_and_its_resume_command_works(
        tmp_path, monkeypatch, capsys, stopped_at_round_3):
    """``--tracking-uri`` percent-encoded, to a folder whose name holds a space, an accent, and a
    ``%41``, ``?`` and ``#`` that are part of the name (decoded once, as SQLAlchemy does: not
    into ``A``); the resume command pfl prints on the way out finishes the run."""
    folder = tmp_path / "a b é %41 ?#"
    folder.mkdir()
    uri = f"sqlite:///{tmp_path}/a%20b%20%C3%A9%20%2541%20%3F%23/mlflow.db"
    monkeypatch.chdir(tmp_path)
    assert run_main([tracked_spec(tmp_path), "--quiet", "--tracking-uri", uri]) == 143
    err = capsys.readouterr().err
    command = err.split("continue it with: ")[1].strip()
    (run_id, _), = runs_and_steps(folder / "mlflow.db")[0].items()
    # said as pfl hands it to MLflow: only the % ? # encoded (MLflow makes a folder of it undecoded)
    assert command == f"pfl-run --resume {run_id} --tracking-uri 'sqlite:///{tmp_path}/a b é %2541 %3F%23/mlflow.db'"
    stopped_at_round_3()
    assert run_main(shlex.split(command)[1:] + ["--quiet"]) == 0, capsys.readouterr().err
    assert runs_and_steps(folder / "mlflow.db") == ({run_id: "FINISHED"}, [1, 2, 3, 4])
    assert_beside(folder, folder / "mlflow.db", run_id)
    # nothing written elsewhere (MLflow 3.17 makes an empty folder of the store's URI undecoded, here
    # "a b é %2541 %3F%23": a %, ? or # in a path cannot be passed it any other way)
    written = [p.name for p in tmp_path.iterdir() if not (p.is_dir() and not any(p.iterdir()))]
    assert sorted(written) == ["a b é %41 ?#", "spec.toml"]


# -- a new store on a full disk ----------------------------------------------------------------


def test_a_new_store_on_a_full_disk_is_one_line_naming_it_and_leaves_nothing(tmp_path, capsys, disk):  # noqa: F811
    volume = disk("1m")
    fill(volume)
    uri = f"sqlite:///{volume}/mlflow.db"
    spec = tracked_spec(tmp_path, **{"experiment.rounds": 1, "checkpoint.dir": str(tmp_path / "ck")})
    code = run_main([spec, "--quiet", "--tracking-uri", uri])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    # the new store is a copy of the template store (store_check.template_store): the OS's words
    assert line == (f"pfl-run: error: tracking.uri {uri}: the store cannot be created in {volume} (No space "
                    f"left on device); give another tracking.uri, or run with --no-tracking")
    # the lock file every run on this store waits on stays, as it does beside a store made
    assert sorted(p.name for p in volume.iterdir() if not p.name.startswith("filler-")) == ["mlflow.db.lock"]
    empty(volume)
    assert run_main([spec, "--quiet", "--tracking-uri", uri]) == 0, capsys.readouterr().err
    assert runs_and_steps(volume / "mlflow.db")[1] == [1]


def test_a_failure_of_the_store_creation_that_is_not_the_disk_is_raised_as_it_is(tmp_path, monkeypatch):
    import mlflow

    from pfl_core.tracking.store_check import create_sqlite_store

    def broken(self, *args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(mlflow.MlflowClient, "search_experiments", broken)
    with pytest.raises(ValueError, match="a bug"):
        create_sqlite_store(sqlite_uri(tmp_path / "new.db"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.db.lock"]


# -- the temporary files of a creation ---------------------------------------------------------


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.parametrize("name", ["new.db", "runs [1].db"])
def test_the_journal_of_a_killed_creation_is_removed_and_a_live_ones_kept(tmp_path, name):
    """A SIGKILL during the creation leaves the temporary store and SQLite's ``-journal`` (or
    ``-wal``, ``-shm``) beside it: a dead process's are removed, a live one's (this process's
    parent) stay. A ``[`` in the store's name is not a glob pattern."""
    from pfl_core.tracking.store_check import create_sqlite_store

    dead = f".{name}.creating-{dead_pid()}-abcd1234"
    live = f".{name}.creating-{os.getppid()}-abcd1234"
    for leftover in (dead, f"{dead}-journal", f"{dead}-wal", f"{dead}-shm", live, f"{live}-journal"):
        (tmp_path / leftover).write_bytes(b"half a store")
    create_sqlite_store(sqlite_uri(tmp_path / name))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, f"{name}.lock", live, f"{live}-journal"])
    assert (tmp_path / name).stat().st_size > 0


def test_a_creation_that_fails_removes_its_own_journal(tmp_path, monkeypatch):
    """The creation stops with the temporary store's rollback journal beside it (an exception
    mid-transaction): both are removed."""
    import mlflow

    from pfl_core.tracking.store_check import create_sqlite_store, template_cache

    search = mlflow.MlflowClient.search_experiments

    def stopped_mid_write(self, *args, **kwargs):
        search(self, *args, **kwargs)
        # MLflow writes the template store (copied into every new store), in the cache
        (tmp, ) = template_cache().glob(".*.creating-*")
        tmp.with_name(tmp.name + "-journal").write_bytes(b"a hot journal")
        raise KeyboardInterrupt

    monkeypatch.setattr(mlflow.MlflowClient, "search_experiments", stopped_mid_write)
    with pytest.raises(KeyboardInterrupt):
        create_sqlite_store(sqlite_uri(tmp_path / "new.db"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.db.lock"]
    assert [p.name for p in template_cache().iterdir() if not p.name.endswith(".lock")] == []
