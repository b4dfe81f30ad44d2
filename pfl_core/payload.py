"""Named payloads between server and clients, and their size in bytes as sent.

A message is a plain ``dict`` of named payloads: tensors (weights, soft labels, prototypes),
numpy arrays, numbers, nested dicts/lists, or :class:`Packed` values whose wire size is
given in bits per element (hard labels in ceil(log2 C) bits, 8-bit quantised scores). The
engine counts :func:`nbytes` of every broadcast and upload, so methods that send labels and
methods that send weights are compared on the same scale.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np
import torch

Message = dict


@attrs.frozen
class Packed:
    """A value sent with ``bits`` bits per element (e.g. class indices, quantised scores)."""

    value: Any
    bits: int

    @property
    def numel(self) -> int:
        v = self.value
        if isinstance(v, torch.Tensor):
            return v.numel()
        return int(np.asarray(v).size)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.numel * self.bits / 8)


def bits_for_classes(num_classes: int) -> int:
    """Bits to send one class index out of ``num_classes`` (at least 1)."""
    return max(1, math.ceil(math.log2(num_classes)))


def nbytes(obj: Any) -> int:
    """Wire size of a payload: tensors and arrays at their element size, numbers as 8 bytes."""
    if obj is None:
        return 0
    if isinstance(obj, Packed):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (bool, int, float, np.number)):
        return 8
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    raise TypeError(f"cannot count the bytes of a {type(obj).__name__} payload")
