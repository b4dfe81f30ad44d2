"""Run tracking: MLflow, or nothing (``tracking.enabled = false``), behind one interface; the
tags and UI links pfl writes; the flattened parameters; the accuracy-distribution artifact."""

from __future__ import annotations

import contextvars
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pfl_core._version import machine_tags, version_tags
from pfl_core.errors import PflError, Stopped, deferred_interrupts
from pfl_core.state.locations import artifact_root_for, plain_uri
from pfl_core.tracking import journal
from pfl_core.tracking.links import GROUP_TAG, POINT_TAG, VIEW_TAG, key_metrics_view


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
# The current invocation's pfl_core.tracking.study.Study (None outside one); set by study.studied.
_STUDY: contextvars.ContextVar = contextvars.ContextVar("pfl_study", default=None)


def current_study():
    """The study of the ``pfl-run`` invocation in progress (None outside one)."""
    return _STUDY.get()


def run_status(exc: BaseException) -> str:
    """The MLflow status of a run a ``exc`` stopped: KILLED for Ctrl-C and SIGTERM
    (KeyboardInterrupt, :class:`pfl_core.errors.Interrupted`) and a run stopped on purpose
    (:class:`pfl_core.errors.Stopped`: a pruned trial), FAILED otherwise."""
    return "KILLED" if isinstance(exc, (KeyboardInterrupt, Stopped)) else "FAILED"


class NullTracker:
    """Tracking switched off: everything is accepted and dropped."""

    run_id = None
    parent_run_id = None
    point_group = None

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


def quiet_mlflow() -> None:
    """Quiet MLflow's start-up chatter (database creation and migrations, run links) on stderr;
    MLflow logs a store's database errors with a traceback, and an outage is said in one line."""
    import logging

    for name in ("alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


class MlflowTracker(NullTracker):
    """Logs to MLflow. ``uri`` empty: MLflow's own default (sqlite ``mlflow.db`` here)."""

    def __init__(self, uri: str = "", study=None):
        import mlflow  # imported lazily: it is slow and only needed when tracking

        quiet_mlflow()
        self.mlflow = mlflow
        uri = plain_uri(uri or mlflow.get_tracking_uri())  # MLflow's default too: percent-encoded
        if uri != mlflow.get_tracking_uri():
            mlflow.set_tracking_uri(uri)
        self.study = study
        self.run_id = None
        # Calls the store misses (it went away mid-run) go to a journal (pfl_core/tracking/journal.py),
        # replayed at most every retry_seconds, at the end, on --resume or by `pfl replay`.
        self.journal = None
        self.journal_home: Path | None = None  # <checkpoint folder>/journal, once known
        self.retry_seconds = float(os.environ.get("PFL_TRACKING_RETRY_SECONDS", "30"))
        self.next_retry = 0.0
        self.last_step: int | None = None
        self.refusal_said = False
        self.last_refusal: str | None = None  # the last replay failed because the store refused a record: why
        self.parent_run_id: str | None = None  # when not this thread's active run (parallel trials)
        self.point_group: str | None = None  # a run the study's comparison lists (POINT_TAG): its group
        # > 0: the run's metrics, params and tags held and sent together at most this often, and
        # before any other call (a tuning trial: no checkpoint a kill could leave ahead of them)
        self.metrics_every_seconds = 0.0
        self._held: list[dict] = []
        self._held_since = 0.0

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
        with journal.short_http(), deferred_interrupts():
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
        context = {TRACKING_URI_TAG: uri, **version_tags(), **machine_tags()}
        if self.study is not None:
            context.update(self.study.tags())
            if self.point_group is not None:
                context.update({POINT_TAG: self.study.id, GROUP_TAG: self.point_group})
        # A run started while another is active (a seed of a repeated experiment, a sweep point
        # of a study) is its child, told apart by its parent; a top-level run by its name.
        nested = mlflow.active_run() is not None
        if not nested and self.parent_run_id:  # a parent in another thread (parallel tuning trials)
            context[PARENT_TAG] = self.parent_run_id
        elif not nested:
            run_name = self._unused_name(run_name)
        try:
            run = mlflow.start_run(run_name=run_name, tags={**context, **tags}, nested=nested)
        except Exception as exc:  # a full or read-only disk under a SQLite store: no run to keep calls for
            if not journal.is_outage(exc):
                raise
            raise PflError(f"the {self._store()} {journal.failing(self._uri())} ({journal.reason(exc)}): run {run_name!r} "
                           f"cannot be started; free space or fix tracking.uri / --tracking-uri, or run with "
                           f"--no-tracking") from None
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
            with journal.short_http(), deferred_interrupts():
                # nested under an active run: a study's interrupted run continued in its new study
                run = mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None)
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
        record = {"op": "metrics", "run_id": self.run_id, "step": int(step), "timestamp": journal.now_ms(),
                  "metrics": {k: float(v) for k, v in metrics.items()}}
        self._log(record)

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
        if self._held:
            self._send_held()
        if self._journal_pending():  # one last replay before the status
            self._replay()
        end_time = journal.now_ms()
        try:  # end_run takes the run off MLflow's stack of active runs first, then tells the store
            with journal.short_http(), deferred_interrupts():
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
            if self.last_refusal is not None:  # the store is there but refuses a record: waiting will not send it
                self._say(f"the {self._store()} refused a call of run {self.run_id} ({self.last_refusal}): what it "
                          f"could not log is kept in {folder}; pfl replay {shlex.quote(str(folder))} names the record "
                          f"refused and sends the rest")
            else:
                self._say(f"the {self._store()} {journal.failing(self._uri(), still=True)}: what run {self.run_id} "
                          f"could not log (metrics, artifacts, its status) is kept in {folder}; send it "
                          f"{journal.when_back(self._uri())} with: pfl replay {shlex.quote(str(folder))}")
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

    def _resume_hint(self) -> str:
        if self.journal_home is not None:  # it has a checkpoint folder
            from pfl_core.state.checkpoint import resume_line  # imports torch: only when needed

            return f"resume it from its last checkpoint: {resume_line(self.journal_home.parent, self.run_id, self._uri())}"
        return "run it again"

    def _journal_pending(self) -> bool:
        return self.journal is not None and self.journal.pending()

    def _send_held(self) -> None:
        """The held calls in as few log_batch calls as MLflow takes (journaled if missed)."""
        held, self._held = self._held, []
        start = 0
        while start < len(held):
            size = journal.batch_group(held, start)
            self._log({"op": "metric_batch", "run_id": held[start]["run_id"], "records": held[start:start + size]})
            start += size

    def _log(self, record: dict) -> None:
        """Send one call to the store; while a journal holds calls (the store was away), the
        journal is replayed first when a retry is due, and the call joins it if that fails."""
        record.setdefault("run_id", self.run_id)
        if self.metrics_every_seconds > 0 and record["op"] in journal.BATCHED and record["run_id"] == self.run_id:
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append(record)  # with the params, the first write: one store write for a short trial
            if time.monotonic() - self._held_since >= self.metrics_every_seconds:
                self._send_held()
            return
        if self._held and record["op"] != "metric_batch":
            self._send_held()  # held calls first: the store sees the calls in their order
        if self._journal_pending():
            if time.monotonic() >= self.next_retry:
                self._replay()
            if self._journal_pending():
                self.journal.add(record)
                return
        started = time.monotonic()
        try:
            with journal.short_http(), deferred_interrupts():
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
        try:
            self.journal.add(record)
        except OSError as error:  # the journal's disk is full or read-only too: nothing can keep the call
            raise PflError(f"the {self._store()} {journal.failing(self._uri())} ({journal.reason(exc)}) and the journal "
                           f"{self.journal.folder} cannot be written either ({error.strerror or error}); "
                           f"free space, then {self._resume_hint()}") from None
        self._retry_later(cost)
        if record["op"] == "metric_batch":
            record = record["records"][0]  # said by its first round
        if first:
            if record["op"] == "metrics" and record["run_id"] == self.run_id:
                when = f"at round {record['step']}"
            elif self.last_step is not None:
                when = f"after round {self.last_step}"
            else:
                when = "before the first round"
            if self.run_id is None:  # logging to runs that ended (a sweep's gains): no end() to try again
                journal.UNSENT.append(self.journal.folder)
                self._say(f"{self._store()} {journal.failing(self._uri())} ({journal.reason(exc)}): metrics of run "
                          f"{record['run_id']} kept in {self.journal.folder}; send them {journal.when_back(self._uri())} "
                          f"with: pfl replay {shlex.quote(str(self.journal.folder))}")
                return
            later = " or on --resume" if self.journal_home is not None else ""
            self._say(f"{self._store()} {journal.failing(self._uri())} {when} ({journal.reason(exc)}): metrics kept in "
                      f"{self.journal.folder}; they are replayed when it returns{later}")

    def _retry_later(self, cost: float) -> None:
        # A failed attempt that took long (a timeout, a locked SQLite file waits 20 s) is retried
        # less often: at most a tenth of the time goes into retrying. 0: at every call, whatever
        # it costs.
        self.next_retry = time.monotonic() + (max(self.retry_seconds, 10 * cost) if self.retry_seconds else 0)

    def _replay(self, keep=lambda record: True) -> None:
        started = time.monotonic()
        try:
            with journal.short_http(), deferred_interrupts():
                self.journal.replay(self.mlflow.MlflowClient(), keep)
        except Exception as exc:
            self._retry_later(time.monotonic() - started)
            self.last_refusal = None if journal.is_outage(exc) else journal.reason(exc)
            if self.last_refusal is not None and not self.refusal_said:  # kept; `pfl replay` names it
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
    from pfl_core.tracking import plots

    fig = plots.accuracy_distribution_figure(groups, title)
    try:
        tracker.log_figure(fig, ACCURACY_FIGURE)
    finally:
        plots.close(fig)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def make_tracker(section, uri_override: str | None = None, study=None):
    """The tracker for one run; ``study`` (default: the current ``pfl-run`` invocation's) adds
    its tags."""
    if not section.enabled:
        return NullTracker()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowTracker(uri_override or section.uri, study or current_study())


