"""Before any training: is the tracking store usable? (a server probe, a read-only look at a
SQLite file)"""

from __future__ import annotations

from pfl_core.errors import PflError
from pfl_core.state.locations import sqlite_file
from pfl_core.tracking import journal
from pfl_core.tracking.tracker import one_line

PROBE_TIMEOUT_S = 5  # the probe of an HTTP tracking server: one try, at most this long


def check_store(section, uri_override: str | None = None) -> None:
    """Before any training: is the tracking store usable? An unreachable server is said in one
    line within seconds (MLflow itself retries for minutes); a SQLite file that is not an
    MLflow store is refused untouched (MLflow would add its tables to it); a half-built store
    (its creation interrupted) is named with what to do. Raises PflError."""
    if not section.enabled:
        return
    import mlflow

    uri = uri_override or section.uri or mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        _probe_server(uri)
    elif uri.startswith("sqlite:///"):
        _check_sqlite(uri)


def _probe_server(uri: str) -> None:
    import mlflow

    try:
        with journal.short_http(force={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                                       "MLFLOW_HTTP_REQUEST_TIMEOUT": str(PROBE_TIMEOUT_S)}):
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as exc:
        reason = _connection_reason(str(exc))
        raise PflError(f"the MLflow tracking server {uri} cannot be reached ({reason}); start it, fix "
                       f"tracking.uri / --tracking-uri, or run with --no-tracking") from None


def _connection_reason(text: str) -> str:
    """The useful end of urllib3's nested message: ``[Errno 111] Connection refused``,
    ``Failed to resolve 'host' (...)``, ``Read timed out``; else the message's start."""
    import re

    found = re.findall(r"(Failed to resolve [^()]*\([^()]*\)|\[Errno -?\d+\][^\"')]*|timed out[^\"')]*)", text)
    return found[-1].strip() if found else one_line(Exception(text))[:160]


MLFLOW_TABLES = {"experiments", "runs", "metrics", "params", "tags", "alembic_version"}


def _check_sqlite(uri: str) -> None:
    """Read-only look at a SQLite store (never modified here)."""
    import sqlite3

    db = sqlite_file(uri)
    if db is None:
        return
    where = f"tracking.uri {uri}"
    if not db.exists():
        if not db.parent.is_dir():
            raise PflError(f"{where}: the directory {db.parent} does not exist")
        return  # MLflow creates it
    if db.is_dir():
        raise PflError(f"{where}: {db} is a directory, not a SQLite file")
    if db.stat().st_size == 0:
        return  # an empty file: MLflow creates its tables in it
    try:
        con = sqlite3.connect(f"file:{db.resolve()}?mode=ro", uri=True, timeout=5)
        try:
            tables = {row[0] for row in con.execute("select name from sqlite_master where type = 'table'")}
            revision = (con.execute("select version_num from alembic_version").fetchall()
                        if "alembic_version" in tables else [])
            runs = con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise PflError(f"{where}: {db} is not an MLflow store ({exc}); it was left as it is: give another "
                       f"file (a new name is created)") from None
    ours = tables & MLFLOW_TABLES
    if not tables:
        return
    if not ours:
        raise PflError(f"{where}: {db} is a SQLite database of something else (tables "
                       f"{', '.join(sorted(tables)[:5])}), not an MLflow store; it was left as it is: "
                       f"give another file (a new name is created)")
    if not revision or not {"experiments", "runs"} <= tables:
        advice = (f"delete {db} and run again (it holds no runs)" if not runs else
                  f"back it up, then run: mlflow db upgrade {uri}")
        raise PflError(f"{where}: {db} is a half-built MLflow store (its creation was interrupted); {advice}")
