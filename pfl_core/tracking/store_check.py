"""Before any training: is the tracking store usable? (a server probe, a read-only look at a
SQLite file) And a new SQLite store is created whole or not at all, once, however many runs
start on it at the same time."""

from __future__ import annotations

import glob
import os
import re
import shutil
import uuid
from pathlib import Path

from pfl_core.errors import PflError
from pfl_core.state.locations import plain_uri, process_running, sqlite_file, sqlite_uri
from pfl_core.tracking import journal
from pfl_core.tracking.tracker import one_line, quiet_mlflow

DEFAULT_URI = "sqlite:///mlflow.db"  # MLflow 3's own default store: mlflow.db in the working directory
PROBE_TIMEOUT_S = 5  # the probe of an HTTP tracking server: one try, at most this long


def check_store(section, uri_override: str | None = None, create: bool = True) -> None:
    """Before any training: is the tracking store usable? An unreachable server is said in one
    line within seconds (MLflow itself retries for minutes); a SQLite file that is not an
    MLflow store is refused untouched (MLflow would add its tables to it); a half-built store
    (its creation interrupted) is named with the command that moves it aside. ``create``: a new
    SQLite store is made now (:func:`create_sqlite_store`). Raises PflError."""
    if not section.enabled:
        return
    if not create:  # a dry run: a look at a SQLite file only, without importing MLflow (slow)
        uri = uri_override or section.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        if uri.startswith("sqlite:///"):
            _check_sqlite(uri, check_revision=False)
        return
    import mlflow

    uri = plain_uri(uri_override or section.uri or mlflow.get_tracking_uri())
    if uri.startswith(("http://", "https://")):
        _probe_server(uri)
    elif uri.startswith("sqlite:///"):
        _check_sqlite(uri)
        create_sqlite_store(uri)


# the temporary store of a creation, and the files SQLite writes beside it while it is written
SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")
CREATING = re.compile(rf"^\.(.+)\.creating-(\d+)-[0-9a-f]+(?:{'|'.join(SQLITE_SIDE_FILES)})?$")


def create_sqlite_store(uri: str) -> None:
    """Create a new SQLite store whole: its tables are made in a temporary file beside it, which
    is then renamed to the store's name, under a file lock (filelock) that every ``pfl-run``
    starting on the same new store waits on. A signal at any moment leaves no store or a
    complete one (two runs started at once on a new store both failed, and a Ctrl-C during the
    creation left it half-built). The lock file (``<store>.lock``) stays beside the store."""
    from filelock import FileLock

    db = sqlite_file(uri)
    if db is None or _has_content(db):
        return
    try:
        with FileLock(f"{db}.lock", timeout=300):
            if _has_content(db):  # another run made it while this one waited
                return
            _remove_abandoned(db)
            # a new name each time: MLflow keeps a store it opened, by its URI, for the process
            tmp = db.with_name(f".{db.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                _fill_new_store(tmp)
                os.replace(tmp, db)
            finally:
                for path in (tmp, *(tmp.with_name(tmp.name + side) for side in SQLITE_SIDE_FILES)):
                    path.unlink(missing_ok=True)
    except Exception as exc:  # OSError, or SQLAlchemy's OperationalError "database or disk is full"
        if not (isinstance(exc, OSError) or journal.is_outage(exc)):
            raise
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else journal.reason(exc)
        raise PflError(f"tracking.uri {uri}: the store cannot be created in {db.parent} "
                       f"({why}); give another tracking.uri, or run with --no-tracking") from None


def _fill_new_store(path: Path) -> None:
    """MLflow's tables in the new file ``path``: a copy of this MLflow's template store
    (:func:`template_store`) with the default experiment MLflow would make now (its artifact
    location and times, the only row that differs between two new stores); MLflow's own
    creation (2 s of schema migrations) where no template can be kept."""
    template = template_store()
    if template is not None:
        shutil.copyfile(template, path)
        default_experiment = _default_experiment_row()
        if default_experiment is not None and _store_revision(path) is not None:
            import sqlite3

            con = sqlite3.connect(path)
            try:
                with con:
                    con.execute("update experiments set artifact_location = ?, creation_time = ?, "
                                "last_update_time = ? where experiment_id = 0", default_experiment)
            finally:
                con.close()
            return
        path.unlink()  # a template this MLflow cannot name the default experiment of: made afresh
    _mlflow_creates(path)


def _mlflow_creates(path: Path) -> None:
    import mlflow

    quiet_mlflow()
    mlflow.MlflowClient(tracking_uri=sqlite_uri(path.resolve())).search_experiments(max_results=1)


def _default_experiment_row() -> tuple[str, int, int] | None:
    """(artifact_location, creation_time, last_update_time) of the default experiment (id 0) that
    MLflow writes into a store it creates now from this directory (its ``_create_default_experiment``);
    None if MLflow's helpers moved."""
    try:
        from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
        from mlflow.tracking._tracking_service.utils import _SERVER_ARTIFACT_ROOT_ENV_VAR
        from mlflow.utils.time import get_current_time_millis
        from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local
    except ImportError:  # pragma: no cover - another MLflow: the store is made by MLflow itself
        return None
    root = resolve_uri_if_local(os.environ.get(_SERVER_ARTIFACT_ROOT_ENV_VAR, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH))
    now = get_current_time_millis()
    return str(append_to_uri_path(root, "0")), now, now


def template_cache() -> Path:
    """Where template stores are kept: ``$PFL_CACHE_DIR/mlflow-stores``, else
    ``$XDG_CACHE_HOME/pfl/mlflow-stores``, else ``~/.cache/pfl/mlflow-stores``."""
    base = os.environ.get("PFL_CACHE_DIR")
    if base:
        return Path(base) / "mlflow-stores"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pfl" / "mlflow-stores"


def template_store() -> Path | None:
    """A new, empty MLflow store of this MLflow version (its version and its migration scripts'
    names in the file name), made once (whole or not at all, under a file lock, as
    :func:`create_sqlite_store` makes a store) and copied for every new store after. None where
    it cannot be kept (no MLflow migrations found, an unwritable cache): the caller has MLflow
    create the store."""
    try:
        from filelock import FileLock

        template = _template_path()
        if template is None:
            return None
        if _store_revision(template) is not None:
            return template
        template.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{template}.lock", timeout=300):
            if _store_revision(template) is not None:  # another run made it while this one waited
                return template
            _remove_abandoned(template)
            tmp = template.with_name(f".{template.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                _mlflow_creates(tmp)
                os.replace(tmp, template)
            finally:
                for path in (tmp, *(tmp.with_name(tmp.name + side) for side in SQLITE_SIDE_FILES)):
                    path.unlink(missing_ok=True)
        return template if _store_revision(template) is not None else None
    except OSError:  # an unwritable or full cache: MLflow creates the store itself
        return None


def _template_path() -> Path | None:
    """The template store's file for this MLflow (made or not); None without MLflow's migrations."""
    import hashlib
    from importlib.metadata import version
    from importlib.util import find_spec

    spec = find_spec("mlflow")  # found, not imported (slow)
    if spec is None or spec.origin is None:
        return None
    names = sorted(p.name for p in (Path(spec.origin).parent / "store" / "db_migrations" / "versions").glob("*.py"))
    if not names:
        return None
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
    return template_cache() / f"mlflow-{version('mlflow')}-{digest}.db"


def _store_revision(path: Path) -> str | None:
    """The schema revision of a complete MLflow store at ``path`` (its tables and its
    ``alembic_version``); None for a missing, empty, half-built or unreadable file."""
    import sqlite3
    from urllib.parse import quote

    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=5)
        try:
            tables = {row[0] for row in con.execute("select name from sqlite_master where type = 'table'")}
            if not MLFLOW_TABLES <= tables:
                return None
            revision = con.execute("select version_num from alembic_version").fetchall()
            default = con.execute("select count(*) from experiments where experiment_id = 0").fetchone()[0]
        finally:
            con.close()
    except sqlite3.DatabaseError:
        return None
    return revision[0][0] if len(revision) == 1 and default == 1 else None


def _has_content(db: Path) -> bool:
    return db.exists() and (db.is_dir() or db.stat().st_size > 0)


def _remove_abandoned(db: Path) -> None:
    """Temporary stores of creations that were killed (their process is gone), with SQLite's
    rollback journal beside them."""
    for path in db.parent.glob(f".{glob.escape(db.name)}.creating-*"):
        found = CREATING.match(path.name)
        if found and found.group(1) == db.name and not process_running(int(found.group(2))):
            path.unlink(missing_ok=True)


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


def _check_sqlite(uri: str, check_revision: bool = True) -> None:
    """Read-only look at a SQLite store (never modified here); ``revision``: also compare its
    schema revision with this MLflow's (``check_revision``; it imports MLflow)."""
    import sqlite3
    from urllib.parse import quote

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
    # SQLite writes the file and, beside it, its rollback journal: both must be writable (a
    # read-only mount, a folder without write permission); said now, not at the first write
    for path in (db, db.parent):
        if not os.access(path, os.W_OK):
            raise PflError(f"{where}: {path} is read-only ({_why_read_only(path)}); make it writable, give another "
                           f"tracking.uri / --tracking-uri, or run with --no-tracking")
    if db.stat().st_size == 0:
        return  # an empty file: MLflow creates its tables in it
    try:
        # a SQLite URI filename: a '%', '?' or '#' in the path is percent-encoded
        con = sqlite3.connect(f"file:{quote(str(db.resolve()))}?mode=ro", uri=True, timeout=5)
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
    head = _schema_head() if check_revision else None
    if not revision or not {"experiments", "runs"} <= tables or (head and revision[0][0] != head and not runs):
        raise PflError(f"{where}: {db} is a half-built MLflow store (its creation was interrupted; it holds "
                       f"{runs} runs); move it aside and run again: mv {db} {db}.half-built")
    if head and revision[0][0] != head:
        raise PflError(f"{where}: {db} has MLflow schema revision {revision[0][0]}, not this MLflow's ({head}); "
                       f"back it up, then run: mlflow db upgrade {uri}")


def _why_read_only(path: Path) -> str:
    """``read-only file system`` or ``permission denied``: what os.access found."""
    try:
        return "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "permission denied"
    except OSError as exc:
        return exc.strerror or str(exc)


def _schema_head() -> str | None:
    """The schema revision this MLflow creates (None if its private helper moved): its template
    store's (:func:`template_store`, made by this MLflow), read in a millisecond, else from
    MLflow's migration scripts (half a second)."""
    try:
        template = _template_path()
        known = _store_revision(template) if template is not None else None
    except OSError:
        known = None
    if known is not None:
        return known
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:  # pragma: no cover - an MLflow without the helper: the revision goes unchecked
        return None
