"""Executors run per-client (and server-side) work items.

The engine hands an executor a function and the items to run it on and consumes the results
lazily, in the items' order, so a streaming aggregate holds few uploads at a time and sees
them in the order the sequential loop produces. Server-side work that is per cluster or per
client (e.g. one distillation job per cluster) goes through the same ``map``.

``map``'s function may only touch its item and read-only run data (the client-side contract,
docs/architecture.md): with ``process`` it runs in a forked worker, whose changes to anything
else are lost.

This module: the executors that run in this process (sequential, batched).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, TypeVar

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
    train together: stacked parameters, one ``torch.func.vmap`` per step (pfl_core/execution/batched.py,
    which says which methods qualify). Any other work runs one item after another."""

    name = "batched"

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        from pfl_core.execution import batched  # lazily: torch.func is only needed here

        return batched.map_clients(fn, items)
