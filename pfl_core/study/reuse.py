"""``pfl-run SPEC --resume``: the final runs a stopped study finished are kept, not run again.

A point's run (one seed of it, or its single run) is kept when an earlier run in the store, in
the spec's experiment, has the same name (``<point> seed=<seed>``, or the point's name), ended
FINISHED, and its last good checkpoint is the final round's and holds the same resolved spec
(less the keys a resume may change, :data:`~pfl_core.state.provenance.FREE_KEYS`) written by the
same pfl version. The checkpoint also holds the run's evaluation history, so the
study's summaries and curves are the run's own.

The kept run is copied into the continuing study (a new MLflow run under the point's parent,
tagged ``pfl.reused_from``: its params, tags, the history of every metric and its artifacts): the
stopped study keeps its runs as they were, and the new one holds all of its own. As ``--resume``
keeps a killed tuning's trials, a run written by other code (the source of ``pfl_core`` or of the
spec's plugins changed since) is kept too; one line says so, naming the commit it ran at.

A run the stop interrupted (not FINISHED) whose latest good checkpoint holds the same spec and
was written by the same code (as ``--resume RUN`` requires: one run, one code) continues from
that checkpoint as a new run of the continuing study,
tagged ``pfl.continued_from``: its metrics up to the checkpoint are copied, the checkpoint is
copied into the new run's own folder, and the engine resumes from it, so the run ends as it
would have without the stop. A run whose checkpoint is gone or was never written
(``checkpoint.enabled = false``) cannot be checked against the spec and runs again from its
start.

Once the continuing study has kept or continued a run of a stopped study, that study is over: its
runs left unfinished are tagged ``pfl.superseded_by`` = the continuing study's id, and those a
kill left RUNNING end KILLED (``pfl results`` lists it as stopped, continued by that study);
its FINISHED runs stay as they were. A study whose tuning the continuing study's tuning went on
with is marked the same way.

One ``SPEC --resume`` of a study (a store and an experiment) runs at a time: each holds a file
lock (:class:`ResumeLock`) and a second one is refused at once, in one line naming the first's
process; the operating system releases the lock of a process that is killed.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from pfl_core.engine import Engine, Resolved, RunResult
from pfl_core.errors import PflError
from pfl_core.spec import tomllib
from pfl_core.state import checkpoint, provenance
from pfl_core.state.checkpoint import CHECKPOINT_TAG
from pfl_core.state.locations import process_running, sqlite_file
from pfl_core.tracking.links import GROUP_TAG, POINT_TAG
from pfl_core.tracking.study import RESUME_TAG
from pfl_core.tracking.terminal import warning_line
from pfl_core.tracking.tracker import PARENT_TAG, STUDY_TAG, TRACKING_URI_TAG, current_study

REUSED_TAG = "pfl.reused_from"  # the run a kept run was copied from
CONTINUED_TAG = "pfl.continued_from"  # the interrupted run a run continues
SUPERSEDED_TAG = "pfl.superseded_by"  # on a stopped study's unfinished runs: the study that continued it
TUNING_TAG = "pfl.tune.study"  # a tuning's runs: the Optuna study its trials are in
CLIENTS_TABLE = "results/clients.csv"
# Tags that belong to a run's place (its study, parent, store) or are MLflow's own: the copy gets
# its new ones from the tracker that starts it.
PLACE_TAGS = (STUDY_TAG, POINT_TAG, GROUP_TAG, TRACKING_URI_TAG, PARENT_TAG, RESUME_TAG)


@attrs.define
class Earlier:
    """A run of a stopped study and its latest good checkpoint: the final one of a finished run,
    or the one an interrupted run continues from."""

    run: Any  # mlflow.entities.Run
    loaded: checkpoint.Loaded

    @property
    def finished(self) -> bool:
        return self.run.info.status == "FINISHED"


class Reuse:
    """The finished runs of the store's earlier studies, found by name and checked against the
    spec (see the module's text)."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, list]] = {}  # experiment -> run name -> runs, newest first
        self._superseded: set[str] = set()  # the stopped studies this one has taken over

    def find(self, resolved: Resolved, name: str) -> Earlier | None:
        """The newest finished run of this name to keep, else the newest interrupted one to
        continue; None: the run runs from its start."""
        spec = resolved.spec
        runs = self._runs(spec.tracking_experiment).get(name, [])
        for finished in (True, False):
            for run in runs:
                if (run.info.status == "FINISHED") != finished:
                    continue
                folder = run.data.tags.get(CHECKPOINT_TAG)
                if not folder:
                    continue
                try:
                    loaded = checkpoint.find(folder)
                except PflError:  # its checkpoints were removed or are damaged
                    continue
                state = loaded.state
                earlier = Earlier(run, loaded)
                # an interrupted run goes on with the code it started with, as --resume RUN does
                if ((loaded.round == spec.experiment.rounds if finished else not self._other_code(earlier, resolved))
                        and state["code"]["pfl"] == self._version()
                        and not provenance.differing_keys(tomllib.loads(state["spec"]), resolved)):
                    return earlier
        return None

    def copy(self, earlier: Earlier, resolved: Resolved, name: str, tracker) -> RunResult:
        """Start ``tracker``'s run as a copy of the finished run ``earlier`` (its artifacts too)
        and return the run's result as the engine returned it."""
        import mlflow

        spec = resolved.spec
        old = earlier.run
        old_id = old.info.run_id
        self._say_if_other_code(earlier, resolved, name)
        self.supersede(old, spec.tracking_experiment)
        new_id, by_step = self._start_copy(earlier, resolved, name, tracker, REUSED_TAG)
        status = "FAILED"
        try:
            client = mlflow.MlflowClient()
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(client.download_artifacts(old_id, "", tmp))
                if any(local.iterdir()):
                    client.log_artifacts(new_id, str(local))
                rows = client_rows(earlier.loaded.state["rows"], local / CLIENTS_TABLE, spec.experiment.coldstart_clients)
            status = "FINISHED"
        finally:
            tracker.end(status)
        history = list(earlier.loaded.state["history"])
        # The engine's final metrics: the last evaluation's, and what on_finish and the cold-start
        # evaluation logged at the last round.
        final = dict(by_step.get(spec.experiment.rounds, {}))
        final.update({k: v for k, v in history[-1].items() if k != "round"} if history else {})
        seconds = (old.info.end_time - old.info.start_time) / 1000 if old.info.end_time else 0.0
        return RunResult(history=history, client_rows=rows, final=final, run_id=new_id, seconds=seconds,
                         kept_from=old_id)

    def resume(self, earlier: Earlier, resolved: Resolved, name: str, tracker, quiet: bool,
               progress_label: str | None) -> RunResult:
        """Start ``tracker``'s run as the continuation of the interrupted run ``earlier``: its
        metrics up to its checkpoint, that checkpoint copied into the new run's own folder, and
        the engine resumed from it (``pfl-run --resume RUN``'s path, in the new run)."""
        spec = resolved.spec
        last = earlier.loaded.round
        self.supersede(earlier.run, spec.tracking_experiment)
        new_id, _ = self._start_copy(earlier, resolved, name, tracker, CONTINUED_TAG, up_to=last)
        try:
            folder = checkpoint.run_folder(spec, new_id, name, checkpoint.tracking_uri_of(tracker))
            # its first checkpoint write tags the run with this folder; until then the copied tag
            # names the interrupted run's, which holds the same checkpoint
            shutil.copytree(earlier.loaded.path, folder / earlier.loaded.path.name)
        except BaseException:
            tracker.end("FAILED")
            raise
        tracker.end("KILLED")  # until the engine reopens it, below
        loaded = checkpoint.find(folder)
        loaded.state["run_id"] = new_id  # the engine continues this run, not the stopped one
        return Engine(resolved, tracker=tracker, progress=not quiet, run_name=name,
                      progress_label=progress_label).run(resume=loaded)

    def _start_copy(self, earlier: Earlier, resolved: Resolved, name: str, tracker, tag: str,
                    up_to: int | None = None) -> tuple[str, dict[int, dict[str, float]]]:
        """Start ``tracker``'s run (in the current study, under the active parent) with
        ``earlier``'s params and own tags, ``tag`` naming it, and its metrics' history (up to
        step ``up_to``); returns the new run's id and that history by step."""
        import mlflow

        spec = resolved.spec
        old = earlier.run
        tags = {k: v for k, v in old.data.tags.items() if not k.startswith("mlflow.") and k not in PLACE_TAGS}
        tracker.start(spec.tracking_experiment, name, dict(old.data.params),
                      {**tags, tag: old.info.run_id})
        try:
            client = mlflow.MlflowClient()
            by_step: dict[int, dict[str, float]] = {}
            for key in old.data.metrics:
                for m in client.get_metric_history(old.info.run_id, key):
                    if up_to is None or m.step <= up_to:
                        by_step.setdefault(m.step, {})[key] = m.value
            for step in sorted(by_step):
                tracker.log_metrics(by_step[step], step)
        except BaseException:
            tracker.end("FAILED")
            raise
        return tracker.run_id, by_step

    def _runs(self, experiment: str) -> dict[str, list]:
        """The experiment's runs by name, newest first, read once (after the tunings): the final
        runs this study starts are not among them (and no tuning run has a final run's name)."""
        if experiment not in self._by_name:
            import mlflow

            client = mlflow.MlflowClient()
            found = client.get_experiment_by_name(experiment)
            runs = [] if found is None else client.search_runs(
                [found.experiment_id], "", max_results=50000, order_by=["attributes.start_time DESC"])
            by_name: dict[str, list] = {}
            for run in runs:
                by_name.setdefault(run.info.run_name, []).append(run)
            self._by_name[experiment] = by_name
        return self._by_name[experiment]

    def supersede(self, run, experiment: str) -> None:
        """Mark the stopped study ``run`` belongs to as continued by the current one, once: its
        runs left unfinished are tagged :data:`SUPERSEDED_TAG`; those still RUNNING (their process
        was killed) end KILLED. A study that ended (its top-level runs FINISHED) is left alone:
        its runs may be kept, but it was not stopped."""
        import mlflow

        stopped_id, current = run.data.tags.get(STUDY_TAG), current_study()
        if not stopped_id or current is None or stopped_id in (current.id, *self._superseded):
            return
        self._superseded.add(stopped_id)
        members = [r for runs in self._runs(experiment).values() for r in runs
                   if r.data.tags.get(STUDY_TAG) == stopped_id]
        if all(r.info.status == "FINISHED" for r in members if PARENT_TAG not in r.data.tags):
            return
        client = mlflow.MlflowClient()
        for member in members:
            if member.info.status == "FINISHED" or SUPERSEDED_TAG in member.data.tags:
                continue
            client.set_tag(member.info.run_id, SUPERSEDED_TAG, current.id)
            if member.info.status in ("RUNNING", "SCHEDULED"):  # the lock says no resume runs it now
                client.set_terminated(member.info.run_id, "KILLED")

    def supersede_tunings(self, experiment: str) -> None:
        """After the current study's tunings: the stopped studies whose tuning they went on with
        (the same Optuna study, ``pfl.tune.study``) are continued by it (:meth:`supersede`)."""
        current = current_study()
        if current is None:
            return
        self._by_name.pop(experiment, None)  # read again: the tunings' own runs are new
        runs = [r for named in self._runs(experiment).values() for r in named if TUNING_TAG in r.data.tags]
        tunings = {r.data.tags[TUNING_TAG] for r in runs if r.data.tags.get(STUDY_TAG) == current.id}
        for run in runs:
            if run.data.tags[TUNING_TAG] in tunings:
                self.supersede(run, experiment)

    @staticmethod
    def _version() -> str:
        from pfl_core._version import __version__

        return __version__

    @staticmethod
    def _other_code(earlier: Earlier, resolved: Resolved) -> bool:
        """Whether ``earlier`` ran with a source of pfl_core or of the spec's plugins other than
        this process's."""
        now = provenance.code_version(provenance.plugin_names(resolved.spec))
        return earlier.loaded.state["code"]["source_sha256"] != now["source_sha256"]

    def _say_if_other_code(self, earlier: Earlier, resolved: Resolved, name: str) -> None:
        if self._other_code(earlier, resolved):
            was = earlier.loaded.state["code"]
            commit = f", written at git commit {was['git_commit'][:12]}" if was.get("git_commit") else ""
            warning_line(f"{name}: kept run {earlier.run.info.run_id} of a stopped study, which ran with other code "
                         f"(the source of pfl_core or of the spec's plugins changed since{commit})")


class ResumeLock:
    """The lock one ``pfl-run SPEC --resume`` holds on a study (a store and an experiment) while it
    continues it: ``<store file>.resume-<experiment's hash>.lock`` beside a SQLite store, else in
    the temporary folder (one machine's resumes). Not the store's own ``<store>.lock``, which a
    new store's creation holds for moments: a resume holds this one for hours. filelock's lock
    (flock) is the process's: the system releases it when the process ends, killed or not. The
    holder's pid is written beside it (``.pid``) for the refusal to name."""

    def __init__(self, uri: str, experiment: str) -> None:
        from filelock import FileLock

        self.uri, self.experiment = uri, experiment
        digest = hashlib.sha256(experiment.encode()).hexdigest()[:12]
        db = sqlite_file(uri)
        if db is not None:
            db = db.resolve()
            self.path = db.with_name(f"{db.name}.resume-{digest}.lock")
        else:
            key = hashlib.sha256(f"{uri}\0{experiment}".encode()).hexdigest()[:16]
            self.path = Path(tempfile.gettempdir()) / f"pfl-resume-{key}.lock"
        self.holder = self.path.with_suffix(".pid")
        self._lock = FileLock(str(self.path))

    def acquire(self) -> None:
        """Take the lock now, or raise PflError naming the process that holds it."""
        from filelock import Timeout

        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise PflError(self._held_line()) from None
        except OSError as exc:
            raise PflError(f"tracking.uri {self.uri}: cannot take the lock {self.path} that keeps two "
                           f"--resume of a study apart ({exc.strerror or exc})") from None
        with contextlib.suppress(OSError):  # the pid only makes the refusal's line more useful
            self.holder.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.holder.unlink(missing_ok=True)
        self._lock.release()

    def _held_line(self) -> str:
        try:
            pid = int(self.holder.read_text().strip())
        except (OSError, ValueError):  # it has not written it yet
            pid = None
        who = f" (pid {pid})" if pid is not None and process_running(pid) else ""
        return (f"another pfl-run --resume{who} is continuing this study of experiment {self.experiment!r} in "
                f"{self.uri}; wait for it to end, and run this command again only if it stops before it is done "
                f"(lock {self.path})")


def hold_resume_locks(points: list, tracking_uri: str | None) -> contextlib.ExitStack:
    """The :class:`ResumeLock` of every store and experiment the points log to, taken now (a
    PflError when another resume holds one); closing the returned stack releases them."""
    import mlflow

    wanted = sorted({(tracking_uri or p.resolved.spec.tracking.uri or mlflow.get_tracking_uri(),
                      p.resolved.spec.tracking_experiment) for p in points})
    held = contextlib.ExitStack()
    try:
        for uri, experiment in wanted:
            lock = ResumeLock(uri, experiment)
            lock.acquire()
            held.callback(lock.release)
    except BaseException:
        held.close()
        raise
    return held


def client_rows(trained: list[dict], table: Path, coldstart: int) -> list[dict]:
    """The engine's final client rows: the trained clients' from the checkpoint (exact) and, with
    cold-start clients, theirs from the run's ``results/clients.csv`` (6 significant digits), each
    value of the type the trained rows' has."""
    rows = [dict(row) for row in trained]
    if not coldstart:
        return rows
    like = rows[0] if rows else {}
    with open(table, newline="") as handle:
        held_out = [row for row in csv.DictReader(handle) if row.get("coldstart") == "True"]
    if not held_out:  # the cold-start evaluation failed: the engine kept the trained rows alone
        return rows
    return ([{**row, "coldstart": False} for row in rows]
            + [{key: _typed(text, like.get(key)) for key, text in row.items()} for row in held_out])


def _typed(text: str, like):
    if text in ("True", "False"):
        return text == "True"
    for kind in ((type(like),) if isinstance(like, (int, float)) else (int, float)):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
