"""FedPCL (plugins/fedpcl): round 1 trains nobody and uploads the initial model's prototypes
(normalised class means, recomputed by hand); the server's unweighted mean and its per-client
store past round 2; the local loss L_g + L_p written out (softmax over class prototypes,
temperature, padding with the global prototype, the gradient clipping); what is evaluated (the
client's own prototypes, the global one for unseen classes); lost uploads; cold start; process
executor and resume bit-identical; bad input."""

import os

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    far_apart,
    fresh_model,
    prepared,
    random_images,
    record_messages,
    refused_at_key,
    shrink,
    train_reference,
)
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny

from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedpcl import FedPCLParams

BASE = {"algorithm.name": "fedpcl", "model.params.hidden": [8], "experiment.rounds": 3}
HALF = {**BASE, "experiment.participation": 0.5}  # rounds 1-2: clients 2, 3; round 3: clients 0, 1
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


def rep(state, x):
    """r(x) = relu(fc1(x)) / ||relu(fc1(x))||, by hand (mlp, one hidden layer)."""
    h = torch.relu(x.flatten(1) @ state["fc1.weight"].T + state["fc1.bias"])
    return h / h.norm(dim=1, keepdim=True)


def class_means(state, x, y):
    r = rep(state, x)
    return {int(c): r[y == c].mean(0) for c in y.unique()}


def cross_entropy_by_hand(r, table, target, tau):
    """mean over rows of log sum_c exp(r . T_c / tau) - r . T_y / tau."""
    logits = r @ table.T / tau
    return (torch.logsumexp(logits, dim=1) - logits[torch.arange(len(target)), target]).mean()


def pcl_loss(global_protos, local_protos, tau, with_local=True):
    """L_g + mean_j L_p(j) over the samples whose class has a global prototype; P_j's missing
    classes are G's."""
    classes = sorted(global_protos)

    def loss(model, x, y, logits):
        h = torch.relu(model.fc1(x.flatten(1)))
        r = h / h.norm(dim=1, keepdim=True)
        keep = torch.tensor([int(c) in global_protos for c in y])
        if not keep.any():
            return r.sum() * 0
        r, target = r[keep], torch.tensor([classes.index(int(c)) for c in y[keep]])
        total = cross_entropy_by_hand(r, torch.stack([global_protos[c] for c in classes]), target, tau)
        if with_local and local_protos:
            tables = [torch.stack([p.get(c, global_protos[c]) for c in classes]) for p in local_protos]
            total = total + sum(cross_entropy_by_hand(r, t, target, tau) for t in tables) / len(tables)
        return total

    return loss


class ClippedSGD(torch.optim.SGD):
    """Plain SGD whose step first clips the gradient norm of all its parameters to ``clip``."""

    def __init__(self, params, lr, clip):
        super().__init__(params, lr=lr)
        self.clip = clip

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.clip)
        return super().step(closure)


def reference(ctx, i, start, loss_fn, clip=None):
    if clip is None:
        return train_reference(ctx, i, start, loss_fn=loss_fn)
    model = fresh_model(ctx, start)
    ctx.client(i).train(model=model, optimizer=ClippedSGD(model.parameters(), ctx.spec.training.lr, clip),
                        loss_fn=loss_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- round 1: prototypes of the initial models ---------------------------------------------------------


def test_round_one_trains_nobody_and_the_global_prototypes_are_the_unweighted_mean():
    engine, ctx = prepared(**BASE)
    shrink(ctx, {0: 30})  # clients 0 and 2 hold class 0, with 30 and 84 samples
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        assert_close(ctx.store[i]["weights"], initial, atol=0)  # no prototypes yet: no training
        data = ctx.data.clients[i]
        expected = class_means(initial, data.train_x, data.train_y)
        assert set(uploads[i]["prototypes"]) == set(expected)
        assert_close(uploads[i]["prototypes"], expected, atol=1e-6)
        assert_close(ctx.server["local"][i], expected, atol=1e-6)
    p0, p2 = uploads[0]["prototypes"][0], uploads[2]["prototypes"][0]
    assert torch.allclose(ctx.server["global"][0], (p0 + p2) / 2, atol=1e-6)
    assert not torch.allclose(ctx.server["global"][0], (30 * p0 + 84 * p2) / 114, atol=1e-4)
    assert sorted(ctx.server["global"]) == [0, 2, 4, 7, 8, 9]


# -- the local loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.07, 1.0])
def test_a_participant_trains_on_the_global_and_the_local_prototype_contrast(tau):
    engine, ctx = prepared(**{**BASE, "algorithm.params.tau": tau, "algorithm.params.clip_norm": None})
    engine.run_round(ctx, 1)
    global_protos = dict(ctx.server["global"])
    local_protos = [ctx.server["local"][j] for j in range(4)]
    broadcasts = record_messages(ctx, "on_broadcast")
    engine.run_round(ctx, 2)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        assert_close(broadcasts[i]["global"], global_protos, atol=0)
        trained = reference(ctx, i, initial, pcl_loss(global_protos, local_protos, tau))
        assert_close(ctx.store[i]["weights"], trained, atol=1e-5)
        assert_close(ctx.store[i]["weights"], initial, HEAD, atol=0)  # the classifier is unused
        assert far_apart(trained, initial, BODY)
        without_local = reference(ctx, i, initial, pcl_loss(global_protos, local_protos, tau, with_local=False))
        assert far_apart(trained, without_local, BODY)


def test_the_gradient_norm_is_clipped_before_each_step():
    engine, ctx = prepared(**{**BASE, "algorithm.params.clip_norm": 0.05})
    engine.run_round(ctx, 1)
    loss = pcl_loss(dict(ctx.server["global"]), [ctx.server["local"][j] for j in range(4)], 0.07)
    engine.run_round(ctx, 2)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        clipped = reference(ctx, i, initial, loss, clip=0.05)
        assert_close(ctx.store[i]["weights"], clipped, atol=1e-5)
        assert far_apart(clipped, reference(ctx, i, initial, loss), BODY)


def test_past_round_two_the_store_keeps_each_clients_latest_and_global_classes_persist():
    engine, ctx = prepared(**HALF)
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    round2 = {j: dict(ctx.server["local"][j]) for j in (2, 3)}
    global2 = dict(ctx.server["global"])
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 3)
    assert ctx.participants == [0, 1]
    initial = ctx.models.initial_state("mlp")
    assert_close(ctx.store[1]["weights"], initial, atol=0)  # its classes 7, 9 have no prototype yet
    assert far_apart(ctx.store[0]["weights"], initial, BODY)
    for i in (0, 1):  # from the initial model against round 2's prototypes
        assert_close(broadcasts[i]["global"], global2, atol=0)
        assert len(broadcasts[i]["local"]) == 2
        expected = reference(ctx, i, ctx.models.initial_state("mlp"), pcl_loss(global2, [round2[2], round2[3]], 0.07))
        assert_close(ctx.store[i]["weights"], expected, atol=1e-5)
        assert_close(uploads[i]["prototypes"], class_means(expected, ctx.data.clients[i].train_x,
                                                           ctx.data.clients[i].train_y), atol=1e-5)
    assert sorted(ctx.server["local"]) == [0, 1, 2, 3]
    assert_close(ctx.server["local"][2], round2[2], atol=0)  # not in round 3: kept
    # class 0 this round: client 0 alone (client 2's stale prototype is not averaged in)
    assert torch.allclose(ctx.server["global"][0], uploads[0]["prototypes"][0], atol=0)
    assert not torch.allclose(ctx.server["global"][0], global2[0], atol=1e-4)
    for c in (2, 4, 8):  # nobody reported them this round: round 2's kept
        assert torch.equal(ctx.server["global"][c], global2[c])
    for c in (7, 9):
        assert torch.equal(ctx.server["global"][c], uploads[1]["prototypes"][c])


# -- what is evaluated ---------------------------------------------------------------------------------


@pytest.mark.parametrize("unseen_from_global", [True, False])
def test_each_client_is_scored_by_its_own_prototypes(unseen_from_global):
    engine, ctx = prepared(**{**HALF, "algorithm.params.unseen_from_global": unseen_from_global})
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    global_protos = ctx.server["global"]
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        state = ctx.store[i].get("weights") or initial
        data = ctx.data.clients[i]
        own = class_means(state, data.train_x, data.train_y)
        model = evaluated_models(ctx, ctx.client(i))[""]
        with torch.no_grad():
            out = model(data.test_x)
        r = rep(state, data.test_x)
        for c in range(10):
            if c in own:
                expected = r @ own[c]
            elif c in global_protos and unseen_from_global:
                expected = r @ global_protos[c]
            else:
                expected = torch.full((len(r),), -1e9)
            assert torch.allclose(out[:, c], expected, atol=1e-5), (i, c)


# -- lost uploads, cold start --------------------------------------------------------------------------


def test_a_lost_upload_is_neither_stored_nor_averaged_and_the_client_keeps_its_training():
    p = 0.5
    lost1 = [i for i in range(4) if upload_is_lost(0, 1, i, p)]
    lost2 = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost2) < 4
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    assert sorted(ctx.server["local"]) == [i for i in range(4) if i not in lost1]
    before = {j: dict(v) for j, v in ctx.server["local"].items()}
    global1 = dict(ctx.server["global"])
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    arrived = [i for i in range(4) if i not in lost2]
    for j in range(4):
        if j in lost2:
            assert j not in ctx.server["local"] or all(torch.equal(ctx.server["local"][j][c], before[j][c]) for c in before[j])
        else:
            assert_close(ctx.server["local"][j], uploads[j]["prototypes"], atol=0)
    for c, before_c in global1.items():
        reports = [uploads[i]["prototypes"][c] for i in arrived if c in uploads[i]["prototypes"]]
        expected = torch.stack(reports).mean(0) if reports else before_c
        assert torch.allclose(ctx.server["global"][c], expected, atol=1e-6)
    initial = ctx.models.initial_state("mlp")
    for i in lost2:  # its model keeps the round's training
        assert far_apart(ctx.store[i]["weights"], initial, BODY)


def test_a_round_whose_uploads_are_all_lost_keeps_the_prototypes_empty():
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 1.0}}])
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    assert ctx.server["global"] == {} and ctx.server["local"] == {}
    initial = ctx.models.initial_state("mlp")
    for i in range(4):  # nobody could train without prototypes
        assert_close(ctx.store[i]["weights"], initial, atol=0)


def test_a_cold_start_client_trains_against_the_final_prototypes():
    result, engine = run_tiny(**{**BASE, "experiment.coldstart_clients": 1})
    ctx = engine.ctx
    (newcomer,) = ctx.coldstart_clients
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    assert_close(message["global"], ctx.server["global"], atol=0)
    assert len(message["local"]) == len(ctx.server["local"]) > 0
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- models ---------------------------------------------------------------------------------------------


def test_architectures_share_prototypes_only_at_one_representation_width(tmp_path):
    raw = random_images(tmp_path, "fedpcl")
    result, engine = run_tiny(**raw, **{"model.pool": ["lenet5", "cnn2"],
                                        "model.arch_params": {"cnn2": {"width": 84 / 512}}})
    assert not result.errors and engine.ctx.server["global"][0].shape == (84,)
    with pytest.raises(SpecError) as info:
        run_tiny(**raw, **{"model.pool": ["lenet5", "cnn2"], "model.arch_params": {"cnn2": {"width": 0.25}}})
    assert info.value.path == "model.pool" and "same width" in info.value.message


def test_a_single_layer_model_is_refused():
    with pytest.raises(SpecError) as info:
        run_tiny(**{**BASE, "model.params.hidden": []})
    assert info.value.path == "model.name" and "single layer" in info.value.message


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5,
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]},
                                       {"model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial-dropout", "batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("fedpcl", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedpcl", "experiment.participation": 0.5,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("tau", 0.0), ("tau", -1.0), ("tau", float("inf")), ("tau", "1"),
                                       ("clip_norm", 0.0), ("clip_norm", float("nan")),
                                       ("unseen_from_global", "yes")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_defaults():
    p = FedPCLParams()
    assert (p.tau, p.clip_norm, p.unseen_from_global) == (0.07, 10.0, True)
