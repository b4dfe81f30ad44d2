"""Aggregation arithmetic shared by weight-averaging methods."""

from __future__ import annotations

from typing import Iterable

import torch


def weighted_average(pairs: Iterable[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor] | None:
    """sum_i p_i * state_i over (p_i, state_i) pairs, streamed: one state held at a time.

    Weights are used as given (pass them normalised). Non-float entries (BatchNorm's
    ``num_batches_tracked``) are taken from the first state. None if there were no pairs.
    """
    total: dict[str, torch.Tensor] | None = None
    for weight, state in pairs:
        if total is None:
            total = {
                k: (v.detach() * weight) if v.is_floating_point() else v.detach().clone()
                for k, v in state.items()
            }
            continue
        for key, value in state.items():
            if value.is_floating_point():
                total[key].add_(value.detach(), alpha=weight)
    return total
