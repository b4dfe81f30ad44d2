#!/usr/bin/env python
"""What tuning costs beyond the trials themselves, and what median pruning saves (a script, not a test).

1. Overhead. For each point of the spec, ``--trials`` trials run through the real tuning code
   (``pfl_core.study.tune.tune_point``: Optuna's sampler and SQLite storage, an MLflow parent
   run and a child run per trial in a SQLite store, and the median pruner's report and decision
   at every evaluation, its decision then ignored so that every trial does the same work as its
   bare twin), each trial timed from Optuna's
   start to its end. Right after each trial (an Optuna callback, outside the trial's time) the
   same configuration (the values it ran, on the same tuning seed, with the same cached data)
   runs as a bare ``Engine.run`` without tracking: a pair close in time, so a change in the
   machine's load hits both. Overhead = tuned trial time / the mean of the bare runs just
   before and after it - 1, as the median over the trials (``sandwiched``); and, robust to a
   machine's load, the share of each tuned trial spent outside its rounds' training and its
   evaluations (``Work``: everything tuning adds, and the run's own set-up). Target <= 3%.
2. Pruning. The point's tuning runs twice from the same seeded sampler, ``pruner = "none"`` and
   ``pruner = "median"``; printed: the tuning wall time of each, the saving, and the quality of
   what each chose (its best validation objective, and the test ``acc_mean`` of its best
   configuration on ``--final-seeds`` seeds). Target: a saving >= 30% at equal final quality.

    python benchmarks/tuning.py                                   # specs/quickstart_tuned.toml, its space, 20 trials
    python benchmarks/tuning.py --trials 8 --final-seeds 2        # quicker
    python benchmarks/tuning.py --spec SPEC --space training.lr=0.001:0.5:log

Each measurement runs in a fresh temporary folder (its own mlflow.db and optuna.db); one torch
thread. Exit status 0 whatever the figures. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_space(text: str) -> dict:
    """``training.lr=0.001:0.5:log`` -> {"training.lr": {"low": 0.001, "high": 0.5, "log": True}}."""
    key, _, rng = text.partition("=")
    low, high, *flags = rng.split(":")
    return {key: {"low": float(low), "high": float(high), "log": "log" in flags}}


def plans_for(spec_path: str, trials: int, pruner: str, space: dict | None, points_wanted: list[str] | None):
    from pfl_core.spec import load_toml
    from pfl_core.study.points import resolve_points, run_names
    from pfl_core.study.tune import plan_tuning

    raw = load_toml(spec_path)
    raw.setdefault("partition", {}).setdefault("val_fraction", 0.1)
    space = space or raw.get("tune", {}).get("space") or parse_space("training.lr=0.001:0.5:log")
    raw["tune"] = {**raw.get("tune", {}), "trials": trials, "pruner": pruner, "space": space}
    raw.setdefault("tracking", {})["progress"] = False
    points = resolve_points(raw, [])
    names = run_names(points)
    plans = plan_tuning(points, names)
    return [p for p in plans if not points_wanted or p.name in points_wanted]


class Work:
    """Seconds a tuned trial spends in its rounds' training and in evaluation (``Engine.run_round``
    and ``evaluate_clients``, timed where they are called): the rest of the trial is tuning's overhead."""

    def __init__(self):
        self.seconds, self.counting = 0.0, True

    def timing(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds += time.perf_counter() - started
        return timed


WORK = Work()


def timed_tuning(plan, folder: Path, cache, pairs: list | None = None, work: list | None = None):
    """Tune ``plan`` in ``folder`` (its own stores); returns (seconds, Tuned). ``pairs``: after
    each trial, its bare twin runs and (trial seconds by Optuna's stamps, bare seconds) is added;
    ``work``: each trial's seconds in training and evaluation (``WORK``)."""
    from pfl_core.study.tune import tune_point

    def twin(study, trial):
        trial_seconds = (trial.datetime_complete - trial.datetime_start).total_seconds()
        work.append(WORK.seconds)
        WORK.counting = False
        pairs.append((trial_seconds, bare_seconds(plan, trial.params, cache)))
        WORK.counting, WORK.seconds = True, 0.0

    os.chdir(folder)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    started = time.perf_counter()
    tuned = tune_point(plan, uri, True, False, cache, callbacks=[twin] if pairs is not None else None)
    return time.perf_counter() - started, tuned


class DecidingNeverPruning:
    """The median pruner's full decision at every report, then "go on": its cost is paid, the
    trial still does the same work as its bare twin."""

    def __init__(self):
        import optuna

        self.median = optuna.pruners.MedianPruner(n_startup_trials=0, n_warmup_steps=0)
        self.decision_seconds: list[float] = []
        self.report_seconds: list[float] = []

    def prune(self, study, trial) -> bool:
        started = time.perf_counter()
        self.median.prune(study, trial)
        self.decision_seconds.append(time.perf_counter() - started)
        return False

    def timing_reports(self, report):
        """``Trial.report`` (the intermediate value written to Optuna's storage), timed."""

        def timed(trial, value, step):
            started = time.perf_counter()
            report(trial, value, step)
            self.report_seconds.append(time.perf_counter() - started)

        return timed

    def summary(self, trials: int, trial_seconds: float) -> str:
        per_trial = (sum(self.decision_seconds) + sum(self.report_seconds)) / trials
        return (f"pruner: {len(self.decision_seconds)} decisions, report median "
                f"{statistics.median(self.report_seconds) * 1000:.1f} ms + decision median "
                f"{statistics.median(self.decision_seconds) * 1000:.1f} ms; {per_trial * 1000:.0f} ms a trial "
                f"= {per_trial / trial_seconds:.2%} of the median trial")


def sandwiched(pairs: list[tuple[float, float]]) -> list[float]:
    """Tuned trial k over the mean of the bare runs just before and just after it (the twins of
    trials k-1 and k): a bare run always right after its tuned twin would gain from anything
    the first of two runs leaves warm (allocator, caches), and that order would be counted
    against tuning. Trials differ only in their values, not in their work."""
    return [pairs[k][0] / ((pairs[k - 1][1] + pairs[k][1]) / 2) for k in range(1, len(pairs))]


def bare_seconds(plan, values: dict, cache) -> float:
    from pfl_core.engine import Engine
    from pfl_core.study.tune import trial_point

    resolved = trial_point(plan.point, values, plan.seeds[0])
    started = time.perf_counter()
    Engine(resolved, progress=False, data_cache=cache).run()  # no tracker: NullTracker
    return time.perf_counter() - started


def final_accuracy(point, seeds: list[int], cache) -> float:
    from pfl_core.engine import Engine

    accs = [Engine(point.for_seed(s), progress=False, data_cache=cache).run().final["acc_mean"] for s in seeds]
    return statistics.fmean(accs)


def startup(spec_path: str, repeats: int = 5) -> None:
    """What a trial pays before its first round, beside its rounds: the data (built once per
    point; then handed back unchanged, or deep-copied), and the process pool: ``repeats``-trial
    tunings of one round each on a 2-worker pool, trials sharing the pool (``REUSE_POOLS``)
    against each trial forking its own, alternated twice so that a change in load hits both."""
    from pfl_core.data.cache import DataCache
    from pfl_core.execution import process
    from pfl_core.spec import load_toml
    from pfl_core.study import tune
    from pfl_core.study.points import resolve_points

    raw = load_toml(spec_path)
    raw.pop("sweep", None)
    raw.setdefault("partition", {}).setdefault("val_fraction", 0.1)
    spec = resolve_points(raw, [])[0].resolved.spec
    cache = DataCache()
    started = time.perf_counter()
    cache.release(cache.get(spec))
    built = time.perf_counter() - started
    handed, copies = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        data = cache.get(spec)
        handed.append(time.perf_counter() - started)
        cache.get(spec)  # the first is still in use: a deep copy
        copies.append(time.perf_counter() - started - handed[-1])
        cache.release(data)
    raw.update(tune={"trials": repeats, "pruner": "none", "sampler": "random",
                     "space": {"training.lr": {"low": 0.001, "high": 0.1, "log": True}}},
               executor={"name": "process", "workers": 2}, tracking={"enabled": False})
    raw["experiment"]["rounds"] = 1
    raw["experiment"].pop("seeds", None)
    forks = []
    new_pool = process.ProcessExecutor._new_pool

    def counting(self, fn=None, runtime=None):
        forks.append(runtime is not None)
        return new_pool(self, fn=fn, runtime=runtime)

    process.ProcessExecutor._new_pool = counting
    per_trial: dict[bool, list[float]] = {True: [], False: []}
    here = Path.cwd()
    for reuse in (False, True, False, True):
        tune.REUSE_POOLS = reuse
        (plan,) = tune.plan_tuning(resolve_points(raw, []), ["point"])
        forks.clear()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            finished: list = []  # the Optuna study, from its callback
            tune.tune_point(plan, None, True, False, cache, callbacks=[lambda study, trial: finished.append(study)])
            os.chdir(here)
        trials = finished[-1].trials
        per_trial[reuse] += [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials[1:]]
        print(f"  {'shared pool' if reuse else 'own pools  '}: {len(trials)} one-round trials, "
              f"{sum(forks)} pools forked")
    process.ProcessExecutor._new_pool = new_pool
    shared, own = statistics.median(per_trial[True]), statistics.median(per_trial[False])
    print(f"{spec_path}: {spec.partition.num_clients} clients; data built once {built:.2f} s; per trial: "
          f"data handed back unchanged median {statistics.median(handed) * 1000:.1f} ms, a deep copy "
          f"{statistics.median(copies):.3f} s; one-round trial (2-worker pool) median {own:.3f} s forking its "
          f"own pool, {shared:.3f} s sharing one: {own - shared:+.3f} s a trial (first trial of each tuning "
          f"left out; {repeats} trials x 2 tunings each)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quickstart_tuned.toml"))
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--space", default=None, help="KEY=LOW:HIGH[:log] (default: the spec's tune.space, "
                        "else training.lr=0.001:0.5:log)")
    parser.add_argument("--points", nargs="*", default=None, help="only these points (run names)")
    parser.add_argument("--final-seeds", type=int, default=5)
    parser.add_argument("--skip", choices=["overhead", "pruning"], default=None)
    parser.add_argument("--startup-only", action="store_true",
                        help="only measure what a trial pays before its rounds: the data handed back or copied, "
                             "the process pool shared or forked (use with a big --spec, e.g. a 100-client "
                             "CIFAR-10 one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from pfl_core.data.cache import DataCache

    space = parse_space(args.space) if args.space else None
    here = Path.cwd()
    if args.startup_only:
        startup(args.spec)
        return 0
    print(f"spec {args.spec}, {args.trials} trials per point, space {space or 'as the spec declares'}")
    if args.skip != "overhead":
        print("\n== overhead: a tuned trial (Optuna + MLflow + the median pruner's decisions) against the same "
              "run bare ==")
        import optuna

        from pfl_core.study import tune

        from pfl_core.engine import engine as engine_module

        engine_module.Engine.run_round = WORK.timing(engine_module.Engine.run_round)
        engine_module.evaluate_clients = WORK.timing(engine_module.evaluate_clients)
        ratios_all, outside_all = [], []
        for plan in plans_for(args.spec, args.trials, "median", space, args.points):
            cache = DataCache()
            pairs: list = []
            pruner = DecidingNeverPruning()
            real_pruner, tune._pruner = tune._pruner, lambda _tune: pruner
            real_report = optuna.trial.Trial.report
            optuna.trial.Trial.report = pruner.timing_reports(real_report)
            work: list = []
            with tempfile.TemporaryDirectory() as tmp:
                timed_tuning(plan, Path(tmp), cache, pairs, work)
                os.chdir(here)
            tune._pruner, optuna.trial.Trial.report = real_pruner, real_report
            outside = [1 - w / t for (t, _), w in zip(pairs, work)]
            outside_all += outside
            ratios = sandwiched(pairs)
            ratios_all += ratios
            print(f"{plan.name:>12}: median trial {statistics.median(s for s, _ in pairs):.3f} s, "
                  f"overhead median {statistics.median(ratios) - 1:+.1%} "
                  f"(min {min(ratios) - 1:+.1%}, max {max(ratios) - 1:+.1%}); tuned-then-bare pairs alone: "
                  f"{statistics.median(t / b for t, b in pairs) - 1:+.1%}\n{'':>14}{pruner.summary(len(pairs), statistics.median(s for s, _ in pairs))}"
                  f"\n{'':>14}outside training and evaluation: median {statistics.median(outside):.2%} of a trial "
                  f"(min {min(outside):.2%}, max {max(outside):.2%})")
        print(f"all points: overhead median {statistics.median(ratios_all) - 1:+.1%} against the bare twins; "
              f"outside training and evaluation median {statistics.median(outside_all):.2%} of a trial (target <= 3%)")
    if args.skip != "pruning":
        print("\n== pruning: the same seeded tuning without and with the median pruner ==")
        seeds = list(range(args.final_seeds))
        total = {"none": 0.0, "median": 0.0}
        for plan_none, plan_median in zip(plans_for(args.spec, args.trials, "none", space, args.points),
                                          plans_for(args.spec, args.trials, "median", space, args.points)):
            cache = DataCache()
            row = []
            for label, plan in (("none", plan_none), ("median", plan_median)):
                with tempfile.TemporaryDirectory() as tmp:
                    seconds, tuned = timed_tuning(plan, Path(tmp), cache)
                    os.chdir(here)
                total[label] += seconds
                acc = final_accuracy(tuned.point, seeds, cache)
                row.append(f"{label}: {seconds:6.1f} s, {tuned.pruned:2d} pruned, best objective "
                           f"{tuned.objective:.4f}, test acc_mean {acc:.4f} on {len(seeds)} seeds")
            print(f"{plan_none.name:>12}: " + " | ".join(row))
        saving = 1 - total["median"] / total["none"] if total["none"] else float("nan")
        print(f"all points: tuning {total['none']:.1f} s without pruning, {total['median']:.1f} s with: "
              f"saving {saving:.0%} (target >= 30% at equal final quality)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
