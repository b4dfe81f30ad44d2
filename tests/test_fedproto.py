"""FedProto: prototypes by hand, Eq. 6 aggregation, nearest-prototype inference, no weights sent."""

import pytest
import torch
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from plugins.fedproto import NearestPrototype, aggregate_prototypes, local_prototypes
from tiny import run_tiny, tiny_raw


def identity_net():
    net = nn.Sequential(nn.Identity(), nn.Linear(2, 3))  # embedding = the input itself
    return net


def test_local_prototypes_are_class_means_of_the_embedding():
    x = torch.tensor([[0.0, 0.0], [2.0, 2.0], [1.0, 5.0]])
    y = torch.tensor([0, 0, 2])
    protos, counts = local_prototypes(identity_net(), x, y, 3)
    assert counts == {0: 2, 2: 1}
    assert torch.equal(protos[0], torch.tensor([1.0, 1.0])) and torch.equal(protos[2], torch.tensor([1.0, 5.0]))


def test_global_prototypes_weight_clients_by_class_counts():
    a = ({0: torch.tensor([0.0, 0.0])}, {0: 3})
    b = ({0: torch.tensor([4.0, 8.0]), 1: torch.tensor([1.0, 1.0])}, {0: 1, 1: 5})
    out = aggregate_prototypes([a, b])
    assert torch.allclose(out[0], torch.tensor([1.0, 2.0])) and torch.equal(out[1], torch.tensor([1.0, 1.0]))


def test_nearest_prototype_inference():
    model = NearestPrototype(identity_net(), {0: torch.tensor([0.0, 0.0]), 2: torch.tensor([5.0, 5.0])}, 3)
    logits = model(torch.tensor([[1.0, 0.0], [4.0, 4.0]]))
    assert logits.argmax(1).tolist() == [0, 2]
    assert logits[0, 0].item() == pytest.approx(-1.0) and logits[0, 1].item() == -1e9


def test_fedproto_sends_prototypes_not_weights_and_regularises():
    result, engine = run_tiny(**{"algorithm.name": "fedproto", "experiment.rounds": 2})
    ctx = engine.ctx
    labels = set(torch.cat([ctx.data.clients[i].train_y for i in range(4)]).tolist())
    assert set(ctx.server["prototypes"]) == labels  # every class some client holds
    emb_dim = 16  # mlp hidden [16]: the classifier's input
    assert all(p.shape == (emb_dim,) for p in ctx.server["prototypes"].values())
    model_bytes = sum(v.numel() * v.element_size() for v in ctx.store[0]["weights"].values())
    assert result.final["comm_up_bytes"] < model_bytes
    _, no_reg = run_tiny(**{"algorithm.name": "fedproto", "experiment.rounds": 2, "algorithm.params.lam": 0.0})
    w, w0 = ctx.store[0]["weights"]["fc1.weight"], no_reg.ctx.store[0]["weights"]["fc1.weight"]
    assert not torch.equal(w, w0)  # round 2 has global prototypes: the regulariser acts


def test_bad_lambda_names_the_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedproto", "algorithm.params.lam": -1.0}))
    assert info.value.path == "algorithm.params.lam"
