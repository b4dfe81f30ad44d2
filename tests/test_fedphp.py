"""FedPHP (plugins/fedphp): the MMD and distillation terms, the inheritance schedule and the
hPM moving average by hand, lam = 0 = FedAvg bit for bit, a local update and the hPM recomputed
independently, what is evaluated, what is sent, the budget, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    model_bytes,
    prepared,
    recorded_training,
    refused_at_key,
    train_reference,
)
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedphp import FedPHP, FedPHPParams, distillation, inheritance, mmd, moving_average

BASE = {"algorithm.name": "fedphp", "model.params.hidden": [8], "experiment.rounds": 2}


# -- the transfer terms, by hand ------------------------------------------------------------------


def test_mmd_of_two_points_by_hand():
    # pooled rows 0 and 2: squared distance 4, mean over the 2 distinct pairs s = 4;
    # kernels at s * 2^(q - 2) = 1, 2, 4, 8, 16; k(u, u) = 5; MMD^2 = 5 + 5 - 2 k(0, 2)
    k02 = sum(math.exp(-4 / s) for s in (1, 2, 4, 8, 16))
    value = mmd(torch.tensor([[0.0]]), torch.tensor([[2.0]]))
    assert value.item() == pytest.approx(10 - 2 * k02, abs=1e-6)
    assert mmd(torch.tensor([[0.0]]), torch.tensor([[2.0]]), kernels=1).item() == pytest.approx(
        2 - 2 * math.exp(-1), abs=1e-6)  # one kernel at s = 4


def test_mmd_of_unequal_sets_by_hand():
    # a = {0, 1}, b = {3}: squared distances 1, 9, 4; s = 2 (1 + 9 + 4) / 6 = 14/3; one kernel
    e = lambda d2: math.exp(-d2 * 3 / 14)
    expected = (2 + 2 * e(1)) / 4 + 1 - 2 * (e(9) + e(4)) / 2
    value = mmd(torch.tensor([[0.0], [1.0]]), torch.tensor([[3.0]]), kernels=1)
    assert value.item() == pytest.approx(expected, abs=1e-6)
    # three kernels at s/3, s, 3s (kernel_mul 3)
    k = lambda d2: sum(math.exp(-d2 / (14 / 3 * m)) for m in (1 / 3, 1, 3))
    expected = (2 * 3 + 2 * k(1)) / 4 + 3 - 2 * (k(9) + k(4)) / 2
    value = mmd(torch.tensor([[0.0], [1.0]]), torch.tensor([[3.0]]), kernels=3, kernel_mul=3.0)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_mmd_is_zero_between_equal_sets_and_has_finite_gradients():
    a = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 1.0]], requires_grad=True)
    value = mmd(a, a.detach().clone())
    assert value.item() == pytest.approx(0.0, abs=1e-6)
    value.backward()
    assert torch.isfinite(a.grad).all()
    assert mmd(torch.ones(2, 3), torch.ones(2, 3)).item() == pytest.approx(0.0, abs=1e-6)  # all rows equal


def test_distillation_by_hand():
    teacher = torch.tensor([[4 * math.log(3.0), 0.0]])  # softmax(teacher / 4) = (3/4, 1/4)
    # uniform student: -(3/4 + 1/4) log(1/2) = log 2
    assert distillation(torch.zeros(1, 2), teacher, 4.0).item() == pytest.approx(math.log(2), abs=1e-6)
    # student softmax = (3/4, 1/4) at temperature 1: the entropy of (3/4, 1/4)
    student = torch.tensor([[math.log(3.0), 0.0]])
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert distillation(student, teacher, 4.0).item() == pytest.approx(entropy, abs=1e-6)
    # temperature 1: softmax(teacher) = (81/82, 1/82) against the uniform student
    assert distillation(torch.zeros(1, 2), teacher, 1.0).item() == pytest.approx(math.log(2), abs=1e-6)
    assert distillation(student, teacher, 1.0).item() == pytest.approx(
        -(81 / 82 * math.log(0.75) + 1 / 82 * math.log(0.25)), abs=1e-6)


# -- the hPM: inheritance schedule and moving average, by hand -------------------------------------


@pytest.mark.parametrize("visits,participation,rounds,expected", [
    (0, 0.5, 4, 0.0),    # first update: the hPM is replaced by the local model
    (1, 0.5, 4, 0.45),   # on average 2 visits: 0.9 * 1/2
    (2, 0.5, 4, 0.9),
    (5, 0.5, 4, 0.9),    # capped at mu_max
    (1, 0.3, 5, 0.9),    # floor(1.5) = 1 expected visit
    (1, 0.1, 5, 0.9),    # floor(0.5) = 0: at least 1
    (3, 1.0, 10, 0.27),
])
def test_inheritance_schedule_by_hand(visits, participation, rounds, expected):
    assert inheritance(visits, 0.9, participation, rounds) == pytest.approx(expected)


def test_moving_average_by_hand():
    history = {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(7)}
    current = {"w": torch.tensor([3.0, 1.0]), "n": torch.tensor(9)}
    out = moving_average(history, current, 0.25)
    assert torch.allclose(out["w"], torch.tensor([2.5, 1.5]))  # 0.25 h + 0.75 w
    assert out["n"].item() == 9  # non-float entries: the local model's
    assert out["w"] is not current["w"]


# -- lam = 0 is FedAvg's local update, bit for bit --------------------------------------------------


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_lambda_zero_is_fedavg_bit_for_bit(extra):
    php = run_rounds(3, **{**BASE, **extra, "algorithm.params.lam": 0.0})
    avg = run_rounds(3, **{**BASE, **extra, "algorithm.name": "fedavg"})
    assert_same(php.server["global"], avg.server["global"])
    assert php.comm_up == avg.comm_up and php.comm_down == avg.comm_down
    for transfer in ("mmd", "kd"):  # ... while lam > 0 changes the local update: the test can tell
        moved = run_rounds(3, **{**BASE, **extra, "algorithm.params.transfer": transfer})
        assert far_apart(moved.server["global"], avg.server["global"], list(avg.server["global"]))


# -- a local update and the hPM, recomputed independently --------------------------------------------


def features(x, state):
    return F.relu(F.linear(x, state["fc1.weight"], state["fc1.bias"]))


def reference_mmd(a, b):
    """The multi-kernel MMD from explicit pairwise differences (5 kernels, factor 2)."""
    pooled = torch.cat([a, b])
    d2 = ((pooled[:, None, :] - pooled[None, :, :]) ** 2).sum(-1)
    n = len(pooled)
    s = d2.detach().sum() / (n * n - n)
    k = sum(torch.exp(-d2 / (s * 2.0 ** e)) for e in (-2, -1, 0, 1, 2))
    na = len(a)
    return k[:na, :na].mean() + k[na:, na:].mean() - 2 * k[:na, na:].mean()


def php_loss(hpm, lam, transfer):
    def loss(model, x, y, logits):
        student = features(x, dict(model.named_parameters()))
        with torch.no_grad():
            teacher = features(x, hpm)
            teacher_logits = F.linear(teacher, hpm["fc2.weight"], hpm["fc2.bias"])
        if transfer == "mmd":
            r = reference_mmd(student, teacher)
        else:
            r = -(F.softmax(teacher_logits / 4.0, 1) * F.log_softmax(logits, 1)).sum(1).mean()
        return (1 - lam) * F.cross_entropy(logits, y) + lam * r
    return loss


@pytest.mark.parametrize("transfer,lam", [("mmd", 0.3), ("kd", 0.5)])
def test_local_update_and_hpm_recomputed(transfer, lam):
    # (few steps per epoch: starting from teacher = student, MMD's data-driven kernel width makes long
    # runs sensitive to rounding, and two correct implementations drift apart by ~1e-4 after 12 steps)
    engine, ctx = prepared(**{**BASE, "algorithm.params.lam": lam, "algorithm.params.transfer": transfer,
                              "experiment.rounds": 4, "training.batch_size": 32})  # 2 steps an epoch
    init = {k: v.clone() for k, v in ctx.models.initial_state("mlp").items()}
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: v.clone() for k, v in message["weights"].items()}
        return message

    ctx.hooks.client_upload = spy
    engine.run_round(ctx, 1)
    # round 1: the teacher is the initial hPM (w^0), the start is w^0; mu = 0, so hPM = w_1
    for i in range(4):
        expected = train_reference(ctx, i, init, loss_fn=php_loss(init, lam, transfer))
        assert_close(uploads[i], expected, atol=1e-5)
        assert_close(ctx.store[i]["hpm"], expected, atol=1e-5)
        assert ctx.store[i]["visits"] == 1
    hpm1 = {i: {k: v.clone() for k, v in ctx.store[i]["hpm"].items()} for i in range(4)}
    w1 = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 2)
    # round 2: start w^1, teacher hPM_1; then hPM_2 = mu hPM_1 + (1 - mu) w_2, mu = 0.9 * 1/4
    for i in range(4):
        expected = train_reference(ctx, i, w1, loss_fn=php_loss(hpm1[i], lam, transfer))
        assert_close(uploads[i], expected, atol=1e-5)
        hpm2 = {k: 0.225 * hpm1[i][k] + 0.775 * expected[k] for k in expected}
        assert_close(ctx.store[i]["hpm"], hpm2, atol=1e-5)
        # the teacher matters: with the received model as teacher the update differs
        assert far_apart(expected, train_reference(ctx, i, w1, loss_fn=php_loss(w1, lam, transfer)), list(expected))


def test_the_batch_loss_is_one_minus_lambda_ce_plus_lambda_transfer():
    engine, ctx = prepared(**BASE, **{"algorithm.params.lam": 0.25})
    engine.run_round(ctx, 1)
    ctx.round = 2
    client = ctx.client(0)
    plugin = next(p for p in engine.resolved.plugins if isinstance(p, FedPHP))
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
    hpm = ctx.store[0]["hpm"]
    from pfl_core.runtime.context import load_state
    from pfl_plugins.fedproto import capture_embedding
    client.scratch["teacher"] = load_state(ctx.models.build("mlp"), hpm).eval()
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    with capture_embedding(client.model, client.scratch):
        logits = client.model(x)
        total = client.objective(client.model, x, y, logits)
    state = dict(client.model.named_parameters())
    expected = 0.75 * F.cross_entropy(logits, y) + 0.25 * reference_mmd(features(x, state), features(x, hpm))
    assert total.item() == pytest.approx(expected.item(), abs=1e-6)
    assert plugin.params.lam == 0.25


# -- evaluation, bytes, budget ----------------------------------------------------------------------


def test_the_evaluated_model_is_the_hpm_and_initial_before_any_training():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.25})
    engine.run_round(ctx, 1)
    (trained,) = ctx.participants
    model = evaluated_models(ctx, ctx.client(trained))[""]
    assert_same(model.state_dict(), ctx.store[trained]["hpm"])
    idle = (trained + 1) % 4
    model = evaluated_models(ctx, ctx.client(idle))[""]
    assert_same(model.state_dict(), ctx.models.initial_state("mlp"))


def test_only_the_model_travels_as_in_fedavg():
    ctx = run_rounds(2, **BASE, **{"experiment.participation": 0.5})
    one_model = model_bytes(ctx.server["global"])
    assert ctx.comm_down == ctx.comm_up == 2 * 2 * one_model


def test_budget_is_local_epochs_and_measured():
    raw = tiny_raw(**BASE, **{"training.local_epochs": 2})
    resolved = resolve(raw)
    assert resolved.as_dict["budget"]["private_epochs_per_round"] == 2
    result = Engine(resolved, progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(4)


def test_defaults_are_the_documented_ones():
    p = FedPHPParams()
    assert (p.lam, p.transfer, p.mu_max, p.temperature, p.kernels, p.kernel_mul) == (0.1, "mmd", 0.9, 4.0, 5, 2.0)


def test_a_full_run_with_coldstart_clients():
    result = Engine(resolve(tiny_raw(**BASE, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


def test_coldstart_trains_its_epochs_from_the_final_model_and_scores_that_hpm(monkeypatch):
    raw = tiny_raw(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 3})
    engine = Engine(resolve(raw), progress=False)
    with recorded_training(monkeypatch) as calls:
        engine.run()
    ctx = engine.ctx
    (cold,) = ctx.coldstart_clients
    (call,) = [c for c in calls if c["client"] == cold]
    assert call["epochs"] == 3
    assert_same(call["before"], ctx.server["global"])
    assert_same(ctx.store[cold]["hpm"], call["after"])  # first update: mu = 0
    assert ctx.store[cold]["visits"] == 1


def test_boundary_values_are_accepted():
    resolve(tiny_raw(**BASE, **{"algorithm.params.lam": 0.0, "algorithm.params.mu_max": 0.0,
                                "algorithm.params.kernels": 1, "algorithm.params.kernel_mul": 0.5}))


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -0.1), ("lam", 1.0), ("lam", float("nan")), ("mu_max", 1.0),
                                       ("mu_max", -0.5), ("transfer", "mdd"), ("temperature", 0.0),
                                       ("kernels", 0), ("kernel_mul", 0.0)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.lam": 1.5}))
    assert "algorithm.params.lam" in line and "[0, 1)" in line
