"""APPLE (plugins/apple): the personalized model as the p-weighted sum of core models, the
gradients of p and of the own core model and the direction of p's step by hand, the loss
scheduler and the prior, a round recomputed, what is evaluated, which core models travel and
their bytes, the limited-bandwidth choice, bad input."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import assert_same, dry_run_error, linear, model_bytes, prepared, refused_at_key
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.runtime.training import batch_order, batch_starts
from pfl_plugins.apple import (
    APPLEParams,
    Mixture,
    choose_downloads,
    download_probabilities,
    personalized,
    prior,
    scheduler,
)

BASE = {"algorithm.name": "apple", "model.params.hidden": [8], "experiment.rounds": 3}


# -- Eq. 4-7 by hand -------------------------------------------------------------------------------


def test_the_personalized_model_is_the_p_weighted_sum_of_core_models():
    cores = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 4.0])}]
    out = personalized([0.5, 0.25, 0.25], cores, ["w"])
    assert torch.allclose(out["w"], torch.tensor([0.5 + 1.0, 0.5 + 1.0]))
    assert torch.equal(personalized([0.0, 1.0, 0.0], cores, ["w"])["w"], cores[1]["w"])


def test_the_gradients_of_p_and_of_the_own_core_model_and_the_direction_of_the_step():
    model = linear([0.0, 0.0], [0.0])
    cores = [{"weight": torch.tensor([[1.0, 0.0]]), "bias": torch.tensor([1.0])},
             {"weight": torch.tensor([[0.0, 2.0]]), "bias": torch.tensor([-1.0])}]
    module = Mixture(model, cores, own=0, p=torch.tensor([0.75, 0.25]))
    x = torch.tensor([[1.0, 3.0]])
    # theta-hat = 0.75 (1, 0; 1) + 0.25 (0, 2; -1) = (0.75, 0.5; 0.5): output 0.75 + 1.5 + 0.5 = 2.75
    out = module(x)
    assert out.item() == pytest.approx(2.75)
    out.sum().backward()  # L = output: grad_theta-hat = (x; 1) = (1, 3; 1)
    # dL/dp_j = <grad_theta-hat, theta_j>: core 0: 1 + 0 + 1 = 2; core 1: 0 + 6 - 1 = 5
    assert torch.allclose(module.p.grad, torch.tensor([2.0, 5.0]))
    # dL/dtheta_own = p_own grad_theta-hat = 0.75 (1, 3; 1); the other core model is a constant
    assert torch.allclose(module.core[0].grad, torch.tensor([[0.75, 2.25]]))
    assert torch.allclose(module.core[1].grad, torch.tensor([0.75]))
    torch.optim.SGD([module.p], lr=0.1).step()  # p moves against its gradient
    assert torch.allclose(module.p.detach(), torch.tensor([0.75 - 0.2, 0.25 - 0.5]))


def test_the_loss_scheduler_by_hand():
    cosine = APPLEParams(schedule="cosine", L=0.5)
    # L_rounds = int(10 * 0.5) = 5: (cos(pi r / 5) + 1) / 2 for r < 5, then 0
    assert scheduler(0, 10, cosine) == pytest.approx(1.0)
    assert scheduler(2, 10, cosine) == pytest.approx((math.cos(2 * math.pi / 5) + 1) / 2)
    assert scheduler(5, 10, cosine) == 0.0 and scheduler(9, 10, cosine) == 0.0
    exponential = APPLEParams(schedule="exponential", L=0.5)
    assert scheduler(0, 10, exponential) == pytest.approx(1.0)
    assert scheduler(1, 10, exponential) == pytest.approx(0.001 ** 0.2)
    assert scheduler(5, 10, exponential) == 0.0
    assert scheduler(0, 3, APPLEParams(L=0.1)) == 0.0  # int(0.3) = 0 rounds: the regulariser is off


def test_the_prior():
    assert torch.allclose(prior([100, 300], "samples"), torch.tensor([0.25, 0.75]))
    assert torch.allclose(prior([100, 300, 7, 1], "uniform"), torch.full((4,), 0.25))


def test_the_regulariser_pulls_p_towards_the_prior():
    _, ctx = prepared(**BASE, **{"algorithm.params.mu": 50.0, "algorithm.params.L": 1.0,
                                      "algorithm.params.p_lr": 0.01, "algorithm.params.prior": "uniform"})
    client = ctx.client(0)
    client.state["p"] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # far from p_0 = 1/4
    ctx.round = 1
    ctx.hooks.local_train(ctx=ctx, client=client)
    p = ctx.store[0]["p"]
    assert float(p[0]) < 0.9 and all(float(p[j]) > 0.05 for j in (1, 2, 3))


# -- in a run ---------------------------------------------------------------------------------------


def test_a_round_recomputed_and_the_evaluated_model_is_the_p_weighted_sum():
    engine, ctx = prepared(**BASE, **{"algorithm.params.p_lr": 0.05, "training.local_epochs": 1})
    init = ctx.models.initial_state("mlp")
    engine.run_round(ctx, 1)
    cores1 = {j: {k: v.clone() for k, v in ctx.server["cores"][j].items()} for j in range(4)}
    state1 = {i: {"core": ctx.store[i]["core"], "p": ctx.store[i]["p"].clone()} for i in range(4)}
    names = [n for n, _ in ctx.models.build("mlp").named_parameters()]
    sizes = [ctx.data.clients[j].num_train for j in range(4)]
    p0 = torch.tensor([n / sum(sizes) for n in sizes])
    for i in range(4):
        assert_same(cores1[i], state1[i]["core"])  # the server stores each client's own core model
    # round 1 recomputed for client 0: every copy is the initial model, p starts at p_0
    model = ctx.models.build("mlp")
    core = {n: init[n].clone().requires_grad_(True) for n in names}
    p = p0.clone().requires_grad_(True)
    data = ctx.data.clients[0]
    ctx.round = 1
    gen = ctx.client(0).generator("train")
    order = torch.randperm(data.num_train, generator=gen)
    bs, lr, p_lr = ctx.spec.training.batch_size, ctx.spec.training.lr, 0.05
    for start in batch_starts(data.num_train, bs, ctx.spec.training.drop_last):
        idx = order[start:start + bs]
        theta = {n: p[0] * core[n] + sum(p[j] * init[n] for j in (1, 2, 3)) for n in names}
        loss = F.cross_entropy(torch.func.functional_call(model, theta, (data.train_x[idx],)), data.train_y[idx])
        loss = loss + 0.0 * (p - p0).pow(2).sum()  # 3 rounds x L = 0.1: the regulariser is off
        grads = torch.autograd.grad(loss, [*core.values(), p])
        with torch.no_grad():
            for (n, c), g in zip(core.items(), grads):
                c -= lr * g
            p -= p_lr * grads[-1]
    for n in names:
        assert torch.allclose(state1[0]["core"][n], core[n], atol=1e-5), n
    assert torch.allclose(state1[0]["p"], p.detach(), atol=1e-5)
    assert not torch.allclose(state1[0]["p"], p0)  # p moved
    engine.run_round(ctx, 2)
    for i in range(4):  # the copies a client holds are the other clients' round-1 core models
        for j in range(4):
            if j != i:
                assert_same(ctx.store[i]["copies"][j], cores1[j])
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        cores = [ctx.store[i]["core"] if j == i else ctx.store[i]["copies"][j] for j in range(4)]
        for n in names:
            expected = sum(float(ctx.store[i]["p"][j]) * cores[j][n] for j in range(4))
            assert torch.allclose(model[n], expected, atol=1e-6)


def recomputed_round(ctx, i, cores, p_start, coefficient, p_lr):
    """Client i's round of Eq. 5-7 written out: SGD on its own core model (training.lr) and on p
    (p_lr), the other clients' ``cores`` fixed, the loss cross-entropy + coefficient ||p - p_0||^2.
    Returns (own core model, p). ``ctx.round`` must be the round (the client's batch order)."""
    names = [n for n, _ in ctx.models.build("mlp").named_parameters()]
    model = ctx.models.build("mlp")
    core = {n: cores[i][n].clone().requires_grad_(True) for n in names}
    p = p_start.clone().requires_grad_(True)
    sizes = [ctx.data.clients[j].num_train for j in range(4)]
    p0 = torch.tensor([n / sum(sizes) for n in sizes])
    data, training = ctx.data.clients[i], ctx.spec.training
    order = batch_order(data.num_train, ctx.client(i).generator("train"), training.shuffle)
    for start in batch_starts(data.num_train, training.batch_size, training.drop_last):
        idx = order[start:start + training.batch_size]
        theta = {n: sum(p[j] * (core[n] if j == i else cores[j][n]) for j in range(4)) for n in names}
        loss = F.cross_entropy(torch.func.functional_call(model, theta, (data.train_x[idx],)), data.train_y[idx])
        loss = loss + coefficient * (p - p0).pow(2).sum()
        grads = torch.autograd.grad(loss, [*core.values(), p])
        with torch.no_grad():
            for c, g in zip(core.values(), grads):
                c -= training.lr * g
            p -= p_lr * grads[-1]
    return {n: c.detach() for n, c in core.items()}, p.detach()


def test_the_regulariser_is_on_in_round_1_only_at_10_rounds_and_l_0_1():
    # the spec's setting (specs/personalized_aggregation.toml): int(10 x 0.1) = 1 round of lambda(r) > 0,
    # lambda(r = 0) = 1 in round 1 and 0 from round 2; a scheduler off by one round in either direction
    # gives round 1 no regulariser (lambda(1) = 0) or round 2 a full one (lambda(0) = 1)
    mu, p_lr = 20.0, 0.01
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 10, "algorithm.params.L": 0.1, "algorithm.params.mu": mu,
                              "algorithm.params.p_lr": p_lr})
    names = [n for n, _ in ctx.models.build("mlp").named_parameters()]
    init = ctx.models.initial_state("mlp")
    sizes = [ctx.data.clients[j].num_train for j in range(4)]
    p0 = torch.tensor([n / sum(sizes) for n in sizes])
    engine.run_round(ctx, 1)
    for i in range(4):
        core, p = recomputed_round(ctx, i, [init] * 4, p0, mu, p_lr)
        assert torch.allclose(ctx.store[i]["p"], p, atol=1e-5), i
        assert all(torch.allclose(ctx.store[i]["core"][n], core[n], atol=1e-5) for n in names), i
        _, p_off = recomputed_round(ctx, i, [init] * 4, p0, 0.0, p_lr)
        assert (p - p_off).abs().max() > 1e-3, i  # the regulariser mattered in round 1
    cores = [{n: v.clone() for n, v in ctx.store[j]["core"].items()} for j in range(4)]
    starts = [ctx.store[i]["p"].clone() for i in range(4)]
    engine.run_round(ctx, 2)
    for i in range(4):
        core, p = recomputed_round(ctx, i, cores, starts[i], 0.0, p_lr)
        assert torch.allclose(ctx.store[i]["p"], p, atol=1e-5), i
        assert all(torch.allclose(ctx.store[i]["core"][n], core[n], atol=1e-5) for n in names), i
        _, p_on = recomputed_round(ctx, i, cores, starts[i], mu, p_lr)
        assert (p - p_on).abs().max() > 1e-3, i  # and would have in round 2


def test_a_client_that_never_trained_is_evaluated_with_the_initial_model():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    (trained,) = ctx.participants
    idle = (trained + 1) % 4
    model = evaluated_models(ctx, ctx.client(idle))[""].state_dict()
    for key, value in ctx.models.initial_state("mlp").items():
        assert torch.allclose(model[key].float(), value.float(), atol=1e-6)


def test_only_changed_core_models_travel_and_are_counted():
    engine, ctx = prepared(**BASE)
    one = model_bytes(ctx.models.initial_state("mlp"))
    engine.run_round(ctx, 1)
    assert ctx.comm_down == 0 and ctx.comm_up == 4 * one  # nothing changed yet; every client uploads its core
    engine.run_round(ctx, 2)
    assert ctx.comm_down == 4 * 3 * one  # every participant gets the 3 other core models
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    sent = sum(len(held) for held in ctx.server["held"].values())
    assert sent >= 1 and ctx.comm_down >= sent * one  # a model is re-sent only when it changed again


def test_limited_downloads_send_at_most_m_and_upload_p():
    engine, ctx = prepared(**BASE, **{"algorithm.params.num_downloads": 1})
    one = model_bytes(ctx.models.initial_state("mlp"))
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    assert ctx.comm_down == 2 * 4 * 1 * one  # rounds 2-3 x 4 participants x 1 core model
    assert ctx.comm_up == 3 * 4 * (one + 4 * 4)  # the core model and p_i (4 float32)
    assert all(len(held) == 2 for held in ctx.server["held"].values())


def test_the_limited_choice_takes_models_never_received_first():
    rng = np.random.default_rng(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    index = {j: j for j in range(4)}
    assert choose_downloads([1, 2, 3], {2}, p, index, 1, 5, 4, rng) == [2]
    assert sorted(choose_downloads([1, 2, 3], {1, 2, 3}, p, index, 2, 5, 4, rng)) in ([1, 2], [1, 3], [2, 3])
    assert choose_downloads([1, 2], set(), p, index, 5, 5, 4, rng) == [1, 2]
    drawn = [choose_downloads([1, 2, 3], set(), p, index, 1, 5, 4, np.random.default_rng(s))[0] for s in range(200)]
    assert set(drawn) == {1, 2, 3}
    for seed in range(20):  # drawn without replacement: M distinct models
        chosen = choose_downloads([1, 2, 3, 4, 5], set(), p, {j: j % 4 for j in range(6)}, 3, 5, 4,
                                  np.random.default_rng(seed))
        assert len(set(chosen)) == 3


def test_the_limited_draw_weighs_models_by_base_to_the_p():
    # r = 5, M = 1, N = 4: base = max(1.5, 5/4) = 1.5; |p| = 0, 2: odds 1 and 2.25
    assert download_probabilities([0.0, 2.0], 5, 1, 4) == pytest.approx([1 / 3.25, 2.25 / 3.25])
    # r = 20, M = 2, N = 4: base = max(1.5, 10) = 10; |p| = 1, 0: odds 10 and 1
    assert download_probabilities([1.0, 0.0], 20, 2, 4) == pytest.approx([10 / 11, 1 / 11])


def test_a_full_run_with_a_coldstart_client():
    result = Engine(resolve(tiny_raw(**BASE, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("p_lr", 0.0), ("mu", -0.1), ("L", 0.0), ("L", 1.5), ("schedule", "cos"),
                                       ("prior", "onehot"), ("num_downloads", 0)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_clients_of_several_architectures_are_refused():
    from pfl_core.errors import SpecError

    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "apple averages weights" in info.value.message


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.L": 2.0}))
    assert line.startswith("pfl-run: error: algorithm.params.L") and "(0, 1]" in line
