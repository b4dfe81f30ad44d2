"""Tuning each point of a study by Optuna (``[tune]``), so every method is compared at the
hyperparameters its own search found, with the same number of trials.

For each point (a method, with the sweep's other settings):

1. its search space: ``tune.space`` (keys every point has) and ``tune.method.<algorithm>``
   (that method's own keys), each a dotted spec key with ``{ low, high [, log, step] }`` or
   ``{ choices = [...] }``; every bound and choice is resolved against the point's spec before
   any data loads, so a key the method does not have is one line naming it;
2. ``tune.trials`` trials: the values come from a seeded design shared by every method
   (``tune.sampler = "shared"``, the default; below) or from Optuna's sampler (TPE, random or
   grid, seeded by ``experiment.seed``); the point runs with them on the tuning seeds, and the
   objective is ``tune.metric`` (a validation metric: the test split is never looked at) at the
   last evaluation or its best round, averaged over the tuning seeds; the median pruner stops a
   trial whose validation metric at an evaluation round is below the median of earlier trials at
   that round (the trial's run ends KILLED, tagged ``pruned``);
3. its best configuration, written as a spec (``tuned_spec.toml``: the point with the chosen
   values and without ``[tune]``), runs on ``experiment.seeds`` as any point does.

The shared design (``tune.sampler = "shared"``) makes the search equal in fact, not only in its
number of trials: the keys of ``tune.space`` take the values of one scrambled Sobol design of
``tune.trials`` points (:class:`scipy.stats.qmc.Sobol`, seeded by ``experiment.seed``), the same
values in the same order for every point of the sweep; a method's own keys
(``tune.method.<algorithm>``) take the further dimensions of a Sobol design of as many points,
paired with the shared one trial by trial, so its knobs are crossed with the shared values inside
the same budget (the two together are one Sobol design of all the keys: a scrambling per
dimension keeps its balance). Each point of the unit cube maps to a key's range uniformly, or
log-uniformly with ``log``, onto the values of its ``step``, or onto its ``choices`` by index.
The trials reach Optuna as enqueued trials (``study.enqueue_trial``), so its storage, pruner,
resume and the MLflow runs are those of any sampler; a resumed tuning enqueues only the design
points not yet run. Sobol points are balanced in blocks of powers of two: a power of two of
``tune.trials`` is best (scipy's warning about other counts is silenced; their points are still
the first points of the same sequence). TPE is not the default: with fewer trials than its 10
seeded start-up trials it is random search, and a method with a key of its own draws another
sequence of learning rates than a method tuned over the learning rate alone, so one method could
win by searching where its competitors never did. After tuning, a best value that is the smallest
or largest value tried for a range's key is a warning line and a tag ``pfl.tune.edge.<key>`` on
the tuning's parent run: the range should be widened.

The tuning seeds (``tune.seeds``) default to one seed above every seed of ``experiment.seeds``:
with distinct seeds the partition and the initialisation differ, so the configuration chosen is
not fitted to the noise of the runs that then report it. Trials share their data and their
worker pool: the partition is built once per seed and handed from trial to trial, copied again
only when a trial changed it (:class:`~pfl_core.data.cache.DataCache`), and a process pool
serves the next trial while that trial's data is the one its workers forked with
(:class:`~pfl_core.execution.planner.ExecutorCache`).

MLflow: a parent run ``<point> (tuning)`` per point with one child run per trial (its params,
``tune_objective``, tag ``pfl.tune.state`` = complete or pruned); the parent holds
``best.<key>`` params, ``best_objective`` and ``tuned_spec.toml``. Optuna's study storage is
``optuna.db`` beside the MLflow store (the working directory without tracking). A killed tuning
continues with ``pfl-run SPEC --resume``: the finished trials are kept (never run again), the
interrupted one is marked failed and replaced; the final runs that finished are kept
(:mod:`pfl_core.study.reuse`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import threading
from typing import Any

import attrs

from pfl_core import registry
from pfl_core.data.cache import DataCache
from pfl_core.engine import Engine, resolve
from pfl_core.errors import NonFiniteError, PflError, SpecError, Stopped
from pfl_core.execution.planner import ExecutorCache
from pfl_core.spec import dump_toml, set_dotted, shown
from pfl_core.state.locations import beside_store, sqlite_uri
from pfl_core.study.points import Point
from pfl_core.study.space import EDGE_TAG, EXAMPLE, Dimension, edges, parse_space, sobol_design, tuning_header
from pfl_core.tracking.terminal import warning_line
from pfl_core.tracking.tracker import flatten, make_tracker, run_status

STORAGE_FILE = "optuna.db"
DESIGN_POINT = "pfl.design_point"  # user attribute of an enqueued trial: its row of the shared design
PRUNER_STARTUP_TRIALS = 5  # trials that run whole before the median pruner stops any
# A trial's metrics reach MLflow in one write at most this often (a write per round cost a short
# trial a tenth of its time); a trial has no checkpoint a kill could leave ahead of them.
TRIAL_METRICS_EVERY_S = 10.0
DIVERGED = "pfl.diverged"  # user attribute of a trial whose training diverged (its message)
REUSE_POOLS = True  # a process pool kept from trial to trial (False: each trial forks its own; tests compare)


@attrs.define
class TuningPlan:
    """A point to tune: its space, its tuning seeds, and its name in Optuna's storage."""

    point: Point
    name: str
    space: list[Dimension]
    seeds: list[int]
    ran: int | None = None  # trials that ran to the end or were pruned, once tuned
    edges: dict[str, str] = attrs.field(factory=dict)  # once tuned: Tuned.edges
    shared: int = 0  # the first ``shared`` dimensions of ``space`` are tune.space's (every point's)


def plan_tuning(points: list[Point], names: list[str], notes: list[str] | None = None) -> list[TuningPlan] | None:
    """Each point's tuning, checked before any data loads (None: the spec has no ``[tune]``).
    A ``tune.method`` entry for an installed method no point runs (``--no-sweep``, ``--set
    algorithm.name=...``) is a note; one for a name no plugin has is an error (a typo)."""
    tune = points[0].resolved.spec.tune
    if tune is None:
        return None
    shared = parse_space(tune.space, "tune.space")
    algorithms = [p.resolved.spec.algorithm.name for p in points]
    for name in tune.method:
        registry.resolve(registry.ALGORITHM, name, f"tune.method.{name}")
        if not isinstance(tune.method[name], dict):
            raise SpecError(f"tune.method.{name}", f"expected a table of dotted.key = {EXAMPLE}")
        if name not in algorithms and notes is not None:
            notes.append(f"tune.method.{name}: no point of this run uses {name!r} (its methods: "
                         f"{', '.join(dict.fromkeys(algorithms))}); its space is not used")
    plans = []
    for point, name in zip(points, names):
        algorithm = point.resolved.spec.algorithm.name
        space = shared + parse_space(tune.method.get(algorithm, {}), f"tune.method.{algorithm}")
        if not space:
            raise SpecError("tune.space", f"no key to tune for {name!r}: give tune.space (every method) or "
                                          f"tune.method.{algorithm} (its own keys)")
        keys = [d.key for d in space]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise SpecError(f"tune.method.{algorithm}.{twice[0]}", "is in tune.space too; give each key once")
        for dim in space:
            if dim.key in point.settings or dim.key.startswith(("tune.", "sweep", "experiment.seed")):
                raise SpecError(dim.path, "is swept or is part of the study's design; tune it or sweep it, not both")
            for value in dim.corners():
                try:
                    trial_point(point, {dim.key: value}, None)
                except SpecError as exc:
                    raise SpecError(dim.path, f"{exc.message} (as {exc.path} = {shown(value)} for {name!r})") from None
        if tune.sampler == "grid" and any(d.choices is None for d in space):
            bad = next(d for d in space if d.choices is None)
            raise SpecError("tune.sampler", f"'grid' needs choices for every key; {bad.path} is a range")
        plans.append(TuningPlan(point, name, space, tuning_seeds(point), shared=len(shared)))
    return plans


def tuning_seeds(point: Point) -> list[int]:
    """``tune.seeds``, or one seed above every seed the final runs use."""
    spec = point.resolved.spec
    if spec.tune.seeds is not None:
        return list(spec.tune.seeds)
    return [max(spec.experiment.seeds or [spec.experiment.seed]) + 1]


def trial_point(point: Point, values: dict[str, Any], seed: int | None, tags: dict[str, str] | None = None):
    """The point's spec with ``values`` set, validation on and ``[tune]`` gone; ``seed``: one
    run on that seed (else the point's own seeds). Returns its Resolved. Its validation split
    comes from the tuning pool alone (``partition.tuning_trial``), which no final run's test
    split draws from (:func:`tuned_raw`)."""
    raw = tuned_raw(point, values)
    raw.setdefault("evaluation", {})["validation"] = True
    raw["partition"]["tuning_trial"] = True
    if seed is not None:  # a trial: a killed tuning runs it again from the start, never resumes it
        raw.setdefault("checkpoint", {})["enabled"] = False
    if seed is not None:
        experiment = raw.setdefault("experiment", {})
        experiment["seed"] = seed
        experiment.pop("seeds", None)
    if tags:
        tracking = raw.setdefault("tracking", {})
        tracking["tags"] = {**tracking.get("tags", {}), **tags}
    return resolve(raw)


def tuned_raw(point: Point, values: dict[str, Any]) -> dict:
    """The point's raw spec with ``values`` set and no ``[tune]`` table: it runs the point alone.
    It keeps the point's ``partition.tuning_pool`` (which ``[tune]`` set), so its test splits stay
    outside the pool the trials validated on, in ``tuned_spec.toml`` too."""
    raw = copy.deepcopy(point.raw)
    raw.pop("tune", None)
    if point.resolved.spec.partition.tuning_pool is not None:
        raw.setdefault("partition", {})["tuning_pool"] = point.resolved.spec.partition.tuning_pool
    for key, value in values.items():
        set_dotted(raw, key, value)
    return raw


def design(plan: TuningPlan, trials: int, seed: int) -> list[dict[str, Any]]:
    """The shared design's ``trials`` points for ``plan``, as each trial's values
    (:func:`~pfl_core.study.space.sobol_design`)."""
    return sobol_design(plan.space, plan.shared, trials, seed)


def _enqueue_design(study, plan: TuningPlan, trials: int, seed: int, done: list) -> None:
    """Queue the design points no finished trial ran and none is queued for; a queued point a
    lowered ``tune.trials`` no longer has is failed, never run."""
    import optuna

    ran = {t.user_attrs.get(DESIGN_POINT) for t in done}
    waiting = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
    queued = set()
    for trial in waiting:
        if trial.user_attrs.get(DESIGN_POINT, trials) >= trials or trial.user_attrs[DESIGN_POINT] in queued:
            study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
        else:
            queued.add(trial.user_attrs[DESIGN_POINT])
    for index, values in enumerate(design(plan, trials, seed)):
        if index not in ran and index not in queued:
            study.enqueue_trial(values, user_attrs={DESIGN_POINT: index})


def storage_url(point: Point, tracking_uri: str | None) -> str:
    """Optuna's storage: ``optuna.db`` beside the MLflow store (or here without tracking)."""
    tracking = point.resolved.spec.tracking
    folder = beside_store((tracking_uri or tracking.uri or None) if tracking.enabled else None)
    return sqlite_uri((folder / STORAGE_FILE).resolve())


def study_name(plan: TuningPlan) -> str:
    """The point's name in the storage, with a digest of what it tunes (the spec but the number
    of trials, where results go, and how they are shown): a changed spec is another study."""
    raw = {k: v for k, v in plan.point.raw.items() if k not in ("tracking", "checkpoint", "report")}
    raw["tune"] = {k: v for k, v in raw.get("tune", {}).items() if k not in ("trials", "parallel")}
    # the sampler in effect: a spec that left it to the default names another study when the default changes
    raw["tune"]["sampler"] = plan.point.resolved.spec.tune.sampler
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=repr).encode()).hexdigest()[:12]
    spec = plan.point.resolved.spec
    return f"{spec.tracking_experiment}/{plan.name}/{digest}"


class Pruned(Stopped):
    """The median pruner stopped this trial (raised inside the trial's run, turned into
    Optuna's TrialPruned by the objective)."""


@attrs.define
class Tuned:
    """What tuning a point found."""

    point: Point  # the point at its best configuration (without [tune])
    values: dict[str, Any]
    objective: float
    complete: int
    pruned: int
    diverged: int = 0  # trials whose training diverged (failed trials, counted in the budget)
    edges: dict[str, str] = attrs.field(factory=dict)  # key -> why its best value is on the edge of those tried

    @property
    def ran(self) -> int:
        return self.complete + self.pruned + self.diverged


def tune_point(plan: TuningPlan, tracking_uri: str | None, quiet: bool, resume: bool, data_cache: DataCache,
               counter=None, callbacks: list | None = None) -> Tuned:
    """Run the point's trials (those a killed tuning did not finish, with ``resume``) and return
    its best configuration. ``callbacks``: Optuna's, called after each trial (benchmarks)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed (diverged) trial: our own line says it
    spec = plan.point.resolved.spec
    tune = spec.tune
    storage = optuna.storages.RDBStorage(storage_url(plan.point, tracking_uri))
    study = optuna.create_study(storage=storage, study_name=_study_name(storage, study_name(plan), resume),
                                sampler=_sampler(tune, spec.experiment.seed, plan.space),
                                pruner=_pruner(tune), direction=tune.direction, load_if_exists=True)
    _fail_abandoned(study)
    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
            or DIVERGED in t.user_attrs]
    if tune.sampler == "shared":
        _enqueue_design(study, plan, tune.trials, spec.experiment.seed, done)
        study._pop_waiting_trial_id = _one_at_a_time(study._pop_waiting_trial_id)
    parent = make_tracker(spec.tracking, tracking_uri)
    parent.start(spec.tracking_experiment, f"{plan.name} (tuning)",
                 {**flatten(plan.point.resolved.as_dict), "tune.seeds": json.dumps(plan.seeds)},
                 {"algorithm": spec.algorithm.name, "pfl.tune.study": study.study_name, **spec.tracking.tags})
    status = "FAILED"
    # trials one after another share a process pool (forked again only when a trial changed
    # its data); parallel trials each fork their own
    executors = ExecutorCache() if REUSE_POOLS and tune.parallel == 1 else None
    try:
        objective = functools.partial(_objective, plan=plan, tracking_uri=tracking_uri, quiet=quiet,
                                      data_cache=data_cache, counter=counter, parent_run_id=parent.run_id,
                                      executors=executors)
        # a grid smaller than tune.trials ends early: Optuna's GridSampler stops when it is done
        study.optimize(objective, n_trials=max(tune.trials - len(done), 0), n_jobs=tune.parallel, catch=(),
                       callbacks=callbacks)
        tuned = _best(study, plan)
        plan.ran, plan.edges = tuned.ran, tuned.edges
        parent.log_metrics({"best_objective": tuned.objective, "trials_complete": float(tuned.complete),
                            "trials_pruned": float(tuned.pruned), "trials_diverged": float(tuned.diverged)}, step=0)
        for key, value in tuned.values.items():
            parent.log_param(f"best.{key}", value)
        for key, text in tuned.edges.items():
            warning_line(f"{plan.name}: {text}")
            parent.set_tag(EDGE_TAG + key, text)
        parent.log_text(tuned_spec_toml(tuned), "tuned_spec.toml")
        status = "FINISHED"
        return tuned
    except BaseException as exc:
        status = run_status(exc)
        raise
    finally:
        if executors is not None:
            executors.close()
        parent.end(status)


def _objective(trial, plan: TuningPlan, tracking_uri, quiet: bool, data_cache: DataCache, counter,
               parent_run_id: str | None, executors: ExecutorCache | None = None) -> float:
    import optuna

    spec = plan.point.resolved.spec
    tune = spec.tune
    values = {dim.key: dim.suggest(trial) for dim in plan.space}
    scores = []
    for i, seed in enumerate(plan.seeds):
        label = f"{plan.name} trial {trial.number}" + (f" seed={seed}" if len(plan.seeds) > 1 else "")
        resolved = trial_point(plan.point, values, seed, {"pfl.tune.trial": str(trial.number)})
        tracker = make_tracker(spec.tracking, tracking_uri)
        tracker.parent_run_id = parent_run_id
        if hasattr(tracker, "metrics_every_seconds"):
            tracker.metrics_every_seconds = TRIAL_METRICS_EVERY_S

        evaluated: list[dict] = []

        def report(round: int, metrics: dict, first_step=i * spec.experiment.rounds, tracker=tracker) -> None:
            evaluated.append(metrics)
            if tune.pruner != "none" and tune.metric in metrics and not math.isnan(metrics[tune.metric]):
                trial.report(metrics[tune.metric], first_step + round)
                if trial.should_prune():
                    tracker.set_tag("pfl.tune.state", "pruned")  # its run is still the active one
                    raise Pruned(f"trial {trial.number} pruned at round {round}")
            if round == spec.experiment.rounds:  # always evaluated; logged now, it goes with the held metrics
                score = objective_value(evaluated, tune.metric, tune.objective, tune.direction)
                tracker.log_metrics_to(tracker.run_id, {"tune_objective": score})
                tracker.set_tag("pfl.tune.state", "complete")

        try:
            run = Engine(resolved, tracker=tracker, progress=not quiet, run_name=label,
                         progress_label=counter.label(label) if counter else label,
                         on_evaluated=report, data_cache=data_cache, artifacts=False,
                         executor_cache=executors).run()
        except Pruned:
            raise optuna.TrialPruned() from None
        except NonFiniteError as exc:  # a result of the search, not an error of the study: the next trial runs
            trial.set_user_attr(DIVERGED, str(exc))  # its run ended FAILED, tagged pfl.diverged by the engine
            warning_line(f"{label}: {exc}; a failed trial, counted in tune.trials")
            return float("nan")  # Optuna marks the trial failed; its sampler never picks it as the best
        scores.append(objective_value(run.history, tune.metric, tune.objective, tune.direction))
    return float(sum(scores) / len(scores))


def objective_value(history: list[dict], metric: str, objective: str, direction: str) -> float:
    """The metric at the last evaluation, or at its best evaluation round."""
    values = [row[metric] for row in history if metric in row]
    if not values:
        raise PflError(f"tune.metric: the runs log no {metric!r} (evaluation.validation is on for trials; "
                       f"is it a metric this method reports, e.g. val_acc_mean?)")
    if objective == "final":
        return float(values[-1])
    return float(max(values) if direction == "maximize" else min(values))


def _one_at_a_time(pop):
    """Optuna's taking of a queued trial, one thread at a time: two parallel trials on SQLite
    (no row locks) could otherwise both take the same design point."""
    lock = threading.Lock()

    def locked():
        with lock:
            return pop()
    return locked


def _study_name(storage, base: str, resume: bool) -> str:
    """``base`` the first time; then ``base#2``, ``#3`` ... for a fresh tuning of the same spec,
    or the newest one again with ``resume``."""
    import optuna

    taken = {s.study_name for s in optuna.study.get_all_study_summaries(storage)}
    numbered = [1] if base in taken else []
    numbered += [int(n.rpartition("#")[2]) for n in taken if n.startswith(f"{base}#") and n.rpartition("#")[2].isdigit()]
    if resume and numbered:
        newest = max(numbered)
        return base if newest == 1 else f"{base}#{newest}"
    if not numbered:
        return base
    return f"{base}#{max(numbered) + 1}"


def _fail_abandoned(study) -> None:
    """Trials left RUNNING by a killed tuning are marked FAIL (Optuna then runs new ones)."""
    import optuna

    for trial in study.trials:
        if trial.state == optuna.trial.TrialState.RUNNING:
            study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)


def _sampler(tune, seed: int, space: list[Dimension]):
    import optuna

    if tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if tune.sampler == "grid":
        return optuna.samplers.GridSampler({d.key: list(d.choices) for d in space}, seed=seed)
    if tune.sampler == "shared":  # every trial is an enqueued design point: the sampler proposes nothing
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(tune):
    import optuna

    if tune.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=0)


def _best(study, plan: TuningPlan) -> Tuned:
    import optuna

    states = [t.state for t in study.trials]
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    pruned = states.count(optuna.trial.TrialState.PRUNED)
    diverged = sum(DIVERGED in t.user_attrs for t in study.trials)
    if not complete:
        raise PflError(f"tune: no trial of {plan.name!r} ran to the end ({pruned} pruned, {diverged} diverged); give "
                       f"more tune.trials, tune.pruner = \"none\" or a space whose values train")
    best = study.best_trial
    values = {dim.key: best.params[dim.key] for dim in plan.space}
    raw = tuned_raw(plan.point, values)
    point = Point(plan.point.settings, resolve(raw), raw, plan.point.base)
    ran = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
           or DIVERGED in t.user_attrs]
    return Tuned(point, values, float(best.value), complete, pruned, diverged, edges(ran, plan.space, values))




def tuned_spec_toml(tuned: Tuned) -> str:
    """The spec that reproduces the point's final runs alone (its best values, no [tune])."""
    return dump_toml(tuned.point.raw)


def values_text(values: dict[str, Any]) -> str:
    """``training.lr=0.05, algorithm.params.mu=0.1``"""
    return ", ".join(f"{key}={shown(value)}" for key, value in values.items())


def describe(plans: list[TuningPlan]) -> str:
    """``tuned: 20 trials each on val_acc_mean (final), seeds [5]`` for the table's header."""
    tune = plans[0].point.resolved.spec.tune
    return tuning_header({p.name: tune.trials if p.ran is None else p.ran for p in plans}, tune.metric,
                         tune.objective, tune.sampler, str(plans[0].seeds),
                         [f"{p.name} {text}" for p in plans for _, text in sorted(p.edges.items())])
