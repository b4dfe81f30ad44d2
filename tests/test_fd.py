"""FD (plugins/fd): the per-label logit sums (F2), the teachers (F4, own report left out or not)
and the regulariser (F1) by hand; two rounds recomputed independently (round 1 is Local, round 2
distils towards the other clients' round-1 averages); lam = 0 is Local bit for bit; each client is
scored on its own model; lost uploads leave their reports out and the models trained; a newcomer;
clients of different architectures; bad input; the process executor and a killed run's resume."""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, prepared, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from test_faults import seeded_lost
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fd import distillation_term, label_logit_sums, teachers

SKEWED = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}
BASE = {"algorithm.name": "fd", "model.params.hidden": [8], **SKEWED}


# -- (F1), (F2), (F4) by hand ----------------------------------------------------------------------


def test_the_per_label_sums_and_counts_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    sums, counts = label_logit_sums(logits, torch.tensor([2, 0, 2]), 3)
    assert torch.equal(sums, torch.tensor([[4.0, 5.0, 6.0], [0.0, 0.0, 0.0], [8.0, 10.0, 12.0]]))
    assert torch.equal(counts, torch.tensor([1.0, 0.0, 2.0]))


def report(rows, seen):
    return torch.tensor(rows), torch.tensor(seen)


def test_the_teachers_by_hand():
    reports = {
        0: report([[1.0, 0.0], [0.0, 0.0]], [True, False]),
        1: report([[3.0, 2.0], [5.0, 7.0]], [True, True]),
        2: report([[8.0, 8.0], [9.0, 9.0]], [False, True]),  # label 0 not seen: its row is ignored
    }
    # client 0 without its own report: label 0 from client 1 alone, label 1 from clients 1 and 2
    teacher, has = teachers(reports, 0, exclude_own=True)
    assert torch.equal(teacher, torch.tensor([[3.0, 2.0], [7.0, 8.0]])) and has.tolist() == [True, True]
    # with its own report (PFLlib's one average): label 0 from clients 0 and 1, unweighted
    teacher, has = teachers(reports, 0, exclude_own=False)
    assert torch.equal(teacher, torch.tensor([[2.0, 1.0], [7.0, 8.0]])) and has.tolist() == [True, True]
    # a label only the client itself reported has no teacher once its own report is left out
    teacher, has = teachers({0: reports[0], 2: reports[2]}, 0, exclude_own=True)
    assert has.tolist() == [False, True] and torch.equal(teacher[1], torch.tensor([9.0, 9.0]))
    assert teachers({0: reports[0]}, 0, exclude_own=True) is None
    assert teachers({}, 3, exclude_own=False) is None
    # a newcomer (no report of its own) gets the average over everyone either way
    assert torch.equal(teachers(reports, 7, True)[0], teachers(reports, 7, False)[0])


def test_the_regulariser_by_hand():
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    teacher = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])  # label 0: (3/4, 1/4); label 1: no teacher
    has = torch.tensor([True, False])
    # only row 0: -(3/4 log softmax(0,1)_0 + 1/4 log softmax(0,1)_1), divided by the batch of 3
    log_q = [-math.log(1 + math.e), 1 - math.log(1 + math.e)]
    expected = -(0.75 * log_q[0] + 0.25 * log_q[1]) / 3
    assert distillation_term(logits, y, teacher, has).item() == pytest.approx(expected, rel=1e-6)
    assert distillation_term(logits, y, teacher, torch.tensor([False, False])).item() == 0.0


# -- in a run --------------------------------------------------------------------------------------


def reference_client(ctx, i, start, teacher=None, lam=1.0):
    """Client i's round from ``start``: SGD on CE (+ lam * the regulariser, written out here), and
    its report: the per-label means of the logits of its training steps."""
    c = ctx.num_classes
    sums, counts = torch.zeros(c, c), torch.zeros(c)

    def loss(model, x, y, logits):
        for row, label in zip(logits.detach(), y.tolist()):
            sums[label] += row
            counts[label] += 1
        value = F.cross_entropy(logits, y)
        if teacher is not None:
            target, has = teacher
            terms = [-(F.softmax(target[label], 0) * F.log_softmax(row, 0)).sum()
                     for row, label in zip(logits, y.tolist()) if has[label]]
            value = value + lam * (sum(terms) / len(y) if terms else 0.0)
        return value

    weights = train_reference(ctx, i, start, loss_fn=loss)
    return weights, (sums / counts.clamp_min(1)[:, None], counts > 0)


def by_hand_teacher(reports, i):
    """The mean of the other clients' reported rows, label by label (a loop, not ``teachers``)."""
    c = next(iter(reports.values()))[0].shape[0]
    target, has = torch.zeros(c, c), torch.zeros(c, dtype=torch.bool)
    for label in range(c):
        rows = [averages[label] for j, (averages, seen) in reports.items() if j != i and seen[label]]
        if rows:
            target[label], has[label] = sum(rows) / len(rows), True
    return target, has


def test_two_rounds_recomputed_independently():
    engine, ctx = prepared(**BASE, **{"algorithm.params.lam": 2.0})
    initial = ctx.models.initial_state("mlp")
    engine.run_round(ctx, 1)  # no teacher yet: every client trains as Local does, and reports
    expected = {i: reference_client(ctx, i, initial) for i in range(4)}
    for i in range(4):
        assert_close(ctx.store[i]["weights"], expected[i][0], atol=1e-6)
        averages, seen = ctx.server["reports"][i]
        assert torch.equal(seen, expected[i][1][1]) and seen.sum() < ctx.num_classes  # label skew
        assert torch.allclose(averages, expected[i][1][0], atol=1e-5)
    round1 = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
    reports = {i: expected[i][1] for i in range(4)}
    engine.run_round(ctx, 2)  # each client distils towards the others' round-1 averages
    for i in range(4):
        teacher = by_hand_teacher(reports, i)
        weights, (averages, _) = reference_client(ctx, i, round1[i], teacher, lam=2.0)
        assert_close(ctx.store[i]["weights"], weights, atol=1e-5)
        assert torch.allclose(ctx.server["reports"][i][0], averages, atol=1e-5)
        local, _ = reference_client(ctx, i, round1[i])
        assert far_apart(weights, local, list(local), atol=1e-4)  # the test tells FD from Local
        with_own, _ = reference_client(ctx, i, round1[i], teachers(reports, i, exclude_own=False), lam=2.0)
        assert far_apart(weights, with_own, list(local), atol=1e-5)  # ... and from PFLlib's average


def test_exclude_own_false_sends_everyone_the_same_average():
    engine, ctx = prepared(**BASE, **{"algorithm.params.exclude_own": False})
    engine.run_round(ctx, 1)
    messages = [ctx.broadcast(i) for i in range(4)]
    for message in messages[1:]:
        assert torch.equal(message["teacher"], messages[0]["teacher"])
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    assert not torch.equal(ctx.broadcast(0)["teacher"], ctx.broadcast(1)["teacher"])


def test_lam_zero_is_local_bit_for_bit():
    _, fd = run_tiny(**BASE, **{"algorithm.params.lam": 0.0})
    _, local = run_tiny(**{**BASE, "algorithm.name": "local"})
    _, distilled = run_tiny(**BASE)
    for i in range(4):
        assert_same(fd.ctx.store[i]["weights"], local.ctx.store[i]["weights"])
    assert any(far_apart(distilled.ctx.store[i]["weights"], local.ctx.store[i]["weights"],
                         list(local.ctx.store[i]["weights"])) for i in range(4))


def test_each_client_is_scored_with_its_own_model():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for i in range(4):
        models = evaluated_models(ctx, ctx.client(i))
        assert list(models) == [""]
        assert_same(models[""].state_dict(), ctx.store[i]["weights"])
    assert not torch.equal(ctx.store[0]["weights"]["fc1.weight"], ctx.store[1]["weights"]["fc1.weight"])


def test_bytes_are_the_reports_and_the_teachers():
    _, engine = run_tiny(**BASE, **{"experiment.rounds": 2})
    c = engine.ctx.num_classes
    matrix_and_mask = c * c * 4 + c  # float32 averages, bool mask
    assert engine.ctx.comm_up == 2 * 4 * matrix_and_mask
    assert engine.ctx.comm_down == 4 * matrix_and_mask  # round 1 sends nothing


def test_a_lost_upload_leaves_its_report_out_and_the_client_keeps_its_trained_model():
    seed, p = 3, 0.5
    lost = seeded_lost(seed, 2, range(4), p)
    assert 0 < len(lost) < 4, lost
    engine, ctx = prepared(**BASE, **{"experiment.seed": seed, "addons": [{"name": "dropout", "params": {"p": p}}]})
    assert not seeded_lost(seed, 1, range(4), p)  # round 1: every report arrives
    engine.run_round(ctx, 1)
    before = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
    old_reports = dict(ctx.server["reports"])
    engine.run_round(ctx, 2)
    assert sorted(ctx.server["reports"]) == sorted(set(range(4)) - lost)
    for i in lost:  # it trained (towards round 1's teachers): its model moved, its report did not arrive
        weights, _ = reference_client(ctx, i, before[i], by_hand_teacher(old_reports, i))
        assert_close(ctx.store[i]["weights"], weights, atol=1e-5)
    assert ctx.round_metrics["dropped_clients"] == len(lost)


def test_a_round_whose_uploads_are_all_lost_keeps_the_teachers():
    seed, p = 6, 0.5
    assert seeded_lost(seed, 1, range(4), p) == {3} and seeded_lost(seed, 2, range(4), p) == {0, 1, 2, 3}
    engine, ctx = prepared(**BASE, **{"experiment.seed": seed, "addons": [{"name": "dropout", "params": {"p": p}}]})
    engine.run_round(ctx, 1)
    assert sorted(ctx.server["reports"]) == [0, 1, 2]
    teacher = ctx.broadcast(0)["teacher"].clone()
    engine.run_round(ctx, 2)  # nothing arrives: round 1's reports still teach in round 3
    assert sorted(ctx.server["reports"]) == [0, 1, 2]
    assert torch.equal(ctx.broadcast(0)["teacher"], teacher)


def test_a_newcomer_distils_towards_everyones_average():
    engine, ctx = prepared(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (newcomer,) = ctx.coldstart_clients
    client = ctx.client(newcomer)
    message = ctx.broadcast(newcomer)
    models = ctx.hooks.coldstart_personalize(ctx=ctx, client=client, message=message)
    teacher = by_hand_teacher(ctx.server["reports"], newcomer)
    assert torch.allclose(message["teacher"], teacher[0]) and torch.equal(message["has_teacher"], teacher[1])

    def loss(model, x, y, logits):
        return F.cross_entropy(logits, y) + distillation_term(logits, y, *teacher)
    expected = train_reference(ctx, newcomer, ctx.models.initial_state("mlp"), epochs=2, loss_fn=loss)
    assert_close(models[""].state_dict(), expected, atol=1e-5)


def test_clients_of_different_architectures_share_only_logits(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (200, 28, 28), dtype=np.uint8), y_train=rng.integers(0, 10, 200))
    images = {"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
              "algorithm.name": "fd", "experiment.rounds": 2, "model.name": "lenet5", "model.params": {},
              "model.pool": ["lenet5", "cnn2"], "model.arch_params": {"cnn2": {"width": 0.25}}}
    result, engine = run_tiny(**images)
    assert [row["arch"] for row in result.client_rows] == ["lenet5", "cnn2", "lenet5", "cnn2"]
    assert math.isfinite(result.final["acc_mean"]) and sorted(engine.ctx.server["reports"]) == [0, 1, 2, 3]


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("lam", -0.5), ("lam", float("nan")), ("lam", float("inf")),
                                            ("lam", "1"), ("lam", True), ("exclude_own", 1), ("exclude_own", "yes")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.lam": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.lam") and ">= 0" in line


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {**SKEWED, "model.params.hidden": [8], "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fd", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_and_lam_zero_is_local_there_too():
    """executor.device = "cuda": the logit sums, teachers and masks on the device; a newcomer and
    lost uploads included."""
    overrides = {**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    assert all(t.device.type == "cuda" for t, _ in engine.ctx.server["reports"].values())
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
    _, zero = run_tiny(**{**overrides, "algorithm.params.lam": 0.0})
    _, local = run_tiny(**{**overrides, "algorithm.name": "local"})
    for i in engine.ctx.store:
        assert_same(zero.ctx.store[i]["weights"], local.ctx.store[i]["weights"])
