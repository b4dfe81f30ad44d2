"""FedCP (plugins/fedcp): the policy (s and 1 - s split every feature), the conditional vector and
the MMD by hand; the personal head kept on the client (only a mix of it goes up); a round
recomputed independently; the server's averages; bytes; what is evaluated; bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, dry_run_error, far_apart, model_bytes, prepared, refused_at_key
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_core.seeding import torch_generator
from pfl_plugins.fedcp import (
    BANDWIDTHS,
    ConditionalPolicyNetwork,
    FedCPParams,
    PolicySplit,
    conditional_vector,
    mmd_rbf,
    policy,
)

BASE = {"algorithm.name": "fedcp", "model.params.hidden": [8], "experiment.rounds": 2}
K = 8  # the mlp [8]'s classifier input
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- (C1), (C2), (C3), (C4) by hand ---------------------------------------------------------------------


def test_conditional_vector_by_hand():
    head = torch.tensor([[1.0, 2.0], [3.0, -2.0]])  # classes x K: column sums (4, 0)
    assert torch.allclose(conditional_vector(head), torch.tensor([[1.0, 0.0]]))
    assert torch.allclose(conditional_vector(torch.tensor([[1.0, 1.0]])), torch.tensor([[2 ** -0.5, 2 ** -0.5]]))


def test_policy_by_hand():
    scores = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # one sample, K = 2: (personal, global) scores
    s = policy(scores, tau=2.0)
    assert torch.allclose(s, torch.tensor([[1 / (1 + math.exp(-0.5)), 0.5]]))  # sigmoid((a_p - a_g) / tau)
    noisy = policy(scores, 1.0, torch.Generator().manual_seed(3))
    gumbel = -torch.empty(1, 2, 2).exponential_(generator=torch.Generator().manual_seed(3)).log()
    assert torch.allclose(noisy, torch.softmax(scores + gumbel, dim=1)[:, 0])
    assert not torch.allclose(noisy, policy(scores, 1.0))


def tiny_net():
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        net[0].bias.zero_()
    return net


def test_the_policy_splits_every_feature_into_s_and_1_minus_s():
    torch.manual_seed(0)
    net, cpn = tiny_net(), ConditionalPolicyNetwork(3)
    global_head = (torch.randn(2, 3), torch.randn(2))
    context = conditional_vector(net[1].weight)
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    store = {}
    with PolicySplit(net, cpn, global_head, context, 1.0, store=store):
        out = net(x)
        h, s = store["emb"], store["policy"]
    assert torch.allclose(h, x @ net[0].weight.T)  # h: the classifier's input
    assert ((s > 0) & (s < 1)).all() and s.shape == (2, 3)
    assert not torch.allclose(s[0], s[1])  # sample-specific
    assert torch.allclose(h * s + h * (1 - s), h)  # the two parts add up to the feature
    expected = net[1](h * s) + F.linear(h * (1 - s), *global_head)  # (C3)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(s, policy(cpn(h * context), 1.0))  # (C2) on h * v_i
    assert "emb" not in store and torch.allclose(net(x), net[1](h))  # the hooks are gone


def test_mmd_by_hand():
    x, y = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    expected = 2 * len(BANDWIDTHS) - 2 * sum(math.exp(-0.5 / a) for a in BANDWIDTHS)
    assert mmd_rbf(x, y).item() == pytest.approx(expected)
    z = torch.randn(5, 3)
    assert mmd_rbf(z, z).item() == pytest.approx(0.0, abs=1e-6)


# -- the personal head stays local; the server's averages ------------------------------------------------


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: {n: t.clone() for n, t in v.items()} for k, v in message.items()}
        return message

    ctx.hooks.client_upload = spy
    return uploads


def test_the_personal_head_stays_local_and_only_a_mix_goes_up():
    engine, ctx = prepared(**BASE)
    w_g = {k: v.clone() for k, v in ctx.server["global_head"].items()}
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(n.values())
    for i in range(4):
        assert set(uploads[i]) == {"body", "cpn", "head"} and set(uploads[i]["body"]) == set(BODY)
        own = ctx.store[i]["head"]
        for k in HEAD:  # (C5): head_mix W^hp + (1 - head_mix) W^hg, W^hg as received
            assert torch.allclose(uploads[i]["head"][k], 0.5 * own[k] + 0.5 * w_g[k], atol=1e-7)
        assert far_apart(uploads[i]["head"], own, HEAD)
    for part, server in (("body", ctx.server["body"]), ("cpn", ctx.server["cpn"]), ("head", ctx.server["global_head"])):
        for k, v in server.items():
            assert torch.allclose(v, sum(n[i] / total * uploads[i][part][k] for i in range(4)), atol=1e-6), (part, k)


def test_head_mix_zero_keeps_the_global_head_and_one_sends_the_personal_head():
    engine, ctx = prepared(**BASE, **{"algorithm.params.head_mix": 0.0})
    initial = {k: v.clone() for k, v in ctx.server["global_head"].items()}
    engine.run_round(ctx, 1)
    assert_close(ctx.server["global_head"], initial, atol=1e-7)
    engine, ctx = prepared(**BASE, **{"algorithm.params.head_mix": 1.0})
    engine.run_round(ctx, 1)
    n = {i: ctx.data.clients[i].num_train for i in range(4)}
    for k in HEAD:
        expected = sum(n[i] * ctx.store[i]["head"][k] for i in range(4)) / sum(n.values())
        assert torch.allclose(ctx.server["global_head"][k], expected, atol=1e-6)


def test_bytes():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    body, cpn, head = model_bytes(ctx.server["body"]), model_bytes(ctx.server["cpn"]), model_bytes(ctx.server["global_head"])
    assert cpn == 4 * (K * 2 * K + 2 * K + 2 * 2 * K)  # Linear(K, 2K) and LayerNorm(2K)
    assert ctx.comm_up == 2 * 4 * (body + cpn + head)
    assert ctx.comm_down == 2 * 4 * (body + cpn + head)


# -- a round recomputed independently ----------------------------------------------------------------


def features(x, w):
    return F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))


def fedcp_training(ctx, i, init, cpn0, w_g, lam, tau, lr):
    """Client i's first round written out: (C1)-(C4) from W^fe^0, the initial W^hp and theta^0."""
    w = {k: init[k].clone().requires_grad_(True) for k in BODY + HEAD}
    cpn = ConditionalPolicyNetwork(K)
    cpn.load_state_dict(cpn0)
    v = F.normalize(init["fc2.weight"].sum(0, keepdim=True), dim=1)  # (C1)
    noise = torch_generator(ctx.spec.experiment.seed, "fedcp_policy", 1, i)

    def loss_fn(_model, x, y, _logits):
        h = features(x, w)
        scores = cpn(h * v)
        s = torch.softmax((scores - torch.empty_like(scores).exponential_(generator=noise).log()) / tau, 1)[:, 0]
        out = F.linear(h * s, w["fc2.weight"], w["fc2.bias"]) + F.linear(h * (1 - s), w_g["fc2.weight"],
                                                                          w_g["fc2.bias"])
        return F.cross_entropy(out, y) + lam * mmd_rbf(h, features(x, init))  # (C4)

    opt = torch.optim.SGD([*w.values(), *cpn.parameters()], lr=lr)
    ctx.client(i).train(model=nn.Identity(), optimizer=opt, loss_fn=loss_fn)
    return w, cpn.state_dict()


def test_a_round_recomputed_independently():
    lam, tau, lr = 2.0, 0.5, 0.05
    engine, ctx = prepared(**BASE, **{"algorithm.params": {"lam": lam, "tau": tau}, "training.lr": lr})
    init = ctx.models.initial_state("mlp")
    cpn0, w_g = dict(ctx.server["cpn"]), dict(ctx.server["global_head"])
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    for i in range(4):
        w, cpn = fedcp_training(ctx, i, init, cpn0, w_g, lam, tau, lr)
        assert_close(uploads[i]["body"], w, BODY, atol=1e-6)
        assert_close(ctx.store[i]["head"], w, HEAD, atol=1e-6)
        assert_close(uploads[i]["cpn"], cpn, atol=1e-6)
        assert far_apart(w, init, BODY + HEAD) and far_apart(cpn, cpn0, ["fc.weight"])


# -- evaluation and cold start ------------------------------------------------------------------------


def test_evaluated_model_uses_the_global_parts_the_own_head_and_no_noise():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    trained = ctx.participants[0]
    idle = next(i for i in range(4) if i not in ctx.participants)
    x = ctx.data.clients[trained].test_x
    for i, head in ((trained, ctx.store[trained]["head"]), (idle, ctx.models.initial_state("mlp"))):
        model = evaluated_models(ctx, ctx.client(i))[""]
        cpn = ConditionalPolicyNetwork(K)
        cpn.load_state_dict(ctx.server["cpn"])
        with torch.no_grad():
            h = features(x, ctx.server["body"])
            s = torch.softmax(cpn(h * F.normalize(head["fc2.weight"].sum(0, keepdim=True), dim=1)), 1)[:, 0]
            g = ctx.server["global_head"]
            expected = F.linear(h * s, head["fc2.weight"], head["fc2.bias"]) + F.linear(h * (1 - s), g["fc2.weight"],
                                                                                        g["fc2.bias"])
            assert torch.allclose(model(x), expected, atol=1e-5)
            assert torch.equal(model(x), model(x))  # deterministic


def test_a_full_run_with_coldstart_clients():
    result, _ = run_tiny(**BASE, **{"experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", -1.0), ("tau", 0.0), ("tau", float("inf")), ("head_mix", 1.5),
                                       ("head_mix", -0.1), ("head_layers", 2)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.tau": -1.0}))
    assert "algorithm.params.tau" in line and "> 0" in line


def test_a_model_without_a_feature_extractor_is_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.params.hidden": []}))
    assert info.value.path == "model.name" and "fedcp needs a feature extractor" in str(info.value)


def test_defaults_are_the_documented_ones():
    p = FedCPParams()
    assert (p.lam, p.tau, p.head_mix, p.head_layers) == (5.0, 1.0, 0.5, 1)
