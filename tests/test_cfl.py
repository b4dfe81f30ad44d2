"""CFL (plugins/cfl): the bipartition (complete linkage, and Alg. 1's optimal one against brute
force), the split criterion on hand-made updates at its thresholds, the weights within a
cluster, a second-level split regrouping client ids (not positions), the warm-up's round, the
flipped-label federation split along the flip, training and evaluation on the client's cluster
model, FedAvg bit for bit before a split, lost uploads, cold start, the process executor and a
killed-and-resumed run."""

import itertools
import os

import numpy as np
import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import dry_run_error, prepared, recorded_training, refused_at_key
from test_checkpoint import (
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.cfl import bipartition, cosine_similarities, max_cross_similarity, within_cluster
from pfl_plugins.faults import upload_is_lost

assert empty_store and same_code_all_along  # fixtures used by the resume test (imported, not called)

# Six clients drawing i.i.d. from one synthetic device; clients 0-2 have their labels reversed, so
# the federation holds two conflicting tasks (the authors' notebook rotates half of its clients' images).
FLIPPED = {"algorithm.name": "cfl", "data.params.num_devices": 1, "data.params.samples_per_device": 720,
           "partition.scheme": "iid", "partition.num_clients": 6,
           "addons": [{"name": "corrupted_clients", "params": {"clients": [0, 1, 2]}}]}
ALWAYS = {"warmup_rounds": 0, "eps1": 1e9, "eps2": 0.0}  # every cluster of >= min_split_size splits


def flipped(**params):
    return {**FLIPPED, "algorithm.params": {**ALWAYS, **params}}


# -- the bipartition -------------------------------------------------------------------------------


def line_similarities(x):
    """alpha = 1 - |x_i - x_j| for points on a line: the dissimilarity 1 - alpha is their distance."""
    x = np.asarray(x, dtype=float)
    return 1.0 - np.abs(x[:, None] - x[None, :])


def test_complete_linkage_and_the_optimal_bipartition_by_hand():
    # points 0, 1, 2.2, 3.5 (gaps 1, 1.2, 1.3). Complete linkage merges {0, 1} at 1, then {2.2, 3.5}
    # at 1.3 (< 2.2, the diameter of {0, 1, 2.2}): parts {0, 1} | {2.2, 3.5}, closest cross pair 1.2 apart.
    # Alg. 1 maximises the closest cross pair's distance: cut the widest gap, {0, 1, 2.2} | {3.5} at 1.3.
    similarities = line_similarities([0.0, 1.0, 2.2, 3.5])
    assert bipartition(similarities, "complete") == ([0, 1], [2, 3])
    assert bipartition(similarities, "optimal") == ([0, 1, 2], [3])
    assert max_cross_similarity(similarities, [0, 1, 2], [3]) == pytest.approx(1 - 1.3)
    assert max_cross_similarity(similarities, [0, 1], [2, 3]) == pytest.approx(1 - 1.2)
    # the part holding position 0 comes first, whatever the order of the tree's children
    assert bipartition(line_similarities([3.5, 2.2, 1.0, 0.0]), "optimal") == ([0], [1, 2, 3])


def smallest_cross_dissimilarity(similarities, first, second):
    return 1.0 - max_cross_similarity(similarities, first, second)


@pytest.mark.parametrize("seed", range(5))
def test_the_optimal_bipartition_is_the_best_of_all_bipartitions(seed):
    updates = torch.as_tensor(np.random.default_rng(seed).normal(size=(7, 5)))
    similarities = cosine_similarities(updates)
    best = max(smallest_cross_dissimilarity(similarities, list(first), [j for j in range(7) if j not in first])
               for size in range(1, 7) for first in itertools.combinations(range(7), size))
    first, second = bipartition(similarities, "optimal")
    assert sorted(first + second) == list(range(7)) and first and second
    assert smallest_cross_dissimilarity(similarities, first, second) == pytest.approx(best)
    first, second = bipartition(similarities, "complete")
    assert smallest_cross_dissimilarity(similarities, first, second) <= best + 1e-12


def test_cosine_similarities_by_hand():
    updates = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    expected = np.array([[1, 0, -1, 0.6, 0], [0, 1, 0, 0.8, 0], [-1, 0, 1, -0.6, 0], [0.6, 0.8, -0.6, 1, 0],
                         [0, 0, 0, 0, 0]])  # a zero update is similar to nothing
    assert np.allclose(cosine_similarities(updates), expected)


def test_weights_within_a_cluster_by_hand():
    weights = {0: 0.1, 1: 0.3, 2: 0.6}
    assert within_cluster(weights, [1, 2], uniform=False) == pytest.approx({1: 1 / 3, 2: 2 / 3})
    assert within_cluster(weights, [0, 1, 2], uniform=True) == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})


# -- the server's round on hand-made updates -------------------------------------------------------

WEIGHTS = {0: 0.1, 1: 0.2, 2: 0.2, 3: 0.15, 4: 0.15, 5: 0.2}


def direction_like(state):
    """D: one fixed random direction with the shapes of ``state``."""
    return {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in state.items()}


def hand_round(coefficients, weights=WEIGHTS, clusters=None, **params):
    """One ``server_aggregate`` on uploads theta_i = theta_c + c_i D (D one fixed direction over
    the parameters), at round 1: (ctx, theta_c, D)."""
    _, ctx = prepared(**{**FLIPPED, "algorithm.params": {"warmup_rounds": 0, **params}})
    reference = ctx.server["cluster_models"][0]
    if clusters is not None:
        ctx.server["clusters"] = clusters
        ctx.server["cluster_models"] = [reference] * len(clusters)
    direction = direction_like(reference)
    uploads = [(i, {"weights": {k: reference[k] + c * direction[k] for k in reference}})
               for i, c in coefficients.items()]
    ctx.round = 1
    ctx.hooks.server_aggregate(ctx=ctx, uploads=iter(uploads), weights=weights)
    return ctx, reference, direction


def norm_of(state):
    return float(torch.cat([v.reshape(-1).double() for v in state.values()]).norm())


TWO_TASKS = {0: 2.0, 1: 1.0, 2: 1.0, 3: -1.0, 4: -1.0, 5: -1.0}
# weighted mean update: (0.1 x 2 + 0.2 + 0.2 - 0.15 - 0.15 - 0.2) D = 0.1 D; the largest: 2 |D|;
# uniform mean: (2 + 1 + 1 - 3) / 6 D = D / 6


@pytest.mark.parametrize("eps1_factor,eps2_factor,splits", [
    (0.101, 1.99, True), (0.099, 1.99, False),  # the mean update must be below eps1 ...
    (0.101, 2.01, False),                        # ... and the largest update above eps2
])
def test_a_cluster_splits_only_when_its_mean_update_is_small_and_its_largest_large(eps1_factor, eps2_factor, splits):
    D = norm_of(direction_like(prepared(**FLIPPED)[1].server["cluster_models"][0]))
    ctx, *_ = hand_round(TWO_TASKS, eps1=eps1_factor * D, eps2=eps2_factor * D)
    assert ctx.server["clusters"] == ([[0, 1, 2], [3, 4, 5]] if splits else [[0, 1, 2, 3, 4, 5]])
    assert ctx.round_metrics["cfl_splits"] == float(splits)
    assert ctx.round_metrics["num_clusters"] == 1.0 + splits
    logged = {(row["client"], row["name"]): row["value"] for row in ctx.client_series}
    assert logged[(0, "cfl_update_norm")] == pytest.approx(2 * D) and logged[(3, "cfl_update_norm")] == pytest.approx(D)
    assert logged[(5, "cfl_mean_update_norm")] == pytest.approx(0.1 * D)


def test_the_weighting_decides_the_mean_update():
    D = norm_of(direction_like(prepared(**FLIPPED)[1].server["cluster_models"][0]))
    # 0.1 D (samples) < 0.12 D < D / 6 (uniform)
    assert len(hand_round(TWO_TASKS, eps1=0.12 * D, eps2=0.0)[0].server["clusters"]) == 2
    assert len(hand_round(TWO_TASKS, eps1=0.12 * D, eps2=0.0, weighting="uniform")[0].server["clusters"]) == 1


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_each_part_starts_from_the_parent_plus_its_own_members_mean_update(weighting):
    ctx, reference, D = hand_round(TWO_TASKS, eps1=1e9, eps2=0.0, weighting=weighting)
    first, second = ctx.server["cluster_models"]
    # samples: {0, 1, 2} weigh (0.2, 0.4, 0.4) -> (0.4 + 0.4 + 0.4) D = 1.2 D; {3, 4, 5}: -D
    # uniform: (2 + 1 + 1) / 3 D and -D
    step = 1.2 if weighting == "samples" else 4 / 3
    for key in reference:
        assert torch.allclose(first[key], reference[key] + step * D[key], atol=1e-6), key
        assert torch.allclose(second[key], reference[key] - D[key], atol=1e-6), key
    assert ctx.server["splits"] == [{"round": 1, "first": [0, 1, 2], "second": [3, 4, 5],
                                     "max_cross_similarity": pytest.approx(-1.0)}]


def test_a_second_level_split_regroups_the_clusters_client_ids_not_their_positions():
    # cluster [2, 3, 4, 5] has positions 0..3; the authors' code and FL-bench would make [0, 1] and [2, 3]
    # of them. [0, 1] is below min_split_size = 4, so it stays whole although its updates are opposite.
    coefficients = {0: 1.0, 1: -1.0, 2: 1.0, 3: 1.0, 4: -1.0, 5: -1.0}
    ctx, *_ = hand_round(coefficients, clusters=[[0, 1], [2, 3, 4, 5]], eps1=1e9, eps2=0.0, min_split_size=4)
    assert ctx.server["clusters"] == [[0, 1], [2, 3], [4, 5]]
    ctx, *_ = hand_round(coefficients, clusters=[[0, 1], [2, 3, 4, 5]], eps1=1e9, eps2=0.0, min_split_size=2)
    assert ctx.server["clusters"] == [[0], [1], [2, 3], [4, 5]]


def test_a_cluster_with_a_missing_member_is_not_split_and_averages_the_arrivals():
    arrivals = {i: c for i, c in TWO_TASKS.items() if i != 5}
    weights = within_cluster(WEIGHTS, list(arrivals), uniform=False)  # as the engine renormalises them
    ctx, reference, D = hand_round(arrivals, weights=weights, eps1=1e9, eps2=0.0)
    assert ctx.server["clusters"] == [[0, 1, 2, 3, 4, 5]] and ctx.server["splits"] == []
    step = sum(weights[i] * c for i, c in arrivals.items())
    for key in reference:
        assert torch.allclose(ctx.server["cluster_models"][0][key], reference[key] + step * D[key], atol=1e-6)


# -- in a run ---------------------------------------------------------------------------------------


def test_the_flipped_clients_are_split_from_the_others_once_the_warm_up_is_over():
    engine, ctx = prepared(**flipped(warmup_rounds=2, min_split_size=4))  # one split, then parts of 3 stay
    for r in (1, 2):
        engine.run_round(ctx, r)
        assert ctx.server["clusters"] == [[0, 1, 2, 3, 4, 5]], r  # round 2 is still the warm-up
    engine.run_round(ctx, 3)
    assert ctx.server["clusters"] == [[0, 1, 2], [3, 4, 5]]
    assert ctx.server["splits"][0]["round"] == 3 and ctx.server["splits"][0]["max_cross_similarity"] < 0


def test_clusters_split_recursively_into_a_tree(monkeypatch):
    engine, ctx = prepared(**flipped(min_split_size=3))
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    parts = [sorted(s["first"] + s["second"]) for s in ctx.server["splits"]]
    assert parts[0] == [0, 1, 2, 3, 4, 5] and sorted(parts[1:]) == [[0, 1, 2], [3, 4, 5]]  # round 2 splits both
    assert sorted(i for c in ctx.server["clusters"] for i in c) == list(range(6)) and len(ctx.server["clusters"]) == 4
    # round 3: each client trains from its own cluster's model and is scored with it
    models = [{k: v.clone() for k, v in m.items()} for m in ctx.server["cluster_models"]]
    owner = {i: k for k, members in enumerate(ctx.server["clusters"]) for i in members}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 3)
    assert sorted(c["client"] for c in calls) == list(range(6))
    for call in calls:
        for key, value in models[owner[call["client"]]].items():
            assert torch.equal(call["before"][key], value), (call["client"], key)
    assert all(any(not torch.equal(a[k], b[k]) for k in a) for a, b in itertools.combinations(models, 2))
    owner = {i: k for k, members in enumerate(ctx.server["clusters"]) for i in members}
    for i in range(6):
        evaluated = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        for key, value in ctx.server["cluster_models"][owner[i]].items():
            assert torch.equal(evaluated[key], value), (i, key)


def test_before_its_first_split_cfl_is_fedavg_bit_for_bit_with_fedavgs_bytes():
    cfl, cfl_engine = run_tiny(**flipped(warmup_rounds=3))
    avg, avg_engine = run_tiny(**{**FLIPPED, "algorithm.name": "fedavg"})
    assert len(cfl_engine.ctx.server["clusters"]) == 1
    for key, value in avg_engine.ctx.server["global"].items():
        assert torch.equal(cfl_engine.ctx.server["cluster_models"][0][key], value), key
    assert cfl.final["acc_mean"] == avg.final["acc_mean"] and cfl.final["loss_mean"] == avg.final["loss_mean"]
    assert (cfl_engine.ctx.comm_up, cfl_engine.ctx.comm_down) == (avg_engine.ctx.comm_up, avg_engine.ctx.comm_down)


def test_splitting_improves_on_fedavg_when_two_tasks_conflict():
    cfl, _ = run_tiny(**flipped(warmup_rounds=2, min_split_size=4), **{"experiment.rounds": 6})
    avg, _ = run_tiny(**{**FLIPPED, "algorithm.name": "fedavg", "experiment.rounds": 6})
    assert cfl.final["acc_mean"] > avg.final["acc_mean"] + 0.1


def test_a_lost_upload_holds_its_cluster_back_for_that_round():
    # dropout at p = 0.1, seed 0 loses client 2 in round 1, nobody in round 2, client 0 in round 3
    assert [[i for i in range(6) if upload_is_lost(0, r, i, 0.1)] for r in (1, 2, 3)] == [[2], [], [0]]
    dropout = {"addons": [*FLIPPED["addons"], {"name": "dropout", "params": {"p": 0.1}}]}
    engine, ctx = prepared(**{**flipped(), **dropout})
    avg_engine, avg_ctx = prepared(**{**FLIPPED, "algorithm.name": "fedavg", **dropout})
    engine.run_round(ctx, 1)
    avg_engine.run_round(avg_ctx, 1)
    assert ctx.server["clusters"] == [[0, 1, 2, 3, 4, 5]]  # client 2 missing: no split
    for key, value in avg_ctx.server["global"].items():  # the arrivals' FedAvg
        assert torch.equal(ctx.server["cluster_models"][0][key], value), key
    engine.run_round(ctx, 2)
    assert ctx.server["clusters"] == [[0, 1, 2], [3, 4, 5]]
    engine.run_round(ctx, 3)  # client 0 missing: only the other cluster splits
    assert ctx.server["clusters"][0] == [0, 1, 2] and len(ctx.server["clusters"]) == 3
    assert all(ctx.store[i] == {} for i in range(6))  # CFL keeps no client state: nothing to stage


def test_a_coldstart_client_takes_the_cluster_model_that_fits_its_data_best():
    engine, ctx = prepared(**flipped(min_split_size=4))
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    clean, flipped_model = ctx.server["cluster_models"][1], ctx.server["cluster_models"][0]
    for newcomer, expected in ((4, clean), (0, flipped_model)):
        for order in ([clean, flipped_model], [flipped_model, clean]):
            client = ctx.client(newcomer)
            ctx.hooks.on_receive(ctx=ctx, client=client, message={"cluster_models": order})
            for key, value in expected.items():
                assert torch.equal(client.model.state_dict()[key], value), (newcomer, key)
    message = ctx.hooks.on_broadcast(ctx=ctx, client_id=99)  # in no cluster: every cluster's model
    assert len(message["cluster_models"]) == 2


def test_a_full_run_with_a_coldstart_client():
    result, engine = run_tiny(**flipped(warmup_rounds=1, min_split_size=4), **{"experiment.coldstart_clients": 1})
    assert "coldstart_acc_mean" in result.final and 5 == sum(len(c) for c in engine.ctx.server["clusters"])


def test_the_process_executor_is_bit_identical_across_splits():
    overrides = {k: v for k, v in flipped().items() if k != "algorithm.name"}
    seq_engine, _ = assert_pool_matches_sequential("cfl", rounds=3, **overrides)
    assert len(seq_engine.ctx.server["clusters"]) > 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_run_killed_before_its_splits_resumes_bit_identical(tmp_path, empty_store):
    overrides = flipped(warmup_rounds=2)  # splits in rounds 3 and 4, after the kill
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert len(ref_server["clusters"]) > 2


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("eps1", 0.0), ("eps1", float("nan")), ("eps2", -1.0), ("warmup_rounds", -1),
                                       ("min_split_size", 1), ("bipartition", "single"), ("weighting", "size")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key({"algorithm.name": "cfl"}, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"algorithm.name": "cfl", "algorithm.params.min_split_size": 1}))
    assert line.startswith("pfl-run: error: algorithm.params.min_split_size") and ">= 2" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cfl", "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "cfl averages weights" in info.value.message

