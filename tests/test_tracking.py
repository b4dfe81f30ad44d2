"""MLflow tracking: params with the same names for every method, metrics by round, artifacts."""

import json

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.tracking.tracker import MlflowTracker, fit_params, flatten

EXPECTED_ARTIFACTS = {
    "resolved_spec.toml",
    "partition/partition_table.csv",
    "partition/partition.png",
    "partition/indices.json",
    "results/clients.csv",
    "results/client_accuracy.png",
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
    assert params["local"]["tracking.uri"] == uri  # the store used, not the spec's "" (its default)

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


def top_level_names(uri, experiment):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return sorted(r.info.run_name for r in runs if "mlflow.parentRunId" not in r.data.tags)


def start_and_end(uri, experiment, name, child=None):
    tracker = MlflowTracker(uri)
    tracker.start(experiment, name, {}, {})
    if child is not None:  # a nested run of the same name: told apart by its parent, not renamed
        inner = MlflowTracker(uri)
        inner.start(experiment, child, {}, {})
        inner.end()
    tracker.end()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the tests below (creating one takes seconds); each uses its own experiments."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def test_a_second_top_level_run_of_the_same_name_gets_a_suffix(store):
    uri = store
    start_and_end(uri, "e", "fedavg", child="fedavg")
    start_and_end(uri, "e", "fedavg")
    start_and_end(uri, "e", "fedavg_x")  # a name the LIKE pattern fedavg% also matches: not taken
    start_and_end(uri, "e", "fedavg")
    start_and_end(uri, "other", "fedavg")  # another experiment: its own names
    start_and_end(uri, "e", "it's \"quoted\"")
    start_and_end(uri, "e", "it's \"quoted\"")
    mlflow.set_tracking_uri(None)
    assert top_level_names(uri, "e") == sorted(["fedavg", "fedavg-2", "fedavg-3", "fedavg_x",
                                                "it's \"quoted\"", "it's \"quoted\"-2"])
    assert top_level_names(uri, "other") == ["fedavg"]


def test_many_and_long_params_are_logged(store):
    uri = store
    params = {f"p{i:03d}": str(i) for i in range(250)}  # more than MLflow's 100 per batch
    params["medium"] = "m" * 600  # over the 500 characters of old MLflow versions: kept whole here
    params["long"] = "x" * 7000  # over MLflow 3's 6000
    tracker = MlflowTracker(uri)
    tracker.start("params", "r", params, {})
    run_id = tracker.run_id
    tracker.end()
    mlflow.set_tracking_uri(None)
    logged = MlflowClient(tracking_uri=uri).get_run(run_id).data.params
    assert {k: v for k, v in logged.items() if k.startswith("p")} == {k: v for k, v in params.items() if k.startswith("p")}
    assert logged["medium"] == params["medium"]
    assert logged["long"] == fit_params({"long": params["long"]})["long"]
    assert len(logged["long"]) <= 6000 and logged["long"].startswith("x" * 5000) and "7000 characters" in logged["long"]
