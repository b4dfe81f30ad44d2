"""``pfl results``: the studies an MLflow store holds, and any one study's comparison table
rebuilt from its runs (through MLflow's client API), printed as ``pfl-run`` printed it or
exported as Markdown, LaTeX or CSV, and its mean curves drawn.

A study's compared runs carry ``pfl.point`` = the study's id (a point's parent run over its
seeds, a single run, a reference run); a point's seed runs are its parent's children; their
final metrics are the runs' last values. Studies logged before ``pfl.point`` existed are
rebuilt from their top-level runs the same way."""

from __future__ import annotations

import datetime
import os
import sys

import attrs

from pfl_core.engine import RunResult
from pfl_core.errors import PflError, did_you_mean
from pfl_core.state.locations import plain_uri, sqlite_file
from pfl_core.study.compare import adjust_gains
from pfl_core.study.points import PointResult
from pfl_core.study.report import (
    Column,
    ResultsTable,
    comparison_table,
    left_out_line,
    print_comparison,
    print_table,
    table_csv_text,
    table_latex,
    table_markdown,
)
from pfl_core.study.reuse import SUPERSEDED_TAG, TUNING_TAG
from pfl_core.study.seeds import gains, point_curve, summarize_runs
from pfl_core.study.space import EDGE_TAG, tuning_header
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
        # the history the table needs: each run's last round (curves() reads the per-round values)
        finals = [RunResult(history=[{"round": _last_round(client, r)}], client_rows=[], final=dict(r.data.metrics),
                            run_id=r.info.run_id) for r in runs]
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


def _last_round(client, run) -> int | None:
    """The last round a stored run ran: its spec's rounds when it finished, else the last step
    it logged a round at."""
    if run.info.status == "FINISHED" and "experiment.rounds" in run.data.params:
        return int(run.data.params["experiment.rounds"])
    return max((m.step for m in client.get_metric_history(run.info.run_id, "round_seconds")), default=None)


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
    parents = sorted((r for r in study.runs if TUNING_TAG in r.data.tags and TRIAL_TAG not in r.data.tags
                      and r.info.run_name.endswith("(tuning)")), key=lambda r: r.info.start_time)  # as tuned
    if not parents:
        return ""
    names = [r.info.run_name.removesuffix(" (tuning)") for r in parents]
    counts = [int(sum(r.data.metrics.get(f"trials_{state}", 0) for state in ("complete", "pruned", "diverged")))
              for r in parents]
    params = parents[0].data.params
    edges = [f"{name} {text}" for name, r in zip(names, parents)
             for tag, text in sorted(r.data.tags.items()) if tag.startswith(EDGE_TAG)]
    return tuning_header(dict(zip(names, counts)), params.get("tune.metric", "?"), params.get("tune.objective", "?"),
                         params.get("tune.sampler", "?"), params.get("tune.seeds", "?"), edges)


# -- exports: the table model of pfl_core.study.report, in each format --------------------------


def comparison(table: Table) -> ResultsTable:
    """The stored study's comparison table, as pfl-run built it (:func:`comparison_table`)."""
    return comparison_table(table.results, table.compare_to, table.correction, table.family, table.left_out)


def markdown(table: Table) -> str:
    return (f"_{table.tuned}_\n\n" if table.tuned else "") + table_markdown(comparison(table))


def latex(table: Table) -> str:
    """A booktabs tabular of the table's columns; needs ``\\usepackage{booktabs}``."""
    return table_latex(comparison(table)) + (f"% {table.tuned}\n" if table.tuned else "")


def csv_text(table: Table) -> str:
    return table_csv_text(comparison(table))


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


def within_table(rows: list[tuple[str, Summary, Summary, Summary]], first: str, second: str,
                 correction: str) -> ResultsTable:
    """``--paired``'s table: per point its seeds, ``first``, ``second`` and their paired
    difference, in every format as the comparison's columns are."""
    p = "p: paired t-test, Holm-adjusted over the runs" if correction == "holm" else "p: paired t-test, unadjusted"
    note = (f"mean ± 95% interval over the seeds; the difference is paired by seed (the same runs); {p}; "
            f"* = adjusted p < 0.05")
    columns = (Column("run", "run", "text", tuple(name for name, *_ in rows)),
               Column("seeds", "seeds", "count", tuple(a.n for _, a, _, _ in rows)),
               Column(first, first, "summary", tuple(a for _, a, _, _ in rows)),
               Column(second, second, "summary", tuple(b for _, _, b, _ in rows)),
               Column(f"{first} - {second}", "difference", "difference", tuple(d for *_, d in rows)))
    return ResultsTable(note, columns)


def curves(client, table: Table, metric: str) -> list[tuple[str, list[float], list[float], list[float]]]:
    """Each point's ``metric`` by round: the mean over its seed runs' histories and the 95%
    interval's half-width."""
    out = []
    for result in table.results:
        # each run's history, as the run had it: one row per logged step (the table's runs are
        # left as they are: their rounds are the table's)
        runs = [attrs.evolve(run, history=[{"round": m.step, metric: m.value}
                                           for m in client.get_metric_history(run.run_id, metric)])
                for run in result.runs]
        steps, means, half = point_curve(attrs.evolve(result, runs=runs), metric)
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
        draw(client, table, metric, plot, study, sys.stderr)  # stderr: stdout may be the CSV
    if paired is not None:
        within = within_table(within_runs(table, *paired), *paired, table.correction)
        if fmt == "csv":
            out.write(table_csv_text(within))
        elif fmt == "latex":
            out.write(table_latex(within))
        else:  # markdown, and the default table
            out.write(table_markdown(within))
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


def draw(client, table: Table, metric: str, path: str, study: StoredStudy, err) -> None:
    """``--plot``: each point's mean curve of ``metric`` with its 95% band into ``path``; says
    on ``err`` where the picture is."""
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
    print(f"plot: {os.path.abspath(path)} ({metric} by round, each point's mean over {seeds} seed(s) with its "
          f"95% band)", file=err)
