"""Run tracking: MLflow, or nothing (``tracking.enabled = false``), behind one interface."""

from __future__ import annotations

import contextvars
import csv
import functools
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import journal
from .errors import PflError


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists become JSON. Same keys for every method."""
    out: dict[str, str] = {}
    if isinstance(data, dict) and data:
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(data, dict):  # an empty table still gets its param, so every run has it
        out[key] = "{}"
    elif isinstance(data, (list, tuple)):
        out[key] = json.dumps(data)
    elif data is None:
        out[key] = "none"
    else:
        out[key] = str(data)
    return out


STUDY_TAG = "pfl.study"
TRACKING_URI_TAG = "pfl.tracking_uri"
NOTE_TAG = "mlflow.note.content"
GIT_TAGS = ("mlflow.source.git.commit", "mlflow.source.git.branch", "mlflow.source.git.repoURL")
# The tag MLflow 3's UI reads to decide what an experiment holds (its sidebar's "Model training"
# against "GenAI"); the UI's own values: custom_model_development, genai_development.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
PARENT_TAG = "mlflow.parentRunId"
MODEL_TRAINING = "custom_model_development"
# MLflow 3's runs table shows no metric column by default. Its UI keeps a saved view of the
# table in an experiment tag (the format its "share view" writes); pfl saves one with the key
# metrics as columns, and the links it prints open it. A UI-internal format: if a later MLflow
# ignores it, the link still opens the runs.
KEY_METRICS = ("acc_mean", "acc_p10", "comm_up_bytes")
KEY_METRICS_VIEW = "pfl-key-metrics"
VIEW_TAG = f"mlflow.sharedViewState.{KEY_METRICS_VIEW}"
# The UI remembers per browser whether it shows GenAI or model-training experiments and opens
# a new browser on GenAI, whatever the experiment's kind tag says; this query switches it.
RUNS_QUERY = "workflowType=machine_learning"


def key_metrics_view() -> str:
    columns = [f"metrics.`{name}`" for name in KEY_METRICS]
    now = int(time.time() * 1000)
    return json.dumps({"name": "pfl: key metrics", "createdAt": now, "updatedAt": now,
                       "state": json.dumps({"selectedColumns": columns})})


def runs_links(base: str, experiment_id: str) -> list[str]:
    """The MLflow UI addresses of an experiment's runs: the chart view and the table with the
    key metrics as columns."""
    runs = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{RUNS_QUERY}"
    return [f"{runs}&compareRunsMode=CHART", f"{runs}&viewStateShareKey={KEY_METRICS_VIEW}"]


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

    def begin(self) -> None:
        """Start the parent run begin_study asked for (when the first run starts, so a failure
        before any run leaves no empty parent): the runs started from now on are its children."""
        from . import __version__

        section, uri_override, experiment, params, tags = self.pending
        self.pending = None
        self.parent = make_tracker(section, uri_override, self)
        self.parent.start(experiment, self.run_name(experiment), params, {"pfl.version": __version__, **tags})

    def log_comparison(self, results) -> None:
        """The parent's ``results/comparison.csv`` (each top-level run's mean and ci95 of every
        final metric, from the runner's results: ``name``, ``run_id``, ``runs``, ``summary``),
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
        if self.note:
            out[NOTE_TAG] = self.note
        return out

    def run_name(self, base: str) -> str:
        """The study parent's name: unique per invocation, readable in the runs table."""
        return f"{base} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))} ({self.id[:6]})"


_STUDY: contextvars.ContextVar[Study | None] = contextvars.ContextVar("pfl_study", default=None)


def current_study() -> Study | None:
    """The study of the ``pfl-run`` invocation in progress (None outside one)."""
    return _STUDY.get()


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


def run_status(exc: BaseException) -> str:
    """The MLflow status of a run a ``exc`` stopped: KILLED for Ctrl-C and SIGTERM
    (KeyboardInterrupt, :class:`pfl_core.errors.Interrupted`), FAILED otherwise."""
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


def begin_study(path: str, description: str, section, uri_override: str | None, experiment: str,
                params: dict[str, str], tags: dict[str, str], parent: bool) -> None:
    """Fill in the current study from the validated spec (its note and git state) and, when
    ``parent`` (more than one top-level run), start its parent run."""
    study = current_study()
    if study is None or not section.enabled:
        return
    study.note = description.strip() or (spec_header(path) if path else "")
    study.git = git_tags(Path(path).resolve().parent) if path else {}
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


class NullTracker:
    """Tracking switched off: everything is accepted and dropped."""

    run_id = None

    def start(self, experiment: str, run_name: str, params: dict[str, str], tags: dict[str, str]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, filename: str) -> None:
        pass

    def log_figure(self, figure, filename: str) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def log_param(self, key: str, value: Any) -> None:
        """One more param of the running run (a value a plugin resolved at run time)."""

    def log_metrics_to(self, run_id: str | None, metrics: dict[str, float]) -> None:
        """Add metrics to a run that may already have ended (a sweep's gains, known last)."""

    def keep_journal_in(self, folder) -> None:
        """The run's checkpoint folder (or None): where calls the store misses are kept."""

    def end(self, status: str = "FINISHED") -> None:
        pass


class MlflowTracker(NullTracker):
    """Logs to MLflow. ``uri`` empty: MLflow's own default (sqlite ``mlflow.db`` here)."""

    def __init__(self, uri: str = "", study: Study | None = None):
        import logging

        import mlflow  # imported lazily: it is slow and only needed when tracking

        # Quiet MLflow's start-up chatter (database migrations, run links) on stderr.
        for name in ("alembic", "mlflow"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # MLflow logs a store's database errors with a traceback; an outage is said in one line
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        self.mlflow = mlflow
        if uri:
            mlflow.set_tracking_uri(uri)
        self.study = study
        self.run_id = None
        # Calls the store misses (it went away mid-run) go to a journal (pfl_core/journal.py),
        # replayed at most every retry_seconds, at the end, on --resume or by `pfl replay`.
        self.journal = None
        self.journal_home: Path | None = None  # <checkpoint folder>/journal, once known
        self.retry_seconds = float(os.environ.get("PFL_TRACKING_RETRY_SECONDS", "30"))
        self.next_retry = 0.0
        self.last_step: int | None = None
        self.refusal_said = False

    def _set_experiment(self, name: str) -> None:
        """Select (create) the experiment; a new one is a model-training experiment (MLflow 3's
        UI opens it on its runs) and, on a SQLite store, keeps its artifacts beside the file."""
        mlflow = self.mlflow
        client = mlflow.MlflowClient()
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                client.create_experiment(name, artifact_location=artifact_root_for(mlflow.get_tracking_uri()),
                                         tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING, VIEW_TAG: key_metrics_view()})
            except Exception:  # created meanwhile by another process: use that one
                if client.get_experiment_by_name(name) is None:
                    raise
        elif experiment.lifecycle_stage == "active":
            if EXPERIMENT_KIND_TAG not in experiment.tags:
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
            if VIEW_TAG not in experiment.tags:
                client.set_experiment_tag(experiment.experiment_id, VIEW_TAG, key_metrics_view())
        self.experiment_id = mlflow.set_experiment(name).experiment_id

    def start(self, experiment, run_name, params, tags):
        with journal.short_http():
            self._start(experiment, run_name, params, tags)

    def _start(self, experiment, run_name, params, tags):
        mlflow = self.mlflow
        try:
            self._set_experiment(experiment)
        except Exception as exc:  # unreachable server, unwritable store
            raise PflError(f"MLflow tracking at {mlflow.get_tracking_uri()} failed: {one_line(exc)} (tracking.uri)") from None
        if self.study is not None and self.study.pending is not None:
            self.study.begin()  # the study's parent first: this run nests under it
        uri = mlflow.get_tracking_uri()
        context = {TRACKING_URI_TAG: uri}
        if self.study is not None:
            context.update(self.study.tags())
        # A run started while another is active (a seed of a repeated experiment, a sweep point
        # of a study) is its child, told apart by its parent; a top-level run by its name.
        nested = mlflow.active_run() is not None
        if not nested:
            run_name = self._unused_name(run_name)
        run = mlflow.start_run(run_name=run_name, tags={**context, **tags}, nested=nested)
        self.run_id = run.info.run_id
        if self.study is not None:
            # MLflow's own git tags describe the checkout of the running script (pfl-run's), not
            # the spec's: keep only those of the spec's directory.
            for key in GIT_TAGS:
                if key not in self.study.git and key in run.data.tags:
                    self._log({"op": "delete_tag", "key": key})
        if "tracking.uri" in params:  # the store used (the spec's value may be "" or overridden)
            params = {**params, "tracking.uri": uri}
        self._log({"op": "params", "params": dict(sorted(fit_params(params).items()))})  # sent in batches

    def _unused_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3`` ... when top-level runs of the experiment already
        have it: the same spec run twice gives two runs that can be told apart in the UI."""
        quote = "'" if "'" not in name else '"'
        if quote in name:  # both quotes in it: not expressible in a filter, compare all names
            query = ""
        else:  # LIKE's wildcards (% _) in the name only widen the search; the names are compared below
            query = f"attributes.run_name LIKE {quote}{name}%{quote}"
        runs = self.mlflow.MlflowClient().search_runs([self.experiment_id], query, max_results=5000)
        taken = {run.info.run_name for run in runs if PARENT_TAG not in run.data.tags}
        if name not in taken:
            return name
        suffixes = [int(t[len(name) + 1:]) for t in taken
                    if t.startswith(f"{name}-") and t[len(name) + 1:].isdigit()]
        return f"{name}-{max(suffixes, default=1) + 1}"

    def resume(self, run_id: str) -> None:
        """Continue run ``run_id`` (``pfl-run --resume``): the metrics it already holds, logged
        after its checkpoint and before it stopped, are not logged again (they are identical)."""
        mlflow = self.mlflow
        try:
            with journal.short_http():
                run = mlflow.start_run(run_id=run_id)
                client = mlflow.MlflowClient()
                self.logged = {(key, m.step) for key in run.data.metrics
                               for m in client.get_metric_history(run_id, key)}
        except Exception as exc:
            raise PflError(f"--resume: MLflow run {run_id} cannot be continued at {mlflow.get_tracking_uri()}: "
                           f"{one_line(exc)}") from None
        self.run_id = run_id

    def log_metrics(self, metrics, step):
        logged = getattr(self, "logged", None)
        if logged:
            metrics = {k: v for k, v in metrics.items() if (k, step) not in logged}
            if not metrics:
                return
        self.last_step = step
        self._log({"op": "metrics", "step": int(step), "timestamp": journal.now_ms(),
                   "metrics": {k: float(v) for k, v in metrics.items()}})

    def log_text(self, text, filename):
        self._log({"op": "text", "text": text, "artifact_file": filename})

    def log_figure(self, figure, filename):
        self._log({"op": "figure", "figure": figure, "artifact_file": filename})

    def set_tag(self, key, value):
        self._log({"op": "tag", "key": key, "value": str(value)})

    def log_param(self, key, value):
        self._log({"op": "params", "params": fit_params({key: str(value)})})

    def log_metrics_to(self, run_id, metrics):
        if run_id is None or not metrics:
            return
        self._log({"op": "metrics", "run_id": run_id, "step": 0, "timestamp": journal.now_ms(),
                   "metrics": {k: float(v) for k, v in metrics.items()}})

    def end(self, status="FINISHED"):
        if self.run_id is None:
            return
        if self._journal_pending():  # one last replay before the status
            self._replay()
        end_time = journal.now_ms()
        try:  # end_run takes the run off MLflow's stack of active runs first, then tells the store
            with journal.short_http():
                self.mlflow.end_run(status=status)
        except Exception as exc:
            if not journal.is_outage(exc):
                raise
            self._keep({"op": "end", "run_id": self.run_id, "status": status, "end_time": end_time}, exc)
        else:
            if self._journal_pending():  # the store came back between the replay and end_run
                self._replay()
        if self._journal_pending():
            folder = self.journal.folder
            journal.UNSENT.append(folder)
            self._say(f"the {self._store()} is still unreachable: what run {self.run_id} could "
                      f"not log (metrics, artifacts, its status) is kept in {folder}; send it when the server is "
                      f"back with: pfl replay {shlex.quote(str(folder))}")
        self.run_id = None

    # -- the journal of calls the store missed ----------------------------------------------------

    def keep_journal_in(self, folder) -> None:
        """Keep the journal in ``<folder>/journal`` (the run's checkpoint folder). A journal
        already there is a resumed run's earlier part: it is replayed now, its end status left
        out (the run goes on), and its metrics are not logged again by the resumed rounds."""
        if folder is None:
            return
        self.journal_home = Path(folder) / journal.CHECKPOINT_SUBFOLDER
        earlier = journal.Journal(self.journal_home, self._uri())
        if not earlier.pending():
            return
        run_id = self.run_id
        self.logged = getattr(self, "logged", set()) | {
            (key, r["step"]) for r in earlier.records() if r["op"] == "metrics" and r["run_id"] == run_id
            for key in r["metrics"]}
        self.journal = earlier
        self._replay(keep=lambda r: not (r["op"] == "end" and r["run_id"] == run_id))

    def _uri(self) -> str:
        return self.mlflow.get_tracking_uri()

    def _store(self) -> str:
        uri = self._uri()
        return f"tracking server {uri}" if uri.startswith(("http://", "https://")) else f"tracking store {uri}"

    def _journal_pending(self) -> bool:
        return self.journal is not None and self.journal.pending()

    def _log(self, record: dict) -> None:
        """Send one call to the store; while a journal holds calls (the store was away), the
        journal is replayed first when a retry is due, and the call joins it if that fails."""
        record.setdefault("run_id", self.run_id)
        if self._journal_pending():
            if time.monotonic() >= self.next_retry:
                self._replay()
            if self._journal_pending():
                self.journal.add(record)
                return
        started = time.monotonic()
        try:
            with journal.short_http():
                journal.send(self.mlflow.MlflowClient(), record)
        except Exception as exc:
            if not journal.is_outage(exc):
                raise
            self._keep(record, exc, time.monotonic() - started)

    def _keep(self, record: dict, exc: BaseException, cost: float = 0.0) -> None:
        """The store missed ``record``: into the journal (said once per run), next retry later."""
        first = self.journal is None
        if first:
            home = self.journal_home or journal.fallback_folder(self._uri(), self.run_id or record["run_id"])
            self.journal = journal.Journal(home, self._uri())
        self.journal.add(record)
        self._retry_later(cost)
        if first:
            if record["op"] == "metrics" and record["run_id"] == self.run_id:
                when = f"at round {record['step']}"
            elif self.last_step is not None:
                when = f"after round {self.last_step}"
            else:
                when = "before the first round"
            if self.run_id is None:  # logging to runs that ended (a sweep's gains): no end() to try again
                journal.UNSENT.append(self.journal.folder)
                self._say(f"{self._store()} unreachable ({journal.reason(exc)}): metrics of run "
                          f"{record['run_id']} kept in {self.journal.folder}; send them when the server is back "
                          f"with: pfl replay {shlex.quote(str(self.journal.folder))}")
                return
            later = " or on --resume" if self.journal_home is not None else ""
            self._say(f"{self._store()} unreachable {when} ({journal.reason(exc)}): metrics kept in "
                      f"{self.journal.folder}; they are replayed when it returns{later}")

    def _retry_later(self, cost: float) -> None:
        # A failed attempt that took long (a timeout, a locked SQLite file waits 20 s) is retried
        # less often: at most a tenth of the time goes into retrying. 0: at every call, whatever
        # it costs.
        self.next_retry = time.monotonic() + (max(self.retry_seconds, 10 * cost) if self.retry_seconds else 0)

    def _replay(self, keep=lambda record: True) -> None:
        started = time.monotonic()
        try:
            with journal.short_http():
                self.journal.replay(self.mlflow.MlflowClient(), keep)
        except Exception as exc:
            self._retry_later(time.monotonic() - started)
            if not journal.is_outage(exc) and not self.refusal_said:  # kept; `pfl replay` names it
                self.refusal_said = True
                self._say(f"the tracking store {self._uri()} refuses a journaled call ({journal.reason(exc)}); "
                          f"it stays in {self.journal.folder}")

    @staticmethod
    def _say(text: str) -> None:
        """One line on stderr that does not break a progress bar."""
        from tqdm import tqdm

        tqdm.write(f"pfl: {text}", file=sys.stderr)


def fit_params(params: dict[str, str]) -> dict[str, str]:
    """Params as MLflow accepts them: a value longer than its limit (6000 characters in MLflow
    3, 500 in older ones; a long ``model.clients`` list) is cut and says so; the run's
    ``resolved_spec.toml`` holds it whole."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:  # pragma: no cover - moved in some MLflow version
        limit = 500
    out = {}
    for key, value in params.items():
        if len(value) > limit:
            note = f"... ({len(value)} characters; whole in resolved_spec.toml)"
            value = value[: limit - len(note)] + note
        out[key] = value
    return out


ACCURACY_FIGURE = "results/client_accuracy.png"


def log_accuracy_distribution(tracker, runs: list[tuple[str, list[dict]]], title: str) -> None:
    """Log the final accuracy of every client, one box per run (``runs``: a label and its
    per-client result rows, cold-start rows marked ``coldstart``) as ``results/client_accuracy.png``.
    Nothing is drawn with tracking off."""
    if type(tracker) is NullTracker:
        return
    groups = []
    for label, rows in runs:
        scored = [r for r in rows if isinstance(r.get("acc"), (int, float)) and r["acc"] == r["acc"]]  # not nan
        groups.append((label, [float(r["acc"]) for r in scored], [bool(r.get("coldstart")) for r in scored]))
    if not any(accs for _, accs, _ in groups):
        return
    from . import plots

    fig = plots.accuracy_distribution_figure(groups, title)
    try:
        tracker.log_figure(fig, ACCURACY_FIGURE)
    finally:
        plots.close(fig)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


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


def make_tracker(section, uri_override: str | None = None, study: Study | None = None):
    """The tracker for one run; ``study`` (default: the current ``pfl-run`` invocation's) adds
    its tags."""
    if not section.enabled:
        return NullTracker()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowTracker(uri_override or section.uri, study or current_study())


class Progress:
    """A per-round progress bar on stderr (tqdm): elapsed time, ETA, and the latest metrics.

    tqdm redraws one line on a terminal and degrades to occasional lines elsewhere (CI logs,
    pipes). ``label`` names the run ("run 2/6 fedprox mu=0.1" during a sweep).
    """

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.latest: dict[str, float] = {}
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="round", file=stream or sys.stderr, leave=True,
                            dynamic_ncols=True, mininterval=0.5,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rounds "
                                       "[{elapsed}<{remaining}{postfix}]")

    def update(self, round: int, metrics: dict[str, float] | None = None) -> None:
        if self.bar is None:
            return
        if metrics:
            self.latest = metrics
        shown = ", ".join(
            f"{k} {human_bytes(self.latest[k]) if k.endswith('_bytes') else _fmt(self.latest[k])}"
            for k in ("acc_mean", "loss_mean", "comm_up_bytes")
            if k in self.latest
        )
        self.bar.set_postfix_str(shown, refresh=False)
        self.bar.update(round - self.bar.n)
        if round >= self.total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def status_line(text: str, enabled: bool = True, stream=None) -> None:
    """One line on stderr (``loading data ...``) that does not break a tqdm bar; only on a
    terminal, so a piped or logged run's stderr holds nothing but its one-line error if the
    loading fails."""
    stream = stream or sys.stderr
    if enabled and getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        tqdm.write(text, file=stream)


def human_bytes(value: float) -> str:
    """A byte count for people: ``0 B``, ``512 B``, ``16.2 kB``, ``1.6 MB``, ``3.1 GB`` (powers of
    1000, as MLflow's and most tools' MB)."""
    if value != value:  # nan
        return "-"
    value = float(value)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1000:
        return f"{sign}{value:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 999.95 or unit == "TB":
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_seconds(value: float) -> str:
    """``0.4 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if value != value:
        return "-"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(round(value)), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _fmt(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def experiment_location(spec) -> str | None:
    """Where a tracked invocation's runs are: the tracking URI, the experiment and the MLflow
    UI address of its runs (None when tracking is off)."""
    if not spec.tracking.enabled:
        return None
    import mlflow

    name = spec.tracking.experiment or spec.experiment.name
    uri = mlflow.get_tracking_uri()
    try:
        with journal.short_http():  # a server gone at the end of the run: said at once, not in minutes
            experiment = mlflow.get_experiment_by_name(name) if name else None
    except Exception:
        experiment = None
    if experiment is None:
        return f"tracking: {uri}"
    id = experiment.experiment_id
    lines = [f"tracking: {uri}, experiment {experiment.name!r} (id {id})"]
    if uri.startswith(("http://", "https://")):
        charts, table = runs_links(uri, id)
    else:
        lines.append(f"  view: mlflow ui --backend-store-uri {uri}   then open")
        charts, table = runs_links("http://127.0.0.1:5000", id)
    lines += [f"  charts: {charts}", f"  table:  {table}"]
    return "\n".join(lines)
