"""MOON (plugins/moon): the contrastive loss of Eq. 3 by hand on tiny vectors, the local objective
CE + mu * l_con (Eq. 4) with z_prev from the client's previous local model (not the global one),
one engine round recomputed from the paper's objective, mu = 0 is FedAvg, and the parameters."""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, dry_run_error, far_apart, mean_of, prepared, train_reference
from tiny import run_tiny, tiny_raw

from pfl_core.api import capture_embedding
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_plugins.moon import GLOBAL, PREVIOUS, MOONParams, contrastive_loss

MOON = {"algorithm.name": "moon"}


def test_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 1.0], [0.0, 1.0]])   # cosines 1/sqrt(2) and 1
    z_prev = torch.tensor([[0.0, 1.0], [0.0, -3.0]])  # cosines 0 and -1
    # -log(e^{s_g/tau} / (e^{s_g/tau} + e^{s_p/tau})) = log(1 + e^{(s_p - s_g)/tau}), tau = 0.5
    rows = [math.log(1 + math.exp((0 - 1 / math.sqrt(2)) / 0.5)), math.log(1 + math.exp((-1 - 1) / 0.5))]
    assert contrastive_loss(z, z_glob, z_prev, 0.5).item() == pytest.approx(sum(rows) / 2, abs=1e-6)
    # the positive is the global model's representation: swapping the two is another value
    swapped = [math.log(1 + math.exp((1 / math.sqrt(2) - 0) / 0.5)), math.log(1 + math.exp((1 + 1) / 0.5))]
    assert contrastive_loss(z, z_prev, z_glob, 0.5).item() == pytest.approx(sum(swapped) / 2, abs=1e-6)
    # tau divides both similarities
    at_two = [math.log(1 + math.exp(-1 / math.sqrt(2) / 2)), math.log(1 + math.exp(-2 / 2))]
    assert contrastive_loss(z, z_glob, z_prev, 2.0).item() == pytest.approx(sum(at_two) / 2, abs=1e-6)


def test_contrastive_loss_is_log_two_when_both_models_agree_and_pulls_towards_the_global_one():
    z = torch.tensor([[1.0, 0.0]], requires_grad=True)
    same = torch.tensor([[0.3, 0.7]])
    assert contrastive_loss(z, same, same, 0.5).item() == pytest.approx(math.log(2))
    loss = contrastive_loss(z, torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, -1.0]]), 0.5)
    loss.backward()
    assert z.grad[0, 1] < 0  # a gradient step moves z towards z_glob = (0, 1), away from z_prev


def representation(state, x):
    """z of the tiny mlp ([16]) by hand: the classifier's input relu(W1 x + b1)."""
    return F.relu(x.flatten(1) @ state["fc1.weight"].T + state["fc1.bias"])


def moon_loss(global_state, previous_state, mu, tau):
    """Eq. 4 for a model ``m`` being trained: CE + mu * l_con, every z computed by hand."""
    def loss(m, x, y, logits):
        z = F.relu(x.flatten(1) @ m.fc1.weight.T + m.fc1.bias)
        z_glob, z_prev = representation(global_state, x), representation(previous_state, x)
        return F.cross_entropy(logits, y) + mu * contrastive_loss(z, z_glob, z_prev, tau)
    return loss


def test_the_objective_uses_the_previous_local_model_not_the_global_one():
    engine, ctx = prepared(**MOON, **{"algorithm.params": {"mu": 2.0, "tau": 0.5}})
    engine.run_round(ctx, 1)
    previous = {k: v.clone() for k, v in ctx.store[1]["previous"].items()}
    glob = ctx.server["global"]
    assert far_apart(previous, glob, ["fc1.weight"])  # the client's own trained model, not the average
    ctx.round = 2
    client = ctx.client(1)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=1))
    assert_close(ctx.models.working("mlp", slot=PREVIOUS).state_dict(), previous, atol=0)
    assert_close(ctx.models.working("mlp", slot=GLOBAL).state_dict(), glob, atol=0)
    model = client.model
    with torch.no_grad():
        model.fc1.weight.add_(0.05)  # so that z differs from z_glob
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    with capture_embedding(model, client.scratch):  # as local_train captures z
        logits = model(x)
        got = client.objective(model, x, y, logits).item()
    z = F.relu(x @ model.fc1.weight.T + model.fc1.bias)
    expected = F.cross_entropy(logits, y) + 2.0 * contrastive_loss(z, representation(glob, x),
                                                                   representation(previous, x), 0.5)
    assert got == pytest.approx(expected.item(), rel=1e-5)
    wrong = F.cross_entropy(logits, y) + 2.0 * contrastive_loss(z, representation(glob, x), representation(glob, x), 0.5)
    assert abs(wrong.item() - got) > 1e-3  # a z_prev taken from the global model would show


def test_the_first_round_contrasts_with_the_initial_model_so_l_con_is_log_two():
    _, ctx = prepared(**MOON, **{"algorithm.params": {"mu": 3.0}})
    ctx.round = 1
    client = ctx.client(0)
    assert "previous" not in client.state
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
    initial = ctx.models.initial_state("mlp")
    assert_close(ctx.models.working("mlp", slot=PREVIOUS).state_dict(), initial, atol=0)
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    with capture_embedding(client.model, client.scratch):
        logits = client.model(x)
        got = client.objective(client.model, x, y, logits).item()
    assert got == pytest.approx(F.cross_entropy(logits, y).item() + 3.0 * math.log(2), rel=1e-5)


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_round_is_fedavg_of_clients_minimising_eq_4(rounds):
    mu, tau = 1.5, 0.5
    engine, ctx = prepared(**MOON, **{"algorithm.params": {"mu": mu, "tau": tau}, "experiment.rounds": 2})
    for r in range(1, rounds):
        engine.run_round(ctx, r)
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    previous = {i: ctx.store[i].get("previous", ctx.models.initial_state("mlp")) for i in range(4)}
    previous = {i: {k: v.clone() for k, v in p.items()} for i, p in previous.items()}
    engine.run_round(ctx, rounds)
    trained = [train_reference(ctx, i, start, loss_fn=moon_loss(start, previous[i], mu, tau)) for i in range(4)]
    assert_close(ctx.server["global"], mean_of((0.25, t) for t in trained), atol=1e-5)  # equal client sizes
    for i in range(4):  # each client keeps its trained model as the next round's w_i^{t-1}
        assert_close(ctx.store[i]["previous"], trained[i], atol=1e-5)
    if rounds == 2:  # the contrastive term acts once there is a previous model
        plain = mean_of((0.25, train_reference(ctx, i, start)) for i in range(4))
        assert far_apart(ctx.server["global"], plain, ["fc1.weight"], atol=1e-5)


def test_mu_zero_is_fedavg_bit_for_bit():
    plain, fedavg = run_tiny(**{"experiment.rounds": 2})
    same, moon = run_tiny(**MOON, **{"experiment.rounds": 2, "algorithm.params.mu": 0.0})
    for key, value in fedavg.ctx.server["global"].items():
        assert torch.equal(moon.ctx.server["global"][key], value), key
    assert same.final["acc_mean"] == plain.final["acc_mean"]


def test_clients_are_evaluated_on_the_global_model_and_coldstart_trains_on_eq_4_from_it():
    engine, ctx = prepared(**MOON, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 1,
                                      "experiment.rounds": 1})
    engine.run_round(ctx, 1)
    i = ctx.training_clients[0]
    glob = {k: v.clone() for k, v in ctx.server["global"].items()}
    state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
    assert all(torch.equal(state[k], v) for k, v in glob.items())
    (n,) = ctx.coldstart_clients
    cold = {k: v.clone() for k, v in coldstart_models(ctx, ctx.client(n))[""].state_dict().items()}
    initial = ctx.models.initial_state("mlp")  # the newcomer's w^{-1}
    assert_close(cold, train_reference(ctx, n, glob, epochs=1, loss_fn=moon_loss(glob, initial, 1.0, 0.5)), atol=1e-5)
    assert far_apart(cold, train_reference(ctx, n, glob, epochs=1), ["fc1.weight"], atol=1e-5)  # not plain CE


def test_the_term_is_only_for_the_clients_own_model_after_it_received_the_global_one():
    engine, ctx = prepared(**MOON)
    engine.run_round(ctx, 1)
    ctx.round = 2
    client = ctx.client(0)
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    other = ctx.models.build("mlp")
    for received in (False, True):
        if received:
            ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
        with capture_embedding(client.model, client.scratch):
            client.model(x)
            logits = other(x)  # another model trained beside the client's own: no contrastive term
            assert client.objective(other, x, y, logits).item() == pytest.approx(F.cross_entropy(logits, y).item())
    with capture_embedding(client.model, client.scratch):
        logits = client.model(x)
        assert client.objective(client.model, x, y, logits).item() > F.cross_entropy(logits, y).item() + 0.1


def test_a_model_without_a_representation_is_refused_naming_the_model():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**MOON, **{"model.params.hidden": []}))
    assert info.value.path == "model.name"
    assert info.value.message == ("moon contrasts the representation the classifier reads, and mlp has a single "
                                  "layer (its representation is the input itself); use a model with a hidden layer")


def test_defaults_and_bad_parameters(tmp_path, capsys):
    assert (MOONParams().mu, MOONParams().tau) == (1.0, 0.5)
    line = dry_run_error(tmp_path, capsys, tiny_raw(**MOON, **{"algorithm.params.tau": 0.0}))
    assert line == "pfl-run: error: algorithm.params.tau: must be > 0, got 0.0"
    line = dry_run_error(tmp_path, capsys, tiny_raw(**MOON, **{"algorithm.params.mu": -1.0}))
    assert line == "pfl-run: error: algorithm.params.mu: must be >= 0, got -1.0"
