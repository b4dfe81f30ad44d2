"""The partial-model baselines of the pMixFed comparison: FedAlt, FedSim, FedBABU, LG-FedAvg."""

import functools

import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.models.layers import layer_keys
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models

# layers fc1, fc2, fc3 (middle split k = 1); small data, 2 rounds: fast on a loaded machine
DEEP = {"model.params.hidden": [16, 16], "data.params.samples_per_device": 60, "experiment.rounds": 2}


def state_bytes(state, keys):
    return sum(state[k].numel() * state[k].element_size() for k in keys)


@pytest.fixture(scope="module")
def runs():
    return functools.lru_cache(maxsize=None)(lambda name: run_tiny(**DEEP, **{"algorithm.name": name}))


def keys_of(engine):
    return layer_keys(engine.ctx.models.working("mlp"))


@pytest.mark.parametrize("name, shared", [("fedsim", "base"), ("fedalt", "base"), ("lgfedavg", "head")])
def test_only_the_shared_part_travels_and_the_rest_stays_personal(name, shared, runs):
    result, engine = runs(name)
    layers = keys_of(engine)
    base, head = layers[0], layers[1] + layers[2]  # split at the middle: L // 2 = 1 base layer
    sent, kept = (base, head) if shared == "base" else (head, base)
    glob, init = engine.ctx.server["global"], engine.ctx.models.initial_state("mlp")
    per_round = 4 * state_bytes(glob, sent)
    assert result.final["comm_up_bytes"] == 2 * per_round == result.final["comm_down_bytes"]
    personal = [engine.ctx.store[i]["personal"] for i in range(4)]
    assert all(set(p) == set(kept) for p in personal)
    assert any(not torch.equal(personal[0][k], personal[1][k]) for k in kept)  # personal differs
    assert all(torch.equal(glob[k], init[k]) for k in kept)  # the server never touches it
    assert any(not torch.equal(glob[k], init[k]) for k in sent)


def test_fedalt_updates_the_personal_part_with_the_shared_part_fixed():
    # no shared epochs: only the personal phase runs, so the shared base never moves
    _, engine = run_tiny(**DEEP, **{"algorithm.name": "fedalt", "training.local_epochs": 0})
    layers = keys_of(engine)
    glob, init = engine.ctx.server["global"], engine.ctx.models.initial_state("mlp")
    assert all(torch.equal(glob[k], init[k]) for k in layers[0])
    assert any(not torch.equal(engine.ctx.store[0]["personal"][k], init[k]) for k in layers[2])


def test_fedalt_coldstart_reconstructs_only_the_personal_part():
    result, engine = run_tiny(**DEEP, **{"algorithm.name": "fedalt", "experiment.coldstart_clients": 1})
    ctx = engine.ctx
    model = coldstart_models(ctx, ctx.client(ctx.coldstart_clients[0]))[""]
    state, base = model.state_dict(), keys_of(engine)[0]
    assert all(torch.equal(state[k], ctx.server["global"][k]) for k in base)
    assert "coldstart_acc_mean" in result.final


def test_fedbabu_keeps_the_head_at_its_initialisation_and_fine_tunes_at_evaluation():
    result, engine = run_tiny(**DEEP, **{"algorithm.name": "fedbabu", "experiment.coldstart_clients": 1,
                                         "algorithm.params.finetune_epochs": 1})
    layers = keys_of(engine)
    glob, init = engine.ctx.server["global"], engine.ctx.models.initial_state("mlp")
    assert all(torch.equal(glob[k], init[k]) for k in layers[2])  # head: head_layers = 1
    assert all(not torch.equal(glob[k], init[k]) for k in layers[0] + layers[1])
    model_bytes = state_bytes(glob, layers[0] + layers[1])
    assert result.final["comm_up_bytes"] == 3 * 2 * model_bytes  # 3 training clients, 2 rounds
    ctx = engine.ctx
    tuned = evaluated_models(ctx, ctx.client(ctx.training_clients[0]))[""].state_dict()
    assert any(not torch.equal(tuned[k], init[k]) for k in layers[2])  # fine-tuning moves the head
    assert all(torch.equal(glob[k], init[k]) for k in layers[2])  # ... but not the global one
    assert "coldstart_acc_mean" in result.final


@pytest.mark.parametrize("name, head_layers", [("fedalt", 3), ("fedsim", 4), ("lgfedavg", 9), ("fedbabu", 5)])
def test_a_split_outside_the_models_layers_names_the_key(name, head_layers):
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**DEEP, **{"algorithm.name": name, "algorithm.params.head_layers": head_layers}))
    assert err.value.path == "algorithm.params.head_layers"
    assert "outside the model's layers" in err.value.message


@pytest.mark.parametrize("name", ["fedalt", "fedsim", "lgfedavg", "fedbabu", "fedper", "fedrep"])
def test_no_head_layers_is_refused_by_the_bound(name):
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**DEEP, **{"algorithm.name": name, "algorithm.params.head_layers": 0}))
    assert err.value.path == "algorithm.params.head_layers" and ">= 1" in err.value.message


def test_the_split_is_checked_again_on_the_real_model():
    from types import SimpleNamespace

    from pfl_core.methods.partial import PartialModel

    plugin = PartialModel(PartialModel.Params(head_layers=7))
    plugin.spec_path = "algorithm"
    _, engine = run_tiny(**{**DEEP, "experiment.rounds": 1})
    ctx = SimpleNamespace(server={}, models=engine.ctx.models)
    with pytest.raises(SpecError) as err:
        plugin.split_keys(ctx, "mlp")
    assert err.value.path == "algorithm.params.head_layers"


def test_cli_dry_run_exits_2_on_a_bad_split(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text(
        '[data]\nname = "synthetic"\n[data.params]\nnum_devices = 4\n[partition]\nscheme = "domain"\n'
        'num_clients = 4\n[model]\nname = "mlp"\n[algorithm]\nname = "fedalt"\n'
        '[algorithm.params]\nhead_layers = 9\n'
    )
    assert run_main([str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "algorithm.params.head_layers" in err


# -- one split parameter (issue 13): head_layers, counted from the output; defaults unchanged --


def head_keys(engine, ctx, name):
    method = engine.resolved.algorithm
    if name in ("fedper", "fedrep"):
        return method.head_keys(ctx)
    shared, personal = method.split_keys(ctx, "mlp")
    return shared if name == "lgfedavg" else personal  # LG-FedAvg shares the head


def fc(*layers):
    return [f"fc{i}.{p}" for i in layers for p in ("weight", "bias")]


# The head each method had under its former default (partial family: split = none, L // 2 base
# layers; FedBABU: split = -1; FedPer/FedRep: head_layers = 1), for MLPs of 3 and 4 layers.
@pytest.mark.parametrize("hidden, name, head", [
    ([16, 16], "fedalt", fc(2, 3)), ([16, 16], "fedsim", fc(2, 3)), ([16, 16], "lgfedavg", fc(2, 3)),
    ([16, 16], "fedbabu", fc(3)), ([16, 16], "fedper", fc(3)),
    ([16, 16], "fedrep", fc(3)),
    ([16, 16, 16], "fedalt", fc(3, 4)), ([16, 16, 16], "fedsim", fc(3, 4)), ([16, 16, 16], "lgfedavg", fc(3, 4)),
    ([16, 16, 16], "fedbabu", fc(4)), ([16, 16, 16], "fedper", fc(4)), ([16, 16, 16], "fedrep", fc(4)),
])
def test_the_default_head_of_every_split_method_is_unchanged(hidden, name, head):
    from harness import prepared

    engine, ctx = prepared(**{"model.params.hidden": hidden, "algorithm.name": name})
    assert head_keys(engine, ctx, name) == head


@pytest.mark.parametrize("name, head_layers, head", [("fedalt", 1, fc(3)), ("lgfedavg", 2, fc(2, 3)),
                                                     ("fedbabu", 2, fc(2, 3)), ("fedper", 2, fc(2, 3))])
def test_head_layers_counts_the_same_layers_in_every_split_method(name, head_layers, head):
    from harness import prepared

    engine, ctx = prepared(**DEEP, **{"algorithm.name": name, "algorithm.params.head_layers": head_layers})
    assert head_keys(engine, ctx, name) == head
