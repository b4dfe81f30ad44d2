"""GPFL (plugins/gpfl): the conditional inputs, the valve and both guidance losses by hand; the
personalized head kept on the client; a round recomputed independently; the server's averages;
bytes; what is evaluated; bad input."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, dry_run_error, far_apart, model_bytes, prepared, refused_at_key
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.gpfl import (
    GPFL,
    ConditionalValve,
    GlobalModules,
    GPFLParams,
    Valve,
    angle_level_loss,
    conditional_inputs,
    magnitude_level_loss,
)

BASE = {"algorithm.name": "gpfl", "model.params.hidden": [8], "experiment.rounds": 2}
K = 8  # the mlp [8]'s classifier input
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- Eq. 5-11 by hand --------------------------------------------------------------------------------


def test_conditional_inputs_by_hand():
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    g, p = conditional_inputs(table, torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(g, torch.tensor([4 / 3, 5 / 3])) and torch.allclose(p, torch.tensor([0.5, 1.0]))


def test_angle_level_loss_by_hand():
    f_g = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    table = torch.tensor([[2.0, 0.0], [0.0, 5.0]])  # only directions count
    # sample 0: cosines (1, 0), label 0: log(1 + e^-1); sample 1: cosines (1/sqrt2, 1/sqrt2), label 1: log 2
    expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 2
    assert angle_level_loss(f_g, table, torch.tensor([0, 1])).item() == pytest.approx(expected)


def test_magnitude_level_loss_by_hand():
    f_g = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    table = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    # rows f - e_y: (1, 0) and (-3, -4): the batch's Frobenius norm sqrt(1 + 9 + 16), not squared, not averaged
    assert magnitude_level_loss(f_g, table, torch.tensor([0, 1])).item() == pytest.approx(math.sqrt(26))


def test_the_valve_by_hand():
    cov = ConditionalValve(2)
    with torch.no_grad():
        for net, shift in ((cov.gamma, 0.5), (cov.beta, -1.0)):
            net[0].weight.zero_()
            net[0].bias.zero_()
            net[2].bias.fill_(shift)  # LayerNorm of a constant is 0: gamma(c) = 0.5, beta(c) = -1 for every c
    f = torch.tensor([[2.0, 1.0]])
    assert torch.allclose(cov(f, torch.tensor([7.0, -3.0])), torch.tensor([[2.0, 0.5]]))  # relu(f * 1.5 - 1)


def test_local_objective_adds_the_guidance_and_the_regularisation():
    torch.manual_seed(0)
    modules = GlobalModules(2, 3)
    f = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    y = torch.tensor([2, 0])
    frozen = torch.randn(3, 2)
    generic = torch.tensor([0.3, -0.2])
    model = nn.Linear(2, 3)
    client = SimpleNamespace(model=model, scratch={"emb": f, "modules": modules, "generic": generic,
                                                   "frozen_table": frozen})
    term = GPFL(GPFLParams(lam=0.5, mu=0.2)).local_objective(ctx=None, client=client, model=model, x=None, y=y,
                                                             logits=None)
    f_g = modules.cov(f, generic)
    l2 = sum(p.pow(2).sum() for p in modules.parameters())
    expected = angle_level_loss(f_g, modules.gce.weight, y) + 0.5 * magnitude_level_loss(f_g, frozen, y) + 0.1 * l2
    assert term.item() == pytest.approx(expected.item(), rel=1e-6)
    none = GPFL(GPFLParams(lam=0.0, mu=0.0)).local_objective(ctx=None, client=client, model=model, x=None, y=y,
                                                             logits=None)
    assert none.item() == pytest.approx(angle_level_loss(f_g, modules.gce.weight, y).item(), rel=1e-6)


def test_the_classifier_reads_the_personalized_feature():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    cov = ConditionalValve(2)
    p = torch.tensor([0.1, 0.9])
    x = torch.tensor([[1.0, -1.0]])
    store = {}
    with Valve(net, cov, p, store), torch.no_grad():
        out = net(x)
        f = store["emb"]
    with torch.no_grad():
        assert torch.allclose(f, net[0](x)) and torch.allclose(out, net[1](cov(f, p)))
        assert torch.allclose(net(x), net[1](net[0](x)))  # the hook is gone


# -- the head stays local; the server's averages; bytes -------------------------------------------------


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: {n: t.clone() for n, t in v.items()} for k, v in message.items()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def test_the_head_stays_local_and_the_rest_is_averaged():
    engine, ctx = prepared(**BASE)
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(n.values())
    for i in range(4):
        assert set(uploads[i]) == {"body", "modules"} and set(uploads[i]["body"]) == set(BODY)
        assert set(ctx.store[i]["head"]) == set(HEAD)
    for part, server in (("body", ctx.server["body"]), ("modules", ctx.server["modules"])):
        for k, v in server.items():
            assert torch.allclose(v, sum(n[i] / total * uploads[i][part][k] for i in range(4)), atol=1e-6), (part, k)


def test_bytes():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    body, modules = model_bytes(ctx.server["body"]), model_bytes(ctx.server["modules"])
    assert modules == 4 * (2 * (K * K + K + 2 * K) + ctx.num_classes * K)  # two Linear+LayerNorm, the C x K table
    assert ctx.comm_up == ctx.comm_down == 2 * 4 * (body + modules)


# -- a round recomputed independently --------------------------------------------------------------------


def features(x, w):
    return F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))


def gpfl_training(ctx, i, init, modules0, lam, mu, lr):
    """Client i's first round written out: Eq. 5-11 from phi^0, the initial head, CoV^0 and E^0."""
    table0 = modules0["gce.weight"]
    w = {k: init[k].clone().requires_grad_(True) for k in BODY + HEAD}
    modules = GlobalModules(K, ctx.num_classes)
    modules.load_state_dict(modules0)
    counts = torch.bincount(ctx.data.clients[i].train_y, minlength=ctx.num_classes).float()
    g, p = table0.mean(0), (counts / counts.sum()) @ table0  # Eq. 5-7 from the received table

    def loss_fn(_model, x, y, _logits):
        f = features(x, w)
        logits = F.linear(modules.cov(f, p), w["fc2.weight"], w["fc2.bias"])
        f_g = modules.cov(f, g)
        cos = F.normalize(f_g, dim=1) @ F.normalize(modules.gce.weight, dim=1).T
        l2 = sum(t.pow(2).sum() for t in modules.parameters())
        return (F.cross_entropy(logits, y) + F.cross_entropy(cos, y) + lam * (f_g - table0[y]).pow(2).sum().sqrt()
                + mu / 2 * l2)

    opt = torch.optim.SGD([*w.values(), *modules.parameters()], lr=lr)
    ctx.client(i).train(model=nn.Identity(), optimizer=opt, loss_fn=loss_fn)
    return w, modules.state_dict()


def test_a_round_recomputed_independently():
    lam, mu, lr = 0.3, 0.2, 0.05
    engine, ctx = prepared(**BASE, **{"algorithm.params": {"lam": lam, "mu": mu}, "training.lr": lr})
    init = ctx.models.initial_state("mlp")
    modules0 = {k: v.clone() for k, v in ctx.server["modules"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    for i in range(4):
        w, modules = gpfl_training(ctx, i, init, modules0, lam, mu, lr)
        assert_close(uploads[i]["body"], w, BODY, atol=1e-6)
        assert_close(ctx.store[i]["head"], w, HEAD, atol=1e-6)
        assert_close(uploads[i]["modules"], modules, atol=1e-6)
        assert far_apart(w, init, BODY + HEAD) and far_apart(modules, modules0, ["gce.weight"])


# -- evaluation and cold start ------------------------------------------------------------------------


def test_evaluated_model_is_the_global_parts_with_the_own_head_and_conditional_input():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    trained = ctx.participants[0]
    idle = next(i for i in range(4) if i not in ctx.participants)
    modules = GlobalModules(K, ctx.num_classes)
    modules.load_state_dict(ctx.server["modules"])
    for i, head in ((trained, ctx.store[trained]["head"]), (idle, ctx.models.initial_state("mlp"))):
        x = ctx.data.clients[i].test_x
        counts = torch.bincount(ctx.data.clients[i].train_y, minlength=ctx.num_classes).float()
        p = (counts / counts.sum()) @ modules.gce.weight
        with torch.no_grad():
            expected = F.linear(modules.cov(features(x, ctx.server["body"]), p), head["fc2.weight"], head["fc2.bias"])
            assert torch.allclose(evaluated_models(ctx, ctx.client(i))[""](x), expected, atol=1e-5)


def test_a_full_run_with_coldstart_clients():
    result, _ = run_tiny(**BASE, **{"experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -1.0), ("lam", float("nan")), ("mu", -0.5), ("mu", "0.1"),
                                       ("head_layers", 2)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.mu": -1.0}))
    assert "algorithm.params.mu" in line and ">= 0" in line


def test_a_model_without_a_feature_extractor_is_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.params.hidden": []}))
    assert info.value.path == "model.name" and "gpfl needs a feature extractor" in str(info.value)


def test_defaults_are_the_documented_ones():
    p = GPFLParams()
    assert (p.lam, p.mu, p.head_layers) == (0.01, 0.1, 1)
