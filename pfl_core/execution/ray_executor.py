"""The ``ray`` executor: items as Ray tasks on this machine or an existing cluster."""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import warnings
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from pfl_core.errors import PflError, SpecError
from pfl_core.execution.views import rebuild_view_call, split_view_call

T = TypeVar("T")
R = TypeVar("R")

RAY_MISSING = "executor.name: 'ray' needs Ray: pip install -e '.[ray]'"

# In a Ray worker process: the last run's constant part and the last map's call, decoded once
# and kept (one of each, so a worker that served an earlier run drops its data).
_worker_runtime: tuple = (None, None)  # (object id, {name: value} of RUN_CONSTANT)
_worker_call: tuple = (None, None)  # (object id, (function, its other arguments, round facts))
_worker_threads: int | None = None


def _fetched(cache: tuple, ref):
    """(cache, value) for ``ref``: the cached value when ``ref`` is the cached one, else fetched."""
    import ray

    key = ref.hex()
    if cache[0] == key:
        return cache, cache[1]
    value = ray.get(ref)
    return (key, value), value


def _ray_run(refs: list, threads: int, item):
    """One item in a Ray worker: rebuild the client view from the run's constant part and the
    map's round facts (both fetched once per worker), then call the map's function on it."""
    global _worker_runtime, _worker_call, _worker_threads
    if _worker_threads != threads:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        _worker_threads = threads
    runtime_ref, call_ref = refs  # nested in a list: Ray would otherwise fetch them for every item
    _worker_runtime, runtime = _fetched(_worker_runtime, runtime_ref)
    _worker_call, call = _fetched(_worker_call, call_ref)
    return rebuild_view_call(runtime, call)(item)


class RayExecutor:
    """Items run as Ray tasks, on this machine (a local Ray started by ``ray.init``) or on an
    existing cluster (``executor.address``: ``"auto"``, ``"host:6379"`` or ``"ray://host:10001"``).

    What runs remotely is the client side: a ``map`` whose function is
    ``functools.partial(f, view, ...)`` with ``view`` a ``ClientView`` and ``f`` importable
    (``run_client``, ``evaluate_client``). The run's read-only data (the data set, the models,
    the plugins, the spec) is put in Ray's object store once per run; each worker fetches it
    once and keeps it, and rebuilds the view with the round's facts, which travel once per map.
    Items (a client's message and state) and results travel per task. Any other function (a
    closure over the server's context, e.g. COSMOS's per-cluster server training) runs here,
    in the driver, one item after another: it may hold the server's state, which stays here.

    Each task takes one CPU and runs one torch thread with flush-denormal on. Results come back
    in the items' order. A task whose worker dies is run again by Ray up to ``retries`` times,
    then the run stops naming the item (the client and round).
    """

    name = "ray"

    def __init__(self, workers: int, threads: int = 1, retries: int = 1, address: str = ""):
        try:
            import ray
        except ImportError:
            raise PflError(RAY_MISSING) from None
        self.ray = ray
        # errors are reported here from the items' results; Ray would also print, at exit, the
        # errors of the tasks left unread after the first one failed
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
        self.threads = threads
        self.retries = retries
        self.address = address
        if not ray.is_initialized():
            self._connect(workers)
        self.slots = int(ray.cluster_resources().get("CPU", 0))
        if self.slots < 1:  # every task asks for one CPU: none would ever start
            raise SpecError("executor.address", f"the Ray cluster at {address or 'this machine'!r} has no CPUs "
                                                f"for tasks; start a node with CPUs (ray start --num-cpus=N)")
        self._remote = ray.remote(_ray_run).options(num_cpus=1, max_retries=retries, retry_exceptions=False)
        self._runtime = None  # (the objects shipped, their object ref): one per run

    def _connect(self, workers: int) -> None:
        if not self.address:
            start_local_ray(workers)
            return
        _check_reachable(self.address)
        _join_cluster(self.ray, self.address)

    def _ship(self, fn) -> list | None:
        """The object refs a task needs for ``fn`` (run constant, this map's call), or None when
        ``fn`` is not the client side's shape and runs in this process."""
        split = split_view_call(fn)
        if split is None:
            return None
        constant, call = split
        ray = self.ray
        if constant["device"].type != "cpu":  # Ray tasks here ask for CPUs only: Ray hides the GPUs from them
            raise PflError(f"executor.device: '{constant['device'].type}' with executor.name = 'ray' is not supported; "
                           f"use 'sequential' or 'batched' on a GPU")
        if self._runtime is None or any(self._runtime[0][n] is not v for n, v in constant.items()):
            try:
                self._runtime = (constant, ray.put(constant))
            except Exception as exc:
                raise PflError(f"executor.name: 'ray' cannot send the run to Ray workers ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:200]}); a plugin may hold something that cannot be "
                               f"pickled; use 'process' or 'sequential'") from None
        return [self._runtime[1], ray.put(call)]

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        refs = self._ship(fn)
        if refs is None:
            for item in items:
                yield fn(item)
            return
        ray = self.ray
        from ray import exceptions

        died = (exceptions.WorkerCrashedError, exceptions.RayActorError, exceptions.OutOfMemoryError,
                exceptions.NodeDiedError, exceptions.LocalRayletDiedError)
        window = 2 * self.slots  # tasks in flight: every CPU busy, and the next ones queued
        source = iter(items)
        pending: collections.deque = collections.deque()  # (item, object ref of its result)

        def fill():
            while len(pending) < window:
                item = next(source, _END)
                if item is _END:
                    return
                pending.append((item, self._remote.remote(refs, self.threads, item)))

        try:
            fill()
            while pending:
                item, ref = pending[0]
                try:
                    result = ray.get(ref)
                except exceptions.RayTaskError as exc:  # the function raised: the same error here
                    cause = exc.cause if isinstance(exc.cause, BaseException) else None
                    if cause is None:
                        raise
                    raise cause from exc
                except died as exc:
                    why = " ".join(str(exc).split())[:200]
                    raise PflError(f"executor: the Ray worker running {item} died ({type(exc).__name__}: {why}); "
                                   f"retried {self.retries} time(s) (executor.retries = {self.retries})") from None
                pending.popleft()
                fill()
                yield result
        finally:
            for _, ref in pending:  # a failed or abandoned map: stop the tasks still queued
                try:
                    ray.cancel(ref)
                except Exception:
                    pass

    def close(self) -> None:
        self._runtime = None  # the object store frees the run's data once no task holds it


_END = object()
_QUIET = dict(log_to_driver=False, logging_level=logging.ERROR, configure_logging=True)
# Ray 2.5x tells every ray.init that a future release stops overriding the accelerator env var
# for tasks without GPUs; pfl asks for none and sets no such variable, so the notice is noise
warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)


def start_local_ray(cpus: int) -> None:
    """Start a new Ray on this machine with ``cpus`` CPUs, quietly (no dashboard, no worker logs).
    Its workers get this process's own import folders (the working directory, a plugin's
    folder on ``sys.path``): they unpickle functions by module name, as this process would."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    own = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    own = [p for p in own if not any(os.path.realpath(p).startswith(prefix) for prefix in installed)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(own))} if own else {}
    # "local": a new Ray of its own, never one found running on this machine (ray.init's default)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
             runtime_env={"env_vars": env} if env else None, **_QUIET)


CONNECT_SECONDS = 12.0  # ray.init's own retries take 35 s or more before giving up


_PROBE = ("import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR'); "
          "ray.shutdown()")


def _join_cluster(ray, address: str, seconds: float = CONNECT_SECONDS) -> None:
    """``ray.init(address)``, or one clear error naming ``executor.address`` when it fails or
    has not connected within ``seconds``. A throw-away process tries first: a cluster that
    does not answer makes Ray's C++ client log a line per second to this process's stderr
    while it retries, and that process can be stopped. Then this process connects (in a
    daemon thread, left behind if it still hangs: the run stops here anyway)."""
    def failed(why: str, hint: str = "; is the cluster running (ray start --head) and its port open from here?"):
        return SpecError("executor.address", f"cannot connect to Ray at {address!r}: {why}{hint}")

    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                               timeout=seconds)
    except subprocess.TimeoutExpired as exc:
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        if "InvalidAuthToken" in said or "Unauthenticated" in said:
            raise failed("the cluster asks for its authentication token: set RAY_AUTH_MODE=token here, and "
                         "RAY_AUTH_TOKEN to the head node's (its ~/.ray/auth_token)", hint="") from None
        raise failed(f"no Ray cluster answered within {seconds:.0f} s") from None
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if line.strip()]
        raise failed(" ".join((lines[-1] if lines else f"exit code {probe.returncode}").split())[:300])
    warnings.filterwarnings("ignore", message="Ray Client connection timed out")  # said here, once
    outcome: dict = {}

    def connect():
        try:
            ray.init(address=address, **_QUIET)
            outcome["connected"] = True
        except BaseException as exc:  # ConnectionError, a version mismatch ...
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="pfl-ray-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if "connected" in outcome:
        return
    if "error" in outcome:
        raise failed(" ".join(str(outcome["error"]).split())[:300] or type(outcome["error"]).__name__)
    raise failed(f"no Ray cluster answered within {seconds:.0f} s")


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """A fast, clear failure for an address where nothing listens: a TCP connection to
    ``host:port`` within ``timeout`` seconds."""
    if address == "auto":
        return  # ray.init finds the local cluster's address itself, or fails at once
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError("executor.address", f"{address!r} is not 'auto', 'host:port' or 'ray://host:port'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise SpecError("executor.address", f"cannot reach Ray at {address!r} ({exc.strerror or exc}); is the "
                                            f"cluster running (ray start --head) and the port open?") from None
