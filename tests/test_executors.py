"""Issue 11: executors. Every executor gives bit-identical results to the sequential loop;
a worker that dies is retried or reported with its client and round; ``auto`` is resolved."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from harness import NEEDS, builtin_algorithms, dry_run_error
from tiny import tiny_raw

from pfl_core import execution as executors
from pfl_core import hookimpl
from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import DataError, NonFiniteError, PflError, SpecError
from pfl_core.execution import planner as plan_module
from pfl_core.execution import process, views
from pfl_core.execution import ray_executor as ray_module
from pfl_core.spec import ExecutorSection, dump_toml

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


def assert_same_run(other, other_engine, sequential, seq_engine):
    """Same metrics, per-client rows, server state, client states and bytes as the sequential run."""
    assert metrics_of(other) == metrics_of(sequential)
    assert other.client_rows == sequential.client_rows
    assert_identical(other_engine.ctx.server, seq_engine.ctx.server)
    for client_id in seq_engine.ctx.store:
        assert_identical(other_engine.ctx.store[client_id], seq_engine.ctx.store[client_id])
    assert (other_engine.ctx.comm_up, other_engine.ctx.comm_down) == (seq_engine.ctx.comm_up, seq_engine.ctx.comm_down)


@pytest.mark.parametrize("name", builtin_algorithms())
def test_process_pool_is_bit_identical_to_the_sequential_loop(name):
    sequential, seq_engine = run(name, {"name": "sequential"})
    pooled, pool_engine = run(name, {"name": "process", "workers": 2})
    assert pool_engine.executor_plan["name"] == "process"
    assert_same_run(pooled, pool_engine, sequential, seq_engine)


def test_worker_count_does_not_change_results():
    two, _ = run("fedrep", {"name": "process", "workers": 2}, **{"partition.num_clients": 4})
    three, _ = run("fedrep", {"name": "process", "workers": 3}, **{"partition.num_clients": 4})
    assert metrics_of(two) == metrics_of(three)


def kill_once(marker, client_id, round):
    """A local_train that SIGKILLs its own worker the first time it runs ``client_id`` in
    ``round`` (the marker file remembers across the forked workers)."""
    from pfl_core.registry.defaults import CoreDefaults
    original = CoreDefaults.local_train

    def local_train(self, ctx, client):
        if client.id == client_id and client.round == round and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, ctx, client)

    return hookimpl(local_train)


def kill_always(monkeypatch, client_id, round):
    """A local_train that SIGKILLs its own worker whenever it runs ``client_id`` in ``round``."""
    from pfl_core.registry.defaults import CoreDefaults
    original = CoreDefaults.local_train

    def always_dies(self, ctx, client):
        if client.id == client_id and client.round == round:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, ctx, client)

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(always_dies))


def test_a_killed_worker_is_retried_and_the_result_is_unchanged(tmp_path, monkeypatch, capsys):
    """The result is exact, and the retry is said: a warning line naming the client and round,
    and a run tag (``pfl.worker_retry.1``)."""
    clean, _ = run("fedavg", {"name": "sequential"})
    from pfl_core.registry.defaults import CoreDefaults
    from pfl_core.tracking.tracker import NullTracker

    tags = {}
    monkeypatch.setattr(NullTracker, "set_tag", lambda self, key, value: tags.__setitem__(key, value))
    monkeypatch.setattr(CoreDefaults, "local_train", kill_once(str(tmp_path / "died"), 2, 2))
    capsys.readouterr()
    retried, _ = run("fedavg", {"name": "process", "workers": 2, "retries": 1})
    assert (tmp_path / "died").exists()  # the worker did die once
    assert metrics_of(retried) == metrics_of(clean)
    said = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(said) == 1 and "client 2 in round 2" in said[0] and "running it again (retry 1 of 1" in said[0], said
    assert list(tags) == ["pfl.worker_retry.1"] and "client 2 in round 2" in tags["pfl.worker_retry.1"]


def test_a_worker_that_keeps_dying_stops_the_run_naming_client_and_round(tmp_path, monkeypatch):
    kill_always(monkeypatch, client_id=3, round=1)
    with pytest.raises(PflError) as info:
        run("fedavg", {"name": "process", "workers": 2, "retries": 1})
    message = str(info.value)
    assert "client 3 in round 1" in message and "SIGKILL" in message and "executor.retries = 1" in message


def test_a_plugin_error_in_a_worker_reaches_the_server_as_itself(monkeypatch):
    from pfl_core.registry.defaults import CoreDefaults

    def broken(self, ctx, client):
        raise ZeroDivisionError("plugin bug")

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(broken))
    with pytest.raises(ZeroDivisionError, match="plugin bug"):
        run("fedavg", {"name": "process", "workers": 2})


@pytest.mark.parametrize("error", [SpecError("algorithm.params.server_arch", "too large to build"),
                                   DataError("a file went missing"), NonFiniteError("a loss became NaN")],
                         ids=lambda e: type(e).__name__)
def test_a_pfl_error_in_a_worker_is_the_line_the_sequential_loop_prints(monkeypatch, capsys, tmp_path, error):
    """pfl's own errors come back from a worker whole (they pickle with every part), so the
    command line prints the same one line and exit code as for the sequential loop; a SpecError
    used to break the pool ("worker process exited with code None")."""
    from test_cli import write_spec
    from tiny import tiny_raw

    from pfl_core.registry.defaults import CoreDefaults

    def broken(self, ctx, client):
        raise error

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(broken))
    said = {}
    for name in ("sequential", "process"):
        spec = write_spec(tmp_path, tiny_raw(**{"executor.name": name, "executor.workers": 2}), f"{name}.toml")
        code = run_main([spec, "--quiet", "--no-tracking"])
        said[name] = (code, capsys.readouterr().err.strip())
    assert said["process"] == said["sequential"]
    assert said["process"][0] == 2 and said["process"][1].count("\n") == 0 and str(error) in said["process"][1]


def test_pfl_errors_pickle_with_every_part():
    import pickle

    from pfl_core.errors import Interrupted
    from pfl_core.spec import FieldError

    spec_error = pickle.loads(pickle.dumps(SpecError("training.lr", "must be > 0")))
    assert (type(spec_error), spec_error.path, spec_error.message) == (SpecError, "training.lr", "must be > 0")
    field = pickle.loads(pickle.dumps(FieldError("lr", "must be > 0")))
    assert (field.name, field.message) == ("lr", "must be > 0")
    stopped = Interrupted(15)
    stopped.round = 3
    back = pickle.loads(pickle.dumps(stopped))
    assert (type(back), back.signum, back.round) == (Interrupted, 15, 3)


@pytest.mark.parametrize("cores, participants, work, expected", [
    (2, 100, 3e9, ("process", 2, 1)),      # 100 LeNet-5 clients x 500 samples on 2 cores: the pool
    (1, 100, 3e9, ("sequential", 1, 1)),   # one core: nothing to share
    (2, 3, 3e9, ("sequential", 2, 1)),     # fewer than 2 participants per worker
    (2, 20, 5e6, ("sequential", 2, 1)),    # the quickstart's logistic regression: too little work to fork for
])
def test_auto_picks_the_pool_only_when_it_pays(monkeypatch, cores, participants, work, expected):
    monkeypatch.setattr(plan_module, "available_cores", lambda: cores)
    assert executors.plan(ExecutorSection(), "cpu", participants, work) == expected
    assert executors.plan(ExecutorSection(), "cuda", participants, work)[0] == "sequential"
    assert executors.plan(ExecutorSection(name="process", workers=3, threads=2), "cpu", 1, 1) == ("process", 3, 2)


def test_auto_counts_the_models_parameters(monkeypatch):
    """The same round with a 5000x wider model crosses the pool's threshold."""
    monkeypatch.setattr(plan_module, "available_cores", lambda: 2)
    narrow = Engine(resolve(tiny_raw(**{"model.params.hidden": [4]})), progress=False)
    narrow.prepare()
    wide = Engine(resolve(tiny_raw(**{"model.params.hidden": [20000]})), progress=False)
    wide.prepare()
    assert (narrow.executor_plan["name"], wide.executor_plan["name"]) == ("sequential", "process")


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


# -- ray ------------------------------------------------------------------------------------
# These start a local Ray with 2 CPUs once for the module (Ray's start-up takes seconds) and
# skip, saying why, where Ray is not installed (it is an optional extra, not in CI's).

def test_ray_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(PflError) as info:
        executors.make_executor("ray", workers=2)
    assert str(info.value) == "executor.name: 'ray' needs Ray: pip install -e '.[ray]'"


def test_ray_on_a_gpu_device_is_one_line_naming_the_device():
    """Ray's tasks ask for CPUs only: a run on another device is refused before anything ships."""
    import types

    from pfl_core.runtime.context import ClientView

    facts = {name: None for name in ClientView.READ_ONLY}
    view = ClientView(types.SimpleNamespace(**{**facts, "device": torch.device("meta")}))
    ray_executor = executors.RayExecutor.__new__(executors.RayExecutor)  # no Ray needed to refuse
    ray_executor.ray, ray_executor._runtime = None, None
    with pytest.raises(PflError) as info:
        ray_executor._ship(functools.partial(print, view))
    assert str(info.value).startswith("executor.device: 'meta' with executor.name = 'ray' is not supported")


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (optional extra: pip install -e '.[ray]')")
    ray_module.start_local_ray(2)  # as the executor starts it: quiet, this process's import folders
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("name", builtin_algorithms())
def test_ray_is_bit_identical_to_the_sequential_loop(local_ray, name):
    sequential, seq_engine = run(name, {"name": "sequential"})
    on_ray, ray_engine = run(name, {"name": "ray"})
    assert ray_engine.executor_plan["name"] == "ray"
    assert_same_run(on_ray, ray_engine, sequential, seq_engine)


def test_ray_puts_the_run_data_in_the_object_store_once_per_run(local_ray, monkeypatch):
    shipped = []
    put = local_ray.put

    def counting_put(value, *args, **kwargs):
        if isinstance(value, dict) and "data" in value:  # the run-constant part of the client view
            shipped.append(value)
        return put(value, *args, **kwargs)

    monkeypatch.setattr(local_ray, "put", counting_put)
    run("fedavg", {"name": "ray"}, rounds=3)  # 3 rounds of training and 3 evaluations
    assert len(shipped) == 1
    assert set(shipped[0]) == set(views.RUN_CONSTANT)


def client_pid(view, item):
    return item, os.getpid()


def test_ray_runs_client_work_in_workers_and_other_functions_here_in_order(local_ray):
    _, engine = run("fedavg", {"name": "ray"}, rounds=1)
    executor, view = engine.ctx.executor, engine.ctx.client_view()
    remote = list(executor.map(functools.partial(client_pid, view), range(6)))
    assert [item for item, _ in remote] == list(range(6))
    assert all(pid != os.getpid() for _, pid in remote)
    here = list(executor.map(lambda item: (item, os.getpid()), range(6)))  # e.g. COSMOS's server jobs
    assert here == [(item, os.getpid()) for item in range(6)]


def test_ray_plugin_error_reaches_the_server_as_itself(local_ray, monkeypatch):
    from pfl_core.registry.defaults import CoreDefaults

    def broken(self, ctx, client):
        raise ZeroDivisionError("plugin bug")

    monkeypatch.setattr(CoreDefaults, "local_train", hookimpl(broken))
    with pytest.raises(ZeroDivisionError, match="plugin bug"):
        run("fedavg", {"name": "ray"})


# (after the other tests: the workers these kill take seconds to start again)
def test_ray_retries_a_killed_worker_and_the_result_is_unchanged(local_ray, tmp_path, monkeypatch):
    clean, _ = run("fedavg", {"name": "sequential"})
    from pfl_core.registry.defaults import CoreDefaults
    monkeypatch.setattr(CoreDefaults, "local_train", kill_once(str(tmp_path / "died"), 2, 2))
    retried, _ = run("fedavg", {"name": "ray", "retries": 1})
    assert (tmp_path / "died").exists()  # the worker did die once
    assert metrics_of(retried) == metrics_of(clean)


def test_ray_worker_that_keeps_dying_stops_the_run_naming_client_and_round(local_ray, monkeypatch):
    kill_always(monkeypatch, client_id=3, round=1)
    with pytest.raises(PflError) as info:
        run("fedavg", {"name": "ray", "retries": 1})
    message = str(info.value)
    assert "client 3 in round 1" in message and "executor.retries = 1" in message


def pfl_run(tmp_path, *overrides):
    """``pfl-run`` on the tiny spec in a fresh process (Ray connects once per process)."""
    spec = tmp_path / "spec.toml"
    spec.write_text(dump_toml(tiny_raw(**{"experiment.rounds": 1})))
    args = [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run([sys.executable, "-c", "import sys; from pfl_core.cli import run_main; "
                           "sys.exit(run_main(sys.argv[1:]))", str(spec), *args],
                          capture_output=True, text=True, cwd=tmp_path)


def test_ray_unreachable_address_is_one_line_naming_the_key(local_ray, tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = pfl_run(tmp_path, "executor.name=ray", f"executor.address=ray://127.0.0.1:{port}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "executor.address" in lines[0] and f"127.0.0.1:{port}" in lines[0]


def test_ray_joins_a_running_cluster_by_its_address(local_ray, tmp_path):
    # the fixture's own address, not "auto": another test session on this machine may run a Ray too
    address = local_ray.get_runtime_context().gcs_address
    done = pfl_run(tmp_path, "executor.name=ray", f"executor.address={address}")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


def test_workers_die_with_a_killed_run(tmp_path):
    """SIGKILL on the run's process leaves no worker behind (they would wait forever)."""
    import subprocess
    import sys
    import time
    script = tmp_path / "run.py"
    script.write_text(
        "import os, sys, time\n"
        "sys.path[:0] = [%r, %r]\n"
        "from pfl_core.execution import ProcessExecutor\n"
        "def slow(i):\n"
        "    os.write(1, str(os.getpid()).encode() + b'\\n')  # one write: two workers' lines never interleave\n"
        "    time.sleep(60)\n"
        "executor = ProcessExecutor(2)\n"
        "executor.CHUNK = 1  # one item per task: both workers start at once and say their pid\n"
        "list(executor.map(slow, range(2)))\n" % (os.getcwd(), os.path.join(os.getcwd(), "tests")))
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(run.stdout.readline()) for _ in range(2)]
    run.kill()
    run.wait()
    # no clock: the workers' death signal arrives with the parent's death; a worker that never
    # dies keeps this loop (and the suite) waiting, which is the failure
    while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
              for pid in workers):
        time.sleep(0.1)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert alive == []


def test_the_parent_imports_what_the_first_optimiser_step_would_before_forking():
    """Workers forked before torch's lazy imports (about 900 modules at the first optimiser
    step) would each import them again, for seconds per worker per round."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from pfl_core.execution import ProcessExecutor\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "assert list(ProcessExecutor(2).map(abs, [-1, -2])) == [1, 2]\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def _pickle_cases():
    base = torch.arange(12, dtype=torch.float32)
    return {
        "float matrix": torch.randn(3, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "bool": torch.tensor([True, False, True]),
        "bfloat16": torch.randn(4).to(torch.bfloat16),  # numpy has no bfloat16: travels as bytes
        "int64": torch.arange(-3, 3),
        "uint8 labels": torch.randint(0, 10, (17,), dtype=torch.uint8),
        "transposed view": base.reshape(3, 4).t(),
        "slice of a larger storage": base[5:8],
    }


@pytest.mark.parametrize("case", list(_pickle_cases()))
def test_items_and_results_pickle_tensors_exactly(case):
    """The pool's pickler sends a tensor's bytes: same dtype, shape and values, a writable
    tensor of its own (a worker trains in place on what it receives)."""
    import pickle

    tensor = _pickle_cases()[case]
    before = tensor.clone()
    back = pickle.loads(process._pickled({"t": tensor, "n": 3}))["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.float(), tensor.float())
    back.zero_()  # writable, and not the original's memory
    assert torch.equal(tensor, before)


def test_pickler_sends_a_repeated_tensor_once_and_only_its_own_bytes():
    import pickle

    weights = torch.randn(1000)
    twice = process._pickled({"a": weights, "b": weights})
    assert len(twice) < 1.1 * 4000
    back = pickle.loads(twice)
    assert back["a"] is back["b"]
    # a 3-element view of the 1,000-element storage sends 3 elements (torch's reduction, the whole storage)
    assert len(process._pickled(weights[:3])) < 400 < 4000 < len(pickle.dumps(weights[:3]))


def test_pickler_leaves_parameters_and_graph_tensors_to_torch():
    import pickle

    parameter = torch.nn.Parameter(torch.randn(3))
    leaf = torch.randn(2, requires_grad=True)
    back = pickle.loads(process._pickled({"p": parameter, "leaf": leaf}))
    assert isinstance(back["p"], torch.nn.Parameter) and torch.equal(back["p"], parameter)
    assert back["leaf"].requires_grad and torch.equal(back["leaf"], leaf)
