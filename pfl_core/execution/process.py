"""The ``process`` executor: a pool of forked worker processes, one torch thread each, kept for
the run; items and results pickled with CPU tensors as raw bytes."""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import multiprocessing
import os
import pickle
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from pfl_core.data.cache import data_fingerprint, data_parts
from pfl_core.errors import PflError
from pfl_core.execution.views import rebuild_view_call, split_view_call
from pfl_core.tracking.terminal import warning_line

T = TypeVar("T")
R = TypeVar("R")

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


# A pool's workers fork with the parent's signal handlers (the command line's: raise Interrupted),
# and the pool SIGTERMs its workers when it breaks: each one printed that Interrupted's traceback.
# So the parent holds these signals while it forks (``_signals_held``), and a worker takes them
# back only once it has its own handlers.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_held():
    """Inside: SIGINT and SIGTERM wait (this thread blocks them), so a worker forked here starts
    with them held; the parent takes any that came once the block ends."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _init_worker(threads: int, parent: int, running) -> None:
    global _running, _slot
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stopped by the pool: end at once, print nothing
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # held since the fork
    _running = running  # this pool's slot array
    with running.get_lock():  # claim a free slot: (pid, item) pairs tell who ran what
        _slot = next(s for s in range(len(running) // 2) if running[2 * s] == 0)
        running[2 * _slot] = os.getpid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


class WorkerError(Exception):
    """Stands in for an exception a worker raised that would not come back whole: its class
    cannot be rebuilt from its pickle (an ``__init__`` whose arguments pickling drops), or is
    rebuilt with another message. The stand-in's class has the original's name and module and
    derives from the pfl error class the original derived from, if any; its message is the
    original's. So the run ends with the line the sequential loop prints, not with a broken
    pool; the worker's traceback (``--debug``) is the pool's ``_RemoteTraceback``."""

    pfl_base: type = Exception  # the pfl error class the original derived from, or Exception

    def __reduce__(self):
        cls = type(self)
        return _worker_error, (cls.__module__, cls.__qualname__, cls.pfl_base, str(self))


@functools.lru_cache(maxsize=None)
def _worker_error_class(module: str, qualname: str, base: type) -> type:
    return type(qualname.rpartition(".")[2], (WorkerError, base),
                {"__module__": module, "__qualname__": qualname, "pfl_base": base})


def _worker_error(module: str, qualname: str, base: type, message: str) -> WorkerError:
    cls = _worker_error_class(module, qualname, base)
    error = cls.__new__(cls)
    Exception.__init__(error, message)  # not the base's __init__: SpecError's takes (path, message)
    return error


def _returnable(exc: BaseException) -> BaseException:
    """``exc`` if the parent rebuilds it as it is from the pickle the pool sends, else its
    ``WorkerError`` stand-in."""
    try:
        rebuilt = ForkingPickler.loads(ForkingPickler.dumps(exc))
        if type(rebuilt) is type(exc) and str(rebuilt) == str(exc):
            return exc
    except Exception:
        pass
    try:
        message = str(exc)
    except Exception:
        message = "(its message could not be made)"
    base = next((c for c in type(exc).__mro__ if c.__module__ == PflError.__module__ and issubclass(c, Exception)),
                Exception)
    return _worker_error(type(exc).__module__, type(exc).__qualname__, base, message)


def _call(indices: list[int], payload: bytes) -> tuple[list[bytes], float, int]:
    """Run a chunk of items in a worker (see ``_run_chunk``); an exception the parent could not
    rebuild comes back as its ``WorkerError`` stand-in (it broke the pool)."""
    try:
        return _run_chunk(indices, payload)
    except BaseException as exc:
        returned = _returnable(exc)
        if returned is exc:
            raise
        raise returned from exc


def _run_chunk(indices: list[int], payload: bytes) -> tuple[list[bytes], float, int]:
    """Run a chunk of items in a worker. Items and results travel as plain pickles made here:
    torch's multiprocessing pickler would move tensors to shared memory instead. Each result
    is pickled as soon as it is computed: an upload may share the worker's working model,
    which the next item trains. Returns (results, CPU seconds, this worker's slot: it now holds
    the current run)."""
    started = time.process_time()
    generation, update, call, items = pickle.loads(payload)
    if call is not None and generation != _pool_generation:
        _load_runtime(generation, update)
    fn = _work_fn if call is None else _view_call(call)
    results = []
    for index, item in zip(indices, items):
        _running[2 * _slot + 1] = index  # which item a death is blamed on
        results.append(_pickled(fn(item)))
    return results, time.process_time() - started, _slot


_pool_runtime: dict | None = None  # in a persistent pool's workers: the run's constant part
_pool_generation = 0  # in those workers: which run it is (a kept pool serves several, one after another)


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


class _RuntimePickler(_TensorPickler):
    """Pickles a run's constant part for a kept pool's workers, the data set left out: each part
    of the data (``data_parts``) travels as its position, which the worker resolves in the
    copy it forked with (the same data, unchanged: ``ProcessExecutor._switch_run`` checks)."""

    def __init__(self, file, parts: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._positions = {id(part): i for i, part in enumerate(parts)}

    def persistent_id(self, obj):
        return self._positions.get(id(obj))


class _RuntimeUnpickler(pickle.Unpickler):
    def __init__(self, file, parts: list):
        super().__init__(file)
        self._parts = parts

    def persistent_load(self, position):
        return self._parts[position]


def _load_runtime(generation: int, update: bytes | None) -> None:
    """In a kept pool's worker: the next run's constant part, on the data it already holds."""
    global _pool_runtime, _pool_generation
    if update is None:  # the parent sends it until every worker has run with it
        raise RuntimeError(f"pfl: worker of run {_pool_generation} got an item of run {generation} without its runtime")
    data = _pool_runtime["data"]
    _pool_runtime = {**_RuntimeUnpickler(io.BytesIO(update), data_parts(data)).load(), "data": data}
    _pool_generation = generation


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
    finished are run again in a new pool, up to ``retries`` times per item. An exception an item
    raises comes back as itself, or, when its class cannot be rebuilt from its pickle, as a
    ``WorkerError`` of the same name and message. The workers ignore Ctrl-C (the parent stops
    the run) and die silently when the pool SIGTERMs them.

    A kept executor (``ExecutorCache``: the trials of a tuning study) serves the next run with
    the same pool when that run's data is the very object the workers forked with, unchanged
    since (``data_fingerprint``): the run's other constant parts (spec, parameters, models,
    plugins) travel to the workers, pickled once, with the first items of its first map. Any
    other change of run forks a new pool.
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
        self._run_pool_fingerprint: tuple | None = None  # of the data the run pool's workers forked with
        self._generation = 0  # which run of the kept pool the items belong to
        self._update: bytes | None = None  # that run's constant part, for workers still on an earlier one
        self._current: set[int] = set()  # the worker slots that have run an item of this generation
        self.pools_forked = 0  # run pools forked (benchmarks, tests)
        # Told of each retry (the engine adds an MLflow tag to the warning line).
        self.on_retry: Callable[[str], None] = warning_line

    def _new_pool(self, fn=None, runtime: dict | None = None):
        """A pool whose workers fork (at its first submit, right after this) with ``fn`` as the
        function of this map, or with ``runtime`` to rebuild client-side calls on."""
        global _work_fn, _pool_runtime, _pool_generation
        _warm_up_torch()
        context = multiprocessing.get_context("fork")
        _work_fn, _pool_runtime, _pool_generation = fn, runtime, self._generation
        if runtime is not None:
            self.pools_forked += 1
            self._run_pool_fingerprint = data_fingerprint(runtime["data"])
            self._current = set(range(self.workers))
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
                if not self._switch_run(constant):
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
            update = self._update if split is not None and len(self._current) < self.workers else None
            payload = _pickled((self._generation, update, call, chunk_items))
            with _signals_held():  # the pool forks its workers at its first submit
                pending.append((indices, chunk_items, pool.submit(_call, indices, payload)))

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
                    pickled, seconds, slot = future.result()
                    self._current.add(slot)  # maps run one at a time: every result is of this run
                    results = [pickle.loads(result) for result in pickled]
                except BrokenProcessPool:
                    dead, code = self._casualty(pool)
                    unfinished = [(i, it) for idx, its, _ in pending for i, it in zip(idx, its)]
                    culprit = next(((i, it) for i, it in unfinished if i == dead), unfinished[0])
                    failures[culprit[0]] += 1
                    if failures[culprit[0]] > self.retries:
                        raise PflError(f"executor: a worker process {_death(code)} while running {culprit[1]}; "
                                       f"retried {self.retries} time(s) (executor.retries = {self.retries})") from None
                    self.on_retry(f"a worker process {_death(code)} while running {culprit[1]}; running it again "
                                  f"(retry {failures[culprit[0]]} of {self.retries}, executor.retries)")
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

    def _switch_run(self, constant: dict) -> bool:
        """Let the run pool serve the run of ``constant`` if its workers hold that run's data as
        it is now; False when they cannot (then a new pool forks)."""
        held = self._run_pool_constant
        if (self._run_pool is None or constant["data"] is not held["data"] or constant["device"] != held["device"]
                or data_fingerprint(constant["data"]) != self._run_pool_fingerprint):
            return False
        buffer = io.BytesIO()
        try:
            _RuntimePickler(buffer, data_parts(constant["data"])).dump(
                {name: value for name, value in constant.items() if name != "data"})
        except Exception:  # something in the run that plain pickle cannot carry: fork instead
            return False
        self._generation += 1
        self._update, self._current, self._run_pool_constant = buffer.getvalue(), set(), constant
        return True

    def close(self) -> None:
        """Stop the run's pool (the engine calls this at the end of a run)."""
        if self._run_pool is not None:
            self._run_pool.shutdown(wait=True, cancel_futures=True)
        self._run_pool = self._run_pool_constant = self._update = None
