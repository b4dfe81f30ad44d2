"""Issue 37, a million clients: each client's data generated on demand (``synthetic_clients``),
set-up and rounds that build nothing per client for all clients, and evaluation of a sample of
clients (``evaluation.clients``), logged as such."""

from __future__ import annotations

import hashlib
import json
import pickle
import tracemalloc

import numpy as np
import pytest
import torch
from test_cli import one_line_error, run_cli, write_spec
from test_engine import RecordingTracker
from tiny import run_tiny, tiny_raw

from pfl_core import registry
from pfl_core.data.federated import build_federated_data
from pfl_core.data.ondemand import OnDemandClients
from pfl_core.engine import Engine, resolve
from pfl_core.runtime import evaluation
from pfl_core.seeding import numpy_rng
from pfl_core.state.store import ClientStore

MILLION = 1_000_000


def on_demand_raw(num_clients: int = 40, **overrides) -> dict:
    raw = tiny_raw(**{"data.name": "synthetic_clients", "data.params": {"samples_per_client": 40, "dim": 12},
                      "partition.num_clients": num_clients, "model.params.hidden": [], **overrides})
    return raw


def dataset(**params):
    return registry.instantiate(registry.DATASET, "synthetic_clients", params, "data.name", "data.params")


@pytest.fixture
def build_limit(monkeypatch):
    """Fail at once when more than ``limit[0]`` clients are built: a walk over every client of a
    million fails here instead of running for minutes."""
    limit = [0]
    build = OnDemandClients._build

    def limited(self, client_id):
        if self.built >= limit[0]:
            raise AssertionError(f"client {client_id} built: more than {limit[0]} clients built")
        return build(self, client_id)

    monkeypatch.setattr(OnDemandClients, "_build", limited)
    return limit


# -- the data: the same client gets the same data, wherever it is built ------------------------


def test_the_same_client_gets_the_same_data_and_clients_differ():
    x5, y5 = dataset(dim=8).client_arrays(5)
    again_x, again_y = dataset(dim=8).client_arrays(5)  # a fresh plugin: nothing kept between them
    assert x5.dtype == np.float32 and x5.shape == (300, 8) and y5.dtype == np.int64
    assert np.array_equal(x5, again_x) and np.array_equal(y5, again_y)
    x6, _ = dataset(dim=8).client_arrays(6)
    assert not np.allclose(x5.mean(0), x6.mean(0))  # each client its own device
    other_seed, _ = dataset(dim=8, seed=1).client_arrays(5)
    assert not np.array_equal(x5, other_seed)
    assert len(np.unique(y5)) > 1


def test_clients_are_built_on_demand_split_as_any_client_and_rebuilt_identically_after_pickling():
    data = build_federated_data(resolve(on_demand_raw(MILLION)).spec)
    clients = data.clients
    assert data.on_demand and len(clients) == MILLION and clients.built == 1  # client 0, for the input shape
    last = clients[MILLION - 1]
    x, y = dataset(samples_per_client=40, dim=12).client_arrays(MILLION - 1)
    assert torch.equal(last.train_x, torch.from_numpy(x[last.indices["train"]]))
    assert torch.equal(last.test_y, torch.from_numpy(y[last.indices["test"]]))
    assert sorted(np.concatenate(list(last.indices.values())).tolist()) == list(range(40))
    assert clients[-1] is last and clients.built == 2  # kept: not generated twice
    copy = pickle.loads(pickle.dumps(clients))  # what a worker on another machine gets: no cache
    assert copy.built == clients.built and not copy._cache
    again = copy[MILLION - 1]
    assert again is not last and all(torch.equal(getattr(again, f), getattr(last, f))
                                     for f in ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y"))
    with pytest.raises(IndexError):
        clients[MILLION]


def test_the_cache_is_bounded():
    clients = build_federated_data(resolve(on_demand_raw(1000)).spec).clients
    for i in range(OnDemandClients.CACHE_SIZE + 10):
        clients[i]
    assert len(clients._cache) == OnDemandClients.CACHE_SIZE
    assert 0 not in clients._cache and OnDemandClients.CACHE_SIZE + 9 in clients._cache


def run_state(executor: str, workers: int = 1):
    raw = on_demand_raw(60, **{"experiment.participation": 0.1, "experiment.rounds": 2,
                               "executor.name": executor, "executor.workers": workers})
    engine = Engine(resolve(raw), progress=False)
    result = engine.run()
    averaged = engine.ctx.server["global"]  # FedAvg's model, aggregated in this process from the uploads
    return result, hashlib.sha256(b"".join(t.numpy().tobytes() for t in averaged.values())).hexdigest()


def test_on_demand_data_match_across_executors():
    """Worker processes build their clients themselves: the results are the sequential loop's, bit for bit."""
    sequential, sequential_model = run_state("sequential")
    process, process_model = run_state("process", workers=2)
    assert sequential.final["acc_mean"] == process.final["acc_mean"]
    assert sequential.final["loss_mean"] == process.final["loss_mean"]
    assert sequential_model == process_model


# -- a million clients: nothing per client at set-up, O(participants) per round ----------------


def test_a_million_clients_set_up_and_run_a_round_building_only_the_participants(build_limit, capsys):
    raw = on_demand_raw(MILLION, **{"experiment.participation": 3 / MILLION, "experiment.rounds": 1,
                                    "evaluation.clients": 4})
    build_limit[0] = 1 + OnDemandClients.PLANNING_CLIENTS  # set-up: client 0 (the input shape), the planner's
    engine = Engine(resolve(raw), progress=False)
    tracemalloc.start()
    try:
        ctx = engine.prepare()
        heap = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a list (or an array) with an entry per client is 8 MB at least; set-up allocates well under 1 MB
    assert heap < 4 * 2**20, f"set-up allocated {heap / 2**20:.1f} MiB for a million clients"
    assert len(ctx.training_clients) == MILLION and len(ctx.models.client_archs) == MILLION
    assert ctx.models.arch_of(MILLION - 1) == "mlp" and len(ctx.store) == MILLION
    ctx.store.close()
    build_limit[0] = 1 + 3 + 4 + OnDemandClients.PLANNING_CLIENTS  # + participants, evaluated, planner
    result = Engine(resolve(raw), progress=False).run()
    assert len(result.client_rows) == 4 and "acc_mean" in result.final


def test_the_store_holds_a_million_clients_states_on_disk(tmp_path):
    store = ClientStore(MILLION, cache_clients=1, spill_dir=tmp_path)
    store[MILLION - 1]["w"] = torch.arange(3.0)
    store[7]["w"] = torch.ones(2)  # evicts the last client's state to its spill file
    assert store.in_memory == [7] and store.writes == 1
    assert torch.equal(store[MILLION - 1]["w"], torch.arange(3.0)) and store.reads == 1
    with pytest.raises(KeyError):
        store[MILLION]
    store.close()


def test_dry_run_of_a_million_clients_builds_a_few(build_limit, tmp_path, capsys):
    build_limit[0] = OnDemandClients.PLANNING_CLIENTS
    code, out, err = run_cli(capsys, write_spec(tmp_path, on_demand_raw(MILLION)), "--dry-run")
    assert code == 0, err
    assert f"# ok: {MILLION} clients, train sizes" in out and "generated on demand" in out


@pytest.mark.parametrize("overrides,key", [
    ({"partition.scheme": "iid"}, "partition.scheme"),
    ({"data.subsample": 100}, "data.subsample"),
    ({"public": {"size": 10}}, "public"),
    ({"partition.min_samples": 41}, "partition.min_samples"),
    ({"data.params.dim": 10**7, "data.params.samples_per_client": 100}, "data.params.dim"),
    ({"evaluation.clients": -1}, "evaluation.clients"),
    ({"evaluation.clients": 41}, "evaluation.clients"),
])
def test_what_on_demand_data_and_evaluation_clients_refuse_is_one_line_naming_the_key(
        tmp_path, capsys, overrides, key):
    code, _, err = run_cli(capsys, write_spec(tmp_path, on_demand_raw(40, **overrides)))
    assert code == 2
    assert key in one_line_error(err)


# -- evaluation of a sample of clients ------------------------------------------------------


def test_evaluation_scores_a_fixed_seeded_sample_logs_it_and_says_so(monkeypatch, capsys):
    evaluated = []
    evaluate = evaluation.evaluate_clients

    def recording(ctx, **kwargs):
        evaluated.append((kwargs.get("split", "test"), list(kwargs["client_ids"])))
        return evaluate(ctx, **kwargs)

    monkeypatch.setattr("pfl_core.engine.engine.evaluate_clients", recording)
    tracker = RecordingTracker()
    raw = on_demand_raw(50, **{"evaluation.clients": 7, "evaluation.validation": True, "experiment.rounds": 2,
                               "experiment.seed": 3})
    engine = Engine(resolve(raw), tracker=tracker, progress=False)
    result = engine.run()
    expected = sorted(int(i) for i in numpy_rng(3, "evaluation_clients").choice(50, size=7, replace=False))
    assert evaluated == [(split, expected) for _ in range(2) for split in ("test", "val")]  # every round, same
    assert [row["client"] for row in result.client_rows] == expected
    assert result.final["acc_mean"] == pytest.approx(np.mean([row["acc"] for row in result.client_rows]))
    assert tracker.tags["pfl.evaluation_sample"] == "7 of 50 clients"
    assert tracker.started[2]["evaluation.clients"] == "7"  # the spec's param
    assert "evaluation metrics are over a sample of 7 of 50 clients" in capsys.readouterr().err
    # the partition of on-demand clients is not walked: no rows, no picture, the indices' rule
    assert tracker.texts["partition/partition_table.csv"].strip().count("\n") == 0
    assert "partition/partition.png" not in tracker.figures
    assert json.loads(tracker.texts["partition/indices.json"])["clients"] == []


def test_the_sample_is_drawn_from_the_training_clients_only():
    result, engine = run_tiny(**{"partition.num_clients": 4, "experiment.coldstart_clients": 1,
                                 "evaluation.clients": 2, "experiment.rounds": 1})
    held_out = engine.ctx.coldstart_clients
    assert len(result.client_rows) == 2 + len(held_out)
    sampled = [row["client"] for row in result.client_rows if not row["coldstart"]]
    assert not set(sampled) & set(held_out) and len(set(sampled)) == 2


def test_evaluation_clients_zero_or_all_evaluates_every_client_and_says_nothing(capsys):
    every, _ = run_tiny(**{"experiment.rounds": 1})
    all_four, _ = run_tiny(**{"experiment.rounds": 1, "evaluation.clients": 4})
    assert [row["client"] for row in every.client_rows] == [0, 1, 2, 3]
    untimed = lambda final: {k: v for k, v in final.items() if not k.endswith("_seconds")}
    assert untimed(every.final) == untimed(all_four.final)
    assert "sample" not in capsys.readouterr().err



@pytest.mark.parametrize("clients, wanted, said", [(10_001, 0, True), (10_000, 0, False), (10_001, 5, False)])
def test_evaluating_every_one_of_many_clients_is_said_with_the_key_that_samples(clients, wanted, said):
    from types import SimpleNamespace

    from pfl_core.runtime.evaluation import evaluation_sample

    notes = []
    spec = SimpleNamespace(evaluation=SimpleNamespace(clients=wanted), experiment=SimpleNamespace(seed=0))
    ctx = SimpleNamespace(spec=spec, training_clients=range(clients), tracker=None)
    evaluation_sample(ctx, note=notes.append)
    every = [n for n in notes if n.startswith("every evaluation scores all")]
    assert bool(every) == said
    if said:
        assert every == [f"every evaluation scores all {clients} training clients (evaluation.clients = 0); "
                         "evaluation.clients = N scores a fixed sample of N instead"]

# -- existing specs: bit for bit as before ---------------------------------------------------

# Recorded on the commit before issue 37 (git archive HEAD, this venv's torch, one machine):
# tests/tiny.py's runs' final metrics (repr) and the last working model's bytes.
BEFORE = {
    "fedavg": ({}, {"acc_mean": "0.9895833333333334", "loss_mean": "0.7273926933606465"}, "07113eefa8f18a54"),
    "local_pool": ({"algorithm.name": "local", "model.pool": ["mlp"], "experiment.participation": 0.5},
                   {"acc_mean": "0.9895833333333334", "loss_mean": "0.08104122802615166"}, "bc360bd8d012f5ea"),
    "ditto_coldstart": ({"algorithm.name": "ditto", "experiment.coldstart_clients": 1, "evaluation.validation": True},
                        {"acc_mean": "0.9861111111111112", "coldstart_acc_mean": "1.0",
                         "loss_mean": "0.12033829092979431", "val_acc_mean": "1.0"}, "5f46a899dad87d4d"),
}


@pytest.mark.parametrize("case", list(BEFORE))
def test_existing_specs_give_the_results_they_gave_before(case):
    overrides, metrics, model_hash = BEFORE[case]
    result, engine = run_tiny(**overrides)
    assert {k: repr(result.final[k]) for k in metrics} == metrics
    state = engine.ctx.models.working(engine.ctx.models.arch_of(0)).state_dict()
    assert hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()[:16] == model_hash
    assert isinstance(engine.ctx.data.clients, list)  # the eager path: not on demand
