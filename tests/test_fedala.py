"""FedALA (plugins/fedala): Eq. 4's element-wise aggregation and Eq. 5's clipped weight step by
hand, the lower layers taken from the global model, the start phase then one epoch a round, what
a client trains from and is evaluated with, FedAvg's bytes and server, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import assert_same, dry_run_error, far_apart, linear, prepared, recorded_training, refused_at_key
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedala import (
    Aggregated,
    ClippedSGD,
    FedALA,
    FedALAParams,
    ala_split,
    converged,
    local_aggregation,
)

BASE = {"algorithm.name": "fedala", "model.params.hidden": [8], "experiment.rounds": 3}
LOWER, HIGHER = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]


# -- Eq. 4 and Eq. 5 by hand -----------------------------------------------------------------------


def test_element_wise_aggregation_by_hand():
    local = {"a": torch.tensor([1.0, 2.0]), "h": torch.tensor([1.0, 1.0, 4.0]), "buf": torch.tensor([7.0])}
    glob = {"a": torch.tensor([5.0, -2.0]), "h": torch.tensor([3.0, 0.0, 4.0]), "buf": torch.tensor([9.0])}
    W = {"h": torch.tensor([0.5, 0.25, 1.0])}
    out = local_aggregation(local, glob, W, lower=["a"])
    assert torch.equal(out["a"], glob["a"])  # a lower layer: the global model, whatever W is
    # h: 1 + (3 - 1) 0.5 = 2, 1 + (0 - 1) 0.25 = 0.75, 4 + 0 = 4
    assert torch.allclose(out["h"], torch.tensor([2.0, 0.75, 4.0]))
    assert torch.equal(out["buf"], local["buf"])  # a higher layer's buffer stays local
    ones = local_aggregation(local, glob, {"h": torch.ones(3)}, lower=["a"])
    zeros = local_aggregation(local, glob, {"h": torch.zeros(3)}, lower=["a"])
    assert torch.equal(ones["h"], glob["h"]) and torch.equal(zeros["h"], local["h"])


def test_the_weight_step_is_clipped_to_the_unit_interval():
    W = torch.nn.Parameter(torch.tensor([0.9, 0.1, 0.5, 0.0]))
    optimizer = ClippedSGD([W], lr=0.5)
    W.grad = torch.tensor([-1.0, 1.0, 0.2, 0.0])
    optimizer.step()
    # 0.9 + 0.5 = 1.4 -> 1;  0.1 - 0.5 -> 0;  0.5 - 0.1 = 0.4;  0 stays 0
    assert torch.allclose(W.detach(), torch.tensor([1.0, 0.0, 0.4, 0.0]))


def test_the_gradient_of_w_is_the_models_gradient_times_global_minus_local():
    model = linear([0.0, 0.0], [0.0])  # nn.Linear(2, 1): weight, bias
    local = {"weight": torch.tensor([[1.0, 1.0]]), "bias": torch.tensor([0.0])}
    glob = {"weight": torch.tensor([[3.0, 0.0]]), "bias": torch.tensor([2.0])}
    module = Aggregated(model, local, glob, {k: torch.full_like(v, 0.5) for k, v in local.items()}, lower=[])
    x = torch.tensor([[1.0, 2.0]])
    module(x).sum().backward()  # L = w . x + b: dL/dw = x = (1, 2), dL/db = 1
    grads = dict(zip(module.names, (w.grad for w in module.W)))
    assert torch.allclose(grads["weight"], torch.tensor([[1.0 * 2.0, 2.0 * -1.0]]))  # x (.) (global - local)
    assert torch.allclose(grads["bias"], torch.tensor([2.0]))
    ClippedSGD(module.parameters(), lr=0.1).step()
    W = module.weights()  # 0.5 - 0.1 (2, -2) and 0.5 - 0.1 * 2
    assert torch.allclose(W["weight"], torch.tensor([[0.3, 0.7]])) and torch.allclose(W["bias"], torch.tensor([0.3]))
    # the forward pass runs Eq. 4: theta-hat = local + (global - local) W at W = 0.5
    expected = torch.tensor([[2.0, 0.5]]) @ x.T + 1.0
    assert torch.allclose(Aggregated(model, local, glob, {k: torch.full_like(v, 0.5) for k, v in local.items()},
                                     lower=[])(x), expected)


def test_the_split_counts_layers_from_the_output():
    _, ctx = prepared(**BASE)
    model = ctx.models.build("mlp")
    assert ala_split(model, 1) == (LOWER, HIGHER)
    assert ala_split(model, 2) == ([], LOWER + HIGHER)


def test_the_start_phase_stopping_rule_by_hand():
    assert not converged([1.0] * 10, threshold=0.1, num_pre_loss=10)  # needs more than num_pre_loss
    assert converged([5.0] + [1.0] * 10, threshold=0.1, num_pre_loss=10)  # std of the last 10: 0
    # std of (1, 1.3): 0.15 >= 0.1; of (1.3, 1.35): 0.025
    assert not converged([2.0, 1.0, 1.3], threshold=0.1, num_pre_loss=2)
    assert converged([2.0, 1.0, 1.3, 1.35], threshold=0.1, num_pre_loss=2)
    assert np.std([1.0, 1.3]) == pytest.approx(0.15)
    assert not converged([9.0, 0.0, 1.0], threshold=0.5, num_pre_loss=2)  # std exactly 0.5: not below


def test_the_sample_is_s_percent_of_the_training_data_drawn_without_replacement():
    _, ctx = prepared(**BASE)
    client = ctx.client(0)
    n = client.num_train
    x, y = FedALA(FedALAParams(s=50)).sample(ctx, client)
    assert len(y) == int(0.5 * n)
    rows = {tuple(r.tolist()) for r in x}
    assert len(rows) == len(y) and rows <= {tuple(r.tolist()) for r in client.data.train_x}
    assert len(FedALA(FedALAParams(s=1)).sample(ctx, client)[1]) == max(1, int(0.01 * n))
    assert len(FedALA(FedALAParams(s=100)).sample(ctx, client)[1]) == n


def test_local_work_is_the_local_epochs_plus_one_pass_over_s_percent():
    spec = resolve(tiny_raw(**BASE, **{"training.local_epochs": 2})).spec
    assert FedALA(FedALAParams(s=80)).local_work(spec).private_epochs_per_round == pytest.approx(2.8)
    assert FedALA(FedALAParams(s=25)).local_work(spec).private_epochs_per_round == pytest.approx(2.25)


# -- in a run ---------------------------------------------------------------------------------------


def ala_epochs(ctx, round):
    return {row["client"]: row["value"] for row in ctx.client_series
            if row["name"] == "ala_epochs" and row["round"] == round}


def test_first_round_starts_from_the_global_model_then_start_phase_then_one_epoch(monkeypatch):
    engine, ctx = prepared(**BASE, **{"algorithm.params.threshold": 1e9, "algorithm.params.num_pre_loss": 3})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    assert [c["client"] for c in calls] == [0, 1, 2, 3]  # no W learning: only the local training
    for call in calls:
        assert_same(call["before"], start)
        assert "W" not in ctx.store[call["client"]]
    engine.run_round(ctx, 2)
    assert ala_epochs(ctx, 2) == {i: 4.0 for i in range(4)}  # the start phase: num_pre_loss + 1 epochs
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 3)
    assert ala_epochs(ctx, 3) == {i: 1.0 for i in range(4)}
    learning = [(c["client"], c["epochs"]) for c in calls if isinstance(c["model"], Aggregated)]
    assert learning == [(i, 1) for i in range(4)]  # one call of one epoch each


def test_later_rounds_start_from_the_weights_the_client_kept():
    engine, ctx = prepared(**BASE, **{"algorithm.params.eta": 1e-6})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    for i in range(4):  # as if the start phase had learned 0.3 everywhere
        ctx.store[i]["W"] = {k: torch.full_like(w, 0.3) for k, w in ctx.store[i]["W"].items()}
    engine.run_round(ctx, 3)
    for i in range(4):  # one tiny step from 0.3, not from 1
        for w in ctx.store[i]["W"].values():
            assert torch.allclose(w, torch.full_like(w, 0.3), atol=1e-3)


def test_the_start_phase_stops_at_its_cap():
    engine, ctx = prepared(**BASE, **{"algorithm.params.threshold": 1e-12, "algorithm.params.max_start_epochs": 5})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    assert ala_epochs(ctx, 2) == {i: 5.0 for i in range(4)}


def test_a_client_trains_from_eq4_lower_layers_global_and_w_in_the_unit_interval(monkeypatch):
    engine, ctx = prepared(**BASE, **{"algorithm.params.eta": 5.0})
    engine.run_round(ctx, 1)
    local = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
    glob = {k: v.clone() for k, v in ctx.server["global"].items()}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    trained = [c for c in calls if c["trainable"] >= set(LOWER + HIGHER)]  # the local training, not W's
    assert [c["client"] for c in trained] == [0, 1, 2, 3]
    clipped = False
    for call in trained:
        i, W = call["client"], ctx.store[call["client"]]["W"]
        assert list(W) == HIGHER
        for w in W.values():
            assert float(w.min()) >= 0.0 and float(w.max()) <= 1.0
            clipped |= bool(((w == 0) | (w == 1)).any()) and bool(((w > 0) & (w < 1)).any())
        for key in LOWER:
            assert torch.equal(call["before"][key], glob[key])  # the lower layers: the global model
        for key in HIGHER:
            expected = local[i][key] + (glob[key] - local[i][key]) * W[key]
            assert torch.allclose(call["before"][key], expected, atol=1e-6)
        assert far_apart(call["before"], glob, HIGHER) and far_apart(call["before"], local[i], HIGHER)
    assert clipped  # a large eta drives some weights to the bounds: the clip is exercised


def test_evaluation_is_eq4_with_the_current_global_model_or_the_global_model_without_a_local_one():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    glob = ctx.server["global"]
    with_w = [i for i in range(4) if "W" in ctx.store[i]]
    assert with_w
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        state = ctx.store[i]
        if "weights" not in state:
            assert_same(model, glob)
            continue
        W = state.get("W") or {k: torch.ones_like(glob[k]) for k in HIGHER}
        for key in LOWER:
            assert torch.equal(model[key], glob[key])
        for key in HIGHER:
            assert torch.allclose(model[key], state["weights"][key] + (glob[key] - state["weights"][key]) * W[key])


def test_the_server_is_fedavgs_and_the_bytes_are_fedavgs():
    def run(name):
        return Engine(resolve(tiny_raw(**{**BASE, "algorithm.name": name})), progress=False)

    ala, avg = run("fedala"), run("fedavg")
    ala.run(), avg.run()
    assert ala.ctx.comm_up == avg.ctx.comm_up and ala.ctx.comm_down == avg.ctx.comm_down
    # the global model is the n_i-weighted mean of the uploads, which are the clients' local models
    sizes = {i: ala.ctx.data.clients[i].num_train for i in range(4)}
    for key, value in ala.ctx.server["global"].items():
        mean = sum(sizes[i] * ala.ctx.store[i]["weights"][key].double() for i in range(4)) / sum(sizes.values())
        assert torch.allclose(value.double(), mean, atol=1e-6)


BATCH_NORM = {**BASE, "model.params.norm": "batch"}  # fc1 -> bn1 -> fc2: bn1 is a lower layer at p = 1
BN_BUFFERS = ["bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]


def test_the_split_leaves_every_buffer_out():
    _, ctx = prepared(**BATCH_NORM)
    lower, higher = ala_split(ctx.models.build("mlp"), 1)
    assert lower == LOWER + ["bn1.weight", "bn1.bias"] and higher == HIGHER


def test_the_lower_layers_batchnorm_statistics_stay_the_clients_own(monkeypatch):
    # the authors' ALA.py copies and mixes parameters() only: running statistics are never the global model's
    engine, ctx = prepared(**BATCH_NORM)
    engine.run_round(ctx, 1)
    local = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
    glob = {k: v.clone() for k, v in ctx.server["global"].items()}
    params = LOWER + ["bn1.weight", "bn1.bias"] + HIGHER
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    trained = [c for c in calls if c["trainable"] >= set(params)]  # the local training, after on_receive
    assert [c["client"] for c in trained] == [0, 1, 2, 3]
    for call in trained:
        i = call["client"]
        for key in BN_BUFFERS:
            assert torch.equal(call["before"][key], local[i][key]), (i, key)
        for key in LOWER + ["bn1.weight", "bn1.bias"]:
            assert torch.equal(call["before"][key], glob[key]), (i, key)  # the lower layers' parameters: global
        assert far_apart(local[i], glob, BN_BUFFERS[:2])  # the averaged statistics differ from the client's
    for i in range(4):  # and the evaluated model (Eq. 4 on the current global model) keeps them too
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        for key in BN_BUFFERS:
            assert torch.equal(model[key], ctx.store[i]["weights"][key]), (i, key)


def test_w_learning_descends_the_local_loss():
    engine, ctx = prepared(**BASE, **{"algorithm.params.threshold": 1e-12, "algorithm.params.max_start_epochs": 30,
                                      "algorithm.params.s": 100})
    engine.run_round(ctx, 1)
    client = ctx.client(0)
    plugin = FedALA(FedALAParams(s=100))
    glob, local = ctx.server["global"], ctx.store[0]["weights"]
    ones = plugin.initial_weights(ctx, client)
    learned = plugin.learn_weights(ctx, client, local, glob, ones, start=True)
    data = ctx.data.clients[0]

    def loss(W):
        model = ctx.models.build("mlp")
        model.load_state_dict(local_aggregation(local, glob, W, LOWER))
        with torch.no_grad():
            return float(F.cross_entropy(model(data.train_x), data.train_y))

    assert loss(learned) < loss(ones)


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("eta", 0.0), ("s", 0), ("s", 101), ("p", 0), ("threshold", -1.0),
                                       ("num_pre_loss", 0), ("max_start_epochs", 0), ("s", 50.0)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "fedala averages weights" in info.value.message


def test_p_beyond_the_models_layers_is_refused_at_its_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"algorithm.params.p": 3}))
    assert info.value.path == "algorithm.params.p" and "mlp has 2 parameterised layer(s)" in info.value.message


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.eta": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.eta") and "> 0" in line
