"""What a run could not log because its MLflow store was unreachable, kept on disk and sent later.

When a tracking call fails because the store went away (an HTTP server that refuses or times
out, a SQLite file another process holds locked), :class:`pfl_core.tracking.MlflowTracker`
appends the call to a journal instead of stopping the run: a folder holding ``journal.jsonl``
(one JSON record per call, in order: metrics with their step and timestamp, params, tags,
artifacts, the run's end status), ``journal.json`` (the store's URI) and ``artifacts/`` (the
files of the artifact calls, written when they failed). The journal is replayed, in order, when
the store answers again (tried at most every ``PFL_TRACKING_RETRY_SECONDS``, 30 s by default,
so an outage does not slow the rounds), at the end of the run, on ``pfl-run --resume``, or by
``pfl replay JOURNAL``. Metrics keep the timestamp of their first attempt, so a record the
store did receive before its answer was lost is not stored twice (MLflow drops a metric equal
in key, value, step and timestamp); params, tags and artifacts are idempotent. A journal fully
sent is deleted.

Where it is: ``<the run's checkpoint folder>/journal``; a run without checkpoints (and a sweep's
or seed set's parent run) uses ``pfl-journal/<run id>`` beside a SQLite store's file, or in the
working directory for a tracking server.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from pfl_core.errors import PflError
from pfl_core.state.locations import beside_store

FORMAT = "pfl-journal/1"
RECORDS = "journal.jsonl"
META = "journal.json"
ARTIFACTS = "artifacts"
CHECKPOINT_SUBFOLDER = "journal"  # inside a run's checkpoint folder
FALLBACK_FOLDER = "pfl-journal"  # <this>/<run id> when the run has no checkpoint folder
METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch request

# MLflow's HTTP client retries a failed request 7 times with exponential back-off (minutes) and
# waits 120 s for an answer. pfl's own calls use these instead (a variable the user set wins):
# one try, 10 s, so an outage costs at most a timeout per retry of the journal.
SHORT_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

# Folders of journals that still hold records at the end of their run (the command line exits 3).
UNSENT: list[Path] = []


@contextlib.contextmanager
def short_http(force: dict[str, str] | None = None) -> Iterator[None]:
    """MLflow HTTP calls inside fail fast (:data:`SHORT_HTTP`; ``force``: these values even
    over the user's own). The environment is restored afterwards."""
    wanted = {name: value for name, value in SHORT_HTTP.items() if name not in os.environ}
    wanted.update(force or {})
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# A full disk, a quota reached, a read-only file system: the store (or its artifact folder)
# cannot be written now; the journal keeps the calls until it can.
UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


# MLflow's error codes for a store that is busy or away, whatever kind of store raised them (a SQLite
# store says TEMPORARILY_UNAVAILABLE for a locked or full database); every other code is a refusal.
TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED"}


def is_outage(exc: BaseException) -> bool:
    """Whether a tracking call failed because the store is away, overloaded or cannot be written
    (connection refused or reset, timeout, a tracking server's HTTP 5xx or 429, SQLite "database
    is locked", a full or read-only disk under the store or its artifacts), not because the store
    refuses the call itself (a changed param, a deleted or unknown run, a value it cannot hold),
    which is raised as before. MLflow wraps the error it met in its own exception: the chain of
    causes is read."""
    from mlflow.exceptions import MlflowException

    if any(_store_away(cause) for cause in _causes(exc)):
        return True
    if not isinstance(exc, MlflowException):
        return False
    if exc.error_code in TRANSIENT_CODES:
        return True
    # A server's 5xx (its database locked, a proxy before it down) is an outage; the same code
    # raised here by a local store (INTERNAL_ERROR around a value SQLite cannot hold) is a refusal.
    return _from_server(exc) and exc.get_http_status_code() >= 500


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _store_away(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
        return True
    try:
        import requests

        if isinstance(exc, requests.exceptions.RequestException):
            return True
    except ImportError:  # pragma: no cover - requests comes with mlflow
        pass
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # SQLite's locked, full or read-only database (sqlite3's own, or as SQLAlchemy raises it)
    return type(exc).__name__ == "OperationalError" and type(exc).__module__.startswith(("sqlalchemy", "sqlite3"))


def _from_server(exc) -> bool:
    """An MLflow exception made of a tracking server's answer (its JSON error, or an HTTP error
    page of a proxy before it)."""
    from mlflow.exceptions import RestException

    return isinstance(exc, RestException) or str(exc.message).startswith("API request to")


def reason(exc: BaseException) -> str:
    """The useful part of a store failure, short: ``[Errno 111] Connection refused``."""
    import re

    text = " ".join(str(exc).split())
    found = re.findall(r"(\[Errno -?\d+\][^\"')]*|Connection aborted|Connection reset by peer|Remote end closed "
                       r"connection without response|Read timed out|timed out|database is locked|error code \d+|"
                       r"too many \d+ error responses|database or disk is full|attempt to write a readonly database|"
                       r"disk I/O error)", text)
    return found[-1].strip()[:160] if found else (text[:160] or type(exc).__name__)


def failing(uri: str, still: bool = False) -> str:
    """What a store that misses calls is: a server is unreachable; a SQLite file (locked, on a
    full or read-only disk) cannot be written."""
    if uri.startswith(("http://", "https://")):
        return "is still unreachable" if still else "unreachable"
    return "still cannot be written" if still else "cannot be written"


def when_back(uri: str) -> str:
    return "when the server is back" if uri.startswith(("http://", "https://")) else "when the store can be written again"


def fallback_folder(tracking_uri: str, run_id: str) -> Path:
    """``pfl-journal/<run id>`` beside a SQLite store's file, else in the working directory."""
    return beside_store(tracking_uri) / FALLBACK_FOLDER / run_id


def now_ms() -> int:
    return int(time.time() * 1000)


class Journal:
    """One journal folder: records appended in order, replayed in order."""

    def __init__(self, folder: Path | str, tracking_uri: str | None = None):
        self.folder = Path(folder)
        self.tracking_uri = tracking_uri

    @property
    def records_file(self) -> Path:
        return self.folder / RECORDS

    def pending(self) -> bool:
        return self.records_file.is_file() and self.records_file.stat().st_size > 0

    def stored_uri(self) -> str | None:
        try:
            return json.loads((self.folder / META).read_text(encoding="utf-8")).get("tracking_uri")
        except (OSError, ValueError):
            return None

    def add(self, record: dict) -> None:
        """Append one call. Artifact calls (``text``, ``figure``) become an ``artifact`` record of
        a file written now into ``artifacts/``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = self.folder / META
        if not meta.exists():
            meta.write_text(json.dumps({"format": FORMAT, "tracking_uri": self.tracking_uri}) + "\n",
                            encoding="utf-8")
        op = record["op"]
        if op in ("text", "figure"):
            artifact_file = record["artifact_file"]
            directory, _, name = artifact_file.rpartition("/")
            relative = f"{ARTIFACTS}/{uuid.uuid4().hex[:12]}/{name}"
            path = self.folder / relative
            path.parent.mkdir(parents=True)
            if op == "text":
                path.write_text(record["text"], encoding="utf-8")
            else:
                record["figure"].savefig(path)  # what MLflow's log_figure does with a matplotlib figure
            record = {"op": "artifact", "run_id": record["run_id"], "file": relative,
                      "artifact_path": directory or None}
        # held calls sent together (a metric_batch) are kept as the records they are
        lines = record["records"] if op == "metric_batch" else [record]
        with open(self.records_file, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))

    def records(self) -> list[dict]:
        """The records in order; a last line cut by a kill mid-write is left out."""
        if not self.records_file.is_file():
            return []
        out = []
        for line in self.records_file.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def replay(self, client, keep: Callable[[dict], bool] = lambda record: True) -> int:
        """Send the records (those ``keep`` accepts; the others are dropped) to ``client``
        (an ``MlflowClient``) in order, consecutive metrics of a run in one batch. On a failure
        the records not sent are written back and the exception propagates (a record the store
        refuses as :class:`RecordRefused`, first in the journal); when all are sent, the folder
        is deleted. Returns the number of records sent."""
        records = [r for r in self.records() if keep(r)]
        sent = 0
        try:
            while sent < len(records):
                group = batch_group(records, sent)
                try:
                    if group > 1:
                        send_batch(client, records[sent:sent + group])
                    else:
                        send(client, records[sent], self.folder)
                except PflError:
                    raise
                except Exception as exc:
                    if is_outage(exc):
                        raise
                    # refused: the group again record by record, key by key, so what the store
                    # takes is sent and what it refuses is named (RecordRefused)
                    for record in records[sent:sent + group]:
                        send_alone(client, record, self.folder)
                        sent += 1
                    continue
                sent += group
        except BaseException:
            self._rewrite(records[sent:])
            raise
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.folder.parent.name == FALLBACK_FOLDER:
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the last run's journal: no empty pfl-journal/ left
        return sent

    def _rewrite(self, records: list[dict]) -> None:
        tmp = self.folder / f".{RECORDS}.tmp-{os.getpid()}"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, self.records_file)


BATCHED = ("metrics", "params", "tag")  # the calls one log_batch can carry together
PARAMS_PER_BATCH = TAGS_PER_BATCH = 100  # MLflow's limits for one log_batch request


def batch_group(records: list[dict], start: int) -> int:
    """How many records from ``start`` are metrics, params and tags of the same run that one
    log_batch takes (within MLflow's limits per request)."""
    first = records[start]
    if first["op"] not in BATCHED:
        return 1
    end, counts = start, {"metrics": 0, "params": 0, "tag": 0}
    limits = {"metrics": METRICS_PER_BATCH, "params": PARAMS_PER_BATCH, "tag": TAGS_PER_BATCH}
    while end < len(records) and records[end]["op"] in BATCHED and records[end]["run_id"] == first["run_id"]:
        op = records[end]["op"]
        size = len(records[end][op]) if op != "tag" else 1
        if end > start and (counts[op] + size > limits[op] or sum(counts.values()) + size > METRICS_PER_BATCH):
            break
        counts[op] += size
        end += 1
    return end - start


def send_batch(client, records: list[dict]) -> None:
    """Metrics, params and tags records of one run in one log_batch."""
    from mlflow.entities import Metric, Param, RunTag

    metrics = [Metric(key, float(value), r["timestamp"], r["step"]) for r in records if r["op"] == "metrics"
               for key, value in r["metrics"].items()]
    params = [Param(k, v) for r in records if r["op"] == "params" for k, v in r["params"].items()]
    tags = [RunTag(r["key"], r["value"]) for r in records if r["op"] == "tag"]
    client.log_batch(records[0]["run_id"], metrics=metrics, params=params, tags=tags)


def send(client, record: dict, folder: Path | None = None) -> None:
    """Perform one tracking call (a record) with ``client``, an ``MlflowClient``."""
    op, run_id = record["op"], record["run_id"]
    if op == "metrics":
        send_batch(client, [record])
    elif op == "metric_batch":  # held metrics, params and tags
        send_batch(client, record["records"])
    elif op == "params":
        from mlflow.entities import Param

        client.log_batch(run_id, params=[Param(k, v) for k, v in record["params"].items()])
    elif op == "tag":
        client.set_tag(run_id, record["key"], record["value"])
    elif op == "delete_tag":
        client.delete_tag(run_id, record["key"])
    elif op == "text":
        client.log_text(run_id, record["text"], record["artifact_file"])
    elif op == "figure":
        client.log_figure(run_id, record["figure"], record["artifact_file"])
    elif op == "artifact":
        client.log_artifact(run_id, str(artifact_file(folder, record)), record["artifact_path"])
    elif op == "end":
        client.set_terminated(run_id, record["status"], record["end_time"])
    else:
        raise PflError(f"unknown journal record {op!r} (written by another pfl version?)")


class RecordRefused(Exception):
    """The store refused one record of a journal (``key``: the param, metric or tag it refused)
    for ``cause``, MLflow's error: not an outage, retrying cannot send it."""

    def __init__(self, record: dict, key, cause: BaseException):
        self.record, self.key, self.cause = record, key, cause
        super().__init__(f"{describe(record, key)}: {refusal_reason(cause)}")


def send_alone(client, record: dict, folder: Path | None = None) -> None:
    """Send one record of a refused batch, params and metrics key by key: returns when the store
    took all of it, raises :class:`RecordRefused` naming the first key it refuses. What it took
    before that is not stored twice on the next replay (params and tags are idempotent, a metric
    keeps its timestamp)."""
    op = record["op"]
    if op in ("params", "metrics"):
        parts = [(key, {**record, op: {key: value}}) for key, value in record[op].items()]
    else:
        parts = [(record.get("key"), record)]
    for key, part in parts:
        try:
            send(client, part, folder)
        except PflError:
            raise
        except Exception as exc:
            if is_outage(exc):
                raise
            raise RecordRefused(record, key, exc) from exc


REFUSAL_CHARS = 400  # MLflow's reason, whole up to this (a changed param's message holds both values)


def refusal_reason(exc: BaseException) -> str:
    """MLflow's own words for a refusal, on one line, with its error code:
    ``RESOURCE_DOES_NOT_EXIST: Run with id=... not found``."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        text = " ".join(str(exc.message).split())
        code = str(exc.error_code)
        if not text.startswith(code):  # a server's answer already starts with its code
            text = f"{code}: {text}"
    else:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= REFUSAL_CHARS else text[:REFUSAL_CHARS - 3] + "..."


def artifact_file(folder: Path, record: dict) -> Path:
    """The file an ``artifact`` record sends: one the journal wrote, under its own folder. A
    record naming anything else (an absolute path, ``..``, a link out) is refused: a journal is
    data, and replaying one must never upload a file it does not hold."""
    name = record.get("file")
    inside = folder.resolve()
    path = (folder / name).resolve() if isinstance(name, str) and name else None
    if path is None or not path.is_relative_to(inside) or path == inside:
        raise PflError(f"{folder}: a journal record names a file outside the journal ({shown_name(name)}); "
                       f"refused: nothing of this journal was sent")
    return path


def shown_name(value) -> str:
    return json.dumps(value, ensure_ascii=True)[:120]


def describe(record: dict, key=None) -> str:
    """A record in a few words, for an error line: its op, the key refused (``key``) and its run:
    ``params record (key "lr" = "0.2") of run 4f42...``."""
    op, run_id = record.get("op"), record.get("run_id")
    values = record.get(op) if op in ("params", "metrics") and isinstance(record.get(op), dict) else {}
    if op == "metrics":
        where = f"metrics record of step {record.get('step')}"
    elif op == "artifact":
        where = f"artifact record {shown_name(str(record.get('file', '')).rpartition('/')[2])}"
    elif op == "end":
        where = f"end record (status {record.get('status')})"
    else:
        where = f"{op} record"
    if key is not None and op in ("params", "metrics", "tag", "delete_tag"):
        value = values.get(key, record.get("value")) if op != "delete_tag" else None
        where += f" (key {shown_name(key)}" + (f" = {shown_name(value)}" if value is not None else "") + ")"
    return f"{where} of run {run_id}"


# -- pfl replay ----------------------------------------------------------------------------------


def journal_folders(path: Path) -> list[Path]:
    """The journals at ``path``: it, or every journal under it (a run's checkpoint folder, a
    ``pfl-journal`` folder)."""
    if (path / RECORDS).is_file() or (path / META).is_file():
        return [path]
    return sorted(p.parent for p in path.rglob(RECORDS))


def replay_main(paths: list[str], tracking_uri: str | None = None, out=None) -> int:
    """``pfl replay JOURNAL ... [--tracking-uri URI]``: send what runs could not log. Exit 0
    when everything was sent, 3 when a store is still unreachable (the journals are kept),
    PflError (exit 2) for a path that holds no journal or a record the store refuses (named with
    its op, key, run and MLflow's reason; the journal is kept, that record first)."""
    import mlflow

    out = out or sys.stderr
    folders = []
    for path in paths:
        found = journal_folders(Path(path).expanduser())
        if not found:
            raise PflError(f"{path}: no journal there (a folder holding {RECORDS})")
        folders += found
    waiting = []
    for folder in folders:
        journal = Journal(folder)
        uri = tracking_uri or journal.stored_uri()
        if not uri:
            raise PflError(f"{folder}: the journal does not say its tracking store; give --tracking-uri")
        records = journal.records()
        for record in records:  # every file it would send is its own, before anything is sent
            if record.get("op") == "artifact":
                artifact_file(folder, record)
        count = len(records)
        try:
            with short_http():
                sent = journal.replay(mlflow.MlflowClient(tracking_uri=uri))
        except PflError:
            raise
        except RecordRefused as refused:
            raise PflError(f"{folder}: the store {uri} refused the {refused}; the journal is kept "
                           f"({len(journal.records())} of {count} records left, this one first)") from None
        except Exception as exc:
            if not is_outage(exc):  # refused before any record (the store itself)
                raise PflError(f"{folder}: the store {uri} refused the journal: {refusal_reason(exc)}; the journal "
                               f"is kept") from None
            waiting.append(folder)
            store = "tracking server" if uri.startswith(("http://", "https://")) else "tracking store"
            print(f"pfl replay: {store} {uri} {failing(uri)} ({reason(exc)}); {folder} is kept "
                  f"({len(journal.records())} of {count} records left): run pfl replay "
                  f"{shlex.quote(str(folder))} again {when_back(uri)}", file=out)
            continue
        print(f"pfl replay: sent {sent} records to {uri}; {folder} removed", file=out)
    return 3 if waiting else 0
