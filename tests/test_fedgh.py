"""FedGH (plugins/fedgh): each participant trains its own extractor under the global header and
uploads its per-class mean representations (recomputed by hand); the server's header training
(mini-batch SGD on the received pairs, cross-entropy's gradient written out, its shuffle, epochs
and batch size); what is evaluated; heterogeneous extractors sharing one header; lost uploads;
cold start; process executor and resume bit-identical; bad input."""

import os

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, far_apart, prepared, random_images, record_messages, refused_at_key, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny

from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.seeding import torch_generator
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedgh import FedGHParams

BASE = {"algorithm.name": "fedgh", "model.params.hidden": [8], "experiment.rounds": 3,
        "algorithm.params.server_lr": 0.5}
HEAD = ["fc2.weight", "fc2.bias"]


def as_fc2(header):
    return {"fc2.weight": header["weight"], "fc2.bias": header["bias"]}


def class_means(state, x, y):
    """{c: mean of relu(fc1(x)) over the samples of class c}, by hand (mlp, hidden = [8])."""
    h = torch.relu(x.flatten(1) @ state["fc1.weight"].T + state["fc1.bias"])
    return {int(c): h[y == c].mean(0) for c in y.unique()}


def reference_header(header, pairs, lr, batch, epochs, seed, round_):
    """Mini-batch SGD on cross-entropy(W r + b, c): grad_W = (softmax - onehot)^T R / B, written
    out, over ``pairs`` (participant order, classes ascending) shuffled by the server's generator."""
    w, b = header["weight"].double().clone(), header["bias"].double().clone()
    x = torch.stack([r for r, _ in pairs]).double()
    y = torch.tensor([c for _, c in pairs])
    generator = torch_generator(seed, "fedgh:header", round_)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch):
            rows = order[start:start + batch]
            p = torch.softmax(x[rows] @ w.T + b, dim=1)
            p[torch.arange(len(rows)), y[rows]] -= 1
            w, b = w - lr * p.T @ x[rows] / len(rows), b - lr * p.sum(0) / len(rows)
    return {"weight": w.float(), "bias": b.float()}


# -- a round, recomputed ----------------------------------------------------------------------------


def test_each_participant_trains_its_extractor_under_the_global_header_and_uploads_class_means():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    header = {k: t.clone() for k, t in ctx.server["header"].items()}
    own = {i: dict(ctx.store[i]["weights"]) for i in range(4)}  # round 1's extractor and header
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        assert_close(broadcasts[i]["header"], header, atol=0)
        assert far_apart(own[i], initial, ["fc1.weight"]) and far_apart(own[i], as_fc2(header), HEAD)
        start = {**own[i], **as_fc2(header)}  # its own extractor, the global header
        trained = train_reference(ctx, i, start)
        assert_close(ctx.store[i]["weights"], trained, atol=1e-6)
        data = ctx.data.clients[i]
        expected = class_means(trained, data.train_x, data.train_y)
        assert set(uploads[i]["representations"]) == set(expected)
        assert_close(uploads[i]["representations"], expected, atol=1e-5)


def test_the_server_trains_the_header_by_minibatch_sgd_on_every_received_pair():
    params = {"server_lr": 0.7, "server_epochs": 2, "server_batch_size": 3}
    engine, ctx = prepared(**{**BASE, **{f"algorithm.params.{k}": v for k, v in params.items()}})
    engine.run_round(ctx, 1)
    header = {k: t.clone() for k, t in ctx.server["header"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    pairs = [(uploads[i]["representations"][c], c) for i in ctx.participants for c in sorted(uploads[i]["representations"])]
    assert len(pairs) > 3 and len(pairs) % 3  # several batches, the last one short
    expected = reference_header(header, pairs, 0.7, 3, 2, 0, 2)
    assert_close(ctx.server["header"], expected, atol=1e-5)
    one_epoch = reference_header(header, pairs, 0.7, 3, 1, 0, 2)
    assert far_apart(expected, one_epoch, ["weight"])
    full_batch = reference_header(header, pairs, 0.7, len(pairs), 2, 0, 2)
    assert far_apart(expected, full_batch, ["weight"])


def test_the_default_batch_is_the_clients_batch_size_and_the_rate_is_server_lr():
    engine, ctx = prepared(**BASE, **{"training.batch_size": 4})
    header = {k: t.clone() for k, t in ctx.server["header"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    pairs = [(uploads[i]["representations"][c], c) for i in ctx.participants for c in sorted(uploads[i]["representations"])]
    assert_close(ctx.server["header"], reference_header(header, pairs, 0.5, 4, 1, 0, 1), atol=1e-5)
    assert far_apart(ctx.server["header"], reference_header(header, pairs, 0.5, 10, 1, 0, 1), ["weight"])


def test_the_header_starts_as_the_initial_classifier():
    _, ctx = prepared(**BASE)
    initial = ctx.models.initial_state("mlp")
    assert_close(as_fc2(ctx.server["header"]), initial, HEAD, atol=0)


# -- what is evaluated ------------------------------------------------------------------------------------


def test_each_client_is_evaluated_with_its_own_extractor_and_the_current_header():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    initial = ctx.models.initial_state("mlp")
    header = as_fc2(ctx.server["header"])
    assert far_apart(header, initial, HEAD)
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        extractor = ctx.store[i].get("weights") or initial  # an idle client: the initial extractor
        assert_close(model, extractor, ["fc1.weight", "fc1.bias"], atol=0)
        assert_close(model, header, HEAD, atol=0)
        if ctx.store[i].get("weights"):
            assert far_apart(model, ctx.store[i]["weights"], HEAD)  # not the header it trained


# -- heterogeneous extractors --------------------------------------------------------------------------------


def test_different_extractors_share_one_header_and_mismatched_headers_are_refused(tmp_path):
    raw = random_images(tmp_path, "fedgh")
    narrow = {"cnn2": {"width": 84 / 512}}  # fc1 gives 84 features, as LeNet-5's
    result, engine = run_tiny(**raw, **{"model.pool": ["lenet5", "cnn2"], "model.arch_params": narrow})
    assert [row["arch"] for row in result.client_rows] == ["lenet5", "cnn2", "lenet5", "cnn2"] and not result.errors
    ctx = engine.ctx
    assert ctx.server["header"]["weight"].shape == (10, 84)
    assert ctx.store[0]["weights"]["conv1.weight"].shape != ctx.store[1]["weights"]["conv1.weight"].shape
    with pytest.raises(SpecError) as info:
        run_tiny(**raw, **{"model.pool": ["lenet5", "cnn2"], "model.arch_params": {"cnn2": {"width": 0.25}}})
    assert info.value.path == "model.pool" and "same shapes" in info.value.message


# -- lost uploads, cold start ---------------------------------------------------------------------------


def test_a_lost_upload_leaves_its_pairs_out_and_the_client_keeps_its_extractor():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 1, i, p)]
    assert 0 < len(lost) < 4
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    header = {k: t.clone() for k, t in ctx.server["header"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    arrived = [i for i in ctx.participants if i not in lost]
    pairs = [(uploads[i]["representations"][c], c) for i in arrived for c in sorted(uploads[i]["representations"])]
    assert_close(ctx.server["header"], reference_header(header, pairs, 0.5, 10, 1, 0, 1), atol=1e-5)
    initial = ctx.models.initial_state("mlp")
    for i in lost:  # its extractor keeps the round's training
        assert far_apart(ctx.store[i]["weights"], initial, ["fc1.weight"])


def test_a_round_whose_uploads_are_all_lost_keeps_the_header():
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 1.0}}])
    header = {k: t.clone() for k, t in ctx.server["header"].items()}
    engine.run_round(ctx, 1)
    assert_close(ctx.server["header"], header, atol=0)


def test_a_cold_start_client_trains_from_the_initial_extractor_under_the_final_header():
    result, engine = run_tiny(**{**BASE, "experiment.coldstart_clients": 1})
    ctx = engine.ctx
    (newcomer,) = ctx.coldstart_clients
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    assert_close(message["header"], ctx.server["header"], atol=0)
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5},
                                       {"algorithm.params.server_epochs": 2,
                                        "model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial", "epochs-batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("fedgh", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedgh", "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("server_lr", 0.0), ("server_lr", float("inf")), ("server_epochs", 0),
                                       ("server_batch_size", 0), ("server_epochs", 1.5), ("server_lr", "1")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_defaults_are_pfllibs():
    p = FedGHParams()
    assert (p.server_lr, p.server_epochs, p.server_batch_size) == (1.0, 1, None)
