"""FedDyn (plugins/feddyn): the device objective's two terms by hand (the quadratic term's value,
the linear term's gradient and their signs), the gradient state's update, the server's h and
theta (Algorithm 1) by hand, two engine rounds recomputed from the algorithm, which model is
evaluated, and h = (1/m) sum_k g_k when uploads are lost (``dropout``)."""

from types import SimpleNamespace

import pytest
import torch
from harness import assert_close, assert_same, dry_run_error, far_apart, linear, mean_of, prepared, shrink
from test_scaffold import params_of, sgd_reference, tensors
from tiny import tiny_raw

from pfl_core import hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_plugins.feddyn import FedDyn, FedDynParams

LINEAR = {"model.params.hidden": [], "experiment.rounds": 2, "algorithm.name": "feddyn"}
PARAMS = ("fc1.weight", "fc1.bias")


def feddyn(alpha=0.5):
    return FedDyn(FedDynParams(alpha=alpha))


def received(model, grad, alpha=0.5, participant=True):
    """A device (id 0) that received theta^{t-1} (the model's weights), holding g_k = ``grad``."""
    client = SimpleNamespace(id=0, model=model, state={} if grad is None else {"grad": grad}, scratch={}, staged={})
    ctx = SimpleNamespace(participants=[0] if participant else [])
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert feddyn(alpha).on_receive(ctx=ctx, client=client, message={"weights": theta})
    return ctx, client


def grads(model):
    return model.weight.grad[0].tolist(), model.bias.grad.tolist()


# -- the device objective --------------------------------------------------------------------

def test_the_quadratic_term_by_hand_and_only_for_the_devices_model():
    model = linear([1.0, 2.0], [0.5])
    ctx, client = received(model, grad=None, alpha=0.5)
    assert feddyn(0.5).local_objective(ctx=ctx, client=client, model=model, x=None, y=None, logits=None).item() == 0
    with torch.no_grad():
        model.weight.add_(torch.tensor([[1.0, -3.0]]))
        model.bias.add_(1.0)
    term = feddyn(0.5).local_objective(ctx=ctx, client=client, model=model, x=None, y=None, logits=None)
    assert term.item() == pytest.approx(0.5 / 2 * 11)  # ||(1, -3, 1)||^2 = 11
    term.backward()  # its gradient alpha (theta - theta^{t-1})
    assert grads(model) == (pytest.approx([0.5, -1.5]), pytest.approx([0.5]))
    other = linear([0.0, 0.0], [0.0])
    assert feddyn(0.5).local_objective(ctx=ctx, client=client, model=other, x=None, y=None, logits=None) is None
    ctx, newcomer = received(model, grad=None, participant=False)  # a cold-start client: the plain loss
    assert feddyn(0.5).local_objective(ctx=ctx, client=newcomer, model=model, x=None, y=None, logits=None) is None


def test_the_linear_term_subtracts_the_gradient_state_from_every_step():
    model = linear([1.0, 2.0], [0.5])
    ctx, client = received(model, grad=tensors([0.25, -1.0], [2.0]))
    model.weight.grad, model.bias.grad = torch.tensor([[1.0, 1.0]]), torch.tensor([1.0])
    feddyn().adjust_gradients(ctx=ctx, client=client, model=model, optimizer=None)
    assert grads(model) == ([0.75, 2.0], [-1.0])  # grad of -<g_k, theta> is -g_k
    other = linear([0.0, 0.0], [0.0])
    other.weight.grad, other.bias.grad = torch.tensor([[1.0, 1.0]]), torch.tensor([1.0])
    feddyn().adjust_gradients(ctx=ctx, client=client, model=other, optimizer=None)
    assert grads(other) == ([1.0, 1.0], [1.0])


def test_a_new_device_starts_with_a_zero_gradient_state():
    model = linear([1.0, 2.0], [0.5])
    ctx, client = received(model, grad=None)
    model.weight.grad, model.bias.grad = torch.tensor([[1.0, 1.0]]), torch.tensor([1.0])
    feddyn().adjust_gradients(ctx=ctx, client=client, model=model, optimizer=None)
    assert grads(model) == ([1.0, 1.0], [1.0])


def test_the_gradient_state_update_by_hand_staged_until_the_upload_arrives():
    model = linear([1.0, 2.0], [0.5])  # theta^{t-1}
    g = tensors([0.25, -1.0], [2.0])
    ctx, client = received(model, grad=g, alpha=0.5)
    with torch.no_grad():  # theta_k^t
        model.weight.copy_(torch.tensor([[2.0, 0.0]]))
        model.bias.copy_(torch.tensor([0.0]))
    upload = feddyn(0.5).client_upload(ctx=ctx, client=client)
    # g_k - alpha (theta_k^t - theta^{t-1}) = (0.25 - 0.5, -1 + 1, 2 + 0.25)
    staged = client.staged["grad"]
    assert staged["weight"][0].tolist() == [-0.25, 0.0] and staged["bias"].tolist() == [2.25]
    assert client.state["grad"] is g  # g_k itself moves only when the engine commits it
    assert upload["weights"]["weight"][0].tolist() == [2.0, 0.0]


# -- the server ------------------------------------------------------------------------------

def state(weight, bias, running=0.0, count=0):
    return {**tensors(weight, bias), "running": torch.tensor([running]), "count": torch.tensor(count)}


def test_server_update_by_hand():
    theta = state([1.0, 1.0], [0.0])
    ctx = SimpleNamespace(server={"global": theta, "h": tensors([0.5, 0.0], [1.0])}, training_clients=[0, 1, 2, 3])
    uploads = [(0, {"weights": state([3.0, 1.0], [2.0], running=2.0, count=5)}),
               (1, {"weights": state([1.0, 5.0], [-2.0], running=6.0, count=8)})]
    assert feddyn(alpha=0.5).server_aggregate(ctx=ctx, uploads=iter(uploads), weights={0: 0.75, 1: 0.25})
    h, glob = ctx.server["h"], ctx.server["global"]
    # drift: (2, 0, 2) + (0, 4, -2) = (2, 4, 0); h - alpha/m drift, m = 4 devices: (0.5 - 0.25, -0.5, 1)
    assert h["weight"][0].tolist() == [0.25, -0.5] and h["bias"].tolist() == [1.0]
    # mean (0.75, 0.25): (2.5, 2, 1); minus h / alpha = (0.5, -1, 2)
    assert glob["weight"][0].tolist() == [2.0, 3.0] and glob["bias"].tolist() == [-1.0]
    assert glob["running"].tolist() == [3.0] and glob["count"].item() == 5  # buffers: FedAvg's average


def test_no_upload_leaves_the_server_as_it_was():
    ctx = SimpleNamespace(server={"global": state([1.0, 1.0], [0.0]), "h": tensors([0.5, 0.0], [1.0])},
                          training_clients=[0, 1])
    before = dict(ctx.server)
    assert feddyn().server_aggregate(ctx=ctx, uploads=iter([]), weights={})
    assert ctx.server == before


# -- two engine rounds, recomputed -----------------------------------------------------------

def test_two_rounds_recomputed_from_algorithm_1():
    alpha = 0.5
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.alpha": alpha})
    theta0 = dict(ctx.server["global"])

    def quadratic(anchor):
        return lambda model: alpha / 2 * sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())

    engine.run_round(ctx, 1)  # g_k = 0: each device minimises L_k + alpha/2 ||theta - theta^0||^2 (FedProx's)
    thetas = [sgd_reference(ctx, i, theta0, extra_loss=quadratic(theta0))[0] for i in range(4)]
    g1 = [{n: -alpha * (t[n] - theta0[n]) for n in PARAMS} for t in thetas]
    for i in range(4):
        assert_close(ctx.store[i]["grad"], g1[i], atol=1e-5)
    h1 = mean_of((0.25, g) for g in g1)  # h = -alpha/m sum (theta_k - theta^0) = (1/m) sum g_k
    assert_close(ctx.server["h"], h1, atol=1e-6)
    mean = mean_of((0.25, t) for t in thetas)
    theta1 = {n: mean[n] - h1[n] / alpha for n in PARAMS}
    assert_close(params_of(ctx.server["global"]), theta1, atol=1e-5)
    assert far_apart(theta1, mean, list(PARAMS))  # the correction matters: theta^1 is not the mean

    theta1 = dict(ctx.server["global"])
    engine.run_round(ctx, 2)  # now the linear term: every gradient minus g_k
    thetas2 = [sgd_reference(ctx, i, theta1, extra_loss=quadratic(theta1), adjust=lambda n, g, d=g1[i]: g - d[n])[0]
               for i in range(4)]
    flipped = [sgd_reference(ctx, i, theta1, extra_loss=quadratic(theta1), adjust=lambda n, g, d=g1[i]: g + d[n])[0]
               for i in range(4)]

    def server(thetas):
        h2 = {n: h1[n] - alpha / 4 * sum(t[n] - theta1[n] for t in thetas) for n in PARAMS}
        mean = mean_of((0.25, t) for t in thetas)
        return {n: mean[n] - h2[n] / alpha for n in PARAMS}, h2

    expected, h2 = server(thetas2)
    assert_close(params_of(ctx.server["global"]), expected, atol=1e-5)
    assert_close(ctx.server["h"], h2, atol=1e-5)
    assert far_apart(expected, server(flipped)[0], list(PARAMS))
    for i in range(4):
        assert_close(ctx.store[i]["grad"], {n: g1[i][n] - alpha * (thetas2[i][n] - theta1[n]) for n in PARAMS},
                     atol=1e-5)


def test_every_client_is_evaluated_on_the_server_model_not_the_mean_of_the_uploads():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- lost uploads ----------------------------------------------------------------------------

class EagerFedDyn(FedDyn):
    """The bug the lost-upload rule prevents: g_k advances even when the upload is lost."""

    @hookimpl
    def client_upload(self, ctx, client):
        upload = super().client_upload(ctx, client)
        client.state["grad"] = client.staged.pop("grad")
        return upload


def dropout_run(algorithm=FedDyn, executor="sequential"):
    raw = tiny_raw(**{**LINEAR, "experiment.rounds": 6, "experiment.participation": 0.75, "executor.name": executor,
                      "addons": [{"name": "dropout", "params": {"p": 0.4}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = algorithm(resolved.plugins[-1].params)
    engine = Engine(resolved, progress=False)
    result = engine.run()
    return engine.ctx, result


def mean_gradient_state(ctx):
    zero = {n: torch.zeros_like(t) for n, t in ctx.server["h"].items()}
    return mean_of((1 / len(ctx.training_clients), ctx.store[i].get("grad") or zero) for i in ctx.training_clients)


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_with_dropout_h_stays_the_mean_of_the_devices_gradient_states(executor):
    ctx, result = dropout_run(executor=executor)
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert_close(ctx.server["h"], mean_gradient_state(ctx), atol=1e-6)
    assert any(t.abs().max() > 1e-4 for t in ctx.server["h"].values())


def test_the_drift_check_catches_a_gradient_state_that_advances_on_a_lost_upload():
    ctx, _ = dropout_run(EagerFedDyn)
    assert far_apart(ctx.server["h"], mean_gradient_state(ctx), list(ctx.server["h"]), atol=1e-5)


# -- parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, -0.1, float("nan"), float("inf")])
def test_alpha_must_be_a_finite_positive_number(alpha):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "feddyn", "algorithm.params.alpha": alpha}))
    assert info.value.path == "algorithm.params.alpha"


def test_a_bad_parameter_is_one_line_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "feddyn", "algorithm.params.alpha": -1}))
    assert line.startswith("pfl-run: error: algorithm.params.alpha: must be > 0")


def test_feddyn_needs_one_architecture():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "feddyn", "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"


def test_defaults():
    assert FedDynParams().alpha == 0.01 and FedDynParams().weighting == "uniform"


# -- the model average: Algorithm 1's 1/|P_t| or the clients' sample shares --------------------

TWO_CLIENTS = {**LINEAR, "data.params.num_devices": 2, "partition.num_clients": 2}
UNIFORM, SAMPLES = {0: 0.5, 1: 0.5}, {0: 0.25, 1: 0.75}  # train splits of 20 and 60 samples


@pytest.mark.parametrize("weighting, weights, other", [("uniform", UNIFORM, SAMPLES), ("samples", SAMPLES, UNIFORM)])
def test_the_model_average_is_algorithm_1s_uniform_one_or_by_samples(weighting, weights, other):
    alpha = 0.5
    engine, ctx = prepared(**TWO_CLIENTS, **{"algorithm.params.weighting": weighting, "algorithm.params.alpha": alpha})
    shrink(ctx, {0: 20, 1: 60})
    assert ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1]) == weights
    theta0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)

    def quadratic(model):
        return alpha / 2 * sum(((p - theta0[n]) ** 2).sum() for n, p in model.named_parameters())

    thetas = [sgd_reference(ctx, i, theta0, extra_loss=quadratic)[0] for i in (0, 1)]
    h1 = {n: -alpha / 2 * sum(t[n] - theta0[n] for t in thetas) for n in PARAMS}  # 1/m, m = 2, either way
    assert_close(ctx.server["h"], h1, atol=1e-6)

    def server(w):
        mean = mean_of(((w[i], thetas[i]) for i in (0, 1)), keys=PARAMS)
        return {n: mean[n] - h1[n] / alpha for n in PARAMS}

    assert_close(params_of(ctx.server["global"]), server(weights), atol=1e-5)
    assert far_apart(server(weights), server(other), list(PARAMS))


@pytest.mark.parametrize("weighting, weight, bias", [("uniform", [2.0, 5.0], [-2.0]), ("samples", [1.5, 6.0], [-3.0])])
def test_the_server_step_by_hand_for_two_clients_of_20_and_60_samples(weighting, weight, bias):
    _, ctx = prepared(**TWO_CLIENTS, **{"algorithm.params.weighting": weighting, "algorithm.params.alpha": 0.5})
    shrink(ctx, {0: 20, 1: 60})
    ctx.server["global"], ctx.server["h"] = state([1.0, 1.0], [0.0]), tensors([0.5, 0.0], [1.0])
    weights = ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1])
    uploads = [(0, {"weights": state([3.0, 1.0], [2.0])}), (1, {"weights": state([1.0, 5.0], [-2.0])})]
    ctx.hooks.server_aggregate(ctx=ctx, uploads=iter(uploads), weights=weights)
    # drift (2, 0; 2) + (0, 4; -2) = (2, 4; 0); h = h - alpha/m drift, m = 2: (0, -1; 1); h / alpha = (0, -2; 2)
    # uniform mean (2, 3; 0), samples (3 + 3, 1 + 15; 2 - 6) / 4 = (1.5, 4; -1); theta = mean - h / alpha
    glob = ctx.server["global"]
    assert glob["weight"][0].tolist() == pytest.approx(weight) and glob["bias"].tolist() == pytest.approx(bias)


def test_a_bad_weighting_is_one_line_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "feddyn",
                                                       "algorithm.params.weighting": "size"}))
    assert line.startswith("pfl-run: error: algorithm.params.weighting: must be one of 'uniform', 'samples'")
