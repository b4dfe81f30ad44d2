"""A tracking server that goes away mid-run (issue 12): the run goes on, what the server missed is
kept in a local journal and replayed when it returns, at the end, on ``--resume`` or by
``pfl replay``; every metric of every round ends in the store exactly once, as in the same run
against a store that never went away, and the run's status is set.

The server is MLflow's own tracking server application (``mlflow.server.app``, what ``mlflow
server`` serves; a SQLite backend, artifacts served) run by werkzeug in a thread of this
process: ``mlflow server`` takes 15-45 s to start on a busy two-core machine, this a few seconds
once, and stopping it closes its listening socket (clients get "connection refused", as from a
stopped server) while restarting it costs a bind. It answers HTTP/1.0 only, so no kept-alive
connection outlives a stop. The runs are ``pfl-run`` (``cli.run_main``) in this process; the
server is stopped and restarted as chosen rounds start (``Engine.run_round`` patched).
"""

from __future__ import annotations

import re
import shutil
import socket
import sqlite3
import threading
from pathlib import Path

import pytest
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.cli import main, run_main
from pfl_core.cli.cli import EXIT_TRACKING_PENDING
from pfl_core.engine import engine as engine_module
from pfl_core.state.checkpoint import checkpoints
from pfl_core.tracking import journal

WALL_CLOCK = ("round_seconds", "eval_seconds")  # differ between any two runs
ROUNDS = 5
ARTIFACTS = {"resolved_spec.toml", "partition/partition_table.csv", "partition/partition.png",
             "partition/indices.json", "results/clients.csv", "results/client_accuracy.png"}


class Server:
    """MLflow's tracking server on a free local port; ``stop()`` and ``start()`` at will."""

    def __init__(self, folder: Path):
        from mlflow.server import constants

        self.db = folder / "server.db"
        # how `mlflow server` configures its application (read when it first needs the store)
        self.environment = {constants.BACKEND_STORE_URI_ENV_VAR: f"sqlite:///{self.db}",
                            constants.ARTIFACT_ROOT_ENV_VAR: "mlflow-artifacts:/",
                            constants.SERVE_ARTIFACTS_ENV_VAR: "true",
                            constants.ARTIFACTS_DESTINATION_ENV_VAR: str(folder / "artifacts")}
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.http = None

    def start(self) -> None:
        from mlflow.server import app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Handler(WSGIRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: nothing survives stop()

            def log_request(self, *args, **kwargs):
                pass

        self.http = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.http = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import requests

    folder = tmp_path_factory.mktemp("server")
    server = Server(folder)
    patch = pytest.MonkeyPatch()
    for name, value in server.environment.items():
        patch.setenv(name, value)
    server.start()
    # The first request creates the store's tables (seconds): before any run, with time to do it.
    requests.get(f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1").raise_for_status()
    shutil.copyfile(server.db, folder / "empty.db")  # an empty store for the reference run
    server.empty_store = folder / "empty.db"
    yield server
    if server.http is not None:
        server.stop()
    patch.undo()


@pytest.fixture(autouse=True)
def retry_every_call(monkeypatch):
    """Retry the journal at every call (30 s apart by default), so a return is seen next round."""
    import mlflow

    monkeypatch.setenv("PFL_TRACKING_RETRY_SECONDS", "0")
    yield
    mlflow.set_tracking_uri(None)


def spec(tmp_path: Path, name: str, **overrides) -> str:
    raw = tiny_raw(**{"experiment.rounds": ROUNDS, "tracking.enabled": True, "tracking.progress": False,
                      "tracking.experiment": name, "executor.name": "sequential",
                      "checkpoint.dir": str(tmp_path / "checkpoints"), **overrides})
    return write_spec(tmp_path, raw, f"{name}.toml")


def at_rounds(monkeypatch, actions: dict):
    """Call ``actions[r]()`` as round r starts, before it runs; returns the unpatched method."""
    run_round = engine_module.Engine.run_round

    def patched(self, ctx, round, *args, **kwargs):
        if round in actions:
            actions[round]()
        return run_round(self, ctx, round, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "run_round", patched)
    return run_round


def experiment_run(db: Path, experiment: str) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        runs = con.execute("select r.run_uuid from runs r join experiments e on r.experiment_id = e.experiment_id "
                           "where e.name = ?", (experiment,)).fetchall()
    assert len(runs) == 1, runs
    return runs[0][0]


def metrics(db: Path, run_id: str) -> list[tuple[str, int, float]]:
    """Every (key, step, value) of the run, wall-clock keys left out; a value logged twice is
    there twice."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("select key, step, value from metrics where run_uuid = ?", (run_id,)).fetchall()
    return sorted((k, s, v) for k, s, v in rows if k not in WALL_CLOCK)


def status(db: Path, run_id: str) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute("select status from runs where run_uuid = ?", (run_id,)).fetchone()[0]


def artifacts(uri: str, run_id: str) -> set[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)

    def walk(path=None):
        out = set()
        for item in client.list_artifacts(run_id, path):
            out |= walk(item.path) if item.is_dir else {item.path}
        return out

    return walk()


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory) -> list[tuple[str, int, float]]:
    """The metrics of the same run logged to a store that never goes away."""
    tmp_path = tmp_path_factory.mktemp("reference")
    db = tmp_path / "reference.db"
    shutil.copyfile(server.empty_store, db)
    assert run_main([spec(tmp_path, "outage"), "--quiet", "--tracking-uri", f"sqlite:///{db}"]) == 0
    logged = metrics(db, experiment_run(db, "outage"))
    assert {step for _, step, _ in logged} == set(range(1, ROUNDS + 1))
    return logged


def test_a_server_that_goes_away_and_returns_loses_no_metric(server, reference, tmp_path, monkeypatch, capsys):
    seen = {}

    def journal_folders():
        return sorted((tmp_path / "checkpoints").glob(f"*/{journal.CHECKPOINT_SUBFOLDER}"))

    def restart():
        seen["journal while away"] = journal_folders()
        server.start()

    at_rounds(monkeypatch, {2: server.stop, 4: restart,
                            ROUNDS: lambda: seen.setdefault("journal after the return", journal_folders())})
    code = run_main([spec(tmp_path, "outage"), "--quiet", "--tracking-uri", server.uri])
    err = capsys.readouterr().err
    assert code == 0, err
    run_id = experiment_run(server.db, "outage")
    # the outage was journaled beside the checkpoints and said once, with the round
    assert seen["journal while away"] == [tmp_path / "checkpoints" / run_id / "journal"]
    assert err.count("unreachable") == 1 and "unreachable at round 2" in err, err
    assert seen["journal after the return"] == [], "replayed when the server returned, not only at the end"
    assert metrics(server.db, run_id) == reference  # every key, every step, once, same values
    assert status(server.db, run_id) == "FINISHED"
    assert not journal_folders()


def test_a_server_that_never_returns_finishes_the_run_and_replay_fills_the_store(
        server, reference, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no checkpoints: the journal goes to ./pfl-journal/<run id>
    at_rounds(monkeypatch, {2: server.stop})
    try:
        code = run_main([spec(tmp_path, "gone", **{"checkpoint.enabled": False}), "--quiet",
                         "--tracking-uri", server.uri])
        err = capsys.readouterr().err
        assert code == EXIT_TRACKING_PENDING, err
        run_id = experiment_run(server.db, "gone")
        command = re.findall(r"send it when the server is back with: (pfl replay \S+)$", err, re.M)
        assert command == [f"pfl replay {tmp_path / 'pfl-journal' / run_id}"], err
        # the run trained to the end; the store holds round 1 only, the rest waits in the journal
        assert {step for _, step, _ in metrics(server.db, run_id)} == {1}
        assert status(server.db, run_id) == "RUNNING"
        # replaying while the server is still away keeps the journal and says so
        assert main(command[0].split()[1:]) == 3
        assert "unreachable" in capsys.readouterr().err
    finally:
        server.start()
    assert main(command[0].split()[1:]) == 0
    assert "removed" in capsys.readouterr().err
    assert metrics(server.db, run_id) == reference
    assert status(server.db, run_id) == "FINISHED"
    assert artifacts(server.uri, run_id) >= ARTIFACTS
    assert not (tmp_path / "pfl-journal").exists()


def test_a_run_that_crashes_while_the_server_is_away_is_replayed_on_resume(
        server, reference, tmp_path, monkeypatch, capsys):
    def crash():
        raise RuntimeError("simulated crash")  # no checkpoint written on the way out: the last is round 2

    run_round = at_rounds(monkeypatch, {2: server.stop, 4: crash})
    try:
        code = run_main([spec(tmp_path, "resumed", **{"checkpoint.every": 2}), "--quiet",
                         "--tracking-uri", server.uri])
        err = capsys.readouterr().err
        assert code == 1 and "simulated crash" in err, err
    finally:
        server.start()
    run_id = experiment_run(server.db, "resumed")
    folder = tmp_path / "checkpoints" / run_id
    assert [p.name for p in checkpoints(folder)] == ["round-000002"]
    # rounds 2 and 3 and the FAILED status wait in the journal
    assert {step for _, step, _ in metrics(server.db, run_id)} == {1}
    monkeypatch.setattr(engine_module.Engine, "run_round", run_round)  # rounds run as usual again
    during = {}
    at_rounds(monkeypatch, {4: lambda: during.setdefault("status", status(server.db, run_id))})
    assert run_main(["--resume", str(folder), "--quiet"]) == 0, capsys.readouterr().err
    assert during["status"] == "RUNNING"  # the journal's FAILED was not applied to the resumed run
    # rounds 2-3 from the journal, rounds 4-5 from the resumed run; round 3, run again from the
    # round-2 checkpoint, is not logged a second time
    assert metrics(server.db, run_id) == reference
    assert status(server.db, run_id) == "FINISHED"
    assert not (folder / "journal").exists()


def test_replaying_a_journal_twice_stores_each_metric_once(server, tmp_path):
    """A call the store applied but whose answer was lost is journaled too; replayed, it must
    not be stored again: records keep the timestamp of their first attempt."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    experiment = client.create_experiment("twice")
    run_id = client.create_run(experiment).info.run_id
    first = journal.Journal(tmp_path / "first", server.uri)
    for step in (1, 2):
        first.add({"op": "metrics", "run_id": run_id, "step": step, "timestamp": journal.now_ms(),
                   "metrics": {"acc_mean": step / 10, "loss_mean": float(step)}})
    first.add({"op": "text", "run_id": run_id, "text": "a,b\n", "artifact_file": "results/x.csv"})
    first.add({"op": "end", "run_id": run_id, "status": "FINISHED", "end_time": journal.now_ms()})
    second = journal.Journal(tmp_path / "second")
    shutil.copytree(first.folder, second.folder)
    assert first.replay(client) == 4 and not first.folder.exists()
    assert second.replay(client) == 4  # the two metrics records went as one batch, counted as two
    assert metrics(server.db, run_id) == [("acc_mean", 1, 0.1), ("acc_mean", 2, 0.2),
                                          ("loss_mean", 1, 1.0), ("loss_mean", 2, 2.0)]
    assert status(server.db, run_id) == "FINISHED"
    assert artifacts(server.uri, run_id) == {"results/x.csv"}


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.txt", "artifacts/../../outside.txt", "link/x.txt", "",
                                  5, None])
def test_replay_refuses_a_journal_that_names_a_file_outside_it(tmp_path, capsys, name):
    """A crafted journal whose artifact record points outside its folder (absolute, ``..``, a
    link out) is refused in one line before anything of it is sent."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("crafted", (tmp_path / "art").as_uri())).info.run_id
    (tmp_path / "outside.txt").write_text("not the journal's")
    folder = tmp_path / "runs" / "journal"
    crafted = journal.Journal(folder, uri)
    crafted.add({"op": "metrics", "run_id": run_id, "step": 1, "timestamp": journal.now_ms(),
                 "metrics": {"acc_mean": 0.5}})
    (folder / "link").symlink_to(tmp_path)
    with open(crafted.records_file, "a", encoding="utf-8") as f:
        f.write(journal.json.dumps({"op": "artifact", "run_id": run_id, "file": name, "artifact_path": None}) + "\n")
    capsys.readouterr()  # MLflow's own lines from creating the store, when this test runs first
    assert main(["replay", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"pfl replay: error: {folder}: a journal record names a file outside the journal ("), err
    assert err.endswith("); refused: nothing of this journal was sent"), err
    assert client.get_run(run_id).data.metrics == {}  # not even the metric before it
    assert not client.list_artifacts(run_id) and crafted.pending()


def test_replay_sends_the_files_a_journal_wrote_itself(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("own", (tmp_path / "art").as_uri())).info.run_id
    own = journal.Journal(tmp_path / "journal", uri)
    own.add({"op": "text", "run_id": run_id, "text": "a,b\n", "artifact_file": "results/x.csv"})
    assert main(["replay", str(own.folder)]) == 0
    assert [a.path for a in client.list_artifacts(run_id, "results")] == ["results/x.csv"]


# -- a record the store refuses is not an outage (issue 33) ----------------------------------------


@pytest.fixture(scope="module")
def empty_sqlite_store(tmp_path_factory) -> Path:
    """An empty SQLite store, made once: creating MLflow's tables takes seconds."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("empty") / "store.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def refused_journal(tmp_path, store: Path, case: str):
    """A SQLite store with one run, and a journal for it (metrics of step 1, then one more record)
    that the store refuses: returns (uri, client, run id, journal, the refused record's words,
    MLflow's error code). Only a deleted run refuses the first record too."""
    from mlflow.tracking import MlflowClient

    shutil.copyfile(store, tmp_path / "store.db")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("refused", (tmp_path / "art").as_uri())).info.run_id
    kept = journal.Journal(tmp_path / "journal", uri)
    kept.add({"op": "metrics", "run_id": run_id, "step": 1, "timestamp": journal.now_ms(),
              "metrics": {"acc_mean": 0.5}})
    if case == "changed param":  # the run was logged again meanwhile, with another lr
        client.log_param(run_id, "lr", "0.1")
        kept.add({"op": "params", "run_id": run_id, "params": {"mu": "1", "lr": "0.2"}})
        return uri, client, run_id, kept, 'params record (key "lr" = "0.2")', "INVALID_PARAMETER_VALUE"
    if case == "deleted run":  # deleted in the UI during the outage
        kept.add({"op": "end", "run_id": run_id, "status": "FINISHED", "end_time": journal.now_ms()})
        client.delete_run(run_id)
        return uri, client, run_id, kept, 'metrics record of step 1 (key "acc_mean" = 0.5)', "INVALID_PARAMETER_VALUE"
    if case == "unknown run":  # a journal replayed into another store (--tracking-uri)
        kept.add({"op": "tag", "run_id": "0" * 32, "key": "pfl.note", "value": "x"})
        return uri, client, "0" * 32, kept, 'tag record (key "pfl.note" = "x")', "RESOURCE_DOES_NOT_EXIST"
    # a value SQLite cannot hold: MLflow's INTERNAL_ERROR raised here, not a server's HTTP 500
    kept.add({"op": "metrics", "run_id": run_id, "step": 2**70, "timestamp": journal.now_ms(),
              "metrics": {"loss_mean": 1.0}})
    return uri, client, run_id, kept, f'metrics record of step {2**70} (key "loss_mean" = 1.0)', "INTERNAL_ERROR"


@pytest.mark.parametrize("case", ["changed param", "deleted run", "unknown run", "value out of range"])
def test_replay_a_record_the_store_refuses_names_it_in_one_line_and_keeps_the_journal(
        tmp_path, capsys, empty_sqlite_store, case):
    uri, client, run_id, kept, words, code = refused_journal(tmp_path, empty_sqlite_store, case)
    left = kept.records()[1:] if case != "deleted run" else kept.records()
    capsys.readouterr()  # MLflow's own lines from creating the store
    assert main(["replay", str(kept.folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"pfl replay: error: {kept.folder}: the store {uri} refused the {words} of run {run_id}: "
                          f"{code}: "), err
    assert err.endswith(f"; the journal is kept ({len(left)} of 2 records left, this one first)"), err
    assert "unreachable" not in err and "cannot be written" not in err
    assert kept.records() == left  # nothing lost: the refused record stays, first
    if case in ("changed param", "value out of range"):  # what the store took before the refusal is in it
        assert client.get_run(run_id).data.metrics == {"acc_mean": 0.5}
    if case == "changed param":
        assert client.get_run(run_id).data.params == {"lr": "0.1", "mu": "1"}


def test_the_refusal_is_said_for_the_record_refused_not_the_batch_it_went_in(tmp_path, empty_sqlite_store):
    """Metrics and params of a run go in one log_batch; the store refuses its changed param:
    the line names the param (not "metrics of step 1"), and the metrics are sent."""
    uri, client, run_id, kept, words, _ = refused_journal(tmp_path, empty_sqlite_store, "changed param")
    assert journal.batch_group(kept.records(), 0) == 2  # one request for both
    with pytest.raises(journal.RecordRefused) as info:
        kept.replay(client)
    assert (info.value.record["op"], info.value.key) == ("params", "lr")
    assert str(info.value).startswith(f"{words} of run {run_id}: INVALID_PARAMETER_VALUE: Changing param values")
    assert client.get_run(run_id).data.metrics == {"acc_mean": 0.5}
    assert [r["op"] for r in kept.records()] == ["params"]


def test_replay_to_a_server_that_is_away_keeps_the_journal_and_says_to_retry(tmp_path, capsys):
    with socket.socket() as probe:  # a port nothing listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{probe.getsockname()[1]}"
    kept = journal.Journal(tmp_path / "journal", uri)
    kept.add({"op": "metrics", "run_id": "1" * 32, "step": 1, "timestamp": journal.now_ms(), "metrics": {"a": 0.5}})
    assert main(["replay", str(kept.folder)]) == 3
    err = capsys.readouterr().err.strip()
    assert err == (f"pfl replay: tracking server {uri} unreachable ([Errno 111] Connection refused); {kept.folder} is "
                   f"kept (1 of 1 records left): run pfl replay {kept.folder} again when the server is back"), err
    assert kept.pending()


def outage_answer(status: int, body: str):
    """A local HTTP server that answers every request with ``status`` and ``body``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status,body", [
    (503, "<html>Service Unavailable</html>"),  # a proxy before a server that is down
    (500, '{"error_code": "INTERNAL_ERROR", "message": "database is locked"}'),
    (501, '{"error_code": "NOT_IMPLEMENTED", "message": "later"}'),  # a 5xx MLflow does not retry
])
def test_replay_to_a_server_answering_5xx_is_an_outage(tmp_path, capsys, status, body):
    server = outage_answer(status, body)
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        kept = journal.Journal(tmp_path / "journal", uri)
        kept.add({"op": "tag", "run_id": "1" * 32, "key": "k", "value": "v"})
        assert main(["replay", str(kept.folder)]) == 3
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pfl replay: tracking server {uri} unreachable ("), err
    assert err.endswith("again when the server is back") and kept.pending(), err


def test_which_store_errors_are_outages():
    import requests
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_STATE, TEMPORARILY_UNAVAILABLE

    def wrapped(cause: BaseException) -> MlflowException:
        try:
            raise cause
        except BaseException:  # as MLflow wraps what it met: the cause is the new one's context
            try:
                raise MlflowException(f"API request failed with exception {cause}", error_code=INTERNAL_ERROR)
            except MlflowException as exc:
                return exc

    outages = [requests.exceptions.ConnectionError("refused"), requests.exceptions.ReadTimeout("timed out"),
               wrapped(requests.exceptions.ConnectionError("refused")), TimeoutError("timed out"),
               RestException({"error_code": "INTERNAL_ERROR", "message": "boom"}),  # a server's 500
               RestException({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "slow down"}),
               MlflowException("API request to endpoint /x failed with error code 502 != 200. Response body: ''"),
               MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE),
               OSError(28, "No space left on device")]
    refusals = [RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values"}),
                RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run not found"}),
                wrapped(OverflowError("Python int too large to convert to SQLite INTEGER")),  # local 500
                MlflowException("Run 'x' metadata is in invalid state.", error_code=INVALID_STATE),
                ValueError("could not convert string to float: 'abc'"), OSError(13, "Permission denied")]
    assert [journal.is_outage(exc) for exc in outages] == [True] * len(outages)
    assert [journal.is_outage(exc) for exc in refusals] == [False] * len(refusals)


def test_a_run_whose_journal_the_store_refuses_says_refused_not_unreachable(tmp_path, empty_sqlite_store, capsys):
    """The end of a run replays its journal one last time: a record the store refuses (a param
    changed meanwhile) is said as a refusal with the command that names it, not as a store
    that "still cannot be written" (it can: waiting would never send that record)."""
    import mlflow

    from pfl_core.tracking.tracker import MlflowTracker

    shutil.copyfile(empty_sqlite_store, tmp_path / "store.db")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    tracker = MlflowTracker(uri)
    tracker.start("refused", "r", {"lr": "0.1"}, {})
    run_id = tracker.run_id
    tracker.journal = journal.Journal(tmp_path / "journal", uri)  # what an outage left: a changed param
    tracker.journal.add({"op": "params", "run_id": run_id, "params": {"lr": "0.2"}})
    tracker.end()
    mlflow.set_tracking_uri(None)
    err = capsys.readouterr().err
    assert f"refused a call of run {run_id}" in err and "INVALID_PARAMETER_VALUE" in err, err
    assert f"pfl replay {tmp_path / 'journal'} names the record refused" in err
    assert "cannot be written" not in err and "unreachable" not in err
    assert journal.Journal(tmp_path / "journal", uri).pending()  # kept
