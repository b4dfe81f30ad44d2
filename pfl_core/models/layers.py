"""Layer bookkeeping for methods that treat a model as base (input side) + head (output side).

A *layer* is a module that directly owns parameters (``module.parameters(recurse=False)`` is
non-empty): a Conv2d, a Linear, a BatchNorm (its own layer) and so on. Layers are listed in
module registration order, which for pfl's zoo and torchvision's models is forward order from
the input to the classifier. (A residual shortcut such as ResNet's ``downsample`` is
registered, and so listed, after the block's main branch.)

Every ``state_dict`` key belongs to exactly one layer: parameters to the module that owns them,
buffers (BatchNorm running statistics, ``num_batches_tracked``) to their owning module as well.
A module that has buffers but no parameters (e.g. ``BatchNorm(affine=False)``) is not a layer;
its buffers are attributed to the closest preceding layer (the first layer if none precedes).

These helpers serve pMixFed, FedRep, FedPer and LG-FedAvg, which share, mix or personalise
the base and the head separately.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from torch import nn

__all__ = ["layer_keys", "layer_of_parameter", "parameterised_layers", "split_at", "split_index"]


def parameterised_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each module that directly owns parameters, base to head.

    A module registered under several names (shared) is listed once, at its first name.
    """
    out = []
    seen = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            seen.add(id(module))
            out.append((name, module))
    return out


def _module_layers(model: nn.Module) -> dict[str, int]:
    """Layer index for every module name (including duplicates and non-layer modules)."""
    index_of = {id(module): i for i, (_, module) in enumerate(parameterised_layers(model))}
    out = {}
    current = 0
    for name, module in model.named_modules(remove_duplicate=False):
        current = index_of.get(id(module), current)
        out[name] = current
    return out


def layer_of_parameter(model: nn.Module) -> dict[str, int]:
    """Map every ``model.state_dict()`` key (parameters and buffers) to its layer index.

    Keys are in ``state_dict`` order, and for the models of the zoo the indices are
    non-decreasing in that order. A model without parameters maps every key to 0.
    """
    module_layer = _module_layers(model)
    out = {}
    for key in model.state_dict().keys():
        owner = key.rpartition(".")[0]
        # Walk up for keys whose owner is not a registered module name (defensive: extra
        # state of custom modules); the root always exists.
        while owner not in module_layer and owner:
            owner = owner.rpartition(".")[0]
        out[key] = module_layer.get(owner, 0)
    return out


def layer_keys(model: nn.Module) -> list[list[str]]:
    """The ``state_dict`` keys of each layer, in layer order (keys in state_dict order)."""
    layers = [[] for _ in range(max(1, len(parameterised_layers(model))))]
    for key, index in layer_of_parameter(model).items():
        layers[index].append(key)
    return layers


def split_index(model: nn.Module, fraction_or_index: int | float | None = None) -> int:
    """The index ``k`` at which :func:`split_at` cuts the layer list (base = layers ``< k``).

    ``None``: the middle, ``L // 2`` for ``L`` layers. An ``int``: a layer index, negative
    counting from the end like Python (``-1``: the head is the last layer), ``0 <= k <= L``
    after that. A ``float`` in ``[0, 1]``: that fraction of the layers goes to the base,
    ``floor(fraction * L)`` (so ``0.5`` is the default). ``1`` is an index, ``1.0`` a fraction.
    """
    n = len(parameterised_layers(model))
    if fraction_or_index is None:
        return n // 2
    if isinstance(fraction_or_index, bool):
        raise TypeError(f"split point must be an int index or a float fraction, got {fraction_or_index!r}")
    if isinstance(fraction_or_index, Integral):
        k = int(fraction_or_index)
        k = n + k if k < 0 else k
        if not 0 <= k <= n:
            raise ValueError(f"layer index {fraction_or_index} out of range for a model with {n} layers")
        return k
    if isinstance(fraction_or_index, Real):
        f = float(fraction_or_index)
        if not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ValueError(f"split fraction must be in [0, 1], got {fraction_or_index!r}")
        return int(math.floor(f * n))
    raise TypeError(f"split point must be an int index or a float fraction, got {fraction_or_index!r}")


def split_at(model: nn.Module, fraction_or_index: int | float | None = None) -> tuple[set[str], set[str]]:
    """``(base_keys, head_keys)``: the ``state_dict`` keys of layers before and from the split.

    See :func:`split_index` for the split point (default: the middle, ``L // 2``). The two sets
    partition ``model.state_dict()``'s keys; iterate the state dict (not the sets) when order
    matters.
    """
    k = split_index(model, fraction_or_index)
    base, head = set(), set()
    for key, index in layer_of_parameter(model).items():
        (base if index < k else head).add(key)
    return base, head
