"""FedGen (plugins/fedgen): the label-count weights, the teacher ensemble and the diversity term by
hand; the generator trained on the server against the frozen client classifiers (recomputed
independently); a client's regularised round recomputed; the generator's broadcast charged in
bytes; FedAvg when alpha = beta = 0; what is evaluated; bad input."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, assert_same, dry_run_error, far_apart, model_bytes, prepared, refused_at_key
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.seeding import torch_generator
from pfl_plugins.fedgen import (
    GENERATOR_WEIGHT_DECAY,
    FedGenParams,
    Generator,
    decayed,
    diversity_loss,
    ensemble_logits,
    label_weights,
)

SMALL = {"hidden": 6, "noise_dim": 3, "generator_steps": 4}
BASE = {"algorithm.name": "fedgen", "model.params.hidden": [8], "experiment.rounds": 2, "algorithm.params": SMALL}
K = 8  # the representation: the mlp [8]'s classifier input


# -- (F2), (F3) by hand ---------------------------------------------------------------------------------


def test_label_weights_by_hand():
    counts = torch.tensor([[3, 0, 0], [1, 2, 0]])  # two clients, three labels (label 2: nobody)
    alpha = label_weights(counts)  # alpha[y, k] = n_k^y / sum_j n_j^y
    assert torch.allclose(alpha, torch.tensor([[0.75, 0.25], [0.0, 1.0], [0.0, 0.0]], dtype=alpha.dtype))


def test_ensemble_logits_weigh_each_teacher_by_its_share_of_the_label():
    heads = [(torch.tensor([[1.0], [0.0]]), torch.tensor([0.0, 0.0])),  # client 0: h(z) = (z, 0)
             (torch.tensor([[0.0], [2.0]]), torch.tensor([1.0, 0.0]))]  # client 1: h(z) = (1, 2z)
    alpha = label_weights(torch.tensor([[3, 0], [1, 2]]))
    z, y = torch.tensor([[1.0], [1.0]]), torch.tensor([0, 1])
    out = ensemble_logits(z, y, heads, alpha)
    # label 0: 0.75 (1, 0) + 0.25 (1, 2) = (1, 0.5); label 1 (only client 1 holds it): (1, 2)
    assert torch.allclose(out, torch.tensor([[1.0, 0.5], [1.0, 2.0]]))


def test_diversity_loss_by_hand():
    eps = torch.tensor([[0.0], [1.0]])
    z = torch.tensor([[0.0, 0.0], [2.0, 4.0]])
    # pairs (0, 1) and (1, 0): d_eps = 1, d_z = (2 + 4) / 2 = 3; the diagonal 0: mean 6 / 4
    assert diversity_loss(eps, z).item() == pytest.approx(math.exp(-1.5))
    assert diversity_loss(eps, torch.zeros(2, 2)).item() == pytest.approx(1.0)  # identical features: the most


def test_the_schedule_decays_per_round():
    assert decayed(10.0, 0.98, 1) == 10.0 and decayed(10.0, 0.98, 3) == pytest.approx(10.0 * 0.98 ** 2)
    assert decayed(10.0, 1.0, 50) == 10.0


def test_generator_feeds_noise_and_one_hot_labels():
    gen = Generator(noise_dim=2, num_classes=3, hidden=4, feature_dim=5)
    assert gen.fc1.in_features == 2 + 3 and gen(torch.tensor([0, 2]), torch.zeros(2, 2)).shape == (2, 5)


# -- the server: FedAvg, then the generator against the frozen classifiers -------------------------------


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {"weights": {n: t.clone() for n, t in message["weights"].items()},
                                    "counts": message["counts"].clone()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def expected_generator(ctx, init, heads, counts, p, optimizer_state=None):
    """(F2)-(F3) recomputed: Adam on a fresh generator from ``init`` against ``heads``."""
    gen = Generator(p.noise_dim, ctx.num_classes, p.hidden, K)
    gen.load_state_dict(init)
    gen.train()
    opt = torch.optim.Adam(gen.parameters(), lr=p.generator_lr, weight_decay=GENERATOR_WEIGHT_DECAY)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    counts = counts.double()
    alpha = counts / counts.sum(0).clamp(min=1)  # clients x labels
    prior = (counts.sum(0) / counts.sum()).float()
    draws = torch_generator(ctx.spec.experiment.seed, "fedgen", ctx.round)
    losses = []
    for _ in range(p.generator_steps):
        y = torch.multinomial(prior, ctx.spec.training.batch_size, replacement=True, generator=draws)
        eps = torch.randn(len(y), p.noise_dim, generator=draws)
        z = gen(y, eps)
        teacher = sum(alpha[k, y].float()[:, None] * (z @ w.T + b) for k, (w, b) in enumerate(heads))
        d_eps = ((eps[:, None] - eps[None]) ** 2).mean(2)
        d_z = (z[:, None] - z[None]).abs().mean(2)
        loss = F.cross_entropy(teacher, y) + p.eta * torch.exp(-(d_eps * d_z).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    expected_generator.mean_loss = sum(losses) / len(losses)
    return gen.state_dict(), prior


def test_the_generator_is_trained_on_the_server_against_the_frozen_client_classifiers():
    engine, ctx = prepared(**{**BASE, "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}})
    p = FedGenParams(**SMALL)
    init = {k: v.clone() for k, v in ctx.server["generator"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    # (F1): the global model is the clients' n-weighted average; the generator did not touch it
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    for key, value in ctx.server["global"].items():
        expected = sum(n[i] * uploads[i]["weights"][key].double() for i in range(4)) / sum(n.values())
        assert torch.allclose(value.double(), expected, atol=1e-6), key
    # the counts are each client's labels
    for i in range(4):
        assert torch.equal(uploads[i]["counts"], torch.bincount(ctx.data.clients[i].train_y, minlength=ctx.num_classes))
    heads = [(uploads[i]["weights"]["fc2.weight"], uploads[i]["weights"]["fc2.bias"]) for i in range(4)]
    counts = torch.stack([uploads[i]["counts"] for i in range(4)])
    assert (counts == 0).any()  # some label is missing somewhere: the per-label weights matter
    state, prior = expected_generator(ctx, init, heads, counts, p)
    assert_close(ctx.server["generator"], state, [k for k in state if "num_batches" not in k], atol=1e-5)
    assert far_apart(ctx.server["generator"], init, ["fc1.weight", "fc2.weight"])
    assert torch.allclose(ctx.server["label_prior"], prior)
    assert ctx.round_metrics["fedgen_generator_loss"] == pytest.approx(expected_generator.mean_loss, rel=1e-5)
    # round 2 continues from the stored generator and Adam's stored moments
    after1 = {k: v.clone() for k, v in ctx.server["generator"].items()}
    opt1 = copy.deepcopy(ctx.server["generator_optimizer"])
    uploads.clear()
    engine.run_round(ctx, 2)
    heads = [(uploads[i]["weights"]["fc2.weight"], uploads[i]["weights"]["fc2.bias"]) for i in range(4)]
    state2, _ = expected_generator(ctx, after1, heads, counts, p, opt1)
    assert_close(ctx.server["generator"], state2, [k for k in state2 if "num_batches" not in k], atol=1e-5)


def test_with_a_wrong_weighting_the_generator_differs():
    """A uniform teacher average (not the label counts) gives another generator: the test above can
    tell the weightings apart."""
    engine, ctx = prepared(**{**BASE, "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}})
    init = {k: v.clone() for k, v in ctx.server["generator"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    heads = [(uploads[i]["weights"]["fc2.weight"], uploads[i]["weights"]["fc2.bias"]) for i in range(4)]
    uniform = torch.ones(4, ctx.num_classes, dtype=torch.long)
    state, _ = expected_generator(ctx, init, heads, uniform, FedGenParams(**SMALL))
    assert far_apart(ctx.server["generator"], state, ["fc1.weight"], atol=1e-5)


# -- a client's round recomputed independently ------------------------------------------------------------


def fedgen_training(ctx, i, w1, gen, prior, a2, b2, lr):
    """Client i's round-2 training from w^1 with (F4)-(F5) written out, its draws repeated."""
    w = {k: v.clone().requires_grad_(True) for k, v in w1.items()}
    draws = torch_generator(ctx.spec.experiment.seed, "fedgen", 2, i)

    def loss_fn(_model, x, y, _logits):
        logits = F.linear(F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"], w["fc2.bias"])
        loss = F.cross_entropy(logits, y)
        with torch.no_grad():
            y_hat = torch.multinomial(prior, ctx.spec.training.batch_size, replacement=True, generator=draws)
            z_hat = gen(y_hat, torch.randn(len(y_hat), SMALL["noise_dim"], generator=draws))
            z = gen(y, torch.randn(len(y), SMALL["noise_dim"], generator=draws))
        loss = loss + a2 * F.cross_entropy(F.linear(z_hat, w["fc2.weight"], w["fc2.bias"]), y_hat)  # (F4)
        target = F.softmax(F.linear(z, w["fc2.weight"], w["fc2.bias"]), 1).detach()
        return loss + b2 * F.kl_div(F.log_softmax(logits, 1), target, reduction="batchmean")  # (F5)

    ctx.client(i).train(model=nn.Identity(), optimizer=torch.optim.SGD(list(w.values()), lr=lr), loss_fn=loss_fn)
    return w


def test_a_regularised_client_round_recomputed_independently():
    alpha, beta, decay, lr = 2.0, 0.5, 0.9, 0.05
    params = {**SMALL, "alpha": alpha, "beta": beta, "decay": decay}
    engine, ctx = prepared(**{**BASE, "algorithm.params": params, "training.lr": lr})
    engine.run_round(ctx, 1)
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    gen = Generator(SMALL["noise_dim"], ctx.num_classes, SMALL["hidden"], K)
    gen.load_state_dict(ctx.server["generator"])
    gen.eval()
    prior = ctx.server["label_prior"].clone()
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 2)
    for i in range(4):
        w = fedgen_training(ctx, i, w1, gen, prior, alpha * decay, beta * decay, lr)  # round 2: decay^1
        assert_close(uploads[i]["weights"], w, atol=1e-6)
        assert far_apart(w, w1, ["fc2.weight"])


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_without_the_regularisers_it_is_fedavg_bit_for_bit(extra):
    def global_after(overrides):
        engine, ctx = prepared(**overrides)
        for r in (1, 2, 3):
            engine.run_round(ctx, r)
        return ctx.server["global"]

    off = {**BASE, "algorithm.params": {**SMALL, "alpha": 0.0, "beta": 0.0}, **extra}
    avg = global_after({**BASE, "algorithm.name": "fedavg", "algorithm.params": {}, **extra})
    assert_same(global_after(off), avg)
    on = global_after({**BASE, **extra})  # ... and the regularisers change the model
    assert far_apart(on, avg, ["fc2.weight"])
    only_alpha = global_after({**off, "algorithm.params": {**SMALL, "beta": 0.0}})
    assert far_apart(only_alpha, avg, ["fc2.weight"])


# -- bytes, evaluation, cold start -------------------------------------------------------------------------


def test_the_generator_broadcast_is_charged():
    _, engine = run_tiny(**{**BASE, "experiment.rounds": 3})
    ctx = engine.ctx
    model = model_bytes(ctx.server["global"])
    generator = model_bytes(ctx.server["generator"])  # parameters and BatchNorm buffers
    c = ctx.num_classes
    # down: round 1 the model; rounds 2 and 3 the model, the generator and p-hat (C floats)
    assert ctx.comm_down == 4 * model + 2 * 4 * (model + generator + 4 * c)
    assert generator == 4 * ((SMALL["noise_dim"] + c) * 6 + 6 + 4 * 6 + 6 * K + K) + 8  # + num_batches_tracked
    # up: the model and the C label counts (int64)
    assert ctx.comm_up == 3 * 4 * (model + 8 * c)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert set(message) == {"weights", "generator", "label_prior"}


def test_round_one_sends_no_generator_and_clients_train_plainly():
    engine, ctx = prepared(**BASE)
    assert set(ctx.hooks.on_broadcast(ctx=ctx, client_id=0)) == {"weights"}
    engine.run_round(ctx, 1)
    assert ctx.server["label_prior"] is not None


def test_the_evaluated_model_is_the_global_model():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    models = evaluated_models(ctx, ctx.client(2))
    assert set(models) == {""}
    assert_same(models[""].state_dict(), ctx.server["global"])


def test_a_full_run_with_coldstart_clients():
    result, _ = run_tiny(**BASE, **{"experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and "fedgen_generator_loss" in result.history[-1]


# -- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha", -1.0), ("beta", float("inf")), ("decay", 0.0), ("decay", 1.5),
                                       ("noise_dim", 0), ("hidden", 2.0), ("generator_lr", 0.0),
                                       ("generator_steps", -1), ("eta", -0.1)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key({k: v for k, v in BASE.items() if k != "algorithm.params"}, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    raw = tiny_raw(**{k: v for k, v in BASE.items() if k != "algorithm.params"}, **{"algorithm.params.generator_lr": -1.0})
    line = dry_run_error(tmp_path, capsys, raw)
    assert "algorithm.params.generator_lr" in line and "> 0" in line


def test_defaults_are_the_documented_ones():
    p = FedGenParams()
    assert (p.alpha, p.beta, p.decay, p.noise_dim, p.hidden, p.generator_lr, p.generator_steps, p.eta) == (
        10.0, 10.0, 0.98, 32, 256, 3e-4, 50, 1.0)
    assert GENERATOR_WEIGHT_DECAY == 1e-2  # the official code's
