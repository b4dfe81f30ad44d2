"""Elastic aggregation (plugins/elastic): the output sensitivity (S1) and the elastic step (S3) by
hand, a round recomputed independently, the moving average carried over three visits and kept
when an upload is lost, one participant at tau = 1 is FedAvg bit for bit, the evaluated model is
the global one, bad input, the process executor and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
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
from pfl_plugins.elastic import Elastic, ElasticParams, elastic_coefficients, output_sensitivity

BASE = {"algorithm.name": "elastic", "model.params.hidden": [8],
        "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}


def linear(weight, bias):
    model = torch.nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    return model


# -- (S1) and (S3) by hand --------------------------------------------------------------------------


def test_the_output_sensitivity_by_hand():
    # f(x) = -x1 - 2 x2; batches of 2: {(1, 0), (0, 1)} then {(1, 1)}; d/dw mean f^2 = mean 2 f x
    model = linear([[-1.0, -2.0]], [0.0])
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # batch 1: f = (-1, -2): |dW| = |(-1, -2)| = (1, 2), |db| = |mean 2f| = 3
    # batch 2: f = -3:       |dW| = (6, 6),               |db| = 6
    omega = output_sensitivity(model, x, 2, 0.5)
    assert torch.allclose(omega["weight"], torch.tensor([[3.25, 3.5]]))  # .5 (.5 (1, 2)) + .5 (6, 6)
    assert torch.allclose(omega["bias"], torch.tensor([3.75]))  # .5 (.5 * 3) + .5 * 6
    # continuing a previous average (2, 2), 4: the old value is damped by mu, the new one by 1 - mu
    previous = {"weight": torch.tensor([[2.0, 2.0]]), "bias": torch.tensor([4.0])}
    omega = output_sensitivity(model, x, 2, 0.5, previous)
    assert torch.allclose(omega["weight"], torch.tensor([[3.75, 4.0]]))
    assert torch.allclose(omega["bias"], torch.tensor([4.75]))
    assert torch.equal(previous["weight"], torch.tensor([[2.0, 2.0]]))  # the caller's copy is untouched
    # mu = 0.9 weighs the older batches more: (0.1 * 0.9 * 3 + 0.1 * 6) for the bias
    assert torch.allclose(output_sensitivity(model, x, 2, 0.9)["bias"], torch.tensor([0.87]))


def test_the_sensitivity_pass_is_a_measurement_in_eval_mode():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    omega = output_sensitivity(model, torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), 4, 0.5)
    assert model.training  # restored
    assert_same(model.state_dict(), before)  # BatchNorm's statistics untouched, no weight moved
    assert set(omega) == {n for n, _ in model.named_parameters()}  # parameters only, no buffer
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind for training


def test_the_elastic_coefficients_by_hand():
    # Omega / Omega_max = 0.5, 0/0 (no participant's output depends on it), 1
    zeta = elastic_coefficients(torch.tensor([0.5, 0.0, 0.2]), torch.tensor([1.0, 0.0, 0.2]), 0.5)
    assert torch.allclose(zeta, torch.tensor([1.0, 1.5, 0.5]))


def test_the_server_step_by_hand():
    plugin = Elastic(ElasticParams(tau=0.5))
    ctx = SimpleNamespace(server={"global": {"w": torch.tensor([0.0, 1.0]), "running": torch.tensor([0.0])}})
    uploads = [
        (0, {"weights": {"w": torch.tensor([1.0, 2.0]), "running": torch.tensor([10.0])},
             "sensitivity": {"w": torch.tensor([1.0, 0.0])}}),
        (1, {"weights": {"w": torch.tensor([3.0, 4.0]), "running": torch.tensor([20.0])},
             "sensitivity": {"w": torch.tensor([3.0, 0.0])}}),
    ]
    assert plugin.server_aggregate(ctx, iter(uploads), {0: 0.25, 1: 0.75}) is True
    # w_avg = (2.5, 3.5); Omega = (2.5, 0), Omega_max = (3, 0): zeta = (1.5 - 5/6, 1.5) = (2/3, 1.5)
    # w = w_t + zeta (w_avg - w_t) = (2/3 * 2.5, 1 + 1.5 * 2.5)
    assert torch.allclose(ctx.server["global"]["w"], torch.tensor([5 / 3, 4.75]))
    assert torch.allclose(ctx.server["global"]["running"], torch.tensor([17.5]))  # a buffer: FedAvg's
    kept = ctx.server["global"]
    assert plugin.server_aggregate(ctx, iter([]), {}) is True and ctx.server["global"] is kept  # nobody


# -- in a run --------------------------------------------------------------------------------------


def sensitivities(ctx, start, mu=0.95, previous=None):
    """(S1) for every client at ``start``, continuing ``previous`` (client id -> its average)."""
    return {i: output_sensitivity(fresh_model(ctx, start), ctx.data.clients[i].train_x,
                                  ctx.spec.training.batch_size, mu, (previous or {}).get(i)) for i in range(4)}


def expected_round(ctx, start, tau, mu=0.95, previous=None):
    """(S1)-(S3) written out: each client's sensitivity and training from ``start``, then the step."""
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    p = {i: n / sum(sizes.values()) for i, n in sizes.items()}
    omegas = sensitivities(ctx, start, mu, previous)
    trained = {i: train_reference(ctx, i, start) for i in range(4)}
    average = mean_of((p[i], trained[i]) for i in range(4))
    expected = {}
    for key in average:
        weighted = sum(p[i] * omegas[i][key] for i in range(4))
        maximum = torch.stack([omegas[i][key] for i in range(4)]).max(dim=0).values
        zeta = 1 + tau - weighted / maximum
        expected[key] = start[key] - zeta * (start[key] - average[key])
    return expected, average, omegas


def test_a_round_recomputed_independently():
    engine, ctx = prepared(**BASE, **{"algorithm.params.tau": 0.3})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    expected, average, _ = expected_round(ctx, start, 0.3)
    assert_close(ctx.server["global"], expected, atol=1e-5)
    assert far_apart(expected, average, list(average), atol=1e-3)  # the test tells Elastic from FedAvg


def test_the_moving_average_carries_over_three_visits_and_survives_lost_uploads():
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 0.5}}])
    carried = {}
    for t in (1, 2, 3):
        start = {k: v.clone() for k, v in ctx.server["global"].items()}
        carried = sensitivities(ctx, start, previous=carried)
        engine.run_round(ctx, t)
        for i in range(4):  # every client trained, delivered or not: its own estimate advanced
            assert_close(ctx.store[i]["sensitivity"], carried[i], atol=1e-6)
    restarted = output_sensitivity(fresh_model(ctx, start), ctx.data.clients[0].train_x, 10, 0.95)
    assert far_apart(carried[0], restarted, list(restarted), atol=1e-4)  # round 3 is not round 3 alone


def test_some_uploads_are_lost_in_that_setting():
    result, _ = run_tiny(**BASE, addons=[{"name": "dropout", "params": {"p": 0.5}}])
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0


def test_one_participant_at_tau_one_is_fedavg_bit_for_bit():
    # one upload: Omega = Omega_max, so zeta = tau = 1 and w_{t+1} is that client's weights
    one = {**BASE, "experiment.participation": 0.25}
    _, elastic = run_tiny(**one, **{"algorithm.params.tau": 1.0})
    _, avg = run_tiny(**{**one, "algorithm.name": "fedavg"})
    assert_same(elastic.ctx.server["global"], avg.ctx.server["global"])
    _, half = run_tiny(**one)  # tau = 0.5: half of each update
    assert far_apart(half.ctx.server["global"], avg.ctx.server["global"], list(avg.ctx.server["global"]))
    assert elastic.ctx.comm_up == 2 * avg.ctx.comm_up and elastic.ctx.comm_down == avg.ctx.comm_down


def test_each_client_is_scored_with_the_global_model():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for i in range(4):
        models = evaluated_models(ctx, ctx.client(i))
        assert list(models) == [""]
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("tau", -0.1), ("tau", float("nan")), ("tau", "1"),
                                            ("mu", 1.0), ("mu", -0.5), ("mu", True)])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.mu": 1.5}))
    assert line.startswith("pfl-run: error: algorithm.params.mu") and "[0, 1)" in line


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {key: value for key, value in BASE.items() if key != "algorithm.name"}
    overrides["addons"] = [{"name": "dropout", "params": {"p": 0.3}}]
    assert_pool_matches_sequential("elastic", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_with_lost_uploads_and_a_newcomer():
    """executor.device = "cuda": the sensitivities and the elastic step stay on the device, and one
    participant at tau = 1 is FedAvg there too."""
    overrides = {**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    assert all(t.device.type == "cuda" for t in engine.ctx.server["global"].values())
    estimates = [engine.ctx.store[i]["sensitivity"] for i in range(4) if "sensitivity" in engine.ctx.store[i]]
    assert len(estimates) == 3 and all(t.device.type == "cuda" for omega in estimates for t in omega.values())
    assert result.final["acc_mean"] == result.final["acc_mean"]  # finite, not NaN
    one = {**BASE, "executor.device": "cuda", "experiment.participation": 0.25}
    _, elastic = run_tiny(**one, **{"algorithm.params.tau": 1.0})
    _, avg = run_tiny(**{**one, "algorithm.name": "fedavg"})
    assert_same(elastic.ctx.server["global"], avg.ctx.server["global"])
