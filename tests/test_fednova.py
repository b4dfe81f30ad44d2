"""FedNova (plugins/fednova): the normaliser ||a_i||_1 (plain SGD and the momentum form) by hand
and against torch's SGD, the upload (x_i, ||a_i||_1), the server's d_i and tau_eff step by hand
for two clients of 1 and 3 steps (with and without momentum), an engine round recomputed from
the formula, FedAvg when the steps are equal, the steps actually taken under the ``stragglers``
add-on (a normaliser from the configured epochs fails the same check), the batched executor,
which model is evaluated, and the spec's checks."""

from types import SimpleNamespace

import pytest
import torch
from harness import assert_close, dry_run_error, far_apart, linear, prepared, shrink, state_of, train_reference
from tiny import run_tiny, tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_plugins.faults import full_batches
from pfl_plugins.fednova import FedNova, FedNovaParams, normaliser

LINEAR = {"model.params.hidden": [], "experiment.rounds": 1, "algorithm.name": "fednova"}
KEYS = ["fc1.weight", "fc1.bias"]


def fednova(server_lr=1.0):
    return FedNova(FedNovaParams(server_lr=server_lr))


def tensors(weight, bias):
    return {"weight": torch.tensor([weight]), "bias": torch.tensor(bias)}


# -- ||a_i||_1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("steps, momentum, expected", [
    (0, 0.0, 0.0), (1, 0.0, 1.0), (3, 0.0, 3.0), (17, 0.0, 17.0),
    (0, 0.5, 0.0), (1, 0.5, 1.0), (2, 0.5, 2.5), (3, 0.5, 4.25),  # 1 + (1 + .5) + (1 + .5 + .25)
    (2, 0.9, 2.9), (3, 0.9, 5.61),  # 1 + 1.9 + 2.71
])
def test_the_normaliser_by_hand(steps, momentum, expected):
    assert normaliser(steps, momentum) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_the_normaliser_is_what_torch_sgd_moves_along_a_constant_gradient(momentum):
    """A linear loss c . w has the gradient c at every step, so tau steps of torch's SGD (with
    momentum) move w by exactly lr * c * ||a||_1: d = (x - y) / ||a||_1 = lr * c for every tau."""
    lr, c = 0.1, torch.tensor([[0.5, -2.0]])
    for tau in range(1, 6):
        model = linear([1.0, 2.0], [0.0])
        x = model.weight.detach().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        for _ in range(tau):
            optimizer.zero_grad()
            (c * model.weight).sum().backward()
            optimizer.step()
        d = (x - model.weight.detach()) / normaliser(tau, momentum)
        assert torch.allclose(d, lr * c, atol=1e-6), tau
        if momentum and tau > 1:  # dividing by the step count would not give lr * c
            assert not torch.allclose((x - model.weight.detach()) / tau, lr * c, atol=1e-3)


# -- the upload and the server, by hand -------------------------------------------------------

def trained_client(end, steps, momentum=0.0, client_id=0):
    """A client whose linear model ended at ``end`` (a weight row and a bias) after ``steps``
    optimiser steps: (ctx, client) for client_upload."""
    client = SimpleNamespace(id=client_id, model=linear(*end), steps=steps)
    ctx = SimpleNamespace(participants=[client_id], spec=SimpleNamespace(training=SimpleNamespace(momentum=momentum)))
    return ctx, client


X = ([1.0, 2.0], [0.5])  # x_t
ONE_STEP = ([0.8, 2.2], [0.4])  # x_t - x_A = (0.2, -0.2, 0.1) after tau_A = 1
THREE_STEPS = ([1.3, 1.4], [0.8])  # x_t - x_B = (-0.3, 0.6, -0.3) after tau_B = 3


def upload_of(end, steps, momentum=0.0):
    ctx, client = trained_client(end, steps, momentum)
    return fednova().client_upload(ctx=ctx, client=client)


@pytest.mark.parametrize("steps, momentum, a_norm", [(3, 0.0, 3.0), (1, 0.0, 1.0), (3, 0.5, 4.25), (0, 0.9, 0.0)])
def test_the_upload_is_the_model_and_the_normaliser_of_the_steps_taken(steps, momentum, a_norm):
    up = upload_of(THREE_STEPS, steps, momentum)
    assert up["a_norm"] == a_norm and up["buffers"] == {} and set(up["weights"]) == {"weight", "bias"}
    assert up["weights"]["weight"][0].tolist() == pytest.approx([1.3, 1.4]) and up["weights"]["bias"].tolist() == pytest.approx([0.8])


def server_with(x):
    return SimpleNamespace(server={"global": x})


def aggregate(uploads, weights, server_lr=1.0, x=None):
    ctx = server_with(tensors(*X) if x is None else x)
    assert fednova(server_lr).server_aggregate(ctx=ctx, uploads=iter(list(enumerate(uploads))), weights=weights) is True
    return ctx.server["global"]


def assert_model(glob, weight, bias):
    assert glob["weight"][0].tolist() == pytest.approx(weight, abs=1e-6)
    assert glob["bias"].tolist() == pytest.approx(bias, abs=1e-6)


@pytest.mark.parametrize("server_lr, weight, bias", [
    # d_A = (0.2, -0.2, 0.1) / 1, d_B = (-0.3, 0.6, -0.3) / 3 = (-0.1, 0.2, -0.1); tau_eff = 0.25 * 1 + 0.75 * 3 = 2.5;
    # sum_i p_i d_i = (0.05 - 0.075, -0.05 + 0.15, 0.025 - 0.075) = (-0.025, 0.1, -0.05); x - eta_g * 2.5 * that
    (1.0, [1.0625, 1.75], [0.625]),
    (0.5, [1.03125, 1.875], [0.5625]),
])
def test_two_clients_of_one_and_three_steps_by_hand(server_lr, weight, bias):
    glob = aggregate([upload_of(ONE_STEP, 1), upload_of(THREE_STEPS, 3)], {0: 0.25, 1: 0.75}, server_lr)
    assert_model(glob, weight, bias)
    # FedAvg would give 0.25 x_A + 0.75 x_B = (1.175, 1.6, 0.7): pulled towards the client of 3 steps


def test_two_clients_with_momentum_by_hand():
    """rho = 0.5: ||a_A||_1 = 1 (1 step), ||a_B||_1 = 1 + 1.5 + 1.75 = 4.25 (3 steps)."""
    glob = aggregate([upload_of(ONE_STEP, 1, 0.5), upload_of(THREE_STEPS, 3, 0.5)], {0: 0.25, 1: 0.75})
    tau_eff = 0.25 * 1 + 0.75 * 4.25
    mean_d = [0.25 * a + 0.75 * b / 4.25 for a, b in [(0.2, -0.3), (-0.2, 0.6), (0.1, -0.3)]]
    assert_model(glob, [1.0 - tau_eff * mean_d[0], 2.0 - tau_eff * mean_d[1]], [0.5 - tau_eff * mean_d[2]])


def test_a_client_that_took_no_step_adds_nothing():
    # tau_eff = 0.5 * 0 + 0.5 * 1; sum_i p_i d_i = 0.5 * 0 + 0.5 * d_A; x - 0.25 d_A
    assert_model(aggregate([upload_of(X, 0), upload_of(ONE_STEP, 1)], {0: 0.5, 1: 0.5}), [0.95, 2.05], [0.475])
    assert_model(aggregate([upload_of(X, 0), upload_of(X, 0)], {0: 0.5, 1: 0.5}), [1.0, 2.0], [0.5])


def test_buffers_are_averaged_as_fedavg_does_and_no_upload_changes_nothing():
    x = {**tensors(*X), "running": torch.tensor([0.0]), "count": torch.tensor(0)}

    def with_buffers(end, steps, running, count):
        up = upload_of(end, steps)
        up["buffers"] = {"running": torch.tensor([running]), "count": torch.tensor(count)}
        return up

    glob = aggregate([with_buffers(ONE_STEP, 1, 4.0, 7), with_buffers(THREE_STEPS, 3, 8.0, 9)], {0: 0.25, 1: 0.75},
                     server_lr=0.5, x=x)
    assert glob["running"].tolist() == pytest.approx([7.0], abs=1e-6) and glob["count"].item() == 7
    assert_model(glob, [1.03125, 1.875], [0.5625])
    ctx = server_with(x)
    before = dict(ctx.server)
    assert fednova().server_aggregate(ctx=ctx, uploads=iter([]), weights={}) is True
    assert ctx.server == before


# -- engine rounds ---------------------------------------------------------------------------

def recomputed(x0, ys, steps, weights, momentum=0.0, server_lr=1.0):
    """x0 - eta_g * tau_eff * sum_i p_i (x0 - y_i) / ||a_i||_1, written out in float64."""
    norms = {i: normaliser(steps[i], momentum) for i in ys}
    tau_eff = sum(weights[i] * norms[i] for i in ys)
    return {n: (x0[n].double() - server_lr * tau_eff * sum(
        weights[i] * (x0[n].double() - ys[i][n].double()) / norms[i] for i in ys)).float() for n in KEYS}


def test_an_engine_round_with_one_and_three_steps_recomputed_from_the_formula():
    engine, ctx = prepared(**LINEAR, **{"partition.num_clients": 2, "data.params.num_devices": 2,
                                        "algorithm.params.server_lr": 0.7})
    shrink(ctx, {0: 10, 1: 30})  # batches of 10: tau_0 = 1, tau_1 = 3
    x0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)
    ys = {i: train_reference(ctx, i, x0) for i in (0, 1)}
    expected = recomputed(x0, ys, {0: 1, 1: 3}, {0: 0.25, 1: 0.75}, server_lr=0.7)
    assert_close(ctx.server["global"], expected, KEYS, atol=1e-6)
    fedavg = {n: 0.25 * ys[0][n] + 0.75 * ys[1][n] for n in KEYS}
    wrong = recomputed(x0, ys, {0: 1, 1: 1}, {0: 0.25, 1: 0.75}, server_lr=0.7)  # not normalised
    assert far_apart(expected, fedavg, KEYS) and far_apart(expected, wrong, KEYS)


def test_with_equal_steps_it_is_fedavg():
    rounds = {**LINEAR, "experiment.rounds": 3}
    nova_result, nova = run_tiny(**rounds)
    avg_result, avg = run_tiny(**{**rounds, "algorithm.name": "fedavg"})
    sizes = {avg.ctx.data.clients[i].num_train for i in range(4)}
    assert len(sizes) == 1  # every client takes the same number of steps
    assert_close(nova.ctx.server["global"], avg.ctx.server["global"], atol=1e-6)
    assert nova_result.final["acc_mean"] == pytest.approx(avg_result.final["acc_mean"], abs=1e-6)


def test_with_unequal_steps_it_is_not_fedavg():
    nova_engine, nova_ctx = prepared(**LINEAR)
    avg_engine, avg_ctx = prepared(**{**LINEAR, "algorithm.name": "fedavg"})
    for ctx in (nova_ctx, avg_ctx):
        shrink(ctx, {0: 10, 1: 30, 2: 50, 3: 84})
    nova_engine.run_round(nova_ctx, 1)
    avg_engine.run_round(avg_ctx, 1)
    assert far_apart(nova_ctx.server["global"], avg_ctx.server["global"], KEYS)


class StepSpy(Plugin):
    """Counts every optimiser step of each client (``adjust_gradients`` runs once per step and
    changes nothing) and keeps its model as uploaded (a wrapper: after the algorithm)."""

    name = "step_spy"

    def __init__(self):
        super().__init__()
        self.steps, self.models = {}, {}

    @hookimpl
    def adjust_gradients(self, ctx, client, model, optimizer):
        self.steps[client.id] = self.steps.get(client.id, 0) + 1

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.models[client.id] = state_of(client.model)
        return upload


class NominalFedNova(FedNova):
    """The bug the stragglers test catches: normalising by the configured local work (the
    batches of ``training.local_epochs`` epochs), not by the steps taken."""

    @hookimpl
    def client_upload(self, ctx, client):
        upload = super().client_upload(ctx, client)
        upload["a_norm"] = float(full_batches(client.num_train, ctx.spec.training))
        return upload


def straggling_round(algorithm=FedNova, momentum=0.0):
    """One round where every client straggles: (x0, the new global model, spy, full batches)."""
    raw = tiny_raw(**{**LINEAR, "training.local_epochs": 2, "training.momentum": momentum,
                      "addons": [{"name": "stragglers", "params": {"fraction": 1.0}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = algorithm(resolved.plugins[-1].params)
    spy = StepSpy()
    resolved.plugins.insert(0, spy)
    engine = Engine(resolved, progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    x0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)
    full = {i: full_batches(ctx.data.clients[i].num_train, ctx.spec.training) for i in range(4)}
    return x0, ctx.server["global"], spy, full


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_straggler_is_normalised_by_the_steps_it_took(momentum):
    x0, glob, spy, full = straggling_round(momentum=momentum)
    assert all(0 < spy.steps[i] < full[i] for i in range(4)) and len(set(spy.steps.values())) > 1
    expected = recomputed(x0, spy.models, spy.steps, {i: 0.25 for i in range(4)}, momentum=momentum)
    assert_close(glob, expected, KEYS, atol=1e-6)


def test_normalising_by_the_configured_steps_fails_the_straggler_check():
    x0, glob, spy, full = straggling_round(NominalFedNova)
    expected = recomputed(x0, spy.models, spy.steps, {i: 0.25 for i in range(4)})
    assert far_apart(glob, expected, KEYS, atol=1e-4)
    # ... and it is what normalising by the configured steps gives
    assert_close(glob, recomputed(x0, spy.models, full, {i: 0.25 for i in range(4)}), KEYS, atol=1e-6)


def test_the_batched_executor_counts_the_same_steps_as_the_sequential_loop():
    """Clients trained together (vmap) report their own steps, stragglers' budgets and momentum
    included: the same global model within float rounding."""
    from test_batched import UNEVEN, assert_close_to_sequential

    assert_close_to_sequential({"algorithm.name": "fednova", **UNEVEN,
                                "addons": [{"name": "stragglers", "params": {"fraction": 0.6}}]})


# -- what is evaluated -----------------------------------------------------------------------

def test_every_client_is_evaluated_on_the_global_model():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert list(models) == [""]
        assert_close(state_of(models[""]), ctx.server["global"], atol=0)


# -- parameters and the spec -----------------------------------------------------------------

@pytest.mark.parametrize("server_lr", [0.0, -1.0, float("nan"), float("inf")])
def test_server_lr_must_be_a_finite_positive_number(server_lr):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fednova", "algorithm.params.server_lr": server_lr}))
    assert info.value.path == "algorithm.params.server_lr"


def test_adam_is_refused_naming_the_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fednova", "training.optimizer": "adam"}))
    assert info.value.path == "training.optimizer"
    assert info.value.message == ("fednova normalises by ||a_i||_1, the weights SGD's steps give the local gradients "
                                  "(Section 4.1); got 'adam', use \"sgd\"")


def test_momentum_is_accepted():
    assert resolve(tiny_raw(**{"algorithm.name": "fednova", "training.momentum": 0.9}))


def test_a_bad_parameter_is_one_line_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "fednova", "algorithm.params.server_lr": 0}))
    assert line.startswith("pfl-run: error: algorithm.params.server_lr: must be > 0")


def test_defaults():
    assert FedNovaParams().server_lr == 1.0
    assert resolve(tiny_raw(**{"algorithm.name": "fednova"})).as_dict["algorithm"]["params"] == {"server_lr": 1.0}
