"""FedIIR (plugins/fediir): the gradient-alignment penalty and its double backward against a
closed-form classifier gradient (I3), the full-split classifier gradient at the received model (I2),
the server's FedAvg and moving average by hand (I4), three engine rounds recomputed independently
(the average accumulates: round 3 tells it from the last mean and from FL-bench's unstored blend),
the moving average over the arrivals only with lost uploads, which model is evaluated, cold-start
clients, bad input, the process executor and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, fresh_model, prepared, shrink, train_reference
from test_checkpoint import (
    empty_store,
)
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core import hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_plugins.fediir import FedIIR, FedIIRParams

assert empty_store  # the fixture used by the resume test (imported, not called)

HIDDEN = {"model.params.hidden": [8], "algorithm.name": "fediir", "algorithm.params.penalty": 0.5}
HEAD = ("fc2.weight", "fc2.bias")  # the classifier of the one-hidden-layer MLP


def iir(**params):
    return FedIIR(FedIIRParams(**{"penalty": 2.0, **params}))


def no_task_loss():
    """A ctx whose hooks answer no task_loss (the core's cross-entropy applies)."""
    return SimpleNamespace(task_loss=lambda **kw: None)


# -- (I3) the penalty by hand ----------------------------------------------------------------------


def two_class_linear(weight, bias):
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    return model


def closed_form_penalty(weight, bias, x, y, average, penalty):
    """penalty * ||g - g_bar||^2 with g written out: dCE/dW = (softmax(Wx + b) - e_y) x^T / B."""
    residual = torch.softmax(x @ weight.T + bias, dim=1) - F.one_hot(y, 2).float()
    g_weight, g_bias = residual.T @ x / len(y), residual.mean(0)
    return penalty * (((g_weight - average["weight"]) ** 2).sum() + ((g_bias - average["bias"]) ** 2).sum())


def test_the_penalty_and_its_double_backward_by_hand():
    model = two_class_linear([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    average = {"weight": torch.tensor([[-0.5, 0.0], [0.0, 1.0]]), "bias": torch.tensor([0.0, 0.5])}
    client = SimpleNamespace(id=0, model=model, scratch={"fediir": {"average": average}})
    ctx = SimpleNamespace(hooks=no_task_loss())
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([0])
    term = iir(penalty=2.0).local_objective(ctx=ctx, client=client, model=model, x=x, y=y, logits=model(x))
    # softmax = (1/2, 1/2), p - e_0 = (-1/2, 1/2): g_W = [[-0.5, -1], [0.5, 1]], g_b = (-0.5, 0.5);
    # g - g_bar: [[0, -1], [0.5, 0]] and (-0.5, 0): 1 + 0.25 + 0.25 = 1.5, times penalty 2
    assert torch.isclose(term, torch.tensor(3.0))
    term.backward()  # through the gradient (create_graph): the closed form's own gradient
    weight = torch.zeros(2, 2, requires_grad=True)
    bias = torch.zeros(2, requires_grad=True)
    closed_form_penalty(weight, bias, x, y, average, 2.0).backward()
    assert weight.grad.abs().max() > 0.05  # a detached inner gradient would give nothing here
    assert torch.allclose(model.weight.grad, weight.grad, atol=1e-6)
    assert torch.allclose(model.bias.grad, bias.grad, atol=1e-6)


def test_the_penalty_covers_the_classifier_only_and_only_the_clients_own_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    average = {"2.weight": torch.zeros(2, 4), "2.bias": torch.zeros(2)}
    client = SimpleNamespace(id=0, model=model, scratch={"fediir": {"average": average}})
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    plugin = iir(penalty=1.0)
    term = plugin.local_objective(ctx=SimpleNamespace(hooks=no_task_loss()), client=client, model=model, x=x, y=y,
                                  logits=model(x))
    head = torch.autograd.grad(F.cross_entropy(model(x), y), [model[2].weight, model[2].bias])
    assert torch.isclose(term, sum((g ** 2).sum() for g in head))  # the first layer's gradient is not in it
    other = nn.Linear(3, 2)  # another model (a probe, a teacher): no term
    assert plugin.local_objective(ctx=None, client=client, model=other, x=x, y=y, logits=other(x)) is None
    client.scratch = {}  # a cold-start client: no term
    assert plugin.local_objective(ctx=None, client=client, model=model, x=x, y=y, logits=model(x)) is None


# -- (I2) the gradient at the received model -------------------------------------------------------


def test_the_uploaded_gradient_is_the_full_split_mean_at_the_received_model():
    _, ctx = prepared(**HIDDEN)
    shrink(ctx, {0: 25})  # batches of 10, 10 and 5: the mean of batch means would differ
    ctx.participants = [0]
    theta = ctx.server["global"]
    client = ctx.client(0)
    plugin = iir()
    assert plugin.on_receive(ctx=ctx, client=client, message={"weights": theta})
    reference = fresh_model(ctx, theta)
    data = ctx.data.clients[0]
    expected = torch.autograd.grad(F.cross_entropy(reference(data.train_x), data.train_y),
                                   [reference.fc2.weight, reference.fc2.bias])
    gradient = client.scratch["fediir"]["gradient"]
    assert set(gradient) == set(HEAD)  # the classifier only
    assert_close(gradient, dict(zip(HEAD, expected)), atol=1e-6)
    batch_means = [torch.autograd.grad(F.cross_entropy(reference(data.train_x[s:s + 10]), data.train_y[s:s + 10]),
                                       [reference.fc2.weight])[0] for s in (0, 10, 20)]
    assert far_apart(gradient, {"fc2.weight": sum(batch_means) / 3}, ["fc2.weight"], atol=1e-5)
    assert_same(client.scratch["fediir"]["average"], {k: torch.zeros_like(v) for k, v in gradient.items()})
    assert client.work.private == 25 and client.work.private_steps == 0  # one pass, no step
    assert_same(client.model.state_dict(), theta)  # the client trains from w^t
    upload = plugin.client_upload(ctx=ctx, client=client)
    assert upload["gradient"] is gradient and set(upload) == {"weights", "gradient"}


def test_the_gradient_pass_leaves_the_batchnorm_statistics_as_received():
    _, ctx = prepared(**{**HIDDEN, "model.params.norm": "batch"})
    ctx.participants = [0]
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    theta = {k: (v + 0.3 if k.endswith("running_mean") else v) for k, v in theta.items()}  # not the fresh ones
    client = ctx.client(0)
    iir().on_receive(ctx=ctx, client=client, message={"weights": theta})
    assert any(k.endswith("running_mean") for k in theta)
    assert_same(client.model.state_dict(), theta)


def test_the_broadcast_target_and_a_cold_start_client():
    _, ctx = prepared(**HIDDEN)
    plugin = iir()
    ctx.participants = [1]
    assert set(plugin.on_broadcast(ctx=ctx, client_id=1)) == {"weights"}  # nothing arrived yet: zero, not sent
    ctx.server["gradient_average"] = {"fc2.bias": torch.ones(10)}
    message = plugin.on_broadcast(ctx=ctx, client_id=1)
    assert message["gradient_average"] is ctx.server["gradient_average"]
    assert set(plugin.on_broadcast(ctx=ctx, client_id=0)) == {"weights"}  # not training this round
    client = ctx.client(0)  # a cold-start client: FedAvg's fine-tuning, no gradient pass
    plugin.on_receive(ctx=ctx, client=client, message={"weights": ctx.server["global"]})
    assert "fediir" not in client.scratch and client.work.private == 0
    assert set(plugin.client_upload(ctx=ctx, client=client)) == {"weights"}


# -- (I4) the server -------------------------------------------------------------------------------


def test_the_server_step_by_hand():
    uploads = [(0, {"weights": {"w": torch.tensor([2.0, 0.0])}, "gradient": {"g": torch.tensor([4.0, 0.0])}}),
               (2, {"weights": {"w": torch.tensor([0.0, 4.0])}, "gradient": {"g": torch.tensor([0.0, 8.0])}})]
    weights = {0: 0.25, 2: 0.75}
    ctx = SimpleNamespace(server={"global": {"w": torch.zeros(2)}})
    assert iir(ema=0.9).server_aggregate(ctx, iter(uploads), weights) is True
    assert torch.allclose(ctx.server["global"]["w"], torch.tensor([0.5, 3.0]))  # FedAvg
    # mean = (1, 6); from the zero average: 0.1 (1, 6)
    assert torch.allclose(ctx.server["gradient_average"]["g"], torch.tensor([0.1, 0.6]))
    assert iir(ema=0.9).server_aggregate(ctx, iter(uploads), weights) is True
    # 0.9 (0.1, 0.6) + 0.1 (1, 6) = (0.19, 1.14)
    assert torch.allclose(ctx.server["gradient_average"]["g"], torch.tensor([0.19, 1.14]))
    kept = ctx.server["gradient_average"]
    assert iir().server_aggregate(ctx, iter([]), {}) is True and ctx.server["gradient_average"] is kept  # nobody


# -- in a run --------------------------------------------------------------------------------------


def penalised_loss(average, penalty):
    """Cross-entropy plus penalty * ||grad_fc2 CE(batch) - average||^2, written for the test's model."""
    def loss(model, x, y, logits):
        ce = F.cross_entropy(logits, y)
        grads = torch.autograd.grad(ce, [model.fc2.weight, model.fc2.bias], create_graph=True)
        return ce + penalty * sum(((g - average[n]) ** 2).sum() for n, g in zip(HEAD, grads))
    return loss


def full_split_gradient(ctx, i, state):
    model = fresh_model(ctx, state)
    data = ctx.data.clients[i]
    grads = torch.autograd.grad(F.cross_entropy(model(data.train_x), data.train_y), [model.fc2.weight, model.fc2.bias])
    return dict(zip(HEAD, grads))


def test_three_rounds_recomputed_independently():
    penalty, ema = 0.5, 0.5
    engine, ctx = prepared(**{**HIDDEN, "algorithm.params.ema": ema})
    shrink(ctx, {0: 40, 1: 70})  # unequal train sizes: p_i matters
    sizes = [ctx.data.clients[i].num_train for i in range(4)]
    p = [n / sum(sizes) for n in sizes]
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    average = {n: torch.zeros_like(theta[n]) for n in HEAD}
    last_mean = None
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        trained = [train_reference(ctx, i, theta, loss_fn=penalised_loss(average, penalty)) for i in range(4)]
        mean = {n: sum(p[i] * full_split_gradient(ctx, i, theta)[n] for i in range(4)) for n in HEAD}
        expected = {k: sum(p[i] * trained[i][k] for i in range(4)) for k in theta}
        plain = [train_reference(ctx, i, theta) for i in range(2)]  # FedAvg's clients, for contrast
        assert far_apart(trained[0], plain[0], list(theta)) and far_apart(trained[1], plain[1], list(theta))
        average = {n: ema * average[n] + (1 - ema) * mean[n] for n in HEAD}
        assert_close(ctx.server["global"], expected, atol=1e-5)
        assert_close(ctx.server["gradient_average"], average, atol=1e-6)
        if t == 3:  # the average accumulates: not the last mean, nor FL-bench's (1 - ema) * mean
            assert far_apart(average, mean, list(HEAD))
            assert far_apart(average, {n: (1 - ema) * mean[n] for n in HEAD}, list(HEAD))
            assert far_apart(average, {n: ema * last_mean[n] + (1 - ema) * mean[n] for n in HEAD}, list(HEAD))
        last_mean = mean
        theta = expected


def test_penalty_zero_is_fedavg_bit_for_bit():
    _, fediir = run_tiny(**{**HIDDEN, "algorithm.params.penalty": 0.0})
    _, fedavg = run_tiny(**{**HIDDEN, "algorithm.name": "fedavg", "algorithm.params": {}})
    assert_same(fediir.ctx.server["global"], fedavg.ctx.server["global"])
    assert "gradient_average" not in fediir.ctx.server


def test_the_gradient_pass_is_declared_and_measured_as_one_more_epoch():
    result, _ = run_tiny(**HIDDEN)  # 3 rounds, every client, one local epoch
    assert resolve(tiny_raw(**HIDDEN)).as_dict["budget"]["private_epochs_per_round"] == 2.0
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(6.0)
    plain = resolve(tiny_raw(**{**HIDDEN, "algorithm.params.penalty": 0.0})).as_dict["budget"]
    assert plain["private_epochs_per_round"] == 1.0


def test_every_client_is_evaluated_on_the_server_model():
    engine, ctx = prepared(**HIDDEN)
    engine.run_round(ctx, 1)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- lost uploads ----------------------------------------------------------------------------------


AGGREGATIONS: list = []  # RecordingFedIIR's: (round, the global model sent, [(client, weight, gradient)])


class RecordingFedIIR(FedIIR):
    """Keeps, per aggregation, the round, the global model sent and each arrival's weight and gradient."""

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        arrivals = []

        def recorded():
            for i, message in uploads:
                arrivals.append((i, weights[i], {n: g.clone() for n, g in message["gradient"].items()}))
                yield i, message

        sent = {k: v.clone() for k, v in ctx.server["global"].items()}
        result = super().server_aggregate(ctx, recorded(), weights)
        AGGREGATIONS.append((ctx.round, sent, arrivals))
        return result


def test_with_dropout_the_average_takes_the_arrivals_only():
    ema = 0.5
    raw = tiny_raw(**{**HIDDEN, "algorithm.params.ema": ema, "experiment.rounds": 5, "experiment.participation": 0.75,
                      "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = RecordingFedIIR(resolved.plugins[-1].params)
    AGGREGATIONS.clear()
    engine = Engine(resolved, progress=False)
    result = engine.run()
    ctx = engine.ctx
    dropped = sum(row.get("dropped_clients", 0) for row in result.history)
    assert dropped > 0
    assert len({r for r, _, arrivals in AGGREGATIONS}) == len(AGGREGATIONS)
    average = {n: torch.zeros_like(ctx.server["global"][n]) for n in HEAD}
    some_subset = False
    for _, sent, arrivals in AGGREGATIONS:
        some_subset |= len(arrivals) < 3
        assert sum(w for _, w, _ in arrivals) == pytest.approx(1.0)  # renormalised over the arrivals
        for i, _, gradient in arrivals:  # each is g_i at the model the server sent that round
            assert_close(gradient, full_split_gradient(ctx, i, sent), atol=1e-6)
        mean = {n: sum(w * g[n] for _, w, g in arrivals) for n in HEAD}
        average = {n: ema * average[n] + (1 - ema) * mean[n] for n in HEAD}
    assert some_subset
    assert_close(ctx.server["gradient_average"], average, atol=1e-6)


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("penalty", -1e-3), ("penalty", float("nan")), ("penalty", float("inf")),
                                            ("penalty", "0.1"), ("ema", 1.0), ("ema", -0.1), ("ema", float("nan"))])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**HIDDEN, f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**HIDDEN, "algorithm.params.ema": 1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.ema: must be in [0, 1)")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.penalty": 0.5,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fediir", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fediir", "algorithm.params.penalty": 0.5, "experiment.participation": 0.5}
    final = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert final  # the reference's final server state (gradient_average included) was compared
