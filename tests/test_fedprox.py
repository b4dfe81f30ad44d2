"""FedProx (plugins/fedprox): the proximal term mu/2 ||w - w_t||^2 by hand (value, sign, size,
gradient), its anchor w_t = the global model received this round, and one engine round
recomputed from the paper's objective."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, far_apart, linear, mean_of, prepared, recorded_training, train_reference
from tiny import tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_plugins.fedprox import FedProx, FedProxParams

LINEAR = {"model.params.hidden": [], "experiment.rounds": 2, "algorithm.name": "fedprox"}


def term(mu, model, anchor):
    client = SimpleNamespace(scratch={"w_t": anchor})
    return FedProx(FedProxParams(mu=mu)).local_objective(ctx=None, client=client, model=model, x=None, y=None,
                                                          logits=None)


def test_proximal_term_by_hand():
    model = linear([1.0, 2.0], [0.5])
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]
    # w - w_t = (1, 3, -1): ||.||^2 = 1 + 9 + 1 = 11; mu/2 * 11 with mu = 0.5
    assert term(0.5, model, anchor).item() == pytest.approx(2.75, abs=1e-6)
    assert term(2.0, model, anchor).item() == pytest.approx(11.0, abs=1e-6)
    assert term(0.5, model, [p.detach().clone() for p in model.parameters()]).item() == 0.0


def test_proximal_gradient_is_mu_times_the_distance_to_the_anchor():
    model = linear([1.0, 2.0], [0.5])
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]
    term(0.5, model, anchor).backward()
    assert torch.allclose(model.weight.grad, torch.tensor([[0.5, 1.5]]))  # mu (w - w_t)
    assert torch.allclose(model.bias.grad, torch.tensor([-0.5]))
    assert all(a.grad is None for a in anchor)  # the anchor is a constant


def test_the_anchor_is_the_received_global_model_not_the_clients_previous_weights():
    plugin = FedProx(FedProxParams(mu=0.5))
    model = linear([9.0, 9.0], [9.0])  # whatever the working model held before (another client's)
    client = SimpleNamespace(model=model, scratch={})
    received = {"weight": torch.tensor([[1.0, -1.0]]), "bias": torch.tensor([0.25])}
    assert plugin.on_receive(ctx=None, client=client, message={"weights": received})
    assert [t.tolist() for t in client.scratch["w_t"]] == [[[1.0, -1.0]], [0.25]]
    assert model.weight.tolist() == [[1.0, -1.0]]  # ... and the model starts from it
    with torch.no_grad():  # a local step moves the model, never the anchor
        model.weight.add_(1.0)
    assert [t.tolist() for t in client.scratch["w_t"]] == [[[1.0, -1.0]], [0.25]]
    # (1, 1, 0) from the anchor: 0.5 / 2 * 2
    assert term(0.5, model, client.scratch["w_t"]).item() == pytest.approx(0.5)


def test_the_clients_objective_is_cross_entropy_plus_the_proximal_term():
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.mu": 0.5})
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=0))
    model = client.model
    with torch.no_grad():
        model.fc1.weight.add_(0.1)  # 0.1 away from the global model in each of 200 weights
    x, y = client.data.train_x[:10], client.data.train_y[:10]
    logits = model(x)
    expected = F.cross_entropy(logits, y) + 0.5 / 2 * 200 * 0.01
    assert client.objective(model, x, y, logits).item() == pytest.approx(expected.item(), rel=1e-5)


def prox_loss(anchor, mu):
    def loss(model, x, y, logits):
        distance = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        return F.cross_entropy(logits, y) + mu / 2 * distance
    return loss


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_round_is_fedavg_of_clients_minimising_the_proximal_objective(rounds):
    engine, ctx = prepared(**LINEAR, **{"algorithm.params.mu": 1.0, "training.local_epochs": 2})
    for r in range(1, rounds):
        engine.run_round(ctx, r)
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, rounds)
    trained = [train_reference(ctx, i, start, loss_fn=prox_loss(start, 1.0)) for i in range(4)]
    expected = mean_of((0.25, t) for t in trained)  # equal client sizes here
    assert_close(ctx.server["global"], expected)
    plain = mean_of((0.25, train_reference(ctx, i, start)) for i in range(4))
    assert far_apart(expected, plain, expected)  # the term matters at this mu
    pushed = [train_reference(ctx, i, start, loss_fn=prox_loss(start, -1.0)) for i in range(4)]
    assert far_apart(expected, mean_of((0.25, t) for t in pushed), expected)  # and so does its sign


def test_each_client_anchors_at_the_global_model_even_after_another_client_trained(monkeypatch):
    from pfl_core.runtime.context import Client

    engine, ctx = prepared(**LINEAR, **{"algorithm.params.mu": 1.0})
    engine.run_round(ctx, 1)
    glob = [v.clone() for v in ctx.server["global"].values()]  # fc1.weight, fc1.bias
    anchors, original = [], Client.train

    def spy(self, *args, **kwargs):
        anchors.append((self.id, [t.clone() for t in self.scratch["w_t"]]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Client, "train", spy)
    engine.run_round(ctx, 2)  # clients 1-3 find client 0's (then 1's, 2's) trained weights in the working model
    assert [i for i, _ in anchors] == [0, 1, 2, 3]
    for _, anchor in anchors:
        assert len(anchor) == 2 and all(torch.equal(a, g) for a, g in zip(anchor, glob))


@pytest.mark.parametrize("mu", [-0.1, float("nan")])
def test_mu_must_be_a_finite_non_negative_number(mu):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedprox", "algorithm.params.mu": mu}))
    assert info.value.path == "algorithm.params.mu"


def test_fedprox_needs_one_architecture_and_says_so_by_name():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedprox", "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and info.value.message.startswith("fedprox averages weights")


def test_default_mu_is_not_zero():
    assert FedProxParams().mu == 0.01
