"""pFedFDA (plugins/pfedfda): the generative classifier, the local estimates, the beta
interpolation of means and covariance and the folds by hand, the cross-validated beta against
a grid, a round recomputed (fixed global head, body training, interpolated estimates, n_i-weighted
aggregate), the test-time adapted evaluation, bytes, budget, bad input."""

import math

import numpy as np
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
)
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.pfedfda import (
    PFedFDAParams,
    class_priors,
    cv_loss,
    cv_parts,
    interpolate,
    lda_head,
    local_estimates,
    solve_beta,
    stratified_folds,
)

BASE = {"algorithm.name": "pfedfda", "model.params.hidden": [8], "experiment.rounds": 2}
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]
D64 = torch.float64


# -- (G1): the generative classifier, by hand ------------------------------------------------------------


def test_lda_head_by_hand():
    # d = 1, Sigma = 2: weight = mu / 2, bias = -mu^2 / 4 + log pi
    weight, bias = lda_head(torch.tensor([[-1.0], [1.0]]), torch.tensor([[2.0]]), torch.tensor([0.25, 0.75]), 0.0)
    assert torch.allclose(weight, torch.tensor([[-0.5], [0.5]], dtype=D64))
    assert torch.allclose(bias, torch.tensor([-0.25 + math.log(0.25), -0.25 + math.log(0.75)], dtype=D64))
    # d = 2, Sigma = diag(3, 1), eps = 1/2: S = diag(3, 1) / 2 + (4 / 2) / 2 I = diag(2.5, 1.5)
    # mu_0 = (5, 3): S^-1 mu_0 = (2, 2), bias -(10 + 6) / 2 + log pi_0
    weight, bias = lda_head(torch.tensor([[5.0, 3.0], [0.0, 0.0]]), torch.diag(torch.tensor([3.0, 1.0])),
                            torch.tensor([0.5, 0.5]), 0.5)
    assert torch.allclose(weight, torch.tensor([[2.0, 2.0], [0.0, 0.0]], dtype=D64))
    assert torch.allclose(bias, torch.tensor([-8 + math.log(0.5), math.log(0.5)], dtype=D64))


def test_class_priors_by_hand():
    p = class_priors(torch.tensor([0, 0, 1]), 3, 0.1)  # (2/3 + 0.1, 1/3 + 0.1, 0.1) / 1.3
    assert torch.allclose(p, torch.tensor([23 / 39, 13 / 39, 3 / 39], dtype=D64))


# -- (G2), (G3): local estimates and the beta interpolation, by hand ----------------------------------------


def test_local_estimates_by_hand():
    z = torch.tensor([[0.0], [2.0], [4.0], [1.0]])
    y = torch.tensor([0, 0, 0, 1])
    glob = torch.tensor([[9.0], [5.0], [7.0]])
    # class 0: 3 samples > 2: mean 2; class 1: 1 sample: the global mean 5; class 2 absent: 7.
    # centred: -2, 0, 2, 1 - 5 = -4: scatter 24, / (4 - 1) = 8, + eps
    means, cov = local_estimates(z, y, glob, 2, 0.01)
    assert torch.allclose(means, torch.tensor([[2.0], [5.0], [7.0]], dtype=D64))
    assert torch.allclose(cov, torch.tensor([[8.01]], dtype=D64))
    means, cov = local_estimates(z, y, glob, 0, 0.01)  # every seen class has its own mean
    assert torch.allclose(means, torch.tensor([[2.0], [1.0], [7.0]], dtype=D64))
    assert torch.allclose(cov, torch.tensor([[8 / 3 + 0.01]], dtype=D64))
    # two dimensions: z = (1, 0), (-1, 0), (0, 2), (0, -2), classes 0, 0, 1, 1: scatter diag(2, 8) / 3
    z = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    _, cov = local_estimates(z, torch.tensor([0, 0, 1, 1]), torch.zeros(2, 2), 0, 0.0)
    assert torch.allclose(cov, torch.diag(torch.tensor([2 / 3, 8 / 3], dtype=D64)))


def test_interpolation_of_means_and_covariance_by_hand():
    local = (torch.tensor([[2.0], [4.0]], dtype=D64), torch.tensor([[8.0]], dtype=D64))
    glob = (torch.tensor([[0.0], [0.0]]), torch.tensor([[1.0]]))
    means, cov = interpolate(local, glob, 0.25, 0.5)
    assert torch.allclose(means, torch.tensor([[0.5], [1.0]], dtype=D64))  # 0.25 local + 0.75 global
    assert torch.allclose(cov, torch.tensor([[4.5]], dtype=D64))  # 0.5 * 8 + 0.5 * 1
    means, cov = interpolate(local, glob, 1.0, 0.0)
    assert torch.equal(means, local[0]) and torch.equal(cov, glob[1].double())


# -- (G4): folds, the cross-validated loss and beta ---------------------------------------------------------


def test_stratified_folds():
    y = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3])
    out = stratified_folds(y, 2, np.random.default_rng(0))
    assert out[5] == -1  # a class with fewer samples than folds is left out
    assert sorted(out[:5].tolist()) == [0, 0, 0, 1, 1] and sorted(out[6:10].tolist()) == [0, 0, 1, 1]
    assert sorted(out[10:].tolist()) == [0, 1]  # as many samples as folds: one in each
    assert np.array_equal(out, stratified_folds(y, 2, np.random.default_rng(0)))  # seeded
    assert sorted(stratified_folds(y, 3, np.random.default_rng(1))[:5].tolist()) == [0, 0, 1, 1, 2]


def reference_cv_loss(z, y, assignment, gmeans, gcov, priors, bm, bc, min_count, eps):
    """The cross-validated loss written out with numpy."""
    z, y = z.double().numpy(), y.numpy()
    gmeans, gcov, priors = gmeans.double().numpy(), gcov.double().numpy(), priors.numpy()
    total = 0.0
    for f in range(assignment.max() + 1):
        tr, te = (assignment != f) & (assignment >= 0), assignment == f
        means = gmeans.copy()
        for c in np.unique(y[tr]):
            if (y[tr] == c).sum() > min_count:
                means[c] = z[tr][y[tr] == c].mean(0)
        r = z[tr] - means[y[tr]]
        cov = r.T @ r / (tr.sum() - 1) + eps * np.eye(z.shape[1])
        m, s = bm * means + (1 - bm) * gmeans, bc * cov + (1 - bc) * gcov
        s = (1 - eps) * s + eps * np.trace(s) / len(s) * np.eye(len(s))
        w = np.linalg.solve(s, m.T).T
        logits = z[te] @ w.T - 0.5 * (m * w).sum(1) + np.log(priors)
        logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        total += -logp[np.arange(te.sum()), y[te]].mean()
    return total


def toy(seed=0, shift=3.0, n=12):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    z = torch.randn(n, 2, generator=g) + shift * torch.stack([y == 1, y == 2], 1).float()
    glob = (torch.tensor([[0.0, 0.0], [2.0, 0.5], [0.5, 2.0]]), torch.eye(2) * 1.5)
    return z, y, glob, class_priors(y, 3, 1e-4)


@pytest.mark.parametrize("bm,bc,min_count", [(0.3, 0.3, 2), (0.8, 0.1, 1), (0.0, 1.0, 0)])
def test_cv_loss_recomputed_with_numpy(bm, bc, min_count):
    z, y, glob, priors = toy()
    assignment = stratified_folds(y, 2, np.random.default_rng(3))
    parts = cv_parts(z, y, assignment, glob[0], min_count, 1e-4)
    value = float(cv_loss(parts, glob, priors, (bm, bc), 1e-4))
    assert value == pytest.approx(reference_cv_loss(z, y, assignment, *glob, priors, bm, bc, min_count, 1e-4),
                                  rel=1e-9)


@pytest.mark.parametrize("seed,shift", [(0, 3.0), (1, 0.5), (2, 6.0)])
def test_beta_minimises_the_cross_validated_loss(seed, shift):
    z, y, glob, priors = toy(seed, shift)
    args = (2, 1, 1e-4)
    assignment = stratified_folds(y, 2, np.random.default_rng(5))
    parts = cv_parts(z, y, assignment, glob[0], 1, 1e-4)
    loss = lambda bm, bc: float(cv_loss(parts, glob, priors, (bm, bc), 1e-4))
    b, b2 = solve_beta(z, y, glob, priors, "single", *args, np.random.default_rng(5))
    assert b == b2 and 0.0 <= b <= 1.0
    grid = np.linspace(0, 1, 201)
    assert loss(b, b) <= min(loss(g, g) for g in grid) + 1e-6
    bm, bc = solve_beta(z, y, glob, priors, "separate", *args, np.random.default_rng(5))
    coarse = np.linspace(0, 1, 21)
    assert loss(bm, bc) <= min(loss(u, v) for u in coarse for v in coarse) + 1e-6
    assert solve_beta(z, y, glob, priors, "local", *args, np.random.default_rng(5)) == (1.0, 1.0)


def test_beta_follows_which_estimate_generalises():
    # well separated local clusters far from the global means: the local estimates win
    z, y, _, priors = toy(0, 8.0, 30)
    wrong = (torch.tensor([[0.0, 8.0], [8.0, 0.0], [0.0, 0.0]]), torch.eye(2))  # classes' means swapped
    b, _ = solve_beta(z, y, wrong, priors, "single", 2, 2, 1e-4, np.random.default_rng(0))
    assert 0.9 < b <= 1.0  # interpolation, never extrapolation past the local estimates
    # the global estimates are the truth and the client has few, noisy samples: mostly global
    truth = (torch.tensor([[0.0, 0.0], [8.0, 0.0], [0.0, 8.0]]), torch.eye(2))
    g = torch.Generator().manual_seed(4)
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    z = truth[0][y] + 3.0 * torch.randn(12, 2, generator=g)
    b, _ = solve_beta(z, y, truth, class_priors(y, 3, 1e-4), "single", 2, 0, 1e-4, np.random.default_rng(0))
    assert b < 0.5


def test_without_cross_validation_beta_is_zero():
    z, y = torch.randn(3, 2), torch.tensor([0, 1, 2])  # one sample per class: nothing left after pruning
    glob = (torch.zeros(3, 2), torch.eye(2))
    assert solve_beta(z, y, glob, class_priors(y, 3, 1e-4), "single", 2, 2, 1e-4,
                      np.random.default_rng(0)) == (0.0, 0.0)


# -- a round recomputed independently -------------------------------------------------------------------


def features(x, state):
    return F.relu(F.linear(x, state["fc1.weight"], state["fc1.bias"]))


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {"body": {k: v.clone() for k, v in message["body"].items()},
                                    "means": message["means"].clone(), "cov": message["cov"].clone()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def lda_state(means, cov, y, num_classes, eps=1e-4):
    weight, bias = lda_head(means, cov, class_priors(y, num_classes, eps), eps)
    return {"fc2.weight": weight.float(), "fc2.bias": bias.float()}


def assert_head_close(state, expected):
    """Equal up to float32 rounding relative to the head's scale (a near-singular covariance of
    ReLU features gives heads of size 1e4)."""
    for k in HEAD:
        scale = 1 + float(expected[k].abs().max())
        assert float((state[k].float() - expected[k].float()).abs().max()) <= 1e-5 * scale, k


def test_a_round_recomputed_independently():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.75, "partition.scheme": "dirichlet",
                              "partition.params": {"alpha": 1.0}})
    glob0 = (ctx.server["means"].clone(), ctx.server["cov"].clone())
    assert torch.equal(glob0[1], torch.eye(8)) and glob0[0].shape == (ctx.num_classes, 8)
    body0 = {k: v.clone() for k, v in ctx.server["body"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    n = {i: ctx.data.clients[i].num_train for i in ctx.participants}
    total = sum(n.values())
    for i in ctx.participants:
        x, y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
        head = lda_state(*glob0, y, ctx.num_classes)  # the fixed global head with the client's priors
        model = fresh_model(ctx, {**body0, **head})
        for name, p in model.named_parameters():
            p.requires_grad_(name in BODY)
        ctx.client(i).train(model=model, optimizer=torch.optim.SGD([model.fc1.weight, model.fc1.bias],
                                                                    lr=ctx.spec.training.lr),
                            loss_fn=lambda m, xb, yb, logits: F.cross_entropy(logits, yb))
        expected = {k: v.detach() for k, v in model.state_dict().items()}
        assert_close(uploads[i]["body"], expected, BODY, atol=1e-6)
        assert_close(expected, head, HEAD, atol=0)  # the head did not move
        # estimates: features under the trained body, beta by cross validation, interpolated
        z = features(x, expected)
        beta = solve_beta(z, y, glob0, class_priors(y, ctx.num_classes, 1e-4), "single", 2, 2, 1e-4,
                          ctx.client(i).rng("pfedfda_folds"))
        assert ctx.store[i]["beta"] == pytest.approx(beta, abs=1e-4)
        means, cov = interpolate(local_estimates(z, y, glob0[0], 2, 1e-4), glob0, *ctx.store[i]["beta"])
        assert torch.allclose(uploads[i]["means"], means.float(), atol=1e-5)
        assert torch.allclose(uploads[i]["cov"], cov.float(), atol=1e-5)
    for key in ("means", "cov"):  # (G5)
        assert torch.allclose(ctx.server[key], sum(n[i] / total * uploads[i][key] for i in n), atol=1e-6)
    for k in BODY:
        assert torch.allclose(ctx.server["body"][k], sum(n[i] / total * uploads[i]["body"][k] for i in n), atol=1e-6)


def test_the_evaluated_model_is_the_global_body_with_a_head_adapted_at_test_time():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    glob = (ctx.server["means"], ctx.server["cov"])
    for i in range(4):  # participants and idle clients alike
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(state, ctx.server["body"], BODY)
        x, y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
        z = features(x, ctx.server["body"])
        beta = solve_beta(z, y, glob, class_priors(y, ctx.num_classes, 1e-4), "single", 2, 2, 1e-4,
                          ctx.client(i).rng("pfedfda_folds"))
        means, cov = interpolate(local_estimates(z, y, glob[0], 2, 1e-4), glob, *beta)
        assert_head_close(state, lda_state(means, cov, y, ctx.num_classes))
        # adapted: not the plain global head
        assert far_apart(state, lda_state(*glob, y, ctx.num_classes), HEAD)


def test_local_beta_uses_only_the_local_estimates():
    engine, ctx = prepared(**{**BASE, "algorithm.params.beta": "local"})
    engine.run_round(ctx, 1)
    for i in range(4):  # (with beta = "single" some of these clients get beta well below 1)
        x, y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        means, cov = local_estimates(features(x, ctx.server["body"]), y, ctx.server["means"], 2, 1e-4)
        assert_head_close(state, lda_state(means, cov, y, ctx.num_classes))
        assert ctx.store[i]["beta"] == (1.0, 1.0)


# -- bytes, budget, cold start ---------------------------------------------------------------------------


def test_bytes_are_body_means_and_covariance():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    for r in (1, 2):
        engine.run_round(ctx, r)
    each = model_bytes(ctx.server["body"]) + 4 * (ctx.num_classes * 8 + 8 * 8)
    assert ctx.comm_down == ctx.comm_up == 2 * 2 * each


def test_budget_is_local_epochs_and_measured():
    resolved = resolve(tiny_raw(**{**BASE, "training.local_epochs": 2}))
    assert resolved.as_dict["budget"]["private_epochs_per_round"] == 2
    result = Engine(resolved, progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(4)


def test_coldstart_clients_adapt_without_training(monkeypatch):
    from pfl_core.runtime.context import Client
    trained = []
    original = Client.train
    monkeypatch.setattr(Client, "train", lambda self, *a, **k: trained.append(self.id) or original(self, *a, **k))
    engine = Engine(resolve(tiny_raw(**{**BASE, "experiment.coldstart_clients": 1})), progress=False)
    result = engine.run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors
    assert not set(trained) & set(engine.ctx.coldstart_clients)


def test_defaults_are_the_documented_ones():
    p = PFedFDAParams()
    assert (p.beta, p.folds, p.min_count, p.eps, p.head_layers) == ("single", 2, 2, 1e-4, 1)


def test_a_model_whose_classifier_is_not_linear_is_refused(monkeypatch):
    from torch import nn
    monkeypatch.setattr("pfl_plugins.pfedfda.parameterised_layers", lambda model: [("fc2", nn.Conv1d(1, 1, 1))])
    with pytest.raises(SpecError) as info:
        Engine(resolve(tiny_raw(**BASE)), progress=False).run()
    assert info.value.path == "model.name" and "Conv1d" in str(info.value)


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("beta", "double"), ("folds", 1), ("min_count", -1), ("eps", 0.0),
                                       ("eps", 1.0), ("eps", float("nan"))])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.folds": 1}))
    assert "algorithm.params.folds" in line and ">= 2" in line
