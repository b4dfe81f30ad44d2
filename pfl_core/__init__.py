"""pfl: personalized federated learning as plugins."""

from .errors import DataError, PflError, SpecError
from .hookspecs import hookimpl
from .registry import ADDON, ALGORITHM, DATASET, MODEL, PARTITIONER, NoParams, Plugin

__version__ = "0.1.0"

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
