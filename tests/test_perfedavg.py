"""Per-FedAvg (plugins/perfedavg): the adaptation step and the FO/HF meta steps by hand, HF against the
exact MAML gradient, zero adaptation steps = the meta-model, one step = (2) on the client's first
adaptation batch, a round recomputed by an independent loop, bytes, budget, bad input."""

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
from pfl_plugins.perfedavg import PerFedAvg, PerFedAvgParams, adaptation_step, meta_step

RAW = {"algorithm.name": "perfedavg", "model.params.hidden": [8], "experiment.rounds": 2,
       "algorithm.params.beta": 0.1, "algorithm.params.alpha": 0.05}


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


# -- the steps, by hand ----------------------------------------------------------------------------------


def half_square(model, x, y, logits):
    return 0.5 * (logits.sum() - y) ** 2  # f(theta) = 1/2 (theta - c)^2 on a 1-weight model, x = 1, y = c


def scalar_model(value=0.0):
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


ONE = torch.ones(1, 1)


def test_adaptation_step_by_hand():
    model = scalar_model(0.0)
    loss = adaptation_step(model, 0.5, ONE, torch.tensor(2.0), half_square)
    assert loss.item() == pytest.approx(2.0) and model.weight.item() == pytest.approx(1.0)  # 0 - 0.5 (0 - 2)


@pytest.mark.parametrize("hessian,expected", [(False, 0.3), (True, 0.15)])
def test_meta_step_by_hand(hessian, expected):
    # w = 0; w_tilde = 0 - 0.5 (0 - 2) = 1; g = grad f(w_tilde; D') = 1 - 4 = -3
    # FO: w = 0 - 0.1 (-3) = 0.3; HF: the Hessian is 1, so d = g and w = 0 - 0.1 (1 - 0.5) (-3) = 0.15
    model = scalar_model(0.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    hessian_batch = (ONE, torch.tensor(7.0)) if hessian else None
    loss = meta_step(model, outer, 0.5, (ONE, torch.tensor(2.0)), (ONE, torch.tensor(4.0)), half_square,
                     hessian_batch=hessian_batch, delta=0.5)  # exact for a quadratic
    assert loss.item() == pytest.approx(2.0)
    assert model.weight.item() == pytest.approx(expected, abs=1e-6)


def test_hf_meta_gradient_approximates_the_exact_maml_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    x2, y2 = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    ce = lambda m, x, y, logits: F.cross_entropy(logits, y)  # noqa: E731
    alpha = 0.3
    params = list(model.parameters())
    inner = torch.autograd.grad(ce(None, None, y, model(x)), params, create_graph=True)
    adapted = {n: p - alpha * g for (n, p), g in zip(model.named_parameters(), inner)}
    exact = torch.autograd.grad(ce(None, None, y2, torch.func.functional_call(model, adapted, (x2,))), params)
    w = [p.detach().clone() for p in params]

    def step_direction(hessian_batch):
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        meta_step(model, outer, alpha, (x, y), (x2, y2), ce, hessian_batch=hessian_batch, delta=1e-5)
        direction = [wi - p.detach() for wi, p in zip(w, model.parameters())]
        with torch.no_grad():
            for p, wi in zip(model.parameters(), w):
                p.copy_(wi)
        return direction

    hf, fo = step_direction((x, y)), step_direction(None)  # HF with D'' = D: the exact MAML direction
    for a, b, c in zip(hf, exact, fo):
        assert torch.allclose(a, b, atol=1e-7)
    assert any((b - c).abs().max() > 1e-4 for b, c in zip(exact, fo))  # FO drops the Hessian term


# -- evaluation: the adapted model ------------------------------------------------------------------------


def test_zero_adaptation_steps_evaluate_the_meta_model_bit_for_bit():
    ctx = run_rounds(1, **RAW, **{"algorithm.params.eval_steps": 0})
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""]
        assert_same(state_of(model), ctx.server["global"])


@pytest.mark.parametrize("steps", [1, 2])
def test_the_evaluated_model_is_the_meta_model_after_steps_of_adaptation_on_training_batches(steps):
    ctx = run_rounds(1, **RAW, **{"algorithm.params.eval_steps": steps})
    alpha, training = 0.05, ctx.spec.training
    meta = {k: v.clone() for k, v in ctx.server["global"].items()}
    for i in range(4):
        client = ctx.client(i)
        evaluated = state_of(evaluated_models(ctx, client)[""])
        model = fresh_model(ctx, ctx.server["global"])
        data = ctx.data.clients[i]
        order = batch_order(len(data.train_y), client.generator("adapt"), True)
        for s in range(steps):
            idx = order[s * training.batch_size:(s + 1) * training.batch_size]
            loss = F.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.sub_(alpha * g)
        assert_close(evaluated, state_of(model))
        assert far_apart(evaluated, ctx.server["global"], evaluated)
    assert_same(ctx.server["global"], meta)  # evaluation never touches the meta-model


# -- a round recomputed by an independent loop -------------------------------------------------------------


def reference_client(ctx, client_id, start, *, alpha, beta, epochs=1):
    """Per-FedAvg (FO) written out: consecutive pairs (D, D') of each epoch's shuffled batches."""
    model = fresh_model(ctx, start)
    data, training = ctx.data.clients[client_id], ctx.spec.training
    gen = ctx.client(client_id).generator("train")
    n = len(data.train_y)
    params = list(model.parameters())
    for _ in range(epochs):
        order = batch_order(n, gen, training.shuffle)
        batches = [order[s:s + training.batch_size] for s in batch_starts(n, training.batch_size, training.drop_last)]
        for d, d1 in zip(batches[0::2], batches[1::2]):
            w = [p.detach().clone() for p in params]
            g = torch.autograd.grad(F.cross_entropy(model(data.train_x[d]), data.train_y[d]), params)
            with torch.no_grad():
                for p, gi in zip(params, g):
                    p.sub_(alpha * gi)
            g2 = torch.autograd.grad(F.cross_entropy(model(data.train_x[d1]), data.train_y[d1]), params)
            with torch.no_grad():
                for p, wi, gi in zip(params, w, g2):
                    p.copy_(wi - beta * gi)
    return state_of(model)


def test_a_round_is_algorithm_one_fo():
    engine, ctx = prepared(**RAW, **{"training.local_epochs": 2})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    trained = [reference_client(ctx, i, start, alpha=0.05, beta=0.1, epochs=2) for i in range(4)]
    expected = {k: sum(0.25 * t[k] for t in trained) for k in start}  # equal client sizes
    assert_close(ctx.server["global"], expected)
    no_adaptation = [reference_client(ctx, i, start, alpha=0.0, beta=0.1, epochs=2) for i in range(4)]
    assert far_apart(expected, {k: sum(0.25 * t[k] for t in no_adaptation) for k in start}, expected)


def test_hf_trains_differently_from_fo():
    fo = run_rounds(1, **RAW)
    hf = run_rounds(1, **RAW, **{"algorithm.params.variant": "hf"})
    assert far_apart(fo.server["global"], hf.server["global"], fo.server["global"], atol=1e-6)


# -- bytes, budget -------------------------------------------------------------------------------------------


def test_bytes_are_fedavgs_and_budget_is_one_pass_per_epoch_for_fo():
    ctx = run_rounds(2, **RAW, **{"experiment.participation": 0.5})
    assert ctx.comm_up == ctx.comm_down == 2 * 2 * model_bytes(ctx.server["global"])
    spec = resolve(tiny_raw(**RAW, **{"training.local_epochs": 3})).spec
    assert PerFedAvg(PerFedAvgParams()).local_work(spec).private_epochs_per_round == 3
    assert PerFedAvg(PerFedAvgParams(variant="hf")).local_work(spec).private_epochs_per_round == pytest.approx(4.0)
    result = Engine(resolve(tiny_raw(**RAW)), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(2.0)


def test_hf_counts_the_second_pass_over_the_hessian_batches():
    engine, ctx = prepared(**RAW, **{"algorithm.params.variant": "hf"})
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
    ctx.hooks.local_train(ctx=ctx, client=client)
    n, b = client.num_train, ctx.spec.training.batch_size
    assert client.work.private == n + (n // b // 3) * b  # one pass + D'' once more per step


def test_defaults_and_a_full_run_with_coldstart_clients():
    p = PerFedAvgParams()
    assert (p.alpha, p.beta, p.variant, p.delta, p.eval_steps) == (0.01, 0.001, "fo", 0.001, 1)
    result = Engine(resolve(tiny_raw(**RAW, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha", -0.1), ("alpha", float("nan")), ("beta", 0.0), ("variant", "so"),
                                       ("delta", 0.0), ("eval_steps", -1)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(RAW, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**RAW, **{"algorithm.params.variant": "fp"}))
    assert "algorithm.params.variant" in line and "'fo', 'hf'" in line
