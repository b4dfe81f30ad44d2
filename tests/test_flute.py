"""FLUTE (plugins/flute): the simplex target, the neural-collapse distance and the server's head
step by hand; three engine rounds under partial participation recomputed independently (head-only
epochs then joint epochs with the feature-norm term, the sample-weighted body, each arrived head
stepped with server_lr / |A|, and the next round starting from the stepped head: an idle client
comes back to its own); what is evaluated; the zero-regulariser setting is FedPer bit for bit;
lost uploads; bytes; bad input; process executor and resume bit-identical."""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    prepared,
    recorded_training,
    shrink,
    train_reference,
)
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.flute import FluteParams, collapse_distance, server_head_step, simplex_target

BASE = {"algorithm.name": "flute", "model.params.hidden": [8], "training.local_epochs": 2,
        "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]  # mlp [8]: fc2 is the classifier
C = 10  # the synthetic data's classes


# -- the pieces by hand ------------------------------------------------------------------------------


def test_the_simplex_target_covers_only_the_clients_classes():
    target = simplex_target(torch.tensor([True, True, False]))
    s = math.sqrt(2)  # sqrt(C - 1), C = 3
    expected = [[2 / 3 / s, -1 / 3 / s, 0.0], [-1 / 3 / s, 2 / 3 / s, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(target, torch.tensor(expected), atol=1e-7)
    full = simplex_target(torch.ones(4, dtype=torch.bool))  # every class: unit Frobenius norm
    assert torch.linalg.matrix_norm(full).item() == pytest.approx(1.0, abs=1e-6)


def test_a_simplex_etf_head_has_zero_collapse_distance_and_the_identity_does_not():
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3])
    etf = 5.0 * torch.stack([angles.cos(), angles.sin()], dim=1)  # 3 rows at 120 degrees, any scale
    everyone = torch.ones(3, dtype=torch.bool)
    assert collapse_distance(etf, simplex_target(everyone)).item() == pytest.approx(0.0, abs=1e-6)
    # W = I_3: W W^T / ||.||_F = I / sqrt(3); the target (I - J/3) / sqrt(2)
    diag, off = 1 / math.sqrt(3) - (2 / 3) / math.sqrt(2), (1 / 3) / math.sqrt(2)
    expected = math.sqrt(3 * diag ** 2 + 6 * off ** 2)
    assert collapse_distance(torch.eye(3), simplex_target(everyone)).item() == pytest.approx(expected, abs=1e-6)
    # only classes 0 and 1 held: rows 0 and 1 at 180 degrees, row 2 zero, still not the target's norm
    u = torch.tensor([True, True, False])
    w = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    t = (2 / 3) / math.sqrt(2)
    g = 0.5  # W W^T = [[1, -1], [-1, 1]] / 2 after normalising
    expected = math.sqrt(2 * (g - t) ** 2 + 2 * (g - t / 2) ** 2)
    assert collapse_distance(w, simplex_target(u)).item() == pytest.approx(expected, abs=1e-6)


def reference_distance(w: np.ndarray, u: np.ndarray) -> float:
    """NC(W, u) in float64 numpy, written out entry by entry."""
    c = len(u)
    gram = w @ w.T
    gram = gram / math.sqrt((gram ** 2).sum())
    total = 0.0
    for a in range(c):
        for b in range(c):
            centred = (1.0 if a == b else 0.0) - 1.0 / c
            total += (gram[a, b] - centred * u[a] * u[b] / math.sqrt(c - 1)) ** 2
    return math.sqrt(total)


def test_the_server_step_is_a_gradient_step_on_the_collapse_distance():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3))
    u = np.array([1.0, 0.0, 1.0, 1.0])
    step = 0.3
    numeric = np.zeros_like(w)  # central differences of the float64 reference
    for idx in np.ndindex(*w.shape):
        plus, minus = w.copy(), w.copy()
        plus[idx] += 1e-6
        minus[idx] -= 1e-6
        numeric[idx] = (reference_distance(plus, u) - reference_distance(minus, u)) / 2e-6
    stepped = server_head_step(torch.tensor(w, dtype=torch.float32), torch.tensor(u > 0), step)
    assert np.allclose(stepped.numpy(), w - step * numeric, atol=1e-5)
    assert np.abs(step * numeric).max() > 1e-2  # the step moves it (a dropped step would fail)
    assert reference_distance(stepped.double().numpy(), u) < reference_distance(w, u)  # downhill


# -- three rounds recomputed ---------------------------------------------------------------------------


def classes_held(ctx, i) -> torch.Tensor:
    return torch.as_tensor(np.bincount(np.asarray(ctx.data.clients[i].train_y), minlength=C) > 0)


def reference_train(ctx, i, start, p: FluteParams):
    """(C1) head-only epochs, then (C2) joint epochs, from ``start``: the trained state."""
    target = simplex_target(classes_held(ctx, i))

    def regularised(m, y, logits):
        w = m.fc2.weight
        gram = w @ w.T
        nc = ((gram / gram.pow(2).sum().sqrt() - target) ** 2).sum().sqrt()
        return F.cross_entropy(logits, y) + p.lam1 * nc + p.lam2 * (w ** 2).sum()

    def head_loss(m, x, y, logits):
        return regularised(m, y, logits)

    def joint_loss(m, x, y, logits):
        features = F.relu(m.fc1(x.flatten(1)))  # the classifier's input, recomputed
        return regularised(m, y, logits) + p.lam3 * (features ** 2).sum()

    epochs = ctx.spec.training.local_epochs
    state = start
    if epochs - p.rep_epochs:
        state = train_reference(ctx, i, state, trainable=HEAD, epochs=epochs - p.rep_epochs, loss_fn=head_loss)
    return train_reference(ctx, i, state, epochs=p.rep_epochs, loss_fn=joint_loss)


def reference_step(weight, labels, step):
    w = weight.detach().double().clone().requires_grad_(True)
    u = labels.double()
    c = len(u)
    target = (torch.eye(c, dtype=torch.float64) - 1.0 / c) * torch.outer(u, u) / math.sqrt(c - 1)
    gram = w @ w.T
    ((gram / gram.pow(2).sum().sqrt() - target) ** 2).sum().sqrt().backward()
    return (w - step * w.grad).float().detach()


def test_three_rounds_with_partial_participation_recomputed():
    p = FluteParams(lam1=0.5, lam2=0.01, lam3=0.01, rep_epochs=1, server_lr=2.0)
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.75, "algorithm.params": {
        "lam1": p.lam1, "lam2": p.lam2, "lam3": p.lam3, "rep_epochs": p.rep_epochs, "server_lr": p.server_lr}})
    shrink(ctx, {0: 40, 1: 60, 2: 84, 3: 70})  # unequal sizes: the body's weights are not uniform
    initial = {k: v.clone() for k, v in ctx.models.initial_state("mlp").items()}
    body = {k: initial[k].clone() for k in BODY}
    heads = {}  # the server's stepped W_i
    biases = {}  # each client's own classifier bias
    came_back, last_participants = False, []
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        participants = list(ctx.participants)
        assert len(participants) == 3
        trained = {}
        for i in participants:
            start = {**body, "fc2.weight": heads.get(i, initial["fc2.weight"]),
                     "fc2.bias": biases.get(i, initial["fc2.bias"])}
            came_back = came_back or (i in heads and t > 1 and i not in last_participants)
            trained[i] = reference_train(ctx, i, start, p)
        sizes = {i: ctx.data.clients[i].num_train for i in participants}
        expected_body = {k: sum(sizes[i] / sum(sizes.values()) * trained[i][k].double() for i in participants).float()
                         for k in BODY}
        assert_close(ctx.server["body"], expected_body, atol=1e-5)
        for i in participants:  # each arrived head stepped with server_lr / |A|, |A| = 3
            expected = reference_step(trained[i]["fc2.weight"], classes_held(ctx, i), p.server_lr / 3)
            assert far_apart({"w": expected}, {"w": trained[i]["fc2.weight"]}, ["w"], atol=1e-3)
            assert torch.allclose(ctx.server["heads"][i], expected, atol=1e-5), (t, i)
            assert_close(ctx.store[i]["head"], trained[i], HEAD, atol=1e-5)
        for i in set(range(4)) - set(participants):  # an idle client's head stays as it was
            if i in heads:
                assert torch.equal(ctx.server["heads"][i], heads[i])
        # continue from the run's state (checked above), so float rounding does not drift
        body = {k: v.clone() for k, v in ctx.server["body"].items()}
        heads = {i: w.clone() for i, w in ctx.server["heads"].items()}
        biases = {i: ctx.store[i]["head"]["fc2.bias"].clone() for i in range(4) if "head" in ctx.store[i]}
        last_participants = participants
    assert came_back  # some client sat out a round and then started from its own stepped head


def test_the_head_trains_alone_before_the_joint_epochs(monkeypatch):
    with recorded_training(monkeypatch) as calls:
        engine, ctx = prepared(**{**BASE, "training.local_epochs": 3, "algorithm.params.rep_epochs": 2})
        engine.run_round(ctx, 1)
    mine = [c for c in calls if c["client"] == 0]
    assert [(c["epochs"], c["trainable"]) for c in mine] == [(1, set(HEAD)), (2, set(BODY + HEAD))]
    assert_same(mine[0]["before"], mine[0]["after"], BODY)  # the head-only epoch leaves the body alone
    assert far_apart(mine[1]["before"], mine[1]["after"], BODY)


def test_each_client_is_evaluated_on_the_global_body_and_its_stepped_head():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        scored = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(scored, ctx.server["body"], BODY)
        own = ctx.store[i]["head"]
        assert torch.equal(scored["fc2.bias"], own["fc2.bias"])
        assert torch.equal(scored["fc2.weight"], ctx.server["heads"][i])  # the server's W_i, not the trained one
        assert far_apart({"w": own["fc2.weight"]}, {"w": ctx.server["heads"][i]}, ["w"])
        assert far_apart(scored, initial, HEAD)


def test_zero_regularisers_and_server_step_with_joint_epochs_only_is_fedper_bit_for_bit():
    zero = {"lam1": 0.0, "lam2": 0.0, "lam3": 0.0, "server_lr": 0.0, "rep_epochs": 2}
    flute, flute_engine = run_tiny(**{**BASE, "experiment.participation": 0.75, "algorithm.params": zero})
    fedper, fedper_engine = run_tiny(**{**BASE, "algorithm.name": "fedper", "experiment.participation": 0.75})
    assert_same(flute_engine.ctx.server["body"], fedper_engine.ctx.server["body"])
    for i in range(4):
        assert_same(flute_engine.ctx.store[i]["head"], fedper_engine.ctx.store[i]["head"])
    assert flute.final["acc_mean"] == fedper.final["acc_mean"]
    assert flute.final["loss_mean"] == fedper.final["loss_mean"]


def test_the_upload_is_the_body_the_head_weight_and_one_bit_per_class():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    shapes = {k: v.numel() for k, v in ctx.models.initial_state("mlp").items()}
    body = 4 * sum(shapes[k] for k in BODY)
    weight = 4 * shapes["fc2.weight"]
    assert ctx.comm_up == 4 * (body + weight + (C + 7) // 8)
    assert ctx.comm_down == 4 * body  # round 1: no head has been stepped yet
    engine.run_round(ctx, 2)
    assert ctx.comm_down == 4 * body + 4 * (body + weight)


# -- lost uploads ------------------------------------------------------------------------------------


def test_a_lost_upload_leaves_the_head_where_the_round_started_and_the_step_counts_arrivals():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 3  # seed 0 drops some and keeps at least two in round 2
    engine, ctx = prepared(**{**BASE, "algorithm.params.server_lr": 2.0},
                           addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    lost_1 = [i for i in range(4) if upload_is_lost(0, 1, i, p)]
    heads = {i: w.clone() for i, w in ctx.server["heads"].items()}
    own = {i: {k: v.clone() for k, v in ctx.store[i]["head"].items()} for i in range(4) if "head" in ctx.store[i]}
    assert sorted(heads) == sorted(own) == [i for i in range(4) if i not in lost_1]
    uploads = {}
    original = ctx.hooks.client_upload

    def recording(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = (message["head_weight"].clone(), message["labels"].value.clone())
        return message
    ctx.hooks.client_upload = recording
    engine.run_round(ctx, 2)
    arrived = [i for i in range(4) if i not in lost]
    for i in lost:  # it trained, but neither its own head nor the server's moved
        assert i in uploads
        if i in own:
            assert_same(ctx.store[i]["head"], own[i])
            assert torch.equal(ctx.server["heads"][i], heads[i])
        else:
            assert "head" not in ctx.store[i] and i not in ctx.server["heads"]
    for i in arrived:  # server_lr / |A|, |A| the arrivals only
        weight, labels = uploads[i]
        assert torch.allclose(ctx.server["heads"][i], reference_step(weight, labels, 2.0 / len(arrived)), atol=1e-5)


def test_a_cold_start_client_gets_the_body_and_no_head():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    assert newcomer not in ctx.server["heads"]
    assert set(ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)) == {"body"}


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.75, "training.local_epochs": 2,
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]},
                                       {"model.params": {"hidden": [8], "norm": "batch"},
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]}],
                         ids=["partial-dropout", "batchnorm-dropout"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("flute", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "flute", "experiment.participation": 0.5, "training.local_epochs": 2,
                 "model.params": {"hidden": [8]}}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["heads"]  # the stepped heads are part of what resumes


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam1", -0.1), ("lam1", float("nan")), ("lam2", "0.5"), ("lam3", -1.0),
                                       ("server_lr", float("inf")), ("rep_epochs", 0), ("rep_epochs", 1.5),
                                       ("rep_epochs", True)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    path = f"algorithm.params.{key}"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, path: value}))
    assert info.value.path == path


def test_more_joint_epochs_than_local_epochs_is_refused_on_the_command_line(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.rep_epochs": 3}))
    assert line == ("pfl-run: error: algorithm.params.rep_epochs: must not exceed training.local_epochs (2), "
                    "got 3")


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"


def test_a_model_without_a_body_is_refused_at_the_model():
    with pytest.raises(SpecError) as info:
        prepared(**{**BASE, "model.params.hidden": []})
    assert info.value.path == "model.name" and "body before the classifier" in info.value.message


def test_defaults_are_fl_benchs():
    p = FluteParams()
    assert (p.lam1, p.lam2, p.lam3, p.rep_epochs, p.server_lr) == (0.25, 0.0025, 0.0005, 1, 0.5)
