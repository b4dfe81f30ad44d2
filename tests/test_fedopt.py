"""FedOpt (plugins/fedopt): FedAdagrad, FedAdam and FedYogi (Reddi et al. 2021, Alg. 2) and FedAvgM
(Hsu et al. 2019). Server steps by hand on a 2-parameter model (moments carried over two
rounds, Yogi's sign, Adagrad's sum, FedAvgM's undamped momentum), one engine round against
the formula applied to FedAvg's average, buffers averaged not stepped, and the parameters."""

import math
from types import SimpleNamespace

import pytest
import torch
from harness import dry_run_error, prepared
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedopt import (
    FedAdagrad,
    FedAdagradParams,
    FedAdam,
    FedAdamParams,
    FedAvgM,
    FedAvgMParams,
    FedYogi,
    FedYogiParams,
)

WEIGHTS = {0: 0.25, 1: 0.75}


def server(x, m, v=None, n=7):
    """A stand-in run context holding x_t = ``x`` (and an integer buffer), m_{t-1} and v_{t-1}."""
    state = {"global": {"w": torch.tensor(x), "n": torch.tensor(n)}, "m": {"w": torch.tensor(m)}}
    if v is not None:
        state["v"] = {"w": torch.tensor(v)}
    return SimpleNamespace(server=state)


def step(plugin, ctx, a, b):
    """One server_aggregate of two uploads ``a`` (weight 0.25) and ``b`` (weight 0.75)."""
    uploads = iter([(0, {"weights": {"w": torch.tensor(a), "n": torch.tensor(1)}}),
                    (1, {"weights": {"w": torch.tensor(b), "n": torch.tensor(2)}})])
    assert plugin.server_aggregate(ctx, uploads, WEIGHTS) is True


def close(tensor, expected, atol=1e-6):
    return torch.allclose(tensor, torch.tensor(expected), rtol=0, atol=atol)


def by_hand(rule, x, m, v, uploads, lr, beta1, beta2=None, tau=None):
    """Algorithm 2 in plain floats, coordinate by coordinate, over rounds of (a, b) uploads."""
    for a, b in uploads:
        for j in range(len(x)):
            delta = 0.25 * a[j] + 0.75 * b[j] - x[j]
            if rule == "sgdm":
                m[j] = beta1 * m[j] + delta
                x[j] = x[j] + lr * m[j]
                continue
            m[j] = beta1 * m[j] + (1 - beta1) * delta
            if rule == "adagrad":
                v[j] = v[j] + delta ** 2
            elif rule == "adam":
                v[j] = beta2 * v[j] + (1 - beta2) * delta ** 2
            else:
                v[j] = v[j] - (1 - beta2) * delta ** 2 * (1 if v[j] > delta ** 2 else -1)
            x[j] = x[j] + lr * m[j] / (math.sqrt(v[j]) + tau)
    return x, m, v


ROUNDS = [([1.4, -2.4], [0.6, -1.6]),   # x_avg = (0.8, -1.8): Delta_1 = (-0.2, 0.2)
          ([0.3, 0.9], [1.5, -2.7])]    # a second round with other signs: the moments carry over


def test_one_fedadam_step_by_hand():
    plugin = FedAdam(FedAdamParams(server_lr=0.5, beta1=0.9, beta2=0.99, tau=0.1))
    ctx = server([1.0, -2.0], [0.0, 0.0], [0.01, 0.01])  # m_{-1} = 0, v_{-1} = tau^2
    step(plugin, ctx, *ROUNDS[0])
    # Delta = (-0.2, 0.2); m = 0.1 Delta = (-0.02, 0.02); v = 0.99 * 0.01 + 0.01 * 0.04 = 0.0103
    # x = x_t + 0.5 * m / (sqrt(0.0103) + 0.1) = x_t -+ 0.0496304...
    shift = 0.5 * 0.02 / (math.sqrt(0.0103) + 0.1)
    assert shift == pytest.approx(0.0496304, abs=1e-6)
    assert close(ctx.server["global"]["w"], [1.0 - shift, -2.0 + shift])
    assert close(ctx.server["m"]["w"], [-0.02, 0.02]) and close(ctx.server["v"]["w"], [0.0103, 0.0103])
    assert ctx.server["global"]["n"].item() == 1  # an integer buffer: FedAvg's (the first upload's)


@pytest.mark.parametrize("rule,cls,params", [
    ("adam", FedAdam, FedAdamParams(server_lr=0.3, beta1=0.8, beta2=0.95, tau=0.05)),
    ("yogi", FedYogi, FedYogiParams(server_lr=0.3, beta1=0.8, beta2=0.95, tau=0.05)),
    ("adagrad", FedAdagrad, FedAdagradParams(server_lr=0.3, beta1=0.5, tau=0.05)),
    ("sgdm", FedAvgM, FedAvgMParams(server_lr=0.7, beta1=0.6)),
])
def test_two_server_steps_follow_algorithm_2(rule, cls, params):
    plugin = cls(params)
    tau = getattr(params, "tau", None)
    v0 = None if rule == "sgdm" else [tau * tau] * 2
    ctx = server([1.0, -2.0], [0.0, 0.0], v0)
    x, m, v = [1.0, -2.0], [0.0, 0.0], None if v0 is None else list(v0)
    for round in ROUNDS:
        step(plugin, ctx, *round)
        x, m, v = by_hand(rule, x, m, v, [round], params.server_lr, params.beta1, getattr(params, "beta2", None), tau)
        assert close(ctx.server["global"]["w"], x, atol=1e-5), rule
        assert close(ctx.server["m"]["w"], m, atol=1e-6), rule
        if v is not None:
            assert close(ctx.server["v"]["w"], v, atol=1e-7), rule
    assert ("v" in ctx.server) == (rule != "sgdm")


def test_yogi_moves_v_towards_delta_squared_from_either_side_and_adam_does_not():
    """sign(v_{t-1} - Delta^2): below Delta^2, v grows by (1 - beta2) Delta^2; above, it shrinks by it;
    equal, it stays (Adam's v would decay towards Delta^2 multiplicatively instead)."""
    ctx = server([1.0, -2.0], [0.0, 0.0], [1e-6, 1.0])  # Delta^2 = 0.04: first below, second above
    step(FedYogi(FedYogiParams(beta2=0.99)), ctx, *ROUNDS[0])
    assert close(ctx.server["v"]["w"], [1e-6 + 0.01 * 0.04, 1.0 - 0.01 * 0.04], atol=1e-8)
    level = server([1.0, 1.0], [0.0, 0.0], [0.25, 0.5])  # uploads 1.5: Delta = 0.5 exactly, Delta^2 = 0.25
    step(FedYogi(FedYogiParams(beta2=0.99)), level, [1.5, 1.5], [1.5, 1.5])
    assert level.server["v"]["w"][0].item() == 0.25  # sign 0: unchanged (exactly)
    assert close(level.server["v"]["w"][1:], [0.5 - 0.01 * 0.25], atol=1e-8)
    adam = server([1.0, -2.0], [0.0, 0.0], [1e-6, 1.0])
    step(FedAdam(FedAdamParams(beta2=0.99)), adam, *ROUNDS[0])
    assert close(adam.server["v"]["w"], [0.99e-6 + 0.01 * 0.04, 0.99 + 0.01 * 0.04], atol=1e-8)


def test_adagrad_sums_the_squares_and_keeps_no_first_moment_by_default():
    plugin = FedAdagrad(FedAdagradParams(server_lr=1.0, tau=0.1))
    ctx = server([1.0, -2.0], [0.0, 0.0], [0.01, 0.01])
    step(plugin, ctx, *ROUNDS[0])  # Delta_1 = (-0.2, 0.2)
    assert close(ctx.server["m"]["w"], [-0.2, 0.2])  # beta1 = 0: m_t = Delta_t
    assert close(ctx.server["v"]["w"], [0.05, 0.05])  # tau^2 + 0.04
    x1 = ctx.server["global"]["w"].clone()
    assert close(x1, [1.0 - 0.2 / (math.sqrt(0.05) + 0.1), -2.0 + 0.2 / (math.sqrt(0.05) + 0.1)])
    step(plugin, ctx, *ROUNDS[0])  # the same uploads: Delta_2 = x_avg - x_1
    delta2 = torch.tensor([0.8, -1.8]) - x1
    assert torch.allclose(ctx.server["v"]["w"], 0.05 + delta2 ** 2, atol=1e-7)  # never decays


def test_fedavgm_momentum_is_undamped_and_beta_zero_lr_one_is_the_average():
    ctx = server([1.0, -2.0], [0.5, 0.5])
    step(FedAvgM(FedAvgMParams(server_lr=2.0, beta1=0.5)), ctx, *ROUNDS[0])
    assert close(ctx.server["m"]["w"], [0.25 - 0.2, 0.25 + 0.2])  # 0.5 m + Delta, no (1 - beta)
    assert close(ctx.server["global"]["w"], [1.0 + 2.0 * 0.05, -2.0 + 2.0 * 0.45])
    plain = server([1.0, -2.0], [0.0, 0.0])
    step(FedAvgM(FedAvgMParams(server_lr=1.0, beta1=0.0)), plain, *ROUNDS[0])
    assert torch.equal(plain.server["global"]["w"], 0.25 * torch.tensor([1.4, -2.4]) + 0.75 * torch.tensor([0.6, -1.6]))


def test_nobody_taking_part_leaves_the_server_state_alone():
    ctx = server([1.0, -2.0], [0.1, 0.2], [0.3, 0.4])
    before = {k: {n: t.clone() for n, t in part.items()} for k, part in ctx.server.items()}
    assert FedAdam().server_aggregate(ctx, iter([]), {}) is True
    for key, part in before.items():
        assert all(torch.equal(ctx.server[key][n], t) for n, t in part.items()), key


# -- through the engine -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_one_engine_round_is_algorithm_2_applied_to_fedavgs_average(name):
    """Round 1 from x_0: FedAvg's clients train from x_0 too, so FedAvg's new model is x_avg."""
    params = {"server_lr": 0.05, "tau": 0.01, "beta1": 0.9}
    engine, ctx = prepared(**{"algorithm.name": name, "algorithm.params": params})
    x0 = {k: v.clone() for k, v in ctx.server["global"].items()}
    assert all(torch.equal(ctx.server["m"][k], torch.zeros_like(x0[k])) for k in x0)
    assert all(torch.allclose(ctx.server["v"][k], torch.full_like(x0[k], 1e-4)) for k in x0)  # tau^2
    engine.run_round(ctx, 1)
    fedavg, fctx = prepared()
    fedavg.run_round(fctx, 1)
    beta2 = 0.99
    for key, x in x0.items():
        delta = fctx.server["global"][key] - x
        m = 0.1 * delta
        v = {"fedadam": beta2 * 1e-4 + (1 - beta2) * delta ** 2, "fedadagrad": 1e-4 + delta ** 2,
             "fedyogi": 1e-4 + (1 - beta2) * delta ** 2 * torch.sign(delta ** 2 - 1e-4)}[name]
        expected = x + 0.05 * m / (v.sqrt() + 0.01)
        assert torch.allclose(ctx.server["global"][key], expected, rtol=0, atol=1e-6), key
        assert torch.allclose(ctx.server["v"][key], v, rtol=0, atol=1e-9), key
        assert not torch.allclose(expected, fctx.server["global"][key], atol=1e-4)  # not FedAvg's step


def test_fedavgm_with_beta_zero_and_lr_one_is_fedavg_bit_for_bit():
    plain, fedavg = run_tiny(**{"experiment.rounds": 2})
    same, fedavgm = run_tiny(**{"experiment.rounds": 2, "algorithm.name": "fedavgm",
                                "algorithm.params": {"beta1": 0.0, "server_lr": 1.0}})
    for key, value in fedavg.ctx.server["global"].items():
        assert torch.equal(fedavgm.ctx.server["global"][key], value), key
    assert same.final["acc_mean"] == plain.final["acc_mean"]
    _, moved = run_tiny(**{"experiment.rounds": 2, "algorithm.name": "fedavgm"})
    assert not torch.equal(moved.ctx.server["global"]["fc1.weight"], fedavg.ctx.server["global"]["fc1.weight"])


def test_buffers_take_fedavgs_average_and_only_parameters_are_stepped():
    batchnorm = {"model.params": {"hidden": [8], "norm": "batch"}, "experiment.rounds": 1}
    engine, ctx = prepared(**batchnorm, **{"algorithm.name": "fedadam"})
    assert set(ctx.server["m"]) == {"fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias", "fc2.weight", "fc2.bias"}
    engine.run_round(ctx, 1)
    fedavg, fctx = prepared(**batchnorm)
    fedavg.run_round(fctx, 1)
    for key in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        assert torch.equal(ctx.server["global"][key], fctx.server["global"][key]), key
    assert not torch.allclose(ctx.server["global"]["fc1.weight"], fctx.server["global"]["fc1.weight"], atol=1e-4)


def test_clients_are_evaluated_on_the_global_model():
    engine, ctx = prepared(**{"algorithm.name": "fedyogi"})
    engine.run_round(ctx, 1)
    state = evaluated_models(ctx, ctx.client(2))[""].state_dict()
    assert all(torch.equal(state[k], v) for k, v in ctx.server["global"].items())


# -- parameters -----------------------------------------------------------------------------


def test_defaults():
    adam, yogi, adagrad, avgm = FedAdamParams(), FedYogiParams(), FedAdagradParams(), FedAvgMParams()
    assert (adam.server_lr, adam.beta1, adam.beta2, adam.tau) == (0.1, 0.9, 0.99, 1e-3)
    assert (yogi.server_lr, yogi.beta1, yogi.beta2, yogi.tau) == (0.1, 0.9, 0.99, 1e-3)
    assert (adagrad.server_lr, adagrad.beta1, adagrad.tau) == (0.1, 0.0, 1e-3)
    assert (avgm.server_lr, avgm.beta1) == (1.0, 0.9)


@pytest.mark.parametrize("name,key,value,message", [
    ("fedadam", "beta2", 1.0, "must be in [0, 1), got 1.0"),
    ("fedyogi", "tau", 0.0, "must be > 0, got 0.0"),
    ("fedadagrad", "server_lr", -0.1, "must be > 0, got -0.1"),
    ("fedavgm", "beta1", 1.0, "must be in [0, 1), got 1.0"),
    ("fedadagrad", "beta2", 0.9, "unknown key"),
])
def test_a_bad_parameter_is_one_line_naming_its_key(tmp_path, capsys, name, key, value, message):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": name, f"algorithm.params.{key}": value}))
    assert line.startswith(f"pfl-run: error: algorithm.params.{key}: {message}"), line


def test_fedopt_needs_one_architecture():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedadam", "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"
