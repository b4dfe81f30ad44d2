"""User-facing errors.

Anything a user can cause with a spec, a flag or a missing file raises a ``PflError``. The
command line turns it into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Iterable


class PflError(Exception):
    """An error the user can fix; its message is one line."""


class SpecError(PflError):
    """A spec value is wrong. ``path`` is the TOML key path, e.g. ``partition.params.alpha``."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self):  # rebuilt from both parts when it comes back from a worker process
        return type(self), (self.path, self.message)


class DataError(PflError):
    """A dataset cannot be found or read."""


class NonFiniteError(PflError):
    """Training diverged: a loss or a sent parameter became NaN or infinite."""


class Stopped(Exception):
    """A run stopped on purpose before its last round, not a failure: a tuning trial the
    pruner ended (its MLflow run is KILLED, not FAILED)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run. The engine and the study fill in where:
    ``round`` (the round in progress), ``run_name``, ``run_id``, ``tracking_uri`` and
    ``out_dir``; the command line prints them in one line and exits 128 + ``signum``."""

    def __init__(self, signum: int = 2):
        super().__init__()
        self.signum = signum
        self.round: int | None = None
        self.rounds: int | None = None
        self.run_name: str | None = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self.out_dir: str | None = None

    def __reduce__(self):  # the signal and where it stopped survive a trip through a pipe
        return type(self), (self.signum,), self.__dict__


# A store call cut in half leaves its SQLite write transaction holding the database's lock, and
# the run's own end (status KILLED) then failed with "database is locked". So a signal that
# arrives during one is held (``defer_interrupt``, asked by the command line's handler) and
# raised as Interrupted when the call is done.
_deferral = {"depth": 0, "pending": None}


@contextlib.contextmanager
def deferred_interrupts():
    """Inside: an interrupting signal is held until the block ends, then raised as Interrupted."""
    _deferral["depth"] += 1
    try:
        yield
    finally:
        _deferral["depth"] -= 1
        if _deferral["depth"] == 0 and _deferral["pending"] is not None:
            signum, _deferral["pending"] = _deferral["pending"], None
            raise Interrupted(signum)


# The signal the command line's handler turned into Interrupted, and whether that exception
# reached a handler: one raised inside a callback whose exceptions Python drops (a weakref's, as
# SQLAlchemy registers; a __del__) never does, and the run went on to exit 0. The engine asks
# ``raise_lost_interrupt`` between rounds.
_signal = {"signum": None, "seen": False}


def note_signal(signum: int | None) -> None:
    """A signal is being raised as Interrupted (None: forget any, at the start of a command)."""
    _signal.update(signum=signum, seen=False)


def interrupt_seen() -> None:
    """The Interrupted of the noted signal reached a handler."""
    _signal["seen"] = True


def raise_lost_interrupt() -> None:
    """Raise Interrupted again for a noted signal whose exception no handler saw (it was dropped)."""
    if _signal["signum"] is not None and not _signal["seen"]:
        _signal["seen"] = True
        raise Interrupted(_signal["signum"])


def defer_interrupt(signum: int) -> bool:
    """True (and the signal held) inside ``deferred_interrupts``; False: raise it now."""
    if _deferral["depth"] == 0:
        return False
    _deferral["pending"] = signum
    return True


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or '' if none is close."""
    close = difflib.get_close_matches(str(name), sorted(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_name(path: str, kind: str, name: str, choices: Iterable[str]) -> SpecError:
    choices = sorted(choices)
    available = ", ".join(choices) or "none installed"
    return SpecError(path, f"unknown {kind} '{name}'{did_you_mean(name, choices)}; available: {available}")
