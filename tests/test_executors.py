"""Issue 11: executors. Every executor gives bit-identical results to the sequential loop;
a worker that dies is retried or reported with its client and round; ``auto`` is resolved."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from harness import NEEDS, builtin_algorithms, dry_run_error
from pfl_core import executors, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import PflError
from pfl_core.spec import ExecutorSection
from tiny import tiny_raw

WALL_CLOCK = ("round_seconds", "eval_seconds")


def run(name, executor, rounds=2, **overrides):
    raw = tiny_raw(**{"algorithm.name": name, "experiment.rounds": rounds, **NEEDS.get(name, {}),
                      **{f"executor.{k}": v for k, v in executor.items()}, **overrides})
    engine = Engine(resolve(raw), progress=False)
    return engine.run(), engine


def metrics_of(result):
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in result.history]


def assert_identical(a, b):
    """Same value and same bits, through nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    elif hasattr(a, "shape"):  # numpy
        assert (a == b).all()
    else:
        assert a == b or (a != a and b != b)  # NaN == NaN here


@pytest.mark.parametrize("name", builtin_algorithms())
def test_process_pool_is_bit_identical_to_the_sequential_loop(name):
    sequential, seq_engine = run(name, {"name": "sequential"})
    pooled, pool_engine = run(name, {"name": "process", "workers": 2})
    assert pool_engine.executor_plan["name"] == "process"
    assert metrics_of(pooled) == metrics_of(sequential)
    assert pooled.client_rows == sequential.client_rows
    assert_identical(pool_engine.ctx.server, seq_engine.ctx.server)
    for client_id in seq_engine.ctx.store:
        assert_identical(pool_engine.ctx.store[client_id], seq_engine.ctx.store[client_id])
    assert (pool_engine.ctx.comm_up, pool_engine.ctx.comm_down) == (seq_engine.ctx.comm_up, seq_engine.ctx.comm_down)


def test_worker_count_does_not_change_results():
    two, _ = run("fedrep", {"name": "process", "workers": 2}, **{"partition.num_clients": 4})
    three, _ = run("fedrep", {"name": "process", "workers": 3}, **{"partition.num_clients": 4})
    assert metrics_of(two) == metrics_of(three)


def kill_once(marker, client_id, round):
    """A local_train that SIGKILLs its own worker the first time it runs ``client_id`` in
    ``round`` (the marker file remembers across the forked workers)."""
    from pfl_core.defaults import CoreDefaults
    original = CoreDefaults.local_train

    def local_train(self, ctx, client):
        if client.id == client_id and client.round == round and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, ctx, client)

    return hookimpl(local_train)


def test_a_killed_worker_is_retried_and_the_result_is_unchanged(tmp_path, monkeypatch):
    clean, _ = run("fedavg", {"name": "sequential"})
    from pfl_core.defaults import CoreDefaults
    monkeypatch.setattr(CoreDefaults, "local_train", kill_once(str(tmp_path / "died"), 2, 2))
    retried, _ = run("fedavg", {"name": "process", "workers": 2, "retries": 1})
    assert (tmp_path / "died").exists()  # the worker did die once
    assert metrics_of(retried) == metrics_of(clean)


def test_a_worker_that_keeps_dying_stops_the_run_naming_client_and_round(tmp_path, monkeypatch):
    from pfl_core.defaults import CoreDefaults
    original = CoreDefaults.local_train

    def always_dies(self, ctx, client):
        if client.id == 3 and client.round == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, ctx, client)

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(always_dies))
    with pytest.raises(PflError) as info:
        run("fedavg", {"name": "process", "workers": 2, "retries": 1})
    message = str(info.value)
    assert "client 3 in round 1" in message and "SIGKILL" in message and "executor.retries = 1" in message


def test_a_plugin_error_in_a_worker_reaches_the_server_as_itself(monkeypatch):
    from pfl_core.defaults import CoreDefaults

    def broken(self, ctx, client):
        raise ZeroDivisionError("plugin bug")

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(broken))
    with pytest.raises(ZeroDivisionError, match="plugin bug"):
        run("fedavg", {"name": "process", "workers": 2})


@pytest.mark.parametrize("cores, participants, samples, expected", [
    (2, 100, 500, ("process", 2, 1)),      # a real round on 2 cores: the pool
    (1, 100, 500, ("sequential", 1, 1)),   # one core: nothing to share
    (2, 3, 500, ("sequential", 2, 1)),     # fewer than 2 participants per worker
    (2, 4, 30, ("sequential", 2, 1)),      # too little work to pay for forking
])
def test_auto_picks_the_pool_only_when_it_pays(monkeypatch, cores, participants, samples, expected):
    monkeypatch.setattr(executors, "available_cores", lambda: cores)
    assert executors.plan(ExecutorSection(), "cpu", participants, samples) == expected
    assert executors.plan(ExecutorSection(), "cuda", participants, samples)[0] == "sequential"
    assert executors.plan(ExecutorSection(name="process", workers=3, threads=2), "cpu", 1, 1) == ("process", 3, 2)


def test_the_executor_actually_used_is_logged_as_resolved_params():
    _, engine = run("fedavg", {"name": "process", "workers": 2}, rounds=1)
    assert engine.ctx.resolved_values["executor.name"] == "process"
    assert engine.ctx.resolved_values["executor.workers"] == 2
    assert engine.ctx.resolved_values["executor.threads"] == 1


@pytest.mark.parametrize("key, value, fragment", [
    ("executor.name", "threads", "must be one of"),
    ("executor.workers", 0, "must be >= 1"),
    ("executor.workers", -2, "must be >= 1"),
    ("executor.retries", -1, "must be >= 0"),
])
def test_bad_executor_settings_are_one_line_naming_the_key(tmp_path, capsys, key, value, fragment):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{key: value}))
    assert line.startswith(f"{key}:") or f" {key}:" in line, line
    assert fragment in line
