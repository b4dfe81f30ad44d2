"""pFedSim (plugins/pfedsim): the classifier similarity and the -log(1 - s) weights by hand; the
warm-up rounds are FedAvg bit for bit; each later round sends every participant the similarity
mix of the clients' last extractors, recomputed by hand over several rounds (stale extractors and
similarities kept), which it trains with its own classifier; what is evaluated; lost uploads;
cold start; the process executor and resume bit-identical; bad input."""

import math
import os

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    prepared,
    record_messages,
    refused_at_key,
    train_reference,
)
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import tiny_raw

from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.pfedsim import PFedSimParams, classifier_similarity, mixing_weights

BASE = {"algorithm.name": "pfedsim", "experiment.rounds": 6, "algorithm.params.warmup_rounds": 1}
EXTRACTOR = ["fc1.weight", "fc1.bias"]
HEAD = ["fc2.weight", "fc2.bias"]
LAM = 0.9999


# -- by hand ----------------------------------------------------------------------------------------------


def test_the_similarity_is_the_mean_cosine_of_the_classifier_rows_floored_at_zero():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    b = torch.tensor([[1.0, 1.0], [0.0, 5.0]])  # row cosines 1/sqrt(2) and 1
    assert classifier_similarity(a, b) == pytest.approx((2 ** -0.5 + 1) / 2)
    c = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])  # cosines -1 and 1: mean 0
    assert classifier_similarity(a, c) == pytest.approx(0.0, abs=1e-12)
    assert classifier_similarity(a, -b) == 0.0  # a negative mean counts as unrelated
    conv = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # (2, 1, 1, 2): one row per output channel
    assert classifier_similarity(conv, conv.flip(-1)) == 0.0


def test_the_weights_are_minus_log_one_minus_s_with_lam_for_the_client_itself():
    row = torch.tensor([0.3, 0.5, 0.0, 0.75], dtype=torch.float64)  # row of client 0; s_00 is ignored
    w = mixing_weights(row, 0, LAM)
    v = [-math.log(1 - LAM), math.log(2), 0.0, math.log(4)]
    assert w.tolist() == pytest.approx([x / sum(v) for x in v])
    w = mixing_weights(row, 0, 0.5)  # lam is the client's own similarity; 0.75 is capped at it: log 2 each
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])
    assert mixing_weights(torch.tensor([0.0, 0.9, 0.0], dtype=torch.float64), 1, LAM) is None  # nobody similar
    capped = mixing_weights(torch.tensor([1.0, 0.0], dtype=torch.float64), 1, LAM)  # s = 1: not infinite
    assert capped.tolist() == pytest.approx([0.5, 0.5])


# -- the rounds -------------------------------------------------------------------------------------------


def similarity_by_hand(a, b):
    a, b = a.double(), b.double()
    cosines = [float(a[c] @ b[c]) / float(a[c].norm() * b[c].norm()) for c in range(a.shape[0])]
    return max(0.0, sum(cosines) / len(cosines))


def mix_by_hand(s, i, extractors, lam=LAM):
    """phi_bar_i written out: v_ij = -log(1 - min(s_ij, lam)), v_ii = -log(1 - lam)."""
    n = len(extractors)
    v = [-math.log(1 - lam) if j == i else -math.log(1 - min(float(s[i][j]), lam)) for j in range(n)]
    if all(v[j] == 0 for j in range(n) if j != i):
        return extractors[i]
    return {k: sum(v[j] / sum(v) * extractors[j][k].double() for j in range(n)).float() for k in EXTRACTOR}


def test_the_warmup_rounds_are_fedavg_bit_for_bit():
    overrides = {**BASE, "algorithm.params.warmup_rounds": 2, "experiment.participation": 0.5}
    engine, ctx = prepared(**overrides)
    broadcasts = record_messages(ctx, "on_broadcast")
    ref_engine, ref = prepared(**{**{k: v for k, v in overrides.items() if not k.startswith("algorithm.params")},
                                  "algorithm.name": "fedavg"})
    for r in (1, 2):
        engine.run_round(ctx, r)
        ref_engine.run_round(ref, r)
        assert ctx.participants == ref.participants and len(ctx.participants) == 2
    assert_same(ctx.server["global"], ref.server["global"])
    assert all(set(m) == {"weights"} for m in broadcasts.values())
    assert ctx.server["extractors"] == {} and not ctx.server["similarity"].any()
    assert all("model" not in ctx.store[i] for i in range(4))
    scored = evaluated_models(ctx, ctx.client(3))[""].state_dict()
    assert_same(scored, ctx.server["global"])


def test_each_round_mixes_the_last_extractors_by_classifier_similarity_and_trains_them_with_the_own_classifier():
    """Half the clients a round, five personalisation rounds: every broadcast is recomputed from the
    similarities and extractors the server held before the round (kept across rounds a client or
    a pair sat out), every participant trains it with the classifier it trained last (the
    warm-up's the first time), and the round's pairs get the cosine of their new classifiers."""
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    warmup = {k: v.clone() for k, v in ctx.server["global"].items()}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    mixed, kept_pair, own_head_used = False, False, False
    for r in range(2, 7):
        s = ctx.server["similarity"].clone()
        extractors = [dict(ctx.server["extractors"].get(j, warmup)) for j in range(4)]
        delivered = set(ctx.server["extractors"])
        models = {i: dict(ctx.store[i]["model"]) for i in range(4) if "model" in ctx.store[i]}
        broadcasts.clear()
        uploads.clear()
        engine.run_round(ctx, r)
        assert len(ctx.participants) == 2
        for i in ctx.participants:
            expected = mix_by_hand(s, i, extractors)
            assert_close(broadcasts[i]["extractor"], expected, EXTRACTOR, atol=1e-6)
            if mix_by_hand(s, i, extractors) is not extractors[i]:
                mixed = True
                assert far_apart(expected, extractors[i], EXTRACTOR)
            assert ("classifier" in broadcasts[i]) == (i not in delivered)
            head = models.get(i, warmup)
            own_head_used |= i in models and far_apart(models[i], warmup, HEAD)
            trained = train_reference(ctx, i, {**expected, **{k: head[k] for k in HEAD}})
            assert_close(uploads[i]["extractor"], trained, EXTRACTOR, atol=1e-5)
            assert torch.allclose(uploads[i]["classifier"], trained["fc2.weight"], atol=1e-5)
            assert_close(ctx.store[i]["model"], trained, atol=1e-5)  # the client keeps its whole model
            assert_same(ctx.server["extractors"][i], uploads[i]["extractor"])
        a, b = ctx.participants
        assert ctx.server["similarity"][a, b] == ctx.server["similarity"][b, a] == pytest.approx(
            similarity_by_hand(uploads[a]["classifier"], uploads[b]["classifier"]), abs=1e-9)
        for i in range(4):
            for j in range(4):
                if {i, j} != {a, b}:
                    assert ctx.server["similarity"][i, j] == s[i, j]
                    kept_pair |= i != j and bool(s[i, j] > 0)
            if i not in ctx.participants and i in delivered:
                assert_same(ctx.server["extractors"][i], extractors[i])
    assert mixed and kept_pair and own_head_used  # the test reached every case it checks


def test_a_client_with_no_similar_client_gets_back_its_own_last_extractor():
    """One client a round: no pair ever delivers together, so s stays 0 and a client that comes
    back receives the extractor it uploaded last (not the warm-up's, not a mean)."""
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 10, "experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    last, returned = {}, False
    for r in range(2, 11):
        broadcasts.clear()
        uploads.clear()
        engine.run_round(ctx, r)
        (i,) = ctx.participants
        if i in last:
            assert_same(broadcasts[i]["extractor"], last[i])
            assert far_apart(last[i], ctx.server["global"], EXTRACTOR)
            returned = True
        last[i] = uploads[i]["extractor"]
    assert returned and not ctx.server["similarity"].any()


def test_each_client_is_scored_with_the_model_it_trained_last():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    for r in (1, 2):
        engine.run_round(ctx, r)
    trained = [i for i in range(4) if i in ctx.server["extractors"]]
    untrained = [i for i in range(4) if i not in trained]
    assert trained and untrained
    for i in trained:  # its last trained model, not its next mix
        assert ctx.hooks.evaluation_message(ctx=ctx, client_id=i) == {}
        scored = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(scored, ctx.store[i]["model"])
        next_mix = ctx.hooks.on_broadcast(ctx=ctx, client_id=i)["extractor"]
        assert far_apart(scored, next_mix, EXTRACTOR) and far_apart(scored, ctx.server["global"], HEAD)
    for i in untrained:  # the warm-up's model
        assert_same(evaluated_models(ctx, ctx.client(i))[""].state_dict(), ctx.server["global"])


def test_warmup_rounds_none_is_half_the_rounds():
    engine, ctx = prepared(**{"algorithm.name": "pfedsim", "experiment.rounds": 5})
    broadcasts = record_messages(ctx, "on_broadcast")
    for r in (1, 2):
        engine.run_round(ctx, r)
        assert all(set(m) == {"weights"} for m in broadcasts.values())
    engine.run_round(ctx, 3)  # P = 5 // 2 = 2
    assert all("extractor" in broadcasts[i] for i in range(4))
    assert ctx.resolved_values["warmup_rounds"] == 2


# -- lost uploads, cold start -------------------------------------------------------------------------------


def test_a_lost_upload_leaves_the_server_as_it_was_and_the_client_keeps_what_it_trained():
    lost2 = [i for i in range(4) if upload_is_lost(0, 2, i, 0.5)]
    lost3 = [i for i in range(4) if upload_is_lost(0, 3, i, 0.5)]
    assert lost2 == [1, 2] and lost3 == [0]  # seed 0
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 0.5}}])
    engine.run_round(ctx, 1)
    warmup = {k: v.clone() for k, v in ctx.server["global"].items()}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    assert set(ctx.server["extractors"]) == {0, 3}
    s = ctx.server["similarity"]
    assert s[0, 3] > 0 and not s[1].any() and not s[2].any()  # set between delivered uploads only
    for i in lost2:  # it trained: it keeps its model and is scored with it
        assert torch.equal(ctx.store[i]["model"]["fc2.weight"], uploads[i]["classifier"])
        assert_same(evaluated_models(ctx, ctx.client(i))[""].state_dict(), ctx.store[i]["model"])
    s2 = s.clone()
    extractors = [dict(ctx.server["extractors"].get(j, warmup)) for j in range(4)]
    heads = {i: {k: ctx.store[i]["model"][k].clone() for k in HEAD} for i in range(4)}
    theta0 = dict(ctx.server["extractors"][0])
    broadcasts.clear()
    uploads.clear()
    engine.run_round(ctx, 3)
    for i in lost2:  # the server sends the warm-up classifier again; the client trains its own
        assert_same(broadcasts[i]["classifier"], warmup, HEAD)
        assert far_apart(heads[i], warmup, HEAD)
        trained = train_reference(ctx, i, {**mix_by_hand(s2, i, extractors), **heads[i]})
        assert_close(uploads[i]["extractor"], trained, EXTRACTOR, atol=1e-5)
    # client 0's round-3 upload was lost: phi_0 and s_0j stay; the delivered pairs are set
    assert_same(ctx.server["extractors"][0], theta0)
    assert far_apart(uploads[0]["extractor"], theta0, EXTRACTOR)
    assert ctx.server["similarity"][0, 3] == s2[0, 3] and not ctx.server["similarity"][0, 1:3].any()
    assert ctx.server["similarity"][1, 2] > 0 and ctx.server["similarity"][1, 3] > 0
    assert ctx.server["similarity"][0, 3] != ctx.server["similarity"][2, 3]


def test_a_cold_start_client_receives_the_warmup_model():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    assert_same(message["extractor"], ctx.server["global"], EXTRACTOR)
    assert_same(message["classifier"], ctx.server["global"], HEAD)
    assert ctx.server["similarity"].shape == (3, 3)


# -- bit identity: process executor, resume ---------------------------------------------------------------


def test_the_process_pool_is_bit_identical_to_the_sequential_loop():
    sequential, _ = assert_pool_matches_sequential("pfedsim", rounds=4, **{
        "experiment.participation": 0.75, "algorithm.params.warmup_rounds": 1},
        addons=[{"name": "dropout", "params": {"p": 0.5}}])
    assert sequential.ctx.server["similarity"].any()  # some extractor was a mix


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "pfedsim", "algorithm.params": {"warmup_rounds": 1},
                 "addons": [{"name": "dropout", "params": {"p": 0.5}}]}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["extractors"] and ref_server["similarity"].any()  # what the killed run had to resume


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("warmup_rounds", -1), ("warmup_rounds", 1.5), ("warmup_rounds", "2"),
                                       ("self_similarity", 0.0), ("self_similarity", 1.0),
                                       ("self_similarity", float("nan")), ("self_similarity", "0.9")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_warming_up_every_round_is_refused(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.warmup_rounds": 6}))
    assert line.startswith("pfl-run: error: algorithm.params.warmup_rounds:")
    assert "less than experiment.rounds (6)" in line


def test_defaults_are_fl_benchs():
    p = PFedSimParams()
    assert (p.warmup_rounds, p.self_similarity) == (None, 0.9999)
