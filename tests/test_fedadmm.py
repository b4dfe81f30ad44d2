"""FedADMM (plugins/fedadmm): the augmented-Lagrangian terms' gradient and signs (A1), the dual and
augmented-model updates (A2, A3) and the server step (A4) by hand, three engine rounds recomputed
independently (the dual only matters from round 2; round 3 checks it accumulates), theta = the mean
of every client's w_i + y_i / rho with lost uploads, which model is evaluated, bad input, the
process executor and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, linear, prepared, train_reference
from test_checkpoint import (
    empty_store,
)
from tiny import tiny_raw

from pfl_core import hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_plugins.fedadmm import FedADMM, FedADMMParams

assert empty_store  # the fixture used by the resume test (imported, not called)

LINEAR = {"model.params.hidden": [], "algorithm.name": "fedadmm", "algorithm.params.rho": 0.5}
PARAMS = ("fc1.weight", "fc1.bias")


def admm(**params):
    return FedADMM(FedADMMParams(**{"rho": 0.5, **params}))


def received(model, state, participant=True):
    """A client (id 0) that received theta (the model's current weights), holding ``state``."""
    client = SimpleNamespace(id=0, model=model, arch="mlp", state=state, scratch={}, staged={})
    ctx = SimpleNamespace(participants=[0] if participant else [],
                          models=SimpleNamespace(initial_state=lambda arch: {"weight": torch.tensor([[9.0, 9.0]]),
                                                                             "bias": torch.tensor([9.0])}))
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ctx, client, theta


# -- (A1)-(A3) by hand ----------------------------------------------------------------------------


def test_the_lagrangian_terms_and_their_gradient_by_hand():
    model = linear([1.0, 2.0], [0.5])
    ctx, client, theta = received(model, {"dual": {"weight": torch.tensor([[1.0, -1.0]]), "bias": torch.tensor([2.0])}})
    plugin = admm(rho=0.5)
    assert plugin.on_receive(ctx=ctx, client=client, message={"weights": theta})
    with torch.no_grad():  # w - theta = (1, -2), bias 1
        model.weight.add_(torch.tensor([[1.0, -2.0]]))
        model.bias.add_(1.0)
    term = plugin.local_objective(ctx=ctx, client=client, model=model, x=None, y=None, logits=None)
    # <y, w - theta> = 1 + 2 + 2 = 5; rho/2 ||w - theta||^2 = 0.25 * (1 + 4 + 1) = 1.5
    assert torch.isclose(term, torch.tensor(6.5))
    term.backward()  # the gradient y + rho (w - theta)
    assert torch.allclose(model.weight.grad, torch.tensor([[1.5, -2.0]]))
    assert torch.allclose(model.bias.grad, torch.tensor([2.5]))
    other = linear([0.0, 0.0], [0.0])  # another model (a teacher, a probe): no term
    assert plugin.local_objective(ctx=ctx, client=client, model=other, x=None, y=None, logits=None) is None


def test_the_dual_and_augmented_model_updates_by_hand():
    model = linear([1.0, 2.0], [0.5])
    state = {"dual": {"weight": torch.tensor([[1.0, -1.0]]), "bias": torch.tensor([2.0])},
             "augmented": {"weight": torch.tensor([[3.0, 3.0]]), "bias": torch.tensor([1.0])}}
    before = {key: {n: t.clone() for n, t in part.items()} for key, part in state.items()}
    ctx, client, theta = received(model, state)
    plugin = admm(rho=0.5)
    plugin.on_receive(ctx=ctx, client=client, message={"weights": theta})
    with torch.no_grad():
        model.weight.add_(torch.tensor([[1.0, -2.0]]))
        model.bias.add_(1.0)
    upload = plugin.client_upload(ctx=ctx, client=client)
    # (A2) y = (1, -1) + 0.5 (1, -2) = (1.5, -2); bias 2 + 0.5 = 2.5
    assert_close(client.staged["dual"], {"weight": torch.tensor([[1.5, -2.0]]), "bias": torch.tensor([2.5])})
    # (A3) s = w + y / rho = (2, 0) + (3, -4) = (5, -4); bias 1.5 + 5 = 6.5; Delta = s - (3, 3), 6.5 - 1
    assert_close(client.staged["augmented"], {"weight": torch.tensor([[5.0, -4.0]]), "bias": torch.tensor([6.5])})
    assert_close(upload["delta"], {"weight": torch.tensor([[2.0, -7.0]]), "bias": torch.tensor([5.5])})
    assert upload["buffers"] == {} and "weights" not in upload  # Delta replaces the weights
    for key, part in before.items():  # nothing advances before the upload arrives
        assert_same(client.state[key], part)


def test_a_first_visit_starts_from_zero_dual_and_the_initial_weights():
    model = linear([1.0, 2.0], [0.5])
    ctx, client, theta = received(model, {})
    plugin = admm(rho=0.5)
    plugin.on_receive(ctx=ctx, client=client, message={"weights": theta})
    own = client.scratch["fedadmm"]
    assert_same(own["dual"], {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    assert_same(own["augmented"], {"weight": torch.tensor([[9.0, 9.0]]), "bias": torch.tensor([9.0])})  # theta^0
    ctx, client, theta = received(model, {}, participant=False)  # a cold-start client: plain training
    plugin.on_receive(ctx=ctx, client=client, message={"weights": theta})
    assert "fedadmm" not in client.scratch


def test_the_server_step_by_hand():
    theta = {"w": torch.tensor([1.0, 1.0]), "running": torch.tensor([0.0]), "count": torch.tensor(3)}
    uploads = [(0, {"delta": {"w": torch.tensor([2.0, 0.0])}, "buffers": {"running": torch.tensor([10.0]),
                                                                          "count": torch.tensor(7)}}),
               (2, {"delta": {"w": torch.tensor([0.0, 4.0])}, "buffers": {"running": torch.tensor([20.0]),
                                                                          "count": torch.tensor(8)}})]
    weights = {0: 0.25, 1: 0.25, 2: 0.5}  # client 1's upload was lost
    ctx = SimpleNamespace(server={"global": theta}, training_clients=[0, 1, 2, 3])
    assert admm(eta=0.5).server_aggregate(ctx, iter(uploads), weights) is True
    # "all": theta + 0.5 / 4 (2, 4) ; buffers over the arrivals: (0.25 * 10 + 0.5 * 20) / 0.75
    assert torch.allclose(ctx.server["global"]["w"], torch.tensor([1.25, 1.5]))
    assert torch.allclose(ctx.server["global"]["running"], torch.tensor([50 / 3]))
    assert ctx.server["global"]["count"] == 7  # the first arrival's, as FedAvg
    ctx.server["global"] = theta
    assert admm(eta=0.5, weighting="participants").server_aggregate(ctx, iter(uploads), weights) is True
    # theta + 0.5 ((0.25 (2, 0) + 0.5 (0, 4)) / 0.75)
    assert torch.allclose(ctx.server["global"]["w"], torch.tensor([1 + 1 / 3, 1 + 4 / 3]))
    kept = ctx.server["global"]
    assert admm().server_aggregate(ctx, iter([]), {}) is True and ctx.server["global"] is kept  # nobody


# -- in a run --------------------------------------------------------------------------------------


def augmented_loss(theta, dual, rho):
    def loss(model, x, y, logits):
        penalty = sum((dual[n] * (p - theta[n])).sum() + rho / 2 * ((p - theta[n]) ** 2).sum()
                      for n, p in model.named_parameters())
        return F.cross_entropy(logits, y) + penalty
    return loss


def test_three_rounds_recomputed_independently():
    rho, eta = 0.5, 0.8
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.eta": eta})
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    dual = {i: {n: torch.zeros_like(theta[n]) for n in PARAMS} for i in range(4)}
    augmented = {i: {n: theta[n].clone() for n in PARAMS} for i in range(4)}  # s_i^0 = theta^0
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        trained = {i: train_reference(ctx, i, theta, loss_fn=augmented_loss(theta, dual[i], rho)) for i in range(4)}
        step, fedavg_like = {}, {}
        for i in range(4):
            dual[i] = {n: dual[i][n] + rho * (trained[i][n] - theta[n]) for n in PARAMS}
            new = {n: trained[i][n] + dual[i][n] / rho for n in PARAMS}
            for n in PARAMS:
                step[n] = step.get(n, 0) + (new[n] - augmented[i][n]) / 4
                fedavg_like[n] = fedavg_like.get(n, 0) + 2 * (trained[i][n] - theta[n]) / 4  # FL-bench's Delta
            augmented[i] = new
        expected = {n: theta[n] + eta * step[n] for n in PARAMS}
        assert_close({n: ctx.server["global"][n] for n in PARAMS}, expected, atol=1e-5)
        for i in range(4):
            assert_close(ctx.store[i]["dual"], dual[i], atol=1e-5)
            assert_close(ctx.store[i]["augmented"], augmented[i], atol=1e-4)
        if t > 1:  # from round 2 the dual differs from zero and Delta from FL-bench's 2 (w - theta)
            assert far_apart(expected, {n: theta[n] + eta * fedavg_like[n] for n in PARAMS}, list(PARAMS))
        theta = expected
    assert any(d.abs().max() > 1e-3 for d in dual[0].values())


def test_every_client_is_evaluated_on_the_server_model():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- lost uploads ----------------------------------------------------------------------------------


class EagerFedADMM(FedADMM):
    """The bug the lost-upload rule prevents: y_i and s_i advance even when the upload is lost."""

    @hookimpl
    def client_upload(self, ctx, client):
        upload = super().client_upload(ctx, client)
        client.state["dual"] = client.staged.pop("dual")
        client.state["augmented"] = client.staged.pop("augmented")
        return upload


def dropout_run(algorithm=FedADMM, executor="sequential"):
    raw = tiny_raw(**{**LINEAR, "experiment.rounds": 5, "experiment.participation": 0.75, "executor.name": executor,
                      "addons": [{"name": "dropout", "params": {"p": 0.4}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = algorithm(resolved.plugins[-1].params)
    engine = Engine(resolved, progress=False)
    result = engine.run()
    return engine.ctx, result


def mean_augmented(ctx):
    start = ctx.models.initial_state("mlp")
    own = [ctx.store[i].get("augmented") or {n: start[n] for n in PARAMS} for i in ctx.training_clients]
    return {n: sum(s[n] for s in own) / len(own) for n in PARAMS}


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_with_dropout_theta_stays_the_mean_of_every_clients_augmented_model(executor):
    ctx, result = dropout_run(executor=executor)
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert_close({n: ctx.server["global"][n] for n in PARAMS}, mean_augmented(ctx), atol=1e-5)


def test_the_mean_check_catches_a_dual_that_advances_on_a_lost_upload():
    ctx, _ = dropout_run(EagerFedADMM)
    assert far_apart({n: ctx.server["global"][n] for n in PARAMS}, mean_augmented(ctx), list(PARAMS), atol=1e-4)


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("rho", 0.0), ("rho", -1.0), ("rho", float("nan")), ("eta", 0.0),
                                            ("eta", float("inf")), ("eta", "1"), ("weighting", "uniform")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**LINEAR, f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**LINEAR, "algorithm.params.rho": -0.5}))
    assert line.startswith("pfl-run: error: algorithm.params.rho: must be > 0")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.rho": 0.5,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedadmm", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fedadmm", "algorithm.params.rho": 0.5, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
