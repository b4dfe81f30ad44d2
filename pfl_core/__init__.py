"""pfl: personalized federated learning as plugins."""

from pfl_core import _deprecated
from pfl_core._version import __version__ as __version__
from pfl_core.errors import DataError, PflError, SpecError
from pfl_core.registry import ADDON, ALGORITHM, DATASET, MODEL, PARTITIONER, NoParams, Plugin
from pfl_core.registry.hookspecs import hookimpl

# pfl 0.1's flat module paths (pfl_core.context, ...) as deprecated aliases for one release.
_deprecated.install()

__all__ = [
    "ADDON",
    "ALGORITHM",
    "DATASET",
    "MODEL",
    "PARTITIONER",
    "DataError",
    "NoParams",
    "PflError",
    "Plugin",
    "SpecError",
    "hookimpl",
]
