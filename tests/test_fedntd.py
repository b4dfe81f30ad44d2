"""FedNTD (plugins/fedntd): the not-true distillation loss (N1-N2) by hand, its gradient (none for
the true class, none into the teacher), a round recomputed independently (round 2 too, where the
teacher is w^1, not w^0; and with BatchNorm, where the teacher must run in eval mode), beta = 0 is
FedAvg bit for bit, the evaluated model is the global one, a newcomer distils from the final
model, bad input, lost uploads, the process executor and a killed run's resume."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, fresh_model, mean_of, prepared, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedntd import not_true_distillation, not_true_logits

# label skew (Dirichlet 0.3): each client holds a few of the 10 classes, so the not-true classes matter
SKEWED = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}
BASE = {"algorithm.name": "fedntd", "model.params.hidden": [8], **SKEWED}


# -- (N1)-(N2) by hand -----------------------------------------------------------------------------


def test_the_not_true_logits_drop_each_rows_true_class_in_order():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]])
    assert torch.equal(not_true_logits(logits, torch.tensor([0, 2, 3])),
                       torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0], [8.0, 9.0, 10.0]]))


def test_the_loss_by_hand():
    # one sample, 3 classes, y = 0: the not-true classes are 1 and 2
    student, teacher, y = torch.tensor([[5.0, 0.0, 1.0]]), torch.tensor([[-3.0, 2.0, 0.0]]), torch.tensor([0])
    # tau = 2: student q~ = softmax(0, 0.5), teacher q~ = softmax(1, 0)
    p = [math.exp(1) / (math.exp(1) + 1), 1 / (math.exp(1) + 1)]
    q = [1 / (1 + math.exp(0.5)), math.exp(0.5) / (1 + math.exp(0.5))]
    kl = sum(pc * math.log(pc / qc) for pc, qc in zip(p, q))
    assert not_true_distillation(student, teacher, y, 2.0).item() == pytest.approx(4 * kl, rel=1e-6)  # tau^2 = 4
    # the true class's logits play no part: change them on both sides and nothing moves
    moved = not_true_distillation(student + torch.tensor([[9.0, 0, 0]]), teacher - torch.tensor([[7.0, 0, 0]]), y, 2.0)
    assert moved.item() == pytest.approx(4 * kl, rel=1e-6)
    # the full-softmax KL (plain distillation) is another number: the test tells them apart
    full = 4 * F.kl_div(F.log_softmax(student / 2, 1), F.softmax(teacher / 2, 1), reduction="batchmean")
    assert abs(full.item() - 4 * kl) > 0.1
    # tau = 4: the factor is tau^2 = 16 (at tau = 2 it equals 2 tau): q~ = softmax(0, 0.25), softmax(0.5, 0)
    p = [math.exp(0.5) / (math.exp(0.5) + 1), 1 / (math.exp(0.5) + 1)]
    q = [1 / (1 + math.exp(0.25)), math.exp(0.25) / (1 + math.exp(0.25))]
    kl = sum(pc * math.log(pc / qc) for pc, qc in zip(p, q))
    assert not_true_distillation(student, teacher, y, 4.0).item() == pytest.approx(16 * kl, rel=1e-6)


def test_the_loss_is_the_mean_over_the_batch_and_zero_when_the_models_agree():
    torch.manual_seed(0)
    student, teacher, y = torch.randn(5, 4), torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 1])
    rows = [not_true_distillation(student[i:i + 1], teacher[i:i + 1], y[i:i + 1], 1.5) for i in range(5)]
    assert not_true_distillation(student, teacher, y, 1.5).item() == pytest.approx(sum(r.item() for r in rows) / 5)
    # only the not-true classes must agree: the true classes differ, the loss is still 0
    same_elsewhere = teacher.clone()
    same_elsewhere[torch.arange(5), y] += 3.0
    assert not_true_distillation(same_elsewhere, teacher, y, 1.5).item() == pytest.approx(0.0, abs=1e-7)


def test_the_gradient_misses_the_true_class_and_the_teacher():
    torch.manual_seed(1)
    student = torch.randn(3, 5, requires_grad=True)
    teacher = torch.randn(3, 5, requires_grad=True)
    y = torch.tensor([4, 0, 2])
    not_true_distillation(student, teacher, y, 1.0).backward()
    assert torch.all(student.grad[torch.arange(3), y] == 0)
    assert student.grad.abs().sum() > 0
    assert teacher.grad is None  # the teacher is a constant


# -- in a run --------------------------------------------------------------------------------------


def ntd_objective(ctx, teacher_state, beta, tau, arch="mlp", teacher_eval=True):
    """CE + beta * L_NTD with a fresh frozen copy of ``teacher_state`` as the teacher, in eval mode."""
    teacher = fresh_model(ctx, teacher_state, arch).train(not teacher_eval).requires_grad_(False)

    def loss(model, x, y, logits):
        with torch.no_grad():
            teacher_logits = teacher(x)
        return F.cross_entropy(logits, y) + beta * not_true_distillation(logits, teacher_logits, y, tau)
    return loss


def expected_round(ctx, start, beta, tau, teacher_eval=True):
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(sizes.values())
    return mean_of((sizes[i] / total, train_reference(
        ctx, i, start, loss_fn=ntd_objective(ctx, start, beta, tau, teacher_eval=teacher_eval))) for i in range(4))


def test_two_rounds_recomputed_independently_distil_from_that_rounds_global_model():
    engine, ctx = prepared(**BASE, **{"algorithm.params.beta": 2.0, "algorithm.params.tau": 2.0})
    w0 = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    expected = expected_round(ctx, w0, 2.0, 2.0)
    assert_close(ctx.server["global"], expected, atol=1e-5)
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    plain = mean_of((sizes[i] / sum(sizes.values()), train_reference(ctx, i, w0)) for i in range(4))
    assert far_apart(expected, plain, list(plain), atol=1e-3)  # the test tells FedNTD from FedAvg
    # round 2: the teacher is w^1 (a teacher kept from round 1, w^0, gives other weights)
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 2)
    expected = expected_round(ctx, w1, 2.0, 2.0)
    assert_close(ctx.server["global"], expected, atol=1e-5)
    stale = mean_of((sizes[i] / sum(sizes.values()), train_reference(
        ctx, i, w1, loss_fn=ntd_objective(ctx, w0, 2.0, 2.0))) for i in range(4))
    assert far_apart(expected, stale, list(stale), atol=1e-4)


def test_with_batchnorm_the_teacher_runs_in_eval_mode():
    norm = {"model.params": {"hidden": [8], "norm": "batch"}}
    engine, ctx = prepared(**{**BASE, **norm})
    engine.run_round(ctx, 1)
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 2)  # round 2: w^1's running statistics are not the initial ones
    floats = [k for k, v in w1.items() if v.is_floating_point()]  # num_batches_tracked is not averaged
    assert_close(ctx.server["global"], expected_round(ctx, w1, 1.0, 1.0), floats, atol=1e-5)
    in_train_mode = expected_round(ctx, w1, 1.0, 1.0, teacher_eval=False)  # batch statistics instead
    assert far_apart(ctx.server["global"], in_train_mode, floats, atol=1e-4)


def test_beta_zero_is_fedavg_bit_for_bit():
    _, ntd = run_tiny(**BASE, **{"algorithm.params.beta": 0.0})
    _, avg = run_tiny(**{**BASE, "algorithm.name": "fedavg"})
    assert_same(ntd.ctx.server["global"], avg.ctx.server["global"])
    _, distilled = run_tiny(**BASE)
    assert far_apart(distilled.ctx.server["global"], avg.ctx.server["global"], list(avg.ctx.server["global"]))
    assert (distilled.ctx.comm_up, distilled.ctx.comm_down) == (avg.ctx.comm_up, avg.ctx.comm_down)


def test_each_client_is_scored_with_the_global_model():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for i in range(4):
        models = evaluated_models(ctx, ctx.client(i))
        assert list(models) == [""]
        assert_same(models[""].state_dict(), ctx.server["global"])


def test_a_newcomer_distils_from_the_final_global_model():
    engine, ctx = prepared(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (newcomer,) = ctx.coldstart_clients
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    client = ctx.client(newcomer)
    models = ctx.hooks.coldstart_personalize(ctx=ctx, client=client, message=ctx.broadcast(newcomer))
    expected = train_reference(ctx, newcomer, start, epochs=2, loss_fn=ntd_objective(ctx, start, 1.0, 1.0))
    assert_close(models[""].state_dict(), expected, atol=1e-5)
    assert far_apart(expected, train_reference(ctx, newcomer, start, epochs=2), list(expected), atol=1e-4)


def test_with_lost_uploads_the_run_keeps_no_client_state():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 4,
                                         "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert all(engine.ctx.store[i] == {} for i in range(4))  # the teacher comes with each broadcast


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("beta", -0.1), ("beta", float("nan")), ("beta", float("inf")),
                                            ("beta", "1"), ("beta", True), ("tau", 0.0), ("tau", -1.0),
                                            ("tau", float("inf")), ("tau", "2")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.tau": 0.0}))
    assert line.startswith("pfl-run: error: algorithm.params.tau") and "> 0" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "fedntd averages weights" in info.value.message


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {**SKEWED, "model.params.hidden": [8], "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedntd", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_and_beta_zero_is_fedavg_there_too():
    """executor.device = "cuda": the teacher's logits and the not-true mask on the device; a
    newcomer and lost uploads included."""
    overrides = {**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    assert all(t.device.type == "cuda" for t in engine.ctx.server["global"].values())
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
    _, zero = run_tiny(**{**overrides, "algorithm.params.beta": 0.0})
    _, avg = run_tiny(**{**overrides, "algorithm.name": "fedavg"})
    assert_same(zero.ctx.server["global"], avg.ctx.server["global"])
    assert far_apart(engine.ctx.server["global"], avg.ctx.server["global"], list(avg.ctx.server["global"]))
