"""Add-ons compose with any algorithm: corrupted clients, and plugins with heterogeneous models."""

import numpy as np
import pytest

from pfl_core.errors import SpecError
from pfl_core.engine import resolve
from tiny import run_tiny, tiny_raw

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
             y_train=rng.integers(0, 10, 200), x_test=np.zeros((0, 28, 28), np.uint8), y_test=np.zeros(0, np.int64))
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
