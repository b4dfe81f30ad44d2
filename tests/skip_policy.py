"""The suite's skip policy: a test may skip for an optional extra or an absent outside resource
(../shared/data, a GPU, Chromium), never because a package pyproject.toml requires is missing.
Such a skip fails the run, naming the package: CI once passed on a fresh venv with every tuning
test skipped for a missing optuna. Skip reasons are printed at the end of every run (``-rs`` in
pyproject's addopts)."""

from __future__ import annotations

import pytest
from dependencies import missing_core_dependency


class SkipPolicy:
    def __init__(self) -> None:
        self.core_skips: list[tuple[str, str, str]] = []  # (test, package, reason)

    def _see(self, report) -> None:
        if not report.skipped or not isinstance(report.longrepr, tuple):
            return
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        missing = missing_core_dependency(reason)
        if missing:
            self.core_skips.append((report.nodeid, missing, reason))

    def pytest_runtest_logreport(self, report) -> None:
        self._see(report)

    def pytest_collectreport(self, report) -> None:  # a module-level skip
        self._see(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for test, package, reason in self.core_skips:
            terminalreporter.write_line(f"FAILED (skip policy): {test or 'collection'} skipped for a missing core "
                                        f"dependency {package!r} ({reason}); pyproject.toml requires it: "
                                        f"install the project as its README says", red=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        if self.core_skips and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def install(config) -> None:
    config.pluginmanager.register(SkipPolicy(), "pfl-skip-policy")
