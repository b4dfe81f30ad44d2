"""Executors run per-client (and server-side) work items.

The engine hands an executor a function and the items to run it on and consumes the results
lazily, in the items' order, so a streaming aggregate holds few uploads at a time and sees
them in the order the sequential loop produces. Server-side work that is per cluster or per
client (e.g. one distillation job per cluster) goes through the same ``map``.

``map``'s function may only touch its item and read-only run data (the client-side contract,
docs/architecture.md): with ``process`` it runs in a forked worker, whose changes to anything
else are lost.
"""

from __future__ import annotations

import collections
import functools
import io
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from pfl_core.errors import PflError, SpecError

T = TypeVar("T")
R = TypeVar("R")


def available_cores() -> int:
    """CPU cores this process may use (affinity-aware, e.g. in a container or under taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class SequentialExecutor:
    """Runs items one after another in this process, in the order given."""

    name = "sequential"

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        for item in items:
            yield fn(item)

    def close(self) -> None:
        pass


class BatchedExecutor(SequentialExecutor):
    """In this process, like ``sequential``, but a round's participants of one architecture
    train together: stacked parameters, one ``torch.func.vmap`` per step (pfl_core/batched.py,
    which says which methods qualify). Any other work runs one item after another."""

    name = "batched"

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        from pfl_core.execution import batched  # lazily: torch.func is only needed here

        return batched.map_clients(fn, items)


# The function of the current ``ProcessExecutor.map``: set before the workers fork, so they
# inherit it (and everything it refers to: data, models, plugins) without pickling.
_work_fn: Callable | None = None
_running = None  # shared array: per worker slot, (pid, index of the item it runs)
_slot: int | None = None  # in a worker: its slot in _running


_warmed_up = False


def _warm_up_torch() -> None:
    """Import in this process what torch imports lazily at the first optimiser step (~900
    modules, torch._dynamo and sympy among them: seconds): a worker forked before that would
    import them again in every pool, measured 5-14 s per worker here."""
    global _warmed_up
    if not _warmed_up:
        parameter = torch.nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([parameter], lr=0.0)
        parameter.sum().backward()
        optimizer.step()
        _warmed_up = True


def _die_with_parent() -> None:
    """Linux: a worker gets SIGKILL when the run's process dies (even by SIGKILL), instead of
    waiting forever on a queue nobody writes to any more."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _init_worker(threads: int, parent: int, running) -> None:
    global _running, _slot
    _running = running  # this pool's slot array
    with running.get_lock():  # claim a free slot: (pid, item) pairs tell who ran what
        _slot = next(s for s in range(len(running) // 2) if running[2 * s] == 0)
        running[2 * _slot] = os.getpid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def _call(indices: list[int], payload: bytes) -> tuple[list[bytes], float]:
    """Run a chunk of items in a worker. Items and results travel as plain pickles made here:
    torch's multiprocessing pickler would move tensors to shared memory instead. Each result
    is pickled as soon as it is computed: an upload may share the worker's working model,
    which the next item trains."""
    started = time.process_time()
    call, items = pickle.loads(payload)
    fn = _work_fn if call is None else _view_call(call)
    results = []
    for index, item in zip(indices, items):
        _running[2 * _slot + 1] = index  # which item a death is blamed on
        results.append(_pickled(fn(item)))
    return results, time.process_time() - started


# What a ``ClientView`` carries that stays the same for a whole run (the process pool's workers
# inherit it when they fork; Ray gets it once per run). Its other fields (the round, the
# participants ...) travel with each map.
RUN_CONSTANT = ("spec", "params", "data", "models", "hooks", "device")
_pool_runtime: dict | None = None  # in a persistent pool's workers: the run's constant part


def split_view_call(fn) -> tuple[dict, tuple] | None:
    """For ``functools.partial(f, view, ...)`` with ``view`` a ``ClientView`` (the client side's
    shape): (the view's run-constant part, (f, other arguments, keywords, round facts)), so a
    worker can rebuild the call from a copy of the run it already holds; else None."""
    from pfl_core.runtime.context import ClientView

    if not (isinstance(fn, functools.partial) and fn.args and isinstance(fn.args[0], ClientView)):
        return None
    view = fn.args[0]
    constant = {name: getattr(view, name) for name in RUN_CONSTANT}
    facts = {name: getattr(view, name) for name in ClientView.READ_ONLY if name not in RUN_CONSTANT}
    return constant, (fn.func, fn.args[1:], fn.keywords, facts)


def rebuild_view_call(runtime: dict, call: tuple):
    """The function ``split_view_call`` took apart, on ``runtime`` (a copy of its constant part)."""
    import types

    from pfl_core.runtime.context import ClientView

    func, args, kwargs, facts = call
    return functools.partial(func, ClientView(types.SimpleNamespace(**runtime, **facts)), *args, **kwargs)


def _view_call(call: tuple):
    return rebuild_view_call(_pool_runtime, call)


def _tensor_from_bytes(data, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The tensor ``_TensorPickler`` took apart: a fresh contiguous CPU tensor over ``data``."""
    return torch.from_numpy(data).view(dtype).reshape(shape)


class _TensorPickler(pickle.Pickler):
    """The plain pickler, except that a CPU tensor travels as its raw bytes (a numpy array,
    pickle protocol 5). torch's own reduction writes every tensor through ``torch.save``: a
    LeNet-5 state takes 0.80 ms to pickle and 1.03 ms to unpickle that way, 0.16 and 0.10 ms
    this way (benchmarks/pickling.py), for each item and result of a map. The same tensor
    object twice is still sent once (the pickle memo); two views of one storage become two
    tensors. A tensor that requires grad, a subclass (``nn.Parameter``) and unusual layouts
    keep torch's reduction."""

    def reducer_override(self, obj):
        if (type(obj) is not torch.Tensor or obj.requires_grad or obj.device.type != "cpu"
                or obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg()):
            return NotImplemented
        return _tensor_from_bytes, (obj.contiguous().reshape(-1).view(torch.uint8).numpy(), obj.dtype, tuple(obj.shape))


def _pickled(item) -> bytes:
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(item)
    return buffer.getvalue()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        why = " (out of memory, or killed)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


class ProcessExecutor:
    """A pool of forked worker processes on this machine.

    Forking shares the data set, the models and the plugins with the workers without copying
    them (copy-on-write); only the items (a client's message and state) and the results (its
    upload and new state) travel, pickled through pipes between this machine's own processes.
    The client side of a round and of an evaluation (``functools.partial(f, ClientView, ...)``)
    runs in one pool kept for the whole run: its workers rebuild each map's view from the run
    they forked with and the round facts sent with the items. Any other function runs in a
    pool forked for that ``map`` (it inherits the function as it is). Each worker runs one
    torch thread. Results come back in the items' order whatever order the workers finish
    in. A worker that dies is reported with the item it ran; that item and the ones not yet
    finished are run again in a new pool, up to ``retries`` times per item.
    """

    name = "process"

    # Items per task: one pickle per chunk, so an object every item shares (the broadcast
    # weights of FedAvg-like methods, the evaluation message) is pickled once per chunk, not
    # once per client. A chunk aims at CHUNK_SECONDS of work, from what the last map of the
    # same function took per item (CHUNK items the first time): cheap items (evaluating a
    # client: ~7 ms for LeNet-5) go many to a task, a round's clients (~0.1 s) one at a time,
    # so that a worker left alone at the end of a map waits for little.
    CHUNK = 4
    MAX_CHUNK = 16
    CHUNK_SECONDS = 0.05

    def __init__(self, workers: int, threads: int = 1, retries: int = 1):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise PflError("executor.name: 'process' needs the fork start method (Linux); "
                           "use 'sequential' or 'ray' on this platform")
        self.workers = workers
        self.threads = threads
        self.retries = retries
        self._run_pool = None  # the pool of the run's client side, and the run it forked with
        self._item_seconds: dict = {}  # CPU seconds per item of the last map, by function
        self._run_pool_constant: dict | None = None

    def _new_pool(self, fn=None, runtime: dict | None = None):
        """A pool whose workers fork (at its first submit, right after this) with ``fn`` as the
        function of this map, or with ``runtime`` to rebuild client-side calls on."""
        global _work_fn, _pool_runtime
        _warm_up_torch()
        context = multiprocessing.get_context("fork")
        _work_fn, _pool_runtime = fn, runtime
        running = context.Array("q", 2 * self.workers)
        pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                   initargs=(self.threads, os.getpid(), running))
        pool.pfl_running = running  # for _casualty, in this process
        return pool

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        split = split_view_call(fn)
        if split is None:  # not the client side: a pool of its own, forked now
            make_pool, call = (lambda: self._new_pool(fn=fn)), None
        else:
            constant, call = split
            if self._run_pool is None or any(self._run_pool_constant[n] is not v for n, v in constant.items()):
                self.close()
                self._run_pool, self._run_pool_constant = self._new_pool(runtime=constant), constant

            def make_pool():  # after a worker died: a fresh pool of the same run
                self._run_pool.shutdown(wait=True, cancel_futures=True)
                self._run_pool = self._new_pool(runtime=constant)
                return self._run_pool

        pool = self._run_pool if split is not None else make_pool()
        # what "the same function" is across maps: the client-side function, else the code of
        # the function given (never the function itself: a closure would keep the run alive)
        kind = call[0] if call is not None else getattr(getattr(fn, "func", fn), "__code__", None)
        per_item = self._item_seconds.get(kind)
        chunk_size = (self.CHUNK if per_item is None else
                      max(1, min(self.MAX_CHUNK, round(self.CHUNK_SECONDS / max(per_item, 1e-6)))))
        spent, done = 0.0, 0
        window = 2 * self.workers  # chunks in flight: enough to keep every worker busy
        source = enumerate(items)
        pending: collections.deque = collections.deque()  # (indices, items, future) per chunk
        failures: collections.Counter = collections.Counter()

        def submit(chunk: list) -> None:
            indices, chunk_items = [i for i, _ in chunk], [it for _, it in chunk]
            pending.append((indices, chunk_items, pool.submit(_call, indices, _pickled((call, chunk_items)))))

        def fill():
            while len(pending) < window:
                chunk = list(itertools.islice(source, chunk_size))
                if not chunk:
                    return
                submit(chunk)

        try:
            fill()
            while pending:
                indices, chunk_items, future = pending[0]
                try:
                    pickled, seconds = future.result()
                    results = [pickle.loads(result) for result in pickled]
                except BrokenProcessPool:
                    dead, code = self._casualty(pool)
                    unfinished = [(i, it) for idx, its, _ in pending for i, it in zip(idx, its)]
                    culprit = next(((i, it) for i, it in unfinished if i == dead), unfinished[0])
                    failures[culprit[0]] += 1
                    if failures[culprit[0]] > self.retries:
                        raise PflError(f"executor: a worker process {_death(code)} while running {culprit[1]}; "
                                       f"retried {self.retries} time(s) (executor.retries = {self.retries})") from None
                    if split is None:
                        pool.shutdown(wait=True, cancel_futures=True)
                    pool = make_pool()  # run the unfinished items again, in order
                    pending.clear()
                    for start in range(0, len(unfinished), chunk_size):
                        submit(unfinished[start:start + chunk_size])
                    continue
                pending.popleft()
                spent, done = spent + seconds, done + len(results)
                if kind is not None:
                    self._item_seconds[kind] = spent / done
                fill()
                yield from results
        finally:
            for _, _, future in pending:  # a map left early (an error in the consumer)
                future.cancel()
            if split is None:
                pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _casualty(pool, wait: float = 3.0) -> tuple[int | None, int | None]:
        """(index of the item the dead worker ran, its exit code), from the pool's slot array.

        A broken pool SIGTERMs its other workers, so the first to die is the one whose exit
        code is not SIGTERM's; the exit codes are polled for a moment, as the pool's manager
        thread may not have reaped the processes yet."""
        processes = dict(getattr(pool, "_processes", None) or {})
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.exitcode is None for p in processes.values()):
            time.sleep(0.02)
        codes = {pid: p.exitcode for pid, p in processes.items() if p.exitcode not in (None, 0)}
        first = {pid: c for pid, c in codes.items() if c != -signal.SIGTERM} or codes
        running = pool.pfl_running
        for slot in range(len(running) // 2):
            if running[2 * slot] in first:
                return int(running[2 * slot + 1]), first[running[2 * slot]]
        return None, next(iter(first.values()), None)

    def close(self) -> None:
        """Stop the run's pool (the engine calls this at the end of a run)."""
        if self._run_pool is not None:
            self._run_pool.shutdown(wait=True, cancel_futures=True)
        self._run_pool = self._run_pool_constant = None


# -- Ray ----------------------------------------------------------------------------------

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


# Parameter-samples (model parameters x samples trained) a round needs before a pool pays
# for itself: forking and feeding a pool costs ~0.1-0.3 s a round on this project's 2-core
# machines, and one parameter-sample ~10-40 ns, so below ~1e8 a round is over before the
# pool saves that much (e.g. the quickstart's logistic regression: 5e6, sequential; 100
# LeNet-5 clients x 500 samples: 3e9, the pool).
POOL_MIN_WORK = 1e8


def plan(section, device: str, participants_per_round: int, param_samples_per_round: float) -> tuple[str, int, int]:
    """(executor name, workers, torch threads) for a spec's ``[executor]``.

    ``name = "auto"``: a process pool with one 1-thread worker per core when there is enough
    per-round work to share (at least two participants per worker and ``POOL_MIN_WORK``
    parameter-samples), else the sequential loop with one thread. One thread per process
    because torch's default (one per core) oversubscribes a machine that is shared or
    already running other workers: measured 6x slower on this project's 2-core machines.
    A CUDA device keeps the sequential loop (a forked process cannot use the parent's CUDA).
    """
    threads = section.threads or 1
    cores = available_cores()
    workers = section.workers or cores
    name = section.name
    if name == "auto":
        enough_work = participants_per_round >= 2 * workers and param_samples_per_round >= POOL_MIN_WORK
        name = "process" if (device == "cpu" and cores >= 2 and enough_work and
                             "fork" in multiprocessing.get_all_start_methods()) else "sequential"
    return name, workers, threads


def make_executor(name: str, workers: int = 1, threads: int = 1, retries: int = 1, address: str = ""):
    if name == "process":
        return ProcessExecutor(workers, threads, retries)
    if name == "ray":
        return RayExecutor(workers, threads, retries, address)
    return {"sequential": SequentialExecutor, "batched": BatchedExecutor}[name]()
