"""SCAFFOLD (plugins/scaffold), option II: the corrected local step (Eq. 3) by hand and its sign,
the control variate c_i+ (Eq. 4) with the steps the client really took, the server's x and c
(Eq. 5) with its learning rate, two engine rounds recomputed from the paper's equations,
which model is evaluated, and c = (1/N) sum_i c_i when uploads are lost (``dropout``)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    fresh_model,
    linear,
    mean_of,
    prepared,
    shrink,
)
from tiny import run_tiny, tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.aggregate import weighted_average
from pfl_core.runtime.training import batch_order, batch_starts
from pfl_plugins.scaffold import Scaffold, ScaffoldParams

LINEAR = {"model.params.hidden": [], "experiment.rounds": 2, "algorithm.name": "scaffold"}


def scaffold(server_lr=1.0):
    return Scaffold(ScaffoldParams(server_lr=server_lr))


def tensors(weight, bias):
    return {"weight": torch.tensor([weight]), "bias": torch.tensor(bias)}


def received(model, c, c_i, participant=True):
    """A client (id 0) that received x (the model's weights) and c, holding c_i."""
    client = SimpleNamespace(id=0, model=model, state={} if c_i is None else {"c_i": c_i}, scratch={}, staged={})
    ctx = SimpleNamespace(participants=[0] if participant else [],
                          spec=SimpleNamespace(training=SimpleNamespace(lr=0.05)))
    x = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert scaffold().on_receive(ctx=ctx, client=client, message={"weights": x, "c": c})
    return ctx, client


def set_grads(model, weight, bias):
    model.weight.grad, model.bias.grad = torch.tensor([weight]), torch.tensor(bias)


def grads(model):
    return model.weight.grad[0].tolist(), model.bias.grad.tolist()


# -- Eq. 3: the corrected local step ---------------------------------------------------------

def test_each_step_descends_along_g_minus_c_i_plus_c():
    model = linear([1.0, 2.0], [0.5])
    ctx, client = received(model, c=tensors([1.0, 1.0], [1.0]), c_i=tensors([3.0, -1.0], [0.5]))
    set_grads(model, [0.1, 0.2], [0.3])
    scaffold().adjust_gradients(ctx=ctx, client=client, model=model, optimizer=None)
    # g - c_i + c = (0.1 - 3 + 1, 0.2 + 1 + 1, 0.3 - 0.5 + 1)
    assert grads(model) == (pytest.approx([-1.9, 2.2], abs=1e-6), pytest.approx([0.8], abs=1e-6))


def test_a_new_client_has_c_i_zero_and_other_models_and_cold_start_clients_are_not_corrected():
    model = linear([1.0, 2.0], [0.5])
    ctx, client = received(model, c=tensors([1.0, -2.0], [0.25]), c_i=None)
    set_grads(model, [0.0, 0.0], [0.0])
    scaffold().adjust_gradients(ctx=ctx, client=client, model=model, optimizer=None)
    assert grads(model) == ([1.0, -2.0], [0.25])  # c - 0
    other = linear([0.0, 0.0], [0.0])
    set_grads(other, [0.5, 0.5], [0.5])
    scaffold().adjust_gradients(ctx=ctx, client=client, model=other, optimizer=None)
    assert grads(other) == ([0.5, 0.5], [0.5])
    ctx, newcomer = received(model, c=tensors([1.0, -2.0], [0.25]), c_i=None, participant=False)
    set_grads(model, [0.0, 0.0], [0.0])
    scaffold().adjust_gradients(ctx=ctx, client=newcomer, model=model, optimizer=None)
    assert grads(model) == ([0.0, 0.0], [0.0]) and newcomer.scratch == {}


# -- Eq. 4, option II ------------------------------------------------------------------------

def test_option_two_control_variate_by_hand_staged_until_the_upload_arrives():
    model = linear([1.0, 2.0], [0.5])  # x
    c, c_i = tensors([1.0, 1.0], [1.0]), tensors([3.0, -1.0], [0.5])
    ctx, client = received(model, c, c_i)
    with torch.no_grad():  # y_i after K = 4 local steps of eta_l = 0.05
        model.weight.copy_(torch.tensor([[0.8, 2.3]]))
        model.bias.copy_(torch.tensor([0.4]))
    client.steps = 4
    upload = scaffold().client_upload(ctx=ctx, client=client)
    # (x - y) / (K eta_l) = (0.2, -0.3, 0.1) / 0.2 = (1, -1.5, 0.5); c_i+ = c_i - c + that
    plus = client.staged["c_i"]
    assert plus["weight"][0].tolist() == pytest.approx([3.0, -3.5], abs=1e-6) and plus["bias"].tolist() == pytest.approx([0.0], abs=1e-6)
    delta = upload["delta_c"]
    assert delta["weight"][0].tolist() == pytest.approx([0.0, -2.5], abs=1e-6) and delta["bias"].tolist() == pytest.approx([-0.5], abs=1e-6)
    assert upload["weights"]["weight"][0].tolist() == pytest.approx([0.8, 2.3], abs=1e-6)  # y_i
    assert client.state["c_i"] is c_i  # c_i itself moves only when the engine commits the staged one


def test_normalised_by_the_steps_taken():
    model = linear([1.0, 2.0], [0.5])
    zero = tensors([0.0, 0.0], [0.0])
    ctx, client = received(model, zero, zero)
    with torch.no_grad():
        model.weight.sub_(0.3)
    for steps, expected in [(1, 6.0), (3, 2.0), (6, 1.0)]:  # 0.3 / (K * 0.05)
        client.steps = steps
        scaffold().client_upload(ctx=ctx, client=client)
        assert client.staged["c_i"]["weight"][0].tolist() == pytest.approx([expected, expected], abs=1e-6)
    client.steps = 0  # no step taken: nothing learnt, c_i stays
    upload = scaffold().client_upload(ctx=ctx, client=client)
    assert client.staged["c_i"] is zero and upload["delta_c"]["weight"].abs().sum() == 0


# -- Eq. 5: the server ---------------------------------------------------------------------

def upload(weight, bias, dc_weight, dc_bias, running=0.0, count=7):
    return {"weights": {**tensors(weight, bias), "running": torch.tensor([running]), "count": torch.tensor(count)},
            "delta_c": tensors(dc_weight, dc_bias)}


def test_server_update_by_hand_with_a_server_learning_rate():
    x = {**tensors([0.0, 0.0], [0.0]), "running": torch.tensor([0.0]), "count": torch.tensor(0)}
    ctx = SimpleNamespace(server={"global": x, "c": tensors([1.0, 1.0], [1.0])}, training_clients=[0, 1, 2, 3])
    uploads = [(0, upload([1.0, 2.0], [1.0], [1.0, 1.0], [2.0], running=4.0, count=7)),
               (1, upload([3.0, 0.0], [-1.0], [3.0, -1.0], [0.0], running=8.0, count=9))]
    assert scaffold(server_lr=0.5).server_aggregate(ctx=ctx, uploads=iter(uploads), weights={0: 0.25, 1: 0.75})
    glob, c = ctx.server["global"], ctx.server["c"]
    # mean y = (2.5, 0.5, -0.5); x + 0.5 (mean y - x)
    assert glob["weight"][0].tolist() == pytest.approx([1.25, 0.25], abs=1e-6) and glob["bias"].tolist() == pytest.approx([-0.25], abs=1e-6)
    assert glob["running"].tolist() == pytest.approx([7.0], abs=1e-6) and glob["count"].item() == 7  # buffers: FedAvg's
    # c + (1/N) sum delta c, N = 4 training clients (not the 2 participants, not their weights)
    assert c["weight"][0].tolist() == pytest.approx([2.0, 1.0], abs=1e-6) and c["bias"].tolist() == pytest.approx([1.5], abs=1e-6)


def test_server_lr_one_is_the_weighted_mean_bit_for_bit_and_no_upload_changes_nothing():
    x = tensors([0.3, -0.7], [0.1])
    uploads = [(0, upload([1.1, 2.3], [1.7], [1.0, 1.0], [2.0])), (1, upload([3.1, 0.9], [-1.3], [3.0, -1.0], [0.0]))]
    ctx = SimpleNamespace(server={"global": x, "c": tensors([0.0, 0.0], [0.0])}, training_clients=[0, 1])
    scaffold().server_aggregate(ctx=ctx, uploads=iter(uploads), weights={0: 0.3, 1: 0.7})
    assert_same(ctx.server["global"], weighted_average([(0.3, uploads[0][1]["weights"]), (0.7, uploads[1][1]["weights"])]))
    before = dict(ctx.server)
    assert scaffold(server_lr=2.0).server_aggregate(ctx=ctx, uploads=iter([]), weights={}) is True
    assert ctx.server == before


# -- two engine rounds, recomputed -----------------------------------------------------------

def sgd_reference(ctx, client_id, start, adjust=None, extra_loss=None):
    """What client ``client_id`` gets from ``start`` in this round by plain SGD on cross-entropy
    (+ ``extra_loss(model)``), ``adjust(name, grad)`` applied to every step's gradient; the
    client's seeded batch order, written out here rather than through ``client.train``.
    Returns (state, steps)."""
    model = fresh_model(ctx, start)
    client, training = ctx.client(client_id), ctx.spec.training
    data = client.data
    optimizer = torch.optim.SGD(model.parameters(), lr=training.lr)
    generator, steps = client.generator("train"), 0
    for _ in range(training.local_epochs):
        order = batch_order(data.num_train, generator, training.shuffle)
        for begin in batch_starts(data.num_train, training.batch_size, training.drop_last):
            idx = order[begin:begin + training.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            (loss if extra_loss is None else loss + extra_loss(model)).backward()
            if adjust is not None:
                for name, p in model.named_parameters():
                    p.grad = adjust(name, p.grad)
            optimizer.step()
            steps += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, steps


def params_of(state, names=("fc1.weight", "fc1.bias")):
    return {n: state[n] for n in names}


def test_round_one_is_fedavg_bit_for_bit():
    _, scaffold_engine = run_tiny(**{**LINEAR, "experiment.rounds": 1, "algorithm.params.weighting": "samples"})
    _, fedavg_engine = run_tiny(**{**LINEAR, "experiment.rounds": 1, "algorithm.name": "fedavg"})
    assert_same(scaffold_engine.ctx.server["global"], fedavg_engine.ctx.server["global"])


def test_two_rounds_recomputed_from_equations_3_4_5():
    lr, eta_g = 0.1, 0.5
    engine, ctx = prepared(**LINEAR, **{"training.local_epochs": 2, "training.lr": lr,
                                        "algorithm.params.server_lr": eta_g})
    x0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)
    # round 1: c = c_i = 0, so y_i is plain SGD; c_i = (x0 - y_i) / (K eta_l), K = 2 epochs of batches
    ys, c_is = [], []
    for i in range(4):
        y, steps = sgd_reference(ctx, i, x0)
        assert steps == 2 * (ctx.data.clients[i].num_train // 10)
        c_i = {n: (x0[n] - y[n]) / (steps * lr) for n in ("fc1.weight", "fc1.bias")}
        assert_close(ctx.store[i]["c_i"], c_i, atol=1e-5)
        ys.append(y)
        c_is.append(c_i)
    c1 = mean_of((0.25, c) for c in c_is)  # c = 1/N sum c_i (N = 4, all took part)
    assert_close(ctx.server["c"], c1, atol=1e-5)
    mean_y = mean_of((0.25, y) for y in ys)
    x1 = {n: x0[n] + eta_g * (mean_y[n] - x0[n]) for n in x0}
    assert_close(ctx.server["global"], x1, atol=1e-6)

    x1 = dict(ctx.server["global"])
    engine.run_round(ctx, 2)  # round 2: every gradient corrected by c - c_i
    corrected, plain, flipped = [], [], []
    for i in range(4):
        correction = {n: c1[n] - c_is[i][n] for n in c1}
        corrected.append(sgd_reference(ctx, i, x1, adjust=lambda n, g, d=correction: g + d[n])[0])
        plain.append(sgd_reference(ctx, i, x1)[0])
        flipped.append(sgd_reference(ctx, i, x1, adjust=lambda n, g, d=correction: g - d[n])[0])

    def server(ys):
        mean = mean_of((0.25, y) for y in ys)
        return {n: x1[n] + eta_g * (mean[n] - x1[n]) for n in x1}

    expected = server(corrected)
    assert_close(ctx.server["global"], expected, atol=1e-5)
    keys = ["fc1.weight", "fc1.bias"]
    assert far_apart(expected, server(plain), keys) and far_apart(expected, server(flipped), keys)
    for i in range(4):  # each c_i moved again: option II on round 2's model change
        steps = 2 * (ctx.data.clients[i].num_train // 10)
        c_i2 = {n: c_is[i][n] - c1[n] + (x1[n] - corrected[i][n]) / (steps * lr) for n in c1}
        assert_close(ctx.store[i]["c_i"], c_i2, atol=1e-4)


def test_only_the_participants_control_variates_move():
    engine, ctx = prepared(**LINEAR, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    first = {i: {n: t.clone() for n, t in ctx.store[i].get("c_i", {}).items()} for i in range(4)}
    assert {i for i in range(4) if first[i]} == set(ctx.participants)
    engine.run_round(ctx, 2)
    for i in range(4):
        moved = bool(ctx.store[i].get("c_i")) and (not first[i] or far_apart(ctx.store[i]["c_i"], first[i],
                                                                               ["fc1.weight", "fc1.bias"]))
        assert moved == (i in ctx.participants or bool(first[i])), i
        if i not in ctx.participants and first[i]:
            assert_same(ctx.store[i]["c_i"], first[i])


class UploadSpy(Plugin):
    """The steps and the uploaded model of each participant (a wrapper: after the algorithm)."""

    name = "upload_spy"

    def __init__(self):
        super().__init__()
        self.seen = {}

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.seen[client.id] = (client.steps, {k: v.detach().clone() for k, v in upload["weights"].items()})
        return upload


def test_a_straggler_normalises_by_the_steps_it_took_not_the_configured_ones():
    raw = tiny_raw(**{**LINEAR, "experiment.rounds": 1, "training.local_epochs": 2,
                                "addons": [{"name": "stragglers", "params": {"fraction": 1.0}}]})
    resolved = resolve(raw)
    spy = UploadSpy()
    resolved.plugins.insert(0, spy)
    engine = Engine(resolved, progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    x0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)
    lr, full = ctx.spec.training.lr, [2 * (ctx.data.clients[i].num_train // 10) for i in range(4)]
    for i, (steps, y) in spy.seen.items():
        assert 0 < steps < full[i]
        assert_close(ctx.store[i]["c_i"], {n: (x0[n] - y[n]) / (steps * lr) for n in ("fc1.weight", "fc1.bias")},
                     atol=1e-5)


# -- what is evaluated -----------------------------------------------------------------------

def test_every_client_is_evaluated_on_the_global_model():
    engine, ctx = prepared(**LINEAR)
    engine.run_round(ctx, 1)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert list(models) == [""]
        assert_same({k: v for k, v in models[""].state_dict().items()}, ctx.server["global"])


# -- lost uploads ----------------------------------------------------------------------------

class EagerScaffold(Scaffold):
    """The bug the lost-upload rule prevents: c_i advances even when the upload is lost."""

    @hookimpl
    def client_upload(self, ctx, client):
        upload = super().client_upload(ctx, client)
        client.state["c_i"] = client.staged.pop("c_i")
        return upload


def dropout_run(algorithm=Scaffold, rounds=6, executor="sequential"):
    raw = tiny_raw(**{**LINEAR, "experiment.rounds": rounds, "experiment.participation": 0.75,
                                "executor.name": executor, "addons": [{"name": "dropout", "params": {"p": 0.4}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = algorithm(resolved.plugins[-1].params)
    engine = Engine(resolved, progress=False)
    result = engine.run()
    return engine.ctx, result


def mean_control_variate(ctx):
    c = ctx.server["c"]
    zero = {n: torch.zeros_like(t) for n, t in c.items()}
    return mean_of((1 / len(ctx.training_clients), ctx.store[i].get("c_i") or zero) for i in ctx.training_clients)


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_with_dropout_the_server_c_stays_the_mean_of_the_clients_c_i(executor):
    ctx, result = dropout_run(executor=executor)
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert_close(ctx.server["c"], mean_control_variate(ctx), atol=1e-5)
    assert any(t.abs().max() > 1e-2 for t in ctx.server["c"].values())  # c is not trivially 0


def test_the_drift_check_catches_a_control_variate_that_advances_on_a_lost_upload():
    ctx, _ = dropout_run(EagerScaffold)
    assert far_apart(ctx.server["c"], mean_control_variate(ctx), list(ctx.server["c"]), atol=1e-3)


# -- parameters and the spec -----------------------------------------------------------------

@pytest.mark.parametrize("server_lr", [0.0, -1.0, float("nan"), float("inf")])
def test_server_lr_must_be_a_finite_positive_number(server_lr):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "scaffold", "algorithm.params.server_lr": server_lr}))
    assert info.value.path == "algorithm.params.server_lr"


WHY = ("scaffold's option II control variates (Eq. 4) divide the model change by K * training.lr, the mean "
       "corrected gradient only ")


@pytest.mark.parametrize("key, value, rest", [
    ("training.optimizer", "adam", "for SGD steps; got 'adam', use \"sgd\""),
    ("training.momentum", 0.9, "without momentum; got 0.9, set it to 0"),
])
def test_option_two_needs_plain_sgd_and_says_which_key(key, value, rest):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "scaffold", key: value}))
    assert info.value.path == key and info.value.message == WHY + rest


def test_a_bad_parameter_is_one_line_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "scaffold", "algorithm.params.server_lr": 0}))
    assert line.startswith("pfl-run: error: algorithm.params.server_lr: must be > 0")


def test_defaults():
    assert ScaffoldParams().server_lr == 1.0 and ScaffoldParams().weighting == "uniform"
    assert resolve(tiny_raw(**{"algorithm.name": "scaffold"})).as_dict["algorithm"]["params"] == {
        "server_lr": 1.0, "weighting": "uniform"}


# -- the model average: Algorithm 1's 1/|S| or the clients' sample shares ----------------------

TWO_CLIENTS = {**LINEAR, "data.params.num_devices": 2, "partition.num_clients": 2}
UNIFORM, SAMPLES = {0: 0.5, 1: 0.5}, {0: 0.25, 1: 0.75}  # train splits of 20 and 60 samples


@pytest.mark.parametrize("weighting, weights, other", [("uniform", UNIFORM, SAMPLES), ("samples", SAMPLES, UNIFORM)])
def test_the_model_average_is_algorithm_1s_uniform_one_or_by_samples(weighting, weights, other):
    engine, ctx = prepared(**TWO_CLIENTS, **{"algorithm.params.weighting": weighting,
                                             "algorithm.params.server_lr": 1.0})
    shrink(ctx, {0: 20, 1: 60})
    assert ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1]) == weights
    x0 = dict(ctx.server["global"])
    engine.run_round(ctx, 1)  # c = c_i = 0: each y_i is plain SGD; x1 = sum_i w_i y_i (eta_g = 1)
    ys = [sgd_reference(ctx, i, x0)[0] for i in (0, 1)]
    expected = mean_of((weights[i], ys[i]) for i in (0, 1))
    assert_close(ctx.server["global"], expected, atol=1e-6)
    keys = ["fc1.weight", "fc1.bias"]
    assert far_apart(expected, mean_of((other[i], ys[i]) for i in (0, 1)), keys)
    c_is = [{n: (x0[n] - ys[i][n]) / (sgd_reference(ctx, i, x0)[1] * ctx.spec.training.lr) for n in keys}
            for i in (0, 1)]
    assert_close(ctx.server["c"], mean_of((0.5, c) for c in c_is), atol=1e-5)  # c: 1/N whatever the weighting


@pytest.mark.parametrize("weighting, weight, bias", [("uniform", [2.0, 1.0], [0.0]), ("samples", [2.5, 0.5], [-0.5])])
def test_the_server_step_by_hand_for_two_clients_of_20_and_60_samples(weighting, weight, bias):
    _, ctx = prepared(**TWO_CLIENTS, **{"algorithm.params.weighting": weighting})
    shrink(ctx, {0: 20, 1: 60})
    ctx.server["global"] = {**tensors([0.0, 0.0], [0.0]), "running": torch.tensor([0.0]), "count": torch.tensor(0)}
    ctx.server["c"] = tensors([0.0, 0.0], [0.0])
    weights = ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1])
    uploads = [(0, upload([1.0, 2.0], [1.0], [0.0, 0.0], [0.0])), (1, upload([3.0, 0.0], [-1.0], [0.0, 0.0], [0.0]))]
    ctx.hooks.server_aggregate(ctx=ctx, uploads=iter(uploads), weights=weights)
    # uniform: (y_0 + y_1) / 2 = (2, 1; 0); samples: (y_0 + 3 y_1) / 4 = (2.5, 0.5; -0.5)
    glob = ctx.server["global"]
    assert glob["weight"][0].tolist() == pytest.approx(weight) and glob["bias"].tolist() == pytest.approx(bias)


def test_a_bad_weighting_is_one_line_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "scaffold",
                                                       "algorithm.params.weighting": "size"}))
    assert line.startswith("pfl-run: error: algorithm.params.weighting: must be one of 'uniform', 'samples'")
