"""APFL (plugins/apfl): the mixture's gradients by hand (v and alpha), alpha fixed at 1 = Local and
at 0 = FedAvg bit for bit, one adaptive round recomputed by an independent loop, the projection
onto [0, 1], the evaluated mixture, bytes, budget, bad input."""

import pytest
import torch
import torch.nn.functional as F
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    fresh_model,
    model_bytes,
    prepared,
    refused_at_key,
    state_of,
)
from tiny import tiny_raw
from torch import nn

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.runtime.training import batch_order, batch_starts
from pfl_plugins.apfl import APFL, APFLParams, alpha_step, mixture, mixture_gradients

APFL_RAW = {"algorithm.name": "apfl", "model.params.hidden": [8], "experiment.rounds": 3}


def run_rounds(rounds=3, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return engine, ctx


# -- the gradients of the mixture, by hand ---------------------------------------------------------


def linear_sum(model, x, y, logits):
    return logits.sum()  # f(theta) = sum over the batch of theta . (x, 1): its gradient is (x, 1)


def test_mixture_gradients_by_hand():
    model = nn.Linear(2, 1)
    own = state_of(model)
    v = {"weight": torch.tensor([[1.0, 2.0]], requires_grad=True), "bias": torch.tensor([0.5], requires_grad=True)}
    w = {"weight": torch.tensor([[0.0, -1.0]]), "bias": torch.tensor([1.5])}
    alpha = torch.tensor(0.25, requires_grad=True)
    x = torch.tensor([[1.0, 3.0]])
    loss, grad_v, grad_alpha = mixture_gradients(model, v, {}, w, alpha, x, None, linear_sum, with_alpha=True)
    # v_bar = 0.25 v + 0.75 w = (0.25, -0.25; 1.25): f = 0.25 - 0.75 + 1.25
    assert loss.item() == pytest.approx(0.75)
    # grad_v f(v_bar) = alpha * (x, 1)
    assert torch.allclose(grad_v[0], torch.tensor([[0.25, 0.75]])) and torch.allclose(grad_v[1], torch.tensor([0.25]))
    # grad_alpha = <v - w, (x, 1)> = 1*1 + 3*3 + (-1)*1
    assert grad_alpha.item() == pytest.approx(9.0)
    # without alpha: no alpha gradient; the module's own weights are untouched (it lends its forward)
    _, _, none = mixture_gradients(model, v, {}, w, alpha, x, None, linear_sum, with_alpha=False)
    assert none is None
    assert_same(state_of(model), own) and model.weight.grad is None


def test_alpha_gradient_matches_a_finite_difference_of_the_cross_entropy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    names = [n for n, _ in model.named_parameters()]
    v = {n: (torch.randn_like(p)).requires_grad_(True) for n, p in model.named_parameters()}
    w = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    ce = lambda model, x, y, logits: F.cross_entropy(logits, y)  # noqa: E731
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    v64 = {n: t.double().detach().requires_grad_(True) for n, t in v.items()}
    w64 = {n: t.double() for n, t in w.items()}
    model64 = model.double()
    _, _, grad_alpha = mixture_gradients(model64, v64, {}, w64, alpha, x.double(), y, ce, with_alpha=True)

    def f(a):
        return ce(None, None, y, torch.func.functional_call(model64, mixture(a, v64, w64), (x.double(),))).item()

    h = 1e-6
    assert grad_alpha.item() == pytest.approx((f(0.3 + h) - f(0.3 - h)) / (2 * h), rel=1e-6)
    assert sorted(v64) == sorted(names)


# -- equivalences ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.local_epochs": 2}])
def test_alpha_fixed_at_one_is_local_bit_for_bit(extra):
    _, apfl = run_rounds(**APFL_RAW, **extra, **{"algorithm.params.alpha": 1.0, "algorithm.params.adaptive": False})
    _, local = run_rounds(**{**APFL_RAW, **extra, "algorithm.name": "local"})
    trained = [i for i in range(4) if "weights" in local.store[i]]
    assert trained == [i for i in range(4) if "v" in apfl.store[i]]
    for i in trained:
        assert_same(apfl.store[i]["v"], local.store[i]["weights"])
        evaluated = evaluated_models(apfl, apfl.client(i))[""]
        assert_same(state_of(evaluated), local.store[i]["weights"])


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_alpha_fixed_at_zero_is_fedavg_bit_for_bit(extra):
    _, apfl = run_rounds(**APFL_RAW, **extra, **{"algorithm.params.alpha": 0.0, "algorithm.params.adaptive": False})
    _, fedavg = run_rounds(**{**APFL_RAW, **extra, "algorithm.name": "fedavg"})
    assert_same(apfl.server["global"], fedavg.server["global"])
    for i in range(4):
        evaluated = evaluated_models(apfl, apfl.client(i))[""]
        assert_same(state_of(evaluated), fedavg.server["global"])
    assert apfl.comm_up == fedavg.comm_up and apfl.comm_down == fedavg.comm_down


def test_adaptive_alpha_does_not_change_the_global_solver():
    _, apfl = run_rounds(**APFL_RAW)
    _, fedavg = run_rounds(**{**APFL_RAW, "algorithm.name": "fedavg"})
    assert_same(apfl.server["global"], fedavg.server["global"])


# -- one adaptive round, recomputed by an independent loop ---------------------------------------------


def reference_round(ctx, client_id, w_state, v_state, alpha, lr, alpha_lr, epochs=1):
    """Alg. 1 for one client, written out: the three gradients at the current iterates on the same
    batch, then the three SGD steps; alpha projected onto [0, 1]."""
    w_model, v_model = fresh_model(ctx, w_state), fresh_model(ctx, v_state)
    data = ctx.data.clients[client_id]
    gen = ctx.client(client_id).generator("train")
    spec = ctx.spec.training
    n = len(data.train_y)
    for _ in range(epochs):
        order = batch_order(n, gen, spec.shuffle)
        for start in batch_starts(n, spec.batch_size, spec.drop_last):
            idx = order[start:start + spec.batch_size]
            x, y = data.train_x[idx], data.train_y[idx]
            w = dict(w_model.named_parameters())
            v = dict(v_model.named_parameters())
            a = torch.tensor(alpha, requires_grad=True)
            mixed = {k: a * v[k] + (1 - a) * w[k].detach() for k in v}
            loss_bar = F.cross_entropy(torch.func.functional_call(v_model, mixed, (x,)), y)
            *gv, ga = torch.autograd.grad(loss_bar, [*v.values(), a])
            gw = torch.autograd.grad(F.cross_entropy(w_model(x), y), list(w.values()))
            with torch.no_grad():
                for p, g in zip(w.values(), gw):
                    p.sub_(lr * g)
                for p, g in zip(v.values(), gv):
                    p.sub_(lr * g)
            alpha = min(1.0, max(0.0, alpha - alpha_lr * ga.item()))
    return state_of(w_model), state_of(v_model), alpha


@pytest.mark.parametrize("alpha_lr", [None, 0.5])
def test_one_adaptive_round_is_algorithm_one(alpha_lr):
    params = {} if alpha_lr is None else {"algorithm.params.alpha_lr": alpha_lr}
    engine, ctx = prepared(**APFL_RAW, **params, **{"algorithm.params.alpha": 0.4, "training.local_epochs": 2})
    w0 = {k: v.clone() for k, v in ctx.server["global"].items()}
    init = ctx.models.initial_state("mlp")
    uploads = {}
    original = ctx.hooks.client_upload

    def spy(**kwargs):
        upload = original(**kwargs)
        uploads[kwargs["client"].id] = {k: v.clone() for k, v in upload["weights"].items()}
        return upload

    ctx.hooks.client_upload = spy
    engine.run_round(ctx, 1)
    lr = ctx.spec.training.lr
    for i in range(4):
        w, v, alpha = reference_round(ctx, i, w0, init, 0.4, lr, lr if alpha_lr is None else alpha_lr, epochs=2)
        assert_close(uploads[i], w)
        assert_close(ctx.store[i]["v"], v, atol=1e-5)
        assert ctx.store[i]["alpha"] == pytest.approx(alpha, abs=1e-5)
        assert ctx.store[i]["alpha"] != pytest.approx(0.4, abs=1e-4)  # alpha did move
        assert far_apart(v, w, v)


@pytest.mark.parametrize("alpha,grad,lr,expected", [(0.5, 0.2, 0.5, 0.4), (0.5, -0.2, 0.5, 0.6),
                                                     (0.9, -1.0, 0.5, 1.0), (0.1, 1.0, 0.5, 0.0), (1.0, -3.0, 1.0, 1.0)])
def test_alpha_step_by_hand(alpha, grad, lr, expected):
    assert alpha_step(alpha, grad, lr) == pytest.approx(expected)


def test_registered_under_its_name():
    from pfl_core import registry
    assert registry.plugin_class("apfl") is APFL and APFL.name == "apfl"


def test_alpha_is_projected_onto_the_unit_interval():
    _, ctx = run_rounds(1, **APFL_RAW, **{"algorithm.params.alpha_lr": 1e6})
    alphas = [ctx.store[i]["alpha"] for i in range(4)]
    assert all(a in (0.0, 1.0) for a in alphas), alphas


# -- what is evaluated, sent, counted -----------------------------------------------------------------


def test_the_evaluated_model_is_the_mixture_of_the_clients_v_and_the_current_global_model():
    _, ctx = run_rounds(2, **APFL_RAW)
    for i in range(4):
        alpha, v, w = ctx.store[i]["alpha"], ctx.store[i]["v"], ctx.server["global"]
        assert 0.0 < alpha < 1.0
        evaluated = state_of(evaluated_models(ctx, ctx.client(i))[""])
        assert_close(evaluated, {k: alpha * v[k] + (1 - alpha) * w[k] for k in v})
        assert far_apart(evaluated, v, v) and far_apart(evaluated, w, w)


def test_a_client_that_never_trained_mixes_the_initial_weights_with_alpha_zero():
    engine, ctx = prepared(**APFL_RAW, **{"experiment.participation": 0.25, "algorithm.params.alpha": 0.25})
    engine.run_round(ctx, 1)
    idle = (ctx.participants[0] + 1) % 4
    assert ctx.store[idle] == {}
    init, w = ctx.models.initial_state("mlp"), ctx.server["global"]
    evaluated = state_of(evaluated_models(ctx, ctx.client(idle))[""])
    assert_close(evaluated, {k: 0.25 * init[k] + 0.75 * w[k] for k in init})


def test_bytes_are_fedavgs_and_work_is_two_passes_per_epoch():
    _, ctx = run_rounds(2, **APFL_RAW, **{"experiment.participation": 0.5})
    assert ctx.comm_up == ctx.comm_down == 2 * 2 * model_bytes(ctx.server["global"])
    spec = resolve(tiny_raw(**APFL_RAW, **{"training.local_epochs": 3})).spec
    assert APFL(APFLParams()).local_work(spec).private_epochs_per_round == 6
    result = Engine(resolve(tiny_raw(**APFL_RAW, **{"training.local_epochs": 2})), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(3 * 2 * 2)
    last = result.history[-1]  # alpha_i per client: aggregated over the clients, never a key per client
    assert 0 <= last["alpha_min"] <= last["alpha_mean"] <= last["alpha_max"] <= 1 and "alpha/0" not in last


def test_defaults_and_a_full_run_with_coldstart_clients():
    assert APFLParams().adaptive and APFLParams().alpha == 0.5 and APFLParams().alpha_lr is None
    result = Engine(resolve(tiny_raw(**APFL_RAW, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha", -0.1), ("alpha", 1.5), ("alpha", float("nan")),
                                       ("alpha_lr", 0.0), ("alpha_lr", float("inf")), ("adaptive", "yes")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(APFL_RAW, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**APFL_RAW, **{"algorithm.params.alpha": 1.5}))
    assert "algorithm.params.alpha" in line and "[0, 1]" in line


def test_with_batchnorm_the_mixture_keeps_v_s_own_running_statistics():
    _, ctx = run_rounds(1, **{**APFL_RAW, "model.params": {"hidden": [8], "norm": "batch"}})
    for i in range(4):
        v, w = ctx.store[i]["v"], ctx.server["global"]
        assert v["bn1.running_mean"].abs().sum() > 0 and int(v["bn1.num_batches_tracked"]) > 0
        assert far_apart(v, w, ["bn1.running_mean"])  # v's statistics, not the global model's
        evaluated = state_of(evaluated_models(ctx, ctx.client(i))[""])
        assert_same(evaluated, v, ["bn1.running_mean", "bn1.running_var"])
