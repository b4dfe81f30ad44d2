"""Paired comparisons of a study's runs: each run against the compared-to run over the seeds
both have, per metric, with p-values adjusted (``report.correction``) over the family that
``report.correction_family`` declares. One place computes them for the printed table,
``differences.csv`` and the parent runs' ``delta_<metric>`` metrics, so the three always agree.

The family: "table" (the default), every comparison of the table in one family (each compared
metric x each run against the compared-to run), so a verdict survives however many columns
the table shows; "metric", one metric's comparisons in the table, a family per metric. The
collaboration gains (``gain_vs_local``, ``gain_vs_best_reference``) are a family each, over
the runs, in either case.
"""

from __future__ import annotations

import math

from pfl_core.study.stats import Summary, adjust, paired_difference

GAINS = ("gain_vs_best_reference", "gain_vs_local")  # the collaboration gains (study/seeds.py)
COMPARED = ("acc_mean", "acc_p10", "coldstart_acc_mean")  # the metrics a comparison table differences


def paired(result, ref, metric: str) -> Summary | None:
    """``result`` minus ``ref`` on ``metric`` over their common seeds (None: nothing to pair)."""
    common = [s for s in result.seeds if s in ref.seeds]
    if not common or metric not in result.summary or metric not in ref.summary:
        return None
    mine = dict(zip(result.seeds, result.values(metric)))
    theirs = dict(zip(ref.seeds, ref.values(metric)))
    return paired_difference([mine[s] for s in common], [theirs[s] for s in common])


FAMILIES = ("table", "metric")  # report.correction_family


def comparisons(results: list, ref, metrics: list[str], correction: str,
                family: str = "table") -> dict[tuple[str, str], Summary]:
    """``{(run name, metric): difference}`` for every run but ``ref``, p adjusted over
    ``family``: all of them ("table") or each metric's ("metric")."""
    found = {(r.name, metric): paired(r, ref, metric) for metric in metrics for r in results if r is not ref}
    found = {key: d for key, d in found.items() if d is not None}
    if family not in FAMILIES:
        raise ValueError(f"unknown correction family {family!r} (one of {', '.join(FAMILIES)})")
    groups = [list(found)] if family == "table" else [[k for k in found if k[1] == m] for m in metrics]
    out: dict[tuple[str, str], Summary] = {}
    for keys in groups:
        out.update(zip(keys, adjust([found[k] for k in keys], correction)))
    return {key: out[key] for key in found}  # metric by metric, the runs in order


def family_note(differences: dict[tuple[str, str], Summary], correction: str, family: str) -> str:
    """The legend's words for how the table's p were adjusted, e.g. "p adjusted by Holm's
    method over all 6 comparisons of this table; * = adjusted p < 0.05"."""
    if correction == "none":
        return 'p not adjusted for multiple comparisons (report.correction = "none"); * = p < 0.05'
    tested = [metric for (_, metric), d in differences.items() if not math.isnan(d.p)]
    if family == "table":
        where = f"all {len(tested)} comparisons of this table"
    else:
        sizes = sorted({tested.count(m) for m in dict.fromkeys(tested)})
        where = f"each metric's {' or '.join(map(str, sizes)) or 0} comparisons, a family per metric"
    return f"p adjusted by Holm's method over {where} (report.correction_family = \"{family}\"); * = adjusted p < 0.05"


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
