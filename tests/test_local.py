"""Local (plugins/local): no communication, each client's own weights carried across rounds,
the personal model evaluated. Expected weights are recomputed independently (tests/harness.py)."""

import torch
from harness import assert_close, assert_same, far_apart, fresh_model, prepared, recorded_training, train_reference

from pfl_core.runtime.evaluation import evaluate_clients, evaluated_models, score

LOCAL = {"algorithm.name": "local", "model.params.hidden": [], "experiment.rounds": 2}


def test_never_communicates():
    engine, ctx = prepared(**LOCAL)
    for r in (1, 2):
        engine.run_round(ctx, r)
    assert ctx.comm_up == 0 and ctx.comm_down == 0
    assert ctx.server == {}


def test_round_two_continues_from_the_clients_own_round_one_weights():
    engine, ctx = prepared(**LOCAL)
    init = ctx.models.initial_state("mlp")
    engine.run_round(ctx, 1)
    after_1 = {i: train_reference(ctx, i, init) for i in range(4)}
    for i in range(4):
        assert_close(ctx.store[i]["weights"], after_1[i])
    engine.run_round(ctx, 2)
    for i in range(4):
        expected = train_reference(ctx, i, after_1[i])
        assert_close(ctx.store[i]["weights"], expected)
        assert far_apart(expected, train_reference(ctx, i, init), expected)  # not restarted from init
        other = after_1[(i + 1) % 4]
        assert far_apart(expected, train_reference(ctx, i, other), expected)  # not a neighbour's weights


def test_each_round_starts_from_the_clients_stored_weights(monkeypatch):
    engine, ctx = prepared(**LOCAL)
    init = ctx.models.initial_state("mlp")
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
        stored = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
        engine.run_round(ctx, 2)
    for call in calls[:4]:
        assert_same(call["before"], init)
    for call in calls[4:]:
        assert_same(call["before"], stored[call["client"]])
        assert_same(call["after"], ctx.store[call["client"]]["weights"])


def test_stored_weights_are_copies_not_the_shared_working_model():
    engine, ctx = prepared(**LOCAL)
    engine.run_round(ctx, 1)
    working = ctx.models.working("mlp").state_dict()
    for i in range(3):  # the working model holds client 3's weights; the others kept their own
        assert far_apart(ctx.store[i]["weights"], working, working)
        assert all(v.data_ptr() != working[k].data_ptr() for k, v in ctx.store[i]["weights"].items())


def test_the_evaluated_model_is_the_clients_own():
    engine, ctx = prepared(**LOCAL)
    engine.run_round(ctx, 1)
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""]
        assert_same(model.state_dict(), ctx.store[i]["weights"])
    _, rows = evaluate_clients(ctx)
    for row in rows:
        data = ctx.data.clients[row["client"]]
        personal = fresh_model(ctx, ctx.store[row["client"]]["weights"])
        assert row["acc"] == score(personal, data.test_x, data.test_y).accuracy


def test_a_client_that_never_trained_is_evaluated_with_the_initial_weights():
    engine, ctx = prepared(**LOCAL, **{"experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    (trained,) = ctx.participants
    idle = (trained + 1) % 4
    assert ctx.store[idle] == {}
    model = evaluated_models(ctx, ctx.client(idle))[""]
    assert_same(model.state_dict(), ctx.models.initial_state("mlp"))


def test_local_never_shares_a_model_between_clients():
    engine, ctx = prepared(**LOCAL)
    engine.run_round(ctx, 1)
    weights = [ctx.store[i]["weights"] for i in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert far_apart(weights[i], weights[j], weights[i])
    assert all(torch.isfinite(w).all() for s in weights for w in s.values())
