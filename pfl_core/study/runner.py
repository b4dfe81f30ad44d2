"""From a spec file to finished runs: overrides, sweep expansion, seeds, validation, tracking,
output."""

from __future__ import annotations

import copy
import math
import sys
from typing import Any

import attrs

from pfl_core.engine.engine import Engine, Resolved, RunResult, resolve
from pfl_core.errors import Interrupted, PflError, SpecError
from pfl_core.spec import POINTS, PluginRef, apply_overrides, expand_sweep, load_toml, set_dotted, shown, structure
from pfl_core.study.stats import Summary, paired_difference, summarize
from pfl_core.tracking.store_check import check_store
from pfl_core.tracking.study import begin_study, studied
from pfl_core.tracking.tables import table_csv
from pfl_core.tracking.terminal import human_bytes, human_seconds
from pfl_core.tracking.tracker import flatten, log_accuracy_distribution, make_tracker, run_status


@attrs.define
class Point:
    """One sweep point: its settings, the validated spec, and the seeds it runs with."""

    settings: dict[str, Any]
    resolved: Resolved
    raw: dict
    base: dict | None = None  # the spec before its sweep settings (--set applied): references start here

    @property
    def seeds(self) -> list[int] | None:
        """The repeat seeds (``experiment.seeds``), or None for one plain run."""
        return self.resolved.spec.experiment.seeds

    def for_seed(self, seed: int) -> Resolved:
        raw = copy.deepcopy(self.raw)
        experiment = raw.setdefault("experiment", {})
        experiment["seed"] = seed
        experiment.pop("seeds", None)
        return resolve(raw)


@attrs.define
class PointResult:
    """A point's runs: one per seed (or the single run), and the mean over them."""

    name: str
    seeds: list[int]
    runs: list[RunResult]
    summary: dict[str, Summary]
    run_id: str | None = None
    resolved_algorithm: str = ""
    group: str = ""  # the non-algorithm sweep settings it shares with its references
    seeded: bool = False  # experiment.seeds: one child run per seed

    def values(self, metric: str) -> list[float]:
        return [r.final.get(metric, math.nan) for r in self.runs]


def resolve_points(raw: dict, overrides: list[str], sweeps: list[str] = (), no_sweep: bool = False,
                   notes: list[str] | None = None) -> list[Point]:
    """Every run the spec describes (one, or one per sweep point), validated before any runs."""
    raw = apply_overrides(raw, overrides, sweeps, no_sweep, notes)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    expanded = expand_sweep(raw)  # validates the [sweep] table's shape
    if _sweeps_algorithm(raw.get("sweep", {})):
        check_base_algorithm(base)
    points = []
    for settings, point in expanded:
        try:
            points.append(Point(settings, resolve(point), point, base))
        except SpecError as exc:
            if settings:  # say which sweep point broke
                where = ", ".join(f"{k}={shown(v)}" for k, v in settings.items())
                raise SpecError(exc.path, f"{exc.message} (sweep point {where})") from None
            raise
    return points


def _sweeps_algorithm(sweep: dict) -> bool:
    """Whether the sweep sets the algorithm (its name, its whole table or its params), so the
    points alone never validate the spec's own [algorithm] table."""
    keys = [k for k in sweep if k != POINTS] + [k for entry in sweep.get(POINTS, []) for k in entry]
    return any(k == "algorithm" or k.startswith("algorithm.") for k in keys)


def check_base_algorithm(base: dict) -> None:
    """The spec's own [algorithm] table is what --no-sweep (and --set on the swept key) runs:
    a sweep over the algorithm must not hide a typo or a bad name in it."""
    from pfl_core import registry

    table = base.get("algorithm")
    if table is None:
        return
    note = " (in the spec's own [algorithm] table, which the sweep replaces)"
    try:
        if not isinstance(table, dict) or "name" in table:
            ref = structure(table, PluginRef, "algorithm")
            registry.instantiate(registry.ALGORITHM, ref.name, ref.params, "algorithm.name", "algorithm.params")
        else:  # the sweep gives every point its name: check the table's keys and types only
            structure({"name": "", **table}, PluginRef, "algorithm")
    except SpecError as exc:
        raise SpecError(exc.path, exc.message + note) from None


def run_name_for(resolved: Resolved, settings: dict[str, Any]) -> str:
    base = resolved.spec.tracking.run_name or resolved.spec.algorithm.name
    flat = {}
    for key, value in settings.items():  # a sweep.points entry names its own overrides
        flat.update(value if key == POINTS else {key: value})
    # A sweep over algorithm.name or over whole [algorithm] tables is named by the algorithm.
    extras = [f"{k.split('.')[-1]}={v}" for k, v in flat.items() if k not in ("algorithm.name", "algorithm")]
    return " ".join([base, *extras])


def run_names(points: list[Point]) -> list[str]:
    """Each point's run name; points that would share one (two [algorithm] tables of the same
    method in a sweep) are told apart by the algorithm parameters whose values differ."""
    names = [run_name_for(p.resolved, p.settings) for p in points]
    for name in set(names):
        same = [i for i, n in enumerate(names) if n == name]
        if len(same) < 2:
            continue
        params = [flatten(points[i].resolved.as_dict.get("algorithm", {}).get("params", {})) for i in same]
        differing = [k for k in dict.fromkeys(k for p in params for k in p) if len({p.get(k) for p in params}) > 1]
        for i, p in zip(same, params):
            names[i] = " ".join([name, *[f"{k.split('.')[-1]}={p.get(k)}" for k in differing]])
    return names


ALGORITHM_KEYS = ("algorithm", "algorithm.name")


def _is_algorithm_key(key: str) -> bool:
    """Settings that vary the method (not the data): reference runs are shared across them.
    A ``sweep.points`` entry is a method with its own budget settings."""
    return key in ALGORITHM_KEYS or key.startswith("algorithm.") or key == POINTS


def reference_points(points: list[Point]) -> list[tuple[str, Point]]:
    """``experiment.reference`` baselines: once per spec (once per group of sweep points that
    share everything but the algorithm), on the identical data and seeds."""
    experiment = points[0].resolved.spec.experiment
    if not experiment.reference:
        return []
    from pfl_core import registry

    for i, name in enumerate(experiment.reference):
        registry.resolve(registry.ALGORITHM, name, f"experiment.reference[{i}]")
    out, seen = [], set()
    for point in points:
        shared = {k: v for k, v in point.settings.items() if not _is_algorithm_key(k)}
        group = repr(sorted(shared.items()))
        if group in seen:
            continue
        seen.add(group)
        for name in experiment.reference:
            # the spec's own settings and this group's data settings, never a sweep point's
            # method-specific overrides (a FedAlt entry's local_epochs is not Local's budget)
            raw = copy.deepcopy(point.base if point.base is not None else point.raw)
            for key, value in shared.items():
                set_dotted(raw, key, value)
            raw["algorithm"] = {"name": name}
            try:
                ref = Point(shared, resolve(raw), raw)
            except SpecError as exc:
                raise SpecError(exc.path, f"{exc.message} (in the reference run {name!r}, experiment.reference)") from None
            label = " ".join([f"{name} (reference)", *[f"{k.split('.')[-1]}={v}" for k, v in shared.items()]])
            out.append((label, ref))
    return out


def same_run(a: Point, b: Point) -> bool:
    """Two points that would produce the same runs (so a reference is not run twice)."""
    strip = lambda d: {k: v for k, v in d.items() if k != "tracking"}  # noqa: E731
    return strip(a.resolved.as_dict) == strip(b.resolved.as_dict)


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


def check_compare_to(points: list[Point], names: list[str]) -> None:
    wanted = points[0].resolved.spec.experiment.compare_to
    if wanted and wanted not in names:
        raise SpecError("experiment.compare_to", f"names no run of this spec: {wanted!r}; runs: {', '.join(names)}")


def study_params(points: list[Point]) -> tuple[str, dict[str, str], dict[str, str]]:
    """The study parent run's experiment, params (what every sweep point shares) and tags."""
    spec = points[0].resolved.spec
    flat = [flatten(p.resolved.as_dict) for p in points]
    shared = {k: v for k, v in flat[0].items() if all(f.get(k) == v for f in flat[1:])}
    swept = list(dict.fromkeys(k for p in points for k in p.settings))
    tags = {"pfl.sweep": ", ".join(swept)} if swept else {}
    return spec.tracking.experiment or spec.experiment.name, shared, {**tags, **spec.tracking.tags}


@studied  # one MLflow study per call (pfl_core/tracking.py)
def run_spec_file(path: str, overrides: list[str], *, dry_run: bool = False, tracking_uri: str | None = None,
                  no_tracking: bool = False, quiet: bool = False, out=None, sweeps: list[str] = (),
                  no_sweep: bool = False, out_dir: str | None = None, overwrite: bool = False,
                  clients: bool = False) -> list[PointResult]:
    """Run every point of the spec. ``out_dir``: also write the results there
    (:mod:`pfl_core.results`), after the spec validated; a failure part-way still writes what
    finished (and an ``INCOMPLETE`` file) before it propagates."""
    from pfl_core.study.results import ResultsDir, check_target, dumps_spec

    out = out or sys.stdout
    if no_tracking:
        overrides = [*overrides, "tracking.enabled=false"]
    notes: list[str] = []
    raw = apply_overrides(load_toml(path), overrides, sweeps, no_sweep, notes)
    points = resolve_points(raw, [], notes=notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    names = run_names(points)
    check_compare_to(points, names)
    references = reference_points(points)
    if dry_run:
        if out_dir is not None:
            check_target(out_dir, overwrite)  # said now, though a dry run writes nothing
        dry_run_report(points, out)
        for label, _ in references:
            print(f"# reference run: {label} (same data and seeds)", file=out)
        return []
    stores = {tracking_uri or p.resolved.spec.tracking.uri: p.resolved.spec.tracking for p in points}
    for section in stores.values():  # a store that cannot be used is said now, before any training
        check_store(section, tracking_uri)
    # Which reference run each point is (None: its own runs), decided once.
    reuses = [next((i for i, (_, ref) in enumerate(references) if same_run(point, ref)), None) for point in points]
    own_points = [p for p, reused in zip(points, reuses) if reused is None]
    # A parent run over the sweep points and reference runs; none for one run or one point's seeds.
    top_level = len(references) + len(own_points)
    begin_study(path, points[0].resolved.spec.experiment.description, points[0].resolved.spec.tracking,
                tracking_uri, *study_params(points), parent=top_level > 1)
    compare_to = points[0].resolved.spec.experiment.compare_to or names[0]
    results_dir = None
    if out_dir is not None:  # the spec validated: now the directory may be created
        check_target(out_dir, overwrite)
        results_dir = ResultsDir(out_dir, overwrite)
        try:
            results_dir.start(dumps_spec(raw))
            for label, ref in references:
                results_dir.write_point(label, ref.resolved.toml())
            for point, name in zip(points, names):
                results_dir.write_point(name, point.resolved.toml())
        except OSError as exc:
            raise PflError(f"--out {out_dir}: cannot write: {exc.strerror or exc}") from None

    counter = RunCounter(sum(len(p.seeds or [0]) for p in [*(ref for _, ref in references), *own_points]))
    ref_results: list[PointResult] = []
    results: list[PointResult] = []
    partial: list[PointResult] = []  # a point whose later seeds failed: the seeds that finished
    reused_refs: set[int] = set()
    shown: list[PointResult] = []

    def finished() -> list[PointResult]:  # the sweep points' results, then the references not among them
        return [*results, *(r for i, r in enumerate(ref_results) if i not in reused_refs)]

    try:
        for label, ref in references:
            ref_results.append(run_point(ref, label, tracking_uri, quiet, out, partial, counter))
            print_point(ref_results[-1], out, clients)
        for point, name, reused in zip(points, names, reuses):
            if reused is not None:  # this sweep point is one of the reference runs: not run twice
                reused_refs.add(reused)
                results.append(attrs.evolve(ref_results[reused], name=name))
            else:
                results.append(run_point(point, name, tracking_uri, quiet, out, partial, counter))
                print_point(results[-1], out, clients)
        shown = finished()
        if ref_results:
            log_gains(points[0], shown, ref_results, tracking_uri)
        if len(shown) > 1:
            print_comparison(shown, compare_to, out)
    except BaseException as exc:
        if results_dir is not None:
            done = shown or [*finished(), *partial]
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}" if str(exc) else type(exc).__name__
            try:
                results_dir.mark_incomplete(f"stopped early ({reason}); these files hold the "
                                            f"{len(done)} run(s) that finished")
                results_dir.write_results(done, compare_to)
                if isinstance(exc, Interrupted):  # said in the command line's one line
                    exc.out_dir = out_dir
                else:
                    print(f"partial results (the {len(done)} run(s) that finished) written to {out_dir}",
                          file=sys.stderr)
            except Exception as write_error:  # never hide the failure that stopped the runs
                print(f"could not write the partial results to {out_dir}: {write_error}", file=sys.stderr)
        raise
    if results_dir is not None:
        results_dir.write_results(shown, compare_to)
    if not quiet:  # --quiet: the summaries and the comparison only
        print_locations(points[0], out_dir, out)
    return shown


def resume_run(target: str, spec_path: str | None, overrides: list[str], *, tracking_uri: str | None = None,
               quiet: bool = False, out=None, clients: bool = False) -> list[PointResult]:
    """``pfl-run --resume TARGET [SPEC]``: continue one run from its latest good checkpoint (a
    checkpoint folder, a run's folder of them, or an MLflow run id whose ``pfl.checkpoint`` tag
    names it) in the same MLflow run. Refused (PflError) when the spec (SPEC and ``--set``, or
    the checkpoint's own spec with ``--set``) or the code differs from the checkpoint's."""
    from pathlib import Path

    from pfl_core.state import checkpoint

    out = out or sys.stdout
    if not Path(target).expanduser().exists():
        target = checkpoint_of_run(target, tracking_uri, spec_path)
    loaded = checkpoint.find(target)
    if loaded.skipped:
        print(f"note: {'; '.join(loaded.skipped)}; resuming from the previous good one, {loaded.path}",
              file=sys.stderr)
    saved = load_toml_text(loaded.state["spec"])
    raw = load_toml(spec_path) if spec_path else saved
    candidates = []
    for point in resolve_points(raw, overrides):
        candidates += [point.for_seed(s) for s in point.seeds] if point.seeds else [point.resolved]
    differences = [checkpoint.spec_differences(checkpoint.compared(saved),
                                               checkpoint.compared(load_toml_text(c.toml()))) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: len(differences[i]))
    if differences[best]:
        keys = differences[best]
        raise PflError(f"--resume: the spec differs from the checkpoint's at {', '.join(keys[:8])}"
                       f"{f' and {len(keys) - 8} more keys' if len(keys) > 8 else ''}; resume with the spec "
                       f"the run started with (or leave SPEC out to use the checkpoint's)")
    resolved = candidates[best]
    was, now = loaded.state["code"], checkpoint.code_version(checkpoint.plugin_names(resolved.spec))
    if (was["pfl"], was["source_sha256"]) != (now["pfl"], now["source_sha256"]):
        commit = f" at git commit {was['git_commit'][:12]}" if was.get("git_commit") else ""
        what = (f"pfl {was['pfl']} against {now['pfl']}" if was["pfl"] != now["pfl"] else
                "the source of pfl_core or of the spec's plugins changed")
        raise PflError(f"--resume: the checkpoint was written by other code ({what}; it was written{commit}); "
                       f"resume with that code, or start the run again")
    spec = resolved.spec
    uri = tracking_uri or loaded.state.get("tracking_uri")
    tracker = make_tracker(spec.tracking, uri) if loaded.state.get("run_id") else make_tracker(
        attrs.evolve(spec.tracking, enabled=False))
    name = loaded.state.get("run_name") or spec.algorithm.name
    run = Engine(resolved, tracker=tracker, progress=not quiet, run_name=name).run(resume=loaded)
    result = PointResult(name, [spec.experiment.seed], [run], {k: summarize([v]) for k, v in run.final.items()},
                         run.run_id, spec.algorithm.name)
    print_point(result, out, clients)
    return [result]


def load_toml_text(text: str) -> dict:
    from pfl_core.spec import tomllib

    return tomllib.loads(text)


def checkpoint_of_run(run_id: str, tracking_uri: str | None, spec_path: str | None) -> str:
    """The checkpoint folder an MLflow run's ``pfl.checkpoint`` tag names."""
    import mlflow

    from pfl_core.state.checkpoint import CHECKPOINT_TAG

    uri = tracking_uri
    if uri is None and spec_path:
        table = load_toml(spec_path).get("tracking")
        uri = (table.get("uri") if isinstance(table, dict) else None) or None
    uri = uri or mlflow.get_tracking_uri()
    from pfl_core.state.locations import sqlite_file

    db = sqlite_file(uri)
    if db is not None and not db.is_file():
        raise PflError(f"--resume: {run_id} is neither a checkpoint folder nor a run of an MLflow store here "
                       f"({uri} does not exist; give --tracking-uri, or the checkpoint folder)")
    try:
        run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception:
        raise PflError(f"--resume: {run_id} is neither a checkpoint folder nor a run in the MLflow store {uri} "
                       f"(give --tracking-uri, or the checkpoint folder)") from None
    folder = run.data.tags.get(CHECKPOINT_TAG)
    if not folder:
        raise PflError(f"--resume: MLflow run {run_id} has no checkpoint (no {CHECKPOINT_TAG} tag: it was run "
                       f"with checkpoint.enabled = false, or stopped before its first checkpoint)")
    return folder


@attrs.define
class RunCounter:
    """``run k/n`` in the progress bar's label during a sweep (or over seeds)."""

    total: int
    done: int = 0

    def label(self, name: str) -> str:
        self.done += 1
        return f"run {self.done}/{self.total} {name}" if self.total > 1 else name


def print_locations(point: Point, out_dir: str | None, out) -> None:
    """Where the results are: the tracking URI, the experiment, the MLflow UI address of its
    runs, and the --out directory."""
    from pfl_core.tracking.terminal import experiment_location

    lines = []
    try:
        where = experiment_location(point.resolved.spec)
    except Exception:  # a store that cannot be read back: the runs were logged; say nothing wrong
        where = None
    if where:
        lines.append(where)
    if out_dir is not None:
        lines.append(f"results: {out_dir}/ (comparison.csv, differences.csv, runs/<run>/clients*.csv, spec.toml)")
    if lines:
        print("\n" + "\n".join(lines), file=out)


def log_gains(point: Point, results: list[PointResult], references: list[PointResult], tracking_uri) -> None:
    """Each run's collaboration gain over the reference runs of its group, logged to its
    (parent) run as ``gain_vs_local``, ``gain_vs_best_reference`` and their ``_ci95``."""
    tracker = make_tracker(point.resolved.spec.tracking, tracking_uri)
    for result in results:
        mine = [r for r in references if r.group == result.group]
        result.summary.update(gains(result, mine))
        metrics = {}
        for key in ("gain_vs_local", "gain_vs_best_reference"):
            if key in result.summary:
                s = result.summary[key]
                metrics[key] = s.mean
                if not math.isnan(s.ci95):
                    metrics[f"{key}_ci95"] = s.ci95
        tracker.log_metrics_to(result.run_id, metrics)


def dry_run_report(points: list[Point], out) -> None:
    import torch

    from pfl_core.data.federated import build_federated_data
    from pfl_core.runtime.context import ModelBank

    for point in points:
        if point.settings:
            print(f"# sweep point: {point.settings}", file=out)
        print(point.resolved.toml(), file=out)
        spec = point.resolved.spec
        if point.seeds:
            print(f"# seeds: {', '.join(map(str, point.seeds))} ({len(point.seeds)} runs of this point, "
                  f"each with its own partition and initialisation)", file=out)
        data = build_federated_data(point.for_seed(point.seeds[0]).spec if point.seeds else spec)
        ModelBank(spec, data.input_shape, data.num_classes, torch.device("cpu")).check_builds()
        sizes = [c.num_train for c in data.clients]
        public = f", public set {len(data.public.indices)}" if data.public is not None else ""
        print(f"# ok: {len(data.clients)} clients, train sizes {min(sizes)}..{max(sizes)}, "
              f"{data.num_classes} classes, input {tuple(data.input_shape)}{public}\n", file=out)


def run_point(point: Point, name: str, tracking_uri: str | None, quiet: bool, out,
              partial: list | None = None, counter: RunCounter | None = None) -> PointResult:
    """Run one sweep point: a single run, or one child run per seed under a parent run that
    holds the mean, std and 95% interval of every final metric."""
    spec = point.resolved.spec
    group = repr(sorted((k, v) for k, v in point.settings.items() if not _is_algorithm_key(k)))
    if not point.seeds:
        tracker = make_tracker(spec.tracking, tracking_uri)
        run = Engine(point.resolved, tracker=tracker, progress=not quiet, run_name=name,
                     progress_label=counter.label(name) if counter else None).run()
        return PointResult(name, [spec.experiment.seed], [run], {k: summarize([v]) for k, v in run.final.items()},
                           run.run_id, spec.algorithm.name, group)

    parent = make_tracker(spec.tracking, tracking_uri)
    parent.start(spec.tracking.experiment or spec.experiment.name, name, flatten(point.resolved.as_dict),
                 {"algorithm": spec.algorithm.name, "pfl.seeds": ",".join(map(str, point.seeds)),
                  **spec.tracking.tags})
    status = "FAILED"
    runs: list[RunResult] = []
    try:
        for seed in point.seeds:
            child = make_tracker(spec.tracking, tracking_uri)
            label = f"{name} seed={seed}"
            runs.append(Engine(point.for_seed(seed), tracker=child, progress=not quiet, run_name=label,
                               progress_label=counter.label(label) if counter else None).run())
            print_run_line(runs[-1], f"{name} seed={seed}", out)
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


def summarize_runs(runs: list[RunResult]) -> dict[str, Summary]:
    keys = sorted({k for r in runs for k in r.final})
    return {k: summarize([r.final.get(k, math.nan) for r in runs]) for k in keys}


def log_seed_summary(tracker, result: PointResult) -> None:
    """The parent run's metrics (``m``, ``m_std``, ``m_ci95``), the per-seed table and the
    clients' final accuracy by seed."""
    metrics = {}
    for key, s in result.summary.items():
        metrics.update({key: s.mean, f"{key}_std": s.std, f"{key}_ci95": s.ci95})
    finite = {k: v for k, v in metrics.items() if not math.isnan(v)}
    if finite:
        tracker.log_metrics(finite, step=0)
    keys = sorted(result.summary)
    rows = [[seed, *[run.final.get(k, math.nan) for k in keys]] for seed, run in zip(result.seeds, result.runs)]
    if rows:
        tracker.log_text(table_csv(["seed", *keys], rows), "results/seeds.csv")
    log_accuracy_distribution(tracker, [(f"seed={seed}", run.client_rows) for seed, run in zip(result.seeds, result.runs)],
                              f"{result.name}: final accuracy per client, by seed")


# -- terminal output --------------------------------------------------------------------------


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:  # byte counts
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _pm(s: Summary, digits: int = 4) -> str:
    if s.n < 2:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f} ± {s.ci95:.{digits}f}"


def print_table(header: list[str], rows: list[list], out) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def run_summary(result: RunResult) -> str:
    """One run in one line: accuracy mean, std, p10, the worst client, bytes, wall time."""
    final = result.final
    parts = [f"{label} {final[k]:.4f}" for k, label in (("acc_mean", "acc_mean"), ("acc_std", "std"),
                                                        ("acc_p10", "p10")) if k in final]
    scored = [r for r in result.client_rows if isinstance(r.get("acc"), (int, float)) and not r.get("coldstart")]
    if scored:
        worst = min(scored, key=lambda r: r["acc"])
        parts.append(f"worst client {worst.get('client', '?')} {worst['acc']:.4f}")
    if "coldstart_acc_mean" in final:
        parts.append(f"cold-start {final['coldstart_acc_mean']:.4f}")
    parts.append(f"up {human_bytes(final.get('comm_up_bytes', 0.0))}, down {human_bytes(final.get('comm_down_bytes', 0.0))}")
    if result.seconds:
        parts.append(human_seconds(result.seconds))
    return "  ".join(parts)


def print_run_line(result: RunResult, name: str, out) -> None:
    print(f"-- {name}: {run_summary(result)}", file=out)
    for error in result.errors:
        print(f"-- {name}: error: {error}", file=out)


def print_point(result: PointResult, out, clients: bool = False) -> None:
    """A run's compact summary (``clients``: its per-client table first); a point with seeds:
    the mean ± 95% interval over them."""
    if len(result.runs) == 1 and len(result.seeds) <= 1 and not result.seeded:
        if clients:
            print_client_table(result.runs[0], result.name, out)
        print_run_line(result.runs[0], result.name, out)
        if result.run_id and not clients:
            print(f"-- MLflow run {result.run_id}", file=out)
        return
    if clients:
        for seed, run in zip(result.seeds, result.runs):
            print_client_table(run, f"{result.name} seed={seed}", out)
    print(f"\n== {result.name}: {len(result.runs)} seeds (mean ± 95% interval) ==", file=out)
    for key in ("acc_mean", "acc_std", "acc_p10", "server_acc_mean", "coldstart_acc_mean",
                "budget.private_epochs", "budget.public_epochs"):
        if key in result.summary:
            print(f"-- {key} {_pm(result.summary[key])}", file=out)
    if "comm_up_bytes" in result.summary:
        seconds = sum(r.seconds for r in result.runs)
        print(f"-- up {human_bytes(result.summary['comm_up_bytes'].mean)} per run, "
              f"{human_seconds(seconds)} in all", file=out)
    if result.run_id:
        print(f"-- MLflow parent run {result.run_id} (one child run per seed)", file=out)


def print_client_table(result: RunResult, name: str, out) -> None:
    rows = result.client_rows
    if not rows:
        return
    print(f"\n== {name}: per-client results (test split) ==", file=out)
    header = list(rows[0])
    print_table(header, [[r[k] for k in header] for r in rows], out)
    final = result.final
    coldstart = "  ".join(f"{k} {_fmt(final[k])}" for k in ("coldstart_acc_mean", "coldstart_acc_std") if k in final)
    if coldstart:
        print(f"-- cold-start clients: {coldstart}", file=out)
    if result.run_id:
        print(f"-- MLflow run {result.run_id}", file=out)


COMPARED = ("acc_mean", "acc_p10", "coldstart_acc_mean")


def print_comparison(results: list[PointResult], reference: str, out) -> None:
    """Every run as mean ± ci95, its collaboration gain over the reference runs (when
    ``experiment.reference`` is set), and its paired difference from ``reference`` over the
    same seeds; differences whose 95% interval excludes 0 are marked *."""
    ref = next((r for r in results if r.name == reference), results[0])
    n = len(ref.runs)
    title = "same seed, same partition" if n == 1 else f"{n} seeds, mean ± 95% interval"
    print(f"\n== comparison ({title}) ==", file=out)
    keys = [k for k in COMPARED if any(k in r.summary for r in results)]
    gain_keys = [k for k in ("gain_vs_best_reference", "gain_vs_local") if any(k in r.summary for r in results)]
    diff_keys = keys if n > 1 else []
    header = ["run", *keys, "comm_up_bytes", *gain_keys, *[f"Δ{k} vs {ref.name}" for k in diff_keys]]
    rows = []
    for r in results:
        rows.append([
            r.name,
            *[_pm(r.summary[k]) if k in r.summary else "-" for k in keys],
            human_bytes(r.summary["comm_up_bytes"].mean) if "comm_up_bytes" in r.summary else "-",
            *[_interval(r.summary[k]) if k in r.summary else "-" for k in gain_keys],
            *[_diff_cell(r, ref, k) for k in diff_keys],
        ])
    print_table(header, rows, out)
    if n > 1:
        print("(Δ: paired difference over the same seeds with its 95% interval; * = the interval excludes 0)",
              file=out)
    if gain_keys:
        print("(gain_vs_best_reference: acc_mean - max(reference runs) per seed, paired; gain_vs_local likewise)",
              file=out)
    if len({tuple(r.seeds) for r in results}) > 1:
        print("note: runs finished on different seed sets; differences use the seeds both have", file=out)


def _interval(d: Summary) -> str:
    if d.n < 2:
        return f"{d.mean:+.4f}"
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{' *' if d.excludes_zero else ''}"


def _diff_cell(result: PointResult, ref: PointResult, key: str) -> str:
    if result is ref:
        return "-"
    common = [s for s in result.seeds if s in ref.seeds]
    if len(common) < 2 or key not in result.summary or key not in ref.summary:
        return "-"
    mine = dict(zip(result.seeds, result.values(key)))
    theirs = dict(zip(ref.seeds, ref.values(key)))
    return _interval(paired_difference([mine[s] for s in common], [theirs[s] for s in common]))
