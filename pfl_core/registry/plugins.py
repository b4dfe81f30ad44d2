"""Plugin discovery and the per-run plugin manager.

Every plugin (algorithm, add-on, dataset, model, partitioner) is a class named by an entry
point in the group ``pfl``; pfl's own plugins are declared in its ``pyproject.toml`` exactly
as a third-party package declares its own. Discovery only maps names to classes; a run
instantiates and registers only the plugins its spec names, each with its parsed ``Params``.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar

import attrs
import pluggy

from pfl_core.errors import PflError, SpecError, did_you_mean, unknown_name
from pfl_core.registry import hookspecs
from pfl_core.spec import structure, unstructure

ENTRY_POINT_GROUP = "pfl"

ALGORITHM = "algorithm"
ADDON = "addon"
DATASET = "dataset"
MODEL = "model"
PARTITIONER = "partitioner"
KINDS = (ALGORITHM, ADDON, DATASET, MODEL, PARTITIONER)


@attrs.define
class NoParams:
    """Parameter class of a plugin that takes none."""


class Plugin:
    """Base of every plugin: a name, a kind and an attrs parameter class.

    Algorithms and add-ons implement hooks from :mod:`pfl_core.registry.hookspecs` as methods marked
    ``@hookimpl``. Datasets, models and partitioners implement ``load``, ``build`` and
    ``split`` respectively (see their base classes).
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ALGORITHM
    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any = None):
        self.params = params if params is not None else self.Params()
        # Where the spec configured this plugin ("algorithm", "addons[1]", "data", ...), so a
        # plugin's own checks name the full key path: f"{self.spec_path}.params.mu".
        self.spec_path = {ALGORITHM: "algorithm", DATASET: "data", PARTITIONER: "partition",
                          MODEL: "model"}.get(self.kind, self.kind)

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} {self.params}>"

    def local_work(self, spec):
        """The local training one participating client does (algorithms; see
        :mod:`pfl_core.registry.budget`). Default: ``training.local_epochs`` private epochs per round.
        Override when a method trains more (warm-up, pre-training, extra phases, public data)."""
        from pfl_core.registry.budget import LocalWork

        return LocalWork(float(spec.training.local_epochs))

    def server_archs(self, spec) -> dict[str, str]:
        """The model architectures this plugin builds through ``ctx.models`` besides the clients'
        (a server model), each with the spec key that names it: ``{"vgg16":
        "algorithm.params.server_arch"}``. ``pfl-run --dry-run`` (and a study, before its first
        run trains) builds them once, so one that cannot take the data's inputs, or is larger
        than this machine's memory, is said there. Default: none."""
        return {}


@attrs.frozen
class Discovered:
    name: str
    entry_point: EntryPoint

    @property
    def distribution(self) -> str:
        dist = self.entry_point.dist
        return dist.name if dist is not None else "?"

    @property
    def version(self) -> str:
        dist = self.entry_point.dist
        return dist.version if dist is not None else "?"

    def load(self) -> type:
        try:
            cls = self.entry_point.load()
        except Exception as exc:  # a broken third-party package must not crash discovery
            raise PflError(
                f"plugin '{self.name}' ({self.entry_point.value}) failed to import: {exc}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Plugin)):
            raise PflError(f"entry point '{self.name}' ({self.entry_point.value}) is not a pfl Plugin class")
        return cls


@lru_cache(maxsize=1)
def _discover() -> dict[str, Discovered]:
    found: dict[str, Discovered] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        # First one wins if two distributions claim a name; `pfl plugins` shows which.
        found.setdefault(ep.name, Discovered(ep.name, ep))
    return found


def refresh() -> None:
    """Forget cached discovery (after installing a package in the same process)."""
    _discover.cache_clear()
    plugin_class.cache_clear()


def discovered() -> dict[str, Discovered]:
    return dict(_discover())


@lru_cache(maxsize=None)
def plugin_class(name: str) -> type:
    return _discover()[name].load()


def names_of_kind(kind: str) -> list[str]:
    out = []
    for name, entry in _discover().items():
        try:
            cls = plugin_class(name)
        except PflError:
            continue
        if cls.kind == kind:
            out.append(name)
    return sorted(out)


def resolve(kind: str, name: str, path: str) -> type:
    """The plugin class of ``kind`` called ``name``; ``path`` is the spec key that named it."""
    if not isinstance(name, str) or name not in _discover():
        raise unknown_name(path, kind, name, names_of_kind(kind))
    cls = plugin_class(name)
    if cls.kind != kind:
        available = ", ".join(names_of_kind(kind)) or "none installed"
        raise SpecError(path, f"'{name}' is {_article(cls.kind)} {cls.kind} plugin, not {_article(kind)} {kind}; "
                              f"available: {available}")
    return cls


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def instantiate(kind: str, name: str, params: dict, name_path: str, params_path: str) -> Plugin:
    """Resolve a plugin and structure its parameter table into its Params class.

    ``name_path`` and ``params_path`` are the TOML key paths errors are reported at.
    """
    cls = resolve(kind, name, name_path)
    return cls(structure(params or {}, cls.Params, params_path))


def resolved_params(plugin: Plugin) -> dict:
    return unstructure(plugin.params)


def implemented_hooks(cls: type) -> list[str]:
    names = []
    for attr in dir(cls):
        fn = getattr(cls, attr, None)
        if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_impl"):
            names.append(attr)
    return sorted(names)


def make_plugin_manager(plugins: list[Plugin]) -> pluggy.PluginManager:
    """A fresh PluginManager holding the core defaults plus exactly the given plugins."""
    from pfl_core.registry.defaults import CoreDefaults

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.Hooks)
    pm.register(CoreDefaults(), name="pfl-core-defaults")
    for index, plugin in enumerate(plugins):
        pm.register(plugin, name=f"{plugin.name}#{index}")
    reject_unknown_hooks(pm)
    return pm


def reject_unknown_hooks(pm: pluggy.PluginManager) -> None:
    """A ``@hookimpl`` whose name matches no hook spec is silently ignored by pluggy unless
    checked: a typo (``local_trian``) must stop the run, naming the plugin and the hook."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        valid = sorted(name for name in dir(hookspecs.Hooks) if not name.startswith("_"))
        for name, caller in sorted(vars(pm.hook).items()):
            if isinstance(caller, pluggy.HookCaller) and not caller.has_spec():
                for impl in caller.get_hookimpls():
                    if impl.optionalhook:
                        continue
                    plugin = impl.plugin
                    raise SpecError(getattr(plugin, "spec_path", "plugins"),
                                    f"plugin '{getattr(plugin, 'name', impl.plugin_name)}' "
                                    f"({type(plugin).__module__}) implements '{name}', which is not a pfl "
                                    f"hook{did_you_mean(name, valid)}") from None
        raise
