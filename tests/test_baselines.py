"""FedAvg, FedProx, Local, Centralized: equivalences, communication, state, seeding."""

import torch
from tiny import run_tiny, tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.execution import SequentialExecutor


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_fedprox_with_mu_zero_equals_fedavg_exactly():
    fedavg, e1 = run_tiny()
    fedprox, e2 = run_tiny(**{"algorithm.name": "fedprox", "algorithm.params.mu": 0.0})
    assert_same_state(e1.ctx.server["global"], e2.ctx.server["global"])
    for h1, h2 in zip(fedavg.history, fedprox.history):
        assert h1["acc_mean"] == h2["acc_mean"] and h1["loss_mean"] == h2["loss_mean"]


def test_fedavg_with_one_client_equals_centralized_on_its_data():
    one_client = {"data.params.num_devices": 1, "partition.num_clients": 1, "training.shuffle": False}
    _, fedavg = run_tiny(**one_client)
    _, central = run_tiny(**one_client, **{"algorithm.name": "centralized"})
    assert_same_state(fedavg.ctx.server["global"], central.ctx.server["global"])


def test_local_never_communicates_and_keeps_a_model_per_client():
    result, engine = run_tiny(**{"algorithm.name": "local"})
    assert result.final["comm_up_bytes"] == 0 and result.final["comm_down_bytes"] == 0
    first, second = (engine.ctx.store[i]["weights"] for i in (0, 1))
    assert any(not torch.equal(first[k], second[k]) for k in first)


def test_fedavg_counts_a_model_each_way_per_participant():
    result, engine = run_tiny(**{"experiment.participation": 0.5})
    model_bytes = sum(v.numel() * v.element_size() for v in engine.ctx.server["global"].values())
    per_round = 2 * model_bytes  # 2 of 4 clients take part
    assert [h["comm_up_bytes"] for h in result.history] == [per_round * r for r in (1, 2, 3)]
    assert [h["comm_down_bytes"] for h in result.history] == [per_round * r for r in (1, 2, 3)]


def test_fedavg_holds_no_model_per_client():
    _, engine = run_tiny()
    assert all(engine.ctx.store[i] == {} for i in range(4))
    assert list(engine.ctx.server) == ["global"]


def test_partial_participation_is_seeded_and_metrics_cover_every_client():
    raw = tiny_raw(**{"experiment.participation": 0.5, "experiment.rounds": 4})
    picked = []
    for _ in range(2):
        engine = Engine(resolve(raw), progress=False)
        ctx = engine.prepare()
        ctx.hooks.setup(ctx=ctx)
        rounds = []
        for r in range(1, 5):
            engine.run_round(ctx, r)
            rounds.append(tuple(ctx.participants))
        picked.append(rounds)
    assert picked[0] == picked[1]
    assert all(len(p) == 2 for p in picked[0])
    assert len(set(picked[0])) > 1  # not the same pair every round
    result, _ = run_tiny(**{"experiment.participation": 0.5})
    assert len(result.client_rows) == 4


class ReversedExecutor(SequentialExecutor):
    def map(self, fn, items):
        return (fn(i) for i in reversed(list(items)))


def test_results_do_not_depend_on_the_order_clients_run_in():
    finals = []
    for executor in (SequentialExecutor(), ReversedExecutor()):
        engine = Engine(resolve(tiny_raw(**{"algorithm.name": "local"})), progress=False)
        ctx = engine.prepare()
        ctx.executor = executor
        ctx.hooks.setup(ctx=ctx)
        for r in (1, 2):
            engine.run_round(ctx, r)
        finals.append([ctx.store[i]["weights"] for i in range(4)])
    for a, b in zip(*finals):
        assert_same_state(a, b)


def test_same_spec_gives_the_same_numbers():
    r1, _ = run_tiny(**{"experiment.participation": 0.5})
    r2, _ = run_tiny(**{"experiment.participation": 0.5})
    strip = lambda h: {k: v for k, v in h.items() if not k.endswith("seconds")}  # noqa: E731
    assert [strip(h) for h in r1.history] == [strip(h) for h in r2.history]
    r3, _ = run_tiny(**{"experiment.participation": 0.5, "experiment.seed": 1})
    assert [strip(h) for h in r1.history] != [strip(h) for h in r3.history]


def test_local_beats_fedavg_on_non_iid_synthetic_data():
    """The quickstart's personalization effect, on the tiny scale."""
    quickstart_like = {
        "experiment.rounds": 6, "data.params.num_devices": 20, "partition.num_clients": 20,
        "data.params.samples_per_device": 300, "data.params.dim": 60, "model.params.hidden": [],
        "training.lr": 0.05, "training.local_epochs": 2,
    }
    local, _ = run_tiny(**quickstart_like, **{"algorithm.name": "local"})
    fedavg, _ = run_tiny(**quickstart_like)
    assert local.final["acc_mean"] > fedavg.final["acc_mean"] + 0.1


def test_coldstart_clients_never_train_and_are_scored_separately():
    result, engine = run_tiny(**{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2,
                                 "data.params.num_devices": 5, "partition.num_clients": 5})
    ctx = engine.ctx
    assert len(ctx.coldstart_clients) == 1 and ctx.coldstart_clients[0] not in ctx.training_clients
    trained = [row for row in result.client_rows if not row.get("coldstart")]
    assert len(trained) == 4 and "coldstart_acc_mean" in result.final
    model_bytes = sum(v.numel() * v.element_size() for v in ctx.server["global"].values())
    assert result.final["comm_up_bytes"] == 3 * 4 * model_bytes  # only the 4 training clients


def test_coldstart_with_zero_epochs_scores_the_global_model():
    result, engine = run_tiny(**{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 0,
                                 "data.params.num_devices": 5, "partition.num_clients": 5})
    from pfl_core.runtime.evaluation import evaluated_models, score

    client = engine.ctx.client(engine.ctx.coldstart_clients[0])
    model = evaluated_models(engine.ctx, client)[""]  # FedAvg's: the global model
    assert result.final["coldstart_acc_mean"] == score(model, client.data.test_x, client.data.test_y).accuracy


BASELINES = ["fedavg", "fedprox", "local", "centralized", "fedalt", "fedsim", "fedbabu", "lgfedavg",
             "corrupted_clients"]


ALIASES = {"perfed_ckt": "comet"}  # an entry point that names another plugin's class


def test_each_baseline_class_carries_its_entry_point_name():
    """The name a plugin reports (registration, messages) is the one a spec uses."""
    from pfl_core import registry
    for name in BASELINES:
        cls = registry.plugin_class(name)
        assert cls.name == name
        assert cls.kind == (registry.ADDON if name == "corrupted_clients" else registry.ALGORITHM)


def test_every_built_in_plugin_carries_its_entry_point_name():
    """Every class the pfl distribution registers reports the name it is registered under
    (an alias reports its target's), so error messages and MLflow tags use the spec's name."""
    from importlib.metadata import distribution

    from pfl_core import registry
    entry_points = [ep for ep in distribution("pfl").entry_points if ep.group == registry.ENTRY_POINT_GROUP]
    assert len(entry_points) > 30
    for ep in entry_points:
        assert registry.plugin_class(ep.name).name == ALIASES.get(ep.name, ep.name), ep.value
