"""Deprecated import paths of pfl 0.1's flat layout, kept for one release (CHANGELOG.md).

``import pfl_core.context`` still works: it warns (DeprecationWarning) and gives the module's
new home, ``pfl_core.runtime.context`` (the same module object, so patching one patches the
other). Plugin authors should import from :mod:`pfl_core.api` instead. The top-level package
``plugins`` has no alias: installing one is the collision the rename removed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

MOVED = {
    "pfl_core.aggregate": "pfl_core.runtime.aggregate",
    "pfl_core.batched": "pfl_core.execution.batched",
    "pfl_core.budget": "pfl_core.registry.budget",
    "pfl_core.checkpoint": "pfl_core.state.checkpoint",
    "pfl_core.context": "pfl_core.runtime.context",
    "pfl_core.defaults": "pfl_core.registry.defaults",
    "pfl_core.docgen": "pfl_core.registry.docgen",
    "pfl_core.evaluation": "pfl_core.runtime.evaluation",
    "pfl_core.executors": "pfl_core.execution",
    "pfl_core.hookspecs": "pfl_core.registry.hookspecs",
    "pfl_core.journal": "pfl_core.tracking.journal",
    "pfl_core.plots": "pfl_core.tracking.plots",
    "pfl_core.results": "pfl_core.study.results",
    "pfl_core.runner": "pfl_core.study",
    "pfl_core.stateio": "pfl_core.state.stateio",
    "pfl_core.stats": "pfl_core.study.stats",
    "pfl_core.store": "pfl_core.state.store",
    "pfl_core.training": "pfl_core.runtime.training",
}


class _Alias:
    """Finds an old module name and loads it as its new module (a meta path finder and its
    loader; not derived from ``importlib.abc``, whose import costs ~25 ms before ``pfl-run`` can
    catch a Ctrl-C)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} is deprecated and will be removed in pfl 0.3: import {new} "
                      f"(plugin authors: pfl_core.api)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module is already executed


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
