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
from pfl_core.spec import dump_toml
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
    node config; ``restart(node)`` forgets what the node's ClientApp held."""

    def __init__(self, node_configs: dict[int, dict]):
        self.node_configs = node_configs
        self.replies: dict = {}
        self.sent: list = []  # (node, message type, field names)

    def get_node_ids(self):
        return list(self.node_configs)

    def push_messages(self, messages):
        from flwr.app import Context, RecordDict

        from pfl_core.deploy import flower

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's own grids do
            node = message.metadata.dst_node_id
            self.sent.append((node, message.metadata.message_type, sorted(message.content["pfl"])))
            context = Context(run_id=1, node_id=node, node_config=self.node_configs[node], state=RecordDict(),
                              run_config={})
            self.replies[message.object_id] = flower.client_main(message, context)
            ids.append(message.object_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    @staticmethod
    def restart(node: int) -> None:
        from pfl_core.deploy import flower

        flower._node_runtime.pop(node, None)


@pytest.fixture
def loopback(monkeypatch):
    """flwr installed, and this process taken for a ServerApp's task (a Message needs its run)."""
    flower_or_skip()
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


HANG_GUARD_S = 1800  # how long a simulated round may wait for its replies before the test fails


def grid_of(*partition_ids) -> LoopbackGrid:
    return LoopbackGrid({100 + i: ({"partition-id": p} if p is not None else {}) for i, p in enumerate(partition_ids)})


def run_on_loopback(raw: dict, grid: LoopbackGrid, tmp_path):
    from pfl_core.deploy import flower

    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    result, _ = flower.run_on_grid(grid, {"spec": str(path), "node-timeout": 0.0, "reply-timeout": 30.0})
    return result


@pytest.mark.parametrize("algorithm", sorted(METHODS))
def test_the_loopback_grid_gives_the_sequential_loops_metrics(algorithm, loopback, tmp_path):
    raw = three_client_raw(algorithm)
    reference = Engine(resolve(raw), progress=False).run()
    grid = grid_of(2, 0, 1)  # node order is not client order
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    assert [row["round"] for row in result.history] == [1, 2, 3]
    # the run's constant part travels once per node; each client's task goes to its own node
    with_runtime = [node for node, kind, fields in grid.sent if "runtime" in fields]
    assert sorted(with_runtime) == [100, 101, 102]
    trained = [node for node, kind, _ in grid.sent if kind == "train"]
    assert sorted(set(trained)) == [100, 101, 102] and len(trained) == 9  # 3 rounds x 3 clients
    assert result.final["acc_mean"] == reference.final["acc_mean"]


def test_a_node_that_restarted_gets_the_run_again_and_the_metrics_stay_the_same(loopback, tmp_path, monkeypatch):
    from pfl_core.deploy import flower

    raw = three_client_raw("ditto")
    reference = Engine(resolve(raw), progress=False).run()
    grid = grid_of(0, 1, 2)
    calls = {"n": 0}
    serve = flower._serve

    def restarting_serve(fields, context):  # node 101's ClientApp restarts before its 4th message
        calls["n"] += context.node_id == 101
        if context.node_id == 101 and calls["n"] == 4:
            grid.restart(101)
        return serve(fields, context)

    monkeypatch.setattr(flower, "_serve", restarting_serve)
    result = run_on_loopback(raw, grid, tmp_path)
    assert comparable(result.history) == comparable(reference.history)
    assert [node for node, _, fields in grid.sent if "runtime" in fields].count(101) == 2


@pytest.mark.parametrize("partition_ids, says", [
    ((0, 1, 3), "node 102: node config partition-id = 3 is out of range: the spec has 3 clients"),
    ((0, 1, 1), "node 102: node config partition-id = 1 is also node 101's"),
    ((0, 1, None), "node config: this node has no data; start its SuperNode with --node-config 'partition-id=N'"),
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
def test_flowers_simulation_runtime_gives_the_sequential_loops_metrics(algorithm, tmp_path):
    """The real ServerApp and ClientApp in Flower's simulation runtime, 3 nodes, 3 rounds: every
    metric MLflow holds for the run equals the sequential loop's run of the same spec."""
    flower_or_skip()
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
        assert ours == theirs and len(ours) == 3, key
    assert flower_run.data.metrics["flower_bytes_up"] > flower_run.data.metrics["comm_up_bytes"] > 0
