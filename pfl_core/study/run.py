"""``pfl-run SPEC``: plan the study's points, run them (references first), print and log the
comparison, and write ``--out``; every step below is its own module of this package."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from pathlib import Path

import attrs

from pfl_core.data.cache import DataCache, drop_handed_over, hand_over
from pfl_core.errors import Interrupted, NonFiniteError, PflError
from pfl_core.spec import apply_overrides, load_toml
from pfl_core.state.locations import sqlite_file
from pfl_core.study.points import (
    PointResult,
    build_key,
    check_compare_to,
    check_every_point_builds,
    first_seed_spec,
    reference_points,
    resolve_points,
    run_names,
    same_run,
    study_params,
)
from pfl_core.study.report import dry_run_report, left_out_line, print_comparison, print_locations, print_point
from pfl_core.study.results import ResultsDir, check_target, dumps_spec
from pfl_core.study.reuse import Reuse, hold_resume_locks
from pfl_core.study.seeds import RunCounter, log_differences, log_gains, log_study_figures, run_point
from pfl_core.study.tune import describe, plan_tuning, tune_point, tuned_spec_toml, values_text
from pfl_core.tracking.store_check import DEFAULT_URI, check_store
from pfl_core.tracking.study import begin_study, studied
from pfl_core.tracking.terminal import warning_line
from pfl_core.tracking.tracker import current_study


@studied  # one MLflow study per call (pfl_core/tracking/study.py)
def run_spec_file(path: str, overrides: list[str], *, dry_run: bool = False, tracking_uri: str | None = None,
                  no_tracking: bool = False, quiet: bool = False, out=None, sweeps: list[str] = (),
                  no_sweep: bool = False, out_dir: str | None = None, overwrite: bool = False,
                  clients: bool = False, yes: bool = False, resume: bool = False) -> list[PointResult]:
    """Run every point of the spec. ``out_dir``: also write the results there
    (:mod:`pfl_core.study.results`), after the spec validated; a failure part-way still writes what
    finished (and an ``INCOMPLETE`` file) before it propagates. A study of more than
    ``LARGE_STUDY`` runs needs ``yes`` (a dry run of one says its size first). With ``[tune]``
    each point is first tuned (:mod:`pfl_core.study.tune`), then runs at its best configuration.
    ``resume``: continue a stopped study of this spec: its newest tuning's finished trials and its
    finished final runs are kept (:mod:`pfl_core.study.reuse`)."""

    out = out or sys.stdout
    given = {"overrides": overrides, "sweeps": sweeps, "no_sweep": no_sweep, "yes": yes}  # as the user gave them
    if no_tracking:
        overrides = [*overrides, "tracking.enabled=false"]
    notes: list[str] = []
    raw = apply_overrides(load_toml(path), overrides, sweeps, no_sweep, notes)
    points = resolve_points(raw, [], notes=notes)
    names = run_names(points)
    check_compare_to(points, names)
    plans = plan_tuning(points, names, notes)  # [tune]: each point's space, checked before any data loads
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    references = reference_points(points)
    check_size(points, references, dry_run, yes, plans)
    stores = {tracking_uri or p.resolved.spec.tracking.uri: p.resolved.spec.tracking for p in points}
    # A store that cannot be used is said now, before any data loads; a new SQLite store is made
    # only once every point's data and models built (a missing data file leaves no mlflow.db).
    for section in stores.values():
        check_store(section, tracking_uri, create=False)  # a look at a SQLite file; creates nothing
        if not dry_run and not is_sqlite_store(section, tracking_uri):
            check_store(section, tracking_uri)  # a server: probed now, in seconds
    if dry_run:
        if out_dir is not None:
            check_target(out_dir, overwrite)  # said now, though a dry run writes nothing
        page = io.StringIO()  # printed once every point built: a data error comes alone, not after it
        dry_run_report(points, page)
        out.write(page.getvalue())
        for label, _ in references:
            print(f"# reference run: {label} (same data and seeds)", file=out)
        if plans:
            for plan in plans:
                print(f"# tuning {plan.name}: {plan.point.resolved.spec.tune.trials} trials on seeds {plan.seeds} over "
                      f"{', '.join(d.key for d in plan.space)}, then its best configuration on its seeds", file=out)
            print(f"# {describe(plans)}", file=out)
        return []
    # the first run takes the data its check built (a tuning study's trials share a DataCache instead)
    runs_first = None if plans else (references[0][1] if references else points[0])
    first_data = check_every_point_builds([*points, *(ref for _, ref in references)], runs_first)
    for section in stores.values():
        if is_sqlite_store(section, tracking_uri):
            check_store(section, tracking_uri)  # a new one is created now
    # Which reference run each point is (None: its own runs), decided once. A tuned point runs at
    # its tuned configuration, never as the (untuned) reference run it looks like before tuning.
    reuses = [None if plans else next((i for i, (_, ref) in enumerate(references) if same_run(point, ref)), None)
              for point in points]
    own_points = [p for p, reused in zip(points, reuses) if reused is None]
    # A parent run over the sweep points and reference runs; none for one run or one point's seeds.
    top_level = len(references) + len(own_points)
    final_runs = sum(len(p.seeds or [0]) for p in [*(ref for _, ref in references), *own_points])
    tracked = points[0].resolved.spec.tracking.enabled
    several = final_runs > 1 or bool(plans)  # a study: one run's own --resume would leave the rest undone
    if several and tracked and current_study() is not None:  # each run names it (--resume RUN says it)
        current_study().resume = study_command(str(Path(path).resolve()), resume=True, **given)
    begin_study(path, points[0].resolved.spec.experiment.description, points[0].resolved.spec.tracking,
                tracking_uri, *study_params(points), parent=top_level > 1, tuned=bool(plans))
    compare_to = points[0].resolved.spec.experiment.compare_to or names[0]
    if current_study() is not None:  # each method's colour: its place in the comparison as planned
        current_study().methods = [*names, *(label for i, (label, _) in enumerate(references) if i not in reuses)]
    correction = points[0].resolved.spec.report.correction
    family = points[0].resolved.spec.report.correction_family
    # the store's finished runs are looked up only where there is a store; one SPEC --resume of a
    # study at a time: while another continues it, this one is refused here, before it writes anything
    reuse = Reuse() if resume and points[0].resolved.spec.tracking.enabled else None
    resume_locks = hold_resume_locks(points, tracking_uri) if reuse is not None else contextlib.ExitStack()
    results_dir = None
    try:
        if out_dir is not None:  # the spec validated: now the directory may be created
            check_target(out_dir, overwrite)
            results_dir = ResultsDir(out_dir, overwrite)
            results_dir.start(dumps_spec(raw))
            for label, ref in references:
                results_dir.write_point(label, ref.resolved.toml())
            for point, name in zip(points, names):
                results_dir.write_point(name, point.resolved.toml())
    except BaseException:
        resume_locks.close()
        raise
    counter = RunCounter(sum(len(p.seeds or [0]) for p in [*(ref for _, ref in references), *own_points]))
    ref_results: list[PointResult] = []
    results: list[PointResult] = []
    partial: list[PointResult] = []  # a point whose later seeds failed: the seeds that finished
    left_out: list[str] = []  # points whose training diverged on a final seed: not in the comparison
    reused_refs: set[int] = set()
    shown: list[PointResult] = []

    def finished() -> list[PointResult]:  # the sweep points' results, then the references not among them
        return [*results, *(r for i, r in enumerate(ref_results) if i not in reused_refs)]

    if first_data is not None:
        hand_over(first_seed_spec(runs_first), first_data)
        del first_data  # the run frees it
    try:
        if plans:  # each point at its own best configuration, found on the validation split
            cache = DataCache()
            for i, plan in enumerate(plans):
                tuned = tune_point(plan, tracking_uri, quiet, resume, cache)
                points[i] = tuned.point
                diverged = f", {tuned.diverged} diverged" if tuned.diverged else ""
                print(f"-- {plan.name}: tuned in {tuned.ran} trials ({tuned.pruned} pruned{diverged}): "
                      f"{values_text(tuned.values)} "
                      f"({plan.point.resolved.spec.tune.metric} {tuned.objective:.4f})", file=out)
                if results_dir is not None:
                    results_dir.write_tuned(names[i], tuned_spec_toml(tuned))
            del cache
            if reuse is not None:  # the stopped studies whose tunings these went on with are over
                reuse.supersede_tunings(points[0].resolved.spec.tracking.experiment
                                        or points[0].resolved.spec.experiment.name)
        for label, ref in references:
            ref_results.append(run_point(ref, label, tracking_uri, quiet, out, partial, counter, reuse))
            print_point(ref_results[-1], out, clients)
        for point, name, reused in zip(points, names, reuses):
            if reused is not None:  # this sweep point is one of the reference runs: not run twice
                reused_refs.add(reused)
                results.append(attrs.evolve(ref_results[reused], name=name))
            else:
                try:
                    results.append(run_point(point, name, tracking_uri, quiet, out, partial, counter, reuse))
                except NonFiniteError as exc:  # that method's result, not the study's end
                    if name == compare_to:  # nothing left to compare with
                        raise
                    left_out.append(diverged_line(point, name, exc, partial))
                    warning_line(f"{left_out[-1]}; the study goes on without it")
                    continue
                print_point(results[-1], out, clients)
        shown = finished()
        if ref_results:
            log_gains(points[0], shown, ref_results, tracking_uri)
        if len(shown) > 1:
            log_differences(points[0], shown, compare_to, tracking_uri)
            if plans:
                print(f"\n{describe(plans)}", file=out)
            print_comparison(shown, compare_to, out, correction, points[0].resolved.spec.report.budget, left_out,
                             family)
            study = current_study()
            if study is not None and study.parent is not None:
                log_study_figures(study.parent, shown)
    except BaseException as exc:
        if isinstance(exc, Interrupted) and several:  # the command that completes the study, not the one run
            exc.study_resume = study_resume_line(path, given, final_runs, bool(plans), tracked, tracking_uri,
                                                 no_tracking, out_dir)
        if results_dir is not None:
            done = shown or [*finished(), *partial]
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}" if str(exc) else type(exc).__name__
            try:
                results_dir.mark_incomplete(f"stopped early ({reason}); these files hold the "
                                            f"{len(done)} run(s) that finished")
                results_dir.write_results(done, compare_to, complete=False, correction=correction, family=family)
                if isinstance(exc, Interrupted):  # said in the command line's one line
                    exc.out_dir = out_dir
                else:
                    print(f"partial results (the {len(done)} run(s) that finished) written to {out_dir}",
                          file=sys.stderr)
            except Exception as write_error:  # never hide the failure that stopped the runs
                print(f"could not write the partial results to {out_dir}: {write_error}", file=sys.stderr)
        raise
    finally:
        resume_locks.close()  # however the study ended
        drop_handed_over()  # a study that stopped before its first run
    if results_dir is not None:
        results_dir.write_results(shown, compare_to, correction=correction, family=family)
    if not quiet:  # --quiet: the summaries and the comparison only
        print_locations(points[0], out_dir, out)
    return shown


def study_command(spec: str, *, resume: bool, overrides=(), sweeps=(), no_sweep: bool = False, yes: bool = False,
                  tracking_uri: str | None = None, no_tracking: bool = False, out_dir: str | None = None) -> str:
    """The ``pfl-run`` command of a study with the options it was given, quoted to paste into a
    shell; ``resume``: ``SPEC --resume``, which keeps the runs that finished and does the rest."""
    words = ["pfl-run", spec, *(["--resume"] if resume else [])]
    words += [word for value in overrides for word in ("--set", value)]
    words += [word for value in sweeps for word in ("--sweep", value)]
    words += [flag for flag, on in (("--no-sweep", no_sweep), ("--yes", yes), ("--no-tracking", no_tracking)) if on]
    if tracking_uri:
        words += ["--tracking-uri", tracking_uri]
    if out_dir:  # the folder holds this study's partial results (INCOMPLETE): the complete ones replace them
        words += ["--out", out_dir, "--overwrite"]
    return shlex.join(words)


def study_resume_line(path: str, given: dict, final_runs: int, tuned: bool, tracked: bool,
                      tracking_uri: str | None, no_tracking: bool, out_dir: str | None) -> str:
    """What an interrupted study of several runs says to do next: the command that completes
    the whole study (an untracked study keeps nothing: the command that runs it again)."""
    size = f"its tuning and {final_runs} runs" if tuned else f"{final_runs} runs"
    options = dict(given, tracking_uri=tracking_uri, no_tracking=no_tracking, out_dir=out_dir)
    if not tracked:
        return f"run the whole study ({size}; untracked, nothing is kept) again with: " \
               f"{study_command(path, resume=False, **options)}"
    return (f"continue the whole study ({size}; those that finished are kept) with: "
            f"{study_command(path, resume=True, **options)}")


def is_sqlite_store(section, tracking_uri: str | None) -> bool:
    """Whether a tracking section logs to a SQLite file (made on first use), as check_store finds it."""
    uri = tracking_uri or section.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    return section.enabled and sqlite_file(uri) is not None


def diverged_line(point, name: str, exc: NonFiniteError, partial: list[PointResult]) -> str:
    """What a point that diverged on one of its seeds says in place of its row."""
    finished = next((len(r.runs) for r in reversed(partial) if r.name == name), 0)
    return left_out_line(name, point.seeds[finished] if point.seeds else None, str(exc))


LARGE_STUDY = 100  # runs (sweep points x seeds, and the reference runs) a study starts without --yes


def check_size(points: list, references: list, dry_run: bool, yes: bool, plans: list | None = None) -> None:
    """A study larger than ``LARGE_STUDY`` runs is refused without ``--yes`` (a typo in a sweep
    axis multiplies it); a dry run of one says its size on stderr before it builds every point."""
    seeds = max(len(p.seeds or [0]) for p in points)
    runs = sum(len(p.seeds or [0]) for p in [*points, *(ref for _, ref in references)])
    trials = sum(p.point.resolved.spec.tune.trials * len(p.seeds) for p in plans or [])
    if runs + trials <= LARGE_STUDY:
        return
    size = (f"{len(points)} sweep point(s) x {seeds} seed(s)" + (f" and {len(references)} reference run(s)"
                                                                 if references else "")
            + (f" after {trials} tuning trial runs" if trials else "") + f": {runs + trials} runs")
    if dry_run:  # the size the real run is refused at, and what this dry run now spends its time on
        needs = "--yes is given" if yes else "the real run needs --yes"
        builds = len({build_key(point) for point in points})
        print(f"note: a dry run of {size}, more than {LARGE_STUDY}: {needs}; all {len(points)} points are checked, "
              f"building the data and models of their {builds} distinct setting(s)", file=sys.stderr)
    elif not yes:
        raise PflError(f"the spec is a study of {size}, more than {LARGE_STUDY}; run it with --yes, or narrow it "
                       f"with --set / --sweep (--dry-run checks it first)")
