"""A Flower node's side of a pfl run: the ClientApp's function and the node's own store
(docs/deployment.md, "The node store"). Runs the client side of a round or of an evaluation
on the node's data and its client's state, both kept in the node store (:class:`NodeStore`)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch

from pfl_core.data.cache import data_parts
from pfl_core.data.federated import ClientData, FederatedData, PublicData, build_federated_data
from pfl_core.deploy.records import CALLS, error_fields, flower, from_content, to_content
from pfl_core.errors import PflError
from pfl_core.execution.process import _RuntimeUnpickler
from pfl_core.execution.views import rebuild_view_call
from pfl_core.runtime.client import ClientResult
from pfl_core.state import stateio

# In a ClientApp's process: the runtime of the last run it served, per node (the simulation
# runtime runs several nodes' ClientApps in one process). Flower's deployment runtime may start
# a new process for each message: the node store on disk then holds the run (NodeStore).
_node_runtime: dict[int, tuple[str, dict]] = {}


def default_state_dir() -> Path:
    """Where a node keeps its store without node config ``state-dir``: the user's cache folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pfl" / "flower-node"


class NodeStore:
    """A node's own files, under node config ``state-dir`` (default: ``default_state_dir()``):

    - ``runs/<run>/client-<c>.safetensors``: client ``c``'s state in run ``<run>`` (a name the
      server draws per run), with the last round it trained and the ``client.staged`` of that
      round until the server's next message says whether the upload arrived; one file, written
      atomically (a crash leaves the previous one), in the format of pfl's checkpoints
      (:mod:`pfl_core.state.stateio`: safetensors and JSON, never unpickled);
    - ``runtime/<key>.pickle``: the run's constant part as the server sent it (checked against
      its SHA-256, the key, before it is read) and ``runtime/<key>.data.safetensors``: the data
      the node built for it, so a new ClientApp process neither asks for the run again nor
      rebuilds its data (stateio again: tensors and plain values only).
    """

    def __init__(self, node_config):
        value = str(node_config.get("state-dir", "") or "")
        self.root = Path(value).expanduser() if value else default_state_dir()

    def _client_file(self, run: str, client: int) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", str(run)):
            raise PflError(f"flower: a task names no valid run ({str(run)[:40]!r}): server and node pfl versions differ?")
        return self.root / "runs" / run / f"client-{int(client)}.safetensors"

    def client(self, run: str, client: int) -> dict:
        """{"state", "round" (last trained, 0 before), "staged", "staged-round"} of client ``client``."""
        path = self._client_file(run, client)
        if not path.exists():
            return {"state": {}, "round": 0, "staged": None, "staged-round": None}
        try:
            return stateio.load(path)
        except stateio.CorruptStateError as exc:
            raise PflError(f"node config state-dir: {path} is damaged ({exc}); the client's state is lost") from None

    def save_client(self, run: str, client: int, entry: dict) -> None:
        path = self._client_file(run, client)
        path.parent.mkdir(parents=True, exist_ok=True)
        stateio.save(path, entry)

    def _runtime_file(self, key: str, suffix: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", str(key)):
            raise PflError(f"flower: a task names no valid run key ({str(key)[:70]!r})")
        return self.root / "runtime" / f"{key}{suffix}"

    def runtime(self, key: str) -> bytes | None:
        """The run's constant part as the server sent it, if this node kept it (and it is intact)."""
        path = self._runtime_file(key, ".pickle")
        if not path.exists():
            return None
        shipped = path.read_bytes()
        return shipped if hashlib.sha256(shipped).hexdigest() == key else None

    def save_runtime(self, key: str, shipped: bytes) -> None:
        path = self._runtime_file(key, ".pickle")
        path.parent.mkdir(parents=True, exist_ok=True)
        stateio.write_atomic(path, shipped, durable=False)  # a lost file is asked for again

    def data(self, key: str, spec, device) -> FederatedData | None:
        path = self._runtime_file(key, ".data.safetensors")
        if not path.exists():
            return None
        try:
            plain = stateio.load(path)
        except stateio.CorruptStateError:
            return None  # built again
        return _data_from_plain(plain, spec, device)

    def save_data(self, key: str, data: FederatedData) -> None:
        path = self._runtime_file(key, ".data.safetensors")
        path.parent.mkdir(parents=True, exist_ok=True)
        stateio.write_atomic(path, stateio.dumps(_data_to_plain(data)), durable=False)


_DATA_PLUGINS = ("partitioner", "dataset")  # plugin objects: made again from the spec, not stored


def _data_to_plain(data: FederatedData) -> dict:
    def fields(obj) -> dict:
        return {f.name: getattr(obj, f.name) for f in attrs.fields(type(obj)) if f.name not in _DATA_PLUGINS}

    plain = fields(data)
    plain["clients"] = [fields(client) for client in data.clients]
    plain["public"] = None if data.public is None else fields(data.public)
    return plain


def _data_from_plain(plain: dict, spec, device) -> FederatedData:
    """The ``FederatedData`` ``_data_to_plain`` took apart, its tensors on ``device``, its parts
    in the same order (``data_parts``: the run's constant part refers to them by position)."""
    from pfl_core.registry import DATASET, PARTITIONER, instantiate

    def on_device(fields: dict) -> dict:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}

    plain = dict(plain)
    plain["clients"] = [ClientData(**on_device(client)) for client in plain["clients"]]
    plain["public"] = None if plain["public"] is None else PublicData(**on_device(plain["public"]))
    return FederatedData(**plain,
                         partitioner=instantiate(PARTITIONER, spec.partition.scheme, spec.partition.params,
                                                 "partition.scheme", "partition.params"),
                         dataset=instantiate(DATASET, spec.data.name, spec.data.params, "data.name", "data.params"))


def client_main(message, context):
    """The ClientApp: a ``query`` answers the node's client; ``train`` and ``evaluate`` run the
    call they carry on this node's data and this client's state. Any error goes back to the
    server as its class's name and message."""
    app = flower()[0]
    kind = message.metadata.message_type.split(".")[0]
    try:
        if kind == "query":
            fields = {"partition-id": node_client(context.node_config)}
            split = node_split(context.node_config)
            body = None if split is None else split_sizes(split)
        else:
            fields, body = _serve(kind, *from_content(message.content), context)
        content = to_content(fields, body)
    except Exception as exc:  # noqa: BLE001 - any error of the client side goes back to the server
        content = to_content(error_fields(exc))
    return app.Message(content, reply_to=message)


def node_client(node_config) -> int:
    """The client this node serves: its node config's ``partition-id``."""
    if "partition-id" in node_config:
        value = node_config["partition-id"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise PflError(f"node config partition-id = {value!r}: not a whole number")
        return value
    if "data-path" in node_config:
        raise PflError("node config partition-id: missing; a node with its own data (data-path) still needs "
                       "partition-id = N, the client id it serves in the spec's run")
    raise PflError("node config: this node has no data; start its SuperNode with "
                   "--node-config 'partition-id=N' (client N of the spec's partition) and optionally "
                   "data-path=\"/path/own.npz\" (its own split)")


def node_split(node_config) -> dict | None:
    """This node's own split, from node config ``data-path`` (None without it): an npz file in
    the format the ``npz`` dataset reads (``x_train``, ``y_train``, ``x_test``, ``y_test``; images
    uint8, features float; integer labels), plus optionally ``x_val``, ``y_val`` (else no
    validation samples). {"x_train", "y_train", ...} as numpy arrays."""
    if "data-path" not in node_config:
        return None
    from pfl_core.data.datasets import Npz
    from pfl_core.errors import DataError

    path = str(node_config["data-path"])
    try:
        raw = Npz(Npz.Params(path=path)).load().validate("node config data-path")
        with np.load(os.path.expanduser(path), allow_pickle=False) as arrays:
            val = {name: arrays[name] for name in ("x_val", "y_val") if name in arrays.files}
    except DataError as exc:  # its lines name the spec's key for the npz dataset: this is the node's
        raise DataError(str(exc).replace("data.params.path", "node config data-path", 1)) from None
    if raw.x_test is None:
        raise DataError(f"node config data-path: npz file {path} has no x_test/y_test: a node's own split "
                        f"needs its test samples")
    if len(val) == 1:
        raise DataError(f"node config data-path: npz file {path} has {next(iter(val))} without its pair "
                        f"(x_val and y_val go together)")
    if val and len(val["x_val"]) != len(val["y_val"]):
        raise DataError(f"node config data-path: npz file {path}: x_val has {len(val['x_val'])} samples, "
                        f"y_val {len(val['y_val'])}")
    if not val:
        val = {"x_val": raw.x_train[:0], "y_val": raw.y_train[:0]}
    return {"path": path, "x_train": raw.x_train, "y_train": raw.y_train, "x_test": raw.x_test,
            "y_test": raw.y_test, "x_val": val["x_val"], "y_val": np.asarray(val["y_val"], dtype=np.int64)}


def split_sizes(split: dict) -> dict:
    """What the server learns of a node's own split: its label counts per split (so its sample
    counts), and one sample's shape."""
    return {"counts": {name: np.bincount(split[f"y_{name}"], minlength=1).tolist()
                       for name in ("train", "val", "test")},
            "shape": list(split["x_train"].shape[1:])}


def own_client_data(split: dict, client: int, data: FederatedData) -> ClientData:
    """Client ``client``'s data from the node's own split, prepared as the spec's data is
    (images standardised with the spec's pool statistics)."""
    from pfl_core.data.federated import _labels_tensor, _to_tensor

    device = data.clients[0].train_x.device if len(data.clients) else torch.device("cpu")
    tensors = {}
    for name in ("train", "val", "test"):
        x = _to_tensor(split[f"x_{name}"], data.mean, data.std, device)
        if tuple(x.shape[1:]) != tuple(data.input_shape):
            raise PflError(f"node config data-path: npz file {split['path']} holds samples of shape "
                           f"{tuple(x.shape[1:])} as the model sees them, the spec's data {tuple(data.input_shape)}")
        y = split[f"y_{name}"]
        if len(y) and int(y.max()) >= data.num_classes:
            raise PflError(f"node config data-path: npz file {split['path']} has label {int(y.max())} in y_{name}, "
                           f"but the spec's data has {data.num_classes} classes")
        tensors[f"{name}_x"], tensors[f"{name}_y"] = x, _labels_tensor(y, device)
    indices = {name: np.arange(len(split[f"y_{name}"]), dtype=np.int64) for name in ("train", "val", "test")}
    return ClientData(id=client, indices=indices, num_classes=data.num_classes, **tensors)


def stand_in(client: int, sizes: dict, num_classes: int, input_shape: tuple) -> ClientData:
    """On the server, a client whose node holds its own split: its labels in class order (the
    counts the node reported: what the client weighting, the work counts and the partition
    table use), its samples zeros of the spec's shape that take no memory."""
    tensors = {}
    for name in ("train", "val", "test"):
        counts = sizes["counts"][name]
        if len(counts) > num_classes:
            raise PflError(f"client {client}: node config data-path holds label {len(counts) - 1} in y_{name}, "
                           f"but the spec's data has {num_classes} classes")
        y = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
        tensors[f"{name}_y"] = y
        tensors[f"{name}_x"] = torch.zeros(()).expand(len(y), *input_shape)
    indices = {name: np.arange(len(tensors[f"{name}_y"]), dtype=np.int64) for name in ("train", "val", "test")}
    return ClientData(id=client, indices=indices, num_classes=num_classes, **tensors)


def stand_ins_for(sizes_by_client: dict) -> Callable[[int, tuple], list[ClientData]]:
    """Every client a stand-in (``build_federated_data``'s ``stand_ins``): a run whose nodes all
    hold their own split builds this on the server and on every node, so the data's parts (what
    the run's constant part refers to) are the same everywhere."""
    return lambda num_classes, input_shape: [stand_in(c, sizes_by_client[c], num_classes, input_shape)
                                             for c in range(len(sizes_by_client))]


def replace_client(data: FederatedData, client: int, replacement: ClientData) -> None:
    if not isinstance(data.clients, list):
        raise PflError(f"node config data-path: the spec's dataset ({type(data.dataset).__name__}) builds its "
                       f"clients on demand; a node's own npz needs a dataset built up front")
    data.clients[client] = replacement


def _serve(kind: str, fields: dict, body: dict, context) -> tuple[dict, object]:
    """(reply fields, reply body) of one train or evaluate message (see ``NodeStore``).

    A node that restarts mid-round (its ClientApp process, or the whole SuperNode) keeps what
    its store holds: a task it had not finished is as if never received (its state file is
    the one before the task; the server counts the upload lost or stops, run config
    ``node-lost``); a task it finished but whose reply was lost has advanced its state (as a
    ``dropout`` client's does) and its staged state is dropped at the next message."""
    client = node_client(context.node_config)
    if int(fields["client"]) != client:
        raise PflError(f"node {context.node_id} serves client {client} (node config partition-id) "
                       f"but was sent client {fields['client']}'s task")
    store = NodeStore(context.node_config)
    runtime = _runtime_for(fields, context.node_id, store, client, context.node_config)
    if runtime is None:
        return {"missing-runtime": True}, None
    torch.set_num_threads(runtime["spec"].executor.threads or 1)
    func, task_class = next((f, c) for f, (k, c) in CALLS.items() if k == kind)
    run = fields["run"]
    entry = store.client(run, client)
    settled = entry["staged"] is not None
    if settled:  # the server's word on the last upload: arrived (commit = its round) or not
        if fields.get("commit") == entry["staged-round"]:
            entry["state"].update(entry["staged"])
        entry["staged"] = entry["staged-round"] = None
    task = body["task"]
    if kind == "train" and task["round"] <= entry["round"]:
        raise PflError(f"node {context.node_id}: a task of round {task['round']} for client {client}, which already "
                       f"trained in round {entry['round']} (a stale message)")
    device = runtime["device"]
    state = entry["state"] if device.type == "cpu" else _to_device(entry["state"], device)
    result = rebuild_view_call(runtime, (func, body["args"], body["kwargs"], body["facts"]))(
        task_class(**task, state=state))
    if kind != "train":
        if settled:
            store.save_client(run, client, entry)
        return {}, result
    staged = bool(result.staged)
    store.save_client(run, client, {"state": result.state, "round": task["round"],
                                    "staged": result.staged if staged else None,
                                    "staged-round": task["round"] if staged else None})
    reply = {"staged": task["round"]} if staged else {}
    return reply, {f.name: getattr(result, f.name) for f in attrs.fields(ClientResult)
                   if f.name not in ("state", "staged")}


def _to_device(value, device):
    from pfl_core.state.store import _to_device as to_device

    return to_device(value, device)


def _runtime_for(fields: dict, node_id: int, store: NodeStore, client: int, node_config) -> dict | None:
    """The run's constant part on this node: held in memory, else from the message (kept in the
    node store), else from the node store; None when none has it (the server then sends it)."""
    key = fields["runtime-key"]
    shipped = fields.get("runtime")
    if shipped is not None:
        if hashlib.sha256(shipped).hexdigest() != key:
            raise PflError("flower: the run's constant part does not match its key (damaged in transit?)")
        if store.runtime(key) is None:  # kept for this node's next processes
            store.save_runtime(key, shipped)
    held = _node_runtime.get(node_id)
    if held is not None and held[0] == key:
        return held[1]
    if shipped is None:
        shipped = store.runtime(key)
        if shipped is None:
            return None
    _node_runtime.pop(node_id, None)  # the last run's data goes before this one's loads
    runtime = _load_runtime(shipped, key, store, client, node_split(node_config))
    _node_runtime[node_id] = (key, runtime)
    return runtime


def _load_runtime(shipped: bytes, key: str, store: NodeStore, client: int, split: dict | None) -> dict:
    """The run's constant part on this node: its data from the node store or built here from
    the spec (deterministic from the spec's seed), client ``client``'s from the node's own
    ``split`` if it has one, the rest unpickled onto it."""
    spec, device, own_data_everywhere, rest = pickle.loads(shipped)
    torch.set_flush_denormal(True)  # as the server's engine and every executor's workers
    data = store.data(key, spec, device)
    if data is None:
        stand_ins = None if own_data_everywhere is None else stand_ins_for(own_data_everywhere)
        data = build_federated_data(spec, device=device, stand_ins=stand_ins)
        store.save_data(key, data)
    if split is not None:  # same structure as the server's stand-in: the parts keep their positions
        replace_client(data, client, own_client_data(split, client, data))
    return {**_RuntimeUnpickler(io.BytesIO(rest), data_parts(data)).load(), "spec": spec, "device": device,
            "data": data}
