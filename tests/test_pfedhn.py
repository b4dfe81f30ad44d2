"""pFedHN (plugins/pfedhn): the hypernetwork and its chain rule by hand; each client receives its
produced model and uploads the change plain local training made; the server's steps (one per
received upload, at the phi that produced theta_i; momentum, weight decay and clipping over
rounds) recomputed independently; what is evaluated; pFedHN-PC's classifier and BatchNorm
buffers stay on the client; lost uploads; process executor and resume bit-identical; bad input."""

import math
import os

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    dry_run_error,
    far_apart,
    model_bytes,
    prepared,
    record_messages,
    refused_at_key,
    train_reference,
)
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.pfedhn import EMBEDDINGS, HyperNetwork, PFedHNParams, hypergradient, produce

BASE = {"algorithm.name": "pfedhn", "model.params.hidden": [8], "experiment.rounds": 2}
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
PLAIN_SGD = {"momentum": 0.0, "weight_decay": 0.0, "max_grad_norm": None}


# -- h(v; phi) and its chain rule by hand ----------------------------------------------------------


def tiny_hypernetwork(hidden_layers=0):
    """Embeddings of 2 clients in R^2, an MLP of width 2, heads for a 2-vector "w" and a scalar "b"."""
    hn = HyperNetwork(num_clients=2, embed_dim=2, hidden_dim=2, hidden_layers=hidden_layers, shapes={"w": (2,), "b": ()})
    with torch.no_grad():
        hn.embeddings.weight.copy_(torch.tensor([[1.0, 2.0], [-1.0, 0.5]]))
        hn.mlp[0].weight.copy_(torch.tensor([[1.0, 0.0], [1.0, -1.0]]))
        hn.mlp[0].bias.copy_(torch.tensor([0.0, 0.5]))
        if hidden_layers:
            hn.mlp[2].weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 2.0]]))
            hn.mlp[2].bias.copy_(torch.tensor([0.0, 0.0]))
        hn.heads[0].weight.copy_(torch.tensor([[1.0, 2.0], [0.0, -1.0]]))
        hn.heads[0].bias.copy_(torch.tensor([0.5, 0.0]))
        hn.heads[1].weight.copy_(torch.tensor([[3.0, 1.0]]))
        hn.heads[1].bias.copy_(torch.tensor([-1.0]))
    return hn


def test_the_hypernetwork_by_hand():
    hn = tiny_hypernetwork()
    phi = dict(hn.state_dict())
    # client 0: v = (1, 2); f = (1, 1 - 2 + 0.5) = (1, -0.5); w = (1 - 1 + 0.5, 0.5) = (0.5, 0.5); b = 3 - 0.5 - 1
    theta = produce(hn, phi, phi[EMBEDDINGS][0])
    assert torch.allclose(theta["w"], torch.tensor([0.5, 0.5])) and theta["b"].shape == ()
    assert theta["b"].item() == pytest.approx(1.5)
    # a hidden layer: relu(f) = (1, 0), then (1, 0) -> w = (1 + 0.5, 0), b = 3 - 1
    deep = tiny_hypernetwork(hidden_layers=1)
    theta = produce(deep, dict(deep.state_dict()), deep.state_dict()[EMBEDDINGS][0])
    assert torch.allclose(theta["w"], torch.tensor([1.5, 0.0])) and theta["b"].item() == pytest.approx(2.0)


def test_the_hypergradient_is_the_chain_rule_with_minus_delta_theta_by_hand():
    hn = tiny_hypernetwork()
    phi = {k: t.clone() for k, t in hn.state_dict().items()}
    delta = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(0.5)}  # theta~ - theta
    g = hypergradient(hn, phi, 0, delta)
    # with u = -delta: dH_w = u f^T, dc = u; f = (1, -0.5), v = (1, 2)
    u_w, u_b, f, v = torch.tensor([-1.0, 2.0]), -0.5, torch.tensor([1.0, -0.5]), torch.tensor([1.0, 2.0])
    assert torch.allclose(g["heads.0.weight"], torch.outer(u_w, f))
    assert torch.allclose(g["heads.0.bias"], u_w)
    assert torch.allclose(g["heads.1.weight"], u_b * f[None]) and g["heads.1.bias"].item() == pytest.approx(u_b)
    # back through the heads: dL/df = H_w^T u_w + H_b^T u_b = (-1, -4) + (-1.5, -0.5) = (-2.5, -4.5)
    df = torch.tensor([-2.5, -4.5])
    assert torch.allclose(g["mlp.0.bias"], df) and torch.allclose(g["mlp.0.weight"], torch.outer(df, v))
    # the embedding: W1^T df = (-2.5 - 4.5, 4.5) in client 0's row only
    assert torch.allclose(g[EMBEDDINGS], torch.tensor([[-7.0, 4.5], [0.0, 0.0]]))
    assert all(torch.equal(phi[k], t) for k, t in hn.state_dict().items())  # phi itself untouched


# -- a round: broadcast, local training, upload --------------------------------------------------------


def hypernetwork_like(ctx, phi, personal_classifier=False):
    """A fresh module holding ``phi``, structured as the run's (its own module, called directly)."""
    model = ctx.models.working("mlp")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()
              if not (personal_classifier and k.startswith("fc2."))}
    table = phi[EMBEDDINGS]
    width = phi["mlp.0.weight"].shape[0]
    layers = sum(1 for k in phi if k.startswith("mlp.") and k.endswith(".weight")) - 1
    hn = HyperNetwork(table.shape[0], table.shape[1], width, layers, shapes)
    hn.load_state_dict(phi)
    return hn


def test_each_client_receives_its_produced_model_and_uploads_what_local_training_changed():
    engine, ctx = prepared(**BASE)
    phi0 = {k: t.clone() for k, t in ctx.server["hn"].items()}
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    hn = hypernetwork_like(ctx, phi0)
    for i in range(4):
        with torch.no_grad():
            expected = hn(phi0[EMBEDDINGS][i])
        assert set(broadcasts[i]["weights"]) == set(PARAMS)
        assert_close(broadcasts[i]["weights"], expected, atol=0)
        trained = train_reference(ctx, i, expected)  # plain SGD from theta_i, the client's batch order
        assert_close(uploads[i]["delta"], {k: trained[k] - expected[k] for k in PARAMS}, atol=1e-6)
        assert far_apart(uploads[i]["delta"], {k: torch.zeros_like(t) for k, t in expected.items()}, PARAMS)
    assert far_apart(broadcasts[0]["weights"], broadcasts[1]["weights"], PARAMS)  # one model per client
    assert ctx.comm_down == ctx.comm_up == 4 * model_bytes(ctx.models.initial_state("mlp"), PARAMS)


# -- the server's steps, recomputed ------------------------------------------------------------------


def reference_steps(ctx, phi_t, deltas, params, state, personal_classifier=False):
    """The server's round from phi_t, written out: for each (client, Delta theta) in order, the
    gradient of <h(v_i; phi_t), -Delta theta_i> (backward through a fresh module), clipped, then
    SGD with momentum and weight decay by its formulas on the running phi. ``state`` holds the
    momentum buffers between rounds."""
    phi = {k: t.clone().double() for k, t in phi_t.items()}
    for client_id, delta in deltas:
        hn = hypernetwork_like(ctx, phi_t, personal_classifier)
        theta = hn(hn.embeddings.weight[client_id])
        sum(-(theta[k] * delta[k]).sum() for k in delta).backward()
        grads = {k: p.grad.double() for k, p in hn.named_parameters()}
        if params.max_grad_norm is not None:
            norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
            grads = {k: g * min(1.0, params.max_grad_norm / (norm + 1e-6)) for k, g in grads.items()}
        for k, g in grads.items():
            d = g + params.weight_decay * phi[k]
            state[k] = d if k not in state else params.momentum * state[k] + d
            lr = params.embed_lr if (k == EMBEDDINGS and params.embed_lr is not None) else params.alpha
            phi[k] = phi[k] - lr * state[k]
    return {k: t.float() for k, t in phi.items()}


def test_the_server_steps_once_per_upload_at_the_phi_that_produced_theta():
    params = PFedHNParams(alpha=0.5, **PLAIN_SGD)
    engine, ctx = prepared(**BASE, **{"algorithm.params": {"alpha": 0.5, **PLAIN_SGD}})
    phi0 = {k: t.clone() for k, t in ctx.server["hn"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    expected = reference_steps(ctx, phi0, [(i, uploads[i]["delta"]) for i in range(4)], params, {})
    assert_close(ctx.server["hn"], expected, atol=1e-5)
    # plain SGD: phi_1 = phi_0 - alpha * sum_i g_i(phi_0), so the step is the sum over the clients
    assert far_apart(ctx.server["hn"], phi0, list(phi0))
    # each produced model moved towards what its client trained: <theta_i(phi_1) - theta_i(phi_0), Delta theta_i> > 0
    before, after = hypernetwork_like(ctx, phi0), hypernetwork_like(ctx, ctx.server["hn"])
    with torch.no_grad():
        for i in range(4):
            moved = after(ctx.server["hn"][EMBEDDINGS][i])
            start = before(phi0[EMBEDDINGS][i])
            assert sum(float(((moved[k] - start[k]) * uploads[i]["delta"][k]).sum()) for k in PARAMS) > 0


def test_momentum_weight_decay_and_the_embedding_rate_over_rounds_one_client_each():
    """Alg. 1 exactly: one client per round. Past round 2, where a buffer that only kept the last
    gradient (or was reset each round) would still agree."""
    chosen = {"alpha": 0.05, "embed_lr": 0.2, "momentum": 0.9, "weight_decay": 0.01, "max_grad_norm": None}
    params = PFedHNParams(**chosen)
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 4, "experiment.participation": 0.25,
                              "algorithm.params": chosen})
    uploads = record_messages(ctx, "client_upload")
    expected, state = {k: t.clone() for k, t in ctx.server["hn"].items()}, {}
    clients = []
    for r in range(1, 5):
        uploads.clear()
        engine.run_round(ctx, r)
        (client_id, upload), = uploads.items()
        clients.append(client_id)
        expected = reference_steps(ctx, expected, [(client_id, upload["delta"])], params, state)
        assert_close(ctx.server["hn"], expected, atol=1e-5)
    assert len(set(clients)) > 1  # different clients took the steps


def test_the_hypernetwork_gradient_is_clipped_to_max_grad_norm():
    c, alpha = 1e-3, 0.1
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.25,
                                      "algorithm.params": {**PLAIN_SGD, "alpha": alpha, "max_grad_norm": c}})
    phi0 = {k: t.clone() for k, t in ctx.server["hn"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    (client_id, upload), = uploads.items()
    raw = hypergradient(hypernetwork_like(ctx, phi0), phi0, client_id, upload["delta"])
    assert math.sqrt(sum(float((g**2).sum()) for g in raw.values())) > 100 * c  # the clip matters here
    step = math.sqrt(sum(float(((ctx.server["hn"][k] - phi0[k]).double() ** 2).sum()) for k in phi0))
    assert step == pytest.approx(alpha * c, rel=1e-3)


# -- what is evaluated -----------------------------------------------------------------------------------


def test_each_client_is_evaluated_with_its_produced_model_of_the_current_phi():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    hn = hypernetwork_like(ctx, ctx.server["hn"])
    for i in range(4):  # participants and idle clients alike: no local steps before scoring
        model = evaluated_models(ctx, ctx.client(i))[""]
        with torch.no_grad():
            expected = hn(ctx.server["hn"][EMBEDDINGS][i])
        assert_close(model.state_dict(), expected, PARAMS, atol=1e-6)


# -- pFedHN-PC and buffers: what the client keeps ---------------------------------------------------------


def test_pfedhn_pc_produces_the_body_and_each_client_keeps_and_trains_its_classifier():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5, "algorithm.params.personal_classifier": True})
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    initial = ctx.models.initial_state("mlp")
    engine.run_round(ctx, 1)
    body, head = PARAMS[:2], PARAMS[2:]
    assert {k for k in ctx.server["hn"] if k.startswith("heads.") and k.endswith("weight")} == {
        "heads.0.weight", "heads.1.weight"}
    for i in ctx.participants:
        assert set(broadcasts[i]["weights"]) == set(body) and set(uploads[i]["delta"]) == set(body)
        trained = train_reference(ctx, i, {**broadcasts[i]["weights"], **{k: initial[k] for k in head}})
        assert_close(ctx.store[i]["kept"], trained, head, atol=1e-6)  # trained jointly with the body
        assert_close(uploads[i]["delta"], {k: trained[k] - broadcasts[i]["weights"][k] for k in body}, atol=1e-6)
        assert far_apart(ctx.store[i]["kept"], initial, head)
    hn = hypernetwork_like(ctx, ctx.server["hn"], personal_classifier=True)
    for i in range(4):  # scored: produced body + own classifier (the initial one if it never trained)
        model = evaluated_models(ctx, ctx.client(i))[""]
        with torch.no_grad():
            produced = hn(ctx.server["hn"][EMBEDDINGS][i])
        assert_close(model.state_dict(), produced, body, atol=1e-6)
        own = ctx.store[i]["kept"] if i in ctx.participants else initial
        assert_close(model.state_dict(), own, head, atol=0)


def test_batchnorm_statistics_are_not_produced_and_stay_with_each_client():
    engine, ctx = prepared(**{**BASE, "model.params": {"hidden": [8], "norm": "batch"}})
    broadcasts = record_messages(ctx, "on_broadcast")
    engine.run_round(ctx, 1)
    buffers = [k for k, _ in ctx.models.working("mlp").named_buffers()]
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        assert not set(buffers) & set(broadcasts[i]["weights"])
        start = {**initial, **broadcasts[i]["weights"]}
        trained = train_reference(ctx, i, start)
        assert_close(ctx.store[i]["kept"], trained, buffers, atol=1e-6)
        assert far_apart(ctx.store[i]["kept"], initial, [b for b in buffers if "running" in b])
    assert far_apart(ctx.store[0]["kept"], ctx.store[1]["kept"], ["bn1.running_mean"])


# -- lost uploads, cold start ---------------------------------------------------------------------------


def test_a_lost_upload_takes_no_step_and_the_client_keeps_its_classifier():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 1, i, p)]
    assert 0 < len(lost) < 4  # seed 0 drops some and keeps some in round 1
    chosen = {"alpha": 0.3, "personal_classifier": True, **PLAIN_SGD}
    engine, ctx = prepared(**BASE, **{"algorithm.params": chosen, "addons": [{"name": "dropout", "params": {"p": p}}]})
    phi0 = {k: t.clone() for k, t in ctx.server["hn"].items()}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    arrived = [(i, uploads[i]["delta"]) for i in range(4) if i not in lost]
    expected = reference_steps(ctx, phi0, arrived, PFedHNParams(**chosen), {}, personal_classifier=True)
    assert_close(ctx.server["hn"], expected, atol=1e-5)
    for i in lost:  # its own classifier keeps the round's training
        assert far_apart(ctx.store[i]["kept"], ctx.models.initial_state("mlp"), PARAMS[2:])


def test_a_cold_start_client_receives_the_model_of_the_mean_training_embedding():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    table = ctx.server["hn"][EMBEDDINGS]
    with torch.no_grad():
        expected = hypernetwork_like(ctx, ctx.server["hn"])(table[ctx.training_clients].mean(0))
    assert_close(message["weights"], expected, atol=1e-6)
    result, _ = run_tiny(**{**BASE, "experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


def test_the_embedding_table_has_the_authors_default_size():
    _, ctx = prepared(**{**BASE, "partition.num_clients": 4})
    assert ctx.server["hn"][EMBEDDINGS].shape == (4, 2)  # int(1 + 4 / 4)
    assert ctx.resolved_values["embed_dim"] == 2
    assert ctx.server["hn"]["heads.0.weight"].shape == (160, 100)  # fc1.weight's 8 x 20, from width 100
    assert sum(1 for k in ctx.server["hn"] if k.startswith("mlp.") and k.endswith("weight")) == 4  # 1 + 3 hidden


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5},
                                       {"algorithm.params.personal_classifier": True,
                                        "model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial", "pc-batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("pfedhn", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "pfedhn", "experiment.participation": 0.5,
                 "algorithm.params": {"personal_classifier": True}}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["hn_momentum"]  # the momentum buffers are part of what resumes


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha", 0.0), ("alpha", float("nan")), ("embed_lr", -1.0),
                                       ("momentum", 1.0), ("weight_decay", -0.1), ("max_grad_norm", 0.0),
                                       ("embed_dim", 0), ("hidden_dim", 0), ("hidden_layers", -1),
                                       ("personal_classifier", "yes"), ("alpha", "0.1")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_pfedhn_pc_needs_a_layer_before_the_classifier(tmp_path, capsys):
    raw = tiny_raw(**{**BASE, "model.params.hidden": [], "algorithm.params.personal_classifier": True})
    line = dry_run_error(tmp_path, capsys, raw)
    assert "algorithm.params.personal_classifier" in line and "1 parameterised layer" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "produces the weights of one architecture" in info.value.message


def test_a_hypernetwork_larger_than_memory_is_refused_at_hidden_dim_before_it_is_allocated():
    engine = Engine(resolve(tiny_raw(**{**BASE, "algorithm.params.hidden_dim": 10**12})), progress=False)
    with pytest.raises(SpecError) as info:
        engine.run()
    assert info.value.path == "algorithm.params.hidden_dim" and "GiB" in str(info.value)


def test_defaults_are_the_authors():
    p = PFedHNParams()
    assert (p.alpha, p.embed_lr, p.momentum, p.weight_decay, p.max_grad_norm) == (0.01, None, 0.9, 1e-3, 50.0)
    assert (p.embed_dim, p.hidden_dim, p.hidden_layers, p.personal_classifier) == (None, 100, 3, False)
