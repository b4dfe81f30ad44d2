"""FedProto: prototypes by hand, Eq. 6 aggregation, nearest-prototype inference, no weights sent."""

import pytest
import torch
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_plugins.fedproto import NearestPrototype, aggregate_prototypes, local_prototypes


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


# -- the regulariser, the aggregation and the evaluated model, by hand ------------------------

import types  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from pfl_core.engine import Engine  # noqa: E402
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_plugins.fedproto import FedProto, capture_embedding  # noqa: E402


def test_regulariser_sign_and_size_by_hand():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        net[0].bias.copy_(torch.tensor([1.0, 0.0]))
    x = torch.tensor([[3.0, 0.0], [5.0, 5.0], [0.0, 4.0]])
    y = torch.tensor([0, 1, 2])  # class 1 has no global prototype: left out of the term
    client = types.SimpleNamespace(scratch={"global": {0: torch.tensor([1.0, 0.0]), 2: torch.tensor([0.0, 2.0])}})
    plugin = FedProto(FedProto.Params(lam=0.5))
    with capture_embedding(net, client.scratch):
        logits = net(x)
    term = plugin.local_objective(ctx=None, client=client, model=net, x=x, y=y, logits=logits)
    # embeddings (classifier inputs): (7, 0) and (1, 4); squared errors 36 + 0 and 1 + 4 over 4 entries
    assert term.item() == pytest.approx(0.5 * 41 / 4)
    term.backward()
    # d/d b1 = lam * 2 / 4 * ((6, 0) + (1, 2)) = (1.75, 0.5): a descent step pulls f(x) toward C-bar^(y)
    assert torch.allclose(net[0].bias.grad, torch.tensor([1.75, 0.5]))
    assert plugin.local_objective(ctx=None, client=types.SimpleNamespace(scratch={"global": {}}),
                                  model=net, x=x, y=y, logits=logits) is None  # round 1: CE only


def prepared(**overrides):
    engine = Engine(resolve(tiny_raw(**{"algorithm.name": "fedproto", **overrides})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def embedding(ctx, weights, x):
    """relu(fc1 x): the mlp [16]'s classifier input, by hand."""
    return F.relu(x @ weights["fc1.weight"].T + weights["fc1.bias"])


def test_prototypes_are_count_weighted_means_of_the_trained_embeddings():
    engine, ctx = prepared(**{"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.5}})
    engine.run_round(ctx, 1)
    sums, totals = {}, {}
    for i in range(4):
        data = ctx.data.clients[i]
        emb = embedding(ctx, ctx.store[i]["weights"], data.train_x)
        for c in data.train_y.unique().tolist():
            mask = data.train_y == c
            sums[c] = sums.get(c, 0) + emb[mask].sum(0)  # n_ic * (class mean) = the class's sum
            totals[c] = totals.get(c, 0) + int(mask.sum())
    assert set(ctx.server["prototypes"]) == set(sums)
    for c, proto in ctx.server["prototypes"].items():
        assert torch.allclose(proto, sums[c] / totals[c], atol=1e-5), c


def test_prototypes_of_classes_nobody_reported_are_kept():
    old = {0: torch.tensor([1.0]), 1: torch.tensor([2.0])}
    ctx = types.SimpleNamespace(server={"prototypes": dict(old)})
    FedProto().server_aggregate(ctx, iter([(3, {"prototypes": {1: torch.tensor([5.0])}, "counts": {1: 4}})]), {})
    assert ctx.server["prototypes"] == {0: old[0], 1: torch.tensor([5.0])}


def test_evaluated_model_is_the_nearest_global_prototype_on_the_own_embedding():
    engine, ctx = prepared(**{"experiment.participation": 0.5})
    for r in (1, 2):
        engine.run_round(ctx, r)
    protos = ctx.server["prototypes"]
    classes = sorted(protos)
    table = torch.stack([protos[c] for c in classes])
    for i in range(4):
        weights = ctx.store[i].get("weights") or ctx.models.initial_state("mlp")
        x = ctx.data.clients[i].test_x
        models = evaluated_models(ctx, ctx.client(i))
        with torch.no_grad():
            dist = ((embedding(ctx, weights, x)[:, None, :] - table[None]) ** 2).sum(-1)
            expected = torch.tensor(classes)[dist.argmin(1)]
            assert torch.equal(models[""](x).argmax(1), expected)
            own = embedding(ctx, weights, x) @ weights["fc2.weight"].T + weights["fc2.bias"]
            assert torch.allclose(models["local_"](x), own, atol=1e-5)  # beside it: the own classifier


def test_coldstart_trains_with_the_regulariser_and_is_scored_by_prototypes():
    engine, ctx = prepared(**{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 1,
                              "partition.scheme": "iid"})
    engine.run_round(ctx, 1)
    (n,) = ctx.coldstart_clients
    assert set(ctx.data.clients[n].train_y.tolist()) <= set(ctx.server["prototypes"])
    seen, original = [], ctx.hooks.local_objective

    def spy(**kw):
        terms = original(**kw)
        seen.append(len(terms))
        return terms
    ctx.hooks.local_objective = spy
    models = coldstart_models(ctx, ctx.client(n))
    assert seen and all(k == 2 for k in seen)  # CE and the prototype term on every batch
    assert set(models) == {"", "local_"} and models[""].prototypes is ctx.server["prototypes"]
    result, _ = run_tiny(**{"algorithm.name": "fedproto", "experiment.rounds": 2, "experiment.coldstart_clients": 1})
    assert not result.errors and "coldstart_acc_mean" in result.final


def test_the_default_lambda_is_the_papers_one_and_zero_is_allowed():
    from pfl_plugins.fedproto import FedProtoParams

    assert FedProtoParams().lam == 1.0  # the documented default weight of Eq. 5's prototype term
    assert resolve(tiny_raw(**{"algorithm.name": "fedproto", "algorithm.params.lam": 0.0})).spec.algorithm.name == "fedproto"
