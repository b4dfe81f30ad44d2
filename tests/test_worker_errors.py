"""Issue 33 (4): an exception raised in a ``process`` executor's worker ends the run as the one
line the sequential loop prints, whatever its class: one the parent cannot rebuild from its
pickle used to break the pool ("a worker process exited with code None"), and the workers, with
the command line's signal handler inherited, printed a traceback each when the pool stopped them.

``pfl-run`` runs in a subprocess, so that stderr is seen whole, the workers' included."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.cli.cli import REPORT_TO
from pfl_core.errors import PflError, SpecError
from pfl_core.execution import process

# A third-party-style plugin hook that fails for client 3 (of 4) in a worker, as PFL_TEST_ERROR
# says; run as ``pfl-run`` runs (the console entry, its signal handlers included).
PLUGIN_RUN = '''
import os, signal, sys

from pfl_core import PflError, hookimpl
from pfl_core.registry.defaults import CoreDefaults


class Bad(Exception):  # its pickle holds the message only: Bad("xy") is refused (no b)
    def __init__(self, a, b):
        super().__init__(f"{a}{b}")


class Renamed(Exception):  # its pickle rebuilds Renamed("bad value 3"): "bad value bad value 3"
    def __init__(self, n):
        super().__init__(f"bad value {n}")


class BadSetting(PflError):  # a plugin's own user error, not rebuildable either
    def __init__(self, key, why):
        super().__init__(f"{key}: {why}")


def fail(kind):
    if kind == "dies":
        os.kill(os.getpid(), signal.SIGKILL)
    raise {"unpicklable": lambda: Bad("x", "y"), "renamed": lambda: Renamed(3),
           "pfl": lambda: BadSetting("algorithm.params.mu", "too large"),
           "picklable": lambda: ZeroDivisionError("plugin bug")}[kind]()


original = CoreDefaults.local_train


def local_train(self, ctx, client):
    if client.id == 3:
        fail(os.environ["PFL_TEST_ERROR"])
    return original(self, ctx, client)


CoreDefaults.local_train = hookimpl(local_train)
from pfl_core.cli import run_main

sys.exit(run_main())
'''


def plugin_run(tmp_path, kind: str, executor: str = "process", *args: str) -> tuple[int, str]:
    script = tmp_path / "plugin_run.py"
    script.write_text(PLUGIN_RUN)
    spec = write_spec(tmp_path, tiny_raw(**{"experiment.rounds": 1, "executor.name": executor,
                                            "executor.workers": 2}), f"{executor}.toml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFL_TEST_ERROR": kind}
    done = subprocess.run([sys.executable, str(script), spec, "--quiet", "--no-tracking", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)  # a hang guard only
    return done.returncode, done.stderr


def internal(message: str) -> str:
    return f"pfl-run: internal error: {message} (run again with --debug for the traceback; {REPORT_TO})"


@pytest.mark.parametrize("kind,code,line", [
    ("unpicklable", 1, internal("Bad: xy")),
    ("renamed", 1, internal("Renamed: bad value 3")),
    ("pfl", 2, "pfl-run: error: algorithm.params.mu: too large"),
    ("picklable", 1, internal("ZeroDivisionError: plugin bug")),  # as before: it travelled whole already
])
def test_a_worker_exception_ends_as_the_one_line_of_its_message(tmp_path, kind, code, line):
    assert plugin_run(tmp_path, kind) == (code, line + "\n")


def test_the_line_is_the_sequential_loops(tmp_path):
    assert plugin_run(tmp_path, "unpicklable", "process") == plugin_run(tmp_path, "unpicklable", "sequential")


def test_debug_shows_the_workers_traceback(tmp_path):
    code, err = plugin_run(tmp_path, "unpicklable", "process", "--debug")
    assert code == 1 and err.rstrip().endswith("\nBad: xy"), err
    assert "in local_train" in err and 'raise {"unpicklable"' in err, err  # where it was raised, in the worker


def test_workers_stopped_by_a_broken_pool_print_nothing(tmp_path):
    """A worker that dies breaks the pool, which SIGTERMs the others: they end silently (they
    raised the command line's Interrupted, a traceback each)."""
    code, err = plugin_run(tmp_path, "dies")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("pfl: warning: a worker process was killed by SIGKILL") and "client 3 in round 1" in lines[0]
    assert lines[1].startswith("pfl-run: error: executor: a worker process was killed by SIGKILL"), err


class Bad(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}{b}")


class BadSpec(SpecError):
    def __init__(self):
        super().__init__("training.lr", "must be positive")

    def __reduce__(self):  # rebuilt as BadSpec("training.lr", ...): refused
        return Exception.__reduce__(self)


def test_a_stand_in_has_the_class_name_the_message_and_the_pfl_kind():
    error = process._returnable(Bad("x", "y"))
    assert isinstance(error, process.WorkerError) and not isinstance(error, PflError)
    assert (type(error).__name__, type(error).__module__, str(error)) == ("Bad", __name__, "xy")
    back = pickle.loads(pickle.dumps(error))  # what the parent gets
    assert type(back) is type(error) and str(back) == "xy"

    spec_error = process._returnable(BadSpec())
    assert isinstance(spec_error, SpecError) and str(spec_error) == "training.lr: must be positive"
    assert type(pickle.loads(pickle.dumps(spec_error))) is type(spec_error)


def test_an_exception_that_travels_whole_is_sent_as_itself():
    error = SpecError("algorithm.params.mu", "too large")
    assert process._returnable(error) is error
    plain = ZeroDivisionError("plugin bug")
    assert process._returnable(plain) is plain
