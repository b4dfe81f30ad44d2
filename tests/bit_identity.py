"""The two executor checks every stateful plugin's tests make, in one place: the process pool
gives the sequential loop's run bit for bit, and a run SIGKILLed mid-way resumes to the same
metrics and the same final server and client states as a run never interrupted."""

from __future__ import annotations

from pathlib import Path

from test_checkpoint import assert_identical, final_state, killed, metrics, only_run, resume, spec_for, status
from test_executors import assert_same_run, run

from pfl_core.cli import run_main


def assert_pool_matches_sequential(method: str, rounds: int = 3, **overrides):
    """Runs ``method`` under the sequential loop and a 2-worker process pool; returns both engines."""
    sequential, seq_engine = run(method, {"name": "sequential"}, rounds=rounds, **overrides)
    pooled, pool_engine = run(method, {"name": "process", "workers": 2}, rounds=rounds, **overrides)
    assert pool_engine.executor_plan["name"] == "process"
    assert_same_run(pooled, pool_engine, sequential, seq_engine)
    return seq_engine, pool_engine


def assert_killed_run_resumes_identical(tmp_path: Path, template: Path, rounds: int = 4, kill_at: int = 3,
                                        **overrides) -> dict:
    """A tracked run checkpointing every round, killed at round ``kill_at`` and resumed, against
    one never interrupted; returns the reference's final server state for method-specific checks."""
    reference, db = tmp_path / "reference.db", tmp_path / "killed.db"
    assert run_main([spec_for(tmp_path, reference.name, rounds, 1, template, **overrides), "--quiet"]) == 0
    killed([f"round:{kill_at}"], spec_for(tmp_path, db.name, rounds, 1, template, **overrides))
    resume(only_run(db), "--tracking-uri", f"sqlite:///{db}")
    assert status(db) == "FINISHED" and metrics(db) == metrics(reference)
    server, clients = final_state(db, rounds)
    ref_server, ref_clients = final_state(reference, rounds)
    assert_identical(server, ref_server, "server")
    assert_identical(clients, ref_clients, "clients")
    return ref_server
