"""FedSR (plugins/fedsr): the encoder (S1), the L2 (S2) and KL (S3) regularisers by hand; the
classifier reading a seeded draw of z in training and the mean in evaluation; three rounds
recomputed independently (the local prior carried from round to round); the local prior never
sent, the shared one averaged; lost uploads; what is evaluated; bad input; the process executor
and a killed run's resume."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, dry_run_error, far_apart, model_bytes, prepared, refused_at_key
from test_checkpoint import (
    empty_store,
)
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedsr import (
    Encoder,
    FedSR,
    FedSRParams,
    Prior,
    Reparameterised,
    cmi_regulariser,
    l2_regulariser,
)

assert empty_store  # the fixture used by the resume test (imported, not called)

K = 8  # the mlp [8]'s classifier input
BASE = {"algorithm.name": "fedsr", "model.params.hidden": [K], "experiment.rounds": 3}
MODEL = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def softplus_inverse(t: float) -> float:
    return math.log(math.expm1(t))


# -- (S1)-(S3) by hand -----------------------------------------------------------------------------


def test_the_encoder_splits_a_mean_and_a_softplus_scale():
    encoder = Encoder(2)
    with torch.no_grad():
        encoder.linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, -1.0]]))
        encoder.linear.bias.copy_(torch.tensor([0.0, 1.0, 0.0, 0.0]))
    mu, sigma = encoder(torch.tensor([[2.0, 3.0]]))
    assert torch.allclose(mu, torch.tensor([[2.0, 4.0]]))
    assert torch.allclose(sigma, torch.tensor([[math.log1p(math.exp(5.0)), math.log1p(math.exp(-3.0))]]))


def test_the_l2_regulariser_is_the_mean_norm_not_squared():
    z = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    assert l2_regulariser(z).item() == pytest.approx(3.0)  # (5 + 1) / 2; squared norms would give 13


def kl(a, s, b, t):
    """KL(N(a, s^2) || N(b, t^2)), written out."""
    return math.log(t / s) + (s * s + (a - b) ** 2) / (2 * t * t) - 0.5


@pytest.mark.parametrize("c", [2.0, -0.5])
def test_the_cmi_regulariser_by_hand(c):
    prior = Prior(num_classes=2, dim=2)
    with torch.no_grad():
        prior.mu.copy_(torch.tensor([[0.0, 1.0], [5.0, -5.0]]))
        prior.rho.copy_(torch.tensor([[softplus_inverse(1.0), softplus_inverse(2.0)], [softplus_inverse(0.5)] * 2]))
        prior.c.fill_(c)
    mu = torch.tensor([[1.0, 0.0], [2.0, -1.0]])
    sigma = torch.tensor([[0.5, 1.0], [1.0, 2.0]])
    y = torch.tensor([0, 1])  # row 0 against r(z|0), row 1 against r(z|1)
    s = abs(c)
    row0 = kl(c * 1, s * 0.5, 0, 1) + kl(c * 0, s * 1, 1, 2)
    row1 = kl(c * 2, s * 1, 5, 0.5) + kl(c * -1, s * 2, -5, 0.5)
    assert cmi_regulariser(mu, sigma, y, prior).item() == pytest.approx((row0 + row1) / 2, rel=1e-5)
    swapped = cmi_regulariser(mu, sigma, torch.tensor([1, 0]), prior).item()
    assert swapped != pytest.approx((row0 + row1) / 2, rel=1e-3)  # the label picks the prior's row


def test_the_cmi_regulariser_trains_the_prior_towards_the_posterior():
    prior = Prior(num_classes=1, dim=1)
    mu, sigma, y = torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.tensor([0])
    cmi_regulariser(mu, sigma, y, prior).backward()
    assert prior.mu.grad.item() < 0  # descending moves r_mu (0) up towards c mu = 3


def test_the_classifier_reads_a_draw_in_training_and_the_mean_in_evaluation():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 4))
    encoder = Encoder(2)
    x = torch.randn(5, 3)
    store = {}

    def classify(z):  # the classifier without the hook
        return F.linear(z, net[1].weight, net[1].bias)

    with Reparameterised(net, encoder, noise=torch.Generator().manual_seed(7), store=store), torch.no_grad():
        out = net(x)
        h = net[0](x)
        mu, sigma = encoder(h)
        eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(7))
        assert torch.allclose(store["z"], mu + sigma * eps) and torch.allclose(out, classify(mu + sigma * eps))
        assert torch.allclose(store["mu"], mu) and torch.allclose(store["sigma"], sigma)
        net.eval()
        assert torch.allclose(net(x), classify(mu))  # evaluation mode: the mean, no draw
        net.train()
    assert store == {}  # cleared on exit
    with torch.no_grad():
        assert torch.allclose(net(x), classify(net[0](x)))  # the hook is gone
        with Reparameterised(net, encoder):  # no generator: the mean, also in training mode
            assert torch.allclose(net(x), classify(mu))


def test_local_objective_adds_both_weighted_terms():
    model = nn.Linear(2, 3)
    prior = Prior(3, 2)
    z, mu, sigma = torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.7]])
    y = torch.tensor([1])
    client = SimpleNamespace(model=model, scratch={"z": z, "mu": mu, "sigma": sigma, "prior": prior})

    def term(**params):
        return FedSR(FedSRParams(**params)).local_objective(ctx=None, client=client, model=model, x=None, y=y,
                                                            logits=None)

    cmi = cmi_regulariser(mu, sigma, y, prior).item()
    assert term(alpha_l2r=0.5, alpha_cmi=0.25).item() == pytest.approx(0.5 * 5 + 0.25 * cmi, rel=1e-6)
    assert term(alpha_l2r=0.5, alpha_cmi=0.0).item() == pytest.approx(2.5)
    assert term(alpha_l2r=0.0, alpha_cmi=0.25).item() == pytest.approx(0.25 * cmi, rel=1e-6)
    assert term(alpha_l2r=0.0, alpha_cmi=0.0) is None
    assert FedSR(FedSRParams()).local_objective(ctx=None, client=client, model=nn.Linear(2, 3), x=None, y=y,
                                                logits=None) is None  # another model: no term


# -- rounds recomputed independently ---------------------------------------------------------------


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: {n: t.detach().clone() for n, t in v.items()} for k, v in message.items()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def fedsr_training(ctx, i, weights, encoder_state, prior_state, alpha_l2r, alpha_cmi, lr):
    """Client i's round written out: (S1)-(S4) from the received model and encoder and its prior."""
    w = {k: weights[k].clone().requires_grad_(True) for k in MODEL}
    enc = {k: v.clone().requires_grad_(True) for k, v in encoder_state.items()}
    prior = {k: v.clone().requires_grad_(True) for k, v in prior_state.items()}
    noise = ctx.client(i).generator("fedsr")

    def loss_fn(_model, x, y, _logits):
        h = F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))
        out = F.linear(h, enc["linear.weight"], enc["linear.bias"])
        mu, sigma = out[:, :K], F.softplus(out[:, K:])
        z = mu + sigma * torch.randn(mu.shape, generator=noise)
        logits = F.linear(z, w["fc2.weight"], w["fc2.bias"])
        c = prior["c"]
        a, s = c * mu, c.abs() * sigma
        b, t = prior["mu"][y], F.softplus(prior["rho"])[y]
        kl = (torch.log(t / s) + (s ** 2 + (a - b) ** 2) / (2 * t ** 2) - 0.5).sum(1).mean()
        return F.cross_entropy(logits, y) + alpha_l2r * (z ** 2).sum(1).sqrt().mean() + alpha_cmi * kl

    opt = torch.optim.SGD([*w.values(), *enc.values(), *prior.values()], lr=lr)
    ctx.client(i).train(model=nn.Identity(), optimizer=opt, loss_fn=loss_fn)
    return ({k: v.detach() for k, v in w.items()}, {k: v.detach() for k, v in enc.items()},
            {k: v.detach() for k, v in prior.items()})


@pytest.mark.parametrize("prior_kind", ["local", "shared"])
def test_three_rounds_recomputed_independently(prior_kind):
    alpha_l2r, alpha_cmi, lr = 0.3, 0.2, 0.05
    engine, ctx = prepared(**BASE, **{"algorithm.params": {"alpha_l2r": alpha_l2r, "alpha_cmi": alpha_cmi,
                                                           "prior": prior_kind}, "training.lr": lr})
    weights = {k: ctx.server["global"][k].clone() for k in MODEL}
    encoder = {k: v.clone() for k, v in ctx.server["encoder"].items()}
    start = {k: v.detach().clone() for k, v in Prior(ctx.num_classes, K).state_dict().items()}
    priors = {i: start for i in range(4)}  # each client's (local) or the server's (shared)
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    uploads = spy_uploads(ctx)
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        trained = {i: fedsr_training(ctx, i, weights, encoder, priors[i], alpha_l2r, alpha_cmi, lr)
                   for i in range(4)}
        plain = fedsr_training(ctx, 0, weights, encoder, priors[0], 0.0, 0.0, lr)  # CE only: tells them apart
        assert far_apart(trained[0][0], plain[0], MODEL, atol=1e-5)
        weights = {k: sum(n[i] / sum(n.values()) * trained[i][0][k] for i in range(4)) for k in MODEL}
        encoder = {k: sum(n[i] / sum(n.values()) * trained[i][1][k] for i in range(4)) for k in encoder}
        assert_close({k: ctx.server["global"][k] for k in MODEL}, weights, atol=1e-5)
        assert_close(ctx.server["encoder"], encoder, atol=1e-5)
        if prior_kind == "local":
            priors = {i: trained[i][2] for i in range(4)}  # carried into the next round, never sent
            for i in range(4):
                assert_close(ctx.store[i]["prior"], priors[i], atol=1e-5)
                assert "prior" not in uploads[i]
            assert "prior" not in ctx.server
        else:
            shared = {k: sum(n[i] / sum(n.values()) * trained[i][2][k] for i in range(4)) for k in start}
            assert_close(ctx.server["prior"], shared, atol=1e-5)
            priors = {i: shared for i in range(4)}
            assert all("prior" not in ctx.store[i] for i in range(4))
    assert far_apart(priors[0], start, ["mu", "rho"])  # the prior did train


def test_bytes_with_a_local_and_a_shared_prior():
    for prior_kind, extra in (("local", 0), ("shared", 4 * (2 * 10 * K + 1))):  # the synthetic data's 10 classes
        _, engine = run_tiny(**{**BASE, "algorithm.params.prior": prior_kind, "experiment.rounds": 1})
        ctx = engine.ctx
        assert ctx.num_classes == 10
        encoder = model_bytes(ctx.server["encoder"])
        assert encoder == 4 * (2 * K * K + 2 * K)
        assert ctx.comm_up == ctx.comm_down == 4 * (model_bytes(ctx.server["global"]) + encoder + extra)


# -- lost uploads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prior_kind", ["local", "shared"])
def test_a_lost_upload_is_left_out_and_a_local_prior_is_kept(prior_kind):
    p = 0.5
    engine, ctx = prepared(**BASE, **{"algorithm.params.prior": prior_kind,
                                      "addons": [{"name": "dropout", "params": {"p": p}}]})
    uploads = spy_uploads(ctx)
    seed = ctx.spec.experiment.seed
    for t in (1, 2):
        before = {i: ctx.store[i].get("prior") for i in range(4)}
        engine.run_round(ctx, t)
        arrived = [i for i in range(4) if not upload_is_lost(seed, t, i, p)]
        lost = [i for i in range(4) if i not in arrived]
        if arrived and lost:
            break
    assert arrived and lost, "pick a seed or p with both kinds in one round"
    n = {i: ctx.data.clients[i].num_train for i in arrived}
    total = sum(n.values())
    for part in ["encoder"] + (["prior"] if prior_kind == "shared" else []):
        expected = {k: sum(n[i] / total * uploads[i][part][k] for i in arrived) for k in uploads[arrived[0]][part]}
        assert_close(ctx.server[part], expected, atol=1e-6)
    if prior_kind == "local":
        for i in lost:  # it trained: its prior moved, and stays although the server never got the upload
            previous = before[i] or {k: v.detach() for k, v in Prior(ctx.num_classes, K).state_dict().items()}
            assert far_apart(ctx.store[i]["prior"], previous, ["mu"], atol=1e-7)


# -- evaluation and cold start ---------------------------------------------------------------------


def test_every_client_is_evaluated_on_the_mean_representation_of_the_global_model():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    w, enc = ctx.server["global"], ctx.server["encoder"]
    for i in range(4):
        x = ctx.data.clients[i].test_x
        with torch.no_grad():
            h = F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))
            mu = F.linear(h, enc["linear.weight"][:K], enc["linear.bias"][:K])
            expected = F.linear(mu, w["fc2.weight"], w["fc2.bias"])
            model = evaluated_models(ctx, ctx.client(i))[""]
            assert torch.allclose(model(x), expected, atol=1e-5)
            assert torch.equal(model(x), model(x))  # no draw
            assert far_apart({"out": model(x)}, {"out": ctx.client(i).model(x)}, ["out"])  # not h straight in


def test_a_full_run_with_coldstart_clients():
    result, _ = run_tiny(**{**BASE, "experiment.coldstart_clients": 1, "experiment.rounds": 2})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha_l2r", -1.0), ("alpha_l2r", float("nan")), ("alpha_cmi", -0.5),
                                       ("alpha_cmi", float("inf")), ("alpha_cmi", "0.1"), ("prior", "global")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.alpha_l2r": -0.5}))
    assert line.startswith("pfl-run: error: algorithm.params.alpha_l2r: must be >= 0")


def test_a_classifier_that_is_not_linear_is_refused_before_any_data_is_loaded(monkeypatch):
    monkeypatch.setattr("pfl_plugins.feddbe.probe_model",
                        lambda spec, arch: nn.Sequential(nn.Linear(2, 2), nn.Conv1d(2, 2, 1)))
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE))
    assert str(info.value) == "model.name: fedsr needs a model whose last layer is a Linear classifier; mlp's is a Conv1d"


def test_defaults_are_the_authors():
    p = FedSRParams()
    assert (p.alpha_l2r, p.alpha_cmi, p.prior) == (0.01, 5e-4, "local")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [K], "algorithm.params.alpha_cmi": 0.1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedsr", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fedsr", "algorithm.params.alpha_cmi": 0.1, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
