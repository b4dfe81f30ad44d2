"""Execution: where the client side of a round runs, one client after another (sequential), in
a pool of forked processes (process), on a Ray cluster (ray), or vectorised (batched); and the
plan that picks one. Every executor gives results bit-identical to the sequential loop
(batched: within float rounding).

- :mod:`~pfl_core.execution.executors`: the executors, ``plan`` and ``make_executor``;
- :mod:`~pfl_core.execution.batched`: training same-architecture clients together (torch.func).
"""
