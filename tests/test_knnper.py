"""kNN-Per (plugins/knnper): the kNN model (K2) and the choice of lambda (K4) by hand, Eq. 7
recomputed independently from a client's own training embeddings, no other client's data in
it, lambda chosen on the validation split, the datastore's capacity, training that is FedAvg's
bit for bit, newcomers scored without training, bad input, lost uploads, the process executor
and a killed run's resume."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_same, dry_run_error, prepared, recorded_training, refused_at_key
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models, score
from pfl_plugins.knnper import KNNMixture, KNNPer, KNNPerParams, as_logits, knn_probabilities, select_lambda

SKEWED = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}
HIDDEN = 8
BASE = {"algorithm.name": "knnper", "model.params.hidden": [HIDDEN], **SKEWED}
# every client mixes samples of 8 synthetic devices that label by different rules: neither model
# is right everywhere, and the clients choose different lambdas
MIXED = {"data.params.num_devices": 8, "partition.scheme": "iid", "partition.params": {}}


# -- (K2), Eq. 7 and (K4) by hand -------------------------------------------------------------------


def test_the_knn_model_by_hand():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 2])
    query = torch.zeros(1, 2)
    # squared distances 0, 1, 4, 9; k = 3 keeps the first three: weights e^0, e^-1, e^-4 over their sum
    s = 1 + math.exp(-1) + math.exp(-4)
    p = knn_probabilities(query, keys, labels, 3, k=3, temperature=1.0)
    assert torch.allclose(p, torch.tensor([[1 / s, (math.exp(-1) + math.exp(-4)) / s, 0.0]]))
    # T = 2 halves every exponent
    s = 1 + math.exp(-0.5) + math.exp(-2)
    p = knn_probabilities(query, keys, labels, 3, k=3, temperature=2.0)
    assert torch.allclose(p, torch.tensor([[1 / s, (math.exp(-0.5) + math.exp(-2)) / s, 0.0]]))
    # k beyond the datastore: every entry
    s = 1 + math.exp(-1) + math.exp(-4) + math.exp(-9)
    p = knn_probabilities(query, keys, labels, 3, k=10, temperature=1.0)
    assert torch.allclose(p, torch.tensor([[1 / s, (math.exp(-1) + math.exp(-4)) / s, math.exp(-9) / s]]))
    # far neighbours: no 0 / 0 (the softmax is shifted), the nearest one dominates
    p = knn_probabilities(torch.tensor([[1000.0, 0.0]]), keys, labels, 3, k=4, temperature=1.0)
    assert torch.isfinite(p).all() and p[0, 2] == pytest.approx(1.0)


def test_neighbours_at_equal_distance_are_taken_in_datastore_order():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([2, 0, 1])
    query = torch.zeros(1, 2)
    assert torch.equal(knn_probabilities(query, keys, labels, 3, k=1, temperature=1.0), torch.tensor([[0.0, 0.0, 1.0]]))
    assert torch.allclose(knn_probabilities(query, keys, labels, 3, k=2, temperature=1.0),
                          torch.tensor([[0.5, 0.0, 0.5]]))
    # the nearest first, then the ties in datastore order (not, as topk does here, the last ones)
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.5, 0.5], [0.0, -1.0]])  # d^2 1, 1, 1, 0.5, 1
    s = math.exp(-0.5) + 2 * math.exp(-1)
    p = knn_probabilities(query, keys, torch.tensor([0, 1, 2, 0, 2]), 3, k=3, temperature=1.0)
    assert torch.allclose(p, torch.tensor([[(math.exp(-0.5) + math.exp(-1)) / s, math.exp(-1) / s, 0.0]]))
    # a large datastore of equal keys (where an unstable sort reorders them): still the first ones
    labels = torch.zeros(5000, dtype=torch.long)
    labels[0], labels[1] = 2, 1
    p = knn_probabilities(query, torch.zeros(5000, 2), labels, 3, k=2, temperature=1.0)
    assert torch.allclose(p, torch.tensor([[0.0, 0.5, 0.5]]))


def test_eq7_is_scored_as_log_probabilities():
    h = torch.tensor([[0.7, 0.3, 0.0]])
    logits = as_logits(h)
    assert torch.allclose(torch.softmax(logits, dim=1), h)
    assert F.cross_entropy(logits, torch.tensor([0])).item() == pytest.approx(-math.log(0.7), abs=1e-6)
    assert math.isfinite(F.cross_entropy(logits, torch.tensor([2])).item())  # h_y = 0: a large, finite loss


def test_lambda_is_chosen_by_validation_accuracy_then_cross_entropy_then_the_smaller_lambda():
    # three samples the kNN model gets right and the global model wrong at lambda <= 1/6, one the kNN
    # model gets wrong, right while 0.9 (1 - lambda) > 0.5, i.e. lambda < 4/9: every sample right
    # for lambda in (1/6, 4/9): 0.2, 0.3, 0.4 on a grid of tenths
    p_knn = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    p_global = torch.tensor([[0.4, 0.6], [0.4, 0.6], [0.4, 0.6], [0.1, 0.9]])
    y = torch.tensor([0, 0, 1, 1])

    def nll(lam):  # -2 log(0.4 + 0.6 lam) - log(0.6 + 0.4 lam) - log(0.9 (1 - lam))
        return -2 * math.log(0.4 + 0.6 * lam) - math.log(0.6 + 0.4 * lam) - math.log(0.9 * (1 - lam))

    assert nll(0.4) < nll(0.3) < nll(0.2)  # among the accurate ones 0.4 has the lowest loss ...
    assert nll(0.5) < nll(0.4)  # ... but 0.5 (3 of 4 right) has a lower one still: accuracy comes first
    assert select_lambda(p_knn, p_global, y, steps=10) == pytest.approx(0.4)
    # every lambda ties (both models the same, right): the smallest, the global model's
    same = torch.tensor([[1.0, 0.0]])
    assert select_lambda(same, same, torch.tensor([0]), steps=10) == 0.0
    # the kNN model alone is best: lambda = 1 is reachable
    assert select_lambda(p_knn[:3], p_global[:3], y[:3], steps=4) == 1.0


# -- in a run: Eq. 7 recomputed independently ----------------------------------------------------


def embed(state, x):
    """The mlp's classifier input relu(fc1 x) and its logits, from its weights (not the run's module)."""
    z = F.relu(x.flatten(1) @ state["fc1.weight"].T + state["fc1.bias"])
    return z, z @ state["fc2.weight"].T + state["fc2.bias"]


def by_hand(state, train_x, train_y, x, k, scale, lam, num_classes):
    """Eq. 7 for the rows of x, written out: exp(-d^2 / T) over the k nearest, T = scale * D."""
    keys, _ = embed(state, train_x)
    queries, logits = embed(state, x)
    d2 = ((queries[:, None, :] - keys[None, :, :]) ** 2).sum(-1)
    nearest = d2.argsort(dim=1, stable=True)[:, :k]
    weights = torch.exp(-(d2.gather(1, nearest) - d2.gather(1, nearest[:, :1])) / (scale * keys.shape[1]))
    weights = weights / weights.sum(1, keepdim=True)
    p_knn = torch.zeros(len(x), num_classes)
    for row in range(len(x)):
        for j in range(nearest.shape[1]):
            p_knn[row, train_y[nearest[row, j]]] += weights[row, j]
    return lam * p_knn + (1 - lam) * torch.softmax(logits, dim=1)


def trained(**overrides):
    engine, ctx = prepared(**{**BASE, **overrides})
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    return engine, ctx


def test_each_clients_model_is_eq7_with_its_own_datastore_and_the_global_model():
    _, ctx = trained(**{"algorithm.params.lam": 0.3, "algorithm.params.k": 3, "algorithm.params.scale": 0.5})
    glob = ctx.server["global"]
    for i in range(4):
        data = ctx.data.clients[i]
        models = evaluated_models(ctx, ctx.client(i))
        assert list(models) == ["", "global_"]
        assert_same(models["global_"].state_dict(), glob)
        expected = by_hand(glob, data.train_x, data.train_y, data.test_x, 3, 0.5, 0.3, ctx.num_classes)
        with torch.no_grad():
            got = torch.softmax(models[""](data.test_x), dim=1)
        assert torch.allclose(got, expected, atol=1e-5), i
        p_global = torch.softmax(embed(glob, data.test_x)[1], dim=1)
        assert (expected - p_global).abs().max() > 1e-2  # the kNN part is not negligible here


def test_no_other_clients_data_enters_a_clients_model():
    _, ctx = trained(**{"algorithm.params.lam": 0.5})
    x0 = ctx.data.clients[0].test_x

    def outputs():
        with torch.no_grad():
            return evaluated_models(ctx, ctx.client(0))[""](x0).clone()

    before = outputs()
    for i in (1, 2, 3):  # every other client's labels shifted: client 0's predictions do not move
        data = ctx.data.clients[i]
        data.train_y = (data.train_y + 1) % ctx.num_classes
    assert torch.equal(outputs(), before)
    own = ctx.data.clients[0]
    own.train_y = (own.train_y + 1) % ctx.num_classes  # its own labels shifted: they do
    assert (outputs() - before).abs().max() > 1e-2


def test_lambda_val_is_each_clients_best_on_its_validation_split():
    engine, ctx = trained(**MIXED, **{"algorithm.params.lam_steps": 20, "algorithm.params.k": 5})
    chosen = {}
    for i in range(4):
        data = ctx.data.clients[i]
        glob = ctx.server["global"]
        p_knn = by_hand(glob, data.train_x, data.train_y, data.val_x, 5, 1.0, 1.0, ctx.num_classes)
        p_global = by_hand(glob, data.train_x, data.train_y, data.val_x, 5, 1.0, 0.0, ctx.num_classes)
        candidates = []
        for step in range(21):
            mixed = step / 20 * p_knn + (1 - step / 20) * p_global
            accuracy = int((mixed.argmax(1) == data.val_y).sum())
            loss = -float(mixed[torch.arange(len(data.val_y)), data.val_y].clamp_min(1e-38).log().sum())
            candidates.append((-accuracy, loss, step / 20))
        chosen[i] = min(candidates)[2]
        model = evaluated_models(ctx, ctx.client(i))[""]
        assert model.lam == pytest.approx(chosen[i]), i
    logged = [row for row in ctx.client_series if row["name"] == "knn_lam"]
    assert {row["client"]: row["value"] for row in logged[-4:]} == pytest.approx(chosen)
    assert len(set(chosen.values())) > 1, chosen  # the choice is per client


def test_a_client_without_validation_samples_keeps_the_global_model():
    _, ctx = trained()
    data = ctx.data.clients[2]
    data.val_x, data.val_y = data.val_x[:0], data.val_y[:0]
    assert evaluated_models(ctx, ctx.client(2))[""].lam == 0.0


def test_lambda_val_needs_a_validation_split_and_a_fixed_lambda_does_not():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"partition.val_fraction": 0.0}))
    assert info.value.path == "algorithm.params.lam" and "partition.val_fraction = 0" in info.value.message
    resolve(tiny_raw(**BASE, **{"partition.val_fraction": 0.0, "algorithm.params.lam": 0.5}))


def test_the_datastore_holds_at_most_capacity_training_samples_a_seeded_subset():
    _, ctx = trained(**{"algorithm.params.capacity": 7})
    client = ctx.client(1)
    plugin = KNNPer(KNNPerParams(capacity=7))
    model = evaluated_models(ctx, client)["global_"]
    keys, labels = plugin.datastore(ctx, client, model)
    every_key, every_label = KNNPer(KNNPerParams()).datastore(ctx, client, model)
    assert keys.shape == (7, HIDDEN) and len(every_key) == client.num_train > 7
    rows = {tuple(r.tolist()): int(l) for r, l in zip(every_key, every_label)}
    assert all(rows[tuple(r.tolist())] == int(l) for r, l in zip(keys, labels))  # training samples, own labels
    again, _ = plugin.datastore(ctx, ctx.client(1), model)
    assert torch.equal(again, keys)
    assert not torch.equal(keys, every_key[:7])  # drawn, not the first 7
    large, _ = KNNPer(KNNPerParams(capacity=client.num_train)).datastore(ctx, client, model)
    assert torch.equal(large, every_key)


def test_training_and_bytes_are_fedavgs_bit_for_bit():
    _, knn = run_tiny(**BASE)
    _, avg = run_tiny(**{**BASE, "algorithm.name": "fedavg"})
    assert_same(knn.ctx.server["global"], avg.ctx.server["global"])
    assert (knn.ctx.comm_up, knn.ctx.comm_down) == (avg.ctx.comm_up, avg.ctx.comm_down)


def test_a_newcomer_is_scored_with_its_own_datastore_without_training(monkeypatch):
    engine, ctx = trained(**{"experiment.coldstart_clients": 1, "algorithm.params.lam": 0.5})
    (newcomer,) = ctx.coldstart_clients
    data = ctx.data.clients[newcomer]
    with recorded_training(monkeypatch) as calls:
        models = ctx.hooks.coldstart_personalize(ctx=ctx, client=ctx.client(newcomer),
                                                 message=ctx.broadcast(newcomer))
    assert calls == []
    assert_same(models["global_"].state_dict(), ctx.server["global"])
    expected = by_hand(ctx.server["global"], data.train_x, data.train_y, data.test_x, 10, 1.0, 0.5, ctx.num_classes)
    with torch.no_grad():
        assert torch.allclose(torch.softmax(models[""](data.test_x), dim=1), expected, atol=1e-5)


def test_under_concept_shift_the_newcomers_datastore_beats_the_global_model():
    # tiny's synthetic devices label by different rules: the held-out one is lost on the global model
    result, _ = run_tiny(**{"algorithm.name": "knnper", "experiment.coldstart_clients": 1})
    assert result.final["coldstart_global_acc_mean"] < 0.5 < result.final["coldstart_acc_mean"]


def test_with_lost_uploads_the_run_keeps_no_client_state():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 4,
                                         "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert all(engine.ctx.store[i] == {} for i in range(4))


def test_the_datastore_the_choice_of_lambda_and_the_scoring_leave_the_batch_statistics_alone():
    _, ctx = trained(**{"model.params.norm": "batch"})
    working = ctx.models.working("mlp")
    working.eval()
    lam = evaluated_models(ctx, ctx.client(0))[""].lam
    working.train()  # as training leaves it
    models = evaluated_models(ctx, ctx.client(0))
    assert_same(models["global_"].state_dict(), ctx.server["global"])  # running statistics untouched
    mixture = models[""]
    assert isinstance(mixture, KNNMixture) and mixture.lam == lam
    data = ctx.data.clients[0]
    first = score(mixture, data.test_x, data.test_y)
    assert mixture.training and mixture.model.training  # the mode is restored
    assert score(mixture, data.test_x, data.test_y) == first
    assert_same(mixture.model.state_dict(), ctx.server["global"])


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("lam", 1.5), ("lam", -0.1), ("lam", "validation"), ("lam", True),
                                       ("lam", float("nan")), ("k", 0), ("scale", 0.0), ("scale", float("inf")),
                                       ("capacity", -1), ("lam_steps", 0), ("k", 2.5)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.lam": 2}))
    assert line.startswith("pfl-run: error: algorithm.params.lam") and '"val"' in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "knnper averages weights" in info.value.message


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads_and_a_newcomer():
    overrides = {**SKEWED, "model.params.hidden": [HIDDEN], "experiment.coldstart_clients": 1,
                 "algorithm.params": {"capacity": 30}, "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    seq_engine, pool_engine = assert_pool_matches_sequential("knnper", rounds=3, **overrides)
    assert seq_engine.ctx.client_series == pool_engine.ctx.client_series  # the lambdas chosen


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5, "algorithm.params.capacity": 30}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_with_lost_uploads_a_newcomer_and_a_capacity():
    """executor.device = "cuda": the datastore, the distances, the scatter of (K2), the choice of
    lambda on the validation split and Eq. 7 all meet CUDA tensors."""
    check_on_device("cuda")


def check_on_device(device):
    overrides = {**MIXED, "algorithm.name": "knnper", "model.params.hidden": [HIDDEN], "executor.device": device,
                 "experiment.coldstart_clients": 1, "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    ctx = engine.ctx
    assert all(t.device.type == device for t in ctx.server["global"].values())
    assert all(math.isfinite(result.final[k]) for k in ("acc_mean", "global_acc_mean", "coldstart_acc_mean"))
    _, avg = run_tiny(**{**overrides, "algorithm.name": "fedavg"})
    assert_same(ctx.server["global"], avg.ctx.server["global"])  # FedAvg's training on the device too
    glob = {k: v.cpu() for k, v in ctx.server["global"].items()}
    lams = set()
    for i in ctx.training_clients:
        mixture = evaluated_models(ctx, ctx.client(i))[""]
        data = ctx.data.clients[i]
        assert mixture.keys.device.type == device
        lams.add(mixture.lam)
        with torch.no_grad():
            got = torch.softmax(mixture(data.test_x), dim=1).cpu()
        expected = by_hand(glob, data.train_x.cpu(), data.train_y.cpu(), data.test_x.cpu(), 10, 1.0, mixture.lam,
                           ctx.num_classes)
        assert torch.allclose(got, expected, atol=1e-4), i
    assert len(lams) > 1  # chosen per client on the device's validation outputs
    keys, labels = KNNPer(KNNPerParams(capacity=30)).datastore(ctx, ctx.client(0), mixture.model)
    assert keys.shape == (30, HIDDEN) and keys.device.type == labels.device.type == device


def test_the_device_check_holds_on_the_cpu():
    check_on_device("cpu")
