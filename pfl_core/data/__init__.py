"""The data layer: dataset plugins, partition plugins and the per-client data they make.

``build_federated_data(spec)`` is the entry point used by the core; the plugin base classes
``DatasetPlugin`` and ``PartitionerPlugin`` are what third-party datasets and schemes subclass.
"""

from pfl_core.data.base import DatasetPlugin, PartitionerPlugin, RawDataset
from pfl_core.data.federated import (
    ClientData,
    FederatedData,
    PublicData,
    apportion,
    build_federated_data,
    stratified_split,
)
from pfl_core.data.partitioners import pathological_split, split_by_proportions

__all__ = [
    "ClientData",
    "DatasetPlugin",
    "FederatedData",
    "PartitionerPlugin",
    "PublicData",
    "RawDataset",
    "apportion",
    "build_federated_data",
    "pathological_split",
    "split_by_proportions",
    "stratified_split",
]
