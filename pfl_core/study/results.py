"""Results on disk, with or without a tracker: ``pfl-run SPEC --out DIR``.

``DIR`` holds::

    spec.toml                  the spec as run (after --set/--sweep; ``pfl-run DIR/spec.toml`` runs it again)
    table.csv                  the printed comparison table, its columns unrounded (as ``pfl results --format csv``)
    comparison.csv             one row per run / sweep point: seeds, and per final metric its mean and ci95
    differences.csv            paired differences over common seeds: each run vs the compared-to run, and
                               the gains over the reference runs (experiment.reference)
    runs/<run>/resolved_spec.toml   the point's spec with every default filled in
    runs/<run>/tuned_spec.toml      with [tune]: the point at its best configuration (runs it alone)
    runs/<run>/clients.csv          per-client results (clients_seed<k>.csv, one per seed, with experiment.seeds)
    INCOMPLETE                 from the start until every file above is written: while it runs, and
                               after a failure or an interrupt (then it says what went wrong; the files
                               hold what finished before it)

A ``DIR`` that exists is refused (:class:`OutputExists`) unless ``overwrite``; nothing is
written before the spec validates (the study calls :meth:`ResultsDir.start` after it does).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

from pfl_core.errors import PflError
from pfl_core.spec import dump_toml
from pfl_core.study.compare import COMPARED, GAINS, comparisons
from pfl_core.study.report import comparison_table, table_csv_text
from pfl_core.study.stats import Summary
from pfl_core.tracking.tables import table_csv

TABLE = "table.csv"
COMPARISON = "comparison.csv"
DIFFERENCES = "differences.csv"
SPEC = "spec.toml"
INCOMPLETE = "INCOMPLETE"


def check_target(path: str | Path, overwrite: bool) -> None:
    """Refuse an existing ``--out`` directory (one line) unless ``--overwrite``."""
    path = Path(path)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise PflError(f"--out {path}: {exc.strerror or exc}") from None
    if exists and not is_dir:
        raise PflError(f"--out {path} exists and is not a directory")
    if exists and not overwrite:
        raise PflError(f"--out {path} already exists; pass --overwrite to replace its results, or choose another directory")


def slug(name: str) -> str:
    """A run name as a directory name: ``fedprox mu=0.1`` -> ``fedprox_mu=0.1``."""
    text = re.sub(r"[^A-Za-z0-9._=+-]+", "_", name).strip("._")
    return text or "run"


class ResultsDir:
    def __init__(self, path: str | Path, overwrite: bool = False):
        self.path = Path(path)
        self.overwrite = overwrite

    def start(self, spec_toml: str) -> None:
        """Create the directory (after the spec validated) and write the spec as run."""
        check_target(self.path, self.overwrite)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # permission denied, a read-only or full file system
            raise PflError(f"--out {self.path}: cannot create it ({exc.strerror or exc})") from None
        with self._writing():
            # first: a folder cut short (a full disk, a kill) is never taken for a complete one
            self.mark_incomplete(f"pfl-run (process {os.getpid()}) is writing these results; this file is "
                                 f"removed when they are complete")
            # --overwrite: only the files a previous pfl-run wrote are removed, never anything else
            for name in (TABLE, COMPARISON, DIFFERENCES):
                (self.path / name).unlink(missing_ok=True)
            runs = self.path / "runs"
            if runs.is_dir():
                for old in runs.glob("*/*"):
                    if old.name in ("resolved_spec.toml", "tuned_spec.toml") or (old.name.startswith("clients")
                                                                                  and old.suffix == ".csv"):
                        old.unlink()
            (self.path / SPEC).write_text(spec_toml, encoding="utf-8")

    def write_point(self, name: str, resolved_toml: str) -> None:
        with self._writing():
            (self._folder(name) / "resolved_spec.toml").write_text(resolved_toml, encoding="utf-8")

    def write_tuned(self, name: str, spec_toml: str) -> None:
        """The point's best configuration as a spec that runs its final runs alone."""
        with self._writing():
            (self._folder(name) / "tuned_spec.toml").write_text(spec_toml, encoding="utf-8")

    def write_results(self, results: list, compare_to: str | None, complete: bool = True,
                      correction: str = "holm", family: str = "table") -> None:
        """table.csv, comparison.csv, differences.csv and each run's per-client CSV; ``complete``: then the
        ``INCOMPLETE`` mark is removed."""
        with self._writing():
            self._write_results(results, compare_to, correction, family)
            if complete:
                (self.path / INCOMPLETE).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A full or read-only disk is the user's to fix: one line naming the folder."""
        try:
            yield
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            with contextlib.suppress(OSError):  # the mark is there from the start; its reason if it fits
                self.mark_incomplete(f"stopped early: cannot write{where}: {exc.strerror or exc}")
            raise PflError(f"--out {self.path}: cannot write{where}: {exc.strerror or exc}; the folder is marked "
                           f"{INCOMPLETE} (free space or choose another --out; the runs are in MLflow when "
                           f"tracked)") from None

    def _write_results(self, results: list, compare_to: str | None, correction: str, family: str) -> None:
        for result in results:
            folder = self._folder(result.name)
            seeded = getattr(result, "seeded", False) or len(result.runs) > 1
            for seed, run in zip(result.seeds, result.runs):
                if run.client_rows:
                    filename = f"clients_seed{seed}.csv" if seeded else "clients.csv"
                    header = list(run.client_rows[0])
                    (folder / filename).write_text(
                        table_csv(header, [[r.get(k, "") for k in header] for r in run.client_rows]), encoding="utf-8")
        if results:
            table = comparison_table(results, compare_to or results[0].name, correction, family)
            (self.path / TABLE).write_text(table_csv_text(table), encoding="utf-8")
        (self.path / COMPARISON).write_text(comparison_csv(results), encoding="utf-8")
        (self.path / DIFFERENCES).write_text(differences_csv(results, compare_to, correction, family), encoding="utf-8")

    def mark_incomplete(self, reason: str) -> None:
        (self.path / INCOMPLETE).write_text(reason + "\n", encoding="utf-8")

    def _folder(self, name: str) -> Path:
        folder = self.path / "runs" / slug(name)
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def _num(value: float):
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def comparison_csv(results: list) -> str:
    keys = sorted({k for r in results for k in r.summary})
    header = ["run", "n_seeds", "seeds", *[f"{k}_{part}" for k in keys for part in ("mean", "ci95")]]
    rows = []
    for r in results:
        row = [r.name, len(r.runs), " ".join(map(str, r.seeds))]
        for k in keys:
            s = r.summary.get(k)
            row += [_num(s.mean), _num(s.ci95)] if s is not None else ["", ""]
        rows.append(row)
    return table_csv(header, rows, exact=True)


# p_family: the comparisons p_adjusted was adjusted over ("table": the printed table's,
# report.correction_family; a metric's name: that metric's, over the runs; "none": unadjusted)
DIFF_HEADER = ["run", "vs", "metric", "n", "mean", "ci95", "low", "high", "p", "p_adjusted", "significant",
               "p_family"]


def _diff_row(run: str, vs: str, metric: str, d: Summary, family: str) -> list:
    return [run, vs, metric, d.n, _num(d.mean), _num(d.ci95), _num(d.low), _num(d.high), _num(d.p),
            _num(d.p_adjusted), "" if math.isnan(d.p_adjusted) else str(d.significant).lower(), family]


def differences_csv(results: list, compare_to: str | None, correction: str = "holm", family: str = "table") -> str:
    """Every run against the compared-to run on every final metric, then the collaboration
    gains. The printed table's metrics have its p (adjusted over ``family``); the other
    metrics, not in the table, are adjusted each over its own comparisons."""
    rows = []
    if results:
        ref = next((r for r in results if r.name == compare_to), results[0])
        keys = sorted({k for r in results for k in r.summary if k not in GAINS})
        shown = [k for k in COMPARED if k in keys]  # the printed table's columns of differences
        found = {**comparisons(results, ref, shown, correction, family),
                 **comparisons(results, ref, [k for k in keys if k not in shown], correction, "metric")}
        for r in results:
            for key in keys:
                if (r.name, key) in found:
                    over = "table" if key in shown and family == "table" else key
                    rows.append(_diff_row(r.name, ref.name, key, found[(r.name, key)],
                                          "none" if correction == "none" else over))
        for r in results:
            for key, vs in zip(GAINS, ("best reference (acc_mean)", "local (acc_mean)")):
                if key in r.summary:
                    rows.append(_diff_row(r.name, vs, key, r.summary[key], "none" if correction == "none" else key))
    return table_csv(DIFF_HEADER, rows, exact=True)


def dumps_spec(raw: dict) -> str:
    return dump_toml(raw)
