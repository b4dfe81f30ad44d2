"""COSMOS and COMET: clustering, distances, targets, heterogeneous clients, bad input, the
paper's CIFAR-100 spec through pfl-run on a fake CIFAR-100 directory."""

from pathlib import Path

import numpy as np
import pytest
import torch

from pfl_core.cli import run_main
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from plugins.codistill import mean_l1_distances, predict
from plugins.comet import kmeans
from plugins.cosmos import auto_clusters, greedy_clusters
from tiny import run_tiny, tiny_raw

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"public.size": 60, "experiment.rounds": 2, "model.arch_params": {},
         "algorithm.params": {"server_arch": "mlp", "pretrain_epochs": 1, "server_epochs": 1}}


def test_greedy_clustering_on_a_hand_made_distance_matrix():
    d = np.array([
        [0.0, 0.1, 0.2, 1.5, 1.6],
        [0.1, 0.0, 0.9, 1.5, 1.6],
        [0.2, 0.9, 0.0, 1.4, 1.5],
        [1.5, 1.5, 1.4, 0.0, 0.3],
        [1.6, 1.6, 1.5, 0.3, 0.0],
    ])
    # B0 = 0.25: client 0 has two neighbours (1, 2) -> {0, 1, 2}; then {3}? 3 and 4 are 0.3 apart.
    assert greedy_clusters(d, 0.25) == [[0, 1, 2], [3], [4]]
    assert greedy_clusters(d, 0.3) == [[0, 1, 2], [3, 4]]
    assert greedy_clusters(d, 0.05) == [[0], [1], [2], [3], [4]]
    assert greedy_clusters(d, 2.0) == [[0, 1, 2, 3, 4]]


def test_greedy_ties_go_to_the_lowest_index():
    d = np.array([[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]], dtype=float) * 0.5
    d[0, 1] = d[1, 0] = d[2, 3] = d[3, 2] = 0.1  # two equal pairs
    assert greedy_clusters(d, 0.1) == [[0, 1], [2, 3]]


def test_auto_b0_grows_until_at_most_max_clusters():
    d = np.array([[0, 0.1, 1.0], [0.1, 0, 1.0], [1.0, 1.0, 0]])
    assert auto_clusters(d, 3) == (0.0, [[0], [1], [2]])
    assert auto_clusters(d, 2) == (0.1, [[0, 1], [2]])
    assert auto_clusters(d, 1) == (1.0, [[0, 1, 2]])


def test_distance_is_the_mean_l1_over_u():
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # 2 clients, |U| = 2
    d = mean_l1_distances(p)
    assert d[0, 1] == pytest.approx((2.0 + 0.0) / 2) and d[1, 0] == d[0, 1] and d[0, 0] == 0
    doubled = mean_l1_distances(torch.cat([p, p], dim=1))  # |U| doubled: same distance
    assert torch.allclose(d, doubled)


def test_cluster_targets_are_member_means():
    comet = {**SMALL, "algorithm.name": "comet", "algorithm.params": {"num_clusters": 1, "pretrain_epochs": 1}}
    result, engine = run_tiny(**comet)
    ctx = engine.ctx
    targets = ctx.server["targets"]
    assert all(targets[0] is targets[i] for i in range(4))  # one cluster: one shared mean
    # The mean of what each client sent: its stored model's predictions on U.
    sent = []
    for i in range(4):
        model = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i))[""]
        sent.append(predict(model, ctx.data.public.x, 1.0))
    assert torch.allclose(targets[0], torch.stack(sent).mean(dim=0), atol=1e-6)


def test_kmeans_separates_obvious_groups():
    points = np.array([[0, 0], [0, 0.1], [5, 5], [5.1, 5]], dtype=float)
    labels = kmeans(points, 2, np.random.default_rng(0))
    assert labels[0] == labels[1] != labels[2] == labels[3]


def test_cosmos_runs_and_reports_client_and_server_accuracy():
    result, engine = run_tiny(**SMALL, **{"algorithm.name": "cosmos"})
    assert {"acc_mean", "server_acc_mean", "num_clusters"} <= set(result.final)
    ctx = engine.ctx
    assert sorted(i for c in ctx.server["clusters"] for i in c) == [0, 1, 2, 3]
    soft = 60 * 10 * 4  # |U| x C float32 per client per round
    assert result.final["comm_up_bytes"] == 2 * 4 * soft and result.final["comm_down_bytes"] == 1 * 4 * soft
    half, _ = run_tiny(**{**SMALL, "algorithm.name": "cosmos",
                          "algorithm.params": {**SMALL["algorithm.params"], "label_dtype": "float16"}})
    assert half.final["comm_up_bytes"] == result.final["comm_up_bytes"] / 2


def test_cosmos_with_four_client_architectures(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    y = np.repeat(np.arange(4), 40)
    np.savez(path, x_train=rng.integers(0, 256, (160, 32, 32, 3), dtype=np.uint8), y_train=y,
             x_test=np.zeros((0, 32, 32, 3), np.uint8), y_test=np.zeros(0, np.int64))
    result, engine = run_tiny(**{
        "data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
        "public.size": 32, "experiment.rounds": 1, "model.name": "lenet5", "model.params": {},
        "model.clients": ["lenet5", "cnn4", "mlp", "squeezenet"], "algorithm.name": "cosmos",
        "algorithm.params": {"server_arch": "cnn4", "pretrain_epochs": 1, "server_epochs": 1, "num_augment": 1},
        "model.arch_params": {"mlp": {"hidden": [8]}, "cnn4": {"width": 0.25}},
        "training.batch_size": 16,
    })
    assert [r["arch"] for r in result.client_rows] == ["lenet5", "cnn4", "mlp", "squeezenet"]
    assert "server_acc_mean" in result.final


@pytest.mark.parametrize("params,path", [
    ({"b0": 0}, "algorithm.params.b0"),
    ({"b0": -0.5}, "algorithm.params.b0"),
    ({"b0": "big"}, "algorithm.params.b0"),
    ({"max_clusters": 0}, "algorithm.params.max_clusters"),
    ({"server_arch": "vgg61"}, "algorithm.params.server_arch"),
])
def test_bad_cosmos_params_name_their_key(params, path):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "algorithm.params": params}))
    assert info.value.path == path


def test_cosmos_needs_a_public_set_and_matching_client_architectures():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos"}))
    assert info.value.path == "public"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "model.clients": ["mlp"] * 3}))
    assert info.value.path == "model.clients"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "model.pool": ["mlp", "alexnett"]}))
    assert info.value.path == "model.pool[1]"


def test_cifar100_spec_offline_without_files_stops_with_one_line(tmp_path, capsys):
    code = run_main([str(ROOT / "specs/cosmos_cifar100.toml"), "--set", f'data.params.root="{tmp_path}"',
                     "--set", "data.params.download=false", "--no-tracking"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(tmp_path) in err[0] and "Traceback" not in err[0]


def test_cifar100_spec_runs_through_pfl_run_on_fake_files(tmp_path, capsys):
    from fakes import torchvision_md5_bypass, write_fake_cifar100

    write_fake_cifar100(tmp_path, n_train=500, n_test=10, seed=0)
    shrink = [f'data.params.root="{tmp_path}"', "data.params.download=false", "partition.num_clients=4",
              "partition.params.groups=2", "partition.min_samples=5", "experiment.rounds=1", "public.fraction=0.1",
              "algorithm.params.server_arch=lenet5", "algorithm.params.pretrain_epochs=1",
              "algorithm.params.server_epochs=1", "algorithm.params.num_augment=1",
              'model.pool=["lenet5", "cnn4"]', "executor.device=cpu"]
    with torchvision_md5_bypass():
        code = run_main([str(ROOT / "specs/cosmos_cifar100.toml"), "--no-tracking", "--quiet",
                         *[arg for item in shrink for arg in ("--set", item)]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "server_acc" in out and out.count("lenet5") >= 2
