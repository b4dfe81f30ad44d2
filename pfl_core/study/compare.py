"""Paired comparisons of a study's runs: each run against the compared-to run over the seeds
both have, per metric, with p-values adjusted for the family of one metric's comparisons
(``report.correction``). One place computes them for the printed table, ``differences.csv``
and the parent runs' ``delta_<metric>`` metrics, so the three always agree.

The family: one metric's comparisons in one table (every run against the compared-to run).
Each metric answers its own question (mean accuracy, the worst decile), so a table of two
metrics holds two families; the collaboration gains (``gain_vs_local``,
``gain_vs_best_reference``) are a family each, over the runs.
"""

from __future__ import annotations

import math

from pfl_core.study.stats import Summary, adjust, paired_difference

GAINS = ("gain_vs_best_reference", "gain_vs_local")  # the collaboration gains (study/seeds.py)


def paired(result, ref, metric: str) -> Summary | None:
    """``result`` minus ``ref`` on ``metric`` over their common seeds (None: nothing to pair)."""
    common = [s for s in result.seeds if s in ref.seeds]
    if not common or metric not in result.summary or metric not in ref.summary:
        return None
    mine = dict(zip(result.seeds, result.values(metric)))
    theirs = dict(zip(ref.seeds, ref.values(metric)))
    return paired_difference([mine[s] for s in common], [theirs[s] for s in common])


def comparisons(results: list, ref, metrics: list[str], correction: str) -> dict[tuple[str, str], Summary]:
    """``{(run name, metric): difference}`` for every run but ``ref``, p adjusted per metric."""
    out: dict[tuple[str, str], Summary] = {}
    for metric in metrics:
        family = [(r.name, paired(r, ref, metric)) for r in results if r is not ref]
        family = [(name, d) for name, d in family if d is not None]
        for (name, _), d in zip(family, adjust([d for _, d in family], correction)):
            out[(name, metric)] = d
    return out


def adjust_gains(results: list, correction: str) -> None:
    """The collaboration gains in each result's summary, p adjusted over the runs (per key)."""
    for key in GAINS:
        holders = [r for r in results if key in r.summary]
        for r, d in zip(holders, adjust([r.summary[key] for r in holders], correction)):
            r.summary[key] = d


def delta_metrics(differences: dict[tuple[str, str], Summary], name: str) -> dict[str, float]:
    """A parent run's ``delta_<metric>``, ``_ci95``, ``_p`` and ``_p_adjusted`` (finite only)."""
    out = {}
    for (run, metric), d in differences.items():
        if run != name:
            continue
        values = {f"delta_{metric}": d.mean, f"delta_{metric}_ci95": d.ci95, f"delta_{metric}_p": d.p,
                  f"delta_{metric}_p_adjusted": d.p_adjusted}
        out.update({k: v for k, v in values.items() if not math.isnan(v)})
    return out
