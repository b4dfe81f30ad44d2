"""Where pfl keeps files beside an MLflow store: a SQLite store's database file, its
artifacts folder, and the folder that checkpoints and journals sit in.

Below both tracking and checkpointing, which each need to know where a store lives.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote


SQLITE_PREFIX = "sqlite:///"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI; None for other stores and in-memory ones.
    Percent-decoded, as SQLAlchemy (under MLflow) does: MLflow's default URI of a working directory
    ``/home/u/My Runs`` is ``sqlite:////home/u/My%20Runs/mlflow.db``; ``?`` starts the options."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    path = unquote(uri[len(SQLITE_PREFIX):].split("?")[0])
    return Path(path) if path and path != ":memory:" else None


def sqlite_uri(path: Path | str) -> str:
    """The ``sqlite:///`` URI of a database file, :func:`sqlite_file` gives ``path`` back. Only a
    ``%``, ``?`` or ``#`` is percent-encoded (SQLAlchemy decodes ``%XX`` and ends the path at a
    ``?``); a space or an accent stays: MLflow (3.17) makes a store's folder from its URI
    undecoded, and made an empty ``My%20Runs`` beside ``My Runs``."""
    return SQLITE_PREFIX + str(path).replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def plain_uri(uri: str) -> str:
    """The store URI pfl hands to MLflow: a SQLite one re-encoded by :func:`sqlite_uri` (MLflow's
    own default, ``sqlite:////home/u/My%20Runs/mlflow.db``, is percent-encoded); others as given."""
    db = sqlite_file(uri)
    if db is None:
        return uri
    options = uri.partition("?")[2]
    return sqlite_uri(db) + (f"?{options}" if options else "")


def artifact_root_for(uri: str) -> str | None:
    """Where a SQLite store's artifacts go: beside the database file (``/tmp/x.db`` ->
    ``file:///tmp/x-artifacts``), not MLflow's shared ``./mlruns``. None for other stores. A file
    URI: MLflow percent-decodes an artifact location, so a bare path with a ``%`` in it (or a
    ``?``, ``#``) would send the artifacts to another folder."""
    db = sqlite_file(uri)
    if db is None:
        return None
    db = db.resolve()
    return db.with_name(db.stem + "-artifacts").as_uri()


def beside_store(tracking_uri: str | None) -> Path:
    """The folder of a SQLite store's file (absolute); the working directory for other stores."""
    db = sqlite_file(tracking_uri or "")
    return db.resolve().parent if db is not None else Path.cwd()


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs (signal 0 asks without signalling): a temporary file named
    after a process that is gone was abandoned (a checkpoint or a store half-written by a kill)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
