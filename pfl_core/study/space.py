"""A ``[tune]`` search space: its keys (:class:`Dimension`, read from ``tune.space`` and
``tune.method.<algorithm>``), the scrambled Sobol points the shared design maps onto them, and
which chosen values lie on the edge of those tried. Below :mod:`pfl_core.study.tune`, which runs
the trials on Optuna."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import attrs
import numpy as np

from pfl_core.errors import SpecError
from pfl_core.spec import shown

OWN_DESIGN_STREAM = 1  # the method's own keys: a Sobol design seeded by (experiment.seed, this)


@attrs.frozen
class Dimension:
    """One key of a search space and where in ``[tune]`` it was given."""

    key: str
    path: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple | None = None

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.is_int():
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def is_int(self) -> bool:
        return _is_int(self.low) and _is_int(self.high) and (self.step is None or _is_int(self.step))

    def at(self, unit: float) -> Any:
        """The value at ``unit`` in [0, 1) of the key's design axis: uniform (log-uniform with
        ``log``) between low and high, the grid of ``step`` or the ``choices`` in equal shares."""
        if self.choices is not None:
            return self.choices[min(int(unit * len(self.choices)), len(self.choices) - 1)]
        if self.step is not None or (self.is_int() and not self.log):
            step = self.step or 1
            count = math.floor((self.high - self.low) / step + 1e-9) + 1  # values low, low + step, ... <= high
            value = self.low + min(int(unit * count), count - 1) * step
            return value if self.is_int() else float(f"{value:.12g}")  # 0.1 + 2 * 0.1, not 0.30000000000000004
        if self.log:
            value = math.exp(math.log(self.low) + unit * (math.log(self.high) - math.log(self.low)))
        else:
            value = self.low + unit * (self.high - self.low)
        if self.is_int():  # a log range of integers
            return min(max(round(value), self.low), self.high)
        return min(max(float(value), float(self.low)), float(self.high))

    def corners(self) -> list:
        """The values that must all be valid for the key: every choice, or both bounds."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


RANGE_KEYS = {"low", "high", "log", "step"}
EXAMPLE = '{ low = 0.001, high = 0.3, log = true } or { choices = [0.01, 0.1] }'


def parse_dimension(key: str, entry: Any, path: str) -> Dimension:
    """One entry of a space, checked: a range of numbers or a list of choices of one type."""
    if not isinstance(entry, dict) or not entry:
        raise SpecError(path, f"expected a table, {EXAMPLE}; got {shown(entry)}")
    if "choices" in entry:
        extra = sorted(set(entry) - {"choices"})
        if extra:
            raise SpecError(path, f"give choices alone, or a range (low, high, log, step); not both ({', '.join(extra)})")
        choices = entry["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpecError(f"{path}.choices", f"expected a non-empty list of values, got {shown(choices)}")
        kinds = {type(c).__name__ for c in choices}
        if len(kinds) > 1:
            raise SpecError(f"{path}.choices", f"mixes types ({', '.join(sorted(kinds))}); give values of one type "
                                               f"(write 1.0, not 1, among floats)")
        if any(isinstance(c, (dict, list)) for c in choices):
            raise SpecError(f"{path}.choices", "expected plain values (numbers, strings, booleans)")
        if len(set(map(repr, choices))) < len(choices):
            raise SpecError(f"{path}.choices", "lists a value more than once")
        return Dimension(key, path, choices=tuple(choices))
    unknown = sorted(set(entry) - RANGE_KEYS)
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", f"unknown key; a range takes low, high, log and step, e.g. {EXAMPLE}")
    for bound in ("low", "high"):
        if bound not in entry:
            raise SpecError(f"{path}.{bound}", "required key is missing (a range needs low and high)")
        value = entry[bound]
        if not _is_number(value) or not math.isfinite(value):
            raise SpecError(f"{path}.{bound}", f"expected a finite number, got {shown(value)}")
    low, high, log, step = entry["low"], entry["high"], entry.get("log", False), entry.get("step")
    if not isinstance(log, bool):
        raise SpecError(f"{path}.log", f"expected true or false, got {shown(log)}")
    if not low < high:
        raise SpecError(path, f"empty range: low {shown(low)} is not below high {shown(high)}")
    if log and low <= 0:
        raise SpecError(f"{path}.low", f"is {shown(low)}, but a log range needs low > 0")
    if step is not None:
        if not _is_number(step) or not math.isfinite(step) or step <= 0:
            raise SpecError(f"{path}.step", f"expected a number > 0, got {shown(step)}")
        if log:
            raise SpecError(f"{path}.step", "a log range takes no step (Optuna samples it continuously)")
    return Dimension(key, path, low=low, high=high, log=log, step=step)


def parse_space(table: dict, where: str) -> list[Dimension]:
    return [parse_dimension(key, entry, f"{where}.{key}") for key, entry in table.items()]


def sobol_design(space: list[Dimension], shared_keys: int, trials: int, seed: int) -> list[dict[str, Any]]:
    """``trials`` points of ``space``, as each trial's values: its first ``shared_keys`` keys
    (tune.space's, every point's) from a scrambled Sobol design seeded by ``seed`` (the same for
    every point of the sweep), the method's own keys from the further dimensions of one seeded
    by ``(seed, OWN_DESIGN_STREAM)``, row i of both in trial i."""
    shared, own = space[:shared_keys], space[shared_keys:]
    units = np.empty((trials, 0))
    if shared:
        units = _sobol(len(shared), trials, np.random.default_rng(seed))
    if own:  # the dimensions after the shared ones: with them, one Sobol design of every key
        own_units = _sobol(len(shared) + len(own), trials, np.random.default_rng([seed, OWN_DESIGN_STREAM]))
        units = np.hstack([units, own_units[:, len(shared):]])
    return [{dim.key: dim.at(float(u)) for dim, u in zip(space, row)} for row in units]


def _sobol(dimensions: int, points: int, rng: np.random.Generator) -> np.ndarray:
    """The first ``points`` points of a scrambled Sobol sequence (a prefix of a longer one)."""
    from scipy.stats import qmc

    # scipy >= 1.15 names the generator ``rng``; older ones ``seed`` (a Generator means the same in both)
    keyword = "rng" if "rng" in inspect.signature(qmc.Sobol).parameters else "seed"
    engine = qmc.Sobol(dimensions, scramble=True, **{keyword: rng})
    if points & (points - 1) == 0:
        return engine.random_base2(points.bit_length() - 1)
    with warnings.catch_warnings():  # balanced in powers of two; other counts are still the sequence's first points
        warnings.filterwarnings("ignore", message="The balance properties of Sobol")
        return engine.random(points)


EDGE_TAG = "pfl.tune.edge."  # + the key: on a tuning parent whose best value is on the edge of those tried


def edges(trials: list, space: list[Dimension], values: dict[str, Any]) -> dict[str, str]:
    """The range keys whose best value is the smallest or the largest value the trials tried:
    the best may lie outside the range. Key -> the sentence that says so."""
    found = {}
    for dim in space:
        if dim.choices is not None:
            continue
        tried = sorted({t.params[dim.key] for t in trials if dim.key in t.params})
        if len(tried) < 2 or values[dim.key] not in (tried[0], tried[-1]):
            continue
        side = "smallest" if values[dim.key] == tried[0] else "largest"
        found[dim.key] = (f"{dim.key}={shown(values[dim.key])} is the {side} value tried in its range "
                          f"[{shown(dim.low)}, {shown(dim.high)}] ({dim.path}); widen the range")
    return found


def sampler_words(sampler: str) -> str:
    """How a table's header names ``tune.sampler``: ``shared Sobol design``, ``tpe sampler``."""
    return "shared Sobol design" if sampler == "shared" else f"{sampler} sampler"


def tuning_header(trials: dict[str, int], metric: str, objective: str, sampler: str, seeds: str,
                  edges: list[str]) -> str:
    """The line above a tuned study's table (pfl-run's and ``pfl results``'s): ``tuned: 20 trials
    each on val_acc_mean (final), shared Sobol design, tuning seeds [5]``, then each point whose
    best value is on the edge of those tried (``edges``: ``POINT SENTENCE``)."""
    counts = list(trials.values())
    said = (f"{counts[0]} trials each" if len(set(counts)) == 1 else
            "trials: " + ", ".join(f"{name} {n}" for name, n in trials.items()))
    return (f"tuned: {said} on {metric} ({objective}), {sampler_words(sampler)}, tuning seeds {seeds}"
            + "".join(f"; on the edge: {edge}" for edge in edges))
