"""A client-side call taken apart for another process or machine: the run-constant part of its
``ClientView`` (sent once per run) and the round's facts (sent with each map)."""

from __future__ import annotations

import functools
import types

from pfl_core.runtime.context import ClientView

# What a ``ClientView`` carries that stays the same for a whole run (the process pool's workers
# inherit it when they fork; Ray gets it once per run). Its other fields (the round, the
# participants ...) travel with each map.
RUN_CONSTANT = ("spec", "params", "data", "models", "hooks", "device")


def split_view_call(fn) -> tuple[dict, tuple] | None:
    """For ``functools.partial(f, view, ...)`` with ``view`` a ``ClientView`` (the client side's
    shape): (the view's run-constant part, (f, other arguments, keywords, round facts)), so a
    worker can rebuild the call from a copy of the run it already holds; else None."""
    if not (isinstance(fn, functools.partial) and fn.args and isinstance(fn.args[0], ClientView)):
        return None
    view = fn.args[0]
    constant = {name: getattr(view, name) for name in RUN_CONSTANT}
    facts = {name: getattr(view, name) for name in ClientView.READ_ONLY if name not in RUN_CONSTANT}
    return constant, (fn.func, fn.args[1:], fn.keywords, facts)


def rebuild_view_call(runtime: dict, call: tuple):
    """The function ``split_view_call`` took apart, on ``runtime`` (a copy of its constant part)."""
    func, args, kwargs, facts = call
    return functools.partial(func, ClientView(types.SimpleNamespace(**runtime, **facts)), *args, **kwargs)
