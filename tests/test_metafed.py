"""MetaFed (plugins/metafed): (M3)'s distillation weight and the feature term by hand; the ring's
schedule (who trains, who teaches) over more than a cycle; the warm-up, hops (distil and copy
branches, the teacher being the model the previous hop just trained) and the personalization
recomputed independently; the copy-or-distill flag (set once, kept); which model is evaluated;
lost uploads; the budget; bad input; the process executor and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, fresh_model, prepared, train_reference
from test_checkpoint import (
    empty_store,
)
from tiny import run_tiny, tiny_raw

from pfl_core.api import capture_embedding
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import score
from pfl_plugins.metafed import MetaFed, MetaFedParams, personalization_weight

assert empty_store  # the fixture used by the resume test (imported, not called)

# A learning rate and warm-up short enough that the clients' accuracies differ (the rules compare them).
BASE = {"algorithm.name": "metafed", "algorithm.params.warmup_epochs": 2, "algorithm.params.lam": 5.0,
        "training.lr": 0.05}
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


# -- by hand ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("teacher", "student", "threshold", "expected"), [
    (0.4, 0.6, 0.5, 0.0),                     # teacher worse and below the threshold: no distillation
    (0.5, 0.6, 0.5, 2 * 10 ** -0.5 / 10),     # worse, but not below: 10^(5 * -0.1) / 10
    (0.45, 0.5, 0.4, 2 * 10 ** -0.25 / 10),   # worse, above the threshold
    (0.3, 0.2, 0.5, 2 * 10 ** 0.5 / 10),      # better though below the threshold
    (0.6, 0.6, 0.5, 2 * 0.1),                 # as good: lam / 10
    (0.9, 0.6, 0.5, 2.0),                     # 5 * 0.3 > 1: capped at lam
])
def test_the_personalization_weight_by_hand(teacher, student, threshold, expected):
    assert personalization_weight(2.0, teacher, student, threshold) == pytest.approx(expected, rel=1e-12)


def test_the_feature_term_by_hand():
    """lam * MSE of the classifier inputs (relu(fc1 x)), the teacher's taken without gradient."""
    student = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    teacher = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    with torch.no_grad():
        student[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        student[0].bias.zero_()
        teacher[0].weight.copy_(torch.tensor([[2.0, 0.0], [0.0, -1.0]]))
        teacher[0].bias.copy_(torch.tensor([0.0, 1.0]))
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    client = SimpleNamespace(model=student, scratch={"teacher": teacher, "lam": 3.0, "student_features": {}})
    plugin = MetaFed(MetaFedParams())
    with capture_embedding(student, client.scratch["student_features"]):
        logits = student(x)
    term = plugin.local_objective(ctx=None, client=client, model=student, x=x, y=None, logits=logits)
    # student features relu(x) = (1, 2), (3, 0); teacher relu(2 x1, 1 - x2) = (2, 0), (6, 2)
    # squared differences 1, 4, 9, 4: mean 4.5, times lam 3
    assert term.item() == pytest.approx(13.5)
    term.backward()
    assert teacher[0].weight.grad is None  # the teacher does not train
    other = torch.nn.Linear(2, 1)  # another model (an evaluation probe): no term
    assert plugin.local_objective(ctx=None, client=client, model=other, x=x, y=None, logits=None) is None
    client.scratch.pop("teacher")  # no teacher this visit: no term
    assert plugin.local_objective(ctx=None, client=client, model=student, x=x, y=None, logits=logits) is None


# -- the reference: plain PyTorch on fresh modules --------------------------------------------------


def features(model, x):
    """relu(bn1(fc1 x)) (the MLP's classifier input), written out."""
    hidden = model.fc1(x.flatten(1))
    return torch.relu(model.bn1(hidden) if hasattr(model, "bn1") else hidden)


def train_distilled(ctx, i, own, teacher_state, lam):
    """f_i after training.local_epochs epochs of CE + lam MSE(z_f(x), z_T(x)) from ``own``, the
    teacher a fresh module in eval mode, the batch order client i's of this round."""
    model, teacher = fresh_model(ctx, own), fresh_model(ctx, teacher_state).eval()
    seen = {}
    model.fc2.register_forward_pre_hook(lambda module, inputs: seen.__setitem__("z", inputs[0]))

    def loss(model, x, y, logits):
        with torch.no_grad():
            target = features(teacher, x)
        return F.cross_entropy(logits, y) + lam * F.mse_loss(seen["z"], target)

    optimizer = torch.optim.SGD(model.parameters(), lr=ctx.spec.training.lr)
    ctx.client(i).train(model=model, optimizer=optimizer, loss_fn=loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accuracy(ctx, i, state):
    data = ctx.data.clients[i]
    return score(fresh_model(ctx, state), data.val_x, data.val_y).accuracy


def expected_hop(ctx, student, own, teacher, distills, lam):
    """(M2): f_s after its hop, from its own f_s and the teacher's weights."""
    if teacher is None:
        return train_reference(ctx, student, own)
    if not distills:
        return train_reference(ctx, student, teacher)  # the copy, then cross-entropy
    if lam == 0:
        return train_reference(ctx, student, own)
    return train_distilled(ctx, student, own, teacher, lam)


def weights(ctx, i):
    return ctx.store[i]["weights"]


# -- the ring --------------------------------------------------------------------------------------


def test_the_ring_runs_one_hop_a_round_each_teacher_the_model_just_handed_on():
    """7 rounds of 4 clients: the warm-up, hops 0 1 2 3 0 (past a whole cycle), the personalization."""
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 7})
    participants, teachers, handed_on_by = [], [], []
    for t in range(1, 8):
        ctx.round = t  # what the engine sets first: the broadcast the round's clients will get
        sent = [ctx.hooks.on_broadcast(ctx=ctx, client_id=i) for i in range(4)]
        owner = ctx.server.get("handed_on_by")
        teachers.append([owner if "teacher" in m else None for m in sent])
        if "teacher" in sent[0]:
            assert_same(sent[0]["teacher"], ctx.server["handed_on"])
        engine.run_round(ctx, t)
        participants.append(list(ctx.participants))
        handed_on_by.append(ctx.server.get("handed_on_by"))
    assert participants == [[0, 1, 2, 3], [0], [1], [2], [3], [0], [0, 1, 2, 3]]
    # the warm-up sends nothing; hop h's teacher is the previous hop's student (hop 0's: client 3's warm-up
    # model); the personalization's is the last hop's student, for every client
    assert [row[0] for row in teachers] == [None, 3, 0, 1, 2, 3, 0]
    assert teachers[-1] == [0, 0, 0, 0]
    assert handed_on_by == [3, 0, 1, 2, 3, 0, 0]


def test_warmup_then_hops_recomputed_independently():
    """Round 1 (M1), then hops 0, 1, 2 (M2): client 1 copies its teacher, the others distil; the
    teacher of each hop is the model the previous hop trained (not the predecessor's warm-up model)."""
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6})
    theta0 = {k: v.clone() for k, v in ctx.models.initial_state("mlp").items()}
    engine.run_round(ctx, 1)
    own = {}
    for i in range(4):
        own[i] = train_reference(ctx, i, theta0, epochs=2)
        assert_close(weights(ctx, i), own[i], atol=1e-6)
        assert ctx.store[i]["distills"] == (accuracy(ctx, i, own[i]) > 0.6)
    assert_same(ctx.server["handed_on"], weights(ctx, 3))
    for i in range(4):  # client 1 copies (it has not learned enough), 0 and 2 distil
        ctx.store[i]["distills"] = i != 1
    teacher = own[3]
    for t, student in ((2, 0), (3, 1), (4, 2)):
        engine.run_round(ctx, t)
        expected = expected_hop(ctx, student, own[student], teacher, student != 1, 5.0)
        assert_close(weights(ctx, student), expected, atol=1e-5)
        plain = train_reference(ctx, student, own[student])
        assert far_apart(expected, plain, PARAMS)  # the teacher made a difference
        own[student], teacher = expected, expected
        assert_same(ctx.server["handed_on"], weights(ctx, student))
    for i in (0, 2):  # the others' models did not move
        assert_close(weights(ctx, i), own[i], atol=1e-5)
    assert_close(weights(ctx, 3), own[3], atol=1e-6)


def test_the_flag_is_set_by_the_students_own_accuracy_and_kept():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6, "algorithm.params.distill_threshold": 1.0})
    engine.run_round(ctx, 1)
    assert not any(ctx.store[i]["distills"] for i in range(4))  # accuracy > 1 never holds
    ctx.store[1]["distills"] = True  # set earlier: it stays, though 1's accuracy is not above 1
    engine.run_round(ctx, 2)
    engine.run_round(ctx, 3)
    assert ctx.store[1]["distills"] is True and ctx.store[0]["distills"] is False
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6, "algorithm.params.distill_threshold": 0.0})
    engine.run_round(ctx, 1)
    ctx.store[0]["distills"] = False
    engine.run_round(ctx, 2)  # client 0's hop: its accuracy is above 0 now
    assert ctx.store[0]["distills"] is True


def test_with_batchnorm_the_teacher_runs_in_eval_mode_and_a_copy_takes_its_statistics():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6, "model.params.norm": "batch"})
    engine.run_round(ctx, 1)
    own = {i: {k: v.clone() for k, v in weights(ctx, i).items()} for i in range(4)}
    ctx.store[0]["distills"], ctx.store[1]["distills"] = True, False
    keys = [k for k, v in own[0].items() if v.is_floating_point()]  # parameters and running statistics
    engine.run_round(ctx, 2)  # client 0 distils from client 3's warm-up model
    expected = train_distilled(ctx, 0, own[0], own[3], 5.0)
    assert_close(weights(ctx, 0), expected, keys, atol=1e-5)
    engine.run_round(ctx, 3)  # client 1 copies client 0's model, running statistics included
    reference = train_reference(ctx, 1, expected)
    assert_close(weights(ctx, 1), reference, keys, atol=1e-5)
    steps = reference["bn1.num_batches_tracked"] - expected["bn1.num_batches_tracked"]
    assert weights(ctx, 1)["bn1.num_batches_tracked"] == own[1]["bn1.num_batches_tracked"] + steps  # its own count


def test_personalization_recomputed_from_the_last_model_handed_on():
    """Round 5 of 5 (M3): every client, the teacher the last hop's student (client 2), lam_i from
    the teacher's and the client's accuracy on the client's validation split."""
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 5})
    for t in range(1, 5):
        engine.run_round(ctx, t)
    assert ctx.server["handed_on_by"] == 2
    teacher = {k: v.clone() for k, v in ctx.server["handed_on"].items()}
    ctx.store[3]["distills"] = False  # one client copies
    before = {i: {k: v.clone() for k, v in weights(ctx, i).items()} for i in range(4)}
    lams = {}
    for i in range(4):
        lams[i] = personalization_weight(5.0, accuracy(ctx, i, teacher), accuracy(ctx, i, before[i]), 0.5)
    assert len({round(v, 9) for v in lams.values()}) > 1  # the accuracies differ: so do the weights
    engine.run_round(ctx, 5)
    for i in range(4):
        distills = ctx.store[i]["distills"]
        expected = expected_hop(ctx, i, before[i], teacher, distills, lams[i])
        assert_close(weights(ctx, i), expected, atol=1e-5)
    logged = {row["client"]: row["value"] for row in ctx.client_series if row["name"] == "metafed_lam"}
    assert logged == pytest.approx({i: lams[i] for i in range(3)})  # client 3 copies: no lam


def test_every_client_is_evaluated_on_its_own_model():
    _, engine = run_tiny(**BASE, **{"experiment.rounds": 4})
    ctx = engine.ctx
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message == {}  # nothing from the server
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), weights(ctx, i))
    assert far_apart(weights(ctx, 0), weights(ctx, 1), PARAMS)


def test_a_coldstart_client_starts_from_the_model_handed_on():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 4, "experiment.coldstart_clients": 1})
    ctx = engine.ctx
    (newcomer,) = ctx.coldstart_clients
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    assert_same(message["teacher"], ctx.server["handed_on"])
    client = ctx.client(newcomer)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    assert_same(client.model.state_dict(), ctx.server["handed_on"])
    assert "coldstart_acc_mean" in result.final


@pytest.mark.parametrize("rounds, hops", [(7, 5), (2, 0)])  # 2 rounds: the warm-up, then the personalization
def test_the_declared_budget_is_what_a_mean_client_trains(rounds, hops):
    """warm-up 2 + 1 epoch x (hops over 4 clients + the personalization): 4.25 epochs at 7 rounds."""
    result, engine = run_tiny(**BASE, **{"experiment.rounds": rounds})
    declared = engine.resolved.as_dict["budget"]
    assert declared["private_epochs"] == pytest.approx(2 + hops / 4 + 1)
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(declared["private_epochs"])


# -- lost uploads ----------------------------------------------------------------------------------


def test_with_every_upload_lost_nothing_is_handed_on_and_clients_keep_their_models():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 5, "addons": [{"name": "dropout", "params": {"p": 1.0}}]})
    theta0 = {k: v.clone() for k, v in ctx.models.initial_state("mlp").items()}
    engine.run_round(ctx, 1)
    own = {i: train_reference(ctx, i, theta0, epochs=2) for i in range(4)}
    assert "handed_on" not in ctx.server  # i_3's warm-up model never arrived
    for t, student in ((2, 0), (3, 1)):
        engine.run_round(ctx, t)  # no teacher: plain cross-entropy from the client's own model
        assert_close(weights(ctx, student), train_reference(ctx, student, own[student]), atol=1e-5)
        assert "handed_on" not in ctx.server


def test_a_lost_hop_leaves_the_older_teacher_for_the_next():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6, "addons": [{"name": "dropout", "params": {"p": 0.0}}]})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)  # client 0 hands its model on
    handed = {k: v.clone() for k, v in ctx.server["handed_on"].items()}
    (dropout,) = [p for p in engine.resolved.plugins if p.name == "dropout"]
    dropout.params.p = 1.0
    engine.run_round(ctx, 3)  # client 1 trains, its upload is lost
    assert ctx.server["handed_on_by"] == 0
    assert_same(ctx.server["handed_on"], handed)
    assert far_apart(weights(ctx, 1), handed, PARAMS)  # client 1 kept what it trained
    dropout.params.p = 0.0
    ctx.round = 4
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=2)  # hop 2 learns from client 0's model
    assert_same(message["teacher"], handed)


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("lam", -1.0), ("lam", float("nan")), ("distill_threshold", 1.5),
                                            ("teacher_threshold", -0.1), ("warmup_epochs", 0),
                                            ("warmup_epochs", 1.5), ("lam", "1")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


@pytest.mark.parametrize(("key", "value"), [("experiment.participation", 0.5), ("partition.val_fraction", 0.0)])
def test_a_setting_the_ring_cannot_run_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, key: value}))
    assert info.value.path == key


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "experiment.participation": 0.5}))
    assert line.startswith("pfl-run: error: experiment.participation: metafed picks its own participants")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    # round 4's hop is lost; client 0 copies in both its hops, the others distil
    overrides = {"algorithm.params.warmup_epochs": 1, "training.lr": 0.01, "algorithm.params.distill_threshold": 0.7,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    seq_engine, _ = assert_pool_matches_sequential("metafed", rounds=6, **overrides)
    assert seq_engine.ctx.server["handed_on_by"] == 3 and not seq_engine.ctx.store[0]["distills"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "metafed", "algorithm.params.warmup_epochs": 1, "training.lr": 0.01,
                 "algorithm.params.distill_threshold": 0.7}
    server = assert_killed_run_resumes_identical(tmp_path, empty_store, rounds=5, kill_at=3, **overrides)
    assert server["handed_on_by"] == 2
