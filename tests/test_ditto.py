"""Ditto (plugins/ditto): the proximal term by hand, the global model = FedAvg's bit for bit,
lambda = 0 = Local bit for bit, the personal update recomputed independently (anchor w^t,
start v_k), what is evaluated, what is sent, the budget, bad input."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    linear,
    model_bytes,
    prepared,
    recorded_training,
    refused_at_key,
    state_of,
    train_reference,
)
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_plugins.ditto import Ditto, DittoParams
from pfl_plugins.fedprox import proximal_term

LINEAR = {"algorithm.name": "ditto", "model.params.hidden": [], "experiment.rounds": 2}


# -- the regulariser, by hand -------------------------------------------------------------------


def term(lam, model, anchor):
    client = SimpleNamespace(scratch={"anchor": anchor})
    return Ditto(DittoParams(lam=lam)).local_objective(ctx=None, client=client, model=model, x=None, y=None,
                                                        logits=None)


def test_proximal_term_value_by_hand():
    model = linear([1.0, 2.0], [0.5])
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]
    # v - w = (1, 3, -1): ||.||^2 = 11; lambda/2 * 11
    assert term(0.5, model, anchor).item() == pytest.approx(2.75, abs=1e-6)
    assert term(2.0, model, anchor).item() == pytest.approx(11.0, abs=1e-6)
    assert proximal_term(model, anchor, 4.0).item() == pytest.approx(22.0, abs=1e-6)


def test_proximal_gradient_is_lambda_times_the_distance_to_the_anchor():
    model = linear([1.0, 2.0], [0.5])
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]
    term(0.5, model, anchor).backward()
    assert torch.allclose(model.weight.grad, torch.tensor([[0.5, 1.5]]))  # lambda (v - w)
    assert torch.allclose(model.bias.grad, torch.tensor([-0.5]))


def test_no_term_outside_the_personal_update():
    client = SimpleNamespace(scratch={"w_t": [torch.zeros(1)]})  # received, but the global model is training
    plugin = Ditto(DittoParams(lam=3.0))
    assert plugin.local_objective(ctx=None, client=client, model=linear([1.0, 1.0], [1.0]), x=None, y=None,
                                  logits=None) is None


# -- the global model is FedAvg's, bit for bit ----------------------------------------------------


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_global_model_is_fedavgs_bit_for_bit(extra):
    ditto = run_rounds(**{**LINEAR, **extra, "model.params.hidden": [8]})
    fedavg = run_rounds(**{**LINEAR, **extra, "model.params.hidden": [8], "algorithm.name": "fedavg"})
    assert_same(ditto.server["global"], fedavg.server["global"])
    assert ditto.comm_up == fedavg.comm_up and ditto.comm_down == fedavg.comm_down


# -- lambda = 0: the personal models are Local's, bit for bit -------------------------------------


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5}, {"training.local_epochs": 2}])
def test_lambda_zero_personal_models_are_locals_bit_for_bit(extra):
    ditto = run_rounds(3, **{**LINEAR, **extra, "model.params.hidden": [8], "algorithm.params.lam": 0.0})
    local = run_rounds(3, **{**LINEAR, **extra, "model.params.hidden": [8], "algorithm.name": "local"})
    trained = [i for i in range(4) if "weights" in local.store[i]]
    assert trained and trained == [i for i in range(4) if "personal" in ditto.store[i]]
    for i in trained:
        assert_same(ditto.store[i]["personal"], local.store[i]["weights"])
    # ... while lambda > 0 pulls them towards the global model: the test can tell them apart
    pulled = run_rounds(3, **{**LINEAR, **extra, "model.params.hidden": [8], "algorithm.params.lam": 1.0})
    assert far_apart(pulled.store[trained[0]]["personal"], local.store[trained[0]]["weights"],
                     local.store[trained[0]]["weights"])


# -- the personal update recomputed independently --------------------------------------------------


def prox_loss(anchor, lam):
    def loss(model, x, y, logits):
        distance = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        return F.cross_entropy(logits, y) + lam / 2 * distance
    return loss


def test_personal_update_minimises_the_ditto_objective_anchored_at_the_received_global_model():
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.lam": 2.0, "algorithm.params.personal_epochs": 2})
    init = ctx.models.initial_state("mlp")
    engine.run_round(ctx, 1)
    v1 = {i: train_reference(ctx, i, init, epochs=2, loss_fn=prox_loss(init, 2.0)) for i in range(4)}
    for i in range(4):
        assert_close(ctx.store[i]["personal"], v1[i])
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 2)  # round 2: from the client's own v, anchored at w^1
    for i in range(4):
        expected = train_reference(ctx, i, v1[i], epochs=2, loss_fn=prox_loss(w1, 2.0))
        assert_close(ctx.store[i]["personal"], expected)
        assert far_apart(expected, train_reference(ctx, i, w1, epochs=2, loss_fn=prox_loss(w1, 2.0)), expected)
        # the anchor is w^t, not the client's locally updated w_k^t
        w_k = train_reference(ctx, i, w1)
        assert far_apart(expected, train_reference(ctx, i, v1[i], epochs=2, loss_fn=prox_loss(w_k, 2.0)), expected)


def test_the_upload_is_the_global_models_local_update_not_the_personal_model():
    engine, ctx = prepared(**LINEAR)
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    seen = []
    original = ctx.hooks.client_upload

    def spy(**kwargs):
        upload = original(**kwargs)
        seen.append((kwargs["client"].id, {k: v.clone() for k, v in upload["weights"].items()}))
        return upload

    ctx.hooks.client_upload = spy
    engine.run_round(ctx, 1)
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    for i, weights in seen:
        assert_close(weights, train_reference(ctx, i, start))  # FedAvg's local update of w^t
        assert far_apart(weights, ctx.store[i]["personal"], weights)


# -- evaluation, bytes, budget ----------------------------------------------------------------------


def test_the_evaluated_model_is_the_personal_one_and_initial_before_any_training():
    engine, ctx = prepared(**LINEAR, **{"experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    (trained,) = ctx.participants
    model = evaluated_models(ctx, ctx.client(trained))[""]
    assert_same(model.state_dict(), ctx.store[trained]["personal"])
    idle = (trained + 1) % 4
    model = evaluated_models(ctx, ctx.client(idle))[""]
    assert_same(model.state_dict(), ctx.models.initial_state("mlp"))


def test_only_the_global_model_travels():
    ctx = run_rounds(2, **LINEAR, **{"experiment.participation": 0.5})
    one_model = model_bytes(ctx.server["global"])
    assert ctx.comm_down == ctx.comm_up == 2 * 2 * one_model  # 2 rounds x 2 participants x w


def test_local_work_is_global_plus_personal_epochs_and_matches_what_trains(monkeypatch):
    spec = resolve(tiny_raw(**LINEAR, **{"training.local_epochs": 2})).spec
    assert Ditto(DittoParams()).local_work(spec).private_epochs_per_round == 4
    assert Ditto(DittoParams(personal_epochs=3)).local_work(spec).private_epochs_per_round == 5
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.personal_epochs": 3})
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    assert [(c["client"], c["epochs"]) for c in calls] == [(i, e) for i in range(4) for e in (None, 3)]
    result = Engine(resolve(tiny_raw(**LINEAR, **{"algorithm.params.personal_epochs": 3})), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(2 * (1 + 3))


def test_default_lambda_is_the_papers_and_not_zero():
    assert DittoParams().lam == 1.0 and DittoParams().personal_epochs is None


def test_a_full_run_with_coldstart_clients():
    result = Engine(resolve(tiny_raw(**LINEAR, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -0.5), ("lam", float("nan")), ("personal_epochs", -1),
                                       ("personal_epochs", "two")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(LINEAR, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**LINEAR, **{"algorithm.params.lam": -1}))
    assert "algorithm.params.lam" in line and ">= 0" in line


def test_a_coldstart_client_trains_its_personal_model_from_the_final_global_model():
    engine, ctx = prepared(**LINEAR, **{"experiment.coldstart_epochs": 2, "algorithm.params.lam": 0.5})
    engine.run_round(ctx, 1)
    final = {k: v.clone() for k, v in ctx.server["global"].items()}
    client = ctx.client(2)
    model = coldstart_models(ctx, client)[""]
    expected = train_reference(ctx, 2, final, epochs=2, loss_fn=prox_loss(final, 0.5))
    assert_close(state_of(model), expected)
    assert far_apart(expected, train_reference(ctx, 2, final, epochs=2), expected)  # the term is on
    assert far_apart(expected, train_reference(ctx, 2, ctx.models.initial_state("mlp"), epochs=2,
                                                loss_fn=prox_loss(final, 0.5)), expected)  # from w, not v^0


def test_zero_personal_epochs_keep_the_personal_model_and_train_only_the_global_one():
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.personal_epochs": 0})
    assert engine.resolved.as_dict["budget"]["private_epochs_per_round"] == 1
    engine.run_round(ctx, 1)
    for i in range(4):
        assert_same(ctx.store[i]["personal"], ctx.models.initial_state("mlp"))


def test_registered_under_its_name_and_receive_answers():
    from pfl_core import registry
    assert registry.plugin_class("ditto") is Ditto and Ditto.name == "ditto"
    _, ctx = prepared(**LINEAR)
    client = ctx.client(0)
    assert Ditto().on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0)) is True
