"""FedBN (plugins/fedbn): which keys are BatchNorm's, one client = FedAvg bit for bit, a round
recomputed (shared layers averaged, BatchNorm layers kept per client and never averaged), what is
evaluated, bytes = exactly the non-BatchNorm bytes, a model without BatchNorm refused."""

import pytest
import torch
from harness import (
    assert_close,
    assert_same,
    far_apart,
    mean_of,
    model_bytes,
    prepared,
    recorded_training,
    shrink,
    state_of,
    train_reference,
)
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.models.zoo import ResNet18
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins import fedbn as fedbn_module
from pfl_plugins.fedbn import FedBN, batchnorm_keys

BN_MLP = {"model.params": {"hidden": [8], "norm": "batch"}}
RAW = {"algorithm.name": "fedbn", "experiment.rounds": 2, **BN_MLP}
BN_KEYS = {f"bn1.{k}" for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}


def run_rounds(rounds=2, **overrides):
    engine, ctx = prepared(**overrides)
    for r in range(1, rounds + 1):
        engine.run_round(ctx, r)
    return engine, ctx


# -- which keys stay local ----------------------------------------------------------------------------


def test_batchnorm_keys_are_every_entry_of_every_batchnorm_module():
    _, ctx = prepared(**RAW)
    model = ctx.models.working("mlp")
    assert batchnorm_keys(model) == BN_KEYS
    shared, personal = FedBN().split_keys(ctx, "mlp")
    assert set(personal) == BN_KEYS and shared == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    resnet = ResNet18().build((3, 32, 32), 10)
    keys = batchnorm_keys(resnet)
    assert "layer2.0.downsample.1.running_var" in keys and "bn1.num_batches_tracked" in keys
    assert not any(k.startswith(("conv1.", "fc.", "layer1.0.conv1.")) for k in keys)
    assert len(keys) == 5 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules())


# -- one client: FedAvg, bit for bit ---------------------------------------------------------------------


def test_with_one_client_fedbn_is_fedavg_bit_for_bit():
    one = {"partition.scheme": "iid", "partition.num_clients": 1, "experiment.rounds": 3}
    _, fedbn = run_rounds(3, **{**RAW, **one})
    _, fedavg = run_rounds(3, **{**RAW, **one, "algorithm.name": "fedavg"})
    evaluated = state_of(evaluated_models(fedbn, fedbn.client(0))[""])
    assert_same(evaluated, fedavg.server["global"])
    assert list(evaluated) == list(fedavg.server["global"])
    # ... and it sent less: no BatchNorm bytes
    bn_bytes = model_bytes(fedavg.server["global"], sorted(BN_KEYS))
    assert fedavg.comm_up - fedbn.comm_up == 3 * bn_bytes


# -- a round, recomputed --------------------------------------------------------------------------------


def test_rounds_average_the_shared_layers_and_keep_each_clients_batchnorm():
    engine, ctx = prepared(**RAW)
    shrink(ctx, {0: 30, 1: 50})  # unequal sizes: n-weighted
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    shared, personal = FedBN().split_keys(ctx, "mlp")
    init = ctx.models.initial_state("mlp")
    bn_state = {i: {k: init[k] for k in personal} for i in range(4)}
    for r in (1, 2):
        glob = {k: ctx.server["global"][k].clone() for k in shared}
        engine.run_round(ctx, r)
        trained = {i: train_reference(ctx, i, {**glob, **bn_state[i]}) for i in range(4)}
        expected = mean_of(((sizes[i] / sum(sizes.values()), trained[i]) for i in range(4)), shared)
        assert_close({k: ctx.server["global"][k] for k in shared}, expected)
        uniform = mean_of(((0.25, trained[i]) for i in range(4)), shared)
        assert far_apart(expected, uniform, shared)  # the test tells n-weighted from uniform
        for i in range(4):
            assert_close(ctx.store[i]["personal"], trained[i], personal)
            bn_state[i] = {k: ctx.store[i]["personal"][k].clone() for k in personal}
        # never averaged: the clients' BatchNorm layers differ from each other
        assert far_apart(bn_state[0], bn_state[1], ["bn1.weight", "bn1.running_mean"])


def test_a_client_starts_each_round_from_the_global_shared_layers_and_its_own_batchnorm(monkeypatch):
    engine, ctx = prepared(**RAW)
    shared, personal = FedBN().split_keys(ctx, "mlp")
    engine.run_round(ctx, 1)
    glob = {k: ctx.server["global"][k].clone() for k in shared}
    own = {i: {k: ctx.store[i]["personal"][k].clone() for k in personal} for i in range(4)}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    for call in calls:
        assert_same(call["before"], glob, shared)
        assert_same(call["before"], own[call["client"]], personal)


def test_the_evaluated_model_is_global_shared_layers_with_the_clients_batchnorm():
    _, ctx = run_rounds(1, **RAW, **{"experiment.participation": 0.5})
    shared, personal = FedBN().split_keys(ctx, "mlp")
    init = ctx.models.initial_state("mlp")
    for i in range(4):
        evaluated = state_of(evaluated_models(ctx, ctx.client(i))[""])
        assert_same(evaluated, ctx.server["global"], shared)
        own = ctx.store[i].get("personal") or {k: init[k] for k in personal}  # never trained: the initial ones
        assert_same(evaluated, own, personal)


# -- bytes, budget -------------------------------------------------------------------------------------------


def test_bytes_are_exactly_the_non_batchnorm_bytes():
    _, ctx = run_rounds(2, **RAW, **{"experiment.participation": 0.5})
    shared, personal = FedBN().split_keys(ctx, "mlp")
    non_bn = model_bytes(ctx.server["global"], shared)
    assert ctx.comm_up == ctx.comm_down == 2 * 2 * non_bn
    assert model_bytes(ctx.server["global"], personal) > 0  # there was something to leave out


def test_measured_private_epochs_equal_the_declared_budget():
    resolved = resolve(tiny_raw(**RAW, **{"training.local_epochs": 2}))
    assert resolved.as_dict["budget"]["private_epochs"] == 4
    result = Engine(resolved, progress=False).run()
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(4)


def test_a_full_run_with_coldstart_clients():
    result = Engine(resolve(tiny_raw(**RAW, **{"experiment.coldstart_clients": 1})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- a model without BatchNorm is refused ----------------------------------------------------------------------


@pytest.mark.parametrize("model,key", [({"model.params": {"hidden": [8]}}, "model.name"),
                                       ({"model.params": {"hidden": [8]}, "model.pool": ["mlp"]}, "model.pool"),
                                       ({"model.params": {"hidden": [8]}, "model.clients": ["mlp"] * 4}, "model.clients")])
def test_a_model_without_batchnorm_is_a_spec_error_before_any_data(model, key):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**RAW, **model}))
    assert info.value.path == key
    assert info.value.message == (
        "fedbn keeps the BatchNorm layers local, but 'mlp' has none (FedBN would be FedAvg); use a model with "
        'BatchNorm, e.g. model.params.norm = "batch" on mlp, lenet5, cnn2 or cnn4, or resnet18, mobilenet_v2, '
        "vgg16 with batch_norm = true")


def test_the_real_model_is_checked_when_the_probe_cannot_build_it(monkeypatch):
    monkeypatch.setattr(fedbn_module, "probe_model", lambda spec, arch: None)
    with pytest.raises(SpecError) as info:
        prepared(**{**RAW, "model.params": {"hidden": [8]}})
    assert info.value.path == "model.name"


def test_cli_dry_run_exits_2_naming_model_name(tmp_path, capsys):
    raw = tiny_raw(**{**RAW, "model.params": {"hidden": [8]}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    assert code == 2
    line = one_line_error(err)
    assert "model.name" in line and "BatchNorm" in line and 'norm = "batch"' in line
    code, out, _ = run_cli(capsys, write_spec(tmp_path, tiny_raw(**RAW), "ok.toml"), "--dry-run")
    assert code == 0


def test_fedbn_takes_no_parameters():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**RAW, **{"algorithm.params.split": 1}))
    assert info.value.path == "algorithm.params.split"
