"""The round engine: resolve a spec into plugins, then run one run's rounds, evaluate and
track them (``Engine``). Below the study, which runs points and seeds; above execution, state
and tracking, which it wires together.

``Engine``, ``resolve``, ``Resolved`` and ``RunResult`` are re-exported here.
"""

from pfl_core.engine.engine import Engine, Resolved, RunResult, resolve

__all__ = ["Engine", "Resolved", "RunResult", "resolve"]
