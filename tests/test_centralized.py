"""Centralized (plugins/centralized): one model trained on the pooled training splits of the
training clients only, evaluated on every training client's test split, no communication."""

import torch
from harness import assert_close, cross_entropy, far_apart, fresh_model, prepared, shrink

from pfl_core.runtime.evaluation import evaluate_clients, score
from pfl_core.runtime.training import make_optimizer, run_epochs
from pfl_core.seeding import torch_generator

CENTRAL = {"algorithm.name": "centralized", "model.params.hidden": [], "experiment.rounds": 2,
           "data.params.num_devices": 5, "partition.num_clients": 5, "experiment.coldstart_clients": 1}


def pooled_reference(ctx, state, x, y, round):
    model = fresh_model(ctx, state)
    t = ctx.spec.training
    run_epochs(model, make_optimizer(model.parameters(), t), x, y, epochs=t.local_epochs, batch_size=t.batch_size,
               loss_fn=cross_entropy, generator=torch_generator(ctx.spec.experiment.seed, "train", round),
               shuffle=t.shuffle, drop_last=t.drop_last)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_pools_the_training_splits_of_the_training_clients_only():
    _, ctx = prepared(**CENTRAL)
    (held_out,) = ctx.coldstart_clients
    assert len(ctx.training_clients) == 4 and held_out not in ctx.training_clients
    clients = [ctx.data.clients[i] for i in ctx.training_clients]
    assert torch.equal(ctx.server["pooled_x"], torch.cat([c.train_x for c in clients]))
    assert torch.equal(ctx.server["pooled_y"], torch.cat([c.train_y for c in clients]))
    assert len(ctx.server["pooled_y"]) == sum(c.num_train for c in clients)  # no val/test samples


def test_each_round_trains_the_global_model_on_the_pooled_data():
    engine, ctx = prepared(**{**CENTRAL, "training.local_epochs": 2})
    shrink(ctx, {ctx.training_clients[0]: 13})
    # the data were pooled at setup: pool again after shrinking, as setup would have
    ctx.server["pooled_x"], ctx.server["pooled_y"] = ctx.data.pooled_train(ctx.training_clients)
    x, y = ctx.server["pooled_x"], ctx.server["pooled_y"]
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    after_1 = pooled_reference(ctx, start, x, y, 1)
    assert_close(ctx.server["global"], after_1)
    engine.run_round(ctx, 2)
    after_2 = pooled_reference(ctx, after_1, x, y, 2)
    assert_close(ctx.server["global"], after_2)
    assert far_apart(after_2, pooled_reference(ctx, start, x, y, 2), after_2)  # round 2 continues round 1
    everyone = ctx.data.pooled_train()  # with the held-out client's data: another model
    assert far_apart(after_1, pooled_reference(ctx, start, *everyone, 1), after_1)


def test_no_client_takes_part_and_nothing_is_communicated():
    engine, ctx = prepared(**CENTRAL)
    engine.run_round(ctx, 1)
    assert ctx.participants == []
    assert ctx.comm_up == 0 and ctx.comm_down == 0
    assert all(ctx.store[i] == {} for i in range(5))


def test_the_global_model_is_scored_on_every_training_clients_test_split():
    engine, ctx = prepared(**CENTRAL)
    engine.run_round(ctx, 1)
    _, rows = evaluate_clients(ctx)
    assert [row["client"] for row in rows] == ctx.training_clients
    reference = fresh_model(ctx, ctx.server["global"])
    for row in rows:
        data = ctx.data.clients[row["client"]]
        assert row["acc"] == score(reference, data.test_x, data.test_y).accuracy


def test_measured_budget_is_local_epochs_per_training_client_per_round():
    engine, ctx = prepared(**{**CENTRAL, "training.local_epochs": 2})
    engine.run_round(ctx, 1)
    assert ctx.budget_metrics()["budget.private_epochs"] == 2.0
    assert engine.resolved.as_dict["budget"]["private_epochs"] == 2 * 2
