"""FedDBE (plugins/feddbe): the mean regulariser and the running mean by hand, the bias on the
representation, the initialization period and the fixed global mean, a DBE round recomputed
independently, the bias kept on the client (never sent, bytes), FedAvg as the ablation, what is
evaluated, bad input."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, assert_same, dry_run_error, far_apart, model_bytes, prepared, refused_at_key
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.feddbe import (
    FedDBE,
    FedDBEParams,
    RepresentationBias,
    WithBias,
    linear_classifier,
    mean_regulariser,
    running_mean,
)

BASE = {"algorithm.name": "feddbe", "model.params.hidden": [8], "experiment.rounds": 2}
K = 8  # the representation: the mlp [8]'s classifier input


# -- (D2), (D3), (D4) by hand ---------------------------------------------------------------------


def test_mean_regulariser_by_hand():
    # (1/K) sum 1/2 (r - g)^2 with r - g = (1, 2): (0.5 + 2) / 2
    assert mean_regulariser(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(1.25)
    assert mean_regulariser(torch.tensor([2.0]), torch.tensor([2.0])).item() == 0.0


def test_running_mean_by_hand_carries_only_the_current_batch_gradient():
    first = torch.tensor([2.0, 4.0], requires_grad=True)
    assert running_mean(None, first, 0.25) is first  # the first batch's mean
    current = torch.tensor([6.0, 0.0], requires_grad=True)
    r = running_mean(first, current, 0.25)  # 0.75 * (2, 4) + 0.25 * (6, 0)
    assert torch.allclose(r, torch.tensor([3.0, 3.0]))
    r.sum().backward()
    assert first.grad is None and torch.allclose(current.grad, torch.tensor([0.25, 0.25]))
    assert torch.equal(running_mean(first, current, 1.0), current.detach())  # m = 1: the batch mean


def objective(plugin, scratch, model):
    return plugin.local_objective(ctx=None, client=SimpleNamespace(scratch=scratch, model=model), model=model,
                                  x=None, y=None, logits=None)


def test_local_objective_is_kappa_times_the_regulariser_of_the_running_mean():
    model = nn.Linear(2, 2)
    plugin = FedDBE(FedDBEParams(kappa=4.0, momentum=0.5))
    scratch = {"global_mean": torch.tensor([0.0, 1.0]), "running": None,
               "emb": torch.tensor([[1.0, 1.0], [3.0, 3.0]])}  # batch mean (2, 2)
    # r = (2, 2): 4 * (1/2)(1/2 (4 + 1)) = 5
    assert objective(plugin, scratch, model).item() == pytest.approx(5.0)
    assert torch.allclose(scratch["running"], torch.tensor([2.0, 2.0]))
    scratch["emb"] = torch.tensor([[0.0, 2.0]])  # r = 0.5 (2, 2) + 0.5 (0, 2) = (1, 2): 4 * (1/2)(1/2 (1 + 1)) = 2
    assert objective(plugin, scratch, model).item() == pytest.approx(2.0)
    assert torch.allclose(scratch["running"], torch.tensor([1.0, 2.0]))
    # no term in the initialization period, at kappa = 0, or for another model than the client's
    assert objective(plugin, {**scratch, "global_mean": None}, model) is None
    assert objective(FedDBE(FedDBEParams(kappa=0.0)), dict(scratch), model) is None
    other = plugin.local_objective(ctx=None, client=SimpleNamespace(scratch=dict(scratch), model=model),
                                   model=nn.Linear(2, 2), x=None, y=None, logits=None)
    assert other is None


def test_the_bias_is_added_to_the_classifier_input_and_the_input_is_recorded():
    net = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 1))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0], [2.0]]))
        net[0].bias.zero_()
        net[1].weight.copy_(torch.tensor([[1.0, 10.0]]))
        net[1].bias.zero_()
    x, bias = torch.tensor([[1.0]]), torch.tensor([3.0, -1.0])
    store = {}
    with RepresentationBias(net, bias, store):
        out = net(x)
        assert torch.equal(store["emb"], torch.tensor([[1.0, 2.0]]))  # z^g: before the bias
    assert out.item() == pytest.approx((1 + 3) + 10 * (2 - 1))  # h(z^g + z^p)
    assert "emb" not in store and net(x).item() == pytest.approx(21.0)  # the hook is gone
    assert WithBias(net, bias)(x).item() == pytest.approx(14.0)
    with RepresentationBias(net, None, store):  # no bias: only recorded
        assert net(x).item() == pytest.approx(21.0)


# -- the initialization period, the global mean, the bias kept local --------------------------------


def features(x, state):
    return F.relu(F.linear(x, state["fc1.weight"], state["fc1.bias"]))


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v.clone())
                                    for k, v in message.items()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def test_the_first_round_is_the_initialization_period_and_fixes_the_global_mean():
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 3})
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    assert ctx.server["global_mean"] is not None and all(set(m) == {"weights", "mean"} for m in uploads.values())
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    expected = sum(n[i] * features(ctx.data.clients[i].train_x, uploads[i]["weights"]).mean(0) for i in range(4))
    assert torch.allclose(ctx.server["global_mean"], expected / sum(n.values()), atol=1e-6)  # (D1)
    for i in range(4):  # each mean is over the client's whole training split, with its trained weights
        assert torch.allclose(uploads[i]["mean"], features(ctx.data.clients[i].train_x, uploads[i]["weights"]).mean(0),
                              atol=1e-6)
        assert "bias" not in ctx.store[i]  # (D0): no PRBM yet
    fixed = ctx.server["global_mean"].clone()
    for r in (2, 3):
        uploads.clear()
        engine.run_round(ctx, r)
        assert all(set(m) == {"weights"} for m in uploads.values())  # the mean is sent once, the bias never
        assert torch.equal(ctx.server["global_mean"], fixed)
    for i in range(4):
        assert ctx.store[i]["bias"].shape == (K,) and ctx.store[i]["bias"].abs().max() > 0


def test_with_partial_participation_the_mean_is_the_first_participants():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    assert len(uploads) == 2
    n = {i: ctx.data.clients[i].num_train for i in uploads}
    expected = sum(n[i] * uploads[i]["mean"] for i in uploads) / sum(n.values())
    assert torch.allclose(ctx.server["global_mean"], expected, atol=1e-7)


def test_the_initialization_period_lasts_until_a_mean_arrives():
    lost = {"addons": [{"name": "dropout", "params": {"p": 1.0}}]}
    engine, ctx = prepared(**BASE, **lost)
    engine.run_round(ctx, 1)
    assert ctx.server["global_mean"] is None  # every upload was lost
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert "global_mean" not in message


def test_bytes_the_bias_is_never_sent():
    _, engine = run_tiny(**{**BASE, "experiment.rounds": 3})
    ctx = engine.ctx
    model = model_bytes(ctx.server["global"])
    # up: the model every round, the K floats of the mean in round 1 only; the bias never
    assert ctx.comm_up == 3 * 4 * model + 4 * 4 * K
    # down: the model every round, the global mean from round 2 on
    assert ctx.comm_down == 3 * 4 * model + 2 * 4 * 4 * K
    assert "bias" not in ctx.server and all("bias" in ctx.store[i] for i in range(4))


# -- a DBE round recomputed independently ------------------------------------------------------------


def dbe_training(ctx, i, w1, g, kappa, m, lr):
    """Client i's DBE round from w^1 and a zero bias, written out: ((D2)-(D4), SGD with momentum 0.5)."""
    params = {k: v.clone().requires_grad_(True) for k, v in w1.items()}
    bias = torch.zeros(K, requires_grad=True)
    running = {"r": None}

    def loss_fn(_model, x, y, _logits):
        z = features(x, params)
        logits = F.linear(z + bias, params["fc2.weight"], params["fc2.bias"])  # (D4)
        batch_mean = z.mean(0)
        r = batch_mean if running["r"] is None else (1 - m) * running["r"].detach() + m * batch_mean  # (D2)
        running["r"] = r
        return F.cross_entropy(logits, y) + kappa * (0.5 * (r - g) ** 2).mean()  # (D3)

    optimizer = torch.optim.SGD([*params.values(), bias], lr=lr, momentum=0.5)
    ctx.client(i).train(model=nn.Identity(), optimizer=optimizer, loss_fn=loss_fn)  # loss_fn makes the logits
    return params, bias.detach()


def test_a_dbe_round_recomputed_independently():
    kappa, m, lr = 3.0, 0.5, 0.05
    engine, ctx = prepared(**BASE, **{"algorithm.params": {"kappa": kappa, "momentum": m}, "training.lr": lr,
                                      "training.momentum": 0.5})
    engine.run_round(ctx, 1)
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    g = ctx.server["global_mean"].clone()
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 2)
    for i in range(4):
        params, bias = dbe_training(ctx, i, w1, g, kappa, m, lr)
        assert_close(uploads[i]["weights"], params, atol=1e-6)
        assert torch.allclose(ctx.store[i]["bias"], bias, atol=1e-6)
        assert far_apart(params, w1, list(w1)) and bias.abs().max() > 1e-4


# -- the ablation: no PRBM, no MR is FedAvg bit for bit ------------------------------------------------


def rounds(n, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, n + 1):
        engine.run_round(ctx, r)
    return ctx


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_without_prbm_and_mr_it_is_fedavg_bit_for_bit(extra):
    plain = {"algorithm.params": {"kappa": 0.0, "prbm": False}}
    dbe = rounds(3, **BASE, **extra, **plain)
    avg = rounds(3, **{**BASE, "algorithm.name": "fedavg"}, **extra)
    assert_same(dbe.server["global"], avg.server["global"])
    full = rounds(3, **BASE, **extra)  # ... and DBE changes the model: the test can tell them apart
    assert far_apart(full.server["global"], avg.server["global"], ["fc1.weight"])
    mr_only = rounds(3, **BASE, **extra, **{"algorithm.params.prbm": False})
    assert far_apart(mr_only.server["global"], avg.server["global"], ["fc1.weight"])
    assert all("bias" not in mr_only.store[i] for i in range(4))


# -- evaluation and cold start ------------------------------------------------------------------------


def test_evaluated_model_is_the_global_model_with_the_own_bias():
    ctx = rounds(2, **BASE)
    x = ctx.data.clients[1].test_x
    w = ctx.server["global"]
    models = evaluated_models(ctx, ctx.client(1))
    assert set(models) == {"", "global_"}
    bias = ctx.store[1]["bias"]
    with torch.no_grad():
        expected = F.linear(features(x, w) + bias, w["fc2.weight"], w["fc2.bias"])
        assert torch.allclose(models[""](x), expected, atol=1e-6)
        assert torch.allclose(models["global_"](x), F.linear(features(x, w), w["fc2.weight"], w["fc2.bias"]),
                              atol=1e-6)


def test_a_full_run_with_coldstart_clients():
    result, engine = run_tiny(**BASE, **{"experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and 0.0 <= result.final["global_acc_mean"] <= 1.0
    (newcomer,) = engine.ctx.coldstart_clients
    assert engine.ctx.store[newcomer]["bias"].abs().max() > 0  # it trained with DBE


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("kappa", -1.0), ("kappa", float("nan")), ("momentum", 0.0),
                                       ("momentum", 1.5), ("momentum", "0.5"), ("prbm", "yes")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.kappa": -0.5}))
    assert "algorithm.params.kappa" in line and ">= 0" in line


def test_a_classifier_that_is_not_linear_is_refused_at_the_model_key():
    spec = resolve(tiny_raw(**BASE)).spec
    with pytest.raises(SpecError) as info:
        linear_classifier(spec, "convnet", nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 2, 1)), "feddbe")
    assert info.value.path == "model.name" and "feddbe needs a model whose last layer is a Linear" in str(info.value)


@pytest.mark.parametrize("method", ["feddbe", "fedgen", "fedcp", "gpfl"])
def test_a_classifier_that_is_not_linear_is_refused_before_any_data_is_loaded(monkeypatch, method):
    """check_spec probes the model (here a stand-in whose last layer is a convolution)."""
    monkeypatch.setattr("pfl_plugins.feddbe.probe_model",
                        lambda spec, arch: nn.Sequential(nn.Linear(2, 2), nn.Conv1d(2, 2, 1)))
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "algorithm.name": method}))
    assert str(info.value) == f"model.name: {method} needs a model whose last layer is a Linear classifier; mlp's is a Conv1d"


def test_defaults_are_the_documented_ones():
    p = FedDBEParams()
    assert (p.kappa, p.momentum, p.prbm) == (50.0, 1.0, True)
