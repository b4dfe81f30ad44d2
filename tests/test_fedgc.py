"""FedGC (plugins/fedgc): the regulariser (G3) and its gradient step (G4) by hand on a case where a
class is shared, a class has two negatives' clients and a client holds a row of a class it lacks
(ignored); three engine rounds under partial participation recomputed independently (local
training on the softmax of the client's own classes, the backbone average, the server's rows and a
PFLlib-style loop for the correction: rows of clients that did not take part keep being corrected,
so state accumulates past round 2); lam = 0 leaves the uploaded rows as they are; what is evaluated;
lost uploads change nothing on the server; bad input; process executor and resume bit-identical."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, fresh_model, prepared, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedgc import FedGCParams, correct_rows, correction_loss, linear_classifier_gives_the_logits

BASE = {"algorithm.name": "fedgc", "model.params.hidden": [8]}
BACKBONE = ["fc1.weight", "fc1.bias"]
HEAD = ["fc2.weight", "fc2.bias"]
# the tiny synthetic data split by domain: clients 0 and 2 hold class 0 only, client 1 classes
# 7 and 9, client 3 classes 2, 4 and 8 (checked in test_the_tiny_clients_are_label_skewed)
CLASSES = {0: [0], 1: [7, 9], 2: [0], 3: [2, 4, 8]}


def mask(classes, n=3):
    return torch.tensor([c in classes for c in range(n)])


# -- (G3), (G4) by hand ------------------------------------------------------------------------------

# three classes in 2-d: client 0 holds 0 and 1 (and a row for class 2, which it lacks: never a
# negative), client 1 holds class 0, client 2 holds class 2
ROWS = {0: torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]),
        1: torch.tensor([[3.0, 0.0], [9.0, 9.0], [9.0, 9.0]]),
        2: torch.tensor([[9.0, 9.0], [9.0, 9.0], [0.0, 2.0]])}
HELD = {0: mask([0, 1]), 1: mask([0]), 2: mask([2])}


def test_the_regulariser_by_hand():
    e = math.e
    # class 0: holders 0 and 1, anchor (2, 0), e.e = 4; negatives: client 2's row (0, 2) . (2, 0) = 0;
    #          counted once per holder
    # class 1: holder 0, anchor (0, 1), e.e = 1; negatives: (3, 0) . e = 0 and (0, 2) . e = 2
    # class 2: holder 2, anchor (0, 2), e.e = 4; negatives: client 0's (1, 0) and (0, 1): 0 and 2,
    #          client 1's (3, 0): 0 (client 0's row of class 2 would add exp(10))
    expected = (2 * (math.log(e**4 + 1) - 4) + (math.log(e + 1 + e**2) - 1)
                + (math.log(e**4 + 1 + e**2 + 1) - 4))
    assert float(correction_loss(ROWS, HELD)) == pytest.approx(expected, rel=1e-6)


def test_the_correction_step_by_hand():
    e = math.e
    new, reg = correct_rows(ROWS, HELD, step=0.5)
    assert reg == pytest.approx(float(correction_loss(ROWS, HELD)))
    # dReg/dW_{j,l} = sum over the classes c that j lacks of (holders of c) * softmax weight of
    # W_{j,l} . e_c in c's term * e_c; anchors are constants
    grad = {
        (2, 2): 2 * (1 / (e**4 + 1)) * torch.tensor([2.0, 0.0]) + (e**2 / (e + 1 + e**2)) * torch.tensor([0.0, 1.0]),
        (1, 0): (1 / (e + 1 + e**2)) * torch.tensor([0.0, 1.0]) + (1 / (e**4 + e**2 + 2)) * torch.tensor([0.0, 2.0]),
        (0, 0): (1 / (e**4 + e**2 + 2)) * torch.tensor([0.0, 2.0]),
        (0, 1): (e**2 / (e**4 + e**2 + 2)) * torch.tensor([0.0, 2.0]),
    }
    for k in ROWS:
        for c in range(3):
            want = ROWS[k][c] - 0.5 * grad.get((k, c), torch.zeros(2))
            assert torch.allclose(new[k][c], want, atol=1e-6), (k, c)
    # the rows of a class a client lacks do not move (client 0's class-2 row, client 1's 1 and 2)
    assert torch.equal(new[0][2], ROWS[0][2]) and torch.equal(new[1][1:], ROWS[1][1:])
    # the step pushes a negative away from the anchor: client 2's row of class 2 . e_0 decreases
    assert float(new[2][2] @ torch.tensor([2.0, 0.0])) < float(ROWS[2][2] @ torch.tensor([2.0, 0.0]))


def test_a_class_every_client_holds_has_no_negatives():
    held = {0: mask([0, 1]), 1: mask([0, 1])}
    assert correction_loss(ROWS, {0: held[0], 1: held[1], 2: mask([0, 1])}) is None
    new, reg = correct_rows({0: ROWS[0], 1: ROWS[1]}, held, step=1.0)
    assert reg == 0.0 and torch.equal(new[0], ROWS[0]) and torch.equal(new[1], ROWS[1])


# -- three engine rounds recomputed ------------------------------------------------------------------


def spy_uploads(ctx):
    seen, original = {}, ctx.hooks.client_upload

    def recording(**kw):
        message = original(**kw)
        seen[kw["client"].id] = {"weights": {k: v.detach().clone() for k, v in message["weights"].items()},
                                 "rows": {k: v.detach().clone() for k, v in message["rows"].items()},
                                 "classes": message["classes"].value.clone()}
        return message

    ctx.hooks.client_upload = recording
    return seen


def own_softmax_loss(classes):
    """PFLlib's client loss: the classifier keeps only the client's classes' rows, labels renumbered."""
    index = torch.tensor(classes)
    renumber = {c: i for i, c in enumerate(classes)}

    def loss(model, x, y, logits):
        return F.cross_entropy(logits[:, index], torch.tensor([renumber[int(v)] for v in y]))
    return loss


def pfllib_correction(heads, classes, step):
    """(G3)-(G4) written as PFLlib's loop: for each client and each of its classes, -log(d1 / (d1 + d2))
    with the exponentials taken directly; one SGD step on every client's rows."""
    leaves = {k: w.clone().requires_grad_(True) for k, w in heads.items()}
    anchors = {}
    for c in range(len(next(iter(classes.values())))):
        own = [leaves[k][c].detach() for k in sorted(leaves) if classes[k][c]]
        if own:
            anchors[c] = sum(own) / len(own)
    reg = torch.zeros(())
    for k in sorted(leaves):
        for c in classes[k].nonzero().flatten().tolist():
            d1 = torch.exp(anchors[c] @ anchors[c])
            d2 = sum((torch.exp(leaves[j][classes[j]] @ anchors[c]).sum()
                      for j in sorted(leaves) if not classes[j][c]), torch.zeros(()))
            reg = reg - torch.log(d1 / (d1 + d2))
    if reg.requires_grad:
        reg.backward()
    return {k: (w - step * w.grad if w.grad is not None else w).detach() for k, w in leaves.items()}, float(reg.detach())


def test_the_tiny_clients_are_label_skewed():
    _, ctx = prepared(**BASE)
    for i, classes in CLASSES.items():
        assert ctx.data.clients[i].label_counts().nonzero()[0].tolist() == classes


def test_three_rounds_recomputed_independently():
    lam, participation = 5.0, 0.5
    engine, ctx = prepared(**BASE, **{"algorithm.params.lam": lam, "experiment.participation": participation})
    step = lam * ctx.spec.training.lr
    initial = ctx.models.initial_state("mlp")
    theta = {k: initial[k].clone() for k in BACKBONE}
    heads, classes, seen_idle_correction = {}, {}, False
    for r in (1, 2, 3):
        start = {i: {**theta, **(heads.get(i) or {k: initial[k].clone() for k in HEAD})} for i in range(4)}
        uploads = spy_uploads(ctx)
        engine.run_round(ctx, r)
        arrived = sorted(uploads)
        assert 0 < len(arrived) < 4
        sizes = {i: ctx.data.clients[i].num_train for i in arrived}
        new_heads = {i: dict(h) for i, h in heads.items()}
        for i in arrived:
            own = torch.tensor(CLASSES[i])
            trained = train_reference(ctx, i, start[i], loss_fn=own_softmax_loss(CLASSES[i]))
            assert_close(uploads[i]["weights"], trained, BACKBONE, atol=1e-5)
            assert torch.equal(uploads[i]["classes"], mask(CLASSES[i], 10))
            assert_close(uploads[i]["rows"], {k: trained[k][own] for k in HEAD}, atol=1e-5)
            # the rows of the classes it lacks never left the client: the server's copy keeps what it sent
            new_heads[i] = {k: start[i][k].clone() for k in HEAD}
            for k in HEAD:
                new_heads[i][k][own] = trained[k][own]
            classes[i] = mask(CLASSES[i], 10)
        total = sum(sizes.values())
        theta = {k: sum(sizes[i] / total * uploads[i]["weights"][k] for i in arrived) for k in BACKBONE}
        uncorrected = {i: h["fc2.weight"] for i, h in new_heads.items()}
        corrected, reg = pfllib_correction(uncorrected, classes, step)
        heads = {i: {**h, "fc2.weight": corrected[i]} for i, h in new_heads.items()}
        assert_close(ctx.server["global"], theta, BACKBONE, atol=1e-5)
        assert sorted(ctx.server["heads"]) == sorted(heads)
        for i in heads:
            assert_close(ctx.server["heads"][i], heads[i], HEAD, atol=1e-5)
            assert torch.equal(ctx.server["classes"][i], classes[i])
        assert ctx.round_metrics["fedgc_reg"] == pytest.approx(reg, rel=1e-5)
        # the correction changes the rows, beyond the tolerance (so the checks above can tell)
        assert far_apart(corrected, uncorrected, list(corrected), atol=1e-3)
        idle = [i for i in heads if i not in arrived]
        seen_idle_correction |= any(far_apart(corrected, uncorrected, [i], atol=1e-3) for i in idle)
        theta = {k: ctx.server["global"][k].clone() for k in BACKBONE}  # carry the engine's floats on
        heads = {i: {k: v.clone() for k, v in h.items()} for i, h in ctx.server["heads"].items()}
    assert seen_idle_correction  # a client that sat the round out still had its rows corrected


def test_without_the_correction_the_server_keeps_the_uploaded_rows():
    engine, ctx = prepared(**BASE, **{"algorithm.params.lam": 0.0})
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        own = torch.tensor(CLASSES[i])
        for k in HEAD:
            want = initial[k].clone()
            want[own] = uploads[i]["rows"][k]
            assert torch.equal(ctx.server["heads"][i][k], want)


# -- what is evaluated ------------------------------------------------------------------------------


def test_each_client_is_evaluated_on_the_backbone_and_its_corrected_rows_for_its_own_classes():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    known = sorted(ctx.server["heads"])
    assert 0 < len(known) < 4
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        client = ctx.client(i)
        model = evaluated_models(ctx, client)[""]
        head = ctx.server["heads"][i] if i in known else {k: initial[k] for k in HEAD}
        expected = fresh_model(ctx, {**ctx.server["global"], **head})
        x = ctx.data.clients[i].test_x
        with torch.no_grad():
            got, want = model(x), expected(x)
        own = mask(CLASSES[i], 10)
        assert torch.allclose(got[:, own], want[:, own], atol=1e-6)
        assert torch.isneginf(got[:, ~own]).all()


# -- lost uploads -----------------------------------------------------------------------------------


def test_a_lost_upload_changes_nothing_on_the_server():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    # seed 0 loses clients 2 and 3 in round 1 and clients 1 and 2 in round 2: client 1 had rows on
    # the server from round 1, client 2 never had any
    assert [i for i in range(4) if upload_is_lost(0, 1, i, p)] == [2, 3] and lost == [1, 2]
    engine, ctx = prepared(**BASE, **{"algorithm.params.lam": 0.0},
                           addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    before = {i: {k: v.clone() for k, v in h.items()} for i, h in ctx.server["heads"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 2)
    for i in lost:  # it trained and uploaded, but the server kept what it had (none, or round 1's rows)
        assert i in uploads
        if i in before:
            assert_same(ctx.server["heads"][i], before[i])
        else:
            assert i not in ctx.server["heads"] and i not in ctx.server["classes"]
    for i in (i for i in range(4) if i not in lost):  # arrivals replace their rows
        own = torch.tensor(CLASSES[i])
        assert_same({k: ctx.server["heads"][i][k][own] for k in HEAD}, uploads[i]["rows"])


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "1"])
def test_a_bad_lam_is_refused_at_its_key(value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "algorithm.params.lam": value}))
    assert info.value.path == "algorithm.params.lam"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    assert FedGCParams().lam == 1.0
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.lam": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.lam: must be >= 0")


def test_only_a_linear_last_layer_that_outputs_the_logits_holds_class_embeddings():
    x = torch.randn(2, 3)
    assert linear_classifier_gives_the_logits(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)), x)
    assert not linear_classifier_gives_the_logits(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2), nn.Tanh()), x)
    assert not linear_classifier_gives_the_logits(nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5)), x)


def test_a_model_whose_last_layer_is_not_the_output_is_refused_naming_the_model(monkeypatch):
    from pfl_plugins import fedgc

    monkeypatch.setattr(fedgc, "linear_classifier_gives_the_logits", lambda model, x: False)
    with pytest.raises(SpecError) as info:
        prepared(**BASE)
    assert info.value.path == "model.name"
    assert "fedgc's class embeddings are the rows of a linear classifier" in info.value.message


# -- executors and resume ---------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "experiment.participation": 0.75,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedgc", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedgc", "experiment.participation": 0.5}
    final = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert final["heads"]  # the corrected rows are part of what is resumed
