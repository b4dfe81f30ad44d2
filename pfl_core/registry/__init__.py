"""The plugin system: the hook specifications, the :class:`Plugin` base class, discovery of
plugins through the ``pfl`` entry-point group, the core's default hook implementations, the
declared local work (budget) and the generated parameter reference.

- :mod:`~pfl_core.registry.hookspecs`: every hook, its arguments and contract;
- :mod:`~pfl_core.registry.plugins`: ``Plugin``, discovery, instantiation, the plugin manager;
- :mod:`~pfl_core.registry.defaults`: what the core does when no plugin implements a hook;
- :mod:`~pfl_core.registry.budget`: the local work a method declares and the engine counts;
- :mod:`~pfl_core.registry.docgen`: ``pfl docs``, the parameter tables of docs/spec-reference.md.

The names of :mod:`~pfl_core.registry.plugins` are re-exported here (``pfl_core.registry.Plugin``).
"""

from pfl_core.registry.plugins import (
    ADDON,
    ALGORITHM,
    DATASET,
    ENTRY_POINT_GROUP,
    KINDS,
    MODEL,
    PARTITIONER,
    Discovered,
    NoParams,
    Plugin,
    discovered,
    implemented_hooks,
    instantiate,
    make_plugin_manager,
    names_of_kind,
    plugin_class,
    refresh,
    reject_unknown_hooks,
    resolve,
    resolved_params,
)

__all__ = [
    "ADDON", "ALGORITHM", "DATASET", "Discovered", "ENTRY_POINT_GROUP", "KINDS", "MODEL", "NoParams",
    "PARTITIONER", "Plugin", "discovered", "implemented_hooks", "instantiate", "make_plugin_manager",
    "names_of_kind", "plugin_class", "refresh", "reject_unknown_hooks", "resolve", "resolved_params",
]
