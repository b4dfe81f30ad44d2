"""MLflow tracking: params with the same names for every method, metrics by round, artifacts."""

import json

import mlflow
from mlflow.tracking import MlflowClient

from pfl_core.engine import Engine, resolve
from pfl_core.tracking import MlflowTracker, flatten
from tiny import tiny_raw

EXPECTED_ARTIFACTS = {
    "resolved_spec.toml",
    "partition/partition_table.csv",
    "partition/partition.png",
    "partition/indices.json",
    "results/clients.csv",
    "results/accuracy_by_round.png",
}


def artifact_paths(client, run_id, path=None):
    out = set()
    for item in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return out


def test_flatten_uses_dotted_keys():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "none"}


def test_runs_of_two_methods_are_logged_side_by_side(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_ids = {}
    for algorithm in ("fedavg", "local"):
        raw = tiny_raw(**{"algorithm.name": algorithm, "experiment.rounds": 2, "tracking.enabled": True})
        engine = Engine(resolve(raw), tracker=MlflowTracker(uri), progress=False)
        run_ids[algorithm] = engine.run().run_id
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    runs = {name: client.get_run(run_id) for name, run_id in run_ids.items()}

    params = {name: run.data.params for name, run in runs.items()}
    assert params["fedavg"].keys() == params["local"].keys()  # same names, comparable in the UI
    assert params["fedavg"]["algorithm.name"] == "fedavg" and params["local"]["algorithm.name"] == "local"
    assert params["local"]["training.batch_size"] == "10"

    for name, run in runs.items():
        assert run.info.status == "FINISHED"
        assert run.data.tags["algorithm"] == name
        history = client.get_metric_history(run.info.run_id, "acc_mean")
        assert [m.step for m in history] == [1, 2]
        for key in ("acc_std", "acc_p10", "loss_mean", "comm_up_bytes", "comm_down_bytes", "round_seconds"):
            assert key in run.data.metrics, key
        assert artifact_paths(client, run.info.run_id) >= EXPECTED_ARTIFACTS
    assert runs["local"].data.metrics["comm_up_bytes"] == 0
    assert runs["fedavg"].data.metrics["comm_up_bytes"] > 0

    local_dir = client.download_artifacts(run_ids["local"], "partition/indices.json", str(tmp_path))
    indices = json.loads(open(local_dir).read())
    seen = [i for c in indices["clients"] for split in ("train", "val", "test") for i in c[split]]
    assert len(seen) == len(set(seen)) == 4 * 120  # every sample once, exactly
