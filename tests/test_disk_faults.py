"""A full or read-only disk under ``--out``, the tracking store or the checkpoints is the user's
to fix: one line naming the path, exit 2 (3 when the runs finished and only their tracking
waits in a journal), no traceback, ``--out`` marked ``INCOMPLETE`` until it is complete, and
nothing already done thrown away.

A full disk is a small tmpfs mounted for the test (a read-only one: mounted ``ro``): the
machine runs as root, for which file permissions do not stop a write. Where mounting is not
allowed (not root, no CAP_SYS_ADMIN) these tests skip, saying so."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest
from tiny import tiny_raw

from pfl_core.cli import main, run_main
from pfl_core.engine import engine as engine_module
from pfl_core.spec import dump_toml
from pfl_core.tracking import journal


def _mount(point, options: str) -> bool:
    point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def disk(tmp_path):
    """``disk(size="1m", read_only=False)``: a fresh tmpfs folder of that size; unmounted after."""
    mounted = []

    def make(size: str = "4m", read_only: bool = False):
        point = tmp_path / f"disk-{len(mounted)}"
        if not _mount(point, f"size={size}" + (",ro" if read_only else "")):
            pytest.skip("a full or read-only disk is made by mounting a small tmpfs, which needs root with "
                        "CAP_SYS_ADMIN here")
        mounted.append(point)
        return point

    make.mounted = mounted
    yield make
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def read_only_view(point, mounted_by):
    """A read-only bind mount of ``point`` (remounting ``point`` itself is refused while this
    process's MLflow holds its store open)."""
    view = point.with_name(point.name + "-read-only")
    view.mkdir()
    subprocess.run(["mount", "--bind", str(point), str(view)], check=True)
    mounted_by.append(view)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
    return view


def fill(folder) -> None:
    """Write a file in ``folder`` until its disk is full."""
    fd = os.open(folder / f"filler-{uuid.uuid4().hex[:6]}", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def empty(folder) -> None:
    for filler in folder.glob("filler-*"):
        filler.unlink()


@pytest.fixture
def fill_at_round(monkeypatch):
    """``fill_at_round(folder, 2)``: the disk of ``folder`` fills as round 2 first starts."""

    def arm(folder, at: int):
        run_round = engine_module.Engine.run_round
        filled = []

        def patched(self, ctx, round, *args, **kwargs):
            if round == at and not filled:
                filled.append(round)
                fill(folder)
            return run_round(self, ctx, round, *args, **kwargs)

        monkeypatch.setattr(engine_module.Engine, "run_round", patched)

    return arm


def spec_file(tmp_path, sweep: bool = False, **overrides) -> str:
    raw = tiny_raw(**{"experiment.rounds": 3, **overrides})
    if sweep:
        raw["experiment"]["seeds"] = [0, 1]
        raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    return str(path)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("pfl-run: error:")]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    return lines[0]


def metric_steps(uri: str, run_id: str, key: str = "acc_mean") -> list[int]:
    import mlflow

    return sorted(m.step for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key))


def run_status(uri: str, run_id: str) -> str:
    import mlflow

    return mlflow.MlflowClient(uri).get_run(run_id).info.status


def only_run_id(uri: str) -> str:
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1
    return runs[0].info.run_id


# -- --out -------------------------------------------------------------------------------------


def test_out_is_marked_incomplete_while_it_is_written_and_unmarked_when_complete(tmp_path, capsys, monkeypatch):
    out = tmp_path / "results"
    seen = []
    run_round = engine_module.Engine.run_round

    def look(self, ctx, round, *args, **kwargs):
        seen.append((out / "INCOMPLETE").is_file())
        return run_round(self, ctx, round, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "run_round", look)
    code = run_main([spec_file(tmp_path, sweep=True), "--no-tracking", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert seen and all(seen)  # every round of every run saw the mark
    assert not (out / "INCOMPLETE").exists() and (out / "comparison.csv").is_file()


def test_a_full_disk_under_out_is_one_line_naming_it_and_the_folder_stays_marked(tmp_path, capsys, disk,
                                                                                   fill_at_round):
    volume = disk("256k")
    out = volume / "results"
    fill_at_round(volume, 2)  # the first run's second round: spec.toml is written, the CSVs will not fit
    code = run_main([spec_file(tmp_path, sweep=True), "--no-tracking", "--quiet", "--out", str(out)])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert f"--out {out}: cannot write" in line and "No space left on device" in line
    assert (out / "INCOMPLETE").is_file() and (out / "spec.toml").read_text().startswith("[experiment]")
    assert not (out / "comparison.csv").exists()


def test_a_read_only_out_is_one_line_before_anything_runs(tmp_path, capsys, disk):
    volume = disk("256k", read_only=True)
    code = run_main([spec_file(tmp_path), "--no-tracking", "--quiet", "--out", str(volume / "results")])
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert code == 2 and "Read-only file system" in line and str(volume / "results") in line
    assert "acc_mean" not in captured.out  # refused before training
    # an existing folder on a read-only disk, with --overwrite: the first write is refused the same way
    code = run_main([spec_file(tmp_path), "--no-tracking", "--quiet", "--out", str(volume), "--overwrite"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and f"--out {volume}: cannot write" in line and "Read-only file system" in line


# -- the tracking store ------------------------------------------------------------------------


def store_with_one_run(tmp_path, capsys, disk):
    """A new tmpfs holding a SQLite store with one finished run; returns (volume, uri, spec)."""
    volume = disk("16m")
    uri = f"sqlite:///{volume}/mlflow.db"
    spec = spec_file(tmp_path, **{"experiment.rounds": 1, "checkpoint.dir": str(tmp_path / "ck"),
                                  "tracking.enabled": True})
    assert run_main([spec, "--quiet", "--tracking-uri", uri]) == 0
    capsys.readouterr()
    return volume, uri, spec


def test_a_read_only_store_is_refused_before_training_and_in_a_dry_run(tmp_path, capsys, disk):
    volume, uri, spec = store_with_one_run(tmp_path, capsys, disk)
    before = (volume / "mlflow.db").read_bytes()
    volume = read_only_view(volume, disk.mounted)
    uri = f"sqlite:///{volume}/mlflow.db"
    for extra in ([], ["--dry-run"]):
        code = run_main([spec, "--quiet", "--tracking-uri", uri, *extra])
        captured = capsys.readouterr()
        line = one_error_line(captured.err)
        assert code == 2, extra
        assert f"{volume}/mlflow.db is read-only (read-only file system)" in line and "--no-tracking" in line
        assert "acc_mean" not in captured.out
    assert (volume / "mlflow.db").read_bytes() == before


def test_a_store_on_a_full_disk_is_one_line_before_training(tmp_path, capsys, disk):
    volume, uri, spec = store_with_one_run(tmp_path, capsys, disk)
    fill(volume)
    code = run_main([spec, "--quiet", "--tracking-uri", uri])
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert code == 2 and f"tracking store {uri} cannot be written (database or disk is full)" in line
    assert "acc_mean" not in captured.out


def test_a_store_that_fills_mid_run_journals_the_rest_exits_3_and_replays_whole(tmp_path, capsys, disk,
                                                                                 fill_at_round):
    volume = disk("16m")
    uri = f"sqlite:///{volume}/mlflow.db"
    checkpoints = tmp_path / "ck"  # on another disk: the journal can be written
    spec = spec_file(tmp_path, **{"checkpoint.dir": str(checkpoints), "tracking.enabled": True})
    fill_at_round(volume, 2)
    code = run_main([spec, "--quiet", "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 3, err
    run_id = next(p.name for p in checkpoints.iterdir())
    folder = checkpoints / run_id / "journal"
    assert f"cannot be written at round 2 (database or disk is full): metrics kept in {folder}" in err
    assert f"send it when the store can be written again with: pfl replay {folder}" in err
    kept = journal.Journal(folder).records()
    assert sorted(r["step"] for r in kept if r["op"] == "metrics" and "acc_mean" in r["metrics"]) == [2, 3]
    empty(volume)
    assert main(["replay", str(folder)]) == 0
    assert metric_steps(uri, run_id) == [1, 2, 3] and run_status(uri, run_id) == "FINISHED"
    assert not folder.exists()


def test_store_and_checkpoints_on_one_full_disk_stop_with_the_resume_command(tmp_path, capsys, disk,
                                                                           fill_at_round):
    volume = disk("16m")
    uri = f"sqlite:///{volume}/mlflow.db"
    spec = spec_file(tmp_path, **{"checkpoint.dir": str(volume / "ck"), "tracking.enabled": True})
    fill_at_round(volume, 2)
    code = run_main([spec, "--quiet", "--tracking-uri", uri])
    line = one_error_line(capsys.readouterr().err)
    run_id = only_run_id(uri)
    assert code == 2
    assert "(database or disk is full) and the journal" in line and "cannot be written either" in line
    assert line.endswith(f"free space, then resume it from its last checkpoint: pfl-run --resume {run_id} "
                         f"--tracking-uri {uri}")
    assert (volume / "ck" / run_id / "round-000001").is_dir()  # the work done is kept
    empty(volume)
    assert run_main(["--resume", run_id, "--quiet"]) == 0, capsys.readouterr().err
    assert metric_steps(uri, run_id) == [1, 2, 3] and run_status(uri, run_id) == "FINISHED"


def test_a_checkpoint_disk_that_fills_mid_run_keeps_the_last_checkpoint_and_says_how_to_resume(
        tmp_path, capsys, disk, fill_at_round):
    volume = disk("4m")
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # the store on another disk
    spec = spec_file(tmp_path, **{"checkpoint.dir": str(volume / "ck"), "tracking.enabled": True})
    fill_at_round(volume, 2)  # round 1's checkpoint fits, round 2's does not
    code = run_main([spec, "--quiet", "--tracking-uri", uri])
    line = one_error_line(capsys.readouterr().err)
    run_id = only_run_id(uri)
    assert code == 2 and "No space left on device" in line
    assert line.endswith(f"round 1's checkpoint is kept: free space, then pfl-run --resume {run_id} "
                         f"--tracking-uri {uri}")
    assert run_status(uri, run_id) == "FAILED" and metric_steps(uri, run_id) == [1, 2]
    empty(volume)
    assert run_main(["--resume", run_id, "--tracking-uri", uri, "--quiet"]) == 0, capsys.readouterr().err
    assert metric_steps(uri, run_id) == [1, 2, 3] and run_status(uri, run_id) == "FINISHED"


@pytest.mark.parametrize("number, outage", [(errno.ENOSPC, True), (errno.EROFS, True), (errno.EDQUOT, True),
                                            (errno.ENOENT, False), (errno.EACCES, False)])
def test_an_unwritable_disk_under_the_artifacts_is_an_outage_a_missing_file_is_not(number, outage):
    assert journal.is_outage(OSError(number, os.strerror(number))) is outage


def test_the_reason_of_a_full_or_read_only_sqlite_store_is_its_own_words():
    text = ("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block) "
            "(sqlite3.OperationalError) {} [SQL: INSERT INTO runs (run_uuid, name)]")
    for words in ("database or disk is full", "attempt to write a readonly database", "disk I/O error"):
        assert journal.reason(Exception(text.format(words))) == words
