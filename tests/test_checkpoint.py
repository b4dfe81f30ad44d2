"""Checkpoint and resume (issue 12): a run SIGKILLed between rounds, mid-round (during local
training) and during evaluation, then resumed with ``pfl-run --resume``, logs exactly the metrics
(every key, every step, once) and ends in exactly the state (server and every client) of the
same run left alone; a changed spec or damaged checkpoint is handled in one line.

The kill is real: the run is a forked copy of this process (torch and MLflow already imported,
so no start-up cost) in which tests/killpoints.py patches the chosen point to send itself
SIGKILL; the parent checks it died of SIGKILL. Resumes and the uninterrupted reference runs run
in this process, through the command line's own entry point. Every store is a copy of one
empty store made once (creating an MLflow store costs a second of migrations).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import write_spec
from harness import NEEDS
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.state import stateio
from pfl_core.state.checkpoint import CLIENTS_DIR, CLIENTS_FILE, RUN_FILE, checkpoints
from pfl_core.state.provenance import code_version as real_code_version

WALL_CLOCK = ("round_seconds", "eval_seconds")  # differ between any two runs

PUBLIC = {"public.size": 60}
METHODS = {  # one method of each kind the issue names
    "fedavg": {},  # weights
    "ditto": {"algorithm.name": "ditto"},  # personal state
    "fedmosaic": {"algorithm.name": "fedmosaic", **PUBLIC},  # label-only
    "cosmos": {"algorithm.name": "cosmos", **PUBLIC, "model.arch_params": {},  # server models
               "algorithm.params": {"server_arch": "mlp", "pretrain_epochs": 1, "server_epochs": 1}},
    "fedsimsup": {"algorithm.name": "fedsimsup", "experiment.participation": 0.5,  # partial participation
                  "algorithm.params.supervisor": "mlp",
                  "algorithm.params.supervisor_arch_params": {"mlp": {"hidden": [4]}}},
}
NEW_METHODS = ("scaffold", "feddyn", "fednova", "fedadam", "fedyogi", "moon", "fedrod", "fedala", "fedamp",
               "fedfomo", "apple", "feddbe", "fedgen", "fedcp", "gpfl",
               "pfedhn", "fedem", "cfl", "knnper", "fedlc", "fedntd", "fd", "fedkd", "fml", "pfedla", "fedgh", "ccvr", "elastic", "fedadmm",
               "metafed", "fedap", "fedcac", "fedsr", "fedpcl", "fedmtl", "fedcross", "fedah",
               "pfedsim", "fedgc", "flute", "fediir", "pflda", "pefll", "floco", "adcol", "fedfed")  # issue 38
METHODS.update({name: {"algorithm.name": name, **NEEDS.get(name, {})} for name in NEW_METHODS})


@pytest.fixture(autouse=True)
def same_code_all_along(monkeypatch):
    """The code version, computed for real once and then kept: other work on the source tree
    while these tests run must not make a resume refuse its checkpoint."""
    monkeypatch.setattr("pfl_core.state.provenance.code_version", frozen_code_version)


def frozen_code_version(names, _computed={}):
    key = tuple(sorted(set(names)))
    if key not in _computed:
        _computed[key] = real_code_version(list(key))
    return _computed[key]


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    import mlflow

    db = tmp_path_factory.mktemp("template") / "empty.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # creates the tables
    return db


def spec_for(tmp_path: Path, store: str, rounds: int, every: int, template: Path | None = None,
             **overrides) -> str:
    if template is not None:
        shutil.copyfile(template, tmp_path / store)
    raw = tiny_raw(**{"experiment.rounds": rounds, "tracking.enabled": True, "tracking.progress": False,
                      "tracking.uri": f"sqlite:///{tmp_path / store}", "executor.name": "sequential",
                      "checkpoint.every": every, **overrides})
    return write_spec(tmp_path, raw, f"{store}.toml")


def killed(points: list[str], *args: str) -> None:
    """``pfl-run ARGS`` with faults injected, in a forked copy of this process; it must die of
    SIGKILL (a point that is never reached fails the test)."""
    import killpoints

    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 99
        try:
            for point in points:
                killpoints.arm(point)
            code = run_main(list(args))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"{points}: the run was not killed (exit status {os.waitstatus_to_exitcode(status)})")


def only_run(db: Path) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        runs = con.execute("select run_uuid from runs").fetchall()
    assert len(runs) == 1, runs
    return runs[0][0]


def metrics(db: Path) -> list[tuple[str, int, float]]:
    """Every (key, step, value) the store's one run logged, wall-clock keys left out (a value
    logged twice appears twice)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("select key, step, value from metrics").fetchall()
    return sorted((k, s, v) for k, s, v in rows if k not in WALL_CLOCK)


def status(db: Path) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute("select status from runs").fetchone()[0]


def final_state(db: Path, rounds: int) -> tuple[dict, dict]:
    """(server state, {file: client state}) of the run's checkpoint of its last round."""
    folder = db.parent / "checkpoints" / only_run(db)
    last = checkpoints(folder)[0]
    assert last.name == f"round-{rounds:06d}"
    server = stateio.load(last / RUN_FILE)["server"]
    if (last / CLIENTS_DIR).is_dir():
        clients = {p.name: stateio.load(p) for p in sorted((last / CLIENTS_DIR).glob("*.safetensors"))}
    else:
        clients = {CLIENTS_FILE: stateio.load(last / CLIENTS_FILE)}
    return server, clients


def assert_identical(a, b, where: str = "") -> None:
    """Exactly equal: same nesting, same tensor dtypes, shapes and bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f"{where}: arrays differ"
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def resume(*args: str) -> None:
    code = run_main(["--resume", *args, "--quiet"])
    assert code == 0


# method, kills (each resume but the last is killed again), rounds, checkpoint.every
CASES = [
    # every kind of kill on one run: at round 3's start (round 2 checkpointed), mid-training in
    # round 4 (round 3 was logged, not checkpointed: its metrics must not be logged twice), at
    # round 5's evaluation (round 4 checkpointed)
    ("fedavg", [["round:3"], ["train:4:5"], ["eval:5"]], 5, 2),
    ("ditto", [["train:3:7"]], 4, 1),
    ("fedmosaic", [["eval:3"]], 4, 1),
    ("cosmos", [["round:3"]], 3, 0),  # automatic period
    ("fedsimsup", [["train:2:3"]], 3, 1),
    # issue 23's methods: server state (control variates, optimiser moments, generators, cloud
    # models, personal heads, previous local models) resumes bit-identical too
    *[(name, [["round:3"]], 4, 1) for name in NEW_METHODS],
]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
@pytest.mark.parametrize("method,kills,rounds,every", CASES, ids=[c[0] for c in CASES])
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store, method, kills, rounds, every):
    overrides = METHODS[method]
    reference = tmp_path / "reference.db"
    assert run_main([spec_for(tmp_path, "reference.db", rounds, every, empty_store, **overrides), "--quiet"]) == 0

    db = tmp_path / "killed.db"
    spec = spec_for(tmp_path, "killed.db", rounds, every, empty_store, **overrides)
    killed(kills[0], spec)
    run_id = only_run(db)
    for points in kills[1:]:  # a resumed run killed again
        killed(points, "--resume", run_id, "--tracking-uri", f"sqlite:///{db}")
    resume(run_id, "--tracking-uri", f"sqlite:///{db}")

    assert only_run(db) == run_id and status(db) == "FINISHED"
    logged = metrics(db)
    assert len(logged) == len({(k, s) for k, s, _ in logged}), "a metric was logged twice for one step"
    assert logged == metrics(reference)
    server, clients = final_state(db, rounds)
    ref_server, ref_clients = final_state(reference, rounds)
    assert_identical(server, ref_server, "server")
    assert_identical(clients, ref_clients, "clients")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
@pytest.mark.parametrize("point, own_dir", [("ckpt-after:1", False), ("ckpt-after:1", True),
                                            ("ckpt-during:2", False), ("ckpt-before:2", True)])
def test_resume_by_run_id_after_a_kill_at_a_checkpoint_write(tmp_path, empty_store, point, own_dir):
    """Killed right after the first checkpoint, while writing the second, or as the second
    starts: ``--resume RUN_ID`` finds the run's checkpoints (its tag is written before the first
    one; without it, in the default folder) and ends bit-identical to the run left alone; a
    half-written checkpoint is removed. ``own_dir``: in a ``checkpoint.dir`` only the tag names."""
    reference = tmp_path / "reference.db"
    assert run_main([spec_for(tmp_path, "reference.db", 3, 1, empty_store), "--quiet"]) == 0
    db = tmp_path / "killed.db"
    where = {"checkpoint.dir": str(tmp_path / "elsewhere")} if own_dir else {}
    killed([point], spec_for(tmp_path, "killed.db", 3, 1, empty_store, **where))
    run_id = only_run(db)
    folder = (tmp_path / "elsewhere" if own_dir else db.parent / "checkpoints") / run_id
    half_written = list(folder.glob(".round-*.tmp-*"))
    assert bool(half_written) == point.startswith("ckpt-during")
    resume(run_id, "--tracking-uri", f"sqlite:///{db}")
    assert status(db) == "FINISHED" and metrics(db) == metrics(reference)
    if not own_dir:
        assert_identical(final_state(db, 3), final_state(reference, 3), "final state")
    assert not list(folder.glob(".round-*")), "a half-written checkpoint was left behind"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
@pytest.mark.parametrize("point", ["ckpt-before:1", "ckpt-during:1"])
def test_a_run_killed_before_its_first_checkpoint_is_complete_says_so(tmp_path, empty_store, capsys, point):
    db = tmp_path / "killed.db"
    killed([point], spec_for(tmp_path, "killed.db", 3, 1, empty_store))
    run_id = only_run(db)
    assert run_main(["--resume", run_id, "--tracking-uri", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"MLflow run {run_id} stopped before its first checkpoint" in err, err


def test_an_unwritable_checkpoint_folder_is_refused_before_round_1(tmp_path, empty_store, capsys, monkeypatch):
    from pfl_core.engine import Engine

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    spec = spec_for(tmp_path, "store.db", 2, 1, empty_store, **{"checkpoint.dir": str(blocker / "sub")})
    monkeypatch.setattr(Engine, "run_round", lambda *a, **k: pytest.fail("a round ran"))
    assert run_main([spec, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpoint.dir" in err and str(blocker / "sub") in err, err


# -- a failure at the end: --resume re-runs only the end ------------------------------------------


def test_a_failed_coldstart_is_rerun_alone_from_the_last_checkpoint(tmp_path, empty_store, monkeypatch, capsys):
    from pfl_core.engine import Engine

    db = tmp_path / "store.db"
    spec = spec_for(tmp_path, "store.db", 2, 0, empty_store, **{"experiment.coldstart_clients": 1})
    evaluate_coldstart = Engine._evaluate_coldstart

    def failing(self, ctx):
        raise RuntimeError("injected cold-start failure")

    monkeypatch.setattr(Engine, "_evaluate_coldstart", failing)
    assert run_main([spec, "--quiet"]) == 1  # reported; the trained run is kept
    assert "cold-start evaluation failed" in capsys.readouterr().err
    before = metrics(db)
    assert before and not any(k.startswith("coldstart_") for k, _, _ in before)

    def no_round(self, ctx, round, *args, **kwargs):
        raise AssertionError(f"round {round} ran again")

    monkeypatch.setattr(Engine, "_evaluate_coldstart", evaluate_coldstart)
    monkeypatch.setattr(Engine, "run_round", no_round)
    resume(only_run(db), "--tracking-uri", f"sqlite:///{db}")
    after = metrics(db)
    added = sorted(set(after) - set(before))
    assert added and all(k.startswith("coldstart_") and s == 2 for k, s, _ in added), added
    assert len(after) == len(before) + len(added)  # nothing else logged again


# -- refusals and damage: one line ----------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, empty_store):
    """A 2-round FedAvg run with a checkpoint after each round (both kept)."""
    tmp_path = tmp_path_factory.mktemp("finished")
    spec = spec_for(tmp_path, "store.db", 2, 1, empty_store)
    assert run_main([spec, "--quiet"]) == 0
    return tmp_path, spec, only_run(tmp_path / "store.db")


def test_a_different_spec_or_code_is_refused_naming_what_differs(finished_run, capsys, monkeypatch):
    tmp_path, spec, run_id = finished_run
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    assert run_main(["--resume", run_id, "--tracking-uri", uri, spec, "--set", "training.lr=0.2",
                     "--set", "experiment.seed=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "spec differs" in err and "training.lr" in err and "experiment.seed" in err, err
    # where and how often to checkpoint may change
    monkeypatch.setattr("pfl_core.engine.Engine.run_round", lambda *a, **k: pytest.fail("a round ran again"))
    assert run_main(["--resume", run_id, "--tracking-uri", uri, spec, "--set", "checkpoint.keep=3", "--quiet"]) == 0
    capsys.readouterr()

    monkeypatch.setattr("pfl_core.state.provenance.code_version",
                        lambda names: {"pfl": "0.1.0", "source_sha256": "0" * 64, "git_commit": ""})
    assert run_main(["--resume", run_id, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "written by other code" in err, err


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(finished_run, capsys, monkeypatch):
    tmp_path, spec, run_id = finished_run
    folder = tmp_path / "checkpoints" / run_id
    copy = tmp_path / "damaged"
    import shutil

    shutil.copytree(folder, copy)
    latest = checkpoints(copy)[0]
    victim = next(p for p in sorted(latest.rglob("*")) if p.is_file() and p.name != RUN_FILE)
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated by one byte
    ran = []
    monkeypatch.setattr("pfl_core.engine.Engine.run_round", lambda self, ctx, round, *a, **k: ran.append(round))
    assert run_main(["--resume", str(copy), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged" in err and "round-000001" in err, err
    assert ran == [2]  # round 2 again, from round 1's checkpoint
    for checkpoint in checkpoints(copy):  # every one damaged: nothing to resume from, said in one line
        (checkpoint / RUN_FILE).write_bytes(b"not a checkpoint")
    assert run_main(["--resume", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no usable checkpoint" in err, err


def test_the_code_version_hashes_the_source_of_the_plugins_the_spec_names():
    fedavg = real_code_version(["fedavg"])
    assert fedavg == real_code_version(["fedavg", "fedavg"])  # repeats aside, the same
    assert fedavg["source_sha256"] != real_code_version(["ditto"])["source_sha256"]  # plugins/ is outside pfl_core


def test_the_code_version_covers_all_of_pfl_core_and_the_named_plugins_only():
    import pfl_core
    from pfl_core.engine import engine
    from pfl_core.registry import plugin_class
    from pfl_core.state import provenance
    from pfl_core.study import run

    files = provenance.source_files(["ditto"])
    for module in (engine, run, provenance, pfl_core):  # the engine and the study decide results too
        assert Path(module.__file__).resolve() in files
    ditto = Path(sys.modules[plugin_class("ditto").__module__].__file__).resolve()
    fedprox = Path(sys.modules[plugin_class("fedprox").__module__].__file__).resolve()
    assert ditto in files and fedprox not in files
    assert len(files) == len(set(files)) and not any("__pycache__" in f.parts for f in files)
