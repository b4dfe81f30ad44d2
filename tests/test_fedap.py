"""FedAP (plugins/fedap): the BatchNorm-input statistics, the distance and the weight matrix by hand;
the pre-training rounds are FedBN bit for bit; round P + 1 takes every client, which measures on
the pre-trained model (recomputed independently) and trains from it; later rounds broadcast
sum_j w_ij theta_j of each client's last upload, over several rounds; BatchNorm layers stay with
the client; what is evaluated; lost uploads (statistics resent, theta_i kept); cold start; the
process executor and resume bit-identical; bad input."""

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
    record_messages,
    refused_at_key,
    train_reference,
)
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
from pfl_plugins.fedap import FedAPParams, batchnorm_input_statistics, mixing_matrix, statistics_distance

BN_MLP = {"model.params": {"hidden": [16], "norm": "batch"}}
BASE = {"algorithm.name": "fedap", **BN_MLP, "experiment.rounds": 5, "algorithm.params.pretrain_rounds": 1}
SHARED = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
BN = ["bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]


def stats(*layers):
    """{"l0": {"mean", "std"}, ...} from (mean list, std list) pairs."""
    return {f"l{n}": {"mean": torch.tensor(m), "std": torch.tensor(s)} for n, (m, s) in enumerate(layers)}


# -- by hand ----------------------------------------------------------------------------------------------


def test_the_distance_sums_each_layers_wasserstein_distance():
    a = stats(([0.0, 0.0], [1.0, 1.0]), ([0.0], [1.0]))
    b = stats(([3.0, 0.0], [1.0, 5.0]), ([1.0], [1.0]))
    # layer 0: sqrt(3^2 + 4^2) = 5; layer 1: sqrt(1) = 1 (sqrt of the sum over both layers: 5.10)
    assert statistics_distance(a, b) == pytest.approx(6.0)
    assert statistics_distance(a, a) == 0.0


def test_the_weights_are_inverse_distances_scaled_to_one_minus_lam_with_lam_on_the_diagonal():
    s = {0: stats(([0.0], [1.0])), 1: stats(([1.0], [1.0])), 2: stats(([3.0], [1.0]))}  # d01 = 1, d02 = 3, d12 = 2
    w = mixing_matrix([0, 1, 2], s, lam=0.5)
    expected = torch.tensor([[0.5, 0.375, 0.125],  # 1/1 : 1/3 = 3 : 1 of the 0.5
                             [1 / 3, 0.5, 1 / 6],  # 1/1 : 1/2
                             [0.2, 0.3, 0.5]], dtype=torch.float64)  # 1/3 : 1/2 = 2 : 3
    assert torch.allclose(w, expected, atol=1e-12)
    w = mixing_matrix([0, 1, 2], s, lam=0.2)  # lam is the self-weight, not a share of the others'
    assert torch.allclose(w[0], torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64), atol=1e-12)


def test_a_client_at_distance_zero_takes_all_the_others_weight_and_unmeasured_clients_fall_back():
    s = {0: stats(([0.0], [1.0])), 1: stats(([0.0], [1.0])), 2: stats(([3.0], [1.0]))}
    w = mixing_matrix([0, 1, 2], s, lam=0.5)
    assert w[0].tolist() == [0.5, 0.5, 0.0] and w[1].tolist() == [0.5, 0.5, 0.0]
    assert w[2].tolist() == pytest.approx([0.25, 0.25, 0.5])  # equal distances: equal shares
    s = {0: stats(([0.0], [1.0])), 1: stats(([2.0], [1.0]))}  # client 2 not measured yet
    w = mixing_matrix([0, 1, 2], s, lam=0.5)
    assert w[0].tolist() == [0.5, 0.5, 0.0]  # measured rows: only the measured clients
    assert w[2].tolist() == [0.25, 0.25, 0.5]  # unmeasured row: the others equally
    assert mixing_matrix([7], {}, lam=0.3).tolist() == [[1.0]]


def test_the_statistics_are_of_each_batchnorm_layers_input_in_eval_mode():
    first, second = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    with torch.no_grad():
        first.running_mean.copy_(torch.tensor([1.0, 0.0]))
        first.running_var.copy_(torch.tensor([4.0, 1.0]))
        first.eps = 0.0
    model = nn.Sequential(first, second)
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [7.0, 6.0]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = batchnorm_input_statistics(model, x, batch_size=3)  # two batches, pooled exactly
    assert torch.allclose(out["0"]["mean"], torch.tensor([4.0, 3.0]))
    assert torch.allclose(out["0"]["std"], torch.tensor([5.0, 5.0]).sqrt())  # population variance 5
    # the second layer sees the first's eval-mode output: (x - 1) / 2 and x / 1
    assert torch.allclose(out["1"]["mean"], torch.tensor([1.5, 3.0]))
    assert torch.allclose(out["1"]["std"], torch.tensor([1.25, 5.0]).sqrt())
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    conv = nn.Sequential(nn.BatchNorm2d(1))  # a 4-D input: per channel over batch and space
    out = batchnorm_input_statistics(conv, torch.tensor([[[[0.0, 2.0]]], [[[4.0, 6.0]]]]))
    assert out["0"]["mean"].tolist() == [3.0] and out["0"]["std"].tolist() == pytest.approx([5.0 ** 0.5])


# -- the rounds -------------------------------------------------------------------------------------------


def bn_input_reference(ctx, client_id, state):
    """mean and population std of fc1(x) over the client's training split, written out."""
    z = F.linear(ctx.data.clients[client_id].train_x.flatten(1), state["fc1.weight"], state["fc1.bias"])
    return {"bn1": {"mean": z.mean(0), "std": z.var(0, unbiased=False).sqrt()}}


def weights_by_hand(statistics, lam):
    """Row i: lam for itself, the other (1 - lam) by inverse distance (every client measured)."""
    n = len(statistics)

    def distance(a, b):
        return float(((a["bn1"]["mean"] - b["bn1"]["mean"]) ** 2).sum()
                     + ((a["bn1"]["std"] - b["bn1"]["std"]) ** 2).sum()) ** 0.5

    rows = []
    for i in range(n):
        inverse = [0.0 if j == i else 1 / distance(statistics[i], statistics[j]) for j in range(n)]
        rows.append([lam if j == i else (1 - lam) * inverse[j] / sum(inverse) for j in range(n)])
    return torch.tensor(rows, dtype=torch.float64)


def mix_by_hand(w_row, models):
    return {k: sum(float(w_row[j]) * models[j][k].double() for j in range(len(models))).float() for k in SHARED}


def test_the_pretraining_rounds_are_fedbn_bit_for_bit():
    overrides = {**BASE, "algorithm.params.pretrain_rounds": 2, "experiment.participation": 0.5}
    engine, ctx = prepared(**overrides)
    broadcasts = record_messages(ctx, "on_broadcast")
    fedbn_overrides = {k: v for k, v in overrides.items() if not k.startswith("algorithm.params")}
    ref_engine, ref = prepared(**{**fedbn_overrides, "algorithm.name": "fedbn"})
    for r in (1, 2):
        engine.run_round(ctx, r)
        ref_engine.run_round(ref, r)
        assert ctx.participants == ref.participants and len(ctx.participants) == 2
    assert_same(ctx.server["global"], ref.server["global"])
    for i in range(4):
        assert (i in ctx.store and "personal" in ctx.store[i]) == (i in ref.store and "personal" in ref.store[i])
        if "personal" in ref.store[i]:
            assert_same(ctx.store[i]["personal"], ref.store[i]["personal"])
    assert all(set(m) == {"weights"} and set(m["weights"]) == set(SHARED) for m in broadcasts.values())
    assert ctx.server["statistics"] == {} and ctx.server["models"] == {}
    model = evaluated_models(ctx, ctx.client(3))[""]  # FedBN's evaluated model while pre-training
    assert_same(model.state_dict(), {k: ctx.server["global"][k] for k in SHARED}, SHARED)


def test_round_p_plus_1_takes_everyone_who_measures_on_the_pretrained_model_and_trains_from_it():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    assert len(ctx.participants) == 2
    pretrained = {k: ctx.server["global"][k].clone() for k in SHARED}
    personal = {i: dict(ctx.store[i].get("personal", {})) for i in range(4)}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    assert ctx.participants == [0, 1, 2, 3]  # despite participation = 0.5
    initial = ctx.models.initial_state("mlp")
    measured = {}
    for i in range(4):
        assert broadcasts[i]["measure"] is True
        assert_same(broadcasts[i]["weights"], pretrained, SHARED)
        start = {**initial, **(personal[i] or {}), **pretrained}
        measured[i] = bn_input_reference(ctx, i, start)
        assert_close(uploads[i]["statistics"]["bn1"], measured[i]["bn1"], atol=1e-5)
        assert_close(ctx.store[i]["statistics"]["bn1"], measured[i]["bn1"], atol=1e-5)  # kept by the client
        assert set(uploads[i]["weights"]) == set(SHARED)  # BatchNorm layers never leave the client
        trained = train_reference(ctx, i, start)
        assert_close(uploads[i]["weights"], trained, SHARED, atol=1e-6)
        assert_close(ctx.server["models"][i], trained, SHARED, atol=1e-6)
        assert_close(ctx.store[i]["personal"], trained, BN, atol=1e-6)
    assert far_apart(measured[0]["bn1"], measured[1]["bn1"], ["mean"])
    assert torch.allclose(ctx.server["mixing"], weights_by_hand(measured, 0.5), atol=1e-5)
    assert not torch.allclose(ctx.server["mixing"][0, 1:], torch.full((3,), 0.5 / 3, dtype=torch.float64),
                              atol=1e-3)  # not the uniform fallback


def test_later_rounds_send_each_client_its_weighted_mix_of_everyones_last_upload():
    """Half the clients a round after the measuring round: theta_j is client j's last upload (not
    a sum, not the round's), W is measured once and kept; checked over three rounds."""
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    w = ctx.server["mixing"].clone()
    last = {j: dict(ctx.server["models"][j]) for j in range(4)}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    stale = set()
    for r in (3, 4, 5):
        broadcasts.clear()
        uploads.clear()
        engine.run_round(ctx, r)
        assert len(ctx.participants) == 2
        models = [last[j] for j in range(4)]
        for i in ctx.participants:
            assert "measure" not in broadcasts[i] and "statistics" not in uploads[i]
            expected = mix_by_hand(w[i], models)
            assert_close(broadcasts[i]["weights"], expected, SHARED, atol=1e-6)
            assert far_apart(expected, models[i], SHARED)  # a mix, not theta_i
        for j in range(4):
            if j in ctx.participants:
                last[j] = {k: uploads[j]["weights"][k].clone() for k in SHARED}
            else:
                stale.add(j)
            assert_same(ctx.server["models"][j], last[j], SHARED)
        assert torch.equal(ctx.server["mixing"], w)
    assert stale  # some theta_j was kept across a round its client sat out


def test_a_participant_trains_its_mix_with_its_own_batchnorm_layers():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    w, models = ctx.server["mixing"].clone(), [dict(ctx.server["models"][j]) for j in range(4)]
    personal = {i: dict(ctx.store[i]["personal"]) for i in range(4)}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 3)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        start = {**initial, **personal[i], **mix_by_hand(w[i], models)}
        trained = train_reference(ctx, i, start)
        assert_close(uploads[i]["weights"], trained, SHARED, atol=1e-5)
        assert_close(ctx.store[i]["personal"], trained, BN, atol=1e-5)
    assert far_apart(ctx.store[0]["personal"], ctx.store[1]["personal"], ["bn1.running_mean"])


def test_each_client_is_evaluated_with_its_mix_and_its_own_batchnorm_layers():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    w, models = ctx.server["mixing"], [ctx.server["models"][j] for j in range(4)]
    for i in range(4):  # participants and idle clients alike, no local steps
        scored = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_close(scored, mix_by_hand(w[i], models), SHARED, atol=1e-6)
        assert_same(scored, ctx.store[i]["personal"], BN)


def test_pretrain_rounds_none_is_half_the_rounds():
    engine, ctx = prepared(**{"algorithm.name": "fedap", **BN_MLP, "experiment.rounds": 5,
                              "experiment.participation": 0.5})
    broadcasts = record_messages(ctx, "on_broadcast")
    for r in (1, 2):
        engine.run_round(ctx, r)
        assert len(ctx.participants) == 2 and not any("measure" in m for m in broadcasts.values())
    engine.run_round(ctx, 3)  # P = 5 // 2 = 2
    assert ctx.participants == [0, 1, 2, 3] and all(broadcasts[i]["measure"] for i in range(4))
    assert ctx.resolved_values["pretrain_rounds"] == 2


# -- lost uploads, cold start -------------------------------------------------------------------------------


def test_lost_statistics_are_resent_from_what_the_client_kept_and_a_lost_model_stays():
    lost2 = [i for i in range(4) if upload_is_lost(0, 2, i, 0.5)]
    lost3 = [i for i in range(4) if upload_is_lost(0, 3, i, 0.5)]
    assert lost2 == [1, 2] and lost3 == [0]  # seed 0: the measuring round loses 1 and 2; round 3 only 0
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 0.5}}])
    engine.run_round(ctx, 1)
    pretrained = {k: ctx.server["global"][k].clone() for k in SHARED}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    assert set(ctx.server["statistics"]) == {0, 3} and set(ctx.server["models"]) == {0, 3}
    kept = {i: {k: v.clone() for k, v in ctx.store[i]["statistics"]["bn1"].items()} for i in range(4)}
    theta0 = {k: v.clone() for k, v in ctx.server["models"][0].items()}
    w = ctx.server["mixing"]
    assert w[1].tolist() == pytest.approx([0.5 / 3, 0.5, 0.5 / 3, 0.5 / 3])  # unmeasured: the others equally
    assert w[0, 1] == w[0, 2] == 0 and w[0, 3] == pytest.approx(0.5)  # measured: only the measured
    broadcasts.clear()
    uploads.clear()
    engine.run_round(ctx, 3)
    for i in range(4):
        assert ("measure" in broadcasts[i]) == (i in lost2)
        assert ("statistics" in uploads[i]) == (i in lost2)
    for i in lost2:  # the statistics measured on the pre-trained model, not on this round's mix
        assert_same(uploads[i]["statistics"]["bn1"], kept[i])
        assert far_apart(bn_input_reference(ctx, i, broadcasts[i]["weights"])["bn1"], kept[i], ["mean"])
    assert set(ctx.server["statistics"]) == {0, 1, 2, 3}
    full = {i: {"bn1": ctx.server["statistics"][i]["bn1"]} for i in range(4)}
    assert torch.allclose(ctx.server["mixing"], weights_by_hand(full, 0.5), atol=1e-5)
    # client 0's round-3 upload was lost: theta_0 is still its round-2 upload; received ones moved
    assert_same(ctx.server["models"][0], theta0, SHARED)
    assert far_apart(uploads[0]["weights"], theta0, SHARED) and far_apart(theta0, pretrained, SHARED)
    for i in (1, 2, 3):
        assert_same(ctx.server["models"][i], uploads[i]["weights"], SHARED)


def test_a_cold_start_client_receives_the_uniform_mean_of_the_clients_models():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    for r in (1, 2):
        engine.run_round(ctx, r)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    assert "measure" not in message and ctx.server["mixing"].shape == (3, 3)
    models = [ctx.server["models"][j] for j in ctx.training_clients]
    assert_close(message["weights"], {k: sum(m[k] for m in models) / 3 for k in SHARED}, atol=1e-6)


# -- bit identity: process executor, resume ---------------------------------------------------------------


def test_the_process_pool_is_bit_identical_to_the_sequential_loop():
    assert_pool_matches_sequential("fedap", rounds=4, **BN_MLP, **{
        "experiment.participation": 0.5, "algorithm.params.pretrain_rounds": 1},
        addons=[{"name": "dropout", "params": {"p": 0.5}}])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedap", "algorithm.params": {"pretrain_rounds": 1}, **BN_MLP,
                 "experiment.participation": 0.5, "addons": [{"name": "dropout", "params": {"p": 0.5}}]}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["statistics"] and ref_server["models"]  # what the killed run had to resume


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("model_momentum", -0.1), ("model_momentum", 1.5),
                                       ("model_momentum", float("nan")), ("model_momentum", "0.5"),
                                       ("pretrain_rounds", -1), ("pretrain_rounds", 1.5)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_pretraining_every_round_is_refused(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.pretrain_rounds": 5}))
    assert "algorithm.params.pretrain_rounds" in line and "less than experiment.rounds (5)" in line


@pytest.mark.parametrize("model,key", [({"model.params": {"hidden": [16]}}, "model.params.norm"),
                                       ({"model.name": "lenet5", "model.params": {}}, "model.params.norm")])
def test_a_model_without_batchnorm_is_refused_naming_the_key(tmp_path, capsys, model, key):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, **model}))
    assert line.startswith(f"pfl-run: error: {key}:") and "no BatchNorm" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "same architecture" in info.value.message


def test_defaults_are_the_references():
    p = FedAPParams()
    assert (p.model_momentum, p.pretrain_rounds) == (0.5, None)
