"""Run-constant values that a plugin's hooks compute for themselves, cached once per run.

A value that is a pure function of the spec and the models (which state-dict keys form the
head, how layers line up across architectures) is needed on both sides of a round. Client-side
hooks must not read the server's copy from ``ctx.server``: an executor may run them in another
process or machine (docs/architecture.md, "The client-side contract"). Each side computes it;
this cache makes that cheap. Entries are keyed by the run's model bank (weakly, so they go with
the run; a worker process holding its own copy of the bank computes its own) and by the plugin.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def per_run(ctx, plugin, name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per (run, plugin, name); later calls return the same value."""
    try:
        entries = _CACHE.setdefault(ctx.models, {})
    except TypeError:  # a stand-in context (tests) whose model bank cannot be weakly referenced
        return compute()
    key = (plugin, name)
    if key not in entries:
        entries[key] = compute()
    return entries[key]
