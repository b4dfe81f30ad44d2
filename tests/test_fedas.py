"""FedAS (plugins/fedas): the Fisher trace, the alignment loss and the Fisher-weighted aggregate
by hand, no alignment with sample weights = FedPer bit for bit, a round recomputed (alignment to
the previous model's prototypes, local training, Fisher weights), what is evaluated, bytes,
budget, bad input."""

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
    model_bytes,
    prepared,
    refused_at_key,
)
from tiny import tiny_raw
from torch import nn

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedas import FedAS, FedASParams, alignment_loss, fisher_trace

BASE = {"algorithm.name": "fedas", "model.params.hidden": [8], "experiment.rounds": 2}
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- (A3): the Fisher trace, by hand ------------------------------------------------------------------


def zero_linear():
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return model


def test_fisher_trace_by_hand():
    # logits 0, p = (1/2, 1/2). Sample 1: x = (1, 2), y = 0: dNLL/dlogits = (-1/2, 1/2),
    # grad W = [[-1/2, -1], [1/2, 1]] (squares 2.5), grad b = (-1/2, 1/2) (0.5): 3.
    # Sample 2: x = (0, 1), y = 1: g = (1/2, -1/2), grad W = [[0, 1/2], [0, -1/2]] (0.5), b 0.5: 1.
    x, y = torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([0, 1])
    assert fisher_trace(zero_linear(), x, y, batch_size=1) == pytest.approx(4.0)  # summed over batches
    # one batch of both: the mean gradient, W [[-1/4, -1/4], [1/4, 1/4]], b 0: 0.25
    assert fisher_trace(zero_linear(), x, y, batch_size=2) == pytest.approx(0.25)
    assert fisher_trace(zero_linear(), x, y, batch_size=1, names={"bias"}) == pytest.approx(1.0)
    assert fisher_trace(zero_linear(), x[:1], y[:1], batch_size=5) == pytest.approx(3.0)


def test_fisher_trace_runs_in_eval_mode_and_leaves_no_gradients():
    model = nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.9), nn.Linear(3, 2))
    x, y = torch.randn(6, 2), torch.randint(0, 2, (6,))
    assert fisher_trace(model, x, y, 3) == fisher_trace(model, x, y, 3)  # dropout off
    assert model.training and all(p.grad is None for p in model.parameters())


# -- (A2): the alignment loss, by hand -------------------------------------------------------------------


def test_alignment_loss_by_hand():
    prototypes = {0: torch.tensor([0.0, 0.0]), 1: torch.tensor([1.0, 1.0])}
    store = {"emb": torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 1.0], [5.0, 5.0]])}
    y = torch.tensor([0, 0, 1, 2])  # class 2 has no prototype
    # class 0: (1 + 4 + 9 + 16) / 4 = 7.5; class 1: 0
    assert alignment_loss(prototypes, store)(None, None, y, None).item() == pytest.approx(7.5)
    store = {"emb": torch.tensor([[2.0, 1.0], [1.0, 1.0]])}
    # class 0: (4 + 1) / 2 = 2.5; class 1: 0 -> summed over classes, not averaged: 2.5
    assert alignment_loss(prototypes, store)(None, None, torch.tensor([0, 1]), None).item() == pytest.approx(2.5)
    emb = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss = alignment_loss({}, {"emb": emb})(None, None, torch.tensor([3]), None)
    loss.backward()  # no prototype in the batch: a zero that still backpropagates
    assert loss.item() == 0.0 and torch.equal(emb.grad, torch.zeros(1, 2))


# -- (A4): the Fisher-weighted aggregate, by hand ------------------------------------------------------


def aggregate(uploads, weighting="fisher"):
    logged = {}
    ctx = SimpleNamespace(server={"body": {"w": torch.tensor([9.0, 9.0])}},
                          log_client=lambda i, **values: logged.update({(i, k): v for k, v in values.items()}))
    FedAS(FedASParams(weighting=weighting)).server_aggregate(ctx=ctx, uploads=iter(uploads),
                                                             weights={0: 0.5, 1: 0.5})
    return ctx.server["body"]["w"], logged


def test_fisher_weighted_aggregate_by_hand():
    uploads = [(0, {"body": {"w": torch.tensor([1.0, 2.0])}, "fisher": 1.0}),
               (1, {"body": {"w": torch.tensor([3.0, 6.0])}, "fisher": 3.0})]
    body, logged = aggregate(uploads)
    assert torch.allclose(body, torch.tensor([2.5, 5.0]))  # (1 (1, 2) + 3 (3, 6)) / 4
    assert logged == {(0, "fedas_weight"): 0.25, (1, "fedas_weight"): 0.75}
    body, _ = aggregate([(0, {"body": {"w": torch.tensor([1.0, 2.0])}}),
                         (1, {"body": {"w": torch.tensor([3.0, 6.0])}})], "samples")
    assert torch.allclose(body, torch.tensor([2.0, 4.0]))  # the core's weights, 1/2 each
    body, _ = aggregate([(0, {"body": {"w": torch.tensor([1.0, 2.0])}, "fisher": 0.0})])
    assert torch.equal(body, torch.tensor([9.0, 9.0]))  # no information: unchanged


# -- no alignment, sample weights: FedPer, bit for bit --------------------------------------------------


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return ctx


AS_FEDPER = {"algorithm.params.align_epochs": 0, "algorithm.params.weighting": "samples"}


@pytest.mark.parametrize("extra", [{}, {"experiment.participation": 0.5, "training.momentum": 0.5}])
def test_without_alignment_and_fisher_it_is_fedper_bit_for_bit(extra):
    fedas = run_rounds(3, **{**BASE, **extra, **AS_FEDPER})
    fedper = run_rounds(3, **{**BASE, **extra, "algorithm.name": "fedper"})
    assert_same(fedas.server["body"], fedper.server["body"])
    for i in range(4):
        assert ("weights" in fedas.store[i]) == ("head" in fedper.store[i])
        if "head" in fedper.store[i]:
            assert_same(fedas.store[i]["weights"], fedper.store[i]["head"], HEAD)
    assert fedas.comm_up == fedper.comm_up and fedas.comm_down == fedper.comm_down
    # each part changes the result on its own: the test can tell them apart
    for changed in ({"algorithm.params.weighting": "samples"}, {"algorithm.params.align_epochs": 0}):
        other = run_rounds(3, **{**BASE, **extra, **changed})
        assert far_apart(other.server["body"], fedper.server["body"], BODY)


# -- a round recomputed independently -------------------------------------------------------------------


def features(x, state):
    return F.relu(F.linear(x, state["fc1.weight"], state["fc1.bias"]))


def prototypes_of(x, y, state):
    z = features(x, state)
    return {c: z[y == c].mean(0) for c in y.unique().tolist()}


def train_part(ctx, i, state, keys, lr, loss_fn, epochs=1):
    model = fresh_model(ctx, state)
    for name, p in model.named_parameters():
        p.requires_grad_(name in keys)
    ctx.client(i).train(model=model, epochs=epochs, optimizer=torch.optim.SGD(
        [p for n, p in model.named_parameters() if n in keys], lr=lr), loss_fn=loss_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def align_to(protos):
    def loss(model, x, y, logits):
        z = features(x, dict(model.named_parameters()))
        return sum(((z[y == c] - protos[c]) ** 2).mean() for c in y.unique().tolist())
    return loss


def ce(model, x, y, logits):
    return F.cross_entropy(logits, y)


def reference_fisher(ctx, state, x, y, batch, keys):
    model = fresh_model(ctx, state)
    total = 0.0
    for s in range(0, len(y), batch):
        model.zero_grad()
        F.cross_entropy(model(x[s:s + batch]), y[s:s + batch]).backward()
        total += sum(float((p.grad ** 2).sum()) for n, p in model.named_parameters() if n in keys)
    return total


@pytest.mark.parametrize("fisher", ["all", "body"])
def test_a_round_recomputed_independently(fisher):
    engine, ctx = prepared(**{**BASE, "algorithm.params.fisher": fisher, "algorithm.params.align_lr": 0.05})
    init = {k: v.clone() for k, v in ctx.models.initial_state("mlp").items()}
    keys = BODY + HEAD if fisher == "all" else BODY
    bodies, traces = {}, {}
    for r in (1, 2):
        previous = {i: dict(ctx.store[i].get("weights") or init) for i in range(4)}
        glob = {k: v.clone() for k, v in ctx.server["body"].items()}
        engine.run_round(ctx, r)
        for i in range(4):
            data = ctx.data.clients[i]
            protos = prototypes_of(data.train_x, data.train_y, previous[i])  # (A1): the previous model
            start = {**previous[i], **glob}  # theta^t with the client's own head
            aligned = train_part(ctx, i, start, BODY, 0.05, align_to(protos))  # (A2)
            assert far_apart(aligned, start, BODY)
            expected = train_part(ctx, i, aligned, BODY + HEAD, ctx.spec.training.lr, ce)
            assert_close(ctx.store[i]["weights"], expected, atol=1e-5)
            bodies[i] = expected
            traces[i] = reference_fisher(ctx, expected, data.train_x, data.train_y, ctx.spec.training.batch_size, keys)
        norm = sum(traces.values())
        for k in BODY:  # (A4)
            assert torch.allclose(ctx.server["body"][k], sum(traces[i] / norm * bodies[i][k] for i in range(4)),
                                  atol=1e-5)
        logged = {row["client"]: row["value"] for row in ctx.client_series
                  if row["round"] == ctx.round and row["name"] == "fedas_weight"}
        assert logged == {i: pytest.approx(traces[i] / norm, rel=1e-4) for i in range(4)}


# -- evaluation, bytes, budget ----------------------------------------------------------------------


def test_evaluated_model_is_the_clients_local_model():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    for i in ctx.participants:
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(state, ctx.store[i]["weights"])
        assert far_apart(state, ctx.server["body"], BODY)  # its own theta_i, not the new global one
    idle = next(i for i in range(4) if i not in ctx.participants)
    state = evaluated_models(ctx, ctx.client(idle))[""].state_dict()
    assert_same(state, ctx.models.initial_state("mlp"))


def test_bytes_are_the_body_and_one_number():
    ctx = run_rounds(2, **BASE, **{"experiment.participation": 0.5})
    body = model_bytes(ctx.server["body"])
    assert ctx.comm_down == 2 * 2 * body
    assert ctx.comm_up == 2 * 2 * (body + 8)


def test_local_work_is_local_plus_alignment_epochs_and_measured():
    spec = resolve(tiny_raw(**BASE, **{"training.local_epochs": 2})).spec
    assert FedAS(FedASParams()).local_work(spec).private_epochs_per_round == 3
    assert FedAS(FedASParams(align_epochs=0)).local_work(spec).private_epochs_per_round == 2
    result = Engine(resolve(tiny_raw(**{**BASE, "algorithm.params.align_epochs": 2})), progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(2 * (1 + 2))


def test_defaults_are_the_documented_ones():
    p = FedASParams()
    assert (p.align_epochs, p.align_lr, p.fisher, p.weighting, p.head_layers) == (1, 0.01, "all", "fisher", 1)


def test_a_full_run_with_coldstart_clients():
    result = Engine(resolve(tiny_raw(**BASE, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("align_epochs", -1), ("align_lr", 0.0), ("align_lr", float("nan")),
                                       ("fisher", "head"), ("weighting", "uniform")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.align_lr": -0.1}))
    assert "algorithm.params.align_lr" in line and "> 0" in line
