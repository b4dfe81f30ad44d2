"""Model plugins: the zoo of architectures and layer bookkeeping for base/head methods."""

from pfl_core.models.base import ModelPlugin, count_parameters
from pfl_core.models.layers import layer_keys, layer_of_parameter, parameterised_layers, split_at, split_index

__all__ = [
    "ModelPlugin",
    "count_parameters",
    "layer_keys",
    "layer_of_parameter",
    "parameterised_layers",
    "split_at",
    "split_index",
]
