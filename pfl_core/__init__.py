"""pfl: personalized federated learning as plugins."""

import importlib

from pfl_core import _deprecated
from pfl_core._version import __version__ as __version__

# pfl 0.1's flat module paths (pfl_core.context, ...) as deprecated aliases for one release.
_deprecated.install()

# The public names are imported when first used (PEP 562): the console scripts import this
# package before their entry function runs, and a Ctrl-C during an import made there is a
# traceback no code of pfl can catch (issue 33).
_PUBLIC = {
    "ADDON": "pfl_core.registry",
    "ALGORITHM": "pfl_core.registry",
    "DATASET": "pfl_core.registry",
    "MODEL": "pfl_core.registry",
    "PARTITIONER": "pfl_core.registry",
    "DataError": "pfl_core.errors",
    "NoParams": "pfl_core.registry",
    "PflError": "pfl_core.errors",
    "Plugin": "pfl_core.registry",
    "SpecError": "pfl_core.errors",
    "hookimpl": "pfl_core.registry.hookspecs",
}

__all__ = ["ADDON", "ALGORITHM", "DATASET", "MODEL", "PARTITIONER", "DataError", "NoParams", "PflError", "Plugin",
           "SpecError", "hookimpl"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pfl_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


TYPE_CHECKING = False  # typing's own costs ~6 ms of that import; type checkers know the name
if TYPE_CHECKING:
    from pfl_core.errors import DataError, PflError, SpecError
    from pfl_core.registry import ADDON, ALGORITHM, DATASET, MODEL, PARTITIONER, NoParams, Plugin
    from pfl_core.registry.hookspecs import hookimpl
