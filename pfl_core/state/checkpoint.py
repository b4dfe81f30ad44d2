"""Checkpoints: a run's whole state after a round, written atomically, and resuming from it.

A checkpoint is a folder ``<run folder>/round-000012/`` holding ``run.safetensors`` (the round,
``ctx.server``, the counters, the history rows, the client series, the global RNG states, the
tracker's run id, the resolved spec and the code version) and the client states (the store's
own ``save(directory)`` under ``clients/``, or ``clients.safetensors``). Everything goes through
:mod:`pfl_core.state.stateio`: safetensors plus a JSON skeleton, never pickle. The folder is written
under a temporary name and renamed, so a kill mid-write leaves the previous checkpoints as
they were; ``run.safetensors`` also holds the SHA-256 of every other file of its checkpoint,
so a truncated or altered checkpoint is found on load and the previous one is used.

Every random draw of a run is seeded by (seed, purpose, round, client) (:mod:`pfl_core.seeding`),
so a round boundary is a clean resume point: restoring this state after ``setup`` and running
the next rounds gives bit-identical results.

``checkpoint.every = 0`` (the default) picks the period itself: the first checkpoint is written
after round 1, and after every write the next is due in the smallest number of rounds ``p``
with ``write_seconds / (p * mean_round_seconds) < 0.05``, so writing costs under 5% of the run
time and a kill loses at most about 20 write times of work. The final round is always
checkpointed (a failure in the final evaluation or the cold-start step can then be re-run
alone with ``--resume``).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shlex
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from pfl_core.errors import PflError
from pfl_core.state import provenance, stateio
from pfl_core.state.locations import beside_store, process_running, sqlite_file, sqlite_uri

FORMAT = "pfl-checkpoint/1"
RUN_FILE = "run.safetensors"
CLIENTS_FILE = "clients.safetensors"  # the fallback for a store without save/load
CLIENTS_DIR = "clients"  # where a store's own save(directory) writes
CHECKPOINT_TAG = "pfl.checkpoint"  # the MLflow tag naming the run's checkpoint folder
COST_TARGET = 0.05  # automatic period: checkpoint writes take under this fraction of the run time
NAME = re.compile(r"^round-(\d+)$")
SET_MARK = "__pfl_set__"  # stateio keeps no sets: a set is saved as {SET_MARK: [items]}


def _portable(value: Any) -> Any:
    """``value`` with sets as ``{SET_MARK: sorted items}`` and numpy integer keys as ints."""
    if isinstance(value, (set, frozenset)):
        return {SET_MARK: [_portable(v) for v in sorted(value)]}
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, np.integer) else k): _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_portable(v) for v in value)
    return value


def _restored(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if device.type == "cpu" else value.to(device)
    if isinstance(value, dict):
        if set(value) == {SET_MARK}:
            return {_restored(v, device) for v in value[SET_MARK]}
        return {k: _restored(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_restored(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_restored(v, device) for v in value)
    return value


def series_columns(rows: list[dict] | None):
    """``ctx.client_series`` (rows of round, client, name, value; one per client per round per
    name, so it grows all run long) as four arrays and the names: encoding it row by row made
    every checkpoint cost more than the last. Rows of another shape are kept as they are."""
    if rows is None:
        return None
    if not all(type(r) is dict and list(r) == ["round", "client", "name", "value"] and type(r["round"]) is int
               and type(r["client"]) is int and type(r["name"]) is str and type(r["value"]) is float for r in rows):
        return _portable(rows)
    names = list(dict.fromkeys(r["name"] for r in rows))
    index = {name: i for i, name in enumerate(names)}
    return {"columns": {"round": np.array([r["round"] for r in rows], dtype=np.int64),
                        "client": np.array([r["client"] for r in rows], dtype=np.int64),
                        "name": np.array([index[r["name"]] for r in rows], dtype=np.int64),
                        "value": np.array([r["value"] for r in rows], dtype=np.float64)},
            "names": names}


def series_rows(saved) -> list[dict]:
    if isinstance(saved, list):
        return list(saved)
    columns, names = saved["columns"], saved["names"]
    return [{"round": int(r), "client": int(c), "name": names[int(n)], "value": float(v)}
            for r, c, n, v in zip(columns["round"].tolist(), columns["client"].tolist(), columns["name"].tolist(),
                                  columns["value"].tolist())]


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): _sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- where a run's checkpoints go ----------------------------------------------------------------


def run_folder(spec, run_id: str | None, run_name: str, tracking_uri: str | None) -> Path | None:
    """The folder of one run's checkpoints: ``<checkpoint.dir>/<run id>``; ``checkpoint.dir``
    empty: ``checkpoints/`` beside a SQLite store, or in the working directory for a tracking
    server. Without MLflow tracking a run has no id: ``<run name>-<time>-<random>`` under
    ``checkpoint.dir``, and no checkpoint at all when that is empty (no store to sit beside,
    and a library call or a test must not litter the working directory)."""
    section = spec.checkpoint
    if not section.enabled:
        return None
    if section.dir:
        base = Path(section.dir).expanduser()
    elif run_id is None or tracking_uri is None:  # no MLflow store to sit beside
        return None
    else:
        base = beside_store(tracking_uri) / "checkpoints"
    if base.exists() and not base.is_dir():
        raise PflError(f"checkpoint.dir: {base} is a file, not a folder; give a folder (it is left as it is)")
    if run_id is not None:
        name = run_id
    else:
        safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", run_name)[:80] or "run"
        name = f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return base / name


def tracking_uri_of(tracker) -> str | None:
    """The tracker's store, a SQLite file's path made absolute (a resume may run elsewhere)."""
    mlflow = getattr(tracker, "mlflow", None)
    if mlflow is None:
        return None
    uri = mlflow.get_tracking_uri()
    db = sqlite_file(uri)
    return sqlite_uri(db.resolve()) if db is not None and not db.is_absolute() else uri


def checkpointer_for(engine, resume: "Loaded | None" = None) -> "Checkpointer":
    """The run's checkpointer (once its tracker has a run id): a resumed run keeps writing
    beside the checkpoint it resumed from."""
    uri = tracking_uri_of(engine.tracker)
    if not engine.spec.checkpoint.enabled:
        folder = None
    elif resume is not None:
        folder = resume.path.parent
    else:
        folder = run_folder(engine.spec, engine.tracker.run_id, engine.run_name, uri)
    checkpointer = Checkpointer(engine, folder, uri, resume.round if resume is not None else 0)
    if resume is None:
        checkpointer.begin()
    return checkpointer


def round_in_progress(engine) -> int:
    """The round an interrupt stopped in: the one after the last round whose metrics were logged
    (an interrupt between rounds stops the next one before it changed anything)."""
    checkpointer = getattr(engine, "checkpointer", None)
    if checkpointer is None:
        return engine.ctx.round
    return min(checkpointer.completed + 1, checkpointer.rounds)


def resume_command(engine) -> str | None:
    """The exact ``pfl-run --resume ...`` that continues this run, if a checkpoint exists."""
    checkpointer = getattr(engine, "checkpointer", None)
    if checkpointer is None or checkpointer.folder is None or not checkpoints(checkpointer.folder):
        return None
    return resume_line(checkpointer.folder, engine.tracker.run_id, checkpointer.tracking_uri)


def resume_line(folder: Path, run_id: str | None = None, tracking_uri: str | None = None) -> str:
    """``pfl-run --resume RUN_ID --tracking-uri URI`` for a tracked run, else by its folder."""
    if run_id and tracking_uri:
        return f"pfl-run --resume {run_id} --tracking-uri {shlex.quote(tracking_uri)}"
    return f"pfl-run --resume {shlex.quote(str(Path(folder).resolve()))}"


# -- writing -------------------------------------------------------------------------------------


class Checkpointer:
    """Writes one run's checkpoints after rounds (``after_round``) and on an interrupt."""

    def __init__(self, engine, folder: Path | None, tracking_uri: str | None, started_round: int = 0):
        spec = engine.spec
        self.engine = engine
        self.folder = folder
        self.every = spec.checkpoint.every
        self.keep = spec.checkpoint.keep
        self.rounds = spec.experiment.rounds
        self.tracking_uri = tracking_uri
        self.written_round = started_round  # the last round a checkpoint holds (a resumed run's start)
        self.completed = started_round  # the last round whose metrics were logged
        self.next_due = started_round + (self.every or 1)
        self.round_clock = time.perf_counter()
        self.round_seconds: list[float] = []
        self.write_seconds: list[float] = []
        self.code: dict[str, str] | None = None
        self.tagged = False

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def begin(self) -> None:
        """Before round 1: the folder exists and can be written (said now, not after a round's
        work), and the run's ``pfl.checkpoint`` tag names it. The pointer comes first, so a kill
        at any moment after the first checkpoint is complete leaves a run that ``--resume RUN_ID``
        finds (it used to be written after that checkpoint)."""
        if not self.enabled:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.folder):
                pass
        except OSError as exc:
            raise PflError(f"checkpoint.dir: the checkpoint folder {self.folder} cannot be written "
                           f"({exc.strerror or exc}); fix checkpoint.dir, or set checkpoint.enabled = false") from None
        if self.engine.tracker.run_id is not None:
            self.engine.tracker.set_tag(CHECKPOINT_TAG, str(self.folder.resolve()))
        self.tagged = True
        # now, not in the first write: that write's time sets the checkpoint period
        self.code = provenance.code_version(provenance.plugin_names(self.engine.spec))

    def after_round(self, ctx, round: int, history: list[dict], rows: list[dict]) -> None:
        """Round ``round`` is complete and its metrics are logged: write if it is due."""
        now = time.perf_counter()
        self.round_seconds.append(now - self.round_clock)
        self.completed = round
        if self.enabled and (round >= self.next_due or round == self.rounds):
            self.write(ctx, round, history, rows)
            if self.every:
                self.next_due = round + self.every
            else:
                self.next_due = round + self.auto_period()
        self.round_clock = time.perf_counter()  # a checkpoint's own time is not a round's

    def auto_period(self) -> int:
        """The smallest p with write / (p * mean round) < COST_TARGET (the last write's time)."""
        mean_round = sum(self.round_seconds) / len(self.round_seconds)
        write = self.write_seconds[-1]
        if mean_round <= 0:
            return 1
        return int(write / (COST_TARGET * mean_round)) + 1

    def on_interrupt(self, ctx, history: list[dict], rows: list[dict]) -> None:
        """Ctrl-C / SIGTERM: when the state is the end of a completed round (the interrupt came
        between rounds) and no checkpoint holds that round yet, write it. A round in progress is
        not finished and not saved half-way: the resume starts from the last checkpoint."""
        if self.enabled and ctx.round == self.completed and self.completed > self.written_round:
            self.write(ctx, self.completed, history, rows)

    def state(self, ctx, round: int, history: list[dict], rows: list[dict]) -> dict:
        engine = self.engine
        if self.code is None:
            self.code = provenance.code_version(provenance.plugin_names(engine.spec))
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, python_gauss = random.getstate()
        rng = {"torch": torch.get_rng_state(), "numpy": [kind, keys.astype(np.int64), pos, has_gauss, gauss],
               "python": [version, np.array(internal, dtype=np.int64), python_gauss]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": FORMAT,
            "round": round,
            "rounds": self.rounds,
            "server": _portable(ctx.server),
            "counters": {"comm_up": ctx.comm_up, "comm_down": ctx.comm_down,
                         "work_private_epochs": ctx.work_private_epochs,
                         "work_public_epochs": ctx.work_public_epochs,
                         "work_private_steps": ctx.work_private_steps,
                         "work_public_steps": ctx.work_public_steps,
                         "finetune_steps": ctx.finetune_steps},
            "history": _portable(history),
            "rows": _portable(rows),
            "client_series": series_columns(getattr(ctx, "client_series", None)),
            "resolved_values": _portable(ctx.resolved_values),
            "rng": rng,
            "run_id": engine.tracker.run_id,
            "tracking_uri": self.tracking_uri,
            "run_name": engine.run_name,
            "spec": engine.resolved.toml(),
            "code": self.code,
            "written": time.time(),
        }

    def write(self, ctx, round: int, history: list[dict], rows: list[dict]) -> Path:
        """Write round ``round``'s checkpoint atomically, then delete the ones beyond ``keep``."""
        started = time.perf_counter()
        final = self.folder / f"round-{round:06d}"
        tmp = self.folder / f".round-{round:06d}.tmp-{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.folder)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_clients(ctx.store, tmp)
            state = self.state(ctx, round, history, rows)
            state["files"] = _files(tmp)
            stateio.save(tmp / RUN_FILE, state)
            if final.exists():  # a resumed run re-writing a round (an older, corrupted copy)
                old = self.folder / f".round-{round:06d}.old-{os.getpid()}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.folder)
        except (TypeError, OSError) as exc:  # a value stateio cannot hold, a full or read-only disk
            shutil.rmtree(tmp, ignore_errors=True)
            if self.written_round:  # the work up to it is kept
                remedy = (f"round {self.written_round}'s checkpoint is kept: free space, then "
                          f"{resume_command(self.engine)}")
            else:
                remedy = "fix checkpoint.dir, or set checkpoint.enabled = false"
            raise PflError(f"checkpoint of round {round} cannot be written to {self.folder}: "
                           f"{' '.join(str(exc).split())[:200]}; {remedy}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.written_round = round
        self.prune()
        if not self.tagged:
            self.engine.tracker.set_tag(CHECKPOINT_TAG, str(self.folder.resolve()))
            self.tagged = True
        self.write_seconds.append(time.perf_counter() - started)
        return final

    def prune(self) -> None:
        for old in checkpoints(self.folder)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)


LEFTOVER = re.compile(r"^\.round-\d+\.(?:tmp|old)-(\d+)$")


def remove_leftovers(folder: Path) -> None:
    """Remove half-written (``.round-N.tmp-PID``) and replaced (``.old-PID``) checkpoint folders
    of processes that no longer run: a kill mid-write leaves one, and nothing read them."""
    for path in folder.iterdir():
        found = LEFTOVER.match(path.name)
        if found and path.is_dir() and (int(found.group(1)) == os.getpid() or not process_running(int(found.group(1)))):
            shutil.rmtree(path, ignore_errors=True)


def save_clients(store, folder: Path) -> None:
    if hasattr(store, "save"):
        (folder / CLIENTS_DIR).mkdir()
        store.save(folder / CLIENTS_DIR)
    else:
        stateio.save(folder / CLIENTS_FILE, _portable({cid: store[cid] for cid in store}))


def load_clients(store, folder: Path, device: torch.device) -> None:
    if (folder / CLIENTS_DIR).is_dir() and hasattr(store, "load"):
        store.load(folder / CLIENTS_DIR)
        return
    states = _restored(stateio.load(folder / CLIENTS_FILE), device)
    for cid in store:
        store[cid].clear()
        store[cid].update(states.get(cid, {}))


# -- reading -------------------------------------------------------------------------------------


def checkpoints(folder: Path) -> list[Path]:
    """A run folder's checkpoints, the latest round first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


@attrs.define
class Loaded:
    path: Path
    state: dict
    skipped: list[str]  # one line per newer checkpoint that could not be used

    @property
    def round(self) -> int:
        return int(self.state["round"])


def read(path: Path) -> dict:
    """One checkpoint's run state, its other files checked against their SHA-256."""
    state = stateio.load(path / RUN_FILE)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise stateio.CorruptStateError("not a pfl checkpoint")
    for name, digest in state.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise stateio.CorruptStateError(f"{name} is missing")
        if _sha256(file) != digest:
            raise stateio.CorruptStateError(f"{name}: checksum mismatch (altered or incomplete)")
    return state


def find(target: str | os.PathLike) -> Loaded:
    """The latest good checkpoint at ``target``: a checkpoint folder (it, or an older one beside
    it if it is damaged) or a run's folder of checkpoints. Raises PflError when there is none."""
    path = Path(target).expanduser()
    if not path.exists():
        raise PflError(f"--resume: {target} does not exist")
    if (path / RUN_FILE).exists() or NAME.match(path.name):
        folder = path.parent
        candidates = [path, *(p for p in checkpoints(folder) if _round_of(p) < _round_of(path))]
    else:
        folder = path
        candidates = checkpoints(folder)
    if not candidates:
        raise PflError(f"--resume: {target} holds no checkpoint (round-NNNNNN folders)")
    skipped = []
    for candidate in candidates:
        try:
            return Loaded(candidate, read(candidate), skipped)
        except (stateio.CorruptStateError, OSError) as exc:
            skipped.append(f"checkpoint {candidate} is damaged ({' '.join(str(exc).split())[:160]})")
    raise PflError(f"--resume: no usable checkpoint in {folder}: {'; '.join(skipped)}")


def _round_of(path: Path) -> int:
    m = NAME.match(path.name)
    return int(m.group(1)) if m else 1 << 62


def restore(ctx, loaded: Loaded) -> tuple[int, list[dict], list[dict]]:
    """Put a checkpoint's state into a freshly set-up run context (after ``setup``); returns
    (round, history rows, the last evaluation's client rows)."""
    state = loaded.state
    device = ctx.device
    ctx.server.clear()
    ctx.server.update(_restored(state["server"], device))
    load_clients(ctx.store, loaded.path, device)
    counters = state["counters"]
    ctx.comm_up, ctx.comm_down = counters["comm_up"], counters["comm_down"]
    ctx.work_private_epochs = counters["work_private_epochs"]
    ctx.work_public_epochs = counters["work_public_epochs"]
    ctx.work_private_steps = int(counters["work_private_steps"])
    ctx.work_public_steps = int(counters["work_public_steps"])
    ctx.finetune_steps = int(counters["finetune_steps"])
    if state.get("client_series") is not None and hasattr(ctx, "client_series"):
        ctx.client_series = series_rows(state["client_series"])
    ctx.resolved_values.update(state.get("resolved_values") or {})
    ctx.round = int(state["round"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(int(i) for i in internal), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return ctx.round, list(state["history"]), list(state["rows"])
