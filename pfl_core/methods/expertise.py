"""FedMosaic's expertise scores on the wire: their known range and their uniform quantisation
to ``bits`` bits; shared by FedMosaic and the privacy add-ons that perturb the scores."""

from __future__ import annotations

import math

import torch


def expertise_bound(mode: str, num_classes: int) -> float:
    """The known range [0, c] of an expertise score: c = 1 ("W"), log C ("U")."""
    return 1.0 if mode == "W" else math.log(num_classes)


def quantise(values: torch.Tensor, bound: float, bits: int) -> torch.Tensor:
    """Codes round(clip(v, 0, bound) / bound * (2^bits - 1)) as the smallest integer dtype."""
    levels = (1 << bits) - 1
    codes = torch.round((values.double() / bound).clamp(0, 1) * levels)
    return codes.to(torch.uint8 if bits <= 8 else torch.int32)


def dequantise(codes: torch.Tensor, bound: float, bits: int) -> torch.Tensor:
    return codes.double() / ((1 << bits) - 1) * bound
