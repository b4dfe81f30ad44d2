"""A spec on a Flower federation (issue 36, pfl_core/deploy/flower.py): the same metrics as pfl's
sequential loop, the node's errors as one line, and the missing extra named.

The loopback grid below routes each message to ``client_main`` in this process, as a SuperLink
would to a SuperNode (fast: the protocol and the node's errors); the ``simulation`` tests run the
real ServerApp and ClientApp in Flower's simulation runtime (Ray actors for the nodes)."""

from __future__ import annotations

import sys

import pytest
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import PflError
from pfl_core.spec import dump_toml, set_dotted
from pfl_core.tracking.tracker import make_tracker

FLOWER_SKIP = "flwr is not installed (optional extra: pip install -e '.[flower]')"
PUBLIC = {"public.size": 60}
METHODS = {"fedavg": {}, "ditto": {}, "fedmosaic": PUBLIC}  # plain weights; per-client state; public-set payloads


def flower_or_skip():
    return pytest.importorskip("flwr", reason=FLOWER_SKIP)


def three_client_raw(algorithm: str = "fedavg", uri: str | None = None) -> dict:
    settings = {"data.params.num_devices": 3, "partition.num_clients": 3, "algorithm.name": algorithm,
                **METHODS.get(algorithm, {})}
    if uri:
        settings.update({"tracking.enabled": True, "tracking.uri": uri})
    return tiny_raw(**settings)


def comparable(history: list[dict]) -> list[dict]:
    """A run's metrics by round, wall times left out (the only values that may differ)."""
    return [{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in history]


class LoopbackGrid:
    """A Flower grid whose nodes are ``client_main`` called in this process, each with its own
    node config; ``restart(node)`` forgets what the node's ClientApp held in memory (its store
    on disk stays); ``lose(node, round)``: Flower's error reply for an unavailable node, as the
    SuperLink sends it, instead of that node's train reply in that round."""

    def __init__(self, node_configs: dict[int, dict]):
        self.node_configs = node_configs
        self.replies: dict = {}
        self.sent: list = []  # (node, message type, fields, body) as the node decoded them
        self.received: list = []  # (node, message type, fields, body, array bytes) of each reply
        self.lost: set = set()  # (node, round) whose train reply is Flower's NODE_UNAVAILABLE
        self.silent: set = set()  # (node, message type) that never reply

    def get_node_ids(self):
        return list(self.node_configs)

    def push_messages(self, messages):
        from flwr.app import Context, Error, Message, RecordDict

        from pfl_core.deploy import node as node_side
        from pfl_core.deploy import records

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's own grids do
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            fields, body = records.from_content(message.content)
            self.sent.append((node, kind, fields, body))
            ids.append(message.object_id)
            if (node, kind) in self.silent:
                continue
            if kind == "train" and (node, body["task"]["round"]) in self.lost:
                self.replies[message.object_id] = Message(Error(5, "Error: Node Unavailable"), reply_to=message)
                continue
            context = Context(run_id=1, node_id=node, node_config=self.node_configs[node], state=RecordDict(),
                              run_config={})
            reply = self.replies[message.object_id] = node_side.client_main(message, context)
            fields, body = records.from_content(reply.content)
            arrays = reply.content.array_records.get(records.ARRAYS)
            self.received.append((node, kind, fields, body,
                                  sum(a.numpy().nbytes for a in arrays.values()) if arrays else 0))
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    @staticmethod
    def restart(node: int) -> None:
        from pfl_core.deploy import node as node_side

        node_side._node_runtime.pop(node, None)


@pytest.fixture
def loopback(monkeypatch, tmp_path):
    """flwr installed, and this process taken for a ServerApp's task (a Message needs its run)."""
    flower_or_skip()
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the nodes' default store: this test's


HANG_GUARD_S = 1800  # how long a simulated round may wait for its replies before the test fails


def grid_of(*partition_ids, **node_config) -> LoopbackGrid:
    """Nodes 100, 101, ... serving these clients (None: no data; "data-path only": an npz, no id)."""
    return LoopbackGrid({100 + i: ({"partition-id": p, **node_config} if isinstance(p, int)
                                   else {"data-path": "own.npz"} if p else {})
                         for i, p in enumerate(partition_ids)})


def run_on_loopback(raw: dict, grid: LoopbackGrid, tmp_path, **run_config):
    from pfl_core.deploy import flower

    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    result, _ = flower.run_on_grid(grid, {"spec": str(path), "node-timeout": 0.0, "reply-timeout": 30.0,
                                          **run_config})
    return result


def tensor_bytes(value) -> int:
    """The bytes of the tensors in a nested payload (pfl's count, ``nbytes``, for plain tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


@pytest.mark.parametrize("algorithm", sorted(METHODS))
def test_the_loopback_grid_gives_the_sequential_loops_metrics(algorithm, loopback, tmp_path):
    raw = three_client_raw(algorithm)
    reference = Engine(resolve(raw), progress=False).run()
    grid = grid_of(2, 0, 1, **{"state-dir": str(tmp_path / "nodes")})  # node order is not client order
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    assert [row["round"] for row in result.history] == [1, 2, 3]
    # the run's constant part travels once per node; each client's task goes to its own node
    with_runtime = [node for node, kind, fields, _ in grid.sent if "runtime" in fields]
    assert sorted(with_runtime) == [100, 101, 102]
    trained = [(node, body["task"]["client_id"]) for node, kind, _, body in grid.sent if kind == "train"]
    assert sorted(set(trained)) == [(100, 2), (101, 0), (102, 1)] and len(trained) == 9  # 3 rounds x 3 clients
    assert result.final["acc_mean"] == reference.final["acc_mean"]


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto"])
def test_a_task_and_its_result_carry_no_client_state_and_tensors_travel_as_arrays(algorithm, loopback, tmp_path):
    """Ditto's personal model stays on its node: a train message holds the task without a state,
    its reply only the upload (the replies' ArrayRecords hold exactly the uploads' tensors:
    pfl's comm_up_bytes of the run), and the node's store holds the personal model."""
    from pfl_core.state import stateio

    raw = three_client_raw(algorithm)
    grid = grid_of(0, 1, 2, **{"state-dir": str(tmp_path / "nodes")})
    result = run_on_loopback(raw, grid, tmp_path)
    train_sent = [body for _, kind, _, body in grid.sent if kind == "train"]
    train_replies = [(fields, body, arrays) for _, kind, fields, body, arrays in grid.received if kind == "train"]
    assert len(train_sent) == len(train_replies) == 9
    assert all(set(body["task"]) == {"round", "client_id", "message", "skip"} for body in train_sent)
    assert all("state" not in body and "staged" not in body and "state" not in fields
               for fields, body, _ in train_replies)
    assert all(not any(name.startswith("pickle/") for name in fields) for fields, _, _ in train_replies)
    assert sum(arrays for _, _, arrays in train_replies) == result.history[-1]["comm_up_bytes"]  # cumulative
    assert sum(arrays for _, _, arrays in train_replies) == sum(tensor_bytes(body["upload"])
                                                                for _, body, _ in train_replies)
    states = [stateio.load(path) for path in sorted((tmp_path / "nodes" / "runs").glob("*/client-*.safetensors"))]
    assert [entry["round"] for entry in states] == [3, 3, 3]
    if algorithm == "ditto":  # the personal model: on the node, never on the wire
        assert all(tensor_bytes(entry["state"]) > 0 for entry in states)


def test_a_restarted_clientapp_reloads_the_run_and_the_clients_state_from_its_node_store(loopback, tmp_path,
                                                                                           monkeypatch):
    """Node 101's ClientApp restarts (forgets all it held in memory) before each of its
    messages from the 4th on, as Flower's deployment runtime may start a process per message:
    the same metrics, the run sent once per node, the data built once per node."""
    from pfl_core.deploy import node as node_side

    raw = three_client_raw("ditto")
    reference = Engine(resolve(raw), progress=False).run()
    grid = LoopbackGrid({100 + c: {"partition-id": c, "state-dir": str(tmp_path / f"node{c}")} for c in range(3)})
    monkeypatch.setattr(node_side, "_node_runtime", {})  # what earlier tests' nodes held in this process
    calls = {"n": 0}
    serve = node_side._serve
    builds = []
    build = node_side.build_federated_data
    monkeypatch.setattr(node_side, "build_federated_data",
                        lambda spec, device, stand_ins: builds.append(1) or build(spec, device, stand_ins))

    def restarting_serve(kind, fields, body, context):
        calls["n"] += context.node_id == 101
        if context.node_id == 101 and calls["n"] >= 4:
            grid.restart(101)
        return serve(kind, fields, body, context)

    monkeypatch.setattr(node_side, "_serve", restarting_serve)
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    assert calls["n"] > 4
    assert sorted(node for node, _, fields, _ in grid.sent if "runtime" in fields) == [100, 101, 102]
    assert len(builds) == 3  # once per node: node 101's later processes load it from the store
    assert len(list((tmp_path / "node1" / "runtime").glob("*.data.safetensors"))) == 1


def with_dropout(raw: dict, p: float = 0.5) -> dict:
    return {**raw, "addons": [{"name": "dropout", "params": {"p": p}}]}


@pytest.mark.parametrize("algorithm", ["ditto", "scaffold"])
def test_lost_uploads_of_the_dropout_addon_leave_the_nodes_staged_state_as_the_sequential_loop_does(
        algorithm, loopback, tmp_path):
    """SCAFFOLD's c_i is staged (kept only if the upload arrives): the server's word on each
    upload reaches the node with its next message, so the node commits or drops it as the
    sequential loop's store does; dropout p = 0.5 loses some uploads of the 3 rounds."""
    raw = with_dropout(three_client_raw(algorithm))
    reference = Engine(resolve(raw), progress=False).run()
    assert sum(row["dropped_clients"] for row in reference.history) > 0
    grid = grid_of(0, 1, 2)
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    if algorithm == "scaffold":
        commits = [fields.get("commit") for _, kind, fields, _ in grid.sent if kind != "query"]
        assert any(c is not None for c in commits) and any(c is None for c in commits[3:])


def test_a_node_lost_mid_round_is_a_lost_upload_and_the_round_completes(loopback, tmp_path, monkeypatch):
    """Flower's NODE_UNAVAILABLE reply for node 101 (client 1) in round 2: as the dropout add-on
    losing client 1's upload in round 2 (FedAvg's clients keep no state, so only the work
    counted and the mean training loss differ: the lost node did not train)."""
    raw = three_client_raw("fedavg")
    grid = grid_of(0, 1, 2)
    grid.lost.add((101, 2))
    result = run_on_loopback(raw, grid, tmp_path)
    resolved = resolve(with_dropout(raw))
    faults = sys.modules[type(resolved.plugins[0]).__module__]  # the registry's import of plugins/faults
    monkeypatch.setattr(faults, "upload_is_lost", lambda seed, round, client, p: (round, client) == (2, 1))
    reference = Engine(resolved, progress=False).run()
    assert [row["dropped_clients"] for row in reference.history] == [0.0, 1.0, 0.0]
    work = ("budget.", "train_loss_mean", "dropped_clients")  # what the lost node's training did
    assert ([{k: v for k, v in row.items() if not k.startswith(work)} for row in comparable(result.history)]
            == [{k: v for k, v in row.items() if not k.startswith(work)} for row in comparable(reference.history)])
    assert result.history[0]["acc_mean"] != result.history[1]["acc_mean"]


@pytest.mark.parametrize("silent, run_config, says", [
    ((101, "train"), {"node-lost": "stop"},
     "node 101 (client 1) was lost in round 1: Flower: node unavailable (error 5); run config node-lost = \"drop\""),
    ((101, "evaluate"), {"reply-timeout": 0.2},
     "node 101 (client 1) was lost in round 1: no reply within 0 s (run config 'reply-timeout')"),
    ((101, "train"), {"node-lost": "sometimes"}, "run config 'node-lost' = 'sometimes': must be one of drop, stop"),
])
def test_a_lost_node_that_cannot_be_dropped_stops_the_run_with_one_line(silent, run_config, says, loopback, tmp_path):
    grid = grid_of(0, 1, 2)
    if silent[1] == "train" and "reply-timeout" not in run_config:
        grid.lost.add((101, 1))
    else:
        grid.silent.add(silent)
    with pytest.raises(PflError) as caught:
        run_on_loopback(three_client_raw(), grid, tmp_path, **run_config)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_method_whose_run_cannot_be_sent_to_the_nodes_is_one_line_naming_algorithm_name(loopback, tmp_path,
                                                                                         monkeypatch):
    from pfl_core.deploy import flower

    def resolve_with_a_closure(raw):
        resolved = resolve(raw)
        resolved.plugins[-1].helper = lambda x: x  # a plugin holding a lambda: pickle refuses it
        return resolved

    monkeypatch.setattr(flower, "resolve", resolve_with_a_closure)
    with pytest.raises(PflError) as caught:
        run_on_loopback(three_client_raw(), grid_of(0, 1, 2), tmp_path)
    assert str(caught.value).startswith("algorithm.name: fedavg cannot run under Flower: its run state cannot be sent")


@pytest.mark.parametrize("settings, says", [
    ({"algorithm.name": "centralized"},
     "algorithm.name: centralized cannot run under Flower: it trains one model on every client's data pooled"),
    ({"algorithm.name": "pmixfed"},
     "algorithm.name: pmixfed cannot run under Flower: algorithm.params.schedule = 'sigmoid-adaptive' measures"),
])
def test_a_method_whose_server_reads_what_only_a_node_holds_is_refused_in_one_line(settings, says, loopback,
                                                                                  tmp_path):
    """Run through the grid, both gave other metrics than the sequential loop: Centralized trained
    nothing, pMixFed's adaptive gamma came from the server's empty view of each client."""
    raw = three_client_raw()
    for key, value in settings.items():
        set_dotted(raw, key, value)
    with pytest.raises(PflError) as caught:
        run_on_loopback(raw, grid_of(0, 1, 2), tmp_path)
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)


def test_pmixfed_with_a_schedule_that_measures_nothing_runs_as_the_sequential_loop(loopback, tmp_path):
    raw = three_client_raw()
    for key, value in {"algorithm.name": "pmixfed", "algorithm.params.schedule": "dynamic-only"}.items():
        set_dotted(raw, key, value)
    reference = Engine(resolve(raw), progress=False).run()
    grid = grid_of(0, 1, 2, **{"state-dir": str(tmp_path / "nodes")})
    assert comparable(run_on_loopback(raw, grid, tmp_path).history) == comparable(reference.history)


def test_payloads_travel_as_arrays_and_json_and_come_back_the_same(loopback):
    import collections

    import numpy as np
    import torch

    from pfl_core.deploy import records
    from pfl_core.payload import Packed

    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    value = {"w": collections.OrderedDict(a=shared, b=shared.t()), 3: (1, 2.5, float("inf"), None, True, "x"),
             "packed": Packed(torch.tensor([1, 2], dtype=torch.int64), 2), "again": shared,
             "np": np.arange(3, dtype=np.int16), "scalar": np.float32(0.1), "other": {frozenset([1])}}
    fields, back = records.from_content(records.to_content({"client": 1}, value))
    assert fields == {"client": 1}
    assert list(back) == list(value) and isinstance(back["w"], collections.OrderedDict)
    assert back["again"] is back["w"]["a"] and torch.equal(back["w"]["b"], shared.t())
    assert back[3] == value[3] and back["packed"].bits == 2 and torch.equal(back["packed"].value, value["packed"].value)
    assert back["np"].dtype == np.int16 and type(back["scalar"]) is np.float32 and back["scalar"] == value["scalar"]
    assert back["other"] == value["other"]
    content = records.to_content({}, value)
    assert sorted(content[records.ARRAYS]) == ["a0", "a1", "a2", "a3", "a4"]  # shared sent once; b is a view
    assert [name for name in content[records.RECORD] if name.startswith("pickle/")] == ["pickle/0"]  # the set only


def export_split(data, client: int, path, keep_train: int | None = None) -> str:
    """Client ``client``'s split of the spec's data as an npz file a node reads (data-path)."""
    import numpy as np

    c = data.clients[client]
    arrays = {f"{k}_{split}": getattr(c, f"{split}_{k}").numpy() for split in ("train", "val", "test") for k in "xy"}
    if keep_train is not None:
        arrays["x_train"], arrays["y_train"] = arrays["x_train"][:keep_train], arrays["y_train"][:keep_train]
    np.savez(path, **arrays)
    return str(path)


def test_nodes_with_their_own_npz_give_the_sequential_loops_metrics(loopback, tmp_path, monkeypatch):
    """Each node reads its client's split from its own npz (node config data-path), written
    from the spec's partition: the same metrics; the server's copy of each client is a stand-in
    built from the sizes the node reported (no samples), and with every client's data on its
    node nothing is partitioned, on the server or on a node."""
    from pfl_core.data import federated

    raw = three_client_raw("ditto")
    reference = Engine(resolve(raw), progress=False).run()
    data = federated.build_federated_data(resolve(raw).spec)

    def no_partition(*args, **kwargs):
        raise AssertionError("the spec's data was partitioned")

    monkeypatch.setattr(federated, "_partitioned_clients", no_partition)
    grid = LoopbackGrid({100 + c: {"partition-id": c, "data-path": export_split(data, c, tmp_path / f"own{c}.npz")}
                         for c in range(3)})
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    assert [row["num_train"] for row in result.client_rows] == [row["num_train"] for row in reference.client_rows]


def test_a_nodes_own_npz_is_what_it_trains_on_and_its_counts_reach_the_server(loopback, tmp_path, monkeypatch):
    from pfl_core.data.federated import build_federated_data
    from pfl_core.deploy import flower

    raw = three_client_raw("fedavg")
    data = build_federated_data(resolve(raw).spec)
    half = data.clients[1].num_train // 2
    grid = grid_of(0, 1, 2)
    grid.node_configs[101]["data-path"] = export_split(data, 1, tmp_path / "own1.npz", keep_train=half)
    weights = []
    original = flower.FlowerEngine.prepare

    def prepare(self):
        ctx = original(self)
        weights.append(ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1, 2]))
        return ctx

    monkeypatch.setattr(flower.FlowerEngine, "prepare", prepare)
    result = run_on_loopback(raw, grid, tmp_path)
    sizes = [data.clients[0].num_train, half, data.clients[2].num_train]
    assert [row["num_train"] for row in result.client_rows] == sizes
    assert weights[0] == pytest.approx({i: n / sum(sizes) for i, n in enumerate(sizes)})
    assert result.history[-1]["acc_mean"] != Engine(resolve(raw), progress=False).run().history[-1]["acc_mean"]


@pytest.mark.parametrize("arrays, says", [
    (None, "node 101: node config data-path: npz file not found: "),
    ({"x": [[1.0]]}, "node 101: node config data-path: npz file {path} has no 'x_train' array (keys: x)"),
    ({"x_train": [[1.0] * 20] * 4, "y_train": [0, 1, 0, 1]},
     "node 101: node config data-path: npz file {path} has no x_test/y_test: a node's own split needs its test"),
    ({"x_train": [[1.0] * 20] * 4, "y_train": [0, 1, 0, 99], "x_test": [[1.0] * 20], "y_test": [0]},
     "client 1: node config data-path holds label 99 in y_train, but the spec's data has"),
])
def test_a_nodes_bad_npz_stops_the_run_with_one_line_naming_data_path(arrays, says, loopback, tmp_path):
    import numpy as np

    path = tmp_path / "own.npz"
    if arrays is not None:
        np.savez(path, **{k: np.asarray(v, dtype=np.float32 if k.startswith("x") else np.int64)
                          for k, v in arrays.items()})
    grid = grid_of(0, 1, 2)
    grid.node_configs[101]["data-path"] = str(path)
    with pytest.raises(PflError) as caught:
        run_on_loopback(three_client_raw(), grid, tmp_path)
    assert says.format(path=path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("partition_ids, says", [
    ((0, 1, 3), "node 102: node config partition-id = 3 is out of range: the spec has 3 clients"),
    ((0, 1, 1), "node 102: node config partition-id = 1 is also node 101's"),
    ((0, 1, None), "node config: this node has no data; start its SuperNode with --node-config 'partition-id=N'"),
    ((0, 1, "data-path only"), "node config partition-id: missing; a node with its own data (data-path) still"),
    ((0, 1), "partition.num_clients: the spec has 3 clients but 2 Flower node(s) connected"),
])
def test_a_node_without_its_client_stops_the_run_with_one_line(partition_ids, says, loopback, tmp_path):
    with pytest.raises(PflError) as caught:
        run_on_loopback(three_client_raw(), grid_of(*partition_ids), tmp_path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_without_the_extra_the_flower_app_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "pfl_core.deploy.apps", raising=False)
    with pytest.raises(PflError, match=r"^Flower is not installed \(optional extra: pip install -e '\.\[flower\]'\)$"):
        import pfl_core.deploy.apps  # noqa: F401


@pytest.mark.parametrize("algorithm", sorted(METHODS))
def test_flowers_simulation_runtime_gives_the_sequential_loops_metrics(algorithm, tmp_path, monkeypatch):
    """The real ServerApp and ClientApp in Flower's simulation runtime, 3 nodes, 3 rounds: every
    metric MLflow holds for the run equals the sequential loop's run of the same spec."""
    flower_or_skip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the nodes' store (the Ray actors inherit it)
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation
    from mlflow.tracking import MlflowClient

    from pfl_core.deploy import apps, flower

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = three_client_raw(algorithm, uri)
    reference = Engine(resolve(raw), tracker=make_tracker(resolve(raw).spec.tracking), progress=False).run()
    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    app = ServerApp()

    @app.main()
    def main(grid, context):  # run_simulation takes no run config: the app's is set here
        # a hang guard only: a busy machine made FedMosaic's nodes miss a 300 s wait once
        context.run_config.update({"spec": str(path), "reply-timeout": float(HANG_GUARD_S)})
        flower.server_main(grid, context)

    run_simulation(app, apps.client_app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(resolve(raw).spec.tracking_experiment).experiment_id])
    flower_runs = [r for r in runs if r.info.run_id != reference.run_id]
    assert len(flower_runs) == 1, "the ServerApp logged no run (its error line is in the captured output)"
    flower_run = flower_runs[0]
    assert flower_run.info.status == "FINISHED"
    compared = [key for key in client.get_run(reference.run_id).data.metrics if not key.endswith("_seconds")]
    assert "acc_mean" in compared and "comm_up_bytes" in compared
    for key in compared:
        ours, theirs = (sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
                        for run_id in (flower_run.info.run_id, reference.run_id))
        assert ours == theirs and ours, key  # FedMosaic's lambda_mean starts in round 2
        assert len(ours) == 3 or not key.startswith(("acc_", "loss_", "comm_")), key
    assert flower_run.data.metrics["flower_bytes_up"] > flower_run.data.metrics["comm_up_bytes"] > 0
    assert flower_run.data.metrics["flower_lost_uploads"] == 0
    assert list((tmp_path / "cache" / "pfl" / "flower-node" / "runs").glob("*/client-*.safetensors"))
