"""Executors run per-client (and server-side) work items.

The engine hands an executor a function and the items to run it on and consumes the results
lazily, so a streaming aggregate holds one client's upload at a time. Server-side work
(e.g. one distillation job per cluster) goes through the same ``map``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class SequentialExecutor:
    """Runs items one after another in this process, in the order given."""

    name = "sequential"

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        for item in items:
            yield fn(item)


EXECUTORS = {SequentialExecutor.name: SequentialExecutor}


def make_executor(section) -> SequentialExecutor:
    return EXECUTORS[section.name]()
