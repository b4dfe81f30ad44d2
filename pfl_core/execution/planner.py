"""Which executor a run gets (``plan``), building it (``make_executor``) and keeping it for the
next run (``ExecutorCache``)."""

from __future__ import annotations

import multiprocessing

from pfl_core.execution.process import ProcessExecutor
from pfl_core.execution.ray_executor import RayExecutor
from pfl_core.execution.sequential import BatchedExecutor, SequentialExecutor, available_cores

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


class ExecutorCache:
    """Executors kept from one run for the next (the trials of a tuning study, one after
    another): a process pool serves the next run without forking again when that run's data is
    the object its workers forked with, unchanged (``ProcessExecutor``). Other executors are
    closed at the end of their run, as without the cache."""

    def __init__(self):
        self._kept: dict[tuple, ProcessExecutor] = {}  # by (workers, threads, retries)

    def get(self, name: str, workers: int, threads: int, retries: int, address: str):
        kept = self._kept.pop((workers, threads, retries), None) if name == "process" else None
        return kept or make_executor(name, workers, threads, retries, address)

    def release(self, executor) -> None:
        """The run that got ``executor`` has ended: keep a process pool, close anything else."""
        if not isinstance(executor, ProcessExecutor):
            executor.close()
            return
        key = (executor.workers, executor.threads, executor.retries)
        previous = self._kept.get(key)
        if previous is not None and previous is not executor:
            previous.close()
        self._kept[key] = executor

    def close(self) -> None:
        for executor in self._kept.values():
            executor.close()
        self._kept.clear()
