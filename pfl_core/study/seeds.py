"""Running one point: a single run, or one child run per seed under a parent run holding the
summary over seeds; and the collaboration gains against the reference runs."""

from __future__ import annotations

import math

import attrs

from pfl_core.engine import Engine, Resolved, RunResult
from pfl_core.study.compare import GAINS, adjust_gains, comparisons, delta_metrics
from pfl_core.study.points import Point, PointResult, _is_algorithm_key
from pfl_core.study.report import COMPARED, print_run_line
from pfl_core.study.reuse import Reuse
from pfl_core.study.stats import Summary, paired_difference, summarize
from pfl_core.tracking.links import CURVE_METRIC, interval_ends
from pfl_core.tracking.study import method_colours
from pfl_core.tracking.tables import table_csv
from pfl_core.tracking.tracker import (
    NullTracker,
    current_study,
    flatten,
    log_accuracy_distribution,
    make_tracker,
    run_status,
)


@attrs.define
class RunCounter:
    """``run k/n`` in the progress bar's label during a sweep (or over seeds)."""

    total: int
    done: int = 0

    def label(self, name: str) -> str:
        self.done += 1
        return f"run {self.done}/{self.total} {name}" if self.total > 1 else name


def gains(result: PointResult, references: list[PointResult]) -> dict[str, Summary]:
    """gain_vs_local and gain_vs_best_reference of ``result``'s acc_mean, paired over seeds."""
    if not references:
        return {}
    common = [s for s in result.seeds if all(s in r.seeds for r in references)]
    if not common:
        return {}
    mine = dict(zip(result.seeds, result.values("acc_mean")))
    refs = {r.name: dict(zip(r.seeds, r.values("acc_mean"))) for r in references}
    out = {}
    best = [max(ref[s] for ref in refs.values()) for s in common]
    out["gain_vs_best_reference"] = paired_difference([mine[s] for s in common], best)
    local = next((refs[r.name] for r in references if r.resolved_algorithm == "local"), None)
    if local is not None:
        out["gain_vs_local"] = paired_difference([mine[s] for s in common], [local[s] for s in common])
    return out


def log_gains(point: Point, results: list[PointResult], references: list[PointResult], tracking_uri) -> None:
    """Each run's collaboration gain over the reference runs of its group, logged to its
    (parent) run as ``gain_vs_local``, ``gain_vs_best_reference``, their ``_ci95`` and
    ``_p_adjusted`` (adjusted over the runs: :mod:`pfl_core.study.compare`)."""
    tracker = make_tracker(point.resolved.spec.tracking, tracking_uri)
    for result in results:
        mine = [r for r in references if r.group == result.group]
        result.summary.update(gains(result, mine))
    adjust_gains(results, point.resolved.spec.report.correction)
    for result in results:
        metrics = {}
        for key in GAINS:
            if key in result.summary:
                s = result.summary[key]
                values = {key: s.mean, f"{key}_ci95": s.ci95, f"{key}_p_adjusted": s.p_adjusted}
                metrics.update({k: v for k, v in values.items() if not math.isnan(v)})
        tracker.log_metrics_to(result.run_id, metrics)


def log_differences(point: Point, results: list[PointResult], compare_to: str, tracking_uri) -> None:
    """Each point's paired differences from the compared-to run on the table's metrics, logged
    to its (parent) run: ``delta_<metric>``, ``_ci95``, ``_p``, ``_p_adjusted``."""
    ref = next((r for r in results if r.name == compare_to), results[0])
    study = current_study()
    if study is not None:  # the MLflow study view's colours and its heading's reference
        study.compared = list(zip([r.run_id for r in results], method_colours([r.name for r in results])))
    if len(ref.runs) < 2:
        return  # one seed: no interval, no test
    if study is not None:
        study.compare_to = ref.name
    spec = point.resolved.spec
    found = comparisons(results, ref, [k for k in COMPARED if k in ref.summary], spec.report.correction,
                        spec.report.correction_family)
    tracker = make_tracker(spec.tracking, tracking_uri)
    for result in results:
        metrics = delta_metrics(found, result.name)
        if metrics:
            tracker.log_metrics_to(result.run_id, metrics)


def run_point(point: Point, name: str, tracking_uri: str | None, quiet: bool, out,
              partial: list | None = None, counter: RunCounter | None = None, reuse: Reuse | None = None) -> PointResult:
    """Run one sweep point: a single run, or one child run per seed under a parent run that
    holds the mean, std and 95% interval of every final metric. ``reuse``: keep the runs a
    stopped study finished (``pfl-run SPEC --resume``, :mod:`pfl_core.study.reuse`)."""
    spec = point.resolved.spec
    group = repr(sorted((k, v) for k, v in point.settings.items() if not _is_algorithm_key(k)))
    if not point.seeds:
        tracker = make_tracker(spec.tracking, tracking_uri)
        tracker.point_group = group
        run = run_or_keep(point.resolved, name, tracker, quiet, counter, reuse)
        return PointResult(name, [spec.experiment.seed], [run], {k: summarize([v]) for k, v in run.final.items()},
                           run.run_id, spec.algorithm.name, group)

    parent = make_tracker(spec.tracking, tracking_uri)
    parent.point_group = group
    parent.start(spec.tracking_experiment, name, flatten(point.resolved.as_dict),
                 {"algorithm": spec.algorithm.name, "pfl.seeds": ",".join(map(str, point.seeds)),
                  **spec.tracking.tags})
    status = "FAILED"
    runs: list[RunResult] = []
    try:
        for seed in point.seeds:
            label = f"{name} seed={seed}"
            runs.append(run_or_keep(point.for_seed(seed), label, make_tracker(spec.tracking, tracking_uri), quiet,
                                    counter, reuse))
            print_run_line(runs[-1], label, out)
        status = "FINISHED"
    except BaseException as exc:
        status = run_status(exc)  # KILLED on Ctrl-C / SIGTERM
        raise
    finally:
        # What the finished seeds measured is logged even when a later seed fails.
        result = PointResult(name, list(point.seeds[: len(runs)]), runs, summarize_runs(runs), parent.run_id,
                             spec.algorithm.name, group, seeded=True)
        log_seed_summary(parent, result)
        parent.end(status)
        if status != "FINISHED" and runs and partial is not None:
            partial.append(result)
    return result


def run_or_keep(resolved: Resolved, name: str, tracker, quiet: bool, counter: RunCounter | None,
                reuse: Reuse | None) -> RunResult:
    """The run ``name``: the engine's, or with ``reuse`` a stopped study's finished one, copied,
    or its interrupted one, continued."""
    progress_label = counter.label(name) if counter else None
    earlier = reuse.find(resolved, name) if reuse is not None else None
    if earlier is not None and earlier.finished:
        return reuse.copy(earlier, resolved, name, tracker)
    if earlier is not None:  # the run the stop interrupted: on from its checkpoint
        return reuse.resume(earlier, resolved, name, tracker, quiet, progress_label)
    return Engine(resolved, tracker=tracker, progress=not quiet, run_name=name, progress_label=progress_label).run()


def summarize_runs(runs: list[RunResult]) -> dict[str, Summary]:
    keys = sorted({k for r in runs for k in r.final})
    return {k: summarize([r.final.get(k, math.nan) for r in runs]) for k in keys}


def mean_curves(runs: list[RunResult]) -> dict[int, dict[str, Summary]]:
    """Per evaluation round that every run has, each per-round metric's mean over the runs
    (seeds) and its 95% interval: {round: {metric: Summary}}."""
    rounds = [{row["round"]: row for row in run.history} for run in runs]
    shared = sorted(set.intersection(*(set(r) for r in rounds))) if rounds else []
    curves = {}
    for step in shared:
        keys = sorted(set.intersection(*(set(r[step]) for r in rounds)) - {"round"})
        curves[step] = {k: summarize([float(r[step][k]) for r in rounds]) for k in keys
                        if all(isinstance(r[step][k], (int, float)) for r in rounds)}
    return curves


def log_seed_summary(tracker, result: PointResult) -> None:
    """The parent run's metrics: each per-round metric's mean over seeds and its ``_ci95`` at
    every evaluation round (one curve per point in MLflow's charts), then at the last round
    the final ``m``, ``m_std``, ``m_ci95``; the per-seed table and the clients' final
    accuracy by seed."""
    curves = mean_curves(result.runs)
    last = max(curves, default=0)
    for step, summaries in curves.items():
        if step != last:  # the last round's values are the final ones, below
            series = {k: v for key, s in summaries.items() for k, v in ((key, s.mean), (f"{key}_ci95", s.ci95))}
            if CURVE_METRIC in summaries:  # the interval's ends: the study view draws them as lines
                curve = summaries[CURVE_METRIC]
                series.update(interval_ends(CURVE_METRIC, curve.mean, curve.ci95))
            tracker.log_metrics({k: v for k, v in series.items() if not math.isnan(v)}, step=step)
    metrics = {}
    for key, s in result.summary.items():
        metrics.update({key: s.mean, f"{key}_std": s.std, f"{key}_ci95": s.ci95})
    if CURVE_METRIC in result.summary:
        final = result.summary[CURVE_METRIC]
        metrics.update(interval_ends(CURVE_METRIC, final.mean, final.ci95))
    finite = {k: v for k, v in metrics.items() if not math.isnan(v)}
    if finite:
        tracker.log_metrics(finite, step=last)
    keys = sorted(result.summary)
    rows = [[seed, *[run.final.get(k, math.nan) for k in keys]] for seed, run in zip(result.seeds, result.runs)]
    if rows:
        tracker.log_text(table_csv(["seed", *keys], rows), "results/seeds.csv")
    log_accuracy_distribution(tracker, [(f"seed={seed}", run.client_rows) for seed, run in zip(result.seeds, result.runs)],
                              f"{result.name}: final accuracy per client, by seed")
    log_mean_curves(tracker, [result], f"{result.name}: {CURVE_METRIC} by round, {len(result.runs)} seed(s)")


def point_curve(result: PointResult, metric: str = CURVE_METRIC) -> tuple[list[int], list[float], list[float]]:
    """A point's ``metric`` by evaluation round: the mean over its seeds and the 95% interval's
    half-width (nan with one run)."""
    curves = mean_curves(result.runs)
    rounds = [step for step, summaries in curves.items() if metric in summaries]
    return rounds, [curves[r][metric].mean for r in rounds], [curves[r][metric].ci95 for r in rounds]


def log_mean_curves(tracker, results: list[PointResult], title: str, metric: str = CURVE_METRIC) -> bool:
    """``results/<metric>_curves.png``: each result's mean curve over its seeds with its 95%
    band, on the study's parent run (every point) and on each point's parent run (its own).
    Whether there was a curve to draw; nothing is drawn with tracking off."""
    from pfl_core.tracking import plots

    drawn = [(r.name, *point_curve(r, metric)) for r in results]
    drawn = [d for d in drawn if d[1]]
    if not drawn or type(tracker) is NullTracker:
        return bool(drawn)
    figure = plots.mean_curves_figure(drawn, metric, title, method_colours([d[0] for d in drawn]))
    try:
        tracker.log_figure(figure, f"results/{metric}_curves.png")
    finally:
        plots.close(figure)
    return True


def log_study_figures(tracker, results: list[PointResult], metric: str = CURVE_METRIC) -> None:
    """The study parent's pictures: every point's mean curve with its band
    (``results/<metric>_curves.png``) and its final mean with its interval
    (``results/final_<metric>.png``)."""
    from pfl_core.tracking import plots

    seeds = max((len(r.runs) for r in results), default=0)
    if not log_mean_curves(tracker, results, f"{metric} by round, {seeds} seed(s)", metric):
        return
    rows = [(r.name, r.summary[metric].mean, r.summary[metric].ci95) for r in results if metric in r.summary]
    figure = plots.final_means_figure(rows, metric, f"final {metric}, {seeds} seed(s)")
    tracker.log_figure(figure, f"results/final_{metric}.png")
    plots.close(figure)
