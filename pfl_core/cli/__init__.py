"""The command line: ``pfl-run`` and ``pfl`` (plugins, docs, replay). It parses arguments, calls
the study and reports: one line and an exit code for every error."""

from pfl_core.cli.cli import main, run_main

__all__ = ["main", "run_main"]
