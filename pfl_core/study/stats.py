"""Summaries over repeated seeds: mean, standard deviation and the 95% Student-t interval.

A difference between two methods is reported as the *paired* difference over the same seeds
(each seed gives both methods the same partition and initialisation), with its own interval,
its two-sided paired t-test p-value, and that p adjusted for the other comparisons of its table
(Holm's step-down method by default, statsmodels' ``multipletests``).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

ALPHA = 0.05
CORRECTIONS = {"holm": "holm", "none": None}  # report.correction -> statsmodels' method


@attrs.frozen
class Summary:
    mean: float
    std: float  # sample standard deviation (ddof = 1); nan for one value
    ci95: float  # half-width of the 95% Student-t interval of the mean; nan for one value
    n: int
    # of a paired difference: the two-sided t-test's p of "mean 0", and that p adjusted for the
    # other comparisons of its table (nan: not a difference, or fewer than 2 seeds)
    p: float = math.nan
    p_adjusted: float = math.nan

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

    @property
    def significant(self) -> bool:
        """The adjusted p is below 0.05 (with no correction, the adjusted p is the p)."""
        return not math.isnan(self.p_adjusted) and self.p_adjusted < ALPHA


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
    """Summary of values[s] - reference[s] over the same seeds s, with the paired t-test's p
    (its adjusted p is the p until :func:`adjust` sees the other comparisons)."""
    if len(values) != len(reference):
        raise ValueError(f"paired difference needs the same seeds on both sides ({len(values)} vs {len(reference)})")
    d = summarize(np.asarray(values, dtype=float) - np.asarray(reference, dtype=float))
    p = t_test_p(d)
    return attrs.evolve(d, p=p, p_adjusted=p)


def t_test_p(d: Summary) -> float:
    """Two-sided p of the one-sample t-test of mean 0 for the differences ``d`` summarises.
    Equal differences on every seed (std 0): p is 0 for a nonzero mean, 1 for zero."""
    if d.n < 2 or math.isnan(d.std) or math.isnan(d.mean):
        return math.nan
    if d.std == 0:
        return 0.0 if d.mean != 0 else 1.0
    from scipy import stats

    return float(2 * stats.t.sf(abs(d.mean) / (d.std / math.sqrt(d.n)), df=d.n - 1))


def adjust(differences: list[Summary], correction: str) -> list[Summary]:
    """The same differences with ``p_adjusted`` corrected for the family they form
    (``correction``: "holm" or "none"); differences without a p keep nan."""
    method = CORRECTIONS[correction]
    tested = [i for i, d in enumerate(differences) if not math.isnan(d.p)]
    if method is None or len(tested) < 2:
        return [attrs.evolve(d, p_adjusted=d.p) for d in differences]
    from statsmodels.stats.multitest import multipletests  # lazily: slow to import

    adjusted = multipletests([differences[i].p for i in tested], alpha=ALPHA, method=method)[1]
    out = list(differences)
    for i, p in zip(tested, adjusted):
        out[i] = attrs.evolve(differences[i], p_adjusted=float(p))
    return out
