"""Where pfl keeps files beside an MLflow store: a SQLite store's database file, its
artifacts folder, and the folder that checkpoints and journals sit in.

Below both tracking and checkpointing, which each need to know where a store lives.
"""

from __future__ import annotations

import os
from pathlib import Path


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI; None for other stores and in-memory ones."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?")[0]
    return Path(path) if path and path != ":memory:" else None


def artifact_root_for(uri: str) -> str | None:
    """Where a SQLite store's artifacts go: beside the database file (``/tmp/x.db`` ->
    ``/tmp/x-artifacts``), not MLflow's shared ``./mlruns``. None for other stores."""
    db = sqlite_file(uri)
    if db is None:
        return None
    db = db.resolve()
    return str(db.with_name(db.stem + "-artifacts"))


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
