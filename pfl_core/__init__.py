"""pfl: personalized federated learning as plugins."""

from pfl_core._version import __version__ as __version__
from pfl_core.errors import DataError, PflError, SpecError
from pfl_core.registry import ADDON, ALGORITHM, DATASET, MODEL, PARTITIONER, NoParams, Plugin
from pfl_core.registry.hookspecs import hookimpl

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
