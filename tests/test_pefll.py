"""PeFLL (plugins/pefll): the descriptor's standardisation and the hypernetwork's chain rule by
hand; each client's descriptor, produced model and upload (Delta theta, v, phi's gradient)
recomputed with plain tensor operations; the server's Adam step over the mean of the received
gradients written out over three rounds with lost uploads; what is evaluated, for participants,
idle and cold-start clients; process executor and resume bit-identical; bad input."""

import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, far_apart, prepared, record_messages, refused_at_key, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.api import HyperNetwork, torch_generator
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.pefll import PeFLLParams, hypernetwork_gradient, standardise

SMALL = {"embed_dim": 3, "embed_hidden": 6, "hidden_dim": 5, "hidden_layers": 1}
BASE = {"algorithm.name": "pefll", "model.params.hidden": [8], "experiment.rounds": 2,
        **{f"algorithm.params.{k}": v for k, v in SMALL.items()}}
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


# -- by hand ----------------------------------------------------------------------------------------


def test_the_descriptor_is_standardised_with_the_sample_std():
    # v = (1, 3, 8): mean 4, sample std sqrt((9 + 1 + 16) / 2) = sqrt(13); a population std differs
    assert torch.allclose(standardise(torch.tensor([1.0, 3.0, 8.0])), torch.tensor([-3.0, -1.0, 4.0]) / 13**0.5)


def test_the_hypernetwork_gradient_is_the_chain_rule_with_minus_delta_theta_by_hand():
    hn = HyperNetwork(num_clients=0, embed_dim=2, hidden_dim=2, hidden_layers=0, shapes={"w": (2,), "b": ()})
    assert not any(k.startswith("embeddings") for k in hn.state_dict())  # v comes from the data, no table
    with torch.no_grad():
        hn.mlp[0].weight.copy_(torch.tensor([[1.0, 0.0], [1.0, -1.0]]))
        hn.mlp[0].bias.copy_(torch.tensor([0.0, 0.5]))
        hn.heads[0].weight.copy_(torch.tensor([[1.0, 2.0], [0.0, -1.0]]))
        hn.heads[0].bias.copy_(torch.tensor([0.5, 0.0]))
        hn.heads[1].weight.copy_(torch.tensor([[3.0, 1.0]]))
        hn.heads[1].bias.copy_(torch.tensor([-1.0]))
    eta = {k: t.clone() for k, t in hn.state_dict().items()}
    v, delta = torch.tensor([1.0, 2.0]), {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(0.5)}
    g = hypernetwork_gradient(hn, eta, v, delta)
    # f = W1 v + c1 = (1, -0.5); u = -delta: dH_w = u f^T, dc_w = u; back: df = H_w^T u_w + H_b^T u_b
    u_w, u_b, f = torch.tensor([-1.0, 2.0]), -0.5, torch.tensor([1.0, -0.5])
    assert torch.allclose(g["heads.0.weight"], torch.outer(u_w, f)) and torch.allclose(g["heads.0.bias"], u_w)
    assert torch.allclose(g["heads.1.weight"], u_b * f[None]) and g["heads.1.bias"].item() == pytest.approx(u_b)
    df = torch.tensor([-2.5, -4.5])
    assert torch.allclose(g["mlp.0.bias"], df) and torch.allclose(g["mlp.0.weight"], torch.outer(df, v))
    assert all(torch.equal(eta[k], t) for k, t in hn.state_dict().items())  # eta itself untouched


# -- a round, recomputed with plain tensor operations ----------------------------------------------------


def embed_by_hand(phi, x, y, num_classes):
    z = torch.cat([x.flatten(1).float(), F.one_hot(y.long(), num_classes).float()], dim=1)
    h = torch.relu(z @ phi["mlp.0.weight"].T + phi["mlp.0.bias"])
    h = torch.relu(h @ phi["mlp.2.weight"].T + phi["mlp.2.bias"])
    e = (h @ phi["mlp.4.weight"].T + phi["mlp.4.bias"]).mean(0)
    return (e - e.mean()) / e.std()


def produce_by_hand(eta, v, shapes):
    f = v @ eta["mlp.0.weight"].T + eta["mlp.0.bias"]
    layer = 2
    while f"mlp.{layer}.weight" in eta:
        f = torch.relu(f) @ eta[f"mlp.{layer}.weight"].T + eta[f"mlp.{layer}.bias"]
        layer += 2
    return {name: (f @ eta[f"heads.{j}.weight"].T + eta[f"heads.{j}.bias"]).view(shape)
            for j, (name, shape) in enumerate(shapes.items())}


def sample_of(ctx, client_id, round, batches=1):
    data = ctx.data.clients[client_id]
    order = torch.randperm(len(data.train_y), generator=torch_generator(ctx.spec.experiment.seed, "pefll:descriptor",
                                                                        round, client_id))
    order = order[:batches * ctx.spec.training.batch_size]
    return data.train_x[order], data.train_y[order]


def by_hand(ctx, phi, eta, client_id, round, grad=False):
    """(v_i, theta_i, phi's leaves) for a client, from plain operations on (phi, eta)."""
    shapes = {k: tuple(p.shape) for k, p in ctx.models.working("mlp").named_parameters()}
    leaves = {k: t.detach().clone().requires_grad_(grad) for k, t in phi.items()}
    with torch.set_grad_enabled(grad):
        v = embed_by_hand(leaves, *sample_of(ctx, client_id, round), ctx.num_classes)
        theta = produce_by_hand(eta, v, shapes)
    return v, theta, leaves


def test_each_client_trains_its_produced_model_and_uploads_delta_descriptor_and_phis_gradient():
    engine, ctx = prepared(**BASE)
    phi0, eta0 = ({k: t.clone() for k, t in ctx.server[n].items()} for n in ("phi", "eta"))
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 1)
    for i in range(4):
        assert_close(broadcasts[i]["embedding_net"], phi0, atol=0)
        assert_close(broadcasts[i]["hypernetwork"], eta0, atol=0)
        v, theta, leaves = by_hand(ctx, phi0, eta0, i, 1, grad=True)
        trained = train_reference(ctx, i, {k: t.detach() for k, t in theta.items()})  # plain SGD from theta_i
        delta = {k: trained[k] - theta[k].detach() for k in PARAMS}
        assert_close(uploads[i]["delta"], delta, atol=1e-5)
        assert far_apart(uploads[i]["delta"], {k: torch.zeros_like(t) for k, t in delta.items()}, PARAMS)
        assert torch.allclose(uploads[i]["descriptor"], v.detach(), atol=1e-6)
        # phi's gradient: d<theta_i(phi), -Delta theta_i>/d phi, through v_i
        sum(-(theta[k] * delta[k]).sum() for k in PARAMS).backward()
        assert_close(uploads[i]["embedding_grad"], {k: p.grad for k, p in leaves.items()}, atol=1e-5)
        assert uploads[i]["embedding_grad"]["mlp.4.weight"].abs().max() > 1e-4  # it reaches phi
    assert not torch.allclose(uploads[0]["descriptor"], uploads[1]["descriptor"])  # one descriptor per client


def adam_by_hand(params, grad, state, lr, betas=(0.9, 0.999), eps=1e-8):
    """One Adam step written out (bias-corrected moments), in double; ``state`` carries them."""
    state["t"] = state.get("t", 0) + 1
    out = {}
    for k, p in params.items():
        g = grad[k].double()
        m = betas[0] * state.get(("m", k), 0) + (1 - betas[0]) * g
        s = betas[1] * state.get(("s", k), 0) + (1 - betas[1]) * g * g
        state[("m", k)], state[("s", k)] = m, s
        m_hat, s_hat = m / (1 - betas[0] ** state["t"]), s / (1 - betas[1] ** state["t"])
        out[k] = (p.double() - lr * m_hat / (s_hat.sqrt() + eps)).float()
    return out


def test_adam_steps_on_the_mean_gradient_of_the_received_uploads_over_three_rounds():
    """Past round 2 (Adam's moments accumulate); lost uploads add nothing to the mean."""
    p, lr, rounds = 0.5, 0.01, 3
    lost = {r: [i for i in range(4) if upload_is_lost(0, r, i, p)] for r in range(1, rounds + 1)}
    assert any(0 < len(v) < 4 for v in lost.values())
    engine, ctx = prepared(**{**BASE, "experiment.rounds": rounds, "algorithm.params.lr": lr,
                              "addons": [{"name": "dropout", "params": {"p": p}}]})
    uploads = record_messages(ctx, "client_upload")
    params = {**{("phi", k): t.clone() for k, t in ctx.server["phi"].items()},
              **{("eta", k): t.clone() for k, t in ctx.server["eta"].items()}}
    state: dict = {}
    for r in range(1, rounds + 1):
        uploads.clear()
        engine.run_round(ctx, r)
        arrived = [i for i in range(4) if i not in lost[r]]
        if arrived:
            eta = {k: t for (n, k), t in params.items() if n == "eta"}
            grads = {}
            for i in arrived:
                shapes = {k: tuple(t.shape) for k, t in uploads[i]["delta"].items()}
                leaves = {k: t.clone().requires_grad_(True) for k, t in eta.items()}
                theta = produce_by_hand(leaves, uploads[i]["descriptor"], shapes)
                sum(-(theta[k] * uploads[i]["delta"][k]).sum() for k in shapes).backward()
                for key, g in [*((("eta", k), t.grad) for k, t in leaves.items()),
                               *((("phi", k), g) for k, g in uploads[i]["embedding_grad"].items())]:
                    grads[key] = grads.get(key, 0) + g.double() / len(arrived)
            params = adam_by_hand(params, grads, state, lr)
        assert_close(ctx.server["phi"], {k: t for (n, k), t in params.items() if n == "phi"}, atol=1e-6)
        assert_close(ctx.server["eta"], {k: t for (n, k), t in params.items() if n == "eta"}, atol=1e-6)
    assert state["t"] == sum(1 for r in lost if len(lost[r]) < 4)


# -- what is evaluated -------------------------------------------------------------------------------------


def test_each_client_is_evaluated_with_the_model_its_descriptor_produces_now():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    for i in range(4):  # participants and idle clients alike: no local steps before scoring
        model = evaluated_models(ctx, ctx.client(i))[""]
        _, expected, _ = by_hand(ctx, ctx.server["phi"], ctx.server["eta"], i, ctx.round)
        assert_close(model.state_dict(), expected, PARAMS, atol=1e-5)


def test_a_cold_start_client_gets_its_produced_model_without_local_training():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    model = ctx.hooks.coldstart_personalize(ctx=ctx, client=ctx.client(newcomer), message=message)[""]
    _, expected, _ = by_hand(ctx, ctx.server["phi"], ctx.server["eta"], newcomer, ctx.round)
    assert_close(model.state_dict(), expected, PARAMS, atol=1e-5)
    result, _ = run_tiny(**{**BASE, "experiment.coldstart_clients": 1})
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0 and not result.errors


def test_batchnorm_statistics_are_not_produced_and_stay_with_each_client():
    engine, ctx = prepared(**{**BASE, "model.params": {"hidden": [8], "norm": "batch"}})
    engine.run_round(ctx, 1)
    buffers = [k for k, _ in ctx.models.working("mlp").named_buffers()]
    assert not set(buffers) & {k.split(".", 1)[0] for k in ctx.server["eta"]}
    assert far_apart(ctx.store[0]["kept"], ctx.store[1]["kept"], ["bn1.running_mean"])


def test_the_default_sizes_are_fl_benchs():
    _, ctx = prepared(**{"algorithm.name": "pefll", "model.params.hidden": [8], "partition.num_clients": 4})
    assert ctx.resolved_values["embed_dim"] == 3  # int(1 + 4 / 4) = 2, floored at 3
    assert ctx.server["phi"]["mlp.4.weight"].shape == (3, 100)
    assert ctx.server["eta"]["heads.0.weight"].shape == (160, 100)  # fc1.weight's 8 x 20, from width 100
    assert sum(1 for k in ctx.server["eta"] if k.startswith("mlp.") and k.endswith("weight")) == 4  # 1 + 3 hidden
    p = PeFLLParams()
    assert (p.lr, p.embed_dim, p.descriptor_batches, p.embed_labels, p.hidden_dim) == (2e-4, None, 1, True, 100)


# -- bit identity: process executor, resume ----------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5,
                                        "addons": [{"name": "dropout", "params": {"p": 0.5}}]},
                                       {"model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial-dropout", "batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("pefll", rounds=3, **{"algorithm.params": dict(SMALL), **overrides})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "pefll", "experiment.participation": 0.5, "algorithm.params": dict(SMALL)}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["adam"]["state"]  # Adam's moments are part of what resumes


# -- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lr", 0.0), ("lr", float("nan")), ("embed_dim", 2), ("embed_hidden", 0),
                                       ("descriptor_batches", 0), ("hidden_dim", 0), ("hidden_layers", -1),
                                       ("embed_labels", "yes")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "produces the weights of one architecture" in info.value.message


def test_a_hypernetwork_larger_than_memory_is_refused_at_hidden_dim_before_it_is_allocated():
    engine = Engine(resolve(tiny_raw(**{**BASE, "algorithm.params.hidden_dim": 10**12})), progress=False)
    with pytest.raises(SpecError) as info:
        engine.run()
    assert info.value.path == "algorithm.params.hidden_dim" and "GiB" in str(info.value)
