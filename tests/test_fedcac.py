"""FedCAC (plugins/fedcac): the critical-parameter selection (S2), the overlap rates (S3), the
rising threshold and the collaborators (S4) and the merged start model by hand; three engine
rounds under partial participation recomputed (masks from the merged start model, customised
models over the collaborators, the global model, the threshold at each round: an off-by-one
round changes it, and round 3 passes beta so the critical parameters stop being shared); tau = 0
is FedAvg bit for bit; what is evaluated; BatchNorm statistics stay with the client; lost uploads
change nothing on the server; bytes; bad input; process executor and resume bit-identical."""

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
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedcac import FedCACParams, collaborators, critical_mask, overlap_rates, start_model

BASE = {"algorithm.name": "fedcac", "model.params.hidden": [8], "algorithm.params.beta": 2}
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


# -- the pieces by hand ------------------------------------------------------------------------------


def test_the_critical_entries_are_the_top_tau_sensitivities_of_each_tensor():
    start = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    trained = torch.tensor([2.0, 0.5, 1.0, -1.0, 3.0])
    # s = |(w' - w) w'| = 2, 0.25, 0, 2, 6
    assert critical_mask(start, trained, 0.2).tolist() == [False, False, False, False, True]  # k = 1
    # k = int(0.4 * 5) = 2: the 2nd largest is 2, and the tie at 2 is critical too
    assert critical_mask(start, trained, 0.4).tolist() == [True, False, False, True, True]
    assert critical_mask(start, trained, 0.8).tolist() == [True, True, False, True, True]  # k = 4
    assert not critical_mask(start, trained, 0.1).any()  # k = int(0.5) = 0: none
    assert critical_mask(start, trained, 1.0).tolist() == [True, True, False, True, True]  # the 5th is 0
    # the shape is the tensor's
    assert critical_mask(start.view(5, 1), trained.view(5, 1), 0.2).shape == (5, 1)


def test_when_most_of_a_tensor_did_not_move_every_entry_that_moved_is_critical():
    start = torch.zeros(10)
    trained = torch.zeros(10)
    trained[3] = 1e-3  # s = 1e-6 at entry 3, 0 elsewhere: the 5th largest is 0
    assert critical_mask(start, trained, 0.5).nonzero().flatten().tolist() == [3]
    assert not critical_mask(start, torch.zeros(10), 0.5).any()  # nothing moved: nothing is sensitive
    trained = torch.full((10,), 1e-3)  # every s = 1e-6 > 1e-10: the ordinary rule, all tied
    assert critical_mask(start, trained, 0.5).all()


def test_the_sensitivity_weighs_the_change_by_the_trained_value():
    start = torch.tensor([0.0, 10.0])
    trained = torch.tensor([1.0, 9.5])  # changes 1 and -0.5, but s = 1 and 4.75
    assert critical_mask(start, trained, 0.5).tolist() == [False, True]


def test_overlap_rates_by_hand():
    masks = [{"a": torch.tensor([1, 1, 0, 0], dtype=torch.bool), "b": torch.tensor([True])},
             {"a": torch.tensor([1, 0, 1, 0], dtype=torch.bool), "b": torch.tensor([True])},
             {"a": torch.tensor([0, 0, 0, 0], dtype=torch.bool), "b": torch.tensor([True])},
             {"a": torch.tensor([0, 0, 0, 0], dtype=torch.bool), "b": torch.tensor([False])}]
    rates = overlap_rates(masks)
    # |m_0| = 3, |m_0 - m_1| = 2: 1 - 2/6; |m_0 - m_2| = 2: 1 - 2/6; |m_0 - m_3| = 3: 1 - 3/6
    assert rates[0] == [None, pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(0.5)]
    # |m_2| = 1: 1 - 2/2 = 0 to clients 0 and 1, 1 - 1/2 to client 3: not symmetric
    assert rates[2] == [pytest.approx(0.0), pytest.approx(0.0), None, pytest.approx(0.5)]
    assert rates[3] == [0.0, 0.0, 0.0, None]  # an empty mask: no overlap


def test_the_threshold_rises_with_the_round_and_picks_the_collaborators():
    rates = [[None, 0.9, 0.5],
             [0.8, None, 0.2],
             [0.4, 0.6, None]]
    # mean of the 6 rates = 3.4 / 6, max 0.9
    mean = 3.4 / 6
    groups, threshold = collaborators(rates, 1, 4)  # T = mean + (0.9 - mean) / 4 = 0.65
    assert threshold == pytest.approx(mean + (0.9 - mean) / 4)
    assert groups == [[0, 1], [1, 0], [2]]
    groups, threshold = collaborators(rates, 0, 4)  # at t = 0 the threshold would be the mean
    assert groups == [[0, 1], [1, 0], [2, 1]]
    groups, threshold = collaborators(rates, 3, 4)  # T = mean + 3/4 (0.9 - mean) = 0.8175
    assert groups == [[0, 1], [1], [2]]
    groups, threshold = collaborators(rates, 5, 4)  # past beta: above the largest rate
    assert threshold > 0.9 and groups == [[0], [1], [2]]
    assert collaborators([[None]], 3, 4) == ([[0]], None)  # one arrival: itself


def test_the_start_model_takes_the_critical_entries_from_the_customised_model():
    w = {"a": torch.tensor([1.0, 2.0, 3.0])}
    u = {"a": torch.tensor([10.0, 20.0, 30.0])}
    m = {"a": torch.tensor([True, False, True])}
    assert start_model(w, u, m)["a"].tolist() == [10.0, 2.0, 30.0]
    assert start_model(w, None, None) is w  # before its first upload: the global model


# -- three rounds recomputed ---------------------------------------------------------------------------


def reference_mask(start, trained, tau):
    """(S2) written out with a sort instead of topk."""
    s = ((trained - start) * trained).abs().flatten().tolist()
    k = int(tau * len(s))
    if k == 0:
        return torch.zeros(trained.shape, dtype=torch.bool)
    kth = sorted(s, reverse=True)[k - 1]
    chosen = [v >= kth for v in s] if kth > 1e-10 else [v > 1e-20 for v in s]
    return torch.tensor(chosen).view(trained.shape)


def reference_round(ctx, round, participants, theta, customized, critical, tau, beta, trained=None):
    """What one round should give: (masks, groups, threshold, new customised models, new global).
    ``trained``: the participants' uploaded weights when given (else trained here from their start)."""
    if trained is None:
        trained = {}
        for i in participants:
            start = {k: torch.where(critical[i][k], customized[i][k], theta[k]) if i in critical else theta[k]
                     for k in PARAMS}
            trained[i] = train_reference(ctx, i, start)
    starts = {i: {k: torch.where(critical[i][k], customized[i][k], theta[k]) if i in critical else theta[k]
                  for k in PARAMS} for i in participants}
    masks = {i: {k: reference_mask(starts[i][k], trained[i][k], tau) for k in PARAMS} for i in participants}
    flat = {i: torch.cat([masks[i][k].flatten() for k in PARAMS]).tolist() for i in participants}
    rate = {}
    for i in participants:
        for j in participants:
            if i != j:
                size = sum(flat[i])
                rate[i, j] = 1 - sum(a != b for a, b in zip(flat[i], flat[j])) / (2 * size) if size else 0.0
    mean = sum(rate.values()) / len(rate)
    threshold = mean + round / beta * (max(rate.values()) - mean)
    groups = {i: [i] + [j for j in participants if j != i and rate[i, j] >= threshold] for i in participants}
    new_customized = {i: {k: sum(trained[j][k] for j in groups[i]) / len(groups[i]) for k in PARAMS}
                      for i in participants}
    sizes = {i: ctx.data.clients[i].num_train for i in participants}
    new_theta = {k: sum(sizes[i] / sum(sizes.values()) * trained[i][k].double() for i in participants).float()
                 for k in PARAMS}
    return masks, groups, threshold, new_customized, new_theta


def test_three_rounds_with_partial_participation_recomputed():
    tau, beta = 0.3, 2
    engine, ctx = prepared(**{**BASE, "algorithm.params.tau": tau, "experiment.participation": 0.75})
    shrink(ctx, {0: 40, 1: 60, 2: 84, 3: 70})  # unequal sizes: the global model's weights are not uniform
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    customized, critical = {}, {}
    seen_idle = False
    counts = []
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        participants = list(ctx.participants)
        assert len(participants) == 3
        idle = [i for i in range(4) if i not in participants]
        masks, groups, threshold, new_customized, new_theta = reference_round(
            ctx, t, participants, theta, customized, critical, tau, beta)
        assert ctx.round_metrics["fedcac_threshold"] == pytest.approx(threshold, abs=1e-12)
        counts.append(sum(len(g) - 1 for g in groups.values()))
        assert ctx.round_metrics["fedcac_collaborators"] == pytest.approx(counts[-1] / 3)
        for i in participants:
            assert_same(ctx.server["critical"][i], masks[i])
            assert_close(ctx.server["customized"][i], new_customized[i], atol=1e-6)
        for i in idle:  # an idle client keeps its last mask and customised model
            if i in critical:
                seen_idle = True
                assert_same(ctx.server["critical"][i], critical[i])
                assert_same(ctx.server["customized"][i], customized[i])
        assert_close(ctx.server["global"], new_theta, atol=1e-6)
        # continue from the server's state (checked above), so float rounding does not drift
        theta = {k: v.clone() for k, v in ctx.server["global"].items()}
        customized = {i: dict(u) for i, u in ctx.server["customized"].items()}
        critical = {i: dict(m) for i, m in ctx.server["critical"].items()}
    assert seen_idle  # some client sat out a round after taking part
    # at beta = 2: round 1 shares with some of the others (of 6 ordered pairs), round 3 (past beta) with none
    assert 0 < counts[0] < 6 and counts[2] == 0
    for i in range(4):  # every client now has a mask with critical and non-critical entries
        flags = torch.cat([m.flatten() for m in critical[i].values()])
        assert flags.any() and not flags.all()


def test_the_sensitivity_is_measured_from_the_merged_start_model_not_the_global_one():
    tau = 0.3
    engine, ctx = prepared(**{**BASE, "algorithm.params.tau": tau})
    engine.run_round(ctx, 1)
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    customized = {i: dict(u) for i, u in ctx.server["customized"].items()}
    critical = {i: dict(m) for i, m in ctx.server["critical"].items()}
    engine.run_round(ctx, 2)
    trained = {i: train_reference(ctx, i, {k: torch.where(critical[i][k], customized[i][k], theta[k])
                                           for k in PARAMS}) for i in range(4)}
    wrong = {i: {k: reference_mask(theta[k], trained[i][k], tau) for k in PARAMS} for i in range(4)}
    assert any((ctx.server["critical"][i][k] != wrong[i][k]).any() for i in range(4) for k in PARAMS)


def test_tau_zero_is_fedavg_bit_for_bit():
    fedcac, cac_engine = run_tiny(**{**BASE, "algorithm.params.tau": 0.0, "experiment.participation": 0.75})
    fedavg, avg_engine = run_tiny(**{"algorithm.name": "fedavg", "model.params.hidden": [8],
                                     "experiment.participation": 0.75})
    assert_same(cac_engine.ctx.server["global"], avg_engine.ctx.server["global"])
    assert fedcac.final["acc_mean"] == fedavg.final["acc_mean"]
    assert fedcac.final["loss_mean"] == fedavg.final["loss_mean"]
    assert not any(m.any() for mask in cac_engine.ctx.server["critical"].values() for m in mask.values())


def test_each_client_is_evaluated_on_its_merged_model():
    # beta = 1: round 2 shares no critical parameter, so each u_i is the client's own trained model
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.75, "algorithm.params.beta": 1})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    theta = ctx.server["global"]
    for i in range(4):  # participants and idle clients alike: no local steps before scoring
        model = evaluated_models(ctx, ctx.client(i))[""]
        if i in ctx.server["critical"]:
            expected = {k: torch.where(ctx.server["critical"][i][k], ctx.server["customized"][i][k], theta[k])
                        for k in PARAMS}
            assert far_apart(expected, theta, PARAMS)
        else:
            expected = theta
        assert_same(model.state_dict(), expected, PARAMS)
        assert_same(ctx.hooks.on_broadcast(ctx=ctx, client_id=i)["weights"], expected, PARAMS)


def test_batchnorm_statistics_are_not_aggregated_and_stay_with_each_client():
    engine, ctx = prepared(**{**BASE, "model.params": {"hidden": [8], "norm": "batch"}})
    engine.run_round(ctx, 1)
    buffers = [k for k, _ in ctx.models.working("mlp").named_buffers()]
    assert buffers and not set(buffers) & set(ctx.server["global"])
    assert not set(buffers) & set(ctx.hooks.on_broadcast(ctx=ctx, client_id=0)["weights"])
    assert far_apart(ctx.store[0]["kept"], ctx.store[1]["kept"], ["bn1.running_mean"])
    scored = evaluated_models(ctx, ctx.client(2))[""].state_dict()
    assert_same(scored, ctx.store[2]["kept"], buffers)


def test_the_upload_is_the_weights_and_one_bit_per_parameter():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    params = {n: p for n, p in ctx.models.working("mlp").named_parameters()}
    weights = sum(p.numel() * 4 for p in params.values())
    bits = sum((p.numel() + 7) // 8 for p in params.values())
    assert ctx.comm_up == 4 * (weights + bits)
    assert ctx.comm_down == 4 * weights


# -- lost uploads ------------------------------------------------------------------------------------


def spy_uploads(ctx):
    seen, original = {}, ctx.hooks.client_upload

    def recording(**kw):
        message = original(**kw)
        seen[kw["client"].id] = {"weights": {k: v.detach().clone() for k, v in message["weights"].items()},
                                 "critical": {k: m.value.clone() for k, m in message["critical"].items()}}
        return message

    ctx.hooks.client_upload = recording
    return seen


def test_a_lost_upload_changes_nothing_on_the_server():
    p, tau, beta = 0.5, 0.3, 2
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 3  # seed 0 drops some and keeps at least two in round 2
    engine, ctx = prepared(**{**BASE, "algorithm.params.tau": tau},
                           addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    customized = {i: dict(u) for i, u in ctx.server["customized"].items()}
    critical = {i: dict(m) for i, m in ctx.server["critical"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 2)
    arrived = [i for i in range(4) if i not in lost]
    for i in lost:  # trained (its upload was made) but the server kept what it had
        assert i in uploads
        if i in critical:
            assert_same(ctx.server["critical"][i], critical[i])
            assert_same(ctx.server["customized"][i], customized[i])
        else:
            assert i not in ctx.server["critical"] and i not in ctx.server["customized"]
    # the arrivals alone make the overlaps, the customised models and the global model
    masks, _groups, threshold, new_customized, new_theta = reference_round(
        ctx, 2, arrived, theta, customized, critical, tau, beta,
        trained={i: uploads[i]["weights"] for i in arrived})
    assert ctx.round_metrics["fedcac_threshold"] == pytest.approx(threshold, abs=1e-12)
    for i in arrived:
        assert_same(ctx.server["critical"][i], uploads[i]["critical"])
        assert_same(ctx.server["critical"][i], masks[i])
        assert_close(ctx.server["customized"][i], new_customized[i], atol=1e-6)
    assert_close(ctx.server["global"], new_theta, atol=1e-6)


def test_a_cold_start_client_receives_the_global_model():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    assert newcomer not in ctx.server["critical"]
    assert ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)["weights"] is ctx.server["global"]


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.75, "algorithm.params.beta": 2,
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]},
                                       {"algorithm.params.tau": 0.2, "model.params": {"hidden": [8], "norm": "batch"},
                                        "addons": [{"name": "dropout", "params": {"p": 0.3}}]}],
                         ids=["partial-dropout", "batchnorm-dropout"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("fedcac", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedcac", "experiment.participation": 0.5, "algorithm.params": {"beta": 3},
                 "model.params": {"hidden": [8], "norm": "batch"}}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["critical"] and ref_server["customized"]  # the masks and models are part of what resumes


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("tau", -0.1), ("tau", 1.5), ("tau", float("nan")), ("tau", "0.5"),
                                       ("beta", 0), ("beta", 2.5), ("beta", True)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.tau": 2.0}))
    assert line.startswith("pfl-run: error: algorithm.params.tau: must be in [0, 1]")


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "same architecture" in info.value.message


def test_defaults_are_flings():
    p = FedCACParams()
    assert (p.tau, p.beta) == (0.5, 100)
