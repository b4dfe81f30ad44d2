"""Issue 36 on Flower's deployment runtime: a real SuperLink and three SuperNode processes started
here (pfl_core/deploy/local.py), the app run with ``flwr run``, and every metric MLflow holds for
that run equal to pfl's sequential loop's run of the same spec (FedAvg, Ditto, FedMosaic, 3 rounds).

One federation serves the module's runs; its processes end with the module, whatever happened.
Slow by Flower's design: a SuperNode starts a new ClientApp process for every message."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_flower import FLOWER_SKIP, METHODS, three_client_raw

from pfl_core.engine import Engine, resolve
from pfl_core.spec import dump_toml
from pfl_core.tracking.tracker import make_tracker

NUM_NODES = 3
HANG_GUARD_S = 1500  # a whole flwr run, and a round's wait for its replies: only against a hang

APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pfl-flower-app"
version = "1.0.0"
dependencies = ["flwr>=1.42,<1.43"]

[tool.flwr.app]
publisher = "pfl"

[tool.flwr.app.components]
serverapp = "pfl_core.deploy.apps:server_app"
clientapp = "pfl_core.deploy.apps:client_app"

[tool.flwr.app.config]
spec = ""
reply-timeout = {reply_timeout:.1f}
"""


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """One SuperLink and three SuperNodes (client c on the node with partition-id c), stopped at the end."""
    pytest.importorskip("flwr", reason=FLOWER_SKIP)
    from pfl_core.deploy.local import LocalFederation

    home = tmp_path_factory.mktemp("flower-home")
    nodes = [{"partition-id": client, "state-dir": str(home / f"node{client}-state")} for client in range(NUM_NODES)]
    with LocalFederation(home, nodes) as running:
        yield running


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("app")
    (folder / "pyproject.toml").write_text(APP_PYPROJECT.format(reply_timeout=HANG_GUARD_S))
    return folder


def metric_histories(client, run_id: str) -> dict[str, list]:
    """{metric: [(step, value), ...]} of an MLflow run, wall times left out."""
    keys = [key for key in client.get_run(run_id).data.metrics if not key.endswith("_seconds")]
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def living_processes_in_groups(groups: set[int]) -> set[int]:
    """The pids of live (not zombie) processes whose process group is in ``groups``."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            state_and_group = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if state_and_group[0] != "Z" and int(state_and_group[2]) in groups:
            found.add(int(entry.name))
    return found


def test_the_federation_lists_every_supernode_online(federation):
    assert federation.online_nodes() == NUM_NODES
    assert all(process.poll() is None for process in federation.processes.values())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc (Linux)")
def test_stopping_a_federation_ends_every_process_it_started_and_their_children(tmp_path):
    pytest.importorskip("flwr", reason=FLOWER_SKIP)
    from pfl_core.deploy.local import LocalFederation

    with LocalFederation(tmp_path, [{"partition-id": 0, "state-dir": str(tmp_path / "state")}]) as federation:
        assert federation.online_nodes() == 1
        groups = {process.pid for process in federation.processes.values()}
        started = living_processes_in_groups(groups)
        assert len(started) > len(groups)  # the SuperLink's and the SuperNode's own SuperExec too
    assert living_processes_in_groups(groups) == set()
    assert federation.processes == {}


@pytest.mark.parametrize("algorithm", sorted(METHODS))
def test_flowers_deployment_runtime_gives_the_sequential_loops_metrics(algorithm, federation, app, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = three_client_raw(algorithm, uri)
    resolved = resolve(raw)
    reference = Engine(resolved, tracker=make_tracker(resolved.spec.tracking), progress=False).run()
    spec = tmp_path / "spec.toml"
    spec.write_text(dump_toml(raw))

    run = federation.run(app, {"spec": str(spec)}, timeout=HANG_GUARD_S)

    assert run.returncode == 0 and run.run_id is not None, run.log[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(resolved.spec.tracking_experiment).experiment_id])
    flower_runs = [r for r in runs if r.info.run_id != reference.run_id]
    assert len(flower_runs) == 1, f"the ServerApp logged no run:\n{run.log[-3000:]}"
    flower_run = flower_runs[0]
    assert flower_run.info.status == "FINISHED"
    ours, reference_metrics = (metric_histories(client, run_id) for run_id in (flower_run.info.run_id,
                                                                             reference.run_id))
    assert "acc_mean" in reference_metrics and "comm_up_bytes" in reference_metrics
    assert len(reference_metrics["acc_mean"]) == 3  # some metrics start later (FedMosaic's lambda_mean: round 2)
    assert {key: ours[key] for key in reference_metrics} == reference_metrics
    assert flower_run.data.metrics["flower_bytes_up"] > 0 and flower_run.data.metrics["flower_lost_uploads"] == 0
