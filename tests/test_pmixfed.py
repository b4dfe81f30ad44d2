"""pMixFed (METHODS.md, revised resolution): the mix degrees by hand, bytes per round between
FedAlt/FedSim and FedAvg, the global head as the average of the local heads, the FedPer and
FedAvg reductions, frozen layers, dAcc on the validation split, cold start, bad input."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core import seeding
from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.methods.partial import partial_average
from pfl_core.models.layers import layer_keys
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models, score
from pfl_plugins import pmixfed

SMALL = {"data.params.samples_per_device": 60}  # fast on a loaded machine
DEEP = {"algorithm.name": "pmixfed", "model.params.hidden": [16, 16], **SMALL}  # 3 layers: fc1, fc2, fc3
DEEPER = {**DEEP, "model.params.hidden": [16, 16, 16]}  # 4 layers: fc1 .. fc4 (fc4 the head)
# 3 devices over 4 clients ("domain": client i gets device i % 3): clients 0 and 3 share device
# 0, so they hold half as many samples as clients 1 and 2 and p_i = n_i / n is not uniform.
UNEQUAL = {"data.params.num_devices": 3}


def nbytes_of(state, keys):
    return sum(state[k].numel() * state[k].element_size() for k in keys)


def client_values(ctx, name) -> dict[int, float]:
    """This round's per-client values of ``name`` (``client.log``), by client."""
    return {row["client"]: row["value"] for row in ctx.client_series if row["round"] == ctx.round and row["name"] == name}


def drive(raw, rounds):
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    for r in range(1, rounds + 1):
        ctx.round_metrics = {}
        engine.run_round(ctx, r)
    return engine, ctx


def sample_weights(ctx, ids):
    """p_i = n_i / n over ``ids``, from the clients' train splits (by hand, not the hook)."""
    n = {i: ctx.data.clients[i].num_train for i in ids}
    return {i: n[i] / sum(n.values()) for i in ids}


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# -- the schedule --------------------------------------------------------------------------


@pytest.mark.parametrize("gamma, mu, nu", [
    # L = 4: mu_l = clip(1 - gamma/(1-gamma) (l-1)/3, 0, 1) for l < 4, mu_4 = 0;
    #        nu_l = gamma (1 - (l-1)/3)
    (0.25, [1, 8 / 9, 7 / 9, 0], [0.25, 1 / 6, 1 / 12, 0]),
    (0.5, [1, 2 / 3, 1 / 3, 0], [0.5, 1 / 3, 1 / 6, 0]),
    (0.6, [1, 0.5, 0, 0], [0.6, 0.4, 0.2, 0]),
    (0.75, [1, 0, 0, 0], [0.75, 0.5, 0.25, 0]),
])
def test_mix_degrees_by_hand_for_four_layers(gamma, mu, nu):
    got_mu = pmixfed.broadcast_degrees(gamma, 4)
    assert got_mu == pytest.approx(mu, abs=1e-12)
    assert [m == 0 for m in got_mu] == [m == 0 for m in mu]  # exactly 0 where frozen, not 1e-17
    assert pmixfed.aggregation_degrees(gamma, 4) == pytest.approx(nu, abs=1e-12)
    assert pmixfed.frozen_count(got_mu) == sum(m == 0 for m in mu[:-1])  # the head is not "frozen"


def test_mix_degrees_fall_from_base_to_head_and_freeze_more_as_gamma_grows():
    frozen = []
    for gamma in np.linspace(0.01, 0.99, 99):
        for num_layers in (2, 3, 5, 8):
            mu = pmixfed.broadcast_degrees(gamma, num_layers)
            assert mu[0] == 1.0 and mu[-1] == 0.0 and len(mu) == num_layers
            assert all(a >= b for a, b in zip(mu, mu[1:]))  # non-increasing from base to head
            nu = pmixfed.aggregation_degrees(gamma, num_layers)
            assert nu[0] == pytest.approx(gamma) and nu[-1] == 0.0 and all(v < 1 for v in nu)
            if gamma <= 0.5:  # at or below the neutral point every layer below the head is shared
                assert all(m > 0 for m in mu[:-1])
        frozen.append(pmixfed.frozen_count(pmixfed.broadcast_degrees(gamma, 8)))
    assert all(a <= b for a, b in zip(frozen, frozen[1:])) and frozen[0] == 0 and frozen[-1] == 6
    assert pmixfed.broadcast_degrees(1.0, 4) == [1.0, 0.0, 0.0, 0.0]  # sigmoid rounded to 1


def test_mix_factor_follows_eq_10_and_the_sign_of_dacc():
    # gamma = sigmoid(k (t/T)^2 dAcc - b)
    assert pmixfed.mix_factor(0.4, 0.5, slope=10, offset=0.5) == pytest.approx(sig(10 * 0.25 * 0.4 - 0.5))
    assert pmixfed.mix_factor(-0.4, 0.5, slope=10, offset=0.5) == pytest.approx(sig(-10 * 0.25 * 0.4 - 0.5))
    assert pmixfed.mix_factor(0.4, 0.5, slope=10, offset=-1) == pytest.approx(sig(10 * 0.25 * 0.4 + 1))
    assert pmixfed.mix_factor(0.9, 0.0, slope=10, offset=0.3) == pytest.approx(sig(-0.3))  # t = 0
    assert pmixfed.mix_factor(-900.0, 1.0, slope=1, offset=0) == pytest.approx(0.0, abs=1e-300)  # no overflow
    # local better than global: a larger gamma, so the broadcast freezes more
    better = pmixfed.mix_factor(0.3, 1.0, slope=10, offset=0)
    worse = pmixfed.mix_factor(-0.3, 1.0, slope=10, offset=0)
    assert better > 0.5 > worse
    assert pmixfed.frozen_count(pmixfed.broadcast_degrees(better, 4)) == 2
    assert pmixfed.frozen_count(pmixfed.broadcast_degrees(worse, 4)) == 0


def test_beta_schedule_draws_each_middle_layer_per_client_and_keeps_base_and_head():
    raw = tiny_raw(**DEEPER, **{"algorithm.params.schedule": "beta"})  # default beta_a = 1: uniform
    engine, ctx = drive(raw, 2)
    for i in range(4):  # round 2's draws, from the client's own seeded stream
        middle = seeding.numpy_rng(0, "pmixfed_mix", 2, i).beta(1.0, 1.0, size=2)
        assert ctx.server["mix"][i]["mu"] == pytest.approx([1.0, *middle, 0.0])
        assert i not in client_values(ctx, "gamma")  # no mix factor at the broadcast
    assert ctx.server["mix"][0]["mu"] != ctx.server["mix"][1]["mu"]
    assert ctx.round_metrics["gamma_agg"] == pytest.approx(seeding.numpy_rng(0, "pmixfed_mix", 2).beta(1.0, 1.0))
    assert "gamma_mean" not in ctx.round_metrics
    assert set(ctx.hooks.client_upload(ctx=ctx, client=_loaded(ctx, 0))) == {"weights"}  # no accuracies sent


def test_defaults_are_the_ones_the_tuning_sweep_chose():
    spec = (Path(__file__).parents[1] / "specs" / "pmixfed_tuning.toml").read_text()
    chosen = re.search(r"chosen: slope k = ([0-9.]+), offset b = ([-0-9.]+), the defaults", spec)
    params = pmixfed.PMixFedParams()
    assert (params.slope, params.offset) == (float(chosen[1]), float(chosen[2]))
    assert (params.schedule, params.gamma, params.beta_a) == ("sigmoid-adaptive", 0.5, 1.0)
    resolve(tiny_raw(**{"algorithm.name": "pmixfed", "algorithm.params.slope": 0.0}))  # k = 0: a constant gamma


# -- communication -------------------------------------------------------------------------


def test_bytes_per_round_lie_strictly_between_fedalt_fedsim_and_fedavg_at_the_neutral_point():
    common = {**SMALL, "model.params.hidden": [16, 16, 16], "experiment.rounds": 1}
    mixed, engine = run_tiny(**common, **{"algorithm.name": "pmixfed", "algorithm.params.schedule": "dynamic-only",
                                          "algorithm.params.gamma": 0.5})
    glob = engine.ctx.server["global"]
    layers = layer_keys(engine.ctx.models.working("mlp"))
    full = nbytes_of(glob, [k for keys in layers for k in keys])
    head = nbytes_of(glob, layers[-1])
    # mu = [1, 2/3, 1/3, 0]: down every layer but the head, with the three sent layers' degrees
    # (the client needs the fractional ones to mix; 8 bytes a number); up every layer (none
    # frozen + head)
    assert mixed.final["comm_down_bytes"] == 4 * (full - head + 3 * 8)
    assert mixed.final["comm_up_bytes"] == 4 * full
    total = {"pmixfed": mixed.final["comm_up_bytes"] + mixed.final["comm_down_bytes"]}
    for name in ("fedalt", "fedsim", "fedavg"):
        result, _ = run_tiny(**common, **{"algorithm.name": name})
        total[name] = result.final["comm_up_bytes"] + result.final["comm_down_bytes"]
    assert total["fedalt"] == total["fedsim"] == 4 * 2 * nbytes_of(glob, layers[0] + layers[1])  # split L // 2
    assert total["fedavg"] == 4 * 2 * full
    assert total["fedalt"] < total["pmixfed"] < total["fedavg"]


# -- the reductions ------------------------------------------------------------------------


def fedper_schedule(params, *, stage, num_layers, dacc, progress, rng):
    return None, [1.0] * (num_layers - 1) + [0.0] if stage == "broadcast" else [0.0] * num_layers


fedper_schedule.uses_accuracy = False


def all_shared(params, *, stage, num_layers, dacc, progress, rng):
    return 0.0, [1.0 if stage == "broadcast" else 0.0] * num_layers


all_shared.uses_accuracy = False


def test_mu_one_below_the_head_and_nu_zero_is_fedper_bit_for_bit(monkeypatch):
    monkeypatch.setitem(pmixfed.SCHEDULES, "fedper", fedper_schedule)
    common = {**SMALL, **UNEQUAL, "model.params.hidden": [16, 16], "experiment.participation": 0.75,
              "experiment.rounds": 3}
    _, per = run_tiny(**common, **{"algorithm.name": "fedper"})
    _, mixed = run_tiny(**common, **{"algorithm.name": "pmixfed", "algorithm.params.schedule": "fedper"})
    body, head = per.resolved.algorithm.split(per.ctx)
    assert head == layer_keys(per.ctx.models.working("mlp"))[-1]
    glob = mixed.ctx.server["global"]
    assert all(torch.equal(glob[k], per.ctx.server["body"][k]) for k in body)  # FedAvg of the bodies
    trained = [i for i in range(4) if "head" in per.ctx.store[i]]
    assert trained == [i for i in range(4) if "local" in mixed.ctx.store[i]] and len(trained) >= 2
    for i in trained:  # personal heads, as FedPer keeps them
        assert all(torch.equal(mixed.ctx.store[i]["local"][k], per.ctx.store[i]["head"][k]) for k in head)
    assert not torch.equal(per.ctx.store[trained[0]]["head"][head[0]], per.ctx.store[trained[1]]["head"][head[0]])


def test_mu_one_everywhere_and_nu_zero_is_fedavg_exactly(monkeypatch):
    monkeypatch.setitem(pmixfed.SCHEDULES, "all-shared", all_shared)
    common = {"model.params.hidden": [16, 16], "experiment.participation": 0.75, **SMALL, **UNEQUAL}
    fedavg, e1 = run_tiny(**common)
    mixed, e2 = run_tiny(**common, **{"algorithm.name": "pmixfed", "algorithm.params.schedule": "all-shared"})
    g1, g2 = e1.ctx.server["global"], e2.ctx.server["global"]
    assert g1.keys() == g2.keys()
    assert all(torch.equal(g1[k], g2[k]) for k in g1)
    # every layer is sent, so the bytes are FedAvg's too
    assert fedavg.final["comm_up_bytes"] == mixed.final["comm_up_bytes"]
    assert fedavg.final["comm_down_bytes"] == mixed.final["comm_down_bytes"]


# -- broadcast, upload and aggregation -----------------------------------------------------


def test_global_head_is_the_weighted_average_of_the_uploaded_local_heads():
    raw = tiny_raw(**DEEP, **UNEQUAL, **{"algorithm.params.schedule": "dynamic-only",
                                         "algorithm.params.gamma": 0.7, "experiment.participation": 0.75})
    engine, ctx = drive(raw, 1)
    layers = layer_keys(ctx.models.working("mlp"))
    init = ctx.models.initial_state("mlp")
    participants = ctx.participants
    assert len(participants) == 3
    p = sample_weights(ctx, participants)
    assert len(set(p.values())) > 1  # the weights matter
    for i in participants:  # the upload is the trained local model's non-frozen layers and its head
        upload = ctx.hooks.client_upload(ctx=ctx, client=_loaded(ctx, i))["weights"]
        assert set(upload) == set(layers[0] + layers[2])  # gamma 0.7, L = 3: mu = [1, 0, 0]: fc2 frozen, the head sent
        assert all(torch.equal(upload[k], ctx.store[i]["local"][k]) for k in upload)
    for key in layers[2]:
        expected = sum(p[i] * ctx.store[i]["local"][key] for i in participants)
        assert torch.allclose(ctx.server["global"][key], expected, atol=1e-6)  # nu_L = 0: no old head mixed in
        assert not torch.allclose(ctx.server["global"][key], init[key])


def _loaded(ctx, client_id):
    """Client ``client_id`` as after training: its stored local model in the working module and
    the mixing degrees its broadcast told it (``on_receive`` keeps them in its scratch)."""
    client = ctx.client(client_id)
    client.model.load_state_dict(ctx.store[client_id]["local"])
    client.scratch["mu"] = list(ctx.server["mix"][client_id]["mu"])
    return client


def test_broadcast_and_aggregation_mix_as_the_equations_say():
    raw = tiny_raw(**DEEP, **UNEQUAL, **{"algorithm.params.schedule": "dynamic-only", "algorithm.params.gamma": 0.2})
    engine, ctx = drive(raw, 1)
    mu = [1.0, 1.0 - 0.2 / 0.8 * 1 / 2, 0.0]
    assert ctx.server["mix"][1]["mu"] == pytest.approx(mu)
    layers = layer_keys(ctx.models.working("mlp"))
    prev = {k: v.clone() for k, v in ctx.server["global"].items()}
    local_1 = {k: v.clone() for k, v in ctx.store[1]["local"].items()}
    # broadcast in round 2: local_l <- mu_l global_l + (1 - mu_l) local_l; the head stays local
    ctx.round = 2
    client = ctx.client(1)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=1)
    assert set(message["weights"]) == set(layers[0] + layers[1])  # the global head is never sent down
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    received = client.model.state_dict()
    for m, keys in zip(mu, layers):
        for key in keys:
            assert torch.allclose(received[key], m * prev[key] + (1 - m) * local_1[key], atol=1e-6)
    # aggregation (Eq. 13): global_l <- nu_l global_l(prev) + (1 - nu_l) sum_i p_i local_i,l
    engine.run_round(ctx, 2)
    p = sample_weights(ctx, range(4))
    current = ctx.server["global"]
    nu = [0.2, 0.1, 0.0]
    for index in range(3):
        for key in layers[index]:
            avg = sum(p[i] * ctx.store[i]["local"][key] for i in range(4))
            assert torch.allclose(current[key], nu[index] * prev[key] + (1 - nu[index]) * avg, atol=1e-6)
    assert ctx.round_metrics["gamma_agg"] == 0.2


def test_frozen_layers_are_neither_broadcast_nor_uploaded_nor_counted_nor_aggregated():
    raw = tiny_raw(**DEEPER, **{"algorithm.params.schedule": "dynamic-only", "algorithm.params.gamma": 0.75})
    engine, ctx = drive(raw, 2)  # L = 4, gamma 0.75: mu = [1, 0, 0, 0], fc2 and fc3 frozen
    layers = layer_keys(ctx.models.working("mlp"))
    assert ctx.server["mix"][0]["mu"] == [1.0, 0.0, 0.0, 0.0]
    assert client_values(ctx, "frozen_layers")[0] == 2 and ctx.round_metrics["frozen_layers_mean"] == 2
    glob, init = ctx.server["global"], ctx.models.initial_state("mlp")
    down = nbytes_of(glob, layers[0])
    up = nbytes_of(glob, layers[0] + layers[3])  # the base and the head
    assert ctx.comm_down == 2 * 4 * down and ctx.comm_up == 2 * 4 * up
    upload = ctx.hooks.client_upload(ctx=ctx, client=_loaded(ctx, 0))
    assert set(upload["weights"]) == set(layers[0] + layers[3])
    for key in layers[1] + layers[2]:  # nobody sent them: the global copy never moved
        assert torch.equal(glob[key], init[key])
    assert any(not torch.equal(glob[k], init[k]) for k in layers[3])
    # the next broadcast replaces the base only; the frozen layers and the head stay local
    ctx.round = 3
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert set(message["weights"]) == set(layers[0])
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    now, local = client.model.state_dict(), ctx.store[0]["local"]
    for key in now:
        assert torch.equal(now[key], glob[key] if key in layers[0] else local[key]), key
    assert any(not torch.equal(local[k], glob[k]) for k in layers[0])  # the base really was replaced
    assert any(not torch.equal(local[k], init[k]) for k in layers[1])  # frozen = not sent, still trained


def gap_schedule(params, *, stage, num_layers, dacc, progress, rng):
    return None, [1.0, 0.0, 0.5, 0.0] if stage == "broadcast" else [0.0] * num_layers


gap_schedule.uses_accuracy = False


def test_a_pluggable_schedule_may_freeze_a_layer_below_a_shared_one(monkeypatch):
    monkeypatch.setitem(pmixfed.SCHEDULES, "gap", gap_schedule)
    engine, ctx = drive(tiny_raw(**DEEPER, **{"algorithm.params.schedule": "gap"}), 1)
    layers = layer_keys(ctx.models.working("mlp"))
    prev, local = dict(ctx.server["global"]), ctx.store[0]["local"]
    ctx.round = 2
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=0)
    assert set(message["weights"]) == set(layers[0] + layers[2])
    client = ctx.client(0)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=message)
    now = client.model.state_dict()
    for key in layers[1] + layers[3]:  # frozen fc2 and the head: the client's own
        assert torch.equal(now[key], local[key])
    for key in layers[2]:  # past the frozen layer, fc3 is still mixed: 0.5 global + 0.5 local
        assert torch.allclose(now[key], 0.5 * prev[key] + 0.5 * local[key], atol=1e-6)
    assert set(ctx.hooks.client_upload(ctx=ctx, client=client)["weights"]) == set(layers[0] + layers[2] + layers[3])
    assert client_values(ctx, "frozen_layers")[0] == 1


def test_a_layer_some_clients_froze_is_averaged_over_the_others():
    avg, senders = partial_average([(0.25, {"base": torch.tensor([1.0]), "deep": torch.tensor([10.0])}),
                                    (0.75, {"base": torch.tensor([3.0])})])
    assert avg["base"].item() == pytest.approx(2.5) and avg["deep"].item() == pytest.approx(10.0)
    assert senders == {"base": 2, "deep": 1}


# -- the adaptive mix factor on the validation split ----------------------------------------


def _model(ctx, state):
    model = ctx.models.build("mlp")
    model.load_state_dict(state)
    return model


def _acc(ctx, state, client_id, split):
    data = ctx.data.clients[client_id]
    return score(_model(ctx, state), getattr(data, f"{split}_x"), getattr(data, f"{split}_y")).accuracy


def test_dacc_is_measured_on_the_validation_split_at_broadcast_and_aggregation():
    raw = tiny_raw(**DEEP, **{"experiment.rounds": 6, "algorithm.params.offset": 0.5,
                              "algorithm.params.slope": 20.0, "partition.val_fraction": 0.3})
    engine, ctx = drive(raw, 3)  # after round 1 the global model is right nowhere; after 3 it is
    num_classes = ctx.num_classes
    for data in ctx.data.clients:  # a test split on which every accuracy differs from validation
        data.test_y = (data.test_y + 1) % num_classes
    k, b, progress = 20.0, 0.5, (4 / 6) ** 2
    prev_global = {key: v.clone() for key, v in ctx.server["global"].items()}
    acc_global = [_acc(ctx, prev_global, i, "val") for i in range(4)]
    assert sum(a > 0 for a in acc_global) >= 2  # both terms of dAcc matter

    def gamma_at_broadcast(client_id, split):
        dacc = _acc(ctx, ctx.store[client_id]["local"], client_id, split) - _acc(ctx, prev_global, client_id, split)
        return sig(k * progress * dacc - b)

    expected = {i: gamma_at_broadcast(i, "val") for i in range(4)}
    assert any(expected[i] != pytest.approx(gamma_at_broadcast(i, "test")) for i in range(4))  # discriminates
    ctx.round_metrics = {}
    engine.run_round(ctx, 4)
    for i in range(4):
        assert client_values(ctx, "gamma")[i] == pytest.approx(expected[i])
        assert ctx.server["mix"][i]["mu"] == pytest.approx(pmixfed.broadcast_degrees(expected[i], 3))
    assert ctx.round_metrics["gamma_mean"] == pytest.approx(np.mean(list(expected.values())))
    # aggregation: dAcc = mean_i Acc(previous global) - mean_i Acc(fresh local_i), on validation
    acc_local = [_acc(ctx, ctx.store[i]["local"], i, "val") for i in range(4)]
    dacc = np.mean(acc_global) - np.mean(acc_local)
    assert dacc != 0
    assert ctx.round_metrics["gamma_agg"] == pytest.approx(sig(k * progress * dacc - b))
    # the server measured the global model's accuracy itself at the broadcast; each upload adds
    # only the fresh local one (8 bytes on top of the sent layers)
    assert ctx.server["mix"][2]["acc_global"] == pytest.approx(acc_global[2])
    upload = ctx.hooks.client_upload(ctx=ctx, client=_trained(ctx, 2))
    assert set(upload) == {"weights", "val_acc_local"}
    assert upload["val_acc_local"] == 0.5  # the client's own, as it measured it


def test_without_a_validation_split_dacc_is_zero_and_nothing_is_sent():
    raw = tiny_raw(**DEEP, **{"experiment.rounds": 2, "algorithm.params.offset": 0.5, "partition.val_fraction": 0.0})
    engine, ctx = drive(raw, 2)
    assert len(ctx.data.clients[0].val_y) == 0
    for i in range(4):
        assert client_values(ctx, "gamma")[i] == pytest.approx(sig(-0.5))  # gamma = sigmoid(-b)
    assert ctx.round_metrics["gamma_agg"] == pytest.approx(sig(-0.5))
    client = _loaded(ctx, 0)
    client.scratch["acc_local"] = pmixfed.val_accuracy(ctx, client, client.model)  # as local_train does
    assert client.scratch["acc_local"] is None
    assert set(ctx.hooks.client_upload(ctx=ctx, client=client)) == {"weights"}


def test_a_two_layer_model_shares_its_base_and_averages_its_head():
    result, engine = run_tiny(**SMALL, **{"algorithm.name": "pmixfed", "experiment.rounds": 1})  # fc1, fc2
    ctx = engine.ctx
    layers = layer_keys(ctx.models.working("mlp"))
    assert len(layers) == 2 and ctx.server["mix"][0]["mu"] == [1.0, 0.0]
    p = sample_weights(ctx, range(4))
    for key in layers[1]:
        assert torch.allclose(ctx.server["global"][key], sum(p[i] * ctx.store[i]["local"][key] for i in range(4)),
                              atol=1e-6)


def _trained(ctx, client_id):
    """A client as after on_receive and local_train: it holds its mixing degrees (what its
    broadcast said) and a local validation accuracy."""
    client = ctx.client(client_id)
    client.scratch["mu"] = list(ctx.server["mix"][client_id]["mu"])
    client.scratch["acc_local"] = 0.5
    return client


# -- clients with different depths ---------------------------------------------------------


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
    keymap, glob = engine.resolved.algorithm.layout(ctx)[1], ctx.server["global"]
    assert keymap["cnn2"]["conv1.weight"] == keymap["lenet5"]["conv1.weight"] == "conv1.weight"
    assert keymap["cnn2"]["conv2.weight"] == "conv2.weight@cnn2"  # another shape: its own entry
    p = sample_weights(ctx, range(4))
    local = {i: ctx.store[i]["local"] for i in range(4)}
    shared = sum(p[i] * local[i]["conv1.weight"] for i in range(4))
    assert torch.allclose(glob["conv1.weight"], shared, atol=1e-6)
    deep = (p[0] * local[0]["fc3.weight"] + p[2] * local[2]["fc3.weight"]) / (p[0] + p[2])
    assert torch.allclose(glob["fc3.weight"], deep, atol=1e-6)  # only the lenet5 clients
    assert "fc3.weight" not in ctx.hooks.client_upload(ctx=ctx, client=_trained(ctx, 1))["weights"]
    assert [len(ctx.server["mix"][i]["mu"]) for i in range(4)] == [5, 4, 5, 4]  # each on its own L


# -- cold start and bad input --------------------------------------------------------------


def test_coldstart_client_starts_from_the_whole_global_model_with_its_trained_head():
    result, engine = run_tiny(**DEEP, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 0,
                                       "experiment.rounds": 2})
    ctx = engine.ctx
    client = ctx.client(ctx.coldstart_clients[0])
    model = coldstart_models(ctx, client)[""]
    glob, init = ctx.server["global"], ctx.models.initial_state("mlp")
    assert all(torch.equal(v, glob[k]) for k, v in model.state_dict().items())
    head = layer_keys(ctx.models.working("mlp"))[-1]
    assert any(not torch.equal(glob[k], init[k]) for k in head)  # the head was aggregated
    assert "coldstart_acc_mean" in result.final


def test_a_client_that_never_trained_is_evaluated_with_the_global_model():
    raw = tiny_raw(**DEEP, **{"experiment.participation": 0.25})
    engine, ctx = drive(raw, 1)
    idle = next(i for i in range(4) if i not in ctx.participants)
    model = evaluated_models(ctx, ctx.client(idle))[""]
    assert all(torch.equal(v, ctx.server["global"][k]) for k, v in model.state_dict().items())
    trained = ctx.participants[0]
    model = evaluated_models(ctx, ctx.client(trained))[""]
    assert all(torch.equal(v, ctx.store[trained]["local"][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("key, value", [
    ("offset", float("inf")), ("offset", "high"), ("slope", float("nan")), ("slope", -1.0), ("slope", "steep"),
    ("slope", True), ("beta_a", 0.0), ("beta_a", -1.0), ("gamma", 1.0), ("gamma", 0.0), ("schedule", "cosine"),
])
def test_bad_parameters_name_their_key(key, value):
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{"algorithm.name": "pmixfed", f"algorithm.params.{key}": value}))
    assert err.value.path == f"algorithm.params.{key}"
    if key == "schedule":  # the message lists what is known
        assert err.value.message == "must be one of 'sigmoid-adaptive', 'dynamic-only', 'beta', got 'cosine'"


def test_a_single_layer_model_is_refused():
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{"algorithm.name": "pmixfed", "model.params.hidden": []}))
    assert err.value.path == "model.name"
    assert "mlp has 1 layer(s), it needs at least 2" in str(err.value)


@pytest.mark.parametrize("line, key", [
    ("slope = inf", "slope"), ("slope = -2.0", "slope"), ('slope = "steep"', "slope"),
    ("offset = nan", "offset"), ("offset = [1]", "offset"),
])
def test_cli_exits_2_naming_the_key(tmp_path, capsys, line, key):
    spec = tmp_path / "bad.toml"
    spec.write_text(
        '[data]\nname = "synthetic"\n[data.params]\nnum_devices = 4\n[partition]\nscheme = "domain"\n'
        'num_clients = 4\n[model]\nname = "mlp"\n[algorithm]\nname = "pmixfed"\n'
        f'[algorithm.params]\n{line}\n'
    )
    assert run_main([str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"algorithm.params.{key}" in err
