"""``[tune]``: every point tuned by Optuna with the same number of trials on the validation split,
then run at its best configuration; bad input is one line before any data loads; a killed
tuning resumes without repeating a finished trial."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import optuna
import pytest
import tomllib
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.data.cache import DataCache
from pfl_core.engine import Engine, resolve
from pfl_core.study import run_spec_file


def tune_raw(trials=4, space=None, method=None, sweep=("fedavg", "fedprox"), **overrides):
    """The tiny spec with [tune] (``tune.*`` overrides go into it) and a sweep of methods."""
    raw = tiny_raw(**{"experiment.rounds": 3, "experiment.seeds": [0, 1],
                      **{k: v for k, v in overrides.items() if not k.startswith("tune.")}})
    raw["tune"] = {"trials": trials, "space": space if space is not None else
                   {"training.lr": {"low": 0.001, "high": 0.5, "log": True}}}
    if method is not None:
        raw["tune"]["method"] = method
    for key, value in overrides.items():
        if key.startswith("tune."):
            raw["tune"][key.removeprefix("tune.")] = value
    if sweep:
        raw["sweep"] = {"algorithm.name": list(sweep)}
    return raw


def runs_of(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def trials_of(storage: Path) -> dict[str, list]:
    url = f"sqlite:///{storage}"
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=url).trials
            for s in optuna.study.get_all_study_summaries(url)}


# -- bad input: one line naming the key, before any data loads ---------------------------------

MISSING_DATA = {"data.name": "npz", "data.params": {"path": "/nonexistent/never.npz"}}


@pytest.mark.parametrize("change, key, words", [
    ({"tune.space": {"training.lrr": {"low": 0.1, "high": 0.2}}}, "tune.space.training.lrr", "unknown key"),
    ({"tune.space": {"training.optimizer": {"low": 0.1, "high": 0.2}}}, "tune.space.training.optimizer", "string"),
    ({"tune.space": {"training.lr": {"low": 0.3, "high": 0.1}}}, "tune.space.training.lr", "empty range"),
    ({"tune.space": {"training.lr": {"low": 0.0, "high": 0.1, "log": True}}}, "tune.space.training.lr.low",
     "log range needs low > 0"),
    ({"tune.space": {"training.lr": {"choices": [0.1, "fast"]}}}, "tune.space.training.lr.choices", "mixes types"),
    ({"tune.space": {"training.lr": {"low": "a", "high": 0.1}}}, "tune.space.training.lr.low", "finite number"),
    ({"tune.space": {"training.lr": 0.1}}, "tune.space.training.lr", "expected a table"),
    ({"tune.trials": 0}, "tune.trials", ">= 1"),
    ({"tune.metric": "acc_mean"}, "tune.metric", "test split"),
    ({"tune.space": {"algorithm.params.mu": {"choices": [0.1, 1.0]}}}, "tune.space.algorithm.params.mu", "fedavg"),
    ({"tune.method": {"fedprx": {"algorithm.params.mu": {"choices": [0.1]}}}}, "tune.method.fedprx",
     "did you mean 'fedprox'"),
    ({"tune.sampler": "grid"}, "tune.sampler", "needs choices for every key"),
    ({"partition.val_fraction": 0.0}, "partition.val_fraction", "validation split"),
    ({"tune.space": {"training.momentum": {"low": 0.5, "high": 1.5}}}, "tune.space.training.momentum", "1.5"),
])
def test_bad_tuning_input_is_one_line_naming_the_key_before_data_loads(tmp_path, capsys, change, key, words):
    raw = tune_raw(**MISSING_DATA)  # data that cannot load: an error after loading would say so instead
    for dotted, value in change.items():
        section, name = dotted.split(".", 1)
        raw[section][name] = value
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--no-tracking")
    line = one_line_error(err)
    assert code == 2 and f"error: {key}" in line and words in line, line


# -- tuning finds what it should --------------------------------------------------------------


def test_tuning_finds_the_learning_rate_that_learns_and_runs_the_point_at_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # without tracking, Optuna's storage is in the working directory
    # 3 rounds at lr 1e-5 leave the model where it started; 0.3 fits the (linearly separable) domains
    raw = tune_raw(trials=2, sweep=None, space={"training.lr": {"choices": [0.00001, 0.3]}},
                   **{"tune.sampler": "grid", "tune.metric": "val_loss_mean", "tune.direction": "minimize"})
    (point,) = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out_dir=str(tmp_path / "o"),
                             out=open(tmp_path / "out.txt", "w"))
    tuned = tomllib.loads((tmp_path / "o" / "runs" / "fedavg" / "tuned_spec.toml").read_text())
    assert tuned["training"]["lr"] == 0.3 and "tune" not in tuned
    assert "fedavg: tuned in 2 trials (0 pruned): training.lr=0.3" in (tmp_path / "out.txt").read_text()
    # the final runs are the tuned spec's runs, on experiment.seeds
    assert point.seeds == [0, 1]
    for seed, run in zip(point.seeds, point.runs):
        alone = Engine(resolve({**tuned, "experiment": {**tuned["experiment"], "seed": seed, "seeds": None}}),
                       progress=False).run()
        assert run.final["acc_mean"] == alone.final["acc_mean"]


def test_same_spec_same_trials_and_every_method_gets_the_same_number(tmp_path, monkeypatch):
    raw = tune_raw(trials=3, method={"fedprox": {"algorithm.params.mu": {"choices": [0.001, 0.1, 1.0]}}},
                   **{"tracking.enabled": True})
    proposals = []
    for attempt in ("a", "b"):
        folder = tmp_path / attempt
        folder.mkdir()
        monkeypatch.chdir(folder)
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        run_spec_file(write_spec(folder, raw), [], quiet=True, tracking_uri=uri, out=open(folder / "out.txt", "w"))
        mlflow.set_tracking_uri(None)
        studies = trials_of(folder / "optuna.db")
        assert len(studies) == 2  # one per point, beside the MLflow store
        proposals.append({name.split("/")[1]: [t.params for t in trials] for name, trials in studies.items()})
        runs = runs_of(uri)
        parents = {r.info.run_name: r for r in runs if r.info.run_name.endswith("(tuning)")}
        assert set(parents) == {"fedavg (tuning)", "fedprox (tuning)"}
        for name, parent in parents.items():
            children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
            assert len(children) == 3  # the same number of trials for every method
            assert {c.data.tags["pfl.tune.state"] for c in children} <= {"complete", "pruned"}
            assert parent.data.metrics["trials_complete"] + parent.data.metrics["trials_pruned"] == 3
        prox = [c for c in runs if c.data.tags.get("mlflow.parentRunId") == parents["fedprox (tuning)"].info.run_id]
        assert {c.data.params["algorithm.params.mu"] for c in prox} <= {"0.001", "0.1", "1.0"}
        assert all(float(c.data.params["evaluation.validation"] == "True") for c in prox)
    assert proposals[0] == proposals[1]  # seeded: the same spec proposes the same trials
    assert proposals[0]["fedavg"] != [{}] * 3 and len(proposals[0]["fedprox"][0]) == 2


def test_the_tuning_seed_is_not_a_final_seed_and_the_trials_share_one_partition(tmp_path):
    from pfl_core.study.points import resolve_points
    from pfl_core.study.tune import plan_tuning

    points = resolve_points(tune_raw(**{"experiment.seeds": [0, 4, 2]}), [])
    plans = plan_tuning(points, ["fedavg", "fedprox"])
    assert [p.seeds for p in plans] == [[5], [5]]
    raw = tune_raw(**{"tune.seeds": [7, 8]})
    assert plan_tuning(resolve_points(raw, []), ["fedavg", "fedprox"])[0].seeds == [7, 8]
    # a trial's run from the cache equals one that built its own data, and the cache hands out copies
    spec = resolve(tiny_raw(**{"partition.val_fraction": 0.2}))
    cache = DataCache()
    first = cache.get(spec.spec)
    labels = first.clients[0].train_y.clone()
    first.clients[0].train_y += 1  # a plugin changing its data cannot reach the next trial
    assert cache.get(spec.spec).clients[0].train_y.equal(labels)
    timed = ("round_seconds", "eval_seconds")
    cached, built = Engine(spec, progress=False, data_cache=cache).run(), Engine(spec, progress=False).run()
    assert {k: v for k, v in cached.final.items() if k not in timed} == {
        k: v for k, v in built.final.items() if k not in timed} and "acc_mean" in built.final


def test_the_median_pruner_stops_trials_and_their_runs_say_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # half the range cannot learn in 4 rounds: once 5 trials ran whole, such trials fall below the median
    raw = tune_raw(trials=12, sweep=None, space={"training.lr": {"low": 1e-6, "high": 0.5, "log": True}},
                   **{"experiment.rounds": 4, "tracking.enabled": True, "tune.sampler": "random"})
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=open(tmp_path / "o.txt", "w"))
    mlflow.set_tracking_uri(None)
    (trials,) = trials_of(tmp_path / "optuna.db").values()
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and len(trials) == 12
    runs = {r.data.tags.get("pfl.tune.trial"): r for r in runs_of(uri) if "pfl.tune.trial" in r.data.tags}
    for t in trials:
        run = runs[str(t.number)]
        if t.state == optuna.trial.TrialState.PRUNED:
            assert run.info.status == "KILLED" and run.data.tags["pfl.tune.state"] == "pruned"
            assert max(t.intermediate_values) < 4  # stopped before its last round
        else:
            assert run.info.status == "FINISHED" and run.data.metrics["tune_objective"] == pytest.approx(t.value)
            # a trial's metrics are held and sent together: every round reaches the store, in order
            history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "val_acc_mean")
            assert [m.step for m in sorted(history, key=lambda m: m.step)] == [1, 2, 3, 4]
            assert history[-1].value == pytest.approx(t.value)  # objective "final": the last round's


def test_a_diverged_trial_fails_alone_and_counts_in_the_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tune_raw(trials=3, sweep=None, space={"training.lr": {"choices": [0.05, 1e9, 0.01]}},
                   **{"tracking.enabled": True, "tune.sampler": "grid", "tune.pruner": "none"})
    spec = write_spec(tmp_path, raw)
    out = io.StringIO()  # read back below: a file left open may not be flushed yet
    run_spec_file(spec, [], quiet=True, tracking_uri=uri, out=out)
    mlflow.set_tracking_uri(None)
    (trials,) = trials_of(tmp_path / "optuna.db").values()
    by_lr = {t.params["training.lr"]: t for t in trials}
    assert by_lr[1e9].state == optuna.trial.TrialState.FAIL and "diverged" in by_lr[1e9].user_attrs["pfl.diverged"]
    assert [by_lr[lr].state for lr in (0.05, 0.01)] == [optuna.trial.TrialState.COMPLETE] * 2
    assert "tuned in 3 trials (0 pruned, 1 diverged)" in out.getvalue()
    assert "a failed trial, counted in tune.trials" in capsys.readouterr().err
    runs = {r.data.tags["pfl.tune.trial"]: r for r in runs_of(uri) if "pfl.tune.trial" in r.data.tags}
    failed = runs[str(by_lr[1e9].number)]
    assert failed.info.status == "FAILED" and "diverged" in failed.data.tags["pfl.diverged"]
    (parent,) = [r for r in runs_of(uri) if r.info.run_name == "fedavg (tuning)"]
    assert parent.data.metrics["trials_diverged"] == 1 and parent.data.params["best.training.lr"] in ("0.05", "0.01")
    # a resumed tuning counts the diverged trial as done: nothing runs again
    out = io.StringIO()
    run_spec_file(spec, [], quiet=True, tracking_uri=uri, out=out, resume=True)
    mlflow.set_tracking_uri(None)
    (again,) = trials_of(tmp_path / "optuna.db").values()
    assert len(again) == 3 and "tuned in 3 trials (0 pruned, 1 diverged)" in out.getvalue()


KILL_AT_TRIAL = """
import os, signal, sys
from pfl_core.engine import engine
started = [0]
run = engine.Engine.run
def counting(self, *args, **kwargs):
    started[0] += 1
    if started[0] == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return run(self, *args, **kwargs)
engine.Engine.run = counting
from pfl_core.cli import run_main
sys.exit(run_main(sys.argv[1:]))
"""


def kill_then_resume(tmp_path, raw, kill_at: int) -> tuple[list, list]:
    """Run the spec in a process killed (SIGKILL) as trial ``kill_at`` starts, then continue it
    with ``--resume``: (its trials before the resume, its trials after)."""
    spec = write_spec(tmp_path, raw)
    env = {**os.environ, "KILL_AT": str(kill_at), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILL_AT_TRIAL, spec, "--quiet"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    (before,) = trials_of(tmp_path / "optuna.db").values()
    resumed = subprocess.run([sys.executable, "-c", "import sys; from pfl_core.cli import run_main; "
                              "sys.exit(run_main(sys.argv[1:]))", spec, "--resume", "--quiet"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    (after,) = trials_of(tmp_path / "optuna.db").values()  # the same study, continued
    return before, after


def test_a_killed_tuning_resumes_without_repeating_a_finished_trial(tmp_path):
    raw = tune_raw(trials=5, sweep=None, **{"tracking.enabled": True, "tracking.progress": False})
    before, after = kill_then_resume(tmp_path, raw, kill_at=4)
    finished = [(t.number, t.params, t.value) for t in before if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 3 and before[3].state == optuna.trial.TrialState.RUNNING
    states = [t.state for t in after]
    assert states.count(optuna.trial.TrialState.COMPLETE) + states.count(optuna.trial.TrialState.PRUNED) == 5
    assert after[3].state == optuna.trial.TrialState.FAIL  # the killed one, replaced
    assert [(t.number, t.params, t.value) for t in after[:3]] == finished  # never run again
    # MLflow: one run per trial that ran (trial 3 was killed as its run began: it has none)
    runs = [r for r in runs_of(f"sqlite:///{tmp_path / 'mlflow.db'}") if "pfl.tune.trial" in r.data.tags]
    assert sorted(int(r.data.tags["pfl.tune.trial"]) for r in runs) == [0, 1, 2, 4, 5]


def test_parallel_trials_nest_under_their_tuning_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tune_raw(trials=4, sweep=None, **{"tracking.enabled": True, "tune.parallel": 2})
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, tracking_uri=uri, out=open(tmp_path / "o.txt", "w"))
    mlflow.set_tracking_uri(None)
    runs = runs_of(uri)
    (parent,) = [r for r in runs if r.info.run_name == "fedavg (tuning)"]
    trials = [r for r in runs if "pfl.tune.trial" in r.data.tags]
    # MLflow's active run is per thread: the trials of the second thread name their parent themselves
    assert len(trials) == 4 and all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in trials)


def test_the_objective_the_header_and_where_the_storage_is():
    from pfl_core.study.points import resolve_points
    from pfl_core.study.tune import describe, objective_value, plan_tuning, storage_url

    history = [{"round": 1, "val_loss_mean": 0.9, "val_acc_mean": 0.5}, {"round": 2, "val_acc_mean": 0.7},
               {"round": 3, "val_loss_mean": 0.4, "val_acc_mean": 0.6}]
    assert objective_value(history, "val_acc_mean", "final", "maximize") == 0.6  # the last evaluation
    assert objective_value(history, "val_acc_mean", "best", "maximize") == 0.7
    assert objective_value(history, "val_loss_mean", "best", "minimize") == 0.4
    assert objective_value(history, "val_loss_mean", "final", "minimize") == 0.4  # rounds without it skipped
    plans = plan_tuning(resolve_points(tune_raw(trials=7, **{"tracking.enabled": True, "tune.sampler": "tpe"}), []),
                        ["fedavg", "fedprox"])
    assert describe(plans).startswith("tuned: 7 trials each on val_acc_mean (final), tpe sampler, tuning seeds [2]")
    plans[1].ran = 5  # a grid that ended early
    assert describe(plans).startswith("tuned: trials: fedavg 7, fedprox 5 on val_acc_mean")
    # beside the MLflow store the run uses (--tracking-uri over the spec's), else here
    assert storage_url(plans[0].point, "sqlite:////data/store/mlflow.db") == "sqlite:////data/store/optuna.db"
    point = resolve_points(tune_raw(**{"tracking.uri": "sqlite:////elsewhere/m.db", "tracking.enabled": True}), [])[0]
    assert storage_url(point, None) == "sqlite:////elsewhere/optuna.db"
    assert storage_url(point, "sqlite:////data/m.db") == "sqlite:////data/optuna.db"
    untracked = resolve_points(tune_raw(**{"tracking.uri": "sqlite:////elsewhere/m.db"}), [])[0]
    assert storage_url(untracked, None) == f"sqlite:///{Path.cwd() / 'optuna.db'}"  # without tracking: here


def test_the_grid_sampler_tries_every_choice_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tune_raw(trials=6, sweep=None, space={"training.lr": {"choices": [0.01, 0.05, 0.2]}},
                   **{"tune.sampler": "grid", "experiment.rounds": 1})
    run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=open(tmp_path / "o.txt", "w"))
    (trials,) = trials_of(tmp_path / "optuna.db").values()
    assert sorted(t.params["training.lr"] for t in trials) == [0.01, 0.05, 0.2]  # stopped when the grid was done


def test_held_metrics_that_the_store_misses_are_journaled_as_metric_records(tmp_path):
    from pfl_core.tracking import journal

    records = [{"op": "metrics", "run_id": "r", "step": step, "timestamp": step, "metrics": {"acc": 0.1 * step}}
               for step in (1, 2, 3)]
    folder = journal.Journal(tmp_path / "j", "sqlite:///x.db")
    folder.add({"op": "metric_batch", "run_id": "r", "records": records})
    assert folder.records() == records  # the journal's own format, replayed like any metrics


def test_reference_runs_stay_untuned_and_a_tuned_point_is_not_replaced_by_its_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # lr 1e-5 does not learn in 3 rounds; the spec's own lr (0.00001 here) is what the reference runs at
    raw = tune_raw(trials=2, sweep=("local", "fedavg"), space={"training.lr": {"choices": [0.00001, 0.3]}},
                   **{"tune.sampler": "grid", "tune.metric": "val_loss_mean", "tune.direction": "minimize",
                      "experiment.reference": ["local"], "training.lr": 0.00001, "experiment.seeds": [0]})
    out = tmp_path / "out.txt"
    points = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out_dir=str(tmp_path / "o"),
                           out=open(out, "w"))
    by_name = {p.name: p for p in points}
    assert set(by_name) == {"local", "fedavg", "local (reference)"}
    tuned = tomllib.loads((tmp_path / "o" / "runs" / "local" / "tuned_spec.toml").read_text())
    assert tuned["training"]["lr"] == 0.3 and not (tmp_path / "o" / "runs" / "local_reference" / "tuned_spec.toml").exists()
    tuned_local = [r.final["acc_mean"] for r in by_name["local"].runs]
    reference = [r.final["acc_mean"] for r in by_name["local (reference)"].runs]
    assert tuned_local != reference  # the tuned point ran at 0.3, not as the reference run at 1e-5
    text = out.read_text()
    assert "local: tuned in 2 trials" in text and "tuned: 2 trials each" in text


def test_a_method_that_diverges_on_a_final_seed_is_left_out_and_the_study_goes_on(tmp_path, capsys):
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 1], "experiment.compare_to": "fedavg"})
    raw["sweep"] = {"points": [{"algorithm": {"name": "fedavg"}},
                               {"algorithm": {"name": "fedprox"}, "training.lr": 1e9},
                               {"algorithm": {"name": "local"}}]}
    out = tmp_path / "o.txt"
    with open(out, "w") as stream:
        results = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=stream,
                                out_dir=str(tmp_path / "res"))
    assert [r.name for r in results] == ["fedavg", "local"]  # the method after it still ran
    text = out.read_text()
    assert "left out: fedprox lr=1000000000.0 diverged on seed 0 (round 1" in text and "local" in text
    assert "the study goes on without it" in capsys.readouterr().err
    assert not (tmp_path / "res" / "INCOMPLETE").exists()
    # the method every row is compared with cannot be left out: one line, exit 2
    raw["experiment"]["compare_to"] = "fedprox lr=1000000000.0"
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--no-tracking", "--quiet")
    assert code == 2 and one_line_error(err) and "diverged" in err


def test_a_tuned_point_that_diverges_on_a_final_seed_is_left_out_too(tmp_path, monkeypatch, capsys):
    from pfl_core.engine import Engine
    from pfl_core.errors import NonFiniteError
    from pfl_core.study import seeds

    class DivergesOnSeed1(Engine):  # fedprox's final run on seed 1 diverges; its tuning trials do not
        def run(self, *args, **kwargs):
            if self.run_name == "fedprox seed=1":
                raise NonFiniteError("round 1, client 0, method fedprox: the training loss became nan")
            return super().run(*args, **kwargs)

    monkeypatch.setattr(seeds, "Engine", DivergesOnSeed1)
    monkeypatch.chdir(tmp_path)
    raw = tune_raw(trials=2, sweep=("fedavg", "fedprox", "local"), **{"experiment.compare_to": "fedavg"})
    with open(tmp_path / "o.txt", "w") as stream:
        results = run_spec_file(write_spec(tmp_path, raw), [], quiet=True, no_tracking=True, out=stream)
    assert [r.name for r in results] == ["fedavg", "local"]
    assert "left out: fedprox diverged on seed 1 (round 1" in (tmp_path / "o.txt").read_text()
