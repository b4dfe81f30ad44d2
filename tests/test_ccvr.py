"""CCVR (plugins/ccvr): each participant's per-class feature statistics of the broadcast model
(recomputed by hand); the server's pooling (equal to the union's mean and unbiased covariance),
its virtual features (their moments, the seeded draw, singular covariances), the classifier's
calibration (SGD written out, only the classifier changes, w^t's extractor kept); FedAvg's
training untouched; what is evaluated; lost uploads; process executor and resume bit-identical;
bad input."""

import os

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, far_apart, prepared, record_messages, refused_at_key
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
)
from tiny import run_tiny

from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.seeding import torch_generator
from pfl_plugins.ccvr import CCVRParams, pool_statistics, virtual_representations
from pfl_plugins.faults import upload_is_lost

BASE = {"algorithm.name": "ccvr", "model.params.hidden": [8], "experiment.rounds": 3,
        "algorithm.params.sample_per_class": 30}
HEAD = ["fc2.weight", "fc2.bias"]
BODY = ["fc1.weight", "fc1.bias"]


def features(state, x):
    """relu(fc1(x)) by hand (mlp, hidden = [8]): the classifier's input, float64."""
    return torch.relu(x.flatten(1).double() @ state["fc1.weight"].double().T + state["fc1.bias"].double())


def union_statistics(ctx, state, client_ids):
    """{class: (mean, unbiased covariance)} of every listed client's features of that class, together."""
    z = torch.cat([features(state, ctx.data.clients[i].train_x) for i in client_ids])
    y = torch.cat([ctx.data.clients[i].train_y for i in client_ids])
    return {int(c): (z[y == c].mean(0), torch.cov(z[y == c].T)) for c in y.unique() if (y == c).sum() > 1}


def reference_classifier(head, x, y, lr, batch, epochs, seed, round_):
    """Mini-batch SGD on cross-entropy(W z + b, c), gradient written out, shuffled by the server's
    "ccvr:calibration" generator."""
    w, b = head["fc2.weight"].double().clone(), head["fc2.bias"].double().clone()
    x = x.double()
    generator = torch_generator(seed, "ccvr:calibration", round_)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch):
            rows = order[start:start + batch]
            p = torch.softmax(x[rows] @ w.T + b, dim=1)
            p[torch.arange(len(rows)), y[rows]] -= 1
            w, b = w - lr * p.T @ x[rows] / len(rows), b - lr * p.sum(0) / len(rows)
    return {"fc2.weight": w.float(), "fc2.bias": b.float()}


# -- (S1): what a client sends --------------------------------------------------------------------


def test_each_participant_sends_its_class_statistics_of_the_broadcast_model_beside_its_weights():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    broadcast = {k: t.clone() for k, t in ctx.server["global"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    for i in range(4):
        data = ctx.data.clients[i]
        statistics = uploads[i]["statistics"]
        assert set(statistics["counts"]) == {int(c) for c in data.train_y.unique()}
        own = union_statistics(ctx, broadcast, [i])
        for c, n in statistics["counts"].items():
            assert n == int((data.train_y == c).sum())
            if n == 1:  # no covariance: zeros, whose weight (N - 1) in the pooling is 0
                assert not statistics["covariances"][c].any()
                continue
            mean, cov = own[c]
            assert_close({"m": statistics["means"][c]}, {"m": mean.float()}, atol=1e-5)
            assert_close({"s": statistics["covariances"][c]}, {"s": cov.float()}, atol=1e-5)  # unbiased (n - 1)
        # the statistics are the broadcast model's, not the trained one's
        trained = union_statistics(ctx, uploads[i]["weights"], [i])
        c = max(statistics["counts"], key=statistics["counts"].get)
        assert not torch.allclose(statistics["means"][c].double(), trained[c][0], atol=1e-4)


# -- (S2): pooling --------------------------------------------------------------------------------


def report(rows_by_class):
    counts, means, covs = {}, {}, {}
    for c, rows in rows_by_class.items():
        counts[c], means[c] = len(rows), rows.mean(0)
        covs[c] = torch.cov(rows.T) if len(rows) > 1 else torch.zeros(rows.shape[1], rows.shape[1])
    return {"counts": counts, "means": means, "covariances": covs}


def test_pooling_gives_the_mean_and_unbiased_covariance_of_the_union():
    g = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64) + 4
    b1, c1 = torch.randn(1, 3, generator=g, dtype=torch.float64) - 2, torch.randn(1, 3, generator=g, dtype=torch.float64)
    pooled = pool_statistics([report({0: a0, 1: b0}), report({1: b1, 2: c1})])
    assert sorted(pooled) == [0, 1]  # class 2 was seen once: no covariance, no virtual features
    union = torch.cat([b0, b1])
    assert torch.allclose(pooled[1][0], union.mean(0), atol=1e-12)
    assert torch.allclose(pooled[1][1], torch.cov(union.T), atol=1e-12)
    assert torch.allclose(pooled[0][1], torch.cov(a0.T), atol=1e-12)


def test_the_server_pools_the_round_participants_statistics():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    uploads = record_messages(ctx, "client_upload")
    broadcast = {k: t.clone() for k, t in ctx.server["global"].items()}
    engine.run_round(ctx, 2)
    assert len(uploads) == 2
    pooled = pool_statistics([uploads[i]["statistics"] for i in sorted(uploads)])
    expected = union_statistics(ctx, broadcast, sorted(uploads))
    assert sorted(pooled) == sorted(expected)
    for c in expected:
        assert torch.allclose(pooled[c][0], expected[c][0], atol=1e-5)
        assert torch.allclose(pooled[c][1], expected[c][1], atol=1e-5)


# -- (S3): virtual features -----------------------------------------------------------------------


def test_virtual_features_follow_each_class_gaussian_even_a_singular_one():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 3, generator=g, dtype=torch.float64)
    full = a @ a.T + torch.eye(3, dtype=torch.float64)
    v = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    u = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64) / 5 ** 0.5  # orthogonal to v
    # rank 1 (as a ReLU feature that is never active makes it), with a round-off eigenvalue below 0
    singular = 2.0 * torch.outer(v, v) - 1e-12 * torch.outer(u, u)
    pooled = {3: (torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), full),
              1: (torch.tensor([-5.0, 0.0, 5.0], dtype=torch.float64), singular)}
    x, y = virtual_representations(pooled, 20000, torch.Generator().manual_seed(2))
    assert torch.isfinite(x).all()
    assert x.dtype == torch.float32 and y.tolist() == [1] * 20000 + [3] * 20000  # classes ascending
    for c, (mean, cov) in pooled.items():
        rows = x[y == c].double()
        assert torch.allclose(rows.mean(0), mean, atol=0.06)
        assert torch.allclose(torch.cov(rows.T), cov, atol=0.15)
    again, _ = virtual_representations(pooled, 20000, torch.Generator().manual_seed(2))
    assert torch.equal(x, again)


# -- (S4): calibration, and what is evaluated ----------------------------------------------------


@pytest.mark.parametrize("params", [{}, {"server_lr": 0.7, "server_epochs": 2, "server_batch_size": 7}],
                         ids=["defaults", "set"])
def test_the_classifier_of_the_broadcast_model_is_retrained_on_the_virtual_features(params):
    engine, ctx = prepared(**BASE, **{f"algorithm.params.{k}": v for k, v in params.items()})
    engine.run_round(ctx, 1)
    broadcast = {k: t.clone() for k, t in ctx.server["global"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    pooled = pool_statistics([uploads[i]["statistics"] for i in ctx.participants])
    x, y = virtual_representations(pooled, 30, torch_generator(0, "ccvr:virtual", 2))
    lr, batch, epochs = params.get("server_lr", 0.1), params.get("server_batch_size", 10), params.get("server_epochs", 1)
    expected = reference_classifier(broadcast, x, y, lr, batch, epochs, 0, 2)
    calibrated = ctx.server["calibrated"]
    assert_close(calibrated, expected, HEAD, atol=1e-5)
    assert far_apart(calibrated, broadcast, HEAD)
    assert_close(calibrated, broadcast, BODY, atol=0)  # the extractor is w^t's, untouched
    if not params:  # batch and epochs matter
        assert far_apart(expected, reference_classifier(broadcast, x, y, lr, len(y), 1, 0, 2), ["fc2.weight"])
        assert far_apart(expected, reference_classifier(broadcast, x, y, lr, batch, 2, 0, 2), ["fc2.weight"])


def test_training_is_fedavgs_and_every_client_is_scored_with_the_calibrated_model():
    engine, ctx = prepared(**BASE)
    fedavg_engine, fedavg_ctx = prepared(**{**BASE, "algorithm.name": "fedavg", "algorithm.params": {}})
    for r in (1, 2):
        engine.run_round(ctx, r)
        fedavg_engine.run_round(fedavg_ctx, r)
    assert_close(ctx.server["global"], fedavg_ctx.server["global"], atol=0)  # the calibration never feeds back
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_close(model, ctx.server["calibrated"], atol=0)
        assert far_apart(model, ctx.server["global"], BODY)


def test_before_any_calibration_the_global_model_is_evaluated():
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 1.0}}])
    engine.run_round(ctx, 1)
    assert "calibrated" not in ctx.server
    model = evaluated_models(ctx, ctx.client(0))[""].state_dict()
    assert_close(model, ctx.server["global"], atol=0)


# -- lost uploads -----------------------------------------------------------------------------------


def test_a_lost_upload_leaves_its_statistics_out_of_the_pooling():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 1, i, p)]
    assert 0 < len(lost) < 4
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    broadcast = {k: t.clone() for k, t in ctx.server["global"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    arrived = [i for i in ctx.participants if i not in lost]
    pooled = pool_statistics([uploads[i]["statistics"] for i in arrived])
    x, y = virtual_representations(pooled, 30, torch_generator(0, "ccvr:virtual", 1))
    assert_close(ctx.server["calibrated"], reference_classifier(broadcast, x, y, 0.1, 10, 1, 0, 1), HEAD, atol=1e-5)


def test_a_round_without_statistics_keeps_the_previous_calibrated_model():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    calibrated = {k: t.clone() for k, t in ctx.server["calibrated"].items()}
    original = ctx.hooks.client_upload

    def without_statistics(**kw):  # every class seen by nobody: nothing to pool
        return {**original(**kw), "statistics": {"counts": {}, "means": {}, "covariances": {}}}

    ctx.hooks.client_upload = without_statistics
    engine.run_round(ctx, 2)
    assert far_apart(ctx.server["global"], calibrated, BODY)  # FedAvg moved on
    assert_close(ctx.server["calibrated"], calibrated, atol=0)


# -- bit identity: process executor, resume ----------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5},
                                       {"algorithm.params.server_epochs": 2,
                                        "model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial", "epochs-batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("ccvr", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "ccvr", "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


def test_a_run_ends_and_a_newcomer_is_scored():
    result, _ = run_tiny(**{**BASE, "experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("sample_per_class", 0), ("server_lr", 0.0), ("server_lr", float("inf")),
                                       ("server_epochs", 0), ("server_batch_size", 0), ("sample_per_class", 1.5),
                                       ("server_lr", "1")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_defaults_are_fl_benchs():
    p = CCVRParams()
    assert (p.sample_per_class, p.server_lr, p.server_epochs, p.server_batch_size) == (200, None, 1, None)
