"""FedAlt, FedSim, FedBABU, LG-FedAvg: which part trains in which phase and in which order,
what is frozen, what is sent and averaged (n_i-weighted), what stays on the client, and which
model is evaluated. Expected weights are recomputed from each method's definition with fresh
modules (tests/harness.py); the model is an MLP with layers fc1, fc2, fc3."""

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
from pfl_core.runtime.evaluation import evaluate_clients, evaluated_models, score

DEEP = {"model.params.hidden": [16, 16], "data.params.samples_per_device": 60, "experiment.rounds": 2}
FC1 = ["fc1.weight", "fc1.bias"]
FC2 = ["fc2.weight", "fc2.bias"]
FC3 = ["fc3.weight", "fc3.bias"]
SIZES = {0: 9, 1: 20, 2: 42, 3: 42}  # unequal, so n_i/n differs from uniform (train splits of 42)


def start(name, **more):
    engine, ctx = prepared(**DEEP, **{"algorithm.name": name}, **more)
    shrink(ctx, {0: SIZES[0], 1: SIZES[1]})
    assert [ctx.data.clients[i].num_train for i in range(4)] == list(SIZES.values())
    return engine, ctx


def snapshot(state):
    return {k: v.clone() for k, v in state.items()}


def merged(glob, shared, personal):
    return {**{k: glob[k] for k in shared}, **personal}


def weighted(states, keys):
    total = sum(SIZES[i] for i in states)
    return mean_of(((SIZES[i] / total, s) for i, s in states.items()), keys)


# -- FedAlt: personal head first (body frozen), then the shared body (head frozen) -------------


def fedalt_client(ctx, i, state, personal_epochs=1):
    head = train_reference(ctx, i, state, trainable=FC2 + FC3, epochs=personal_epochs)
    return train_reference(ctx, i, head, trainable=FC1)


def test_fedalt_phases_head_first_with_the_body_frozen_then_the_body_with_the_head_frozen(monkeypatch):
    engine, ctx = start("fedalt", **{"algorithm.params.personal_epochs": 2, "training.local_epochs": 1})
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    assert [c["client"] for c in calls] == [0, 0, 1, 1, 2, 2, 3, 3]
    for personal, shared in zip(calls[::2], calls[1::2]):
        assert personal["trainable"] == set(FC2 + FC3) and personal["epochs"] == 2
        assert_same(personal["after"], personal["before"], FC1)  # body bit-unchanged
        assert far_apart(personal["after"], personal["before"], FC2 + FC3)
        assert shared["trainable"] == set(FC1) and shared["epochs"] == 1
        assert_same(shared["before"], personal["after"])  # the body phase continues from the head phase
        assert_same(shared["after"], shared["before"], FC2 + FC3)  # head bit-unchanged
        assert far_apart(shared["after"], shared["before"], FC1)
    for call in calls:  # frozen flags are restored afterwards
        assert all(p.requires_grad for p in call["model"].parameters())


def test_fedalt_round_is_recomputed_and_the_order_of_its_phases_matters():
    engine, ctx = start("fedalt")
    init = snapshot(ctx.models.initial_state("mlp"))
    engine.run_round(ctx, 1)
    trained = {i: fedalt_client(ctx, i, init) for i in range(4)}
    assert_close(ctx.server["global"], weighted(trained, FC1), FC1)
    assert_same(ctx.server["global"], init, FC2 + FC3)  # the server never holds a trained head
    for i in range(4):
        assert set(ctx.store[i]["personal"]) == set(FC2 + FC3)
        assert_close(ctx.store[i]["personal"], trained[i], FC2 + FC3)
    swapped = {i: train_reference(ctx, i, train_reference(ctx, i, init, trainable=FC1), trainable=FC2 + FC3)
               for i in range(4)}
    assert far_apart(trained[0], swapped[0], FC2 + FC3)
    assert far_apart(weighted(trained, FC1), weighted(swapped, FC1), FC1)
    assert far_apart(weighted(trained, FC1), mean_of(((0.25, t) for t in trained.values()), FC1), FC1)


def test_fedalt_round_two_starts_from_the_global_body_and_the_clients_own_head(monkeypatch):
    engine, ctx = start("fedalt")
    engine.run_round(ctx, 1)
    glob, personal = snapshot(ctx.server["global"]), {i: snapshot(ctx.store[i]["personal"]) for i in range(4)}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    for call in calls[::2]:
        assert_same(call["before"], merged(glob, FC1, personal[call["client"]]))
    expected = {i: fedalt_client(ctx, i, merged(glob, FC1, personal[i])) for i in range(4)}
    assert_close(ctx.server["global"], weighted(expected, FC1), FC1)


def test_fedalt_personal_epochs_zero_trains_only_the_body():
    engine, ctx = start("fedalt", **{"algorithm.params.personal_epochs": 0})
    init = snapshot(ctx.models.initial_state("mlp"))
    engine.run_round(ctx, 1)
    for i in range(4):
        assert_same(ctx.store[i]["personal"], init, FC2 + FC3)
    expected = {i: train_reference(ctx, i, init, trainable=FC1) for i in range(4)}
    assert_close(ctx.server["global"], weighted(expected, FC1), FC1)


def test_fedalt_declares_both_phases_as_its_local_work():
    raw = tiny_raw(**DEEP, **{"algorithm.name": "fedalt", "algorithm.params.personal_epochs": 2,
                              "training.local_epochs": 3})
    resolved = resolve(raw)
    work = resolved.algorithm.local_work(resolved.spec)
    assert work.private_epochs_per_round == 5 and work.public_epochs_per_round == 0
    assert resolved.as_dict["budget"]["private_epochs"] == 2 * 5  # two rounds
    engine, ctx = start("fedalt", **{"algorithm.params.personal_epochs": 2, "training.local_epochs": 3})
    engine.run_round(ctx, 1)
    assert ctx.budget_metrics()["budget.private_epochs"] == 5  # measured equals declared


# -- FedSim: body and head in one joint pass ---------------------------------------------------


def test_fedsim_trains_body_and_head_jointly_and_averages_only_the_body(monkeypatch):
    engine, ctx = start("fedsim")
    init = snapshot(ctx.models.initial_state("mlp"))
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    assert [c["client"] for c in calls] == [0, 1, 2, 3]
    assert all(c["trainable"] == set(FC1 + FC2 + FC3) and c["epochs"] is None for c in calls)
    trained = {i: train_reference(ctx, i, init) for i in range(4)}
    assert_close(ctx.server["global"], weighted(trained, FC1), FC1)
    assert_same(ctx.server["global"], init, FC2 + FC3)
    for i in range(4):
        assert_close(ctx.store[i]["personal"], trained[i], FC2 + FC3)
    alternating = {i: fedalt_client(ctx, i, init) for i in range(4)}
    assert far_apart(weighted(trained, FC1), weighted(alternating, FC1), FC1)


# -- FedBABU: head frozen at its seeded initialisation, body FedAvg, fine-tune at evaluation --


def test_fedbabu_trains_the_body_only_and_the_head_stays_at_its_initialisation(monkeypatch):
    engine, ctx = start("fedbabu")
    init = snapshot(ctx.models.initial_state("mlp"))
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
        glob_1 = snapshot(ctx.server["global"])
        engine.run_round(ctx, 2)
    for call in calls:
        assert call["trainable"] == set(FC1 + FC2)
        assert_same(call["after"], init, FC3)  # the head never moves, also not on the client
    for call in calls[4:]:
        assert_same(call["before"], glob_1)  # round 2 starts from the averaged body + initial head
    trained = {i: train_reference(ctx, i, glob_1, trainable=FC1 + FC2) for i in range(4)}
    assert_close(ctx.server["global"], weighted(trained, FC1 + FC2), FC1 + FC2)
    assert_same(ctx.server["global"], init, FC3)
    assert all(ctx.store[i] == {} for i in range(4))  # nothing personal is kept between rounds


def test_fedbabu_sends_the_body_only():
    engine, ctx = start("fedbabu")
    engine.run_round(ctx, 1)
    body = model_bytes(ctx.server["global"], FC1 + FC2)
    assert ctx.comm_up == ctx.comm_down == 4 * body
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert set(message["weights"]) == set(FC1 + FC2)


def test_fedbabu_evaluates_the_global_model_fine_tuned_as_a_whole():
    engine, ctx = start("fedbabu", **{"algorithm.params.finetune_epochs": 2})
    engine.run_round(ctx, 1)
    glob = snapshot(ctx.server["global"])
    for i in (0, 2):
        with torch.no_grad():  # whatever another client left in the working model
            for p in ctx.models.working("mlp").parameters():
                p.add_(1.0)
        tuned = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        expected = train_reference(ctx, i, glob, epochs=2)  # every layer, from body + initial head
        assert_close(tuned, expected)
        assert far_apart(tuned, glob, FC3) and far_apart(tuned, glob, FC1)
        assert far_apart(expected, train_reference(ctx, i, glob, epochs=2, trainable=FC1 + FC2), FC3)
    assert_same(ctx.server["global"], glob)  # evaluation never changes the global model


def test_fedbabu_without_fine_tuning_evaluates_the_global_model():
    engine, ctx = start("fedbabu", **{"algorithm.params.finetune_epochs": 0})
    engine.run_round(ctx, 1)
    _, rows = evaluate_clients(ctx)
    reference = fresh_model(ctx, ctx.server["global"])
    for row in rows:
        data = ctx.data.clients[row["client"]]
        assert row["acc"] == score(reference, data.test_x, data.test_y).accuracy


def test_fedbabu_defaults_and_a_negative_fine_tuning_names_its_key():
    from pfl_core.errors import SpecError
    from pfl_plugins.fedbabu import FedBABUParams

    assert FedBABUParams().finetune_epochs == 5 and FedBABUParams().head_layers == 1  # the paper's main setting
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**DEEP, **{"algorithm.name": "fedbabu", "algorithm.params.finetune_epochs": -1}))
    assert info.value.path == "algorithm.params.finetune_epochs"


def test_fedbabu_local_work_is_the_federated_epochs():
    engine, ctx = start("fedbabu", **{"algorithm.params.finetune_epochs": 3})
    engine.run_round(ctx, 1)
    evaluate_clients(ctx)  # evaluation-time fine-tuning is personalisation, not a round's work
    assert ctx.budget_metrics()["budget.private_epochs"] == 1
    assert engine.resolved.algorithm.local_work(ctx.spec).private_epochs_per_round == 1


# -- LG-FedAvg: the head is shared and averaged, the base stays local ---------------------


def test_lgfedavg_averages_the_head_and_keeps_the_base_on_the_client(monkeypatch):
    engine, ctx = start("lgfedavg")
    init = snapshot(ctx.models.initial_state("mlp"))
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    assert all(c["trainable"] == set(FC1 + FC2 + FC3) for c in calls)
    trained = {i: train_reference(ctx, i, init) for i in range(4)}
    assert_close(ctx.server["global"], weighted(trained, FC2 + FC3), FC2 + FC3)
    assert_same(ctx.server["global"], init, FC1)
    for i in range(4):
        assert set(ctx.store[i]["personal"]) == set(FC1)
        assert_close(ctx.store[i]["personal"], trained[i], FC1)
    head = model_bytes(init, FC2 + FC3)
    assert ctx.comm_up == ctx.comm_down == 4 * head
    glob, personal = snapshot(ctx.server["global"]), {i: snapshot(ctx.store[i]["personal"]) for i in range(4)}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    for call in calls:  # own base, received head
        assert_same(call["before"], merged(glob, FC2 + FC3, personal[call["client"]]))


@pytest.mark.parametrize("name, shared, personal", [("fedalt", FC1, FC2 + FC3), ("fedsim", FC1, FC2 + FC3),
                                                    ("lgfedavg", FC2 + FC3, FC1)])
def test_the_evaluated_model_is_the_global_shared_part_with_the_clients_own_part(name, shared, personal):
    engine, ctx = start(name)
    engine.run_round(ctx, 1)
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""]
        expected = merged(ctx.server["global"], shared, ctx.store[i]["personal"])
        assert_same(model.state_dict(), expected)
    assert far_apart(ctx.store[0]["personal"], ctx.store[1]["personal"], personal)


@pytest.mark.parametrize("name, shared", [("fedalt", FC1), ("fedsim", FC1), ("lgfedavg", FC2 + FC3),
                                          ("fedbabu", FC1 + FC2)])
def test_uploads_carry_exactly_the_shared_part(name, shared):
    engine, ctx = start(name)
    client = ctx.client(1)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=1))
    ctx.hooks.local_train(ctx=ctx, client=client)
    upload = ctx.hooks.client_upload(ctx=ctx, client=client)
    assert list(upload) == ["weights"] and set(upload["weights"]) == set(shared)
    assert_same(upload["weights"], client.model.state_dict(), shared)


def test_a_key_only_some_clients_sent_is_renormalised_over_its_senders_by_hand():
    from pfl_core.methods.partial import partial_average

    t = lambda v: torch.tensor([v])
    pairs = [(0.2, {"x": t(1.0)}), (0.3, {"x": t(2.0), "y": t(10.0)}), (0.5, {"x": t(4.0), "y": t(20.0)})]
    average, senders = partial_average(pairs)
    assert senders == {"x": 3, "y": 2}
    assert average["x"].item() == pytest.approx(0.2 * 1 + 0.3 * 2 + 0.5 * 4)  # every client: weights as given
    assert average["y"].item() == pytest.approx((0.3 * 10 + 0.5 * 20) / 0.8)  # its two senders, renormalised
    assert partial_average([]) == ({}, {})


def test_layer_probe_tries_the_next_input_shape_when_one_is_refused(monkeypatch):
    """A model that takes only colour images is still probed (its layers counted) before the
    data is loaded: a refused guess moves on to the next shape, it does not end the probe."""
    from pfl_core.methods.partial import probe_num_layers
    from pfl_core.runtime.context import ModelBank

    real_plugin = ModelBank.plugin

    class ColourOnly:  # the spec's model plugin, refusing grey images
        def __init__(self, plugin):
            self.plugin = plugin

        def __getattr__(self, name):
            return getattr(self.plugin, name)

        def build(self, input_shape, num_classes):
            if input_shape[0] != 3:
                raise ValueError("colour images only")
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 8), torch.nn.Linear(8, 2))

    monkeypatch.setattr(ModelBank, "plugin", lambda self, *args: ColourOnly(real_plugin(self, *args)))
    assert probe_num_layers(resolve(tiny_raw()).spec, "lenet5") == 2
