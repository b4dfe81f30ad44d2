"""PFL-DA (plugins/pflda): the head distance by hand; three rounds under partial participation with
unequal client sizes recomputed from the method's definition ((P1) the personal head alone on
cross-entropy + lam ||h - g||_2, (P2) the body and the global head on cross-entropy, (P3) the
sample-weighted mean of the uploaded global heads); the pull changes the personal head and is off at
lam = 0; what is evaluated (the personal model, idle clients on the initial one); BatchNorm statistics
stay with the client; lost uploads; bytes and budget; cold start; bad input; process executor and
resume bit-identical."""

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
    prepared,
    refused_at_key,
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
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.pflda import PFLDAParams, head_distance

BASE = {"algorithm.name": "pflda", "model.params.hidden": [8]}
BODY = ["fc1.weight", "fc1.bias"]
HEAD = ["fc2.weight", "fc2.bias"]


def test_the_head_distance_is_the_unsquared_norm_over_all_head_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Linear(1, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    anchor = {"1.weight": torch.tensor([[3.0]]), "1.bias": torch.tensor([4.0])}
    distance = head_distance(model, anchor, ["1.weight", "1.bias"])
    assert distance.item() == pytest.approx(5.0)  # sqrt(3^2 + 4^2), the two tensors together
    distance.backward()  # d/dh ||h - g|| = (h - g) / ||h - g||; the body gets nothing
    assert model[1].weight.grad.item() == pytest.approx(-0.6) and model[1].bias.grad.item() == pytest.approx(-0.8)
    assert model[0].weight.grad is None


# -- three rounds recomputed -------------------------------------------------------------------------


def pull(anchor, lam):
    """(P1)'s loss written out: cross-entropy + lam sqrt(sum (h - g)^2)."""
    def loss(model, x, y, logits):
        params = dict(model.named_parameters())
        squares = sum(((params[k] - anchor[k]) ** 2).sum() for k in HEAD)
        # at h = g (round 1's first step) the norm's subgradient 0: sqrt's own would be inf * 0
        norm = torch.sqrt(squares) if squares.item() > 0 else squares
        return F.cross_entropy(logits, y) + lam * norm
    return loss


def reference_client(ctx, i, personal, g, lam):
    """(b_i', h_i', g_i') from the client's personal model and the global head g."""
    after_p1 = train_reference(ctx, i, personal, trainable=HEAD, loss_fn=pull(g, lam))
    after_p2 = train_reference(ctx, i, {**{k: after_p1[k] for k in BODY}, **g})
    return {**{k: after_p2[k] for k in BODY}, **{k: after_p1[k] for k in HEAD}}, {k: after_p2[k] for k in HEAD}


def test_three_rounds_with_partial_participation_recomputed():
    lam = 0.5
    engine, ctx = prepared(**{**BASE, "algorithm.params.lam": lam, "experiment.participation": 0.75})
    shrink(ctx, {0: 40, 1: 60, 2: 84, 3: 70})  # unequal sizes: the head average is not uniform
    initial = ctx.models.initial_state("mlp")
    personal = {i: {k: initial[k].clone() for k in BODY + HEAD} for i in range(4)}
    g = {k: initial[k].clone() for k in HEAD}
    assert_same(ctx.server["head"], g)
    seen_idle = False
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        participants = list(ctx.participants)
        uploads = {}
        for i in participants:
            new_personal, uploads[i] = reference_client(ctx, i, personal[i], g, lam)
            assert_close(ctx.store[i]["personal"], new_personal, BODY + HEAD, atol=1e-5)
            assert far_apart(new_personal, uploads[i], HEAD)  # the personal head is not the uploaded one
        for i in set(range(4)) - set(participants):  # an idle client keeps its model
            seen_idle = seen_idle or "personal" in ctx.store[i]
            if "personal" in ctx.store[i]:
                assert_same(ctx.store[i]["personal"], personal[i])
        total = sum(ctx.data.clients[i].num_train for i in participants)
        expected = {k: sum(ctx.data.clients[i].num_train / total * uploads[i][k].double() for i in participants).float()
                    for k in HEAD}
        assert_close(ctx.server["head"], expected, atol=1e-5)
        # continue from the run's state (checked above), so float rounding does not drift
        g = {k: v.clone() for k, v in ctx.server["head"].items()}
        personal = {i: {k: v.clone() for k, v in ctx.store[i]["personal"].items()} if "personal" in ctx.store[i]
                    else personal[i] for i in range(4)}
    assert seen_idle  # some client sat out a round after taking part


def test_the_pull_moves_the_personal_head_and_lam_zero_is_plain_cross_entropy():
    heads, gaps = {}, {}
    for lam in (0.0, 2.0):
        engine, ctx = prepared(**{**BASE, "algorithm.params.lam": lam})
        engine.run_round(ctx, 1)
        before = {k: v.clone() for k, v in ctx.store[1]["personal"].items()}
        g = {k: v.clone() for k, v in ctx.server["head"].items()}
        engine.run_round(ctx, 2)  # round 2: h_1 != g from the first step, so the pull acts throughout
        heads[lam] = ctx.store[1]["personal"]
        gaps[lam] = sum(((heads[lam][k] - g[k]) ** 2).sum() for k in HEAD).sqrt()
        if lam == 0.0:  # the personal head trains on plain cross-entropy, body frozen (PFLlib's effective rule)
            assert_close(heads[lam], train_reference(ctx, 1, before, trainable=HEAD), HEAD, atol=1e-6)
    assert far_apart(heads[0.0], heads[2.0], HEAD)
    assert gaps[2.0] < gaps[0.0]  # the pull brings the personal head towards the global head it was given


def test_lam_moves_only_the_personal_heads_the_global_head_and_bodies_are_the_same_bit_for_bit():
    # (P2) never sees h_i, so the shared trajectory does not depend on the pull
    _, weak = run_tiny(**{**BASE, "algorithm.params.lam": 0.0, "experiment.participation": 0.75})
    _, strong = run_tiny(**{**BASE, "algorithm.params.lam": 2.0, "experiment.participation": 0.75})
    assert_same(weak.ctx.server["head"], strong.ctx.server["head"])
    for i in range(4):
        assert_same(weak.ctx.store[i]["personal"], strong.ctx.store[i]["personal"], BODY)
    assert any(far_apart(weak.ctx.store[i]["personal"], strong.ctx.store[i]["personal"], HEAD) for i in range(4))


def test_each_client_is_evaluated_on_its_personal_model():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    initial = ctx.models.initial_state("mlp")
    assert ctx.hooks.evaluation_message(ctx=ctx, client_id=0) == {}
    for i in range(4):
        scored = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        if i in ctx.participants:
            assert_same(scored, ctx.store[i]["personal"], BODY + HEAD)
            assert far_apart(scored, ctx.server["head"], HEAD)  # not the global head
        else:  # never trained: the seeded initial model
            assert_same(scored, initial, BODY + HEAD)


def test_batchnorm_statistics_stay_with_each_client():
    engine, ctx = prepared(**{**BASE, "model.params": {"hidden": [8], "norm": "batch"}})
    engine.run_round(ctx, 1)
    assert set(ctx.server["head"]) == set(HEAD)  # the body, its BatchNorm included, never leaves
    assert far_apart(ctx.store[0]["personal"], ctx.store[1]["personal"], ["bn1.running_mean"])
    scored = evaluated_models(ctx, ctx.client(2))[""].state_dict()
    assert_same(scored, ctx.store[2]["personal"], ["bn1.running_mean", "bn1.running_var"])


def test_only_the_head_travels_and_each_round_is_two_phases_of_local_epochs():
    result, engine = run_tiny(**{**BASE, "training.local_epochs": 2, "experiment.rounds": 2})
    model = engine.ctx.models.working("mlp")
    head_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n in HEAD)
    assert result.final["comm_up_bytes"] == result.final["comm_down_bytes"] == 2 * 4 * head_bytes
    assert result.final["budget.private_epochs"] == pytest.approx(2 * 2 * 2)
    assert resolve(tiny_raw(**{**BASE, "training.local_epochs": 3})).as_dict["budget"]["private_epochs_per_round"] == 6


# -- lost uploads -------------------------------------------------------------------------------------


def test_a_lost_upload_leaves_the_global_head_and_the_client_keeps_its_model():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 4
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    g = {k: v.clone() for k, v in ctx.server["head"].items()}
    personal = {i: {k: v.clone() for k, v in ctx.store[i]["personal"].items()} for i in range(4)
                if "personal" in ctx.store[i]}
    engine.run_round(ctx, 2)
    arrived = [i for i in range(4) if i not in lost]
    uploads = {}
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        start = personal.get(i, {k: initial[k] for k in BODY + HEAD})
        new_personal, uploads[i] = reference_client(ctx, i, start, g, 1.0)
        assert_close(ctx.store[i]["personal"], new_personal, BODY + HEAD, atol=1e-5)  # lost ones too
    total = sum(ctx.data.clients[i].num_train for i in arrived)
    expected = {k: sum(ctx.data.clients[i].num_train / total * uploads[i][k].double() for i in arrived).float()
                for k in HEAD}
    assert_close(ctx.server["head"], expected, atol=1e-5)


def test_a_cold_start_client_adapts_from_the_initial_model_under_the_final_head():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    g = {k: v.clone() for k, v in ctx.server["head"].items()}
    scored = coldstart_models(ctx, ctx.client(newcomer))[""].state_dict()
    initial = ctx.models.initial_state("mlp")
    after_p1 = train_reference(ctx, newcomer, {k: initial[k] for k in BODY + HEAD}, trainable=HEAD, epochs=2,
                               loss_fn=pull(g, 1.0))
    after_p2 = train_reference(ctx, newcomer, {**{k: after_p1[k] for k in BODY}, **g}, epochs=2)
    expected = {**{k: after_p2[k] for k in BODY}, **{k: after_p1[k] for k in HEAD}}
    assert_close(scored, expected, BODY + HEAD, atol=1e-5)
    assert far_apart(scored, initial, BODY + HEAD)
    assert "personal" not in ctx.store[newcomer]


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.75,
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]},
                                       {"model.params": {"hidden": [8], "norm": "batch"},
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]}],
                         ids=["partial-dropout", "batchnorm-dropout"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("pflda", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "pflda", "experiment.participation": 0.5,
                 "model.params": {"hidden": [8], "norm": "batch"}}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert set(ref_server["head"]) == set(HEAD)


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -0.1), ("lam", float("nan")), ("lam", float("inf")), ("lam", "1"),
                                       ("head_layers", 0), ("head_layers", 1.5)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_a_head_that_leaves_no_body_is_refused_at_its_key(tmp_path, capsys):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "algorithm.params.head_layers": 2}))  # the mlp [8] has 2 layers
    assert info.value.path == "algorithm.params.head_layers"
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.head_layers": 2}))
    assert line.startswith("pfl-run: error: algorithm.params.head_layers: 2 head layers is outside")
    engine, ctx = prepared(**{**BASE, "model.params.hidden": [8, 8], "algorithm.params.head_layers": 2})
    two_layers = ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert list(ctx.server["head"]) == two_layers  # 3 layers: the last two form the head
    engine.run_round(ctx, 1)
    assert far_apart(ctx.store[0]["personal"], ctx.server["head"], two_layers)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.lam": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.lam:")


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "same architecture" in info.value.message


def test_defaults_are_pfllibs():
    p = PFLDAParams()
    assert (p.lam, p.head_layers) == (1.0, 1)
