"""Summaries over repeated seeds: mean, standard deviation and the 95% Student-t interval.

A difference between two methods is reported as the *paired* difference over the same seeds
(each seed gives both methods the same partition and initialisation), with its own interval.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np


@attrs.frozen
class Summary:
    mean: float
    std: float  # sample standard deviation (ddof = 1); nan for one value
    ci95: float  # half-width of the 95% Student-t interval of the mean; nan for one value
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.ci95

    @property
    def high(self) -> float:
        return self.mean + self.ci95

    @property
    def excludes_zero(self) -> bool:
        """The interval lies entirely above or below 0 (never true without an interval)."""
        return not math.isnan(self.ci95) and (self.low > 0 or self.high < 0)


def summarize(values: Sequence[float]) -> Summary:
    """Mean, std and 95% t-interval half-width of ``values`` (nan entries are kept: a method
    that failed on one seed has no mean)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return Summary(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if n < 2:
        return Summary(mean, math.nan, math.nan, n)
    std = float(x.std(ddof=1))
    from scipy import stats  # lazily: about a second to import, needed only with repeat seeds

    ci95 = float(stats.t.ppf(0.975, df=n - 1) * std / math.sqrt(n))
    return Summary(mean, std, ci95, n)


def paired_difference(values: Sequence[float], reference: Sequence[float]) -> Summary:
    """Summary of values[s] - reference[s] over the same seeds s."""
    if len(values) != len(reference):
        raise ValueError(f"paired difference needs the same seeds on both sides ({len(values)} vs {len(reference)})")
    return summarize(np.asarray(values, dtype=float) - np.asarray(reference, dtype=float))
