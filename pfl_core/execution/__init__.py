"""Execution: where the client side of a round runs, one client after another (sequential), in
a pool of forked processes (process), on a Ray cluster (ray), or vectorised (batched); and the
plan that picks one. Every executor gives results bit-identical to the sequential loop
(batched: within float rounding).

- :mod:`~pfl_core.execution.planner`: ``plan`` (which executor a run gets), ``make_executor`` and
  ``ExecutorCache`` (a process pool kept from one tuning trial for the next);
- :mod:`~pfl_core.execution.sequential`: ``SequentialExecutor`` and ``BatchedExecutor``;
- :mod:`~pfl_core.execution.batched`: training same-architecture clients together (torch.func);
- :mod:`~pfl_core.execution.process`: ``ProcessExecutor``, the pool of forked workers;
- :mod:`~pfl_core.execution.ray_executor`: ``RayExecutor``;
- :mod:`~pfl_core.execution.views`: a client-side call taken apart for another process.
"""

from pfl_core.execution.planner import POOL_MIN_WORK, ExecutorCache, make_executor, plan
from pfl_core.execution.process import ProcessExecutor
from pfl_core.execution.ray_executor import RayExecutor
from pfl_core.execution.sequential import BatchedExecutor, SequentialExecutor, available_cores

__all__ = ["POOL_MIN_WORK", "BatchedExecutor", "ExecutorCache", "ProcessExecutor", "RayExecutor", "SequentialExecutor",
           "available_cores", "make_executor", "plan"]
