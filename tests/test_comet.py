"""COMET: k-means with a fixed K on the clients' soft predictions, cluster-mean targets, and
the client's co-distillation step (plain KL to the cluster mean, no regulariser). The round
order, bytes and budget it shares with COSMOS are tested in tests/test_cosmos.py."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.methods.codistill import predict
from pfl_core.runtime.context import load_state
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.comet import kmeans

SMALL = {"public.size": 60, "experiment.rounds": 1, "model.arch_params": {}, "algorithm.name": "comet"}


def test_kmeans_separates_obvious_groups():
    points = np.array([[0, 0], [0, 0.1], [5, 5], [5.1, 5]], dtype=float)
    labels = kmeans(points, 2, np.random.default_rng(0))
    assert labels[0] == labels[1] != labels[2] == labels[3]


@pytest.mark.parametrize("k,expected", [(1, 1), (2, 2), (3, 3), (4, 4), (9, 4)])
def test_kmeans_uses_exactly_k_clusters(k, expected):
    """K is fixed (not an outcome, as in COSMOS): two obvious groups still give K clusters."""
    points = np.array([[0, 0], [0, 0.1], [5, 5], [5.1, 5]], dtype=float)
    for seed in range(5):
        assert len(np.unique(kmeans(points, k, np.random.default_rng(seed)))) == expected


def test_kmeans_lloyd_moves_centres_to_the_means():
    # k-means++ may start from two points of the left group; Lloyd must still split the groups
    points = np.array([[0.0], [0.2], [0.4], [10.0], [10.2]])
    for seed in range(10):
        labels = kmeans(points, 2, np.random.default_rng(seed))
        assert len(set(labels[:3])) == 1 and len(set(labels[3:])) == 1 and labels[0] != labels[3]


def test_server_targets_are_the_plain_means_of_each_k_means_cluster():
    _, engine = run_tiny(**SMALL, **{"algorithm.params": {"num_clusters": 2, "pretrain_epochs": 0}})
    ctx = engine.ctx
    g = torch.Generator().manual_seed(0)
    shape = (len(ctx.data.public.x), ctx.num_classes)
    a, b = torch.softmax(5 * torch.randn(shape, generator=g), 1), torch.softmax(5 * torch.randn(shape, generator=g), 1)
    near = lambda p: 0.9 * p + 0.1 * torch.softmax(torch.randn(shape, generator=g), 1)  # noqa: E731
    preds = {0: near(a), 1: near(b), 2: near(a), 3: near(b)}
    uploads = ((i, {"soft_labels": p}) for i, p in preds.items())
    ctx.round_metrics = {}
    ctx.hooks.server_aggregate(ctx=ctx, uploads=uploads, weights={0: 0.7, 1: 0.1, 2: 0.1, 3: 0.1})
    targets = ctx.server["targets"]
    assert torch.allclose(targets[0], (preds[0] + preds[2]) / 2) and torch.equal(targets[0], targets[2])
    assert torch.allclose(targets[1], (preds[1] + preds[3]) / 2) and torch.equal(targets[1], targets[3])
    assert ctx.round_metrics["num_clusters"] == 2


def test_one_cluster_target_is_the_mean_of_what_the_clients_sent():
    result, engine = run_tiny(**{**SMALL, "experiment.rounds": 2,
                                 "algorithm.params": {"num_clusters": 1, "pretrain_epochs": 1}})
    ctx = engine.ctx
    targets = ctx.server["targets"]
    assert all(targets[0] is targets[i] for i in range(4))  # one cluster: one shared mean
    # The mean of what each client sent: its stored model's predictions on U.
    sent = []
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""]
        sent.append(predict(model, ctx.data.public.x, 1.0))
    assert torch.allclose(targets[0], torch.stack(sent).mean(dim=0), atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_client_step_is_plain_kl_from_the_cluster_mean(temperature):
    """One distillation epoch in one batch (|U| = 60 < distill_batch_size): the step of
    mean_x KL(target(x) || softmax(f_i(x) / T)) from the client's stored weights."""
    _, engine = run_tiny(**SMALL, **{"algorithm.params": {"num_clusters": 1, "pretrain_epochs": 1,
                                                          "temperature": temperature}})
    ctx = engine.ctx
    u = ctx.data.public.x
    target = torch.softmax(torch.randn(len(u), ctx.num_classes, generator=torch.Generator().manual_seed(1)), 1)
    client = ctx.client(2)
    expected = copy.deepcopy(load_state(ctx.models.build("mlp"), client.state["weights"]))
    log_q = F.log_softmax(expected(u) / temperature, dim=1)
    (target * (target.log() - log_q)).sum(dim=1).mean().backward()
    with torch.no_grad():
        for p in expected.parameters():
            p -= ctx.spec.training.lr * p.grad
    ctx.hooks.on_receive(ctx=ctx, client=client, message={"targets": target})
    for got, want in zip(client.model.parameters(), expected.parameters()):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("params,path", [
    ({"num_clusters": 0}, "algorithm.params.num_clusters"),
    ({"kmeans_iterations": 0}, "algorithm.params.kmeans_iterations"),
    ({"label_dtype": "int8"}, "algorithm.params.label_dtype"),
])
def test_bad_comet_params_name_their_key(params, path):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "comet", "public.size": 60, "algorithm.params": params}))
    assert info.value.path == path


def test_kmeans_ends_at_a_fixed_point_of_lloyds_step():
    """Every point is labelled with its nearest cluster mean (after several updates, not one:
    on 0..19 the seeded first centres are rarely the final split)."""
    points = np.arange(20.0)[:, None]
    for seed in range(20):
        labels = kmeans(points, 2, np.random.default_rng(seed))
        means = np.stack([points[labels == j].mean(axis=0) for j in np.unique(labels)])
        nearest = np.unique(labels)[((points[:, None, :] - means[None]) ** 2).sum(axis=2).argmin(axis=1)]
        assert np.array_equal(labels, nearest), seed
