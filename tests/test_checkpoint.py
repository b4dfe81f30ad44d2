"""Checkpoint and resume (issue 12): a run SIGKILLed between rounds, mid-round (during local
training) and during evaluation, then resumed with ``pfl-run --resume``, logs exactly the metrics
(every key, every step, once) and ends in exactly the state (server and every client) of the
same run left alone; a changed spec or damaged checkpoint is handled in one line.

The kill is real: the run is a subprocess (tests/killpoints.py patches that process only) that
sends itself SIGKILL at the chosen point. Resumes and the uninterrupted reference runs run in
this process, through the command line's own entry point.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfl_core import stateio
from pfl_core.checkpoint import CLIENTS_DIR, CLIENTS_FILE, RUN_FILE, checkpoints
from pfl_core.cli import run_main
from test_cli import write_spec
from tiny import tiny_raw

HERE = Path(__file__).resolve().parent
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


def spec_for(tmp_path: Path, store: str, rounds: int, every: int, **overrides) -> str:
    raw = tiny_raw(**{"experiment.rounds": rounds, "tracking.enabled": True, "tracking.progress": False,
                      "tracking.uri": f"sqlite:///{tmp_path / store}", "executor.name": "sequential",
                      "checkpoint.every": every, **overrides})
    return write_spec(tmp_path, raw, f"{store}.toml")


def killed(points: list[str], *args: str) -> subprocess.CompletedProcess:
    """pfl-run with faults injected, in a subprocess; it must die of SIGKILL."""
    proc = subprocess.run([sys.executable, str(HERE / "killpoints.py"), *points, "--", *args], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    return proc


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
    ("fedavg", [["round:3"], ["train:4:5"], ["eval:5"]], 6, 2),
    ("ditto", [["train:3:7"]], 4, 1),
    ("fedmosaic", [["eval:3"]], 4, 1),
    ("cosmos", [["round:3"]], 3, 0),  # automatic period
    ("fedsimsup", [["train:2:3"]], 3, 1),
]


@pytest.mark.parametrize("method,kills,rounds,every", CASES, ids=[c[0] for c in CASES])
def test_a_killed_run_resumes_bit_identical(tmp_path, method, kills, rounds, every):
    overrides = METHODS[method]
    reference = tmp_path / "reference.db"
    assert run_main([spec_for(tmp_path, "reference.db", rounds, every, **overrides), "--quiet"]) == 0

    db = tmp_path / "killed.db"
    spec = spec_for(tmp_path, "killed.db", rounds, every, **overrides)
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
