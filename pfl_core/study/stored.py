"""``pfl results``: the studies an MLflow store holds, and any one study's comparison table
rebuilt from its runs (through MLflow's client API), printed as ``pfl-run`` printed it or
exported as Markdown, LaTeX or CSV, and its mean curves drawn.

A study's compared runs carry ``pfl.point`` = the study's id (a point's parent run over its
seeds, a single run, a reference run); a point's seed runs are its parent's children; their
final metrics are the runs' last values. Studies logged before ``pfl.point`` existed are
rebuilt from their top-level runs the same way."""

from __future__ import annotations

import csv
import datetime
import io
import math
import os

import attrs

from pfl_core.engine import RunResult
from pfl_core.errors import PflError, did_you_mean
from pfl_core.state.locations import plain_uri, sqlite_file
from pfl_core.study.compare import adjust_gains, comparisons, family_note
from pfl_core.study.points import PointResult
from pfl_core.study.report import COMPARED, budget_columns, left_out_line, print_comparison, print_table
from pfl_core.study.results import comparison_csv
from pfl_core.study.reuse import SUPERSEDED_TAG, TUNING_TAG
from pfl_core.study.seeds import gains, point_curve, summarize_runs
from pfl_core.study.space import EDGE_TAG, sampler_words
from pfl_core.study.stats import Summary, adjust, paired_difference, summarize
from pfl_core.tracking.links import GROUP_TAG, POINT_TAG
from pfl_core.tracking.tracker import PARENT_TAG, STUDY_TAG

DEFAULT_STORE = "sqlite:///mlflow.db"
TRIAL_TAG = "pfl.tune.trial"
REFERENCE = " (reference)"
# Worst first: a study is as finished as its least finished run.
STATUS_ORDER = ("RUNNING", "FAILED", "KILLED", "SCHEDULED", "FINISHED")


@attrs.define
class StoredStudy:
    """One study of the store, as ``pfl results`` lists it."""

    id: str
    experiment: str
    started: float  # ms since the epoch, its first run's start
    methods: list[str]
    seeds: list[int]
    tuned: bool
    status: str
    runs: list = attrs.field(repr=False)  # every MLflow run of the study
    continued_by: str = ""  # the study a `pfl-run SPEC --resume` continued this stopped one in

    @property
    def date(self) -> str:
        return datetime.datetime.fromtimestamp(self.started / 1000).strftime("%Y-%m-%d %H:%M")

    @property
    def state(self) -> str:
        """The status as ``pfl results`` shows it: MLflow's, or ``stopped (continued by ID)``."""
        if self.continued_by and self.status != "FINISHED":
            return f"stopped (continued by {self.continued_by})"
        return self.status


def store_uri(tracking_uri: str | None) -> str:
    """The store to read: --tracking-uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db. A SQLite
    file that does not exist is an error (MLflow would create an empty one)."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_STORE
    path = sqlite_file(uri)
    if path is not None:
        if not path.is_file():
            raise PflError(f"--tracking-uri: no MLflow store at {uri} ({path} does not exist); run pfl results where "
                           f"pfl-run ran, or give --tracking-uri")
    return plain_uri(uri)


def studies(client) -> list[StoredStudy]:
    """Every study in the store, oldest first."""
    runs = []
    for experiment in client.search_experiments():
        runs += [(experiment.name, r) for r in client.search_runs([experiment.experiment_id],
                                                                  f"tags.`{STUDY_TAG}` LIKE '%'", max_results=50000)]
    by_id: dict[str, list] = {}
    for name, run in runs:
        by_id.setdefault(run.data.tags[STUDY_TAG], []).append((name, run))
    found = []
    for study_id, members in by_id.items():
        study_runs = [r for _, r in members]
        points = compared_runs(study_runs)
        seeds = sorted({int(s) for p in points for s in p.data.tags.get("pfl.seeds", "").split(",") if s.strip()})
        point_parents = {p.data.tags.get(PARENT_TAG) for p in points}
        parent = next((r for r in study_runs if r.info.run_id in point_parents), None)
        statuses = ([parent.info.status] if parent is not None else
                    [r.info.status for r in points] or [r.info.status for r in study_runs])
        found.append(StoredStudy(
            study_id, members[0][0], min(r.info.start_time for r in study_runs),
            list(dict.fromkeys(p.data.tags.get("algorithm", "?") for p in points)),
            seeds, any(TUNING_TAG in r.data.tags for r in study_runs),
            min(statuses, key=lambda s: STATUS_ORDER.index(s) if s in STATUS_ORDER else 0), study_runs,
            next((r.data.tags[SUPERSEDED_TAG] for r in study_runs if SUPERSEDED_TAG in r.data.tags), "")))
    return sorted(found, key=lambda s: s.started)


def compared_runs(study_runs: list) -> list:
    """The runs the study's table compares, in the order they started."""
    marked = [r for r in study_runs if POINT_TAG in r.data.tags]
    if not marked:  # logged before pfl.point: the top-level runs, or the study parent's children
        ids = {r.info.run_id for r in study_runs}
        parents = {r.data.tags.get(PARENT_TAG) for r in study_runs} & ids
        study_parent = next((r.info.run_id for r in study_runs if r.info.run_id in parents
                             and PARENT_TAG not in r.data.tags and "pfl.seeds" not in r.data.tags), None)
        marked = [r for r in study_runs if TUNING_TAG not in r.data.tags and TRIAL_TAG not in r.data.tags
                  and r.data.tags.get(PARENT_TAG) == study_parent and r.info.run_id != study_parent]
    return sorted(marked, key=lambda r: r.info.start_time)


def find(found: list[StoredStudy], wanted: str) -> StoredStudy:
    """``last``, a study id or a prefix of one, or a prefix of an experiment's name (its
    newest study)."""
    if not found:
        raise PflError("the store holds no pfl study")
    if wanted == "last":
        return found[-1]
    by_id = [s for s in found if s.id.startswith(wanted)]
    if len(by_id) == 1:
        return by_id[0]
    if len(by_id) > 1:
        raise PflError(f"study {wanted!r} is ambiguous: {', '.join(s.id for s in by_id)}")
    by_name = [s for s in found if s.experiment.startswith(wanted)]
    if by_name:
        return by_name[-1]
    names = list(dict.fromkeys(s.experiment for s in found))
    raise PflError(f"no study {wanted!r} in this store{did_you_mean(wanted, names)}; 'pfl results' lists them")


@attrs.define
class Table:
    """A stored study's comparison, as pfl-run built it."""

    results: list[PointResult]
    compare_to: str
    correction: str
    budget: str
    tuned: str  # "tuned: ..." or ""
    left_out: list[str] = attrs.Factory(list)  # points that stopped (a seed diverged), as pfl-run said
    family: str = "table"  # report.correction_family


def load(client, study: StoredStudy) -> Table:
    points = compared_runs(study.runs)
    if not points:
        raise PflError(f"study {study.id} has no finished runs to compare")
    children: dict[str, list] = {}
    for run in study.runs:
        if PARENT_TAG in run.data.tags:
            children.setdefault(run.data.tags[PARENT_TAG], []).append(run)
    results, left_out = [], []
    for run in points:
        seeded = "pfl.seeds" in run.data.tags
        runs = sorted(children.get(run.info.run_id, []) if seeded else [run],
                      key=lambda r: int(r.data.params.get("experiment.seed", 0)))
        runs = [r for r in runs if TRIAL_TAG not in r.data.tags]
        if run.info.status in ("FAILED", "KILLED") and len(points) > 1:  # pfl-run left it out of its table
            left_out.append(_stopped(run, runs))
            continue
        finals = [RunResult(history=[], client_rows=[], final=dict(r.data.metrics), run_id=r.info.run_id) for r in runs]
        seeds = [int(r.data.params.get("experiment.seed", 0)) for r in runs]
        results.append(PointResult(run.info.run_name, seeds, finals, summarize_runs(finals), run.info.run_id,
                                   run.data.tags.get("algorithm", ""), run.data.tags.get(GROUP_TAG, ""), seeded))
    references = [r for r in results if _is_reference(r)]
    results = [r for r in results if not _is_reference(r)] + references  # pfl-run's order: the points, then these
    params = points[0].data.params
    correction = params.get("report.correction", "holm")
    if references:
        for result in results:
            result.summary.update(gains(result, [r for r in references if r.group == result.group]))
        adjust_gains(results, correction)
    compare_to = params.get("experiment.compare_to", "") or results[0].name
    # studies stored before report.correction_family existed were adjusted per metric
    family = params.get("report.correction_family", "metric")
    return Table(results, compare_to, correction, params.get("report.budget", "passes"), _tuning_line(study),
                 left_out, family)


def _stopped(point, runs: list) -> str:
    """The line pfl-run printed under its table for a point that stopped part-way."""
    diverged = [r for r in runs if "pfl.diverged" in r.data.tags]
    if diverged:
        run = diverged[0]
        return left_out_line(point.info.run_name, run.data.params.get("experiment.seed", "?"), run.data.tags["pfl.diverged"])
    done = sum(r.info.status == "FINISHED" for r in runs)
    return f"{point.info.run_name} {point.info.status.lower()} ({done} seed run(s) finished)"


def _is_reference(result: PointResult) -> bool:
    """A reference run: named ``<algorithm> (reference)`` (then the group's settings)."""
    return result.name.startswith(f"{result.resolved_algorithm}{REFERENCE}")


def _tuning_line(study: StoredStudy) -> str:
    parents = [r for r in study.runs if TUNING_TAG in r.data.tags and TRIAL_TAG not in r.data.tags
               and r.info.run_name.endswith("(tuning)")]
    if not parents:
        return ""
    counts = [int(sum(r.data.metrics.get(f"trials_{state}", 0) for state in ("complete", "pruned", "diverged")))
              for r in parents]
    params = parents[0].data.params
    trials = (f"{counts[0]} trials each" if len(set(counts)) == 1 else
              "trials: " + ", ".join(f"{r.info.run_name.removesuffix(' (tuning)')} {n}" for r, n in zip(parents, counts)))
    edges = [f"{r.info.run_name.removesuffix(' (tuning)')} {text}" for r in parents
             for tag, text in sorted(r.data.tags.items()) if tag.startswith(EDGE_TAG)]
    return (f"tuned: {trials} on {params.get('tune.metric', '?')} ({params.get('tune.objective', '?')}), "
            f"{sampler_words(params.get('tune.sampler', '?'))}, tuning seeds {params.get('tune.seeds', '?')}"
            + "".join(f"; on the edge: {edge}" for edge in edges))


# -- exports ---------------------------------------------------------------------------------


def _columns(table: Table) -> tuple[list[str], dict]:
    """The table's metric columns and its paired differences (as the printed table has them)."""
    results = table.results
    ref = next((r for r in results if r.name == table.compare_to), results[0])
    keys = [k for k in COMPARED if any(k in r.summary for r in results)]
    diffs = comparisons(results, ref, keys, table.correction, table.family) if len(ref.runs) > 1 else {}
    return keys, diffs


def _lower_is_better(key: str) -> bool:
    return "loss" in key or "bytes" in key


def _best(results: list[PointResult], key: str) -> float:
    means = [r.summary[key].mean for r in results if key in r.summary and not math.isnan(r.summary[key].mean)]
    if not means:
        return math.nan
    return min(means) if _lower_is_better(key) else max(means)


def _cell(s: Summary, digits: int = 4) -> tuple[str, str]:
    return f"{s.mean:.{digits}f}", ("" if s.n < 2 or math.isnan(s.ci95) else f"{s.ci95:.{digits}f}")


def _mean_ci(s: Summary, pm: str) -> str:
    """``mean ± ci`` (``pm`` between them), or the mean alone where there is no interval."""
    return pm.join(x for x in _cell(s) if x)


def _delta(d: Summary) -> str:
    if d.n < 2:
        return f"{d.mean:+.4f}"
    p = "" if math.isnan(d.p_adjusted) else f", p={d.p_adjusted:.3f}" if d.p_adjusted >= 0.001 else ", p<0.001"
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{p}{'*' if d.significant else ''}"


def markdown(table: Table) -> str:
    keys, diffs = _columns(table)
    ref = table.compare_to
    delta_keys = [k for k in keys if any(key == k for _, key in diffs)]
    # what "the same budget" was, per run, in both conventions (passes and optimiser steps)
    budgets = [*budget_columns(table.results, "passes"), *budget_columns(table.results, "steps")]
    header = ["run", "seeds", *keys, *budgets, *[f"Δ{k} vs {ref}" for k in delta_keys]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table.results:
        cells = [r.name, str(len(r.runs))]
        for k in keys:
            if k not in r.summary:
                cells.append("-")
                continue
            mean, ci = _cell(r.summary[k])
            text = f"{mean} ± {ci}" if ci else mean
            cells.append(f"**{text}**" if r.summary[k].mean == _best(table.results, k) else text)
        cells += [f"{r.summary[k].mean:g}" if k in r.summary else "-" for k in budgets]
        cells += [_delta(diffs[(r.name, k)]) if (r.name, k) in diffs else "-" for k in delta_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*([f"_{table.tuned}_", ""] if table.tuned else []), *lines, "", _footnote(table),
                      *(f"\nleft out: {line}" for line in table.left_out)]) + "\n"


def latex(table: Table) -> str:
    """A booktabs tabular: mean ± ci95 (the best mean of each column in bold), and the paired
    differences with their interval and adjusted p; needs ``\\usepackage{booktabs}``."""
    keys, diffs = _columns(table)
    delta_keys = [k for k in keys if any(key == k for _, key in diffs)]
    header = ["run", *[k.replace("_", r"\_") for k in keys],
              *[rf"$\Delta$ {k.replace('_', chr(92) + '_')} vs {_tex(table.compare_to)}" for k in delta_keys]]
    lines = [r"\begin{tabular}{l" + "c" * (len(header) - 1) + "}", r"\toprule", " & ".join(header) + r" \\",
             r"\midrule"]
    for r in table.results:
        cells = [_tex(r.name)]
        for k in keys:
            if k not in r.summary:
                cells.append("--")
                continue
            mean, ci = _cell(r.summary[k])
            if r.summary[k].mean == _best(table.results, k):
                mean = rf"\textbf{{{mean}}}"
            cells.append(f"${mean} \\pm {ci}$" if ci else f"${mean}$")
        for k in delta_keys:
            d = diffs.get((r.name, k))
            cells.append("--" if d is None else _latex_delta(d))
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", f"% {_footnote(table)}"]
    if table.tuned:
        lines.append(f"% {table.tuned}")
    return "\n".join(lines) + "\n"


def _latex_delta(d: Summary) -> str:
    p = "" if math.isnan(d.p_adjusted) else f", $p={max(d.p_adjusted, 0.001):.3f}$"
    return f"${d.mean:+.4f}$ [{d.low:+.4f}, {d.high:+.4f}]{p}" + ("$^*$" if d.significant else "")


def _tex(text: str) -> str:
    for char in ("\\", "&", "%", "$", "#", "_", "{", "}"):
        text = text.replace(char, "\\" + char if char != "\\" else r"\textbackslash{}")
    return text


def _footnote(table: Table) -> str:
    n = max(len(r.runs) for r in table.results)
    return (f"mean ± 95% interval over {n} seed(s); Δ: paired difference over the same seeds with its 95% interval; "
            f"{family_note(_columns(table)[1], table.correction, table.family)}")


def within_runs(table: Table, first: str, second: str) -> list[tuple[str, Summary, Summary, Summary]]:
    """Per point: ``first``, ``second`` and ``first - second`` paired over the point's seed runs
    (two metrics of the same runs, e.g. the corrupted clients' lambda against the clean ones'),
    the differences' p adjusted across the points (the table's correction). Points whose runs
    lack either metric are left out; no point with both is an error naming the metrics there are."""
    complete = [r for r in table.results
                if r.runs and all(first in run.final and second in run.final for run in r.runs)]
    if not complete:
        known = sorted({k for r in table.results for run in r.runs for k in run.final})
        missing = first if first not in known else second
        raise PflError(f"--paired: no point's runs all logged both {first!r} and {second!r}: "
                       f"{missing!r} is missing{did_you_mean(missing, known)}")
    differences = adjust([paired_difference(r.values(first), r.values(second)) for r in complete], table.correction)
    return [(r.name, summarize(r.values(first)), summarize(r.values(second)), d) for r, d in zip(complete, differences)]


def within_markdown(rows: list[tuple[str, Summary, Summary, Summary]], first: str, second: str,
                    correction: str) -> str:
    lines = [f"| run | seeds | {first} | {second} | {first} - {second} |", "|---|---|---|---|---|"]
    for name, a, b, d in rows:
        lines.append(f"| {name} | {a.n} | {_mean_ci(a, ' ± ')} | {_mean_ci(b, ' ± ')} | {_delta(d)} |")
    return "\n".join([*lines, "", _within_note(correction)]) + "\n"


def _within_note(correction: str) -> str:
    p = "p: paired t-test, Holm-adjusted over the runs" if correction == "holm" else "p: paired t-test, unadjusted"
    return f"mean ± 95% interval over the seeds; the difference is paired by seed (the same runs); {p}; * = adjusted p < 0.05"


def within_csv(rows: list[tuple[str, Summary, Summary, Summary]], first: str, second: str) -> str:
    """One number per cell, unrounded: for a plotting or analysis script."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["run", "seeds", first, f"{first}_ci95", second, f"{second}_ci95", "difference",
                     "difference_low", "difference_high", "p", "p_adjusted"])
    for name, a, b, d in rows:
        writer.writerow([name, a.n, *(f"{v:.10g}" for v in (a.mean, a.ci95, b.mean, b.ci95, d.mean, d.low, d.high,
                                                                d.p, d.p_adjusted))])
    return out.getvalue()


def within_latex(rows: list[tuple[str, Summary, Summary, Summary]], first: str, second: str,
                 correction: str) -> str:
    """A booktabs tabular of ``within_markdown``'s cells; needs ``\\usepackage{booktabs}``."""
    lines = [r"\begin{tabular}{lcccc}", r"\toprule",
             " & ".join(["run", "seeds", _tex(first), _tex(second), f"{_tex(first)} $-$ {_tex(second)}"]) + r" \\",
             r"\midrule"]
    for name, a, b, d in rows:
        cells = ["$" + _mean_ci(s, r" \pm ") + "$" for s in (a, b)]
        lines.append(" & ".join([_tex(name), str(a.n), *cells, _latex_delta(d)]) + r" \\")
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}", f"% {_within_note(correction)}"]) + "\n"


def csv_text(table: Table) -> str:
    return comparison_csv(table.results)


def curves(client, table: Table, metric: str) -> list[tuple[str, list[float], list[float], list[float]]]:
    """Each point's ``metric`` by round: the mean over its seed runs' histories and the 95%
    interval's half-width."""
    out = []
    for result in table.results:
        for run in result.runs:  # the run's history, as the run had it: one row per logged step
            run.history = [{"round": m.step, metric: m.value} for m in client.get_metric_history(run.run_id, metric)]
        steps, means, half = point_curve(result, metric)
        if steps:
            out.append((result.name, steps, means, half))
    return out


# -- the command -----------------------------------------------------------------------------


def results_main(wanted: str | None, tracking_uri: str | None, fmt: str, plot: str | None, metric: str, out,
                 paired: tuple[str, str] | None = None) -> int:
    from mlflow.tracking import MlflowClient

    uri = store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    found = studies(client)
    if wanted is None:
        if not found:
            print(f"no pfl study in {uri}", file=out)
            return 0
        rows = [[s.id, s.date, s.experiment, ", ".join(s.methods), len(s.seeds) or 1, "yes" if s.tuned else "no",
                 s.state, len(s.runs)] for s in reversed(found)]
        print_table(["study", "date", "experiment", "methods", "seeds", "tuned", "status", "runs"], rows, out)
        return 0
    study = find(found, wanted)
    table = load(client, study)
    if plot is not None:
        draw(client, table, metric, plot, study)
    if paired is not None:
        rows = within_runs(table, *paired)
        if fmt == "csv":
            out.write(within_csv(rows, *paired))
        elif fmt == "latex":
            out.write(within_latex(rows, *paired, table.correction))
        else:  # markdown, and the default table
            out.write(within_markdown(rows, *paired, table.correction))
        return 0
    if fmt == "markdown":
        out.write(markdown(table))
    elif fmt == "latex":
        out.write(latex(table))
    elif fmt == "csv":
        out.write(csv_text(table))
    else:
        print(f"study {study.id}: experiment {study.experiment!r}, {study.date}, {study.state}", file=out)
        if table.tuned:
            print(table.tuned, file=out)
        print_comparison(table.results, table.compare_to, out, table.correction, table.budget, table.left_out,
                         table.family)
    return 0


def draw(client, table: Table, metric: str, path: str, study: StoredStudy) -> None:
    from pfl_core.tracking import plots

    drawn = curves(client, table, metric)
    if not drawn:
        logged = sorted({k for r in table.results for k in r.summary})
        raise PflError(f"--metric: the study's runs log no per-round {metric!r}{did_you_mean(metric, logged)}")
    seeds = max(len(r.runs) for r in table.results)
    figure = plots.mean_curves_figure(drawn, metric, f"{study.experiment} ({study.id}): {metric}, {seeds} seed(s)")
    try:
        figure.savefig(path)
    except OSError as exc:
        raise PflError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plots.close(figure)
