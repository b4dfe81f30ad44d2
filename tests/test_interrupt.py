"""Runs that survive (issue 12): Ctrl-C and SIGTERM end the MLflow runs KILLED, say in one line
where the run stopped and where its results are, and exit 130 / 143."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import write_spec
from tiny import tiny_raw

BIN = Path(sys.executable).parent


def logged_rounds(db: Path) -> int:
    """How many rounds the store holds a metric for (0 while it is being created)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            row = con.execute("select max(step) from metrics where key = 'comm_up_bytes'").fetchone()
        return int(row[0] or 0)
    except sqlite3.Error:
        return 0


def statuses(db: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return dict(con.execute("select name, status from runs").fetchall())


@pytest.mark.parametrize("sig,code,seeds", [(signal.SIGINT, 130, None), (signal.SIGTERM, 143, [0, 1])])
def test_a_signal_ends_the_runs_killed_with_one_line(tmp_path, sig, code, seeds):
    db = tmp_path / "store.db"
    raw = tiny_raw(**{"experiment.rounds": 100000, "tracking.enabled": True, "tracking.uri": f"sqlite:///{db}"})
    if seeds:  # a sweep over seeds: the study's parent and the seeds' parent too
        raw["experiment"]["seeds"] = seeds
        raw["sweep"] = {"training.lr": [0.1, 0.05]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(BIN / "pfl-run"), write_spec(tmp_path, raw), "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while logged_rounds(db) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no round was logged"
            time.sleep(0.1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert f"interrupted ({signal.Signals(sig).name}) at round " in line, line
    assert "status KILLED" in line and str(db) in line and str(tmp_path / "out") in line, line
    runs = statuses(db)
    assert runs and set(runs.values()) == {"KILLED"}, runs
    assert len(runs) == (3 if seeds else 1), runs  # study parent, seeds' parent, first seed's run
    assert (tmp_path / "out" / "INCOMPLETE").exists()
