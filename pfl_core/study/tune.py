"""Tuning each point of a study by Optuna (``[tune]``), so every method is compared at the
hyperparameters its own search found, with the same number of trials.

For each point (a method, with the sweep's other settings):

1. its search space: ``tune.space`` (keys every point has) and ``tune.method.<algorithm>``
   (that method's own keys), each a dotted spec key with ``{ low, high [, log, step] }`` or
   ``{ choices = [...] }``; every bound and choice is resolved against the point's spec before
   any data loads, so a key the method does not have is one line naming it;
2. ``tune.trials`` trials: Optuna's sampler (TPE, random or grid, seeded by
   ``experiment.seed``) proposes values, the point runs with them on the tuning seeds, and the
   objective is ``tune.metric`` (a validation metric: the test split is never looked at) at the
   last evaluation or its best round, averaged over the tuning seeds; the median pruner stops a
   trial whose validation metric at an evaluation round is below the median of earlier trials at
   that round (the trial's run ends KILLED, tagged ``pruned``);
3. its best configuration, written as a spec (``tuned_spec.toml``: the point with the chosen
   values and without ``[tune]``), runs on ``experiment.seeds`` as any point does.

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
from pfl_core.tracking.terminal import warning_line
from pfl_core.tracking.tracker import flatten, make_tracker, run_status

STORAGE_FILE = "optuna.db"
PRUNER_STARTUP_TRIALS = 5  # trials that run whole before the median pruner stops any
# A trial's metrics reach MLflow in one write at most this often (a write per round cost a short
# trial a tenth of its time); a trial has no checkpoint a kill could leave ahead of them.
TRIAL_METRICS_EVERY_S = 10.0
DIVERGED = "pfl.diverged"  # user attribute of a trial whose training diverged (its message)
REUSE_POOLS = True  # a process pool kept from trial to trial (False: each trial forks its own; tests compare)


@attrs.frozen
class Dimension:
    """One key of a search space and where in ``[tune]`` it was given."""

    key: str
    path: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple | None = None

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        if _is_int(self.low) and _is_int(self.high) and (self.step is None or _is_int(self.step)):
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def corners(self) -> list:
        """The values that must all be valid for the key: every choice, or both bounds."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


RANGE_KEYS = {"low", "high", "log", "step"}
EXAMPLE = '{ low = 0.001, high = 0.3, log = true } or { choices = [0.01, 0.1] }'


def parse_dimension(key: str, entry: Any, path: str) -> Dimension:
    """One entry of a space, checked: a range of numbers or a list of choices of one type."""
    if not isinstance(entry, dict) or not entry:
        raise SpecError(path, f"expected a table, {EXAMPLE}; got {shown(entry)}")
    if "choices" in entry:
        extra = sorted(set(entry) - {"choices"})
        if extra:
            raise SpecError(path, f"give choices alone, or a range (low, high, log, step); not both ({', '.join(extra)})")
        choices = entry["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpecError(f"{path}.choices", f"expected a non-empty list of values, got {shown(choices)}")
        kinds = {type(c).__name__ for c in choices}
        if len(kinds) > 1:
            raise SpecError(f"{path}.choices", f"mixes types ({', '.join(sorted(kinds))}); give values of one type "
                                               f"(write 1.0, not 1, among floats)")
        if any(isinstance(c, (dict, list)) for c in choices):
            raise SpecError(f"{path}.choices", "expected plain values (numbers, strings, booleans)")
        if len(set(map(repr, choices))) < len(choices):
            raise SpecError(f"{path}.choices", "lists a value more than once")
        return Dimension(key, path, choices=tuple(choices))
    unknown = sorted(set(entry) - RANGE_KEYS)
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", f"unknown key; a range takes low, high, log and step, e.g. {EXAMPLE}")
    for bound in ("low", "high"):
        if bound not in entry:
            raise SpecError(f"{path}.{bound}", "required key is missing (a range needs low and high)")
        value = entry[bound]
        if not _is_number(value) or not math.isfinite(value):
            raise SpecError(f"{path}.{bound}", f"expected a finite number, got {shown(value)}")
    low, high, log, step = entry["low"], entry["high"], entry.get("log", False), entry.get("step")
    if not isinstance(log, bool):
        raise SpecError(f"{path}.log", f"expected true or false, got {shown(log)}")
    if not low < high:
        raise SpecError(path, f"empty range: low {shown(low)} is not below high {shown(high)}")
    if log and low <= 0:
        raise SpecError(f"{path}.low", f"is {shown(low)}, but a log range needs low > 0")
    if step is not None:
        if not _is_number(step) or not math.isfinite(step) or step <= 0:
            raise SpecError(f"{path}.step", f"expected a number > 0, got {shown(step)}")
        if log:
            raise SpecError(f"{path}.step", "a log range takes no step (Optuna samples it continuously)")
    return Dimension(key, path, low=low, high=high, log=log, step=step)


def parse_space(table: dict, where: str) -> list[Dimension]:
    return [parse_dimension(key, entry, f"{where}.{key}") for key, entry in table.items()]


@attrs.define
class TuningPlan:
    """A point to tune: its space, its tuning seeds, and its name in Optuna's storage."""

    point: Point
    name: str
    space: list[Dimension]
    seeds: list[int]
    ran: int | None = None  # trials that ran to the end or were pruned, once tuned


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
        plans.append(TuningPlan(point, name, space, tuning_seeds(point)))
    return plans


def tuning_seeds(point: Point) -> list[int]:
    """``tune.seeds``, or one seed above every seed the final runs use."""
    spec = point.resolved.spec
    if spec.tune.seeds is not None:
        return list(spec.tune.seeds)
    return [max(spec.experiment.seeds or [spec.experiment.seed]) + 1]


def trial_point(point: Point, values: dict[str, Any], seed: int | None, tags: dict[str, str] | None = None):
    """The point's spec with ``values`` set, validation on and ``[tune]`` gone; ``seed``: one
    run on that seed (else the point's own seeds). Returns its Resolved."""
    raw = tuned_raw(point, values)
    raw.setdefault("evaluation", {})["validation"] = True
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
    """The point's raw spec with ``values`` set and no ``[tune]`` table: it runs the point alone."""
    raw = copy.deepcopy(point.raw)
    raw.pop("tune", None)
    for key, value in values.items():
        set_dotted(raw, key, value)
    return raw


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
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=repr).encode()).hexdigest()[:12]
    spec = plan.point.resolved.spec
    return f"{spec.tracking.experiment or spec.experiment.name}/{plan.name}/{digest}"


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
    parent = make_tracker(spec.tracking, tracking_uri)
    parent.start(spec.tracking.experiment or spec.experiment.name, f"{plan.name} (tuning)",
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
        plan.ran = tuned.ran
        parent.log_metrics({"best_objective": tuned.objective, "trials_complete": float(tuned.complete),
                            "trials_pruned": float(tuned.pruned), "trials_diverged": float(tuned.diverged)}, step=0)
        for key, value in tuned.values.items():
            parent.log_param(f"best.{key}", value)
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
    return Tuned(point, values, float(best.value), complete, pruned, diverged)


def tuned_spec_toml(tuned: Tuned) -> str:
    """The spec that reproduces the point's final runs alone (its best values, no [tune])."""
    return dump_toml(tuned.point.raw)


def values_text(values: dict[str, Any]) -> str:
    """``training.lr=0.05, algorithm.params.mu=0.1``"""
    return ", ".join(f"{key}={shown(value)}" for key, value in values.items())


def describe(plans: list[TuningPlan]) -> str:
    """``tuned: 20 trials each on val_acc_mean (final), seeds [5]`` for the table's header."""
    tune = plans[0].point.resolved.spec.tune
    counts = [tune.trials if p.ran is None else p.ran for p in plans]
    trials = (f"{counts[0]} trials each" if len(set(counts)) == 1 else
              "trials: " + ", ".join(f"{p.name} {n}" for p, n in zip(plans, counts)))
    return f"tuned: {trials} on {tune.metric} ({tune.objective}), {tune.sampler} sampler, tuning seeds {plans[0].seeds}"
