"""FedAH (plugins/fedah): the Aggregated Head (S1) by hand, the W step (S2) recomputed on one full
batch, the first round from the global model, head then body training each with the other part
frozen, W and the head carried across rounds (round 3), FedAvg's server over whole models, which
model is evaluated, lost uploads, bad input, the process executor and a killed run's resume."""

import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    fresh_model,
    linear,
    mean_of,
    prepared,
    recorded_training,
    refused_at_key,
)
from test_checkpoint import (
    empty_store,
)
from tiny import tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedah import AggregatedHead, ClippedWeightSGD, FedAH, FedAHParams, aggregate_head

assert empty_store  # the fixture used by the resume test (imported, not called)

BASE = {"algorithm.name": "fedah", "model.params.hidden": [8], "experiment.rounds": 3}
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- (S1) by hand ----------------------------------------------------------------------------------


def test_the_aggregated_head_by_hand():
    glob = {"b": torch.tensor([5.0, -2.0]), "h": torch.tensor([3.0, 0.0, 4.0]), "hbuf": torch.tensor([9.0])}
    head = {"h": torch.tensor([1.0, 1.0, 4.0]), "hbuf": torch.tensor([7.0])}
    W = {"h": torch.tensor([0.5, 0.25, 1.0])}
    out = aggregate_head(glob, head, W)
    assert torch.equal(out["b"], glob["b"])  # the body: the global model
    # h: 1 + (3 - 1) 0.5 = 2, 1 + (0 - 1) 0.25 = 0.75, 4 + 0 = 4
    assert torch.allclose(out["h"], torch.tensor([2.0, 0.75, 4.0]))
    assert torch.equal(out["hbuf"], head["hbuf"])  # a head buffer stays the client's own
    assert torch.equal(aggregate_head(glob, head, {"h": torch.ones(3)})["h"], glob["h"])
    assert torch.equal(aggregate_head(glob, head, {"h": torch.zeros(3)})["h"], head["h"])


def test_the_weight_step_is_plain_sgd_clipped_to_the_unit_interval():
    W = torch.nn.Parameter(torch.tensor([0.9, 0.1, 0.5, 0.0]))
    W.grad = torch.tensor([-1.0, 1.0, 0.2, 0.0])
    ClippedWeightSGD([W], lr=0.5).step()
    # 0.9 + 0.5 = 1.4 -> 1;  0.1 - 0.5 -> 0;  0.5 - 0.1 = 0.4;  0 stays 0
    assert torch.allclose(W.detach(), torch.tensor([1.0, 0.0, 0.4, 0.0]))


def test_the_gradient_of_w_is_the_heads_gradient_times_global_minus_own_head():
    model = linear([0.0, 0.0], [0.0])  # the whole model is the head here: weight, bias
    head = {"weight": torch.tensor([[1.0, 1.0]]), "bias": torch.tensor([0.0])}
    glob = {"weight": torch.tensor([[3.0, 0.0]]), "bias": torch.tensor([2.0])}
    module = AggregatedHead(model, glob, head, {k: torch.full_like(v, 0.5) for k, v in head.items()})
    x = torch.tensor([[1.0, 2.0]])
    out = module(x)  # h-hat = (2, 0.5), 1: 2 + 1 + 1 = 4
    assert torch.allclose(out, torch.tensor([[4.0]]))
    out.sum().backward()  # dL/dw = x = (1, 2), dL/db = 1; times (global - head) = (2, -1), 2
    grads = dict(zip(module.names, (w.grad for w in module.W)))
    assert torch.allclose(grads["weight"], torch.tensor([[2.0, -2.0]])) and torch.allclose(grads["bias"],
                                                                                           torch.tensor([2.0]))


def test_local_work_counts_weight_head_and_body_epochs():
    spec = resolve(tiny_raw(**BASE, **{"training.local_epochs": 3})).spec
    assert FedAH(FedAHParams(weight_epochs=2, head_epochs=4)).local_work(spec).private_epochs_per_round == 9.0


# -- the rounds ------------------------------------------------------------------------------------


def phases(calls, client):
    """This client's (kind, call) in order: "W" (S2), "head" (S3), "body" (S4)."""
    out = []
    for call in calls:
        if call["client"] != client:
            continue
        if isinstance(call["model"], AggregatedHead):
            out.append(("W", call))
        elif call["trainable"] == set(HEAD):
            out.append(("head", call))
        elif call["trainable"] == set(BODY):
            out.append(("body", call))
        else:
            out.append(("other", call))
    return out


def test_round_one_starts_from_the_global_model_and_trains_head_then_body(monkeypatch):
    engine, ctx = prepared(**BASE, **{"algorithm.params.head_epochs": 2, "training.local_epochs": 1})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    for i in range(4):
        kinds = phases(calls, i)
        assert [k for k, _ in kinds] == ["head", "body"]  # no W learning without a head of its own
        head, body = kinds[0][1], kinds[1][1]
        assert head["epochs"] == 2 and body["epochs"] == 1
        assert_same(head["before"], start)
        assert_same(head["after"], body["before"])
        assert_same(body["after"], body["before"], HEAD)  # the head is frozen in S4
        assert far_apart(body["after"], body["before"], BODY)
        assert_same(ctx.store[i]["head"], head["after"], HEAD)  # h_i: the head after S3
        assert all(torch.equal(w, torch.ones_like(w)) for w in ctx.store[i]["W"].values())
        assert list(ctx.store[i]["W"]) == HEAD


def test_the_server_averages_the_whole_trained_models(monkeypatch):
    engine, ctx = prepared(**BASE)
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    finals = {i: phases(calls, i)[-1][1]["after"] for i in range(4)}
    sizes = {i: ctx.client(i).num_train for i in range(4)}
    total = sum(sizes.values())
    assert_close(ctx.server["global"], mean_of((sizes[i] / total, finals[i]) for i in range(4)), atol=1e-6)


def test_the_weight_step_on_one_full_batch_by_hand(monkeypatch):
    """With one batch holding all of a client's data, S2 from W = 1 is one step at the global
    model: W = clip(1 - eta grad_h L(global) (.) (h - h_i))."""
    eta = 3.0
    engine, ctx = prepared(**BASE, **{"training.batch_size": 1000, "algorithm.params.eta": eta})
    engine.run_round(ctx, 1)
    glob = {k: v.clone() for k, v in ctx.server["global"].items()}
    heads = {i: {k: v.clone() for k, v in ctx.store[i]["head"].items()} for i in range(4)}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    moved = False
    for i in range(4):
        model = fresh_model(ctx, glob)
        data = ctx.client(i).data
        F.cross_entropy(model(data.train_x), data.train_y).backward()
        grads = dict(model.named_parameters())
        expected = {k: (1.0 - eta * grads[k].grad * (glob[k] - heads[i][k])).clamp(0.0, 1.0) for k in HEAD}
        assert_close(ctx.store[i]["W"], expected, atol=1e-5)
        moved |= far_apart(ctx.store[i]["W"], {k: torch.ones_like(v) for k, v in expected.items()}, HEAD)
        # S3 starts from (S1) with the learned W: the global body, the aggregated head
        head_call = next(c for k, c in phases(calls, i) if k == "head")
        assert_same(head_call["before"], glob, BODY)
        assert_close(head_call["before"], aggregate_head(glob, heads[i], ctx.store[i]["W"]), HEAD, atol=1e-6)
    assert moved  # the step is not trivially zero


def test_w_and_the_head_carry_over_to_round_three(monkeypatch):
    """Round 3 starts W-learning from the W of round 2 (not from ones) and mixes the head of round 2."""
    engine, ctx = prepared(**BASE, **{"algorithm.params.eta": 1e-7})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    for i in range(4):  # as if round 2 had learned 0.3 everywhere
        ctx.store[i]["W"] = {k: torch.full_like(w, 0.3) for k, w in ctx.store[i]["W"].items()}
    heads = {i: {k: v.clone() for k, v in ctx.store[i]["head"].items()} for i in range(4)}
    glob = {k: v.clone() for k, v in ctx.server["global"].items()}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 3)
    for i in range(4):
        for w in ctx.store[i]["W"].values():  # a tiny step from 0.3
            assert torch.allclose(w, torch.full_like(w, 0.3), atol=1e-4)
        head_call = next(c for k, c in phases(calls, i) if k == "head")
        expected = aggregate_head(glob, heads[i], {k: torch.full_like(glob[k], 0.3) for k in HEAD})
        assert_close(head_call["before"], expected, HEAD, atol=1e-4)
        assert far_apart(head_call["before"], glob, HEAD) and far_apart(head_call["before"], heads[i], HEAD)


def test_evaluation_is_the_aggregated_head_or_the_global_model_without_a_head():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    glob = ctx.server["global"]
    assert any("head" in ctx.store[i] for i in range(4))
    mixed = []
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        state = ctx.store[i]
        if "head" not in state:
            assert_same(model, glob)
            continue
        assert_same(model, glob, BODY)
        assert_close(model, aggregate_head(glob, state["head"], state["W"]), HEAD)
        if far_apart(state["W"], {k: torch.ones_like(w) for k, w in state["W"].items()}, HEAD):
            mixed.append(i)  # W learned: the evaluated head is neither the global one nor h_i
            assert far_apart(model, glob, HEAD) and far_apart(model, state["head"], HEAD)
    assert mixed


def test_a_lost_upload_keeps_the_clients_own_head_and_weights(monkeypatch):
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 0.5}}])
    lost = []
    for r in (1, 2, 3):
        with recorded_training(monkeypatch) as calls:
            engine.run_round(ctx, r)
        lost += [(r, i) for i in range(4) if upload_is_lost(ctx.spec.experiment.seed, r, i, 0.5)]
        for i in range(4):  # every client that trained keeps its trained head, lost upload or not
            assert_same(ctx.store[i]["head"], [c for k, c in phases(calls, i) if k == "head"][-1]["after"], HEAD)
        if r > 1:
            assert all(0.0 <= float(w.min()) and float(w.max()) <= 1.0
                       for i in range(4) for w in ctx.store[i]["W"].values())
    assert [i for r, i in lost if r < 3]  # some upload was lost before the last round


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("eta", 0.0), ("eta", float("nan")), ("weight_epochs", -1),
                                            ("head_epochs", -1), ("head_layers", 0), ("weight_epochs", 1.5)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_a_head_without_a_body_is_refused_at_its_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"algorithm.params.head_layers": 2}))
    assert info.value.path == "algorithm.params.head_layers" and info.value.message.startswith("is 2, but mlp has 2 parameterised layer(s)")


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.eta": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.eta") and "> 0" in line


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedah", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fedah", "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
