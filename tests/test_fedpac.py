"""FedPAC (plugins/fedpac): the feature statistics, the QP's combination weights and the
alignment term by hand, lam = 0 without collaboration = FedRep (FedPer family) bit for bit, a
local round and the server's aggregation recomputed, what is evaluated, bytes, budget, bad input."""

from types import SimpleNamespace

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
from pfl_plugins.fedpac import FedPAC, FedPACParams, combination_weights, combine, feature_statistics

BASE = {"algorithm.name": "fedpac", "model.params.hidden": [8], "experiment.rounds": 2}
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- (P1)-(P2): the feature statistics, by hand ---------------------------------------------------


def test_feature_statistics_by_hand():
    # client A: z = 1, 3 (class 0): p = 1, mu = 2, E||z||^2 = 5: v = (5 - 4) / 2 = 0.5, h = (2, 0)
    v, h = feature_statistics(torch.tensor([[1.0], [3.0]]), torch.tensor([0, 0]), 2)
    assert v == pytest.approx(0.5) and torch.allclose(h, torch.tensor([[2.0], [0.0]], dtype=h.dtype))
    # client B: z = 0 (class 0), 2, 4 (class 1): p = 1/3, 2/3; mu = 0, 3; E||z||^2 = 0, 10
    # v = (1/3) (1/3 * 0 - 1/9 * 0 + 2/3 * 10 - 4/9 * 9) = 8/9; h = (0, 2)
    v, h = feature_statistics(torch.tensor([[0.0], [2.0], [4.0]]), torch.tensor([0, 1, 1]), 2)
    assert v == pytest.approx(8 / 9) and torch.allclose(h, torch.tensor([[0.0], [2.0]], dtype=h.dtype))
    # both classes contribute: z = 1, 3 (class 0), 2, 4, 6 (class 1): p = 2/5, 3/5; mu = 2, 4;
    # E||z||^2 = 5, 56/3: v = (1/5) (2/5 * 5 - 4/25 * 4 + 3/5 * 56/3 - 9/25 * 16) = 1.36; h = (0.8, 2.4)
    v, h = feature_statistics(torch.tensor([[1.0], [3.0], [2.0], [4.0], [6.0]]), torch.tensor([0, 0, 1, 1, 1]), 2)
    assert v == pytest.approx(1.36) and torch.allclose(h, torch.tensor([[0.8], [2.4]], dtype=h.dtype))
    # two dimensions: z = (1, 0), (0, 1) of class 1 of 3 classes: mu = (1/2, 1/2), E||z||^2 = 1
    v, h = feature_statistics(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1, 1]), 3)
    assert v == pytest.approx((1 - 0.5) / 2)
    assert torch.allclose(h, torch.tensor([[0.0, 0.0], [0.5, 0.5], [0.0, 0.0]], dtype=h.dtype))


# -- (P6): the QP's combination weights, by hand -----------------------------------------------------


def test_two_client_weights_by_hand():
    # the two clients above: v = (1/2, 8/9), h_A - h_B = (2, -2), ||.||^2 = 8.
    # For A: P = diag(1/2, 8/9 + 8), alpha ∝ (1/P_11, 1/P_22) = (160/169, 9/169)
    v, h = [0.5, 8 / 9], torch.tensor([[[2.0], [0.0]], [[0.0], [2.0]]])
    assert np.allclose(combination_weights(v, h, 0), [160 / 169, 9 / 169], atol=1e-7)
    # For B: P = diag(1/2 + 8, 8/9): alpha = (16/169, 153/169)
    assert np.allclose(combination_weights(v, h, 1), [16 / 169, 153 / 169], atol=1e-7)


def test_three_clients_with_equal_statistics_weigh_by_inverse_variance():
    h = torch.ones(3, 2, 4)  # no bias term: P = diag(v), alpha ∝ 1/v
    assert np.allclose(combination_weights([1.0, 2.0, 4.0], h, 0), [4 / 7, 2 / 7, 1 / 7], atol=1e-7)
    assert np.allclose(combination_weights([1.0, 2.0, 4.0], h, 2), [4 / 7, 2 / 7, 1 / 7], atol=1e-7)


def test_a_far_client_gets_zero_weight():
    # i = 0; d_j = h_0 - h_j = 0, 1, 2 (one class, one dimension); v = (1, 0.1, 0.1):
    # P = [[1, 0, 0], [0, 1.1, 2], [0, 2, 4.1]]. The unconstrained optimum has alpha_3 < 0; on
    # alpha_3 = 0 it is alpha ∝ (1/1, 1/1.1) = (11/21, 10/21), and the KKT condition holds:
    # (P alpha)_3 = 20/21 >= (P alpha)_1 = 11/21.
    h = torch.tensor([[[0.0]], [[-1.0]], [[-2.0]]])
    assert np.allclose(combination_weights([1.0, 0.1, 0.1], h, 0), [11 / 21, 10 / 21, 0.0], atol=1e-7)


def test_weights_of_one_client_and_of_a_flat_objective():
    assert combination_weights([0.3], torch.zeros(1, 2, 2), 0).tolist() == [1.0]
    assert np.allclose(combination_weights([0.0, 0.0], torch.zeros(2, 1, 1), 1), [0.5, 0.5])  # a tie


def test_combine_by_hand():
    heads = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -2.0])}]
    assert torch.allclose(combine([0.25, 0.75], heads)["w"], torch.tensor([2.5, -1.0]))


# -- (P3): the alignment term, by hand -----------------------------------------------------------------


def alignment(lam, scratch, y):
    client = SimpleNamespace(scratch=scratch)
    return FedPAC(FedPACParams(lam=lam)).local_objective(ctx=None, client=client, model=None, x=None, y=y,
                                                         logits=None)


def test_alignment_term_by_hand():
    emb = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])
    centroids = {0: torch.tensor([0.0, 0.0]), 2: torch.tensor([1.0, 1.0])}
    y = torch.tensor([0, 1, 2])  # class 1 has no centroid: left out
    # samples 0 and 2: squared errors (1 + 4) + (1 + 1) over 2 samples x 2 dimensions = 7/4
    assert alignment(2.0, {"global": centroids, "emb": emb}, y).item() == pytest.approx(3.5)
    assert alignment(1.0, {"global": centroids, "emb": emb}, y).item() == pytest.approx(1.75)
    # no term outside the body epochs, nor at lam = 0
    assert alignment(1.0, {"centroids": centroids, "emb": emb}, y) is None
    assert alignment(0.0, {"global": centroids, "emb": emb}, y) is None


# -- lam = 0, no collaboration = FedRep with one head epoch (the FedPer family), bit for bit ------------


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


FEDREP = {"algorithm.name": "fedrep", "algorithm.params.head_epochs": 1, "algorithm.params.body_epochs": 1}
AS_FEDREP = {"algorithm.params.lam": 0.0, "algorithm.params.collaborate": False,
             "algorithm.params.head_lr_scale": 1.0, "algorithm.params.body_epochs": 1}


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_without_alignment_and_collaboration_it_is_fedrep_bit_for_bit(extra):
    pac = run_rounds(3, **{**BASE, **extra, **AS_FEDREP})
    rep = run_rounds(3, **{**BASE, **extra, **FEDREP})
    assert_same(pac.server["body"], rep.server["body"])
    for i in range(4):
        assert ("head" in pac.store[i]) == ("head" in rep.store[i])
        if "head" in rep.store[i]:
            assert_same(pac.store[i]["head"], rep.store[i]["head"])
    # ... and the alignment changes the body: the test can tell them apart
    aligned = run_rounds(3, **{**BASE, **extra, **AS_FEDREP, "algorithm.params.lam": 1.0})
    assert far_apart(aligned.server["body"], rep.server["body"], BODY)


def test_a_lone_participant_gets_a_one_hot_combination_and_matches_fedrep():
    one = {"experiment.participation": 0.25}
    pac = run_rounds(3, **{**BASE, **one, **AS_FEDREP, "algorithm.params.collaborate": True})
    rep = run_rounds(3, **{**BASE, **one, **FEDREP})
    assert_same(pac.server["body"], rep.server["body"])
    for i, head in pac.server["heads"].items():  # alpha = (1): phi-hat_i = phi_i
        assert_same(head, pac.store[i]["head"])
        assert_same(head, rep.store[i]["head"])


# -- a round recomputed independently -------------------------------------------------------------------


def features(x, state):
    return F.relu(F.linear(x, state["fc1.weight"], state["fc1.bias"]))


def train_part(ctx, i, state, keys, lr, loss_fn, epochs=1):
    model = fresh_model(ctx, state)
    for name, p in model.named_parameters():
        p.requires_grad_(name in keys)
    client = ctx.client(i)
    client.train(model=model, epochs=epochs, optimizer=torch.optim.SGD([p for n, p in model.named_parameters()
                                                                         if n in keys], lr=lr), loss_fn=loss_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def aligned_loss(centroids, lam):
    def loss(model, x, y, logits):
        z = features(x, dict(model.named_parameters()))
        known = [j for j, c in enumerate(y.tolist()) if c in centroids]
        target = torch.stack([centroids[int(y[j])] for j in known])
        return F.cross_entropy(logits, y) + lam * ((z[known] - target) ** 2).mean()
    return loss


def ce(model, x, y, logits):
    return F.cross_entropy(logits, y)


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        copy = lambda t: t.clone() if isinstance(t, torch.Tensor) else t
        uploads[kw["client"].id] = {k: ({n: copy(t) for n, t in v.items()} if isinstance(v, dict) else copy(v))
                                    for k, v in message.items()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def test_a_round_recomputed_independently():
    engine, ctx = prepared(**{**BASE, "algorithm.params.lam": 0.5, "experiment.rounds": 3, "training.lr": 0.05})
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    body1 = {k: v.clone() for k, v in ctx.server["body"].items()}
    heads1 = {i: {k: v.clone() for k, v in h.items()} for i, h in ctx.server["heads"].items()}
    centroids1 = dict(ctx.server["centroids"])
    assert set(centroids1) and set(heads1) == {0, 1, 2, 3}
    engine.run_round(ctx, 2)
    for i in range(4):
        # start: theta^1 and the combined head of round 1; then 1 head epoch at 10 x lr, CE only
        start = {**body1, **heads1[i]}
        after_head = train_part(ctx, i, start, HEAD, 0.5, ce)
        # then body epochs (training.local_epochs = 1) at lr with the alignment to c^1
        expected = train_part(ctx, i, after_head, BODY, 0.05, aligned_loss(centroids1, 0.5))
        assert_close(uploads[i]["body"], expected, BODY, atol=1e-6)
        assert_close(uploads[i]["head"], expected, HEAD, atol=1e-6)
        assert far_apart(after_head, start, HEAD) and far_apart(expected, after_head, BODY)
        # statistics with the received theta^1, before training; centroids with the trained theta_i
        x, y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
        v, h = feature_statistics(features(x, body1), y, ctx.num_classes)
        assert uploads[i]["v"] == pytest.approx(v, rel=1e-5) and torch.allclose(uploads[i]["h"], h.float(), atol=1e-6)
        z = features(x, expected)
        for c in y.unique().tolist():
            assert torch.allclose(uploads[i]["centroids"][c], z[y == c].mean(0), atol=1e-5)
            assert uploads[i]["counts"][c] == int((y == c).sum())
    # the server: n_i-weighted body, count-weighted centroids (P5), combined heads (P6)-(P7)
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(n.values())
    for k in BODY:
        assert torch.allclose(ctx.server["body"][k], sum(n[i] / total * uploads[i]["body"][k] for i in range(4)),
                              atol=1e-6)
    for c, centroid in ctx.server["centroids"].items():
        holders = [i for i in range(4) if c in uploads[i]["counts"]]
        expected = sum(uploads[i]["counts"][c] * uploads[i]["centroids"][c] for i in holders) / sum(
            uploads[i]["counts"][c] for i in holders)
        assert torch.allclose(centroid, expected, atol=1e-6)
    v = [uploads[i]["v"] for i in range(4)]
    h = torch.stack([uploads[i]["h"] for i in range(4)])
    for i in range(4):
        alpha = combination_weights(v, h, i)
        (self_weight,) = [row["value"] for row in ctx.client_series
                          if (row["round"], row["client"], row["name"]) == (ctx.round, i, "fedpac_self_weight")]
        assert self_weight == pytest.approx(alpha[i])
        for k in HEAD:
            assert torch.allclose(ctx.server["heads"][i][k], sum(alpha[j] * uploads[j]["head"][k] for j in range(4)),
                                  atol=1e-6)


def test_the_head_is_the_last_layer():
    from torch import nn

    from pfl_plugins.fedpac import head_keys
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    assert head_keys(model) == ["4.weight", "4.bias"]


@pytest.mark.parametrize("part", ["head", "body"])
def test_zero_epochs_leave_that_part_as_received(part):
    ctx = run_rounds(1, **{**BASE, f"algorithm.params.{part}_epochs": 0, "algorithm.params.collaborate": False})
    init = ctx.models.initial_state("mlp")
    if part == "head":
        for i in range(4):
            assert_same(ctx.store[i]["head"], init, HEAD)
        assert far_apart(ctx.server["body"], init, BODY)
    else:
        assert_close(ctx.server["body"], init, BODY)  # every client sent the body it received
        assert far_apart(ctx.store[0]["head"], init, HEAD)


def test_centroids_of_classes_nobody_reported_are_kept():
    engine, ctx = prepared(**BASE)
    old = torch.full((8,), 7.0)
    ctx.server["centroids"] = {99: old}
    engine.run_round(ctx, 1)
    assert ctx.server["centroids"][99] is old and len(ctx.server["centroids"]) > 1


# -- evaluation, bytes, budget ----------------------------------------------------------------------


def test_evaluated_model_is_the_global_body_with_the_combined_head():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    trained = ctx.participants
    idle = [i for i in range(4) if i not in trained]
    for i in trained:
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(state, ctx.server["body"], BODY)
        assert_same(state, ctx.server["heads"][i], HEAD)
        assert far_apart(ctx.server["heads"][i], ctx.store[i]["head"], HEAD, atol=1e-7)  # combined != own
    state = evaluated_models(ctx, ctx.client(idle[0]))[""].state_dict()
    assert_same(state, ctx.models.initial_state("mlp"), HEAD)
    # the combined head is what the client starts from next time
    client = ctx.client(trained[0])
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=trained[0])
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    assert_same(client.model.state_dict(), ctx.server["heads"][trained[0]], HEAD)


def test_bytes_are_body_head_centroids_and_statistics():
    ctx = run_rounds(2, **BASE)
    body = model_bytes(ctx.server["body"])
    head = model_bytes(ctx.models.initial_state("mlp"), HEAD)
    d, c = 8, ctx.num_classes
    classes = [len(ctx.data.clients[i].train_y.unique()) for i in range(4)]
    # up, per client and round: theta_i + phi_i + its centroids (4 bytes x d each) + counts (8 each)
    # + v (8) + h (c x d floats)
    per_round_up = sum(body + head + k * (4 * d + 8) + 8 + 4 * c * d for k in classes)
    assert ctx.comm_up == 2 * per_round_up
    # down: round 1 theta; round 2 theta + c^1 (one centroid per class seen) + phi-hat_i
    seen = len(set().union(*[set(ctx.data.clients[i].train_y.tolist()) for i in range(4)]))
    assert ctx.comm_down == 4 * body + 4 * (body + 4 * d * seen + head)
    # without collaboration: no heads, no statistics
    plain = run_rounds(2, **{**BASE, "algorithm.params.collaborate": False})
    assert plain.comm_up == 2 * sum(body + k * (4 * d + 8) for k in classes)
    assert plain.comm_down == 4 * body + 4 * (body + 4 * d * seen)


def test_local_work_is_head_plus_body_epochs_and_matches_what_trains():
    spec = resolve(tiny_raw(**BASE, **{"training.local_epochs": 2})).spec
    assert FedPAC(FedPACParams()).local_work(spec).private_epochs_per_round == 3
    assert FedPAC(FedPACParams(head_epochs=2, body_epochs=1)).local_work(spec).private_epochs_per_round == 3
    result = Engine(resolve(tiny_raw(**{**BASE, "algorithm.params.head_epochs": 2})), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(2 * (2 + 1))


def test_defaults_are_the_documented_ones():
    p = FedPACParams()
    assert (p.lam, p.head_epochs, p.body_epochs, p.head_lr_scale, p.collaborate, p.head_layers) == (
        1.0, 1, None, 10.0, True, 1)


def test_a_full_run_with_coldstart_clients():
    result = Engine(resolve(tiny_raw(**BASE, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


@pytest.mark.parametrize("method", ["fedpac", "fedas", "pfedfda"])  # they share FedPAC's split of the model
def test_a_model_without_a_feature_extractor_is_refused_at_model_name(monkeypatch, method):
    raw = tiny_raw(**{**BASE, "algorithm.name": method, "model.params.hidden": []})
    expected = f"model.name: {method} needs a feature extractor before the classifier, but mlp has 1 parameterised layer(s)"
    with pytest.raises(SpecError) as info:
        resolve(raw)  # before any data is loaded
    assert str(info.value) == expected
    monkeypatch.setattr("pfl_plugins.fedpac.probe_num_layers", lambda spec, arch: None)  # a model the probe cannot build
    engine = Engine(resolve(raw), progress=False)
    with pytest.raises(SpecError) as info:
        engine.run()  # then setup, on the real model
    assert str(info.value) == expected


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -1.0), ("lam", float("inf")), ("head_epochs", -1),
                                       ("body_epochs", -2), ("head_lr_scale", 0.0), ("head_lr_scale", -3.0),
                                       ("collaborate", "yes")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.lam": -0.5}))
    assert "algorithm.params.lam" in line and ">= 0" in line
