"""pMixFed: the mix-degree schedule, the FedAvg reduction, frozen layers, heterogeneous depths,
the adaptive mix factor on the validation split, bad input."""

import math

import numpy as np
import pytest
import torch

from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.evaluation import score
from pfl_core.models.layers import layer_keys
from plugins import pmixfed
from plugins.partial import partial_average
from tiny import run_tiny, tiny_raw

SMALL = {"data.params.samples_per_device": 60}  # fast on a loaded machine
DEEP = {"algorithm.name": "pmixfed", "model.params.hidden": [16, 16], **SMALL}  # 3 layers: fc1, fc2, fc3


def nbytes_of(state, keys):
    return sum(state[k].numel() * state[k].element_size() for k in keys)


def drive(raw, rounds):
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    for r in range(1, rounds + 1):
        ctx.round_metrics = {}
        engine.run_round(ctx, r)
    return engine, ctx


# -- the schedule --------------------------------------------------------------------------


def test_mix_degrees_are_one_at_the_base_zero_at_the_head_and_freeze_more_as_gamma_grows():
    zeros = []
    for gamma in np.linspace(0.01, 0.99, 50):
        for num_layers in (2, 4, 5, 8):
            mu = pmixfed.broadcast_degrees(gamma, num_layers)
            assert mu[0] == 1.0 and mu[-1] == 0.0 and len(mu) == num_layers
            assert all(a >= b for a, b in zip(mu, mu[1:]))  # non-increasing from base to head
            assert all(0.0 <= m <= 1.0 for m in mu)
        zeros.append(sum(m == 0 for m in pmixfed.broadcast_degrees(gamma, 8)))
    assert all(a <= b for a, b in zip(zeros, zeros[1:])) and zeros[0] == 1 and zeros[-1] == 7
    assert pmixfed.broadcast_degrees(0.5, 5) == [1.0, 0.5, 0.0, 0.0, 0.0]
    nu = pmixfed.aggregation_degrees(0.6, 4)
    assert nu[0] == 0.6 and nu[-1] == 0.0 and all(n < 1 for n in nu)
    assert pmixfed.mix_factor(0.0, 1.0, slope=10, offset=0) == 0.5
    assert pmixfed.mix_factor(0.3, 1.0, slope=10, offset=1) == pytest.approx(1 / (1 + math.exp(-2)))
    assert pmixfed.mix_factor(0.9, 0.0, slope=10, offset=0) == 0.5  # no effect before training


def all_shared(params, *, stage, num_layers, dacc, progress, rng):
    return 0.0, [1.0 if stage == "broadcast" else 0.0] * num_layers


all_shared.uses_accuracy = False


def test_all_mix_degrees_one_and_aggregation_zero_equals_fedavg_exactly(monkeypatch):
    monkeypatch.setitem(pmixfed.SCHEDULES, "all-shared", all_shared)
    common = {"model.params.hidden": [16, 16], "experiment.participation": 0.75, **SMALL}
    fedavg, e1 = run_tiny(**common)
    mixed, e2 = run_tiny(**common, **{"algorithm.name": "pmixfed", "algorithm.params.schedule": "all-shared"})
    g1, g2 = e1.ctx.server["global"], e2.ctx.server["global"]
    assert g1.keys() == g2.keys()
    assert all(torch.equal(g1[k], g2[k]) for k in g1)
    # every layer is sent, so the bytes are FedAvg's too
    assert fedavg.final["comm_up_bytes"] == mixed.final["comm_up_bytes"]
    assert fedavg.final["comm_down_bytes"] == mixed.final["comm_down_bytes"]


# -- frozen layers, the broadcast and aggregation mixups ------------------------------------


def test_frozen_layer_is_neither_changed_by_broadcast_nor_counted():
    raw = tiny_raw(**DEEP, **{"algorithm.params.schedule": "dynamic-only", "algorithm.params.gamma": 0.5})
    engine, ctx = drive(raw, 2)  # gamma 0.5, L = 3: mu = [1, 0, 0]
    assert ctx.server["mix"][0]["mu"] == [1.0, 0.0, 0.0]
    assert ctx.round_metrics["frozen_layers/0"] == 2
    fc1 = layer_keys(ctx.models.working("mlp"))[0]
    per_round = 4 * nbytes_of(ctx.server["global"], fc1)
    assert ctx.comm_down == 2 * per_round and ctx.comm_up == 2 * per_round
    ctx.round = 3
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert set(message["weights"]) == set(fc1)
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    now, local, glob = client.model.state_dict(), client.state["local"], ctx.server["global"]
    for key in now:
        assert torch.equal(now[key], glob[key] if key in fc1 else local[key]), key
    assert any(not torch.equal(local[k], glob[k]) for k in fc1)  # the base really was replaced


def test_broadcast_and_aggregation_mix_as_the_equations_say():
    raw = tiny_raw(**DEEP, **{"algorithm.params.schedule": "dynamic-only", "algorithm.params.gamma": 0.2})
    engine, ctx = drive(raw, 1)
    mu = [1.0, 1.0 - 1.0 / (2 * 0.8), 0.0]  # clip(1 - (l-1)/((L-1)(1-gamma)))
    assert ctx.server["mix"][1]["mu"] == pytest.approx(mu)
    layers = layer_keys(ctx.models.working("mlp"))
    prev = {k: v.clone() for k, v in ctx.server["global"].items()}
    local_1 = {k: v.clone() for k, v in ctx.store[1]["local"].items()}
    # broadcast in round 2: local_l <- mu_l global_l + (1 - mu_l) local_l
    ctx.round = 2
    client = ctx.client(1)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=1))
    received = client.model.state_dict()
    for m, keys in zip(mu, layers):
        for key in keys:
            assert torch.allclose(received[key], m * prev[key] + (1 - m) * local_1[key], atol=1e-6)
    # aggregation: nu_l = gamma (1 - (l-1)/(L-1)) on the layers with mu > 0; the head untouched
    weights = ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1, 2, 3])
    engine.run_round(ctx, 2)
    current = ctx.server["global"]
    nu = [0.2, 0.1, 0.0]
    for index in (0, 1):
        for key in layers[index]:
            avg = sum(weights[i] * ctx.store[i]["local"][key] for i in range(4))
            assert torch.allclose(current[key], nu[index] * prev[key] + (1 - nu[index]) * avg, atol=1e-6)
    for key in layers[2]:
        assert torch.equal(current[key], prev[key])  # the head is never aggregated
    assert ctx.round_metrics["gamma_agg"] == 0.2


def test_adaptive_mix_factor_uses_the_validation_split():
    raw = tiny_raw(**DEEP, **{"experiment.rounds": 4, "algorithm.params.offset": 0.5})
    engine, ctx = drive(raw, 1)
    params = ctx.params
    client = ctx.client(2)
    local = score(_load(ctx, client.state["local"]), client.data.val_x, client.data.val_y).accuracy
    glob = score(_load(ctx, ctx.server["global"]), client.data.val_x, client.data.val_y).accuracy
    expected = 1 / (1 + math.exp(-(params.slope * (2 / 4) ** 2 * (local - glob) - params.offset)))
    ctx.round_metrics = {}
    engine.run_round(ctx, 2)
    assert ctx.round_metrics["gamma/2"] == pytest.approx(expected)
    assert ctx.round_metrics["frozen_layers/2"] == sum(m == 0 for m in pmixfed.broadcast_degrees(expected, 3))
    assert 0 < ctx.round_metrics["gamma_agg"] < 1 and "gamma_mean" in ctx.round_metrics
    # each upload carries the two validation accuracies: 16 bytes on top of the sent layers
    upload = ctx.hooks.client_upload(ctx=ctx, client=_trained(ctx, 2))
    assert set(upload) == {"weights", "val_acc_local", "val_acc_global"}


def _trained(ctx, client_id):
    client = ctx.client(client_id)
    client.scratch["acc_local"] = 0.5
    return client


def _load(ctx, state):
    model = ctx.models.build("mlp")
    model.load_state_dict(state)
    return model


# -- clients with different depths ---------------------------------------------------------


def test_partial_average_renormalises_a_layer_over_the_clients_that_have_it():
    a = {"base": torch.tensor([1.0]), "deep": torch.tensor([10.0])}
    b = {"base": torch.tensor([3.0])}  # a shallower client: no deep layer
    avg, senders = partial_average([(0.25, a), (0.75, b)])
    assert avg["base"].item() == pytest.approx(2.5) and avg["deep"].item() == pytest.approx(10.0)
    assert senders == {"base": 2, "deep": 1}


def write_images(path, n=160, size=12, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 4
    x = (rng.integers(0, 60, size=(n, size, size)) + 40 * y[:, None, None]).astype(np.uint8)
    np.savez(path, x_train=x, y_train=y)
    return str(path)


def test_a_shallower_client_leaves_the_deeper_layers_to_the_others(tmp_path, monkeypatch):
    monkeypatch.setitem(pmixfed.SCHEDULES, "all-shared", all_shared)
    raw = tiny_raw(**{
        "algorithm.name": "pmixfed", "algorithm.params.schedule": "all-shared", "experiment.rounds": 1,
        "data.name": "npz", "data.params": {"path": write_images(tmp_path / "img.npz")},
        "partition.scheme": "iid", "model.name": "cnn2", "model.params": {},
        # lenet5 at width 5.34: conv1 is 32 x 1 x 5 x 5 like cnn2's, everything after differs;
        # lenet5 has 5 layers, cnn2 4
        "model.clients": ["lenet5", "cnn2", "lenet5", "cnn2"],
        "model.arch_params": {"lenet5": {"width": 5.34}},
    })
    del raw["model"]["params"]
    engine, ctx = drive(raw, 1)
    keymap, glob = ctx.server["keymap"], ctx.server["global"]
    assert keymap["cnn2"]["conv1.weight"] == keymap["lenet5"]["conv1.weight"] == "conv1.weight"
    assert keymap["cnn2"]["conv2.weight"] == "conv2.weight@cnn2"  # another shape: its own entry
    weights = ctx.hooks.client_weighting(ctx=ctx, participants=[0, 1, 2, 3])
    local = {i: ctx.store[i]["local"] for i in range(4)}
    shared = sum(weights[i] * local[i]["conv1.weight"] for i in range(4))
    assert torch.allclose(glob["conv1.weight"], shared, atol=1e-6)
    deep = (weights[0] * local[0]["fc3.weight"] + weights[2] * local[2]["fc3.weight"]) / (weights[0] + weights[2])
    assert torch.allclose(glob["fc3.weight"], deep, atol=1e-6)  # only the lenet5 clients
    assert "fc3.weight" not in ctx.hooks.client_upload(ctx=ctx, client=ctx.client(1))["weights"]


# -- cold start and bad input --------------------------------------------------------------


def test_coldstart_client_starts_from_the_whole_global_model():
    result, engine = run_tiny(**DEEP, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 0,
                                       "experiment.rounds": 2})
    ctx = engine.ctx
    client = ctx.client(ctx.coldstart_clients[0])
    model = ctx.hooks.coldstart_personalize(ctx=ctx, client=client)[""]
    assert all(torch.equal(v, ctx.server["global"][k]) for k, v in model.state_dict().items())
    assert "coldstart_acc_mean" in result.final


@pytest.mark.parametrize("key, value", [
    ("offset", float("inf")), ("slope", float("nan")), ("beta_a", 0.0), ("beta_a", -1.0),
    ("gamma", 1.0), ("schedule", "cosine"),
])
def test_bad_parameters_name_their_key(key, value):
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{"algorithm.name": "pmixfed", f"algorithm.params.{key}": value}))
    assert err.value.path == f"algorithm.params.{key}"


def test_a_single_layer_model_is_refused():
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{"algorithm.name": "pmixfed", "model.params.hidden": []}))
    assert err.value.path == "model.name"


def test_cli_exits_2_naming_the_key(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text(
        '[data]\nname = "synthetic"\n[data.params]\nnum_devices = 4\n[partition]\nscheme = "domain"\n'
        'num_clients = 4\n[model]\nname = "mlp"\n[algorithm]\nname = "pmixfed"\n'
        '[algorithm.params]\nslope = inf\n'
    )
    assert run_main([str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "algorithm.params.slope" in err
