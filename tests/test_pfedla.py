"""pFedLA (plugins/pfedla): the layer-wise weights and the mix by hand; each client receives its
mix of every client's model and uploads what plain local training changed; the server steps each
client's own hypernetwork through the mix (recomputed by backward through a fresh module, its
sign checked) and adds Delta theta_i to theta_i; momentum per client over rounds; HeurpFedLA's
own layers; what is evaluated; BatchNorm statistics stay with the client; lost uploads; cold
start; process executor and resume bit-identical; bad input."""

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
from tiny import tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.pfedla import LayerWeights, PFedLAParams, mix, mixing_weights

SMALL = {"embed_dim": 3, "hidden_dim": 6, "hn_lr": 0.5}  # a small hypernetwork and a step that shows
BASE = {"algorithm.name": "pfedla", "model.params.hidden": [8], "experiment.rounds": 3,
        **{f"algorithm.params.{k}": v for k, v in SMALL.items()}}
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
LAYERS = [PARAMS[:2], PARAMS[2:]]


# -- the weights and the mix by hand -------------------------------------------------------------


def test_rows_are_normalised_a_zero_row_is_the_own_one_hot_and_heurpfedla_takes_the_top_self_weights():
    raw = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [2.0, 1.0, 1.0]])
    alpha = mixing_weights(raw, own=1)
    assert torch.allclose(alpha, torch.tensor([[0.25, 0.75, 0.0], [0.0, 1.0, 0.0], [0.5, 0.25, 0.25]]))
    # K = 1: the self-weights (column 1) are 3, 0, 1: layer 0 becomes client 1's own
    alpha = mixing_weights(raw, own=1, heuristic_k=1)
    assert torch.allclose(alpha, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.25, 0.25]]))
    # K = 1 for client 0: its self-weights 1, 0, 2 pick layer 2
    alpha = mixing_weights(raw, own=0, heuristic_k=1)
    assert torch.allclose(alpha, torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_the_mix_is_layer_by_layer():
    models = [{"a.w": torch.tensor([1.0, 2.0]), "b.w": torch.tensor(10.0)},
              {"a.w": torch.tensor([3.0, 6.0]), "b.w": torch.tensor(20.0)}]
    alpha = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    out = mix(alpha, models, [["a.w"], ["b.w"]])
    assert torch.allclose(out["a.w"], torch.tensor([2.5, 5.0])) and out["b.w"].item() == pytest.approx(10.0)


# -- a round, recomputed ----------------------------------------------------------------------------


def snapshot(ctx):
    return ({i: dict(phi) for i, phi in ctx.server["hn"].items()},
            {i: dict(m) for i, m in ctx.server["models"].items()})


def reference_mix(ctx, phi, models, client_id, heuristic_k=0, layers=LAYERS):
    """theta_bar_i from a fresh hypernetwork module holding ``phi``: ReLU'd heads, rows normalised
    by hand, every client's theta_j^l weighted; differentiable in the module's parameters."""
    num_layers, n = len(layers), len(models)
    hn = LayerWeights(phi["embedding"].shape[0], phi["mlp.0.weight"].shape[0], num_layers, n)
    hn.load_state_dict(phi)
    raw = hn()
    rows = []
    for l in range(num_layers):
        own = heuristic_k and l in torch.topk(raw[:, client_id].detach(), heuristic_k).indices.tolist()
        rows.append(torch.eye(n)[client_id] if own else raw[l] / raw[l].sum())
    theta = {k: sum(rows[l][j] * models[j][k] for j in range(n)) for l, keys in enumerate(layers) for k in keys}
    return hn, theta


def reference_step(ctx, phi, models, client_id, delta, lr, heuristic_k=0):
    """phi_i - lr * d<theta_bar_i, -Delta theta_i>/d phi_i, by backward through a fresh module."""
    hn, theta = reference_mix(ctx, phi, models, client_id, heuristic_k)
    (-sum((theta[k] * delta[k]).sum() for k in delta)).backward()
    return {k: (p - lr * p.grad).detach() if p.grad is not None else p.detach() for k, p in hn.named_parameters()}


def test_each_client_receives_its_layerwise_mix_and_uploads_what_local_training_changed():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)  # round 1: every theta_j is theta^0, so every mix is theta^0
    phi, models = snapshot(ctx)
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    for i in range(4):
        with torch.no_grad():
            _, expected = reference_mix(ctx, phi[i], models, i)
        assert set(broadcasts[i]["weights"]) == set(PARAMS)
        assert_close(broadcasts[i]["weights"], expected, atol=1e-6)
        assert far_apart(expected, models[i], PARAMS)  # a mix, not theta_i itself
        trained = train_reference(ctx, i, expected)
        assert_close(uploads[i]["delta"], {k: trained[k] - expected[k] for k in PARAMS}, atol=1e-6)
    assert far_apart(broadcasts[0]["weights"], broadcasts[1]["weights"], PARAMS)  # one mix per client
    assert ctx.comm_down == ctx.comm_up == 2 * 4 * model_bytes(ctx.models.initial_state("mlp"), PARAMS)  # 2 rounds


def test_the_server_steps_each_clients_hypernetwork_and_adds_delta_to_its_model():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    phi, models = snapshot(ctx)
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    for i in range(4):
        delta = uploads[i]["delta"]
        expected = reference_step(ctx, phi[i], models, i, delta, lr=0.5)
        assert_close(ctx.server["hn"][i], expected, atol=1e-5)
        assert far_apart(ctx.server["hn"][i], phi[i], ["heads.0.weight", "embedding"])
        assert_close(ctx.server["models"][i], {k: models[i][k] + delta[k] for k in PARAMS}, atol=1e-7)
        # the step moves the mix towards what the client trained: <theta_bar(phi') - theta_bar(phi), Delta> > 0
        with torch.no_grad():
            before = reference_mix(ctx, phi[i], models, i)[1]
            after = reference_mix(ctx, ctx.server["hn"][i], models, i)[1]
        assert sum(float(((after[k] - before[k]) * delta[k]).sum()) for k in PARAMS) > 0


def test_round_one_mixes_equal_models_so_no_hypernetwork_moves():
    engine, ctx = prepared(**BASE)
    phi, models = snapshot(ctx)
    engine.run_round(ctx, 1)
    for i in range(4):  # up to rounding: theta_j - theta_bar_i = 0 is the derivative's every factor
        assert_close(ctx.server["hn"][i], phi[i], atol=1e-6)
        assert far_apart(ctx.server["models"][i], models[i], PARAMS)


def test_momentum_is_kept_per_client_over_rounds():
    """Half the clients a round over five rounds: a client's buffer must carry its own past
    gradients (past the round where keeping only the last one would agree)."""
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 5, "experiment.participation": 0.5,
                              "algorithm.params.hn_lr": 0.2, "algorithm.params.momentum": 0.9})
    engine.run_round(ctx, 1)
    uploads = record_messages(ctx, "client_upload")
    buffers, steps = {}, {i: 0 for i in range(4)}
    for r in range(2, 6):
        phi, models = snapshot(ctx)
        uploads.clear()
        engine.run_round(ctx, r)
        for i, upload in uploads.items():
            grad = {k: (phi[i][k] - t) / 0.2 for k, t in reference_step(ctx, phi[i], models, i, upload["delta"],
                                                                        lr=0.2).items()}
            buffers[i] = grad if i not in buffers else {k: 0.9 * buffers[i][k] + grad[k] for k in grad}
            steps[i] += 1
            assert_close(ctx.server["hn"][i], {k: phi[i][k] - 0.2 * buffers[i][k] for k in grad}, atol=1e-5)
        for i in set(range(4)) - set(uploads):
            assert_close(ctx.server["hn"][i], phi[i], atol=0)
    assert max(steps.values()) >= 3  # some client's buffer carried two earlier steps


# -- HeurpFedLA ----------------------------------------------------------------------------------------


def test_heurpfedla_gives_each_client_its_own_layer_of_largest_self_weight_and_no_gradient_there():
    engine, ctx = prepared(**{**BASE, "algorithm.params.heuristic_k": 1})
    engine.run_round(ctx, 1)
    phi, models = snapshot(ctx)
    broadcasts, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    own_layers = set()
    for i in range(4):
        hn, _ = reference_mix(ctx, phi[i], models, i)
        (own,) = torch.topk(hn()[:, i].detach(), 1).indices.tolist()
        own_layers.add(own)
        assert_close(broadcasts[i]["weights"], models[i], LAYERS[own], atol=1e-7)  # theta_i^l itself
        other = LAYERS[1 - own]
        assert far_apart(broadcasts[i]["weights"], models[i], other)
        expected = reference_step(ctx, phi[i], models, i, uploads[i]["delta"], lr=0.5, heuristic_k=1)
        assert_close(ctx.server["hn"][i], expected, atol=1e-5)
        assert_close(ctx.server["hn"][i], phi[i], [f"heads.{own}.weight", f"heads.{own}.bias"], atol=0)
        assert far_apart(ctx.server["hn"][i], phi[i], [f"heads.{1 - own}.weight"])


# -- what is evaluated; what the client keeps -----------------------------------------------------------


def test_each_client_is_evaluated_with_its_mix_of_the_current_state():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    phi, models = snapshot(ctx)
    for i in range(4):  # participants and idle clients alike: no local steps before scoring
        model = evaluated_models(ctx, ctx.client(i))[""]
        with torch.no_grad():
            _, expected = reference_mix(ctx, phi[i], models, i)
        assert_close(model.state_dict(), expected, PARAMS, atol=1e-6)


def test_batchnorm_statistics_are_not_mixed_and_stay_with_each_client():
    engine, ctx = prepared(**{**BASE, "model.params": {"hidden": [8], "norm": "batch"}})
    broadcasts = record_messages(ctx, "on_broadcast")
    engine.run_round(ctx, 1)
    model = ctx.models.working("mlp")
    buffers = [k for k, _ in model.named_buffers()]
    assert len(ctx.server["hn"][0]) == 1 + 6 + 2 * 3  # embedding, MLP, 3 layers (fc1, bn1, fc2)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):
        assert not set(buffers) & set(broadcasts[i]["weights"])
        trained = train_reference(ctx, i, {**initial, **broadcasts[i]["weights"]})
        assert_close(ctx.store[i]["kept"], trained, buffers, atol=1e-6)
    assert far_apart(ctx.store[0]["kept"], ctx.store[1]["kept"], ["bn1.running_mean"])
    scored = evaluated_models(ctx, ctx.client(2))[""].state_dict()
    assert_close(scored, ctx.store[2]["kept"], buffers, atol=0)


# -- lost uploads, cold start ---------------------------------------------------------------------------


def test_a_lost_upload_moves_neither_the_hypernetwork_nor_the_model_of_its_client():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 4  # seed 0 drops some and keeps some in round 2
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    phi, models = snapshot(ctx)
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    for i in range(4):
        if i in lost:
            assert_close(ctx.server["hn"][i], phi[i], atol=0)
            assert_close(ctx.server["models"][i], models[i], atol=0)
        else:
            expected = reference_step(ctx, phi[i], models, i, uploads[i]["delta"], lr=0.5)
            assert_close(ctx.server["hn"][i], expected, atol=1e-5)
            assert_close(ctx.server["models"][i], {k: models[i][k] + uploads[i]["delta"][k] for k in PARAMS},
                         atol=1e-7)


def test_a_cold_start_client_receives_the_uniform_mean_of_the_training_clients_models():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1})
    (newcomer,) = ctx.coldstart_clients
    assert newcomer not in ctx.server["hn"] and newcomer not in ctx.server["models"]
    engine.run_round(ctx, 1)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=newcomer)
    models = [ctx.server["models"][j] for j in ctx.training_clients]
    assert len(models) == 3 and ctx.server["hn"][ctx.training_clients[0]]["heads.0.weight"].shape == (3, 6)
    assert_close(message["weights"], {k: sum(m[k] for m in models) / 3 for k in PARAMS}, atol=1e-6)


def test_the_initial_hypernetworks_are_fl_benchs():
    _, ctx = prepared(**BASE)
    phi = ctx.server["hn"]
    for l in range(2):  # heads U(0, 1) with zero bias, so every weight starts positive
        w = phi[0][f"heads.{l}.weight"]
        assert w.shape == (4, 6) and bool((w >= 0).all() and (w < 1).all()) and not phi[0][f"heads.{l}.bias"].any()
    assert_close(phi[0], phi[3], [k for k in phi[0] if k != "embedding"], atol=0)  # one draw, copied
    assert far_apart(phi[0], phi[3], ["embedding"])  # each its own row of the embedding table


# -- bit identity: process executor, resume ---------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"experiment.participation": 0.5, "algorithm.params.momentum": 0.5},
                                       {"algorithm.params.heuristic_k": 1,
                                        "model.params": {"hidden": [8], "norm": "batch"}}],
                         ids=["partial-momentum", "heur-batchnorm"])
def test_the_process_pool_is_bit_identical_to_the_sequential_loop(overrides):
    assert_pool_matches_sequential("pfedla", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "pfedla", "experiment.participation": 0.5,
                 "algorithm.params": {"momentum": 0.5}, "model.params": {"hidden": [8], "norm": "batch"}}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert ref_server["hn_momentum"]  # the momentum buffers are part of what resumes


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("hn_lr", 0.0), ("hn_lr", float("nan")), ("momentum", 1.0),
                                       ("momentum", -0.1), ("embed_dim", 0), ("hidden_dim", 0),
                                       ("heuristic_k", -1), ("heuristic_k", 1.5), ("hn_lr", "0.1")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_heuristic_k_beyond_the_models_layers_is_refused(tmp_path, capsys):
    raw = tiny_raw(**{**BASE, "algorithm.params.heuristic_k": 3})
    line = dry_run_error(tmp_path, capsys, raw)
    assert "algorithm.params.heuristic_k" in line and "the model has 2" in line
    resolve(tiny_raw(**{**BASE, "algorithm.params.heuristic_k": 2}))  # every layer its own: allowed


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "same architecture" in info.value.message


def test_defaults_are_fl_benchs():
    p = PFedLAParams()
    assert (p.hn_lr, p.momentum, p.embed_dim, p.hidden_dim, p.heuristic_k) == (5e-3, 0.0, 100, 100, 0)
