"""Per-client state owned by the engine, with a bounded in-memory cache and spill to disk.

Plugins keep personal models, supervisors, lambda histories, cluster ids in ``client.state``
(``store[client_id]``): one plain dict per client of tensors and plain values, never in
attributes of their own. The store keeps at most ``cache_clients`` of these dicts in memory
(least recently used first out) and writes the others to a spill folder as
:mod:`pfl_core.state.stateio` files (safetensors, never pickle), so a run's memory does not grow
with the number of clients.

The invariant that makes eviction safe: **a state dict that is referenced outside the store
is pinned** (never evicted). ``store[cid]`` returns the live dict; while a ``Client`` (or any
other code) holds it, it stays in memory and every write to it is seen by the next
``store[cid]`` - there is never a second copy of one client's state. An evicted dict is one
nobody else holds any more, so nothing can write to it after it was saved. A pinned entry can
make the cache exceed its bound for a while; it is evicted at the first access after it was
let go. (Holding a dict is detected from its reference count; holding only a tensor taken out
of a state, past the hook that took it, is outside the plugin contract: plugins keep no state
of their own between hook calls.)

A state is written when it is evicted only if it may have changed since it was last read from
or written to its spill file: unchanged means the same nesting and keys, the same tensor
objects (by identity) with no in-place change (torch's version counter, the storage pointer and
the shape), and equal plain values; a state holding numpy arrays is always written (numpy
has no version counter). Evaluating 10,000 clients therefore reads their states and writes
none. An empty state has no file.

The spill folder (``pfl-state-*``) is removed by :meth:`ClientStore.close` (the engine calls
it at the end of a run), or when the store is collected or the interpreter exits, only ever
by the process that made it. A process killed outright leaves it behind; the next store that
makes a spill folder in the same place removes it: each folder holds an ``flock`` on its
``.owner.lock`` for as long as its process (or a forked worker of it) lives, and only a folder
whose lock nobody holds is removed (a lock works across processes and containers sharing the
folder, where a process id would not; a folder without the lock file is left alone).

Spilled tensors are loaded back on the store's ``device``; a state file keeps dtypes, shapes,
nesting (dict, list, tuple; int or str keys) and plain values exactly (numpy scalars come back
as Python numbers, which is how stateio stores them).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # Windows: spill folders of killed runs are not swept
    fcntl = None

import numpy as np
import torch

from pfl_core.errors import PflError
from pfl_core.payload import nbytes
from pfl_core.state import stateio

# cache_clients = 0 (automatic): at most this many states in memory, and fewer when their
# tensors pass AUTO_CACHE_BYTES (e.g. 256 LeNet-5 models are 64 MB; 256 ResNet-18s would be 11 GB).
AUTO_CACHE_CLIENTS = 256
AUTO_CACHE_BYTES = 256 * 2**20
MANIFEST = "clients.json"
MANIFEST_FORMAT = "pfl-client-store/1"
SUFFIX = ".safetensors"  # stateio files are safetensors files


def _refs(mapping: dict, key) -> int:
    """The reference count of ``mapping[key]`` as seen from here (one helper, so the baseline
    and every check count the same temporary references)."""
    return sys.getrefcount(mapping[key])


def _baseline_refs() -> int:
    probe: OrderedDict[int, dict] = OrderedDict()
    probe[0] = {}
    return _refs(probe, 0)


_NOT_HELD = _baseline_refs()  # a dict referenced only by the cache


# -- change detection: what a state held when it was last read from or written to disk ------


def _snapshot(value: Any):
    """What :func:`_unchanged` compares with; ``None`` when the value cannot be checked
    cheaply (numpy arrays are mutable in place without a trace). Tensors are held by weak
    reference: a snapshot keeps nothing alive, and a replaced tensor is a dead reference."""
    if isinstance(value, torch.Tensor):
        return ("tensor", weakref.ref(value), value._version, value.data_ptr(), tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            snap = _snapshot(item)
            if snap is None:
                return None
            items.append((key, snap))
        return ("dict", items)
    if isinstance(value, (list, tuple)):
        items = [_snapshot(item) for item in value]
        if any(snap is None for snap in items):
            return None
        return ("list" if isinstance(value, list) else "tuple", items)
    if isinstance(value, np.ndarray):
        return None
    return ("plain", type(value), value)  # numbers, strings, booleans, None: immutable


def _unchanged(value: Any, snap) -> bool:
    """Whether ``value`` holds what it held at ``snap``: the same nesting and keys, the same
    tensor objects unchanged in place, equal plain values. (Containers are compared by
    content, not identity: a rebuilt dict of the same tensors is the same state.)"""
    kind = snap[0]
    if kind == "plain":
        _, cls, old = snap
        return type(value) is cls and (value is old or value == old)  # NaN != NaN: "changed", safely
    if kind == "tensor":
        _, ref, version, pointer, shape, dtype = snap
        if ref() is not value:
            return False
        try:
            return (value._version == version and value.data_ptr() == pointer and tuple(value.shape) == shape
                    and value.dtype == dtype)
        except RuntimeError:  # e.g. an inference-mode tensor has no version counter
            return False
    if kind == "dict":
        items = snap[1]
        if not isinstance(value, dict) or len(value) != len(items):
            return False
        for (key, item_snap), (cur_key, cur_item) in zip(items, value.items()):
            if key != cur_key or type(key) is not type(cur_key) or not _unchanged(cur_item, item_snap):
                return False
        return True
    items = snap[1]
    expected = list if kind == "list" else tuple
    return (isinstance(value, expected) and len(value) == len(items)
            and all(_unchanged(v, s) for v, s in zip(value, items)))


def _to_device(value: Any, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


class ClientStore:
    """Per-client state: ``store[cid]`` is client ``cid``'s live dict (``{}`` at first).

    ``cache_clients``: how many states stay in memory (>= 1), 0 for automatic (at most
    :data:`AUTO_CACHE_CLIENTS` and :data:`AUTO_CACHE_BYTES` of tensors). ``spill_dir``: the
    folder in which the spill folder is created (a fresh temporary folder inside it, removed
    by :meth:`close`); empty or None: the system's temporary folder. ``device``: where
    spilled tensors are loaded back to. See the module docstring for the eviction invariant.
    """

    def __init__(self, num_clients: int, cache_clients: int = 0, spill_dir: str | os.PathLike | None = None,
                 device: torch.device | str | None = None):
        if cache_clients < 0:
            raise ValueError(f"cache_clients must be >= 0, got {cache_clients}")
        self._num_clients = num_clients
        self.automatic = cache_clients == 0
        self.cache_clients = AUTO_CACHE_CLIENTS if self.automatic else cache_clients
        self.cache_bytes = AUTO_CACHE_BYTES if self.automatic else None
        self._spill_parent = str(spill_dir) if spill_dir else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()  # least recently used first
        self._snapshots: dict[int, Any] = {}  # cached states as their spill file has them
        self._sizes: dict[int, int] = {}  # tensor bytes of cached states (automatic mode), estimated
        self._last: int | None = None  # the state handed out last: re-measured at the next access
        self._on_disk: set[int] = set()  # clients whose spill file holds their state
        self._spill: Path | None = None  # created at the first spill
        self._cleanup = None
        self.closed = False
        self.writes = 0  # spill files written (evictions of changed states, checkpoints): for tests and benchmarks
        self.reads = 0

    # -- the mapping interface ---------------------------------------------------------

    def __getitem__(self, client_id: int) -> dict[str, Any]:
        state = self._cache.get(client_id)
        if state is None:
            self._check_id(client_id)
            state = self._read(client_id) if client_id in self._on_disk else {}
            self._cache[client_id] = state
        else:
            self._cache.move_to_end(client_id)
        self._handed_out(client_id)
        return state

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._num_clients))

    def __len__(self) -> int:
        return self._num_clients

    def replace(self, client_id: int, state: dict[str, Any]) -> None:
        """Set client ``client_id``'s whole state (e.g. as a worker process returns it). A dict
        already in memory is updated in place, so whoever holds it sees the new state."""
        self._check_id(client_id)
        live = self._cache.get(client_id)
        if live is None:
            self._cache[client_id] = dict(state)
        else:
            if live is not state:
                live.clear()
                live.update(state)
            self._cache.move_to_end(client_id)
        self._snapshots.pop(client_id, None)  # written at eviction
        self._handed_out(client_id)

    @property
    def in_memory(self) -> list[int]:
        """The clients whose state is in memory now, least recently used first."""
        return list(self._cache)

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Write every client's state into ``directory`` (one stateio file per client with a
        non-empty state, then a manifest): a state already in its spill file is linked (or
        copied across file systems), a changed one in memory is written once (to its spill
        file, then linked). Memory stays bounded: no state is loaded to do this."""
        self._require_open()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for client_id in list(self._cache):
            self._write_back(client_id)
        saved = sorted(self._on_disk)
        for client_id in saved:
            target = directory / f"{client_id}{SUFFIX}"
            target.unlink(missing_ok=True)
            _link_or_copy(self._path(client_id), target)
            _fsync(target)  # spill files are written without fsync; a checkpoint must be durable
        keep = {f"{client_id}{SUFFIX}" for client_id in saved}
        for stale in directory.glob(f"*{SUFFIX}"):  # a reused folder: states now empty
            if stale.name not in keep:
                stale.unlink()
        manifest = {"format": MANIFEST_FORMAT, "num_clients": self._num_clients, "clients": saved}
        stateio.write_atomic(directory / MANIFEST, json.dumps(manifest).encode(), durable=True)

    def load(self, directory: str | os.PathLike) -> None:
        """Replace every client's state by those :meth:`save` wrote into ``directory``. The
        files are linked (or copied) into the spill folder and read when each client is
        first accessed, where their checksum is verified (``stateio.CorruptStateError``)."""
        self._require_open()
        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise PflError(f"{directory}: no readable client-state manifest {MANIFEST} "
                           f"({' '.join(str(exc).split())[:120]})") from None
        if manifest.get("format") != MANIFEST_FORMAT:
            raise PflError(f"{directory / MANIFEST}: not a client-state manifest ({MANIFEST_FORMAT})")
        if manifest.get("num_clients") != self._num_clients:
            raise PflError(f"{directory}: the saved states are of {manifest.get('num_clients')} clients, "
                           f"this run has {self._num_clients}")
        clients = [int(c) for c in manifest.get("clients", [])]
        missing = [c for c in clients if not (directory / f"{c}{SUFFIX}").is_file()]
        if missing:
            raise PflError(f"{directory}: the state files of clients {missing[:5]} are missing")
        self._cache.clear()
        self._snapshots.clear()
        self._sizes.clear()
        self._last = None
        for client_id in list(self._on_disk):
            self._path(client_id).unlink(missing_ok=True)
        self._on_disk.clear()
        for client_id in clients:
            self._check_id(client_id)
            target = self._path(client_id)  # creates the spill folder
            target.unlink(missing_ok=True)
            _link_or_copy(directory / f"{client_id}{SUFFIX}", target)
            self._on_disk.add(client_id)

    # -- the end of a run ------------------------------------------------------------------

    def close(self) -> None:
        """Remove the spill folder. States still in memory stay readable; a spilled one is
        gone, and asking for it is an error."""
        if self._cleanup is not None:
            self._cleanup()  # weakref.finalize: runs once
        self.closed = True

    @property
    def spill_folder(self) -> Path | None:
        """The spill folder, once something was spilled (None before)."""
        return self._spill

    # -- internals -------------------------------------------------------------------------

    def _check_id(self, client_id) -> None:
        if not isinstance(client_id, (int, np.integer)) or not 0 <= client_id < self._num_clients:
            raise KeyError(client_id)

    def _require_open(self) -> None:
        if self.closed:
            raise PflError("the client store is closed (the run ended and its spill folder was removed)")

    def _handed_out(self, client_id: int) -> None:
        if self.automatic:
            previous = self._last
            if previous is not None and previous != client_id and previous in self._cache:
                self._sizes[previous] = _tensor_bytes(self._cache[previous])
            self._sizes.setdefault(client_id, _tensor_bytes(self._cache[client_id]))
        self._last = client_id
        self._evict(keep=client_id)

    def _over_bound(self) -> bool:
        if len(self._cache) > self.cache_clients:
            return True
        return self.cache_bytes is not None and sum(self._sizes.values()) > self.cache_bytes

    def _evict(self, keep: int) -> None:
        if not self._over_bound():
            return
        for client_id in list(self._cache):  # least recently used first
            if client_id == keep or _refs(self._cache, client_id) > _NOT_HELD:
                continue  # pinned: in use outside the store
            self._write_back(client_id)
            del self._cache[client_id]
            self._snapshots.pop(client_id, None)
            self._sizes.pop(client_id, None)
            if not self._over_bound():
                return

    def _write_back(self, client_id: int) -> None:
        """Make the spill file hold the cached state (nothing to do when it is unchanged)."""
        state = self._cache[client_id]
        snap = self._snapshots.get(client_id)
        if snap is not None and _unchanged(state, snap):
            return
        if not state:
            if client_id in self._on_disk:
                self._path(client_id).unlink(missing_ok=True)
                self._on_disk.discard(client_id)
            self._snapshots[client_id] = _snapshot(state)
            return
        self._require_open()
        stateio.write_atomic(self._path(client_id), stateio.dumps(state), durable=False)
        self.writes += 1
        self._on_disk.add(client_id)
        self._snapshots[client_id] = _snapshot(state)

    def _read(self, client_id: int) -> dict[str, Any]:
        if self.closed:
            raise PflError(f"client {client_id}'s state was spilled to disk and the run has ended "
                           f"(its spill folder is removed); raise state.cache_clients to keep every state in memory")
        state = stateio.loads(self._path(client_id).read_bytes())
        self.reads += 1
        if self.device.type != "cpu":
            state = _to_device(state, self.device)
        self._snapshots[client_id] = _snapshot(state)
        return state

    def _path(self, client_id: int) -> Path:
        if self._spill is None:
            if self._spill_parent:
                Path(self._spill_parent).mkdir(parents=True, exist_ok=True)
            remove_abandoned_spills(Path(self._spill_parent or tempfile.gettempdir()))
            self._spill = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=self._spill_parent))
            lock = _hold_owner_lock(self._spill)
            # Removed by close(), or when the store is collected or the interpreter exits.
            self._cleanup = weakref.finalize(self, _remove_spill, self._spill, os.getpid(), lock)
        return self._spill / f"{client_id}{SUFFIX}"


def _remove_spill(folder: Path, owner_pid: int, lock: int | None = None) -> None:
    """Remove the spill folder, from the process that made it only: a forked worker process
    holds a copy of the store, and its copy going away must not take the folder with it."""
    if os.getpid() == owner_pid:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


SPILL_PREFIX = "pfl-state-"
OWNER_LOCK = ".owner.lock"


def _hold_owner_lock(folder: Path) -> int | None:
    """Take the exclusive ``flock`` that marks ``folder`` as in use, for this process's life (its
    forked workers share it). Locked under another name, then renamed: a sweeping process never
    sees the lock file unlocked. None where ``fcntl`` is missing (Windows: nothing is swept)."""
    if fcntl is None:
        return None
    fd = os.open(folder / (OWNER_LOCK + ".new"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    os.replace(folder / (OWNER_LOCK + ".new"), folder / OWNER_LOCK)
    return fd


def remove_abandoned_spills(parent: Path) -> list[Path]:
    """Remove the spill folders in ``parent`` whose owner is gone (a process killed outright):
    those with a lock file nobody holds. Folders without one (being created, or made by an
    older pfl) and folders this process may not open are left alone. Returns the removed."""
    removed = []
    if fcntl is None:
        return removed
    for folder in parent.glob(SPILL_PREFIX + "*"):
        try:
            fd = os.open(folder / OWNER_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its run is alive
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        removed.append(folder)
    return removed


def _tensor_bytes(state) -> int:
    try:
        return nbytes(state)
    except TypeError:  # a value nbytes does not count: its tensors are what matters here
        return 0


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not supported
        shutil.copyfile(source, target)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
