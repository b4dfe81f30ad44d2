"""Add-ons compose with any algorithm: corrupted clients, and plugins with heterogeneous models."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from harness import prepared
from tiny import run_tiny, tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.registry import make_plugin_manager
from pfl_plugins.corrupted_clients import CorruptedClients, CorruptedClientsParams, flip

LEARNABLE = {"experiment.rounds": 5, "training.local_epochs": 2, "data.params.samples_per_device": 200}


def corrupted(**params):
    return {"addons": [{"name": "corrupted_clients", "params": params}]}


def acc_by_client(result):
    return {row["client"]: row["acc"] for row in result.client_rows}


def test_flipping_only_training_labels_ruins_that_clients_clean_test_accuracy():
    clean, _ = run_tiny(**LEARNABLE, **{"algorithm.name": "local"})
    poisoned, _ = run_tiny(**LEARNABLE, **{"algorithm.name": "local"}, **corrupted(clients=[0], splits=["train"]))
    clean_acc, poisoned_acc = acc_by_client(clean), acc_by_client(poisoned)
    assert poisoned_acc[0] < clean_acc[0] - 0.4
    for other in (1, 2, 3):  # Local: nobody else is affected
        assert poisoned_acc[other] == clean_acc[other]


def test_flipped_client_keeps_its_own_task_under_local_training():
    """All splits flipped: the client's own task is consistent, so Local still learns it."""
    clean, _ = run_tiny(**LEARNABLE, **{"algorithm.name": "local"})
    flipped, _ = run_tiny(**LEARNABLE, **{"algorithm.name": "local"}, **corrupted(clients=[0], mapping="shift"))
    assert acc_by_client(flipped)[0] > 0.6
    assert abs(acc_by_client(flipped)[0] - acc_by_client(clean)[0]) < 0.2


def test_add_on_composes_with_a_weight_sharing_method():
    result, engine = run_tiny(**{"algorithm.name": "fedprox"}, **corrupted(clients=[1, 2]))
    labels = engine.ctx.data.clients[1].train_y
    assert result.final["comm_up_bytes"] > 0
    assert len(engine.resolved.plugins) == 2 and engine.resolved.plugins[-1].name == "fedprox"
    assert labels.max() < 10


def test_add_on_checks_name_the_add_on_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**corrupted(clients=[7])))
    assert info.value.path == "addons[0].params.clients[0]"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**corrupted(splits=["training"])))
    assert info.value.path == "addons[0].params.splits"


def test_heterogeneous_client_architectures(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (200, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 200))  # no test arrays: the partition makes the test splits
    images = {"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
              "algorithm.name": "local", "experiment.rounds": 1, "model.name": "lenet5", "model.params": {}}
    result, engine = run_tiny(**images, **{"model.pool": ["lenet5", "cnn2"], "model.arch_params": {"cnn2": {"width": 0.25}}})
    assert [row["arch"] for row in result.client_rows] == ["lenet5", "cnn2", "lenet5", "cnn2"]
    assert engine.ctx.store[0]["weights"].keys() != engine.ctx.store[1]["weights"].keys() or \
        engine.ctx.store[0]["weights"]["conv1.weight"].shape != engine.ctx.store[1]["weights"]["conv1.weight"].shape
    with pytest.raises(SpecError) as info:  # weight averaging needs one architecture
        run_tiny(**{**images, "algorithm.name": "fedavg", "model.clients": ["lenet5", "cnn2", "lenet5", "lenet5"]})
    assert info.value.path == "model.clients"
    with pytest.raises(SpecError) as info:  # lenet5 needs images; synthetic gives vectors
        run_tiny(**{"algorithm.name": "local", "model.pool": ["mlp", "lenet5"]})
    assert info.value.path == "model.pool[1]"


# -- corrupted_clients: which labels are flipped, how, and when ---------------------------------


def labels(ctx, client, split):
    return getattr(ctx.data.clients[client], f"{split}_y").clone()


def prepared_with(**params):
    return prepared(**corrupted(**params))[1]


def test_flip_mappings_by_hand():
    y = torch.tensor([0, 3, 9, 5])
    assert flip(y, 10, "reverse").tolist() == [9, 6, 0, 4]
    assert flip(y, 10, "shift").tolist() == [1, 4, 0, 6]
    assert flip(torch.tensor([0, 1, 2]), 3, "shift").tolist() == [1, 2, 0]


@pytest.mark.parametrize("mapping, expected", [("reverse", lambda y: 9 - y), ("shift", lambda y: (y + 1) % 10)])
def test_only_the_chosen_clients_labels_are_flipped_in_every_split(mapping, expected):
    _, clean = prepared()
    flipped = prepared_with(clients=[1, 3], mapping=mapping)
    for client in range(4):
        for split in ("train", "val", "test"):
            want = labels(clean, client, split)
            if client in (1, 3):
                want = expected(want)
            assert labels(flipped, client, split).tolist() == want.tolist(), (client, split)
            x = f"{split}_x"
            assert torch.equal(getattr(flipped.data.clients[client], x), getattr(clean.data.clients[client], x))


def test_by_default_client_0_is_reversed_in_every_split():
    """The paper's setting: "client 0 was assigned flipped labels"."""
    _, clean = prepared()
    flipped = prepared_with()
    assert CorruptedClientsParams() == CorruptedClientsParams(clients=[0], mapping="reverse",
                                                              splits=["train", "val", "test"])
    for client in range(4):
        for split in ("train", "val", "test"):
            want = labels(clean, client, split)
            assert labels(flipped, client, split).tolist() == (9 - want if client == 0 else want).tolist()


def test_splits_limits_the_flip_to_the_named_splits():
    _, clean = prepared()
    flipped = prepared_with(clients=[2], splits=["train", "test"])
    assert labels(flipped, 2, "train").tolist() == (9 - labels(clean, 2, "train")).tolist()
    assert labels(flipped, 2, "test").tolist() == (9 - labels(clean, 2, "test")).tolist()
    assert labels(flipped, 2, "val").tolist() == labels(clean, 2, "val").tolist()


def test_the_flip_is_deterministic_and_the_partition_is_unchanged():
    first, second = prepared_with(clients=[0]), prepared_with(clients=[0])
    _, clean = prepared()
    for client in range(4):
        for split in ("train", "val", "test"):
            assert labels(first, client, split).tolist() == labels(second, client, split).tolist()
            assert (first.data.clients[client].indices[split] == clean.data.clients[client].indices[split]).all()


def test_labels_are_flipped_before_any_other_plugins_setup_reads_them():
    seen = {}

    class Reader(Plugin):
        name = "reader"

        @hookimpl
        def setup(self, ctx):
            seen["labels"] = ctx.data.clients[0].train_y.tolist()

    client = SimpleNamespace(train_y=torch.tensor([0, 1, 2]), val_y=torch.tensor([2]), test_y=torch.tensor([1]))
    other = SimpleNamespace(train_y=torch.tensor([0, 0]), val_y=torch.tensor([0]), test_y=torch.tensor([0]))
    ctx = SimpleNamespace(data=SimpleNamespace(clients=[client, other]), num_classes=3)
    addon = CorruptedClients(CorruptedClientsParams(clients=[0]))
    make_plugin_manager([addon, Reader()]).hook.setup(ctx=ctx)
    assert seen["labels"] == [2, 1, 0]
    assert client.val_y.tolist() == [0] and client.test_y.tolist() == [1]
    assert other.train_y.tolist() == [0, 0]


@pytest.mark.parametrize("params, path", [({"clients": [-1]}, "addons[0].params.clients[0]"),
                                          ({"clients": [0, 4]}, "addons[0].params.clients[1]"),
                                          ({"splits": []}, "addons[0].params.splits"),
                                          ({"mapping": "random"}, "addons[0].params.mapping")])
def test_bad_add_on_parameters_name_their_key(params, path):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**corrupted(**params)))
    assert info.value.path == path


def test_bad_add_on_parameters_say_what_is_expected():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**corrupted(splits=["train", "training"])))
    assert info.value.message == "must be a non-empty list of train, val, test; got ['train', 'training']"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**corrupted(clients=[5])))
    assert info.value.message == "client 5 does not exist (4 clients)"
