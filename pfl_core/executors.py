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
import multiprocessing
import os
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from .errors import PflError

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


# The function of the current ``ProcessExecutor.map``: set before the workers fork, so they
# inherit it (and everything it refers to: data, models, plugins) without pickling.
_work_fn: Callable | None = None
_running = None  # shared array: per worker slot, (pid, index of the item it runs)


def _init_worker(threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def _call(index: int, payload: bytes) -> bytes:
    """Run one item in a worker. Items and results travel as plain pickles made here: torch's
    multiprocessing pickler would move tensors to shared memory instead, and a result that
    shares the worker's working model would change under the server as the worker goes on."""
    with _running.get_lock():  # claim a slot the first time this worker runs an item
        pid = os.getpid()
        slot = next((s for s in range(len(_running) // 2) if _running[2 * s] == pid), None)
        if slot is None:
            slot = next(s for s in range(len(_running) // 2) if _running[2 * s] == 0)
            _running[2 * slot] = pid
        _running[2 * slot + 1] = index
    return pickle.dumps(_work_fn(pickle.loads(payload)), protocol=pickle.HIGHEST_PROTOCOL)


def _pickled(item) -> bytes:
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        why = " (out of memory, or killed)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


class ProcessExecutor:
    """A pool of worker processes on this machine, forked for each ``map``.

    Forking shares the data set, the models and the plugins with the workers without copying
    them (copy-on-write); only the items (a client's message and state) and the results (its
    upload and new state) travel, pickled through pipes between this machine's own processes.
    Each worker runs one torch thread. Results come back in the items' order whatever order
    the workers finish in. A worker that dies is reported with the item it ran; that item and
    the ones not yet finished are run again in a new pool, up to ``retries`` times per item.
    """

    name = "process"

    def __init__(self, workers: int, threads: int = 1, retries: int = 1):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise PflError("executor.name: 'process' needs the fork start method (Linux); "
                           "use 'sequential' or 'ray' on this platform")
        self.workers = workers
        self.threads = threads
        self.retries = retries

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        context = multiprocessing.get_context("fork")
        window = 2 * self.workers  # items in flight: enough to keep every worker busy
        source = enumerate(items)
        pending: collections.deque = collections.deque()  # (index, item, future)
        failures: collections.Counter = collections.Counter()
        pool = None

        def new_pool():
            global _work_fn, _running
            _work_fn = fn  # inherited by the workers this pool forks (another map may run meanwhile)
            _running = context.Array("q", 2 * self.workers)
            return ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                       initargs=(self.threads,))

        def fill():
            while len(pending) < window:
                nxt = next(source, None)
                if nxt is None:
                    return
                index, item = nxt
                pending.append((index, item, pool.submit(_call, index, _pickled(item))))

        try:
            pool = new_pool()
            fill()
            while pending:
                index, item, future = pending[0]
                try:
                    result = pickle.loads(future.result())
                except BrokenProcessPool:
                    dead = self._dead_item(pool)
                    culprit = next(((i, it) for i, it, _ in pending if i == dead), (index, item))
                    failures[culprit[0]] += 1
                    code = self._dead_code(pool)
                    if failures[culprit[0]] > self.retries:
                        raise PflError(f"executor: a worker process {_death(code)} while running {culprit[1]}; "
                                       f"retried {self.retries} time(s) (executor.retries = {self.retries})") from None
                    pool.shutdown(wait=True, cancel_futures=True)
                    pool = new_pool()  # run the unfinished items again, in order
                    unfinished = [(i, it) for i, it, _ in pending]
                    pending.clear()
                    for i, it in unfinished:
                        pending.append((i, it, pool.submit(_call, i, _pickled(it))))
                    continue
                pending.popleft()
                fill()
                yield result
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _dead_code(pool) -> int | None:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            if process.exitcode not in (None, 0):
                return process.exitcode
        return None

    @staticmethod
    def _dead_item(pool) -> int | None:
        """The index of the item a dead worker was running, from the shared slot array."""
        processes = getattr(pool, "_processes", None) or {}
        dead = {pid for pid, p in processes.items() if p.exitcode not in (None, 0)}
        for slot in range(len(_running) // 2):
            if _running[2 * slot] in dead:
                return int(_running[2 * slot + 1])
        return None

    def close(self) -> None:
        pass


EXECUTORS = {SequentialExecutor.name: SequentialExecutor, ProcessExecutor.name: ProcessExecutor}


def plan(section, device: str, participants_per_round: int, samples_per_client: float) -> tuple[str, int, int]:
    """(executor name, workers, torch threads) for a spec's ``[executor]``.

    ``name = "auto"``: a process pool with one 1-thread worker per core when there is enough
    per-round work to share (at least two participants per worker, and enough samples that
    forking the pool costs little), else the sequential loop with one thread. One thread per
    process because torch's default (one per core) oversubscribes a machine that is shared or
    already running other workers: measured 6x slower on this project's 2-core machines.
    A CUDA device keeps the sequential loop (a forked process cannot use the parent's CUDA).
    """
    threads = section.threads or 1
    cores = available_cores()
    workers = section.workers or cores
    name = section.name
    if name == "auto":
        enough_work = participants_per_round >= 2 * workers and participants_per_round * samples_per_client >= 2000
        name = "process" if (device == "cpu" and cores >= 2 and enough_work and
                             "fork" in multiprocessing.get_all_start_methods()) else "sequential"
    return name, workers, threads


def make_executor(name: str, workers: int = 1, threads: int = 1, retries: int = 1):
    if name == "process":
        return ProcessExecutor(workers, threads, retries)
    return EXECUTORS[name]()
