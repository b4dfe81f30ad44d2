"""``pfl-run SPEC --resume`` keeps the final runs a stopped study finished: they are copied into
the continuing study (never run again), which then holds the same numbers as a study that ran
without a stop; a run of another spec, or one whose checkpoint is gone, runs again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import tomllib
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, write_spec
from tiny import tiny_raw

from pfl_core.cli import main, run_main
from pfl_core.engine import engine as engine_module
from pfl_core.state.checkpoint import CHECKPOINT_TAG, RUN_FILE, checkpoints
from pfl_core.study import run_spec_file
from pfl_core.study.reuse import CONTINUED_TAG, REUSED_TAG, SUPERSEDED_TAG, Reuse, ResumeLock, client_rows
from pfl_core.study.stored import find, load, studies

SEEDS = [0, 1, 2]


def study_raw(**overrides):
    return tiny_raw(**{"experiment.seeds": SEEDS, "tracking.enabled": True, "algorithm.name": "fedprox",
                       "algorithm.params": {"mu": 0.01}, **overrides})


class Stop(Exception):
    pass


def counting_runs(monkeypatch, stop_at: int | None = None) -> list[int]:
    """Count Engine.run calls (the seeds each call ran); the ``stop_at``-th raises Stop."""
    calls: list[int] = []
    run = engine_module.Engine.run

    def counted(self, *args, **kwargs):
        calls.append(self.resolved.spec.experiment.seed)
        if stop_at is not None and len(calls) == stop_at:
            raise Stop("the machine went away")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "run", counted)
    return calls


def run_study(spec, uri, tmp_path, resume=False, overrides=()):
    out = tmp_path / "out.txt"
    try:
        with open(out, "w") as handle:
            results = run_spec_file(spec, list(overrides), quiet=True, tracking_uri=uri, out=handle, resume=resume)
    finally:
        mlflow.set_tracking_uri(None)
    return results, out.read_text()


def seed_runs(uri, study_id):
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {r.info.run_name: r for r in runs if r.data.tags.get("pfl.study") == study_id and "seed=" in r.info.run_name}


def untimed(rows: list[dict]) -> list[dict]:
    """The rows less their wall times (a run's own, never equal between two runs)."""
    return [{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in rows]


@pytest.fixture(params=[0])
def stopped(tmp_path, monkeypatch, request):
    """A study stopped while its second seed ran: (spec, uri, the first seed's run); the
    parameter: its cold-start clients."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = write_spec(tmp_path, study_raw(**{"experiment.coldstart_clients": request.param}))
    counting_runs(monkeypatch, stop_at=2)
    with pytest.raises(Stop):
        run_study(spec, uri, tmp_path)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    (stopped_study,) = studies(MlflowClient(tracking_uri=uri))
    runs = seed_runs(uri, stopped_study.id)
    assert runs["fedprox seed=0"].info.status == "FINISHED"
    return spec, uri, runs["fedprox seed=0"]


@pytest.mark.parametrize("stopped", [0, 1], indirect=True, ids=["trained clients", "a cold-start client"])
def test_a_resumed_study_keeps_the_finished_seed_and_equals_a_study_without_a_stop(stopped, tmp_path, monkeypatch):
    spec, uri, first = stopped
    calls = counting_runs(monkeypatch)
    results, printed = run_study(spec, uri, tmp_path, resume=True)
    assert calls == [1, 2]  # seed 0 was not run again
    assert "fedprox seed=0: " in printed and f"(kept: run {first.info.run_id} of a stopped study)" in printed
    (point,) = results
    assert point.seeds == SEEDS

    fresh_uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    (fresh,), _ = run_study(spec, fresh_uri, tmp_path)
    assert calls == [1, 2, 0, 1, 2]
    assert point.values("acc_mean") == fresh.values("acc_mean")  # the kept seed's result is the run's own
    assert untimed(point.runs[0].history) == untimed(fresh.runs[0].history)
    assert untimed([point.runs[0].final]) == untimed([fresh.runs[0].final])
    assert point.runs[0].seconds == pytest.approx((first.info.end_time - first.info.start_time) / 1000)
    kept_rows, fresh_rows = point.runs[0].client_rows, fresh.runs[0].client_rows
    assert [list(r) for r in kept_rows] == [list(r) for r in fresh_rows]
    for kept_row, fresh_row in zip(kept_rows, fresh_rows):  # cold-start rows come from a CSV of 6 digits
        assert kept_row == {k: pytest.approx(v, rel=1e-5) if type(v) is float else v for k, v in fresh_row.items()}
    with open(spec, "rb") as handle:  # the cold-start case holds a held-out client's row
        assert any(r.get("coldstart") for r in kept_rows) == bool(tomllib.load(handle)["experiment"]["coldstart_clients"])
    for key in ("acc_mean", "loss_mean"):
        assert point.summary[key].mean == fresh.summary[key].mean and point.summary[key].ci95 == fresh.summary[key].ci95

    # the store: the new study holds all three seeds; the kept one is a copy, the stopped study keeps its own
    client = MlflowClient(tracking_uri=uri)
    stopped_study, resumed = studies(client)
    runs = seed_runs(uri, resumed.id)
    copy = runs["fedprox seed=0"]
    assert copy.info.run_id != first.info.run_id and copy.data.tags[REUSED_TAG] == first.info.run_id
    assert copy.data.tags["mlflow.parentRunId"] == point.run_id
    assert copy.data.params == first.data.params
    for key in first.data.metrics:
        old = [(m.step, m.value) for m in client.get_metric_history(first.info.run_id, key)]
        assert sorted((m.step, m.value) for m in client.get_metric_history(copy.info.run_id, key)) == sorted(old)
    assert client.list_artifacts(copy.info.run_id, "results") and \
        {a.path for a in client.list_artifacts(copy.info.run_id, "results")} == \
        {a.path for a in client.list_artifacts(first.info.run_id, "results")}
    assert seed_runs(uri, stopped_study.id)["fedprox seed=0"].info.run_id == first.info.run_id
    table = load(client, find(studies(client), "last"))
    (stored,) = table.results
    assert stored.seeds == SEEDS and stored.summary["acc_mean"].mean == pytest.approx(fresh.summary["acc_mean"].mean)
    mlflow.set_tracking_uri(None)


def test_a_run_of_another_spec_is_not_kept(stopped, tmp_path, monkeypatch):
    spec, uri, _ = stopped
    calls = counting_runs(monkeypatch)
    _, printed = run_study(spec, uri, tmp_path, resume=True, overrides=["algorithm.params.mu=0.02"])
    assert calls == SEEDS and "kept" not in printed


def test_a_run_of_another_report_setting_is_kept(stopped, tmp_path, monkeypatch):
    """[report] decides how the table compares runs, never what a run trains: a resume with
    another correction family keeps the finished run."""
    spec, uri, _ = stopped
    calls = counting_runs(monkeypatch)
    _, printed = run_study(spec, uri, tmp_path, resume=True, overrides=['report.correction_family="metric"'])
    assert calls == SEEDS[1:] and "kept" in printed


def test_a_run_whose_checkpoint_is_gone_runs_again(stopped, tmp_path, monkeypatch):
    spec, uri, first = stopped
    shutil.rmtree(first.data.tags[CHECKPOINT_TAG])
    calls = counting_runs(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    assert calls == SEEDS


def test_a_run_whose_final_checkpoint_is_damaged_runs_again(stopped, tmp_path, monkeypatch):
    """Its previous checkpoint is good, but of an earlier round: not the run's end."""
    spec, uri, first = stopped
    folder = Path(first.data.tags[CHECKPOINT_TAG])
    (checkpoints(folder)[0] / RUN_FILE).write_bytes(b"damaged")
    assert checkpoints(folder)[1:], "the run keeps an earlier checkpoint"
    calls = counting_runs(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    assert calls == SEEDS


def test_a_run_of_another_pfl_version_runs_again(stopped, tmp_path, monkeypatch):
    spec, uri, _ = stopped
    monkeypatch.setattr(Reuse, "_version", staticmethod(lambda: "99.0"))
    calls = counting_runs(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    assert calls == SEEDS


def test_of_two_stopped_studies_the_newest_run_is_kept(stopped, tmp_path, monkeypatch):
    spec, uri, first = stopped
    counting_runs(monkeypatch, stop_at=2)
    with pytest.raises(Stop):  # stopped again, started afresh (no --resume): a second seed 0
        run_study(spec, uri, tmp_path)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    newest = seed_runs(uri, studies(client)[-1].id)["fedprox seed=0"]
    assert newest.info.run_id != first.info.run_id
    run_study(spec, uri, tmp_path, resume=True)
    kept = seed_runs(uri, studies(client)[-1].id)["fedprox seed=0"]
    assert kept.data.tags[REUSED_TAG] == newest.info.run_id
    mlflow.set_tracking_uri(None)


def test_without_resume_every_run_runs_again(stopped, tmp_path, monkeypatch):
    spec, uri, _ = stopped
    calls = counting_runs(monkeypatch)
    run_study(spec, uri, tmp_path)
    assert calls == SEEDS


def test_a_run_written_by_other_code_is_kept_and_said(stopped, tmp_path, monkeypatch, capsys):
    spec, uri, first = stopped
    from pfl_core.state import provenance

    real = provenance.code_version
    monkeypatch.setattr(provenance, "code_version", lambda names: {**real(names), "source_sha256": "changed"})
    calls = counting_runs(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    assert calls == [1, 2]
    err = capsys.readouterr().err
    assert f"kept run {first.info.run_id} of a stopped study, which ran with other code" in err


def test_cold_start_rows_are_read_back_with_the_trained_rows_types(tmp_path):
    table = tmp_path / "clients.csv"
    table.write_text("client,acc,coldstart\n0,0.5,False\n3,1,True\n")
    trained = [{"client": 0, "acc": 0.5}]
    assert client_rows(trained, table, coldstart=0) == trained
    rows = client_rows(trained, table, coldstart=1)
    assert rows == [{"client": 0, "acc": 0.5, "coldstart": False}, {"client": 3, "acc": 1.0, "coldstart": True}]
    assert type(rows[1]["acc"]) is float and type(rows[1]["client"]) is int


# -- the run the stop interrupted continues from its checkpoint ------------------------------------

ROUNDS = 4
STOP_ROUND = 3  # seed 1 stops in its round 3: its round-2 checkpoint holds rounds 1-2


def counting_rounds(monkeypatch, stop: tuple[int, int] | None = None, raising: type = Stop) -> list[tuple[int, int]]:
    """Record (seed, round) of every round run; ``stop`` = (seed, round) raises ``raising`` there."""
    rounds: list[tuple[int, int]] = []
    run_round = engine_module.Engine.run_round

    def counted(self, ctx, round):
        rounds.append((self.resolved.spec.experiment.seed, round))
        if stop == rounds[-1]:
            raise raising("the machine went away mid-run")
        return run_round(self, ctx, round)

    monkeypatch.setattr(engine_module.Engine, "run_round", counted)
    return rounds


@pytest.fixture
def interrupted_mid_run(tmp_path, monkeypatch):
    """A study stopped in seed 1's round 3 (a checkpoint every round): (spec, uri)."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = write_spec(tmp_path, study_raw(**{"experiment.rounds": ROUNDS, "checkpoint.every": 1}))
    counting_rounds(monkeypatch, stop=(1, STOP_ROUND))
    with pytest.raises(Stop):
        run_study(spec, uri, tmp_path)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    return spec, uri


def test_the_interrupted_run_continues_from_its_checkpoint_as_a_run_never_stopped(interrupted_mid_run, tmp_path,
                                                                                  monkeypatch):
    spec, uri = interrupted_mid_run
    client = MlflowClient(tracking_uri=uri)
    (stopped_study,) = studies(client)
    interrupted = seed_runs(uri, stopped_study.id)["fedprox seed=1"]
    assert interrupted.info.status == "FAILED"
    old_folder = Path(interrupted.data.tags[CHECKPOINT_TAG])
    old_checkpoints = sorted(p.name for p in old_folder.iterdir())

    rounds = counting_rounds(monkeypatch)
    (point,), _ = run_study(spec, uri, tmp_path, resume=True)
    # seed 0 kept, seed 1 on from its round-2 checkpoint, seed 2 whole
    assert rounds == [(1, 3), (1, 4), *[(2, r) for r in range(1, ROUNDS + 1)]]

    fresh_uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    (fresh,), _ = run_study(spec, fresh_uri, tmp_path)
    assert point.values("acc_mean") == fresh.values("acc_mean")
    assert untimed(point.runs[1].history) == untimed(fresh.runs[1].history)
    assert untimed([point.runs[1].final]) == untimed([fresh.runs[1].final])

    resumed = studies(client)[1]
    continued = seed_runs(uri, resumed.id)["fedprox seed=1"]
    assert continued.info.status == "FINISHED" and continued.data.tags[CONTINUED_TAG] == interrupted.info.run_id
    assert continued.data.tags["mlflow.parentRunId"] == point.run_id
    fresh_client = MlflowClient(tracking_uri=fresh_uri)
    fresh_run = seed_runs(fresh_uri, studies(fresh_client)[0].id)["fedprox seed=1"]
    for key in ("acc_mean", "loss_mean", "train_loss_mean"):  # rounds 1-2 copied, 3-4 trained again
        got = sorted((m.step, m.value) for m in client.get_metric_history(continued.info.run_id, key))
        assert got == sorted((m.step, m.value) for m in fresh_client.get_metric_history(fresh_run.info.run_id, key))
    # the new run has its own checkpoints; the interrupted run's are left as they were
    new_folder = Path(continued.data.tags[CHECKPOINT_TAG])
    assert new_folder != old_folder and checkpoints(new_folder)
    assert sorted(p.name for p in old_folder.iterdir()) == old_checkpoints
    # it failed (its status says so still), and the study that continued it is named on it
    after = client.get_run(interrupted.info.run_id)
    assert after.info.status == "FAILED" and after.data.tags[SUPERSEDED_TAG] == resumed.id
    mlflow.set_tracking_uri(None)


def test_a_finished_run_is_kept_before_a_newer_interrupted_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = write_spec(tmp_path, study_raw(**{"experiment.rounds": ROUNDS, "checkpoint.every": 1}))
    counting_rounds(monkeypatch, stop=(1, 1))  # the first study: seed 0 finishes
    with pytest.raises(Stop):
        run_study(spec, uri, tmp_path)
    monkeypatch.undo()
    counting_rounds(monkeypatch, stop=(0, STOP_ROUND))  # the second, afresh: seed 0 interrupted
    with pytest.raises(Stop):
        run_study(spec, uri, tmp_path)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    first, second = studies(client)
    finished = seed_runs(uri, first.id)["fedprox seed=0"]
    assert seed_runs(uri, second.id)["fedprox seed=0"].info.status == "FAILED"
    rounds = counting_rounds(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    kept = seed_runs(uri, studies(client)[-1].id)["fedprox seed=0"]
    assert kept.data.tags.get(REUSED_TAG) == finished.info.run_id and CONTINUED_TAG not in kept.data.tags
    assert all(seed != 0 for seed, _ in rounds)
    mlflow.set_tracking_uri(None)


def test_an_interrupted_run_of_other_code_runs_again_from_its_start(interrupted_mid_run, tmp_path, monkeypatch):
    """One run, one code: as --resume RUN refuses, the continuation does not mix two."""
    spec, uri = interrupted_mid_run
    from pfl_core.state import provenance

    real = provenance.code_version
    monkeypatch.setattr(provenance, "code_version", lambda names: {**real(names), "source_sha256": "changed"})
    rounds = counting_rounds(monkeypatch)
    run_study(spec, uri, tmp_path, resume=True)
    assert [r for seed, r in rounds if seed == 1] == list(range(1, ROUNDS + 1))
    assert not [seed for seed, _ in rounds if seed == 0]  # the finished seed is still kept
    mlflow.set_tracking_uri(None)


# -- one resume of a study at a time; the study it continues is marked stopped -----------------------

HOLD_LOCK = """
import sys
from pfl_core.study.reuse import ResumeLock
lock = ResumeLock(sys.argv[1], sys.argv[2])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # held until this process is killed
"""


def test_a_second_resume_while_one_runs_is_refused_in_one_line_and_a_killed_holder_blocks_nothing(
        stopped, tmp_path, monkeypatch, capsys):
    """The issue: two `pfl-run SPEC --resume` of one stopped study at once both ran the remaining
    runs, and the store ended with two continuing studies."""
    spec, uri, _ = stopped
    client = MlflowClient(tracking_uri=uri)
    calls = counting_runs(monkeypatch)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, uri, "tiny"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code = run_main([spec, "--resume", "--tracking-uri", uri, "--quiet", "--out", str(tmp_path / "results")])
        err = one_line_error(capsys.readouterr().err)
        assert code == 2 and err.startswith(
            f"pfl-run: error: another pfl-run --resume (pid {holder.pid}) is continuing this study of experiment "
            f"'tiny' in {uri}; wait for it to end")
        assert f"(lock {(tmp_path / 'mlflow.db').resolve()}.resume-" in err  # beside the store
        assert calls == [] and len(studies(client)) == 1  # nothing ran, no study began
        assert not (tmp_path / "results").exists()
    finally:
        holder.kill()  # SIGKILL: the system releases the lock of a process that is gone
        holder.wait(timeout=300)
    assert run_main([spec, "--resume", "--tracking-uri", uri, "--quiet"]) == 0
    assert calls == [1, 2]
    assert len(studies(client)) == 2  # the stopped study and the one study that continued it
    mlflow.set_tracking_uri(None)


KILLED_AT_ROUND = """
import os, signal, sys
from pfl_core.engine import engine
rounds = [0]
run_round = engine.Engine.run_round
def counted(self, ctx, round):
    rounds[0] += 1
    if rounds[0] == int(os.environ["KILL_AT_ROUND"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return run_round(self, ctx, round)
engine.Engine.run_round = counted
from pfl_core.cli import run_main
sys.exit(run_main(sys.argv[1:]))
"""


def kill_study(spec: str, uri: str, tmp_path, at_round: int) -> None:
    """``pfl-run SPEC`` SIGKILLed as the ``at_round``-th round of the process starts: what a kill
    leaves, its runs RUNNING in MLflow."""
    env = {**os.environ, "KILL_AT_ROUND": str(at_round), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_ROUND, spec, "--tracking-uri", uri, "--quiet"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr


@pytest.fixture
def killed_mid_run(tmp_path, monkeypatch):
    """A study SIGKILLed in seed 1's round 3 (seed 0 finished; a checkpoint every round): (spec, uri)."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = write_spec(tmp_path, study_raw(**{"experiment.rounds": ROUNDS, "checkpoint.every": 1}))
    kill_study(spec, uri, tmp_path, at_round=ROUNDS + STOP_ROUND)
    return spec, uri


def listed(capsys, uri: str) -> dict[str, str]:
    """``pfl results``' rows by study id."""
    assert main(["results", "--tracking-uri", uri]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}


def test_the_runs_a_kill_left_running_end_killed_naming_the_study_that_continued_them(killed_mid_run, tmp_path,
                                                                                        capsys):
    spec, uri = killed_mid_run
    client = MlflowClient(tracking_uri=uri)
    (stopped_study,) = studies(client)
    before = {r.info.run_name: r for r in stopped_study.runs}
    assert {name: r.info.status for name, r in before.items()} == {
        "fedprox": "RUNNING", "fedprox seed=0": "FINISHED", "fedprox seed=1": "RUNNING"}
    assert listed(capsys, uri)[stopped_study.id].split()[-2:] == ["RUNNING", "3"]

    run_study(spec, uri, tmp_path, resume=True)
    stopped_study, resumed = studies(client)
    after = {r.info.run_name: r for r in stopped_study.runs}
    for name in ("fedprox", "fedprox seed=1"):  # the point's parent run, and the run the kill interrupted
        assert after[name].info.status == "KILLED" and after[name].data.tags[SUPERSEDED_TAG] == resumed.id
    kept = after["fedprox seed=0"]  # finished: left as it was
    assert kept.info.status == "FINISHED" and SUPERSEDED_TAG not in kept.data.tags
    assert kept.info.end_time == before["fedprox seed=0"].info.end_time

    rows = listed(capsys, uri)
    assert f" stopped (continued by {resumed.id}) " in rows[stopped_study.id]
    assert rows[resumed.id].split()[-2:] == ["FINISHED", "4"]
    assert main(["results", stopped_study.id, "--tracking-uri", uri]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f", stopped (continued by {resumed.id})")
    mlflow.set_tracking_uri(None)


def test_a_resume_stopped_by_ctrl_c_frees_its_lock_and_a_second_resume_finishes_the_study(killed_mid_run, tmp_path,
                                                                                          monkeypatch):
    spec, uri = killed_mid_run
    counting_rounds(monkeypatch, stop=(2, 2), raising=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        run_study(spec, uri, tmp_path, resume=True)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    lock = ResumeLock(uri, "tiny")
    # released on the way out, not when its objects are collected: the traceback still holds them
    lock.acquire()
    lock.release()
    assert interrupted.traceback

    rounds = counting_rounds(monkeypatch)
    (point,), _ = run_study(spec, uri, tmp_path, resume=True)
    assert rounds == [(2, 2), (2, 3), (2, 4)]  # seeds 0 and 1 kept, seed 2 on from its round-1 checkpoint
    assert point.seeds == SEEDS
    client = MlflowClient(tracking_uri=uri)
    killed, first, second = studies(client)
    assert (killed.continued_by, first.continued_by, second.state) == (first.id, second.id, "FINISHED")
    # the point's parent (named fedprox-2 beside the first study's) and seed 2: Ctrl-C ended them
    # KILLED, and they name the second resume; the seeds it finished are left as they were
    by_name = {r.info.run_name if "seed=" in r.info.run_name else "parent": r for r in first.runs}
    for name in ("parent", "fedprox seed=2"):
        assert by_name[name].info.status == "KILLED" and by_name[name].data.tags[SUPERSEDED_TAG] == second.id
    for name in ("fedprox seed=0", "fedprox seed=1"):
        assert by_name[name].info.status == "FINISHED" and SUPERSEDED_TAG not in by_name[name].data.tags
    mlflow.set_tracking_uri(None)


def test_a_study_that_ended_is_not_marked_when_a_resume_keeps_its_runs(tmp_path, monkeypatch):
    """A sweep whose point diverged ended FINISHED: its failed runs are its result, not a stop."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = study_raw(**{"experiment.seeds": [0], "experiment.rounds": 2})
    raw["sweep"] = {"training.lr": [0.1, 1e9]}
    spec = write_spec(tmp_path, raw)
    run_study(spec, uri, tmp_path)
    run_study(spec, uri, tmp_path, resume=True)
    client = MlflowClient(tracking_uri=uri)
    ended, resumed = studies(client)
    assert any(r.info.status == "FAILED" for r in ended.runs)  # the diverged point's runs
    assert not [r for r in ended.runs if SUPERSEDED_TAG in r.data.tags] and ended.state == "FINISHED"
    assert any(REUSED_TAG in r.data.tags for r in resumed.runs)
    mlflow.set_tracking_uri(None)


def test_a_study_killed_while_tuning_is_marked_by_the_resume_that_goes_on_with_its_trials(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = study_raw(**{"experiment.seeds": [0], "experiment.rounds": 2})
    raw["tune"] = {"trials": 2, "space": {"training.lr": {"low": 0.01, "high": 0.2, "log": True}}}
    spec = write_spec(tmp_path, raw)
    kill_study(spec, uri, tmp_path, at_round=3)  # trial 0 finished, trial 1 killed in its round 1
    client = MlflowClient(tracking_uri=uri)
    (killed,) = studies(client)
    statuses = sorted((r.info.run_name, r.info.status) for r in killed.runs)
    assert [status for _, status in statuses] == ["RUNNING", "FINISHED", "RUNNING"]  # tuning, trial 0, trial 1
    run_study(spec, uri, tmp_path, resume=True)
    killed, resumed = studies(client)
    for run in killed.runs:
        if run.info.run_name.endswith("trial 0"):
            assert run.info.status == "FINISHED" and SUPERSEDED_TAG not in run.data.tags
        else:
            assert run.info.status == "KILLED" and run.data.tags[SUPERSEDED_TAG] == resumed.id, run.info.run_name
    assert killed.state == f"stopped (continued by {resumed.id})"
    mlflow.set_tracking_uri(None)
