"""The study: one ``pfl-run`` invocation, its tags (note, git state) and, for several top-level
runs, the MLflow parent run they nest under, which holds their comparison."""

from __future__ import annotations

import csv
import functools
import io
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfl_core._version import TUNING_PACKAGES, version_tags
from pfl_core.tracking.plots import method_colour
from pfl_core.tracking.tracker import (
    _STUDY,
    GIT_TAGS,
    NOTE_TAG,
    STUDY_TAG,
    current_study,
    log_accuracy_distribution,
    make_tracker,
    run_status,
)

RESUME_TAG = "pfl.study.resume"  # on each run of a study of several: the command that completes the study


@dataclass
class Study:
    """One invocation of ``pfl-run``: an id every run it logs is tagged with (``pfl.study``), the
    spec's description (``mlflow.note.content``) and the git state of the spec's directory, and
    (for a sweep, or reference runs beside the method) the parent run its runs nest under."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    note: str = ""
    git: dict[str, str] = field(default_factory=dict)  # GIT_TAGS found for the spec's directory
    started: float = field(default_factory=time.time)
    parent: Any = None  # the study's parent run's tracker, once begun
    pending: tuple | None = None  # begin_study's arguments until the first run starts
    tuned: bool = False  # a [tune] study: its runs also record optuna's version
    resume: str = ""  # a study of several runs: the `pfl-run SPEC --resume ...` that completes it
    methods: list[str] = field(default_factory=list)  # its runs' names as planned: each one's colour
    # its compared runs' (run id, colour) and the run they are compared to: the MLflow study
    # view colours its runs and names its reference with them (links.save_study_view)
    compared: list[tuple[str | None, str]] = field(default_factory=list)
    compare_to: str = ""

    def begin(self) -> None:
        """Start the parent run begin_study asked for (when the first run starts, so a failure
        before any run leaves no empty parent): the runs started from now on are its children."""
        from pfl_core._version import __version__

        section, uri_override, experiment, params, tags = self.pending
        self.pending = None
        self.parent = make_tracker(section, uri_override, self)
        self.parent.start(experiment, self.run_name(experiment), params, {"pfl.version": __version__, **tags})

    def log_comparison(self, results) -> None:
        """The parent's ``results/comparison.csv`` (each top-level run's mean and ci95 of every
        final metric, from the study's results: ``name``, ``run_id``, ``runs``, ``summary``),
        ``best_acc_mean``, the tag ``pfl.best_run`` and each run's clients' final accuracy
        (``results/client_accuracy.png``, one box per run, its seeds pooled)."""
        if self.parent is None:
            return
        keys = sorted({k for r in results for k in r.summary})
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["run", "run_id", "seeds", *[c for k in keys for c in (k, f"{k}_ci95")]])
        for r in results:
            cells = [v for k in keys for v in ((r.summary[k].mean, r.summary[k].ci95) if k in r.summary
                                               else (float("nan"), float("nan")))]
            writer.writerow([r.name, r.run_id or "", len(r.runs), *[f"{v:.6g}" for v in cells]])
        self.parent.log_text(out.getvalue(), "results/comparison.csv")
        scored = [r for r in results if "acc_mean" in r.summary and r.summary["acc_mean"].mean == r.summary["acc_mean"].mean]
        if scored:
            best = max(scored, key=lambda r: r.summary["acc_mean"].mean)
            self.parent.log_metrics({"best_acc_mean": best.summary["acc_mean"].mean}, step=0)
            self.parent.set_tag("pfl.best_run", best.name)
        log_accuracy_distribution(self.parent, [(r.name, [row for run in r.runs for row in run.client_rows])
                                                for r in results], "final accuracy per client (seeds pooled)")

    def end(self, status: str) -> None:
        if self.parent is not None:
            self.parent.end(status)
            self.parent = None

    def tags(self) -> dict[str, str]:
        out = {STUDY_TAG: self.id, **self.git}
        if self.tuned:  # the tuning's sampler decides the hyperparameters every run of it uses
            out.update(version_tags(TUNING_PACKAGES))
        if self.note:
            out[NOTE_TAG] = self.note
        if self.resume:  # so `pfl-run --resume RUN` can say how to complete the rest of its study
            out[RESUME_TAG] = self.resume
        return out

    def run_name(self, base: str) -> str:
        """The study parent's name: unique per invocation, readable in the runs table."""
        return f"{base} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))} ({self.id[:6]})"


def method_colours(names: list[str]) -> list[str]:
    """Each named method's colour in the study's pictures and its MLflow view: its place among
    the current study's planned methods (``Study.methods``), so a method has one colour in every
    picture and a method left out of the comparison takes no other's; else its place in
    ``names``."""
    study = current_study()
    order = study.methods if study is not None and set(names) <= set(study.methods) else list(names)
    return [method_colour(order.index(name)) for name in names]


def studied(run_spec_file):
    """Make each call of ``run_spec_file(path, ...)`` one study: its trackers tag their runs with
    it; the parent run, if ``begin_study`` started one, ends with the call and holds the
    comparison of the runs the call returns."""

    @functools.wraps(run_spec_file)
    def wrapper(path, *args, **kwargs):
        study = Study()
        token = _STUDY.set(study)
        status = "FAILED"
        try:
            results = run_spec_file(path, *args, **kwargs)
            study.log_comparison(results)
            status = "FINISHED"
            return results
        except BaseException as exc:
            status = run_status(exc)
            raise
        finally:
            _STUDY.reset(token)
            study.end(status)

    return wrapper


def begin_study(path: str, description: str, section, uri_override: str | None, experiment: str,
                params: dict[str, str], tags: dict[str, str], parent: bool, tuned: bool = False) -> None:
    """Fill in the current study from the validated spec (its note and git state) and, when
    ``parent`` (more than one top-level run), start its parent run."""
    study = current_study()
    if study is None or not section.enabled:
        return
    study.note = description.strip() or (spec_header(path) if path else "")
    study.git = git_tags(Path(path).resolve().parent) if path else {}
    study.tuned = tuned
    if parent:
        study.pending = (section, uri_override, experiment, params, tags)


def spec_header(path: str) -> str:
    """The spec file's leading comment block without its ``#`` marks: the spec's description
    when ``experiment.description`` is empty."""
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                stripped = line.strip()
                if not stripped.startswith("#"):
                    break
                text = stripped[1:]
                lines.append(text[1:] if text.startswith(" ") else text)
    except OSError:
        return ""
    return "\n".join(lines).strip()


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):  # no git, a hung git
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def git_tags(directory: Path) -> dict[str, str]:
    """MLflow's git tags for ``directory`` (commit, branch, remote URL), {} outside a checkout."""
    commit = _git(directory, "rev-parse", "HEAD")
    if commit is None:
        return {}
    out = {GIT_TAGS[0]: commit}
    branch = _git(directory, "rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":
        out[GIT_TAGS[1]] = branch
    remote = _git(directory, "config", "--get", "remote.origin.url")
    if remote:
        out[GIT_TAGS[2]] = remote
    return out
