"""The command line: ``pfl-run`` and ``pfl`` (plugins, docs, replay). It parses arguments, calls
the study and reports: one line and an exit code for every error.

The console scripts enter through ``run_main`` and ``main`` below. This module imports nothing
at import time, so that a Ctrl-C (or SIGTERM) at any moment after Python started, during the
first imports too, ends as one line and exit code 128 + the signal (130), never a traceback.
"""

import functools
import os
import signal
import sys


def run_main(argv=None, prog: str = "pfl-run") -> int:
    """``pfl-run`` (``pfl_core.cli.cli.run_main``); ``argv`` None: the console script."""
    return _command(lambda cli: cli.run_main(argv, prog), argv is None, prog)


def main(argv=None) -> int:
    """``pfl`` (``pfl_core.cli.cli.main``); ``argv`` None: the console script."""
    return _command(lambda cli: cli.main(argv), argv is None, "pfl")


def _command(call, console: bool, prog: str) -> int:
    """Run a command; as the console script (the process ends after it), a stop signal that no
    command handles (during the imports, or Python's own exit: seconds of torch's exit hooks)
    ends the process at once. In a program, a KeyboardInterrupt outside the run is one line."""
    if console:  # no KeyboardInterrupt at all: one landing in an object's __del__ is "ignored"
        _on_stop_signals(functools.partial(_leave, prog))
    try:
        from pfl_core.cli import cli

        code = call(cli)
    except KeyboardInterrupt as exc:
        code = _interrupted(prog, exc)
    if console:  # the command has said how it ended: a signal now only cuts Python's exit short
        _on_stop_signals(functools.partial(_leave, None))
    return code


def _interrupted(prog: str, exc: KeyboardInterrupt) -> int:
    signum = getattr(exc, "signum", signal.SIGINT)
    print(f"{prog}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def _on_stop_signals(handler) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def _leave(prog: str | None, signum: int, frame) -> None:
    """End the process now, with 128 + ``signum``: what it printed is flushed, then one line
    (none when ``prog`` is None: the command has finished and said so)."""
    _on_stop_signals(signal.SIG_IGN)  # a second Ctrl-C while leaving
    try:
        sys.stdout.flush()
        if prog is not None:
            print(f"{prog}: interrupted ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
    except Exception:  # stdout closed, or the signal came in the middle of a write to it
        pass
    os._exit(128 + signum)


__all__ = ["main", "run_main"]
