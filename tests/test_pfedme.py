"""pFedMe (plugins/pfedme): the inner objective and one local round by hand, the server's beta step
by hand, K = 1 with personal_lr = 1/lambda (large lambda) = FedAvg, a round recomputed by an
independent loop, what is evaluated, sent, counted, bad input (beta = 0 freezes the model)."""

from types import SimpleNamespace

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
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_core.runtime.training import batch_order, batch_starts
from pfl_plugins.pfedme import PFedMe, PFedMeParams, moreau_step, server_step

RAW = {"algorithm.name": "pfedme", "model.params.hidden": [8], "experiment.rounds": 2}


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


# -- the inner objective and one local round, by hand -------------------------------------------------


def test_the_inner_objective_is_the_loss_plus_lambda_half_the_squared_distance_to_w():
    plugin = PFedMe(PFedMeParams(lam=4.0))
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(0.5)
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]
    term = plugin.local_objective(ctx=None, client=SimpleNamespace(scratch={"anchor": anchor}), model=model,
                                  x=None, y=None, logits=None)
    assert term.item() == pytest.approx(4.0 / 2 * 11)  # ||(1, 3, -1)||^2 = 11
    term.backward()
    assert torch.allclose(model.weight.grad, torch.tensor([[4.0, 12.0]]))  # lambda (theta - w)
    assert plugin.local_objective(ctx=None, client=SimpleNamespace(scratch={}), model=model, x=None, y=None,
                                  logits=None) is None  # outside the inner steps: no term


def test_the_clients_objective_in_an_inner_step_is_cross_entropy_plus_the_term():
    engine, ctx = prepared(**{**RAW, "model.params.hidden": [], "algorithm.params.lam": 3.0})
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
    model = client.model
    client.scratch["anchor"] = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.fc1.weight.add_(0.1)  # 200 weights 0.1 away
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    logits = model(x)
    expected = F.cross_entropy(logits, y) + 3.0 / 2 * 200 * 0.01
    assert client.objective(model, x, y, logits).item() == pytest.approx(expected.item(), rel=1e-5)


def quadratic(lam, target=2.0):
    """f(theta) = 1/2 (theta - target)^2 on a 1-parameter model (x = 1), plus the proximal term."""
    def loss(model, x, y, logits):
        return 0.5 * (logits.sum() - target) ** 2 + lam / 2 * (model.weight - anchor_of[0]).pow(2).sum()
    anchor_of = []
    return loss, anchor_of


@pytest.mark.parametrize("k,personal_lr,theta,w_next", [
    (1, 0.25, 0.5, 0.05),     # theta = 0 + 0.25 * 2; w = 0 - 0.1 * 1 * (0 - 0.5)
    (2, 0.25, 0.75, 0.075),   # second step: grad (0.5 - 2) + 1 * (0.5 - 0) = -1 -> 0.75
    (2, 0.5, 1.0, 0.1),       # reaches the exact prox (target + lambda w) / (1 + lambda) = 1
])
def test_one_local_round_by_hand(k, personal_lr, theta, w_next):
    model = nn.Linear(1, 1, bias=False)
    w = [torch.zeros(1, 1)]
    loss, anchor_of = quadratic(lam=1.0)
    anchor_of.append(w[0].clone())  # the anchor w_{i,r} (w itself changes only after the inner steps)
    inner = torch.optim.SGD(model.parameters(), lr=personal_lr)
    first = moreau_step(model, w, torch.ones(1, 1), None, k=k, inner=inner, loss_fn=loss, eta_lambda=0.1 * 1.0)
    assert first.item() == pytest.approx(2.0)  # f(w) = 1/2 (0 - 2)^2
    assert model.weight.item() == pytest.approx(theta)
    assert w[0].item() == pytest.approx(w_next)


# -- the server step, by hand --------------------------------------------------------------------------


def aggregate(beta, previous):
    ctx = SimpleNamespace(server={"global": previous})
    uploads = iter([(0, {"weights": {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)}}),
                    (1, {"weights": {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(9)}})])
    assert PFedMe(PFedMeParams(beta=beta)).server_aggregate(ctx=ctx, uploads=uploads, weights={0: 0.25, 1: 0.75})
    return ctx.server["global"]


def test_server_step_with_beta_by_hand():
    previous = {"w": torch.tensor([2.0, 4.0]), "n": torch.tensor(3)}
    # average = 0.25 [1, 2] + 0.75 [5, -2] = [4, -1]
    assert torch.equal(aggregate(1.0, previous)["w"], torch.tensor([4.0, -1.0]))  # beta = 1: FedAvg
    assert torch.allclose(aggregate(0.5, previous)["w"], torch.tensor([3.0, 1.5]))
    assert torch.allclose(aggregate(2.0, previous)["w"], torch.tensor([6.0, -6.0]))  # -1 * w + 2 * average
    assert torch.equal(aggregate(2.0, previous)["n"], torch.tensor(7))  # integer entries: the average's


def test_server_step_keeps_the_model_when_nobody_took_part():
    previous = {"w": torch.tensor([2.0])}
    assert server_step(previous, previous, 0.5) is previous
    ctx = SimpleNamespace(server={"global": previous})
    PFedMe(PFedMeParams(beta=2.0)).server_aggregate(ctx=ctx, uploads=iter(()), weights={})
    assert ctx.server["global"] is previous


# -- equivalence with FedAvg ------------------------------------------------------------------------------


def test_one_inner_step_at_personal_lr_one_over_lambda_is_fedavg():
    lam = 1000.0
    pfedme = run_rounds(**RAW, **{"algorithm.params.lam": lam, "algorithm.params.k": 1,
                                  "algorithm.params.personal_lr": 1 / lam})
    fedavg = run_rounds(**{**RAW, "algorithm.name": "fedavg"})
    assert_close(pfedme.server["global"], fedavg.server["global"], atol=1e-5)
    assert pfedme.comm_up == fedavg.comm_up and pfedme.comm_down == fedavg.comm_down
    half = run_rounds(**RAW, **{"algorithm.params.lam": lam, "algorithm.params.k": 1,
                                "algorithm.params.personal_lr": 0.5 / lam})
    assert far_apart(half.server["global"], fedavg.server["global"], fedavg.server["global"])


# -- a round recomputed by an independent loop ------------------------------------------------------------


def reference_client(ctx, client_id, start, *, lam, k, personal_lr, epochs=1):
    """Alg. 1's client, written out: per mini-batch theta = w, k SGD steps on CE + lambda/2 ||theta - w||^2,
    then w <- w - eta lambda (w - theta). Returns (w, theta)."""
    theta_model = fresh_model(ctx, start)
    w = {n: p.detach().clone() for n, p in theta_model.named_parameters()}
    data, training = ctx.data.clients[client_id], ctx.spec.training
    gen = ctx.client(client_id).generator("train")
    n = len(data.train_y)
    for _ in range(epochs):
        order = batch_order(n, gen, training.shuffle)
        for s in batch_starts(n, training.batch_size, training.drop_last):
            idx = order[s:s + training.batch_size]
            x, y = data.train_x[idx], data.train_y[idx]
            params = dict(theta_model.named_parameters())
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(w[name])
            for _ in range(k):
                h = F.cross_entropy(theta_model(x), y) + lam / 2 * sum(((p - w[q]) ** 2).sum() for q, p in params.items())
                grads = torch.autograd.grad(h, list(params.values()))
                with torch.no_grad():
                    for p, g in zip(params.values(), grads):
                        p.sub_(personal_lr * g)
            with torch.no_grad():
                for name, p in params.items():
                    w[name] = w[name] - training.lr * lam * (w[name] - p)
    return w, state_of(theta_model)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_two_rounds_recomputed(beta):
    params = {"lam": 15.0, "k": 3, "personal_lr": 0.01, "beta": beta}
    engine, ctx = prepared(**RAW, **{f"algorithm.params.{k}": v for k, v in params.items()},
                           **{"training.local_epochs": 2, "training.lr": 0.005})
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    for r in (1, 2):
        start = {k: v.clone() for k, v in ctx.server["global"].items()}
        engine.run_round(ctx, r)
        results = {i: reference_client(ctx, i, start, lam=15.0, k=3, personal_lr=0.01, epochs=2) for i in range(4)}
        total = sum(sizes.values())
        average = {k: sum(sizes[i] / total * results[i][0][k] for i in range(4)) for k in results[0][0]}
        expected = {k: (1 - beta) * start[k] + beta * average[k] for k in average}
        assert_close(ctx.server["global"], expected, atol=1e-5)
        for i in range(4):
            assert_close(ctx.store[i]["personal"], results[i][1], atol=1e-5)
            assert far_apart(results[i][1], results[i][0], results[i][1])  # theta is not w


# -- evaluation, bytes, budget ---------------------------------------------------------------------------


def test_the_evaluated_model_is_theta_and_the_global_model_before_any_training():
    engine, ctx = prepared(**RAW, **{"experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    (trained,) = ctx.participants
    model = evaluated_models(ctx, ctx.client(trained))[""]
    assert_same(state_of(model), ctx.store[trained]["personal"])
    assert far_apart(ctx.store[trained]["personal"], ctx.server["global"], ctx.server["global"])
    idle = (trained + 1) % 4
    model = evaluated_models(ctx, ctx.client(idle))[""]
    assert_same(state_of(model), ctx.server["global"])


def test_a_coldstart_client_is_evaluated_with_its_own_theta_trained_from_the_global_model():
    engine, ctx = prepared(**RAW, **{"experiment.coldstart_clients": 1})
    engine.run_round(ctx, 1)
    client = ctx.client(ctx.coldstart_clients[0])
    assert "personal" not in ctx.store[client.id]  # it never trained
    model = coldstart_models(ctx, client)[""]
    assert_same(state_of(model), ctx.store[client.id]["personal"])  # theta_i, not w
    assert far_apart(ctx.store[client.id]["personal"], ctx.server["global"], ctx.server["global"])


def test_only_w_travels_and_work_is_k_passes_per_epoch():
    ctx = run_rounds(2, **RAW, **{"experiment.participation": 0.5})
    assert ctx.comm_up == ctx.comm_down == 2 * 2 * model_bytes(ctx.server["global"])
    spec = resolve(tiny_raw(**RAW, **{"training.local_epochs": 2})).spec
    assert PFedMe(PFedMeParams(k=3)).local_work(spec).private_epochs_per_round == 6
    result = Engine(resolve(tiny_raw(**RAW, **{"algorithm.params.k": 3})), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(2 * 3)
    assert result.history[-1]["train_loss_mean"] > 0


def test_defaults_are_the_papers_and_a_full_run_with_coldstart_clients():
    p = PFedMeParams()
    assert (p.lam, p.k, p.personal_lr, p.beta) == (15.0, 5, 0.09, 1.0)
    result = Engine(resolve(tiny_raw(**RAW, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -1.0), ("lam", 0.0), ("k", 0), ("personal_lr", 0.0),
                                       ("personal_lr", float("nan")), ("beta", 0.0), ("beta", -0.5),
                                       ("beta", float("inf"))])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(RAW, key, value)


@pytest.mark.parametrize("key,value,fragment", [("beta", 0, "never moves"), ("k", 0, ">= 1"), ("lam", -2, "> 0")])
def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys, key, value, fragment):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**RAW, **{f"algorithm.params.{key}": value}))
    assert f"algorithm.params.{key}" in line and fragment in line
