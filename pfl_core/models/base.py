"""The base class of model plugins and small helpers shared by the zoo.

A model plugin turns a dataset's input shape and class count into a fresh ``torch.nn.Module``
that returns logits (no softmax). ``build`` may be called many times in one run (one model per
client, per-client architectures); every call draws its initial weights from torch's global
RNG only, so ``torch.manual_seed(s)`` followed by ``build`` always gives the same weights.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch
from torch import nn

from pfl_core import registry
from pfl_core.errors import SpecError


class ModelPlugin(registry.Plugin):
    """Base of every model plugin.

    Subclasses set ``name``, ``Params`` (an attrs class) and implement :meth:`build`.
    ``requires_image`` says whether the architecture needs ``(C, H, W)`` inputs; such models
    call :meth:`check_image_input` first so a feature-vector dataset gets a clear
    :class:`~pfl_core.errors.SpecError` at ``name_path`` instead of a shape error deep in torch.
    """

    kind: ClassVar[str] = registry.MODEL
    requires_image: ClassVar[bool] = True
    # Spec key reported when this model cannot take the dataset's inputs. The engine may set
    # it per instance (e.g. "model.pool[1]") when building per-client architectures.
    name_path: str = "model.name"

    def build(self, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """A freshly initialised module mapping a batch of ``input_shape`` inputs to logits.

        ``input_shape`` excludes the batch dimension: ``(C, H, W)`` for images, ``(D,)`` for
        feature vectors. The module's output has shape ``(batch, num_classes)``.
        """
        raise NotImplementedError

    # -- helpers for subclasses ---------------------------------------------------------

    def check_shape(self, input_shape: Sequence[int], num_classes: int) -> tuple[int, ...]:
        """Validate the arguments of :meth:`build`; returns ``input_shape`` as a tuple of ints."""
        shape = tuple(int(d) for d in input_shape)
        if not shape or any(d < 1 for d in shape):
            raise ValueError(f"input_shape must be non-empty positive sizes, got {tuple(input_shape)!r}")
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        if self.requires_image:
            self.check_image_input(shape)
        return shape

    def check_image_input(self, input_shape: tuple[int, ...]) -> None:
        if len(input_shape) == 3:
            return
        what = "feature vectors" if len(input_shape) == 1 else "inputs"
        raise SpecError(
            self.name_path,
            f"{self.name} needs image inputs (C, H, W); this dataset gives {what} of shape "
            f"{tuple(input_shape)!r}",
        )

    def check_forward(self, model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """Run one dummy sample through ``model`` (eval mode, no grad) to reject inputs too
        small for the architecture with a SpecError; returns ``model`` in training mode.

        Eval mode leaves BatchNorm statistics untouched and dropout off, and zeros use no RNG,
        so this check changes neither the weights nor torch's random state.
        """
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(torch.zeros((1, *input_shape)))
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError(
                self.name_path,
                f"{self.name} cannot take inputs of shape {tuple(input_shape)!r} (too small for "
                f"its downsampling?): {reason}",
            ) from None
        finally:
            model.train(was_training)
        if tuple(out.shape) != (1, num_classes):  # a bug in the architecture, not the spec
            raise AssertionError(f"{self.name} gave output shape {tuple(out.shape)}, expected (1, {num_classes})")
        return model


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters of ``module`` (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
