"""A spec's rounds on a Flower federation: its ServerApp and ClientApp (docs/deployment.md).

The ServerApp runs pfl's engine as ``pfl-run`` does (selection, broadcast, aggregation, the
evaluation messages, MLflow tracking) with a :class:`FlowerExecutor`: the client side of a round
(``run_client``) and of an evaluation (``evaluate_client``) travels as a Flower ``Message`` to
the SuperNode that holds the client, and its result comes back as the reply. Client ``c`` is
served by the node whose node config says ``partition-id = c``. The ClientApp
(:mod:`pfl_core.deploy.node`) rebuilds the client view (as a process-pool worker does) from the
run's constant part, which the server sends once per node and run, on the data the node builds
itself from the spec (with its own split from node config ``data-path``, if given), and runs
the call. A ``data-path`` client stands in on the server by the label counts its node reported.

A client's state lives on its node (``node.NodeStore``, node config ``state-dir``): a task goes
out without it and only what ``client_upload`` returned comes back (with the client's metrics
and work). ``client.staged`` stays on the node until the server says, in its next message to
that node, whether the upload was delivered (``commit``): then the node merges it, else drops it.

Wire format (:mod:`pfl_core.deploy.records`): the tensors and arrays of a task and of a result (the broadcast, the upload, the
evaluation message) travel in an ``ArrayRecord`` (numpy format, never pickled), their nesting and
plain values as JSON in a ``ConfigRecord``. Pickled: the run's constant part (the spec, the
plugins, the model bank: Python objects, sent once per node and run) and any value of a payload
that is none of tensor, array, number, string, bool, None, list, tuple, dict or a few pfl value
classes (``pickle/N`` entries). A node's errors come back as their class's name and message, so
the server unpickles nothing but such payload values. ``comm_up_bytes`` and ``comm_down_bytes``
are pfl's own counts as under ``pfl-run``; the bytes Flower carried (every record of every
message) are logged as ``flower_bytes_down`` and ``flower_bytes_up``.

Run config (``[tool.flwr.app.config]`` or ``flwr run --run-config``): ``spec`` (the spec's path
on the server), ``set`` (``--set`` overrides, separated by ``;``), ``tracking-uri``,
``reply-timeout`` (seconds a round waits for its replies, default 600), ``node-timeout``
(seconds the server waits for one node per client to connect, default 120) and ``node-lost``
(``"drop"``, the default: a node Flower reports unavailable, or that has not replied within
``reply-timeout``, is a lost upload as under the ``dropout`` add-on; ``"stop"``: the run stops
with one line naming the node and the round).

flwr is imported only inside functions (``flower()``): without the ``flower`` extra, building an
app is one line naming it. The app objects Flower loads are in :mod:`pfl_core.deploy.apps`.
"""

from __future__ import annotations

import hashlib
import io
import sys
import time
import uuid

import attrs
import torch

from pfl_core.data.cache import data_parts, hand_over
from pfl_core.data.federated import build_federated_data
from pfl_core.deploy.node import (  # noqa: F401 - client_main: the ClientApp's function
    client_main,
    node_client,
    replace_client,
    stand_in,
    stand_ins_for,
)
from pfl_core.deploy.records import (  # noqa: F401
    CALLS,
    FLOWER_MISSING,
    RECORD,
    content_bytes,
    flower,
    from_content,
    raise_error,
    to_content,
)
from pfl_core.engine import Engine, resolve
from pfl_core.engine.engine import pick_device
from pfl_core.errors import PflError, SpecError
from pfl_core.execution.process import _pickled, _RuntimePickler
from pfl_core.execution.views import split_view_call
from pfl_core.registry.budget import WorkCounter
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.registry.plugins import ADDON, Plugin
from pfl_core.runtime.client import ClientResult
from pfl_core.spec import apply_overrides, load_toml
from pfl_core.tracking.tracker import make_tracker

REPLY_TIMEOUT = 600.0
NODE_TIMEOUT = 120.0
POLL_SECONDS = 0.05  # between two pulls of replies (Flower's send_and_receive sleeps 3 s)
NODE_LOST = ("drop", "stop")
# Flower's error codes (flwr.common.constant.ErrorCode) for a node or its reply that is gone:
# MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE (no heartbeat for
# HEARTBEAT_PATIENCE x the interval: 2 x 30 s by default), CLIENT_APP_CRASHED
LOST_CODES = {3: "message unavailable", 4: "reply unavailable", 5: "node unavailable", 8: "ClientApp crashed"}
STAGED = "__pfl_flower_staged__"  # in the server's store: the round whose staged state the node may commit


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
    node_lost = str(run_config.get("node-lost", "drop"))
    if node_lost not in NODE_LOST:
        raise PflError(f"run config 'node-lost' = {node_lost!r}: must be one of {', '.join(NODE_LOST)}")
    resolved = resolve(raw)
    spec = resolved.spec
    blocker = getattr(resolved.algorithm, "not_deployable", lambda: None)()
    if blocker:  # the method's own word: its server side reads what only a node holds
        raise SpecError("algorithm.name", f"{spec.algorithm.name} cannot run under Flower: {blocker}")
    executor = FlowerExecutor(grid, spec.partition.num_clients,
                              reply_timeout=float(run_config.get("reply-timeout", REPLY_TIMEOUT)),
                              node_timeout=float(run_config.get("node-timeout", NODE_TIMEOUT)),
                              drop_lost=node_lost == "drop")
    tracker = make_tracker(spec.tracking, str(run_config.get("tracking-uri", "")) or None)
    result = FlowerEngine(resolved, executor, tracker=tracker, progress=False).run()
    if result.run_id:
        tracker.log_metrics_to(result.run_id, {"flower_bytes_down": float(executor.bytes_down),
                                               "flower_bytes_up": float(executor.bytes_up),
                                               "flower_lost_uploads": float(len(executor.lost))})
    return result, result.run_id


class LostNodes(Plugin):
    """Added to a Flower run whose lost nodes count as lost uploads (run config ``node-lost``):
    a client whose node Flower reported unavailable in this round is a lost upload, as the
    ``dropout`` add-on's are (the round aggregates the arrivals, the client's staged state is
    dropped). Holds only the (round, client) pairs lost, so it travels to the nodes as it is."""

    name = "flower-lost-nodes"
    kind = ADDON

    def __init__(self):
        super().__init__()
        self.lost: set[tuple[int, int]] = set()

    @hookimpl
    def upload_lost(self, ctx, client_id):
        return (ctx.round, client_id) in self.lost


class FlowerEngine(Engine):
    """The engine, its executor the Flower grid's nodes whatever ``[executor]`` names."""

    def __init__(self, resolved, executor: FlowerExecutor, **kwargs):
        if executor.drop_lost:  # the engine's lost-upload path (the dropout add-on's) takes the lost nodes
            resolved = attrs.evolve(resolved, plugins=[executor.lost_nodes, *resolved.plugins])
        super().__init__(resolved, **kwargs)
        self.flower_executor = executor

    def prepare(self):
        """The run's context, each client whose node has its own data (node config data-path)
        standing in by its sizes: label counts as the node reported them, no samples. When every
        client's node has its own, nothing is partitioned: only the public set and the
        standardisation statistics come from the spec's data (as on the nodes)."""
        own = self.flower_executor.own_data
        everyone = self.flower_executor.own_data_everywhere()
        if everyone is not None:
            device = pick_device(self.spec.executor.device)
            hand_over(self.spec, build_federated_data(self.spec, device, stand_ins=stand_ins_for(everyone)), device)
        ctx = super().prepare()
        for client, sizes in sorted(own.items()):
            replace_client(ctx.data, client, stand_in(client, sizes, ctx.data.num_classes, ctx.data.input_shape))
        return ctx

    def _make_executor(self, device, data=None, models=None):
        threads = self.spec.executor.threads or 1  # the sequential loop's, so the server's steps match it
        torch.set_num_threads(threads)
        self.executor_plan = {"name": "flower", "workers": len(self.flower_executor.node_of_client),
                              "threads": threads}
        return self.flower_executor


class FlowerExecutor:
    """The client side of each map as Flower Messages, one per item, to the node of its client;
    results in the items' order. Any other function (server-side work over the server's own
    context, e.g. COSMOS's per-cluster training) runs here, in the ServerApp.

    A task goes without the client's state (its node holds it, :class:`NodeStore`) and comes
    back without it: the result's ``state`` is the server's (empty) entry, its ``staged`` a
    marker (``STAGED``: the round) that the engine commits into that entry when the upload
    arrived; the next message to the node carries it as ``commit``."""

    name = "flower"

    def __init__(self, grid, num_clients: int, reply_timeout: float = REPLY_TIMEOUT,
                 node_timeout: float = NODE_TIMEOUT, drop_lost: bool = True):
        self.grid = grid
        self.reply_timeout = reply_timeout
        self.drop_lost = drop_lost
        self.lost_nodes = LostNodes()
        self.lost: list[tuple[int, int, int, str]] = []  # (round, client, node, why) of each lost upload
        self.run = uuid.uuid4().hex  # names this run's folder in each node's store
        self._runtime: tuple | None = None  # (the constant shipped, its key, its bytes)
        self._holding: set[int] = set()  # nodes that hold the current runtime
        self.bytes_down = self.bytes_up = 0  # what Flower carried: every record of every message
        self.own_data: dict[int, dict] = {}  # client -> its node's own split's sizes (node config data-path)
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
        replies = self._exchange([(node, "query", {}, None) for node in nodes], "nodes")
        node_of_client: dict[int, int] = {}
        for node, reply in zip(nodes, replies):
            if reply is None:
                raise PflError(f"node {node}: did not answer which client it serves (Flower: node unavailable)")
            fields, sizes = reply
            raise_error(fields, f"node {node}: ")
            client = int(fields["partition-id"])
            if not 0 <= client < num_clients:
                raise PflError(f"node {node}: node config partition-id = {client} is out of range: the spec has "
                               f"{num_clients} clients (partition.num_clients), so 0 to {num_clients - 1}")
            if client in node_of_client:
                raise PflError(f"node {node}: node config partition-id = {client} is also node "
                               f"{node_of_client[client]}'s; give each SuperNode its own")
            node_of_client[client] = node
            if sizes is not None:
                self.own_data[client] = sizes
        return node_of_client

    def own_data_everywhere(self) -> dict | None:
        """Every client's sizes when every client's node holds its own split (then neither the
        server nor a node partitions the spec's data), else None."""
        return self.own_data if len(self.own_data) == len(self.node_of_client) else None

    def map(self, fn, items):
        split = split_view_call(fn)
        if split is None:
            for item in items:
                yield fn(item)
            return
        constant, (func, args, kwargs, facts) = split
        if func not in CALLS:
            raise PflError(f"flower: {getattr(func, '__qualname__', func)} is not a client-side call a node runs")
        kind, task_class = CALLS[func]
        key, runtime = self._ship(constant)
        group = f"round {facts['round']}"
        items = list(items)
        requests = []
        for item in items:
            node = self.node_of_client[item.client_id]
            fields = {"run": self.run, "client": item.client_id, "runtime-key": key}
            commit = item.state.pop(STAGED, None)  # the engine committed the last upload's staged state
            if commit is not None:
                fields["commit"] = commit
            if node not in self._holding:
                fields["runtime"] = runtime
            body = {"task": {f.name: getattr(item, f.name) for f in attrs.fields(task_class) if f.name != "state"},
                    "facts": facts, "args": args, "kwargs": kwargs}
            requests.append((node, kind, fields, body))
        replies = self._exchange(requests, group)
        # a node that holds the run neither in memory nor in its store says so, and gets it
        again = [i for i, reply in enumerate(replies) if reply is not None and reply[0].get("missing-runtime")]
        if again:
            resent = [(requests[i][0], kind, {**requests[i][2], "runtime": runtime}, requests[i][3]) for i in again]
            for i, request, reply in zip(again, resent, self._exchange(resent, group)):
                requests[i], replies[i] = request, reply
        for item, (node, _, _, _), reply in zip(items, requests, replies):
            if reply is None:  # lost (Flower's error reply, or no reply in time), with drop_lost
                self.lost_nodes.lost.add((facts["round"], item.client_id))
                yield self._lost_result(item, kind)
                continue
            fields, body = reply
            raise_error(fields)
            self._holding.add(node)
            if kind == "train":
                staged = {STAGED: fields["staged"]} if "staged" in fields else {}
                yield ClientResult(**body, state=item.state, staged=staged)
            else:
                yield body

    @staticmethod
    def _lost_result(item, kind: str):
        """What the engine gets for a client whose node was lost: an upload that the engine's
        lost-upload path drops (``LostNodes``), no work, no loss."""
        if kind != "train":
            raise AssertionError("an evaluation is never dropped")  # _exchange stops the run instead
        return ClientResult(item.client_id, {}, item.state, WorkCounter())

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
            shipped = _pickled((constant["spec"], constant["device"], self.own_data_everywhere(), rest.getvalue()))
            self._runtime = (constant, hashlib.sha256(shipped).hexdigest(), shipped)
            self._holding = set()
        return self._runtime[1], self._runtime[2]

    def _exchange(self, requests: list[tuple], group: str) -> list:
        """Send ``(node, message type, fields, body)`` each as one Message; the replies as
        (fields, body) in the same order. A node Flower reports gone (``LOST_CODES``) or that
        has not replied within ``reply_timeout``: None in its place for a round's training with
        ``drop_lost``, else the run stops with one line naming it."""
        app = flower()[0]
        messages = [app.Message(to_content(fields, body), node, kind, group_id=group, ttl=self.reply_timeout or None)
                    for node, kind, fields, body in requests]
        for message in messages:
            self.bytes_down += content_bytes(message.content)
        ids = list(self.grid.push_messages(messages))
        if len(ids) != len(messages) or not all(ids):
            raise PflError(f"flower: the SuperLink did not take every message of {group} (too large?)")
        waiting = {message_id: i for i, message_id in enumerate(ids)}
        replies: list = [None] * len(ids)
        lost: dict[int, str] = {}
        deadline = time.monotonic() + self.reply_timeout
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                i = waiting.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    code, reason = reply.error.code, " ".join(str(reply.error.reason).split())[:300]
                    if code not in LOST_CODES:
                        raise PflError(f"node {requests[i][0]}: Flower reported error {code} in {group}: {reason}")
                    lost[i] = f"Flower: {LOST_CODES[code]} (error {code})"
                else:
                    self.bytes_up += content_bytes(reply.content)
                    replies[i] = from_content(reply.content)
            if waiting and time.monotonic() > deadline:
                for i in waiting.values():
                    lost[i] = f"no reply within {self.reply_timeout:.0f} s (run config 'reply-timeout')"
                break
            if waiting:
                time.sleep(POLL_SECONDS)
        for i, why in sorted(lost.items()):
            node, kind = requests[i][0], requests[i][1]
            if not (self.drop_lost and kind == "train"):
                raise PflError(f"node {node} (client {requests[i][2].get('client', '?')}) was lost in {group}: {why}"
                               + ("; run config node-lost = \"drop\" counts it as a lost upload"
                                  if kind == "train" else ""))
            self.lost.append((int(group.split()[-1]), requests[i][2]["client"], node, why))
        return replies

    def close(self) -> None:
        self._runtime, self._holding = None, set()
