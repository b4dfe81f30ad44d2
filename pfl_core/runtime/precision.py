"""``training.precision``: the arithmetic of the model's forward passes and losses.

"fp32" (the default) changes nothing. "bf16" runs the forward pass and the loss of local
training, of evaluation and of a method's server-side training under ``torch.autocast`` with
dtype bfloat16: matrix products and convolutions in bfloat16, losses and reductions in float32
(torch's autocast lists). Weights, gradients, optimiser state, uploads and aggregation stay
float32: autocast casts copies of the weights for each product, never the weights themselves.

Every loop that runs a model enters :func:`precision_autocast` (the client side of a round,
evaluation, the batched executor's joint step, server-side training such as COSMOS's
distillation and FedGen's generator), so a plugin's own loop inside ``local_train`` or
``personalized_models`` is covered without knowing about it.
"""

from __future__ import annotations

import contextlib

import torch

from pfl_core.errors import SpecError


def precision_autocast(training, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context to run a model's forward pass and loss in, for the run's ``training`` section
    (``TrainingSection``) on ``device``: autocast to bfloat16 for ``precision = "bf16"``, else
    nothing at all (fp32 results bit-identical to a run without it)."""
    if training.precision != "bf16":
        return contextlib.nullcontext()
    # No cast cache: the context spans whole training loops, and autocast's cache would keep
    # feeding the first step's bfloat16 copy of each weight to every later forward pass.
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, cache_enabled=False)


def bf16_supported(device: torch.device | str) -> bool:
    """Whether ``device`` computes in bfloat16 natively: on a GPU torch's own check, on a CPU
    torch's check of the AVX512-BF16 and AMX instructions. Not oneDNN's "bf16 supported", which
    is true on any AVX-512 CPU: without those instructions it emulates bfloat16, measured 2x
    slower than float32 here (docs/benchmarks.md, "bf16")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def check_precision_supported(training, device: torch.device | str) -> None:
    """Refuse ``training.precision = "bf16"`` on a machine without bfloat16 support, in one line."""
    if training.precision == "bf16" and not bf16_supported(device):
        where = "this GPU" if torch.device(device).type == "cuda" else "this CPU (no avx512_bf16, no AMX)"
        raise SpecError("training.precision", f"'bf16' needs native bfloat16 support, which {where} lacks "
                                              "(emulated, it runs slower than fp32); use 'fp32' (the default)")
