"""A spec's rounds on a Flower federation: its ServerApp and ClientApp (docs/deployment.md).

The ServerApp runs pfl's engine as ``pfl-run`` does (selection, broadcast, aggregation, the
evaluation messages, MLflow tracking) with a :class:`FlowerExecutor`: the client side of a round
(``run_client``) and of an evaluation (``evaluate_client``) travels as a Flower ``Message`` to
the SuperNode that holds the client, and its result comes back as the reply. Client ``c`` is
served by the node whose node config says ``partition-id = c``. The ClientApp rebuilds the
client view (as a process-pool worker does) from the run's constant part, which the server
sends once per node and run, on the data the node loads itself from the spec, and runs the call.

Wire format of this first version: each task, call and result is a pickle (CPU tensors as raw
bytes, the process executor's format) in a ``ConfigRecord`` bytes value. pfl's own counts of
the payloads (``comm_up_bytes``, ``comm_down_bytes``) are logged as under ``pfl-run``; the bytes
Flower carried are logged as ``flower_bytes_down`` and ``flower_bytes_up``.

Run config (``[tool.flwr.app.config]`` or ``flwr run --run-config``): ``spec`` (the spec's path
on the server), ``set`` (``--set`` overrides, separated by ``;``), ``tracking-uri``,
``reply-timeout`` (seconds a round waits for its replies, default 600) and ``node-timeout``
(seconds the server waits for one node per client to connect, default 120).

flwr is imported only inside functions (``flower()``): without the ``flower`` extra, building an
app is one line naming it. The app objects Flower loads are in :mod:`pfl_core.deploy.apps`.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import time

import torch

from pfl_core.data.cache import data_parts
from pfl_core.data.federated import build_federated_data
from pfl_core.engine import Engine, resolve
from pfl_core.errors import PflError, SpecError
from pfl_core.execution.process import _pickled, _returnable, _RuntimePickler, _RuntimeUnpickler
from pfl_core.execution.views import rebuild_view_call, split_view_call
from pfl_core.runtime.client import run_client
from pfl_core.spec import apply_overrides, load_toml
from pfl_core.tracking.tracker import make_tracker

FLOWER_MISSING = "Flower is not installed (optional extra: pip install -e '.[flower]')"
RECORD = "pfl"  # the ConfigRecord every pfl message carries, both ways
REPLY_TIMEOUT = 600.0
NODE_TIMEOUT = 120.0
POLL_SECONDS = 0.05  # between two pulls of replies (Flower's send_and_receive sleeps 3 s)


def flower():
    """flwr's ``app``, ``serverapp`` and ``clientapp`` modules, or one line naming the extra."""
    try:
        from flwr import app, clientapp, serverapp
    except ImportError:
        raise PflError(FLOWER_MISSING) from None
    return app, serverapp, clientapp


def make_server_app():
    """The ServerApp (``pfl_core.deploy.apps:server_app``)."""
    _, serverapp, _ = flower()
    app = serverapp.ServerApp()
    app.main()(server_main)
    return app


def make_client_app():
    """The ClientApp (``pfl_core.deploy.apps:client_app``)."""
    _, _, clientapp = flower()
    app = clientapp.ClientApp()
    for register in (app.train, app.evaluate, app.query):
        register()(client_main)
    return app


# -- the server ---------------------------------------------------------------------------


def server_main(grid, context) -> None:
    """The ServerApp: one run of the spec named by the run config, its clients on the nodes."""
    try:
        result, run_id = run_on_grid(grid, context.run_config)
    except PflError as exc:  # one line, as pfl-run prints it; Flower then reports the run failed
        print(f"pfl: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    final = ", ".join(f"{k}={v:.4f}" for k, v in result.final.items() if k in ("acc_mean", "loss_mean"))
    print(f"pfl: finished in {result.seconds:.1f} s: {final} (MLflow run {run_id})", flush=True)


def run_on_grid(grid, run_config):
    """(the engine's RunResult, its MLflow run id) of the spec ``run_config['spec']`` run with
    its client side on ``grid``'s nodes."""
    path = run_config.get("spec")
    if not path:
        raise PflError("run config 'spec': missing; give the spec file's path on the server "
                       "(flwr run APP --run-config 'spec=\"/path/spec.toml\"')")
    overrides = [part.strip() for part in str(run_config.get("set", "")).split(";") if part.strip()]
    raw = apply_overrides(load_toml(path), overrides)
    if raw.get("sweep"):
        raise SpecError("sweep", "a Flower run is one run of one spec; run each point with its own flwr run "
                                 "(run config 'set': the point's settings)")
    resolved = resolve(raw)
    spec = resolved.spec
    executor = FlowerExecutor(grid, spec.partition.num_clients,
                              reply_timeout=float(run_config.get("reply-timeout", REPLY_TIMEOUT)),
                              node_timeout=float(run_config.get("node-timeout", NODE_TIMEOUT)))
    tracker = make_tracker(spec.tracking, str(run_config.get("tracking-uri", "")) or None)
    result = FlowerEngine(resolved, executor, tracker=tracker, progress=False).run()
    if result.run_id:
        tracker.log_metrics_to(result.run_id, {"flower_bytes_down": float(executor.bytes_down),
                                               "flower_bytes_up": float(executor.bytes_up)})
    return result, result.run_id


class FlowerEngine(Engine):
    """The engine, its executor the Flower grid's nodes whatever ``[executor]`` names."""

    def __init__(self, resolved, executor: FlowerExecutor, **kwargs):
        super().__init__(resolved, **kwargs)
        self.flower_executor = executor

    def _make_executor(self, device, data=None, models=None):
        threads = self.spec.executor.threads or 1  # the sequential loop's, so the server's steps match it
        torch.set_num_threads(threads)
        self.executor_plan = {"name": "flower", "workers": len(self.flower_executor.node_of_client),
                              "threads": threads}
        return self.flower_executor


class FlowerExecutor:
    """The client side of each map as Flower Messages, one per item, to the node of its client;
    results in the items' order. Any other function (server-side work over the server's own
    context, e.g. COSMOS's per-cluster training) runs here, in the ServerApp."""

    name = "flower"

    def __init__(self, grid, num_clients: int, reply_timeout: float = REPLY_TIMEOUT,
                 node_timeout: float = NODE_TIMEOUT):
        self.grid = grid
        self.reply_timeout = reply_timeout
        self._runtime: tuple | None = None  # (the constant shipped, its key, its bytes)
        self._holding: set[int] = set()  # nodes that hold the current runtime
        self.bytes_down = self.bytes_up = 0  # what Flower carried, payloads as sent
        self.node_of_client = self._find_nodes(num_clients, node_timeout)

    def _find_nodes(self, num_clients: int, timeout: float) -> dict[int, int]:
        """{client id: node id}, from each connected node's ``partition-id``."""
        deadline = time.monotonic() + timeout
        nodes = sorted(self.grid.get_node_ids())
        while len(nodes) < num_clients and time.monotonic() < deadline:
            time.sleep(0.5)
            nodes = sorted(self.grid.get_node_ids())
        if len(nodes) < num_clients:
            raise PflError(f"partition.num_clients: the spec has {num_clients} clients but {len(nodes)} Flower node(s) "
                           f"connected within {timeout:.0f} s (run config 'node-timeout'); start one SuperNode per "
                           f"client, each with node config partition-id")
        records = self._exchange([(node, "query", {}) for node in nodes], "nodes")
        node_of_client: dict[int, int] = {}
        for node, record in zip(nodes, records):
            self._raise_error(record)
            client = int(record["partition-id"])
            if not 0 <= client < num_clients:
                raise PflError(f"node {node}: node config partition-id = {client} is out of range: the spec has "
                               f"{num_clients} clients (partition.num_clients), so 0 to {num_clients - 1}")
            if client in node_of_client:
                raise PflError(f"node {node}: node config partition-id = {client} is also node "
                               f"{node_of_client[client]}'s; give each SuperNode its own")
            node_of_client[client] = node
        return node_of_client

    def map(self, fn, items):
        split = split_view_call(fn)
        if split is None:
            for item in items:
                yield fn(item)
            return
        constant, call = split
        key, runtime = self._ship(constant)
        kind = "train" if call[0] is run_client else "evaluate"
        group = f"round {call[3]['round']}"
        call_bytes = _pickled(call)
        requests = []
        for item in items:
            fields = {"item": _pickled(item), "call": call_bytes, "runtime-key": key, "client": item.client_id}
            node = self.node_of_client[item.client_id]
            if node not in self._holding:
                fields["runtime"] = runtime
            requests.append((node, kind, fields))
        records = self._exchange(requests, group)
        # a node whose ClientApp restarted no longer holds the runtime: it says so, and gets it
        again = [i for i, record in enumerate(records) if record.get("missing-runtime")]
        if again:
            resent = [(requests[i][0], kind, {**requests[i][2], "runtime": runtime}) for i in again]
            for i, request, record in zip(again, resent, self._exchange(resent, group)):
                requests[i], records[i] = request, record
        for (node, _, fields), record in zip(requests, records):
            self.bytes_down += sum(len(v) for v in fields.values() if isinstance(v, bytes))
            self._raise_error(record)
            self._holding.add(node)
            self.bytes_up += len(record["result"])
            yield pickle.loads(record["result"])

    def _ship(self, constant: dict) -> tuple[str, bytes]:
        """(key, bytes) of the run's constant part as the nodes rebuild it: the spec and device
        first (a node builds its data from them), then the rest with every part of the data as
        its position in the node's own copy (the process pool's way to leave the data out)."""
        if self._runtime is None or any(self._runtime[0][n] is not v for n, v in constant.items()):
            rest = io.BytesIO()
            try:
                _RuntimePickler(rest, data_parts(constant["data"])).dump(
                    {name: value for name, value in constant.items() if name not in ("spec", "device", "data")})
            except Exception as exc:  # noqa: BLE001 - whatever pickling refused: said in the one line
                raise SpecError("algorithm.name", f"{constant['spec'].algorithm.name} cannot run under Flower: its "
                                                  f"run state cannot be sent to the nodes ({type(exc).__name__}: "
                                                  f"{' '.join(str(exc).split())[:200]})") from None
            shipped = _pickled((constant["spec"], constant["device"], rest.getvalue()))
            self._runtime = (constant, hashlib.sha256(shipped).hexdigest(), shipped)
            self._holding = set()
        return self._runtime[1], self._runtime[2]

    def _exchange(self, requests: list[tuple[int, str, dict]], group: str) -> list:
        """Send ``(node, message type, fields)`` each as one Message; the replies' records in
        the same order. A node that has not replied within ``reply_timeout`` stops the run."""
        app = flower()[0]
        messages = [app.Message(app.RecordDict({RECORD: app.ConfigRecord(fields)}), node, kind, group_id=group)
                    for node, kind, fields in requests]
        ids = list(self.grid.push_messages(messages))
        if len(ids) != len(messages) or not all(ids):
            raise PflError(f"flower: the SuperLink did not take every message of {group} (too large?)")
        waiting = {message_id: i for i, message_id in enumerate(ids)}
        replies: list = [None] * len(ids)
        deadline = time.monotonic() + self.reply_timeout
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                replies[waiting.pop(reply.metadata.reply_to_message_id)] = reply
            if waiting and time.monotonic() > deadline:
                late = sorted(requests[i][0] for i in waiting.values())
                raise PflError(f"flower: node(s) {', '.join(map(str, late))} did not reply within "
                               f"{self.reply_timeout:.0f} s in {group} (run config 'reply-timeout')")
            if waiting:
                time.sleep(POLL_SECONDS)
        records = []
        for (node, _, _), reply in zip(requests, replies):
            if reply.has_error():
                raise PflError(f"node {node}: Flower reported error {reply.error.code} in {group}: "
                               f"{' '.join(str(reply.error.reason).split())[:300]}")
            records.append(dict(reply.content[RECORD]))
        return records

    @staticmethod
    def _raise_error(record: dict) -> None:
        """The exception a node's client side raised, raised here as itself (or its stand-in)."""
        if "error" in record:
            raise pickle.loads(record["error"])

    def close(self) -> None:
        self._runtime, self._holding = None, set()


# -- the node -----------------------------------------------------------------------------

# In a ClientApp's process: the runtime of the last run it served, per node (the simulation
# runtime runs several nodes' ClientApps in one process).
_node_runtime: dict[int, tuple[str, dict]] = {}


def client_main(message, context):
    """The ClientApp: a ``query`` answers the node's client; ``train`` and ``evaluate`` run the
    call they carry on this node's data. Any error goes back to the server as itself."""
    app = flower()[0]
    fields = message.content[RECORD]
    try:
        if message.metadata.message_type.split(".")[0] == "query":
            answer = {"partition-id": node_client(context.node_config)}
        else:
            answer = _serve(fields, context)
    except Exception as exc:  # noqa: BLE001 - any error of the client side goes back to the server as itself
        answer = {"error": _pickled(_returnable(exc))}
    return app.Message(app.RecordDict({RECORD: app.ConfigRecord(answer)}), reply_to=message)


def node_client(node_config) -> int:
    """The client this node serves: its node config's ``partition-id``."""
    if "partition-id" in node_config:
        value = node_config["partition-id"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise PflError(f"node config partition-id = {value!r}: not a whole number")
        return value
    if "data-path" in node_config:
        raise PflError("node config data-path: a node's own npz file is not supported yet; "
                       "use partition-id (a client of the spec's partition)")
    raise PflError("node config: this node has no data; start its SuperNode with "
                   "--node-config 'partition-id=N' (client N of the spec's partition)")


def _serve(fields, context) -> dict:
    client = node_client(context.node_config)
    if int(fields["client"]) != client:
        raise PflError(f"node {context.node_id} serves client {client} (node config partition-id) "
                       f"but was sent client {fields['client']}'s task")
    key = fields["runtime-key"]
    held = _node_runtime.get(context.node_id)
    if held is None or held[0] != key:
        if "runtime" not in fields:
            return {"missing-runtime": True}
        _node_runtime.pop(context.node_id, None)  # the last run's data goes before this one's loads
        held = _node_runtime[context.node_id] = (key, _load_runtime(fields["runtime"]))
    runtime = held[1]
    torch.set_num_threads(runtime["spec"].executor.threads or 1)
    item, call = pickle.loads(fields["item"]), pickle.loads(fields["call"])
    return {"result": _pickled(rebuild_view_call(runtime, call)(item))}


def _load_runtime(shipped: bytes) -> dict:
    """The run's constant part on this node: its data built here from the spec (deterministic
    from the spec's seed), the rest unpickled onto it."""
    spec, device, rest = pickle.loads(shipped)
    torch.set_flush_denormal(True)  # as the server's engine and every executor's workers
    data = build_federated_data(spec, device=device)
    return {**_RuntimeUnpickler(io.BytesIO(rest), data_parts(data)).load(), "spec": spec, "device": device,
            "data": data}
