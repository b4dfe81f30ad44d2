"""FedAvg (plugins/fedavg): the n_i-weighted mean, the start of each client's round, the model
evaluated, the bytes, partial participation. Expected values are hand-computed or recomputed
independently (tests/harness.py), never copied from a run."""

from types import SimpleNamespace

import pytest
import torch
from harness import (
    assert_close,
    assert_same,
    far_apart,
    fresh_model,
    mean_of,
    model_bytes,
    prepared,
    recorded_training,
    shrink,
    train_reference,
)
from tiny import tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models, score
from pfl_plugins.fedavg import FedAvg

LINEAR = {"model.params.hidden": [], "experiment.rounds": 2}  # one Linear(20, 10) layer


def set_weights(ctx):
    """Round-number weights for the 1-layer model: w[c, j] = (c - j) / 50, b[c] = c / 10."""
    glob = ctx.server["global"]
    w = glob["fc1.weight"]
    c, j = torch.meshgrid(torch.arange(w.shape[0]), torch.arange(w.shape[1]), indexing="ij")
    glob["fc1.weight"] = ((c - j) / 50.0).float()
    glob["fc1.bias"] = (torch.arange(w.shape[0]) / 10.0).float()
    return {k: v.clone() for k, v in glob.items()}


# -- the server step, by hand ------------------------------------------------------------


def test_server_aggregate_is_the_given_weighted_mean_by_hand():
    ctx = SimpleNamespace(server={"global": {"w": torch.zeros(2)}})
    uploads = iter([(3, {"weights": {"w": torch.tensor([1.0, 2.0])}}),
                    (5, {"weights": {"w": torch.tensor([5.0, -2.0])}})])
    assert FedAvg().server_aggregate(ctx=ctx, uploads=uploads, weights={3: 0.25, 5: 0.75})
    # 0.25 * [1, 2] + 0.75 * [5, -2] = [4, -1]; uniform would give [3, 0], client 5's alone [5, -2]
    assert torch.equal(ctx.server["global"]["w"], torch.tensor([4.0, -1.0]))


def test_server_aggregate_weights_follow_the_client_ids():
    ctx = SimpleNamespace(server={"global": {"w": torch.zeros(1)}})
    uploads = iter([(0, {"weights": {"w": torch.tensor([8.0])}}), (1, {"weights": {"w": torch.tensor([0.0])}})])
    FedAvg().server_aggregate(ctx=ctx, uploads=uploads, weights={0: 0.75, 1: 0.25})
    assert torch.equal(ctx.server["global"]["w"], torch.tensor([6.0]))


def test_without_uploads_the_global_model_is_kept():
    old = {"w": torch.tensor([1.5])}
    ctx = SimpleNamespace(server={"global": old})
    assert FedAvg().server_aggregate(ctx=ctx, uploads=iter(()), weights={})
    assert ctx.server["global"] is old


def test_client_weights_are_the_participants_shares_of_training_samples():
    _, ctx = prepared(**LINEAR)
    shrink(ctx, {0: 21, 1: 63, 2: 42})  # client 3 keeps its 84
    weights = ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1, 2, 3])
    assert weights == pytest.approx({0: 0.1, 1: 0.3, 2: 0.2, 3: 0.4}, abs=1e-12)
    assert ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1]) == pytest.approx({0: 0.25, 1: 0.75})


# -- one round through the engine ------------------------------------------------------


def test_one_round_gives_the_sample_weighted_mean_of_clients_trained_from_the_global_model():
    engine, ctx = prepared(**LINEAR)
    shrink(ctx, {0: 12, 1: 30})  # n = 12, 30, 84, 84
    start = set_weights(ctx)
    engine.run_round(ctx, 1)
    trained = {i: train_reference(ctx, i, start) for i in range(4)}
    sizes = {0: 12, 1: 30, 2: 84, 3: 84}
    expected = mean_of((sizes[i] / 210, trained[i]) for i in range(4))
    assert_close(ctx.server["global"], expected)
    uniform = mean_of((0.25, trained[i]) for i in range(4))
    assert far_apart(expected, uniform, expected)  # the test tells the two apart


def test_every_participant_starts_its_round_from_the_global_model(monkeypatch):
    engine, ctx = prepared(**LINEAR)
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
        after_round_1 = {k: v.clone() for k, v in ctx.server["global"].items()}
        engine.run_round(ctx, 2)
    assert [c["client"] for c in calls] == [0, 1, 2, 3, 0, 1, 2, 3]
    init = ctx.models.initial_state("mlp")
    for call in calls[:4]:
        assert_same(call["before"], init)
    for call in calls[4:]:
        assert_same(call["before"], after_round_1)
    assert far_apart(after_round_1, init, init)
    for call in calls:  # the whole model trains
        assert call["trainable"] == {"fc1.weight", "fc1.bias"}


def test_the_upload_is_the_trained_model():
    engine, ctx = prepared(**LINEAR)
    plugin = engine.resolved.algorithm
    client = ctx.client(2)
    plugin.on_receive(ctx=ctx, client=client, message=plugin.on_broadcast(ctx=ctx, client_id=2))
    ctx.hooks.local_train(ctx=ctx, client=client)
    upload = plugin.client_upload(ctx=ctx, client=client)["weights"]
    assert_same(upload, client.model.state_dict())
    assert far_apart(upload, ctx.server["global"], upload)


def test_broadcast_is_the_whole_global_model():
    _, ctx = prepared(**LINEAR)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=1)
    assert list(message) == ["weights"]
    assert_same(message["weights"], ctx.server["global"])
    assert set(message["weights"]) == set(ctx.models.working("mlp").state_dict())


def test_the_evaluated_model_is_the_global_model():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)  # the working model now holds the last client's trained weights
    glob = ctx.server["global"]
    assert far_apart(ctx.models.working("mlp").state_dict(), glob, glob)
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""]
        assert_same(model.state_dict(), glob)


def test_every_clients_accuracy_is_the_global_models_on_its_test_split():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)
    from pfl_core.runtime.evaluation import evaluate_clients

    _, rows = evaluate_clients(ctx)
    reference = fresh_model(ctx, ctx.server["global"])
    for row in rows:
        data = ctx.data.clients[row["client"]]
        assert row["acc"] == score(reference, data.test_x, data.test_y).accuracy
    assert [row["client"] for row in rows] == [0, 1, 2, 3]


# -- partial participation and bytes ---------------------------------------------------


def test_partial_participation_averages_only_the_participants_with_their_own_shares(monkeypatch):
    engine, ctx = prepared(**LINEAR, **{"experiment.participation": 0.5})
    shrink(ctx, {0: 12, 1: 30, 2: 50})  # client 3 keeps 84
    sizes = {0: 12, 1: 30, 2: 50, 3: 84}
    start = set_weights(ctx)
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    chosen = ctx.participants
    assert len(chosen) == 2 and [c["client"] for c in calls] == chosen  # nobody else trains
    total = sum(sizes[i] for i in chosen)
    trained = {i: train_reference(ctx, i, start) for i in chosen}
    expected = mean_of((sizes[i] / total, trained[i]) for i in chosen)
    assert_close(ctx.server["global"], expected)
    assert far_apart(expected, mean_of((0.5, trained[i]) for i in chosen), expected)
    every = mean_of((sizes[i] / 176, train_reference(ctx, i, start)) for i in range(4))
    assert far_apart(expected, every, expected)


def test_bytes_are_the_model_bytes_times_the_participants_each_way():
    engine, ctx = prepared(**LINEAR, **{"experiment.participation": 0.75})
    per_client = model_bytes(ctx.server["global"])
    assert per_client == (20 * 10 + 10) * 4
    engine.run_round(ctx, 1)
    assert ctx.comm_up == ctx.comm_down == 3 * per_client
    engine.run_round(ctx, 2)
    assert ctx.comm_up == ctx.comm_down == 6 * per_client


def test_fedavg_needs_one_architecture_for_every_client():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"
    assert info.value.message == ("fedavg averages weights, so every client needs the same architecture; "
                                  "got lenet5, mlp")
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"model.clients": ["mlp", "mlp", "cnn2", "mlp"]}))
    assert info.value.path == "model.clients" and info.value.message.endswith("got cnn2, mlp")
    resolve(tiny_raw(**{"model.pool": ["mlp", "mlp"]}))  # one architecture, listed twice: fine
