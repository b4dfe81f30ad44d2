"""Validators of spec fields and plugin parameters, and the limits no spec may exceed.

A validator raises :class:`FieldError`; the structuring code (:mod:`pfl_core.spec.convert`) turns it
into a :class:`~pfl_core.errors.SpecError` carrying the full TOML key path.
"""

from __future__ import annotations

import collections
import json
import math
import struct

from pfl_core.errors import did_you_mean


class FieldError(ValueError):
    def __init__(self, name: str, message: str):
        self.name = name
        self.message = message
        super().__init__(f"{name}: {message}")

    def __reduce__(self):
        return type(self), (self.name, self.message)


def described(text: str):
    """Mark a validator with the constraint it enforces, in words (``"each >= 1"``): the
    ``constraint`` column of the generated parameter reference (``pfl docs``,
    :mod:`pfl_core.registry.docgen`). Only sets the attribute ``describe``; the check is unchanged."""

    def mark(validator):
        validator.describe = text
        return validator

    return mark


def _check(predicate, description):
    @described(description)
    def validator(_instance, attribute, value):
        if value is not None and not predicate(value):
            raise FieldError(attribute.name, f"must be {description}, got {value!r}")

    return validator


def at_least(bound):
    return _check(lambda v: v >= bound, f">= {bound}")


def greater_than(bound):
    return _check(lambda v: v > bound, f"> {bound}")


def at_most(bound):
    return _check(lambda v: v <= bound, f"<= {bound}")


def between(low, high, *, low_open=False, high_open=False):
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")

    def ok(v):
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return _check(ok, f"in {lo}{low}, {high}{hi}")


@described("finite")
def finite(_instance, attribute, value):
    if value is not None and not math.isfinite(value):
        raise FieldError(attribute.name, f"must be a finite number, got {value!r}")


def as_float32(value: float) -> float:
    """``value`` rounded to float32, the precision of the tensors it scales (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # rounds beyond float32's largest
        return math.copysign(math.inf, value)


@described("in [1.2e-38, 3.4e38], float32's normal range")
def learning_rate(_instance, attribute, value):
    """A step size: finite, > 0, and a normal float32. A smaller one is 0 in float32
    (``training.lr = 1e-46``: the run trained nothing and reported the initial model) or a
    subnormal number, which a run flushes to 0 (the engine's ``torch.set_flush_denormal``)."""
    if value is None:
        return
    finite(_instance, attribute, value)
    if value <= 0:  # the words of finite and greater_than(0), which this replaced
        raise FieldError(attribute.name, f"must be > 0, got {value!r}")
    if value < FLOAT32_TINY:
        # float32 rounds up to half its smallest subnormal, 2**-149, to 0 (computed, not cast: a
        # cast after torch.set_flush_denormal(True) gives 0 for every subnormal)
        held = "0 in float32" if value <= 2.0**-150 else "a subnormal number in float32, which a run flushes to 0"
        raise FieldError(attribute.name, f"{value:g} is {held} (the precision of the weights it scales), so no step "
                                         f"would move them; it must be >= {FLOAT32_TINY:.3g} (float32's smallest "
                                         f"normal number)")
    if value > FLOAT_MAX:
        raise FieldError(attribute.name, f"{value:g} is beyond float32's range (|x| <= {FLOAT_MAX:.3g})")


def optimizer_step_problem(optimizer: str, lr: float, momentum: float) -> str | None:
    """Why ``optimizer`` (``training.optimizer``) cannot step at ``lr`` in float32, or None.

    What torch's optimisers derive from lr must fit float32 too: Adam's first step takes
    ``lr / (1 - beta1)`` (10 lr; torch converts it to float32 and stops with an overflow error
    beyond 3.4e38), SGD's momentum makes the step under a steady gradient ``lr / (1 -
    momentum)`` (momentum as float32 holds it: 0.99999999 is 1, whose velocity never decays)."""
    if optimizer == "adam":
        divisor = 1 - ADAM_BETAS[0] ** 1  # as torch.optim.Adam computes its first step size
        what, given = "adam's first step, lr / (1 - beta1)", f"beta1 = {ADAM_BETAS[0]}"
    else:
        divisor = max(1 - as_float32(momentum), 0.0)
        what, given = "sgd's step under a steady gradient, lr / (1 - momentum)", f"training.momentum = {momentum!r}"
    step = lr / divisor if divisor else math.inf
    if step <= FLOAT_MAX:
        return None
    return (f"{lr:g} makes {what} = {step:.3g} ({given}), overflow float32 (largest {FLOAT_MAX:.3g}); "
            f"with {optimizer} it must be <= {FLOAT_MAX * divisor:.3g}")


def choices_text(choices) -> str:
    """``"a"``, ``"a" or "b"``, ``"a", "b" or "c"`` (strings quoted as in TOML)."""
    words = [json.dumps(c) if isinstance(c, str) else repr(c) for c in choices]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def one_of(*choices):
    @described(choices_text(choices))
    def validator(_instance, attribute, value):
        if value not in choices:
            raise FieldError(
                attribute.name,
                f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
                + did_you_mean(value, choices),
            )

    return validator


# ---------------------------------------------------------------------------
# Limits (docs/spec-reference.md, "Limits"): what no experiment needs and what would exhaust
# memory or never finish is refused at its key before anything is allocated.

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # TOML's integers are 64-bit
FLOAT_MAX = 3.4028234663852886e38  # float32's largest: a spec number meets float32 tensors (lr, decay, ...)
FLOAT32_TINY = 2.0**-126  # float32's smallest normal number (1.2e-38): below it a step size loses its precision
ADAM_BETAS = (0.9, 0.999)  # torch's defaults, which make_optimizer passes (pfl_core/runtime/training.py)
MAX_CLIENTS = 1_000_000  # partition.num_clients
# training.local_epochs, experiment.coldstart_epochs: epochs of one client in one round (papers
# use 1-50; 2**63 - 1 was accepted and the run never ended)
MAX_EPOCHS = 10_000
MAX_ROUNDS = 1_000_000  # experiment.rounds
MAX_SWEEP_POINTS = 1000  # points of a sweep's cartesian product
MAX_NESTING = 32  # levels of arrays and tables in a value
MAX_SPEC_BYTES = 10 * 2**20  # a spec file


def describe_int(value: int) -> str:
    """An integer for a message: itself, or its number of digits when it is very long."""
    text = str(value)
    return text if len(text) <= 24 else f"a {len(text.lstrip('-'))}-digit number"


@described("non-empty, distinct, each >= 0")
def _valid_seeds(_instance, attribute, value):
    if value is None:
        return
    if not value:
        raise FieldError(attribute.name, "must list at least one seed, e.g. [0, 1, 2]")
    negative = [s for s in value if s < 0]
    if negative:
        raise FieldError(attribute.name, f"seeds must be >= 0, got {negative[0]}")
    repeated = _repeated(value)
    if repeated:
        raise FieldError(attribute.name, f"lists seed {repeated[0]} more than once; each seed must be distinct")


def _repeated(values) -> list:
    """The values listed more than once, sorted (linear: 100000 seeds are not a hang)."""
    return sorted(v for v, n in collections.Counter(values).items() if n > 1)


def _distinct(what):
    @described("distinct")
    def validator(_instance, attribute, value):
        repeated = _repeated(value)
        if repeated:
            raise FieldError(attribute.name, f"lists {repeated[0]!r} more than once")

    return validator


