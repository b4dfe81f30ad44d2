"""FedCross (plugins/fedcross): the collaborator rules (C3) and the round offset of the in-order
rule, the similarity over parameters only, the cross-aggregation (C4) and the server step with a
lost upload by hand, three engine rounds recomputed independently (with and without lost
uploads), the FedAvg warm-up (C5) at the round where an off-by-one shows, FedAvg bit for bit
when every round is a warm-up round, which model is evaluated, bad input, the process executor
and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, prepared, refused_at_key, train_reference
from test_checkpoint import (
    empty_store,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedcross import FedCross, FedCrossParams, collaborators, cosine_similarities, cross_aggregate

assert empty_store  # the fixture used by the resume test (imported, not called)

RAW = {"algorithm.name": "fedcross", "algorithm.params.alpha": 0.75}


def cross(**params):
    plugin = FedCross(FedCrossParams(**{"alpha": 0.75, **params}))
    plugin.parameter_names = lambda ctx: ["w"]  # the stand-in models' only parameter
    return plugin


# -- (C3) and (C4) by hand -------------------------------------------------------------------------

SIMILARITY = torch.tensor([[1.0, 0.2, 0.9, 0.5],
                           [0.2, 1.0, 0.1, 0.3],
                           [0.9, 0.1, 1.0, -0.4],
                           [0.5, 0.3, -0.4, 1.0]])


def test_the_collaborator_rules_by_hand():
    assert collaborators(SIMILARITY, "lowest_similarity", 1) == [1, 2, 3, 2]
    assert collaborators(SIMILARITY, "highest_similarity", 1) == [2, 3, 0, 0]
    negative = torch.tensor([[1.0, -0.5, -0.2], [-0.5, 1.0, -0.9], [-0.2, -0.9, 1.0]])
    assert collaborators(negative, "highest_similarity", 1) == [2, 0, 0]  # never the model itself
    assert collaborators(torch.ones(1, 1), "in_order", 5) == [0]  # K = 1: nothing to cross with


def test_the_in_order_partner_shifts_from_one_at_round_one():
    # K = 4: (t - 1) mod 3 + 1 = 1, 2, 3, 1 at t = 1..4 (PFLlib's 0-based round counter)
    assert collaborators(SIMILARITY, "in_order", 1) == [1, 2, 3, 0]
    assert collaborators(SIMILARITY, "in_order", 2) == [2, 3, 0, 1]
    assert collaborators(SIMILARITY, "in_order", 3) == [3, 0, 1, 2]
    assert collaborators(SIMILARITY, "in_order", 4) == [1, 2, 3, 0]


def test_similarity_is_the_cosine_of_the_parameters_only():
    models = [{"w": torch.tensor([1.0, 0.0]), "running": torch.tensor([5.0])},
              {"w": torch.tensor([1.0, 1.0]), "running": torch.tensor([-5.0])},
              {"w": torch.tensor([0.0, -2.0]), "running": torch.tensor([5.0])}]
    s = cosine_similarities(models, ["w"])
    root = 2 ** -0.5
    assert torch.allclose(s, torch.tensor([[1.0, root, 0.0], [root, 1.0, -root], [0.0, -root, 1.0]],
                                          dtype=torch.float64))


def test_cross_aggregation_by_hand():
    own = {"w": torch.tensor([4.0, 0.0]), "count": torch.tensor(3)}
    partner = {"w": torch.tensor([0.0, 8.0]), "count": torch.tensor(9)}
    mixed = cross_aggregate(own, partner, 0.75)
    assert torch.equal(mixed["w"], torch.tensor([3.0, 2.0]))  # 0.75 own + 0.25 partner
    assert mixed["count"] == 3  # an integer entry is the model's own


def test_the_server_step_with_a_lost_upload_by_hand():
    dispatched = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])}]
    ctx = SimpleNamespace(server={"global": {"w": torch.zeros(2)}, "middleware": dispatched,
                                  "dispatch": {7: 2, 3: 0, 5: 1}},
                          round=2, device="cpu", participants=[3, 5, 7], log=lambda **kw: None)
    # client 3 trained w_0 into (2, 0); client 7 trained w_2 into (0, -2); client 5's upload was lost
    uploads = [(3, {"weights": {"w": torch.tensor([2.0, 0.0])}}), (7, {"weights": {"w": torch.tensor([0.0, -2.0])}})]
    weights = {3: 0.25, 7: 0.75}
    assert cross().server_aggregate(ctx, iter(uploads), weights) is True
    assert torch.allclose(ctx.server["global"]["w"], torch.tensor([0.5, -1.5]))  # (C2) over the arrivals
    # v = (2, 0), (0, 1) [lost: as dispatched], (0, -2): cos(v0, v1) = cos(v0, v2) = 0 (tie: index 1),
    # cos(v1, v2) = -1: v1 -> v2, v2 -> v1
    middleware = [m["w"] for m in ctx.server["middleware"]]
    assert torch.allclose(middleware[0], torch.tensor([1.5, 0.25]))
    assert torch.allclose(middleware[1], torch.tensor([0.0, 0.25]))
    assert torch.allclose(middleware[2], torch.tensor([0.0, -1.25]))
    assert torch.equal(dispatched[1]["w"], torch.tensor([0.0, 1.0]))  # the stored models were not mutated
    kept_middleware, kept_global = ctx.server["middleware"], ctx.server["global"]
    assert cross().server_aggregate(ctx, iter([]), {}) is True  # nothing arrived: everything stays
    assert ctx.server["middleware"] is kept_middleware and ctx.server["global"] is kept_global
    # a cold-start client gets the global model, a participant its dispatched middleware model
    assert cross().on_broadcast(ctx, 9)["weights"] is ctx.server["global"]
    assert cross().on_broadcast(ctx, 7)["weights"] is ctx.server["middleware"][2]


# -- in a run --------------------------------------------------------------------------------------


def expected_round(ctx, start, alpha, strategy, lost):
    """Recompute one round from the middleware models ``start`` and the run's dispatch."""
    dispatch = ctx.server["dispatch"]
    names = [n for n, _ in ctx.models.working("mlp").named_parameters()]
    trained = [dict(m) for m in start]
    arrived = []
    for client, j in dispatch.items():
        if client in lost:
            continue
        trained[j] = train_reference(ctx, client, start[j])
        arrived.append((ctx.data.clients[client].num_train, trained[j]))
    total = sum(n for n, _ in arrived)
    global_ = {k: sum(n / total * s[k] for n, s in arrived) for k in arrived[0][1]}
    count = len(trained)
    flat = [torch.cat([m[n].double().flatten() for n in names]) for m in trained]
    new = []
    for j in range(count):
        if strategy == "in_order":
            partner = (j + (ctx.round - 1) % (count - 1) + 1) % count
        else:
            sims = {k: float(torch.nn.functional.cosine_similarity(flat[j], flat[k], dim=0))
                    for k in range(count) if k != j}
            partner = min(sims, key=sims.get) if strategy == "lowest_similarity" else max(sims, key=sims.get)
        new.append({k: alpha * trained[j][k] + (1 - alpha) * trained[partner][k] for k in trained[j]})
    return global_, new


@pytest.mark.parametrize(("strategy", "dropout"), [("lowest_similarity", False), ("in_order", False),
                                                   ("highest_similarity", True)])
def test_three_rounds_recomputed_independently(strategy, dropout):
    alpha = 0.75
    extra = {"addons": [{"name": "dropout", "params": {"p": 0.4}}]} if dropout else {}
    engine, ctx = prepared(**RAW, **{"algorithm.params.collaborator": strategy, "experiment.participation": 0.75},
                           **extra)
    start = None
    lost_any = False
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        if start is None:  # K = 3 copies of the initial weights
            start = [ctx.models.initial_state("mlp")] * 3
        lost = {i for i in ctx.server["dispatch"] if dropout and upload_is_lost(0, t, i, 0.4)}
        lost_any |= bool(lost)
        if len(lost) == 3:
            continue
        global_, middleware = expected_round(ctx, start, alpha, strategy, lost)
        assert_close(ctx.server["global"], global_, atol=1e-5)
        for j in range(3):
            assert_close(ctx.server["middleware"][j], middleware[j], atol=1e-5)
        if t > 1:  # the middleware models differ: the global model is not FedAvg's
            assert far_apart(middleware[0], middleware[1], list(middleware[0]))
        start = middleware
    assert lost_any or not dropout


def test_the_fedavg_rounds_reset_every_middleware_model_to_the_global_model():
    engine, ctx = prepared(**RAW, **{"algorithm.params.fedavg_rounds": 1})
    engine.run_round(ctx, 1)  # round 1 is a FedAvg round
    for model in ctx.server["middleware"]:
        assert_same(model, ctx.server["global"])
    engine.run_round(ctx, 2)  # round 2 cross-aggregates
    first, second = ctx.server["middleware"][:2]
    assert far_apart(first, second, list(first))


def test_fedcross_with_every_round_a_fedavg_round_is_fedavg_bit_for_bit():
    fedavg, fedavg_engine = run_tiny(**{"experiment.participation": 0.75})
    fedcross, fedcross_engine = run_tiny(**RAW, **{"algorithm.params.fedavg_rounds": 3,
                                                   "experiment.participation": 0.75})
    assert_same(fedcross_engine.ctx.server["global"], fedavg_engine.ctx.server["global"])
    assert fedcross.final["acc_mean"] == fedavg.final["acc_mean"]


def test_the_dispatch_is_a_seeded_permutation_that_changes_between_rounds():
    """With every client taking part, a fixed dispatch would make middleware model j client j's own."""
    engine, ctx = prepared(**RAW)
    seen = []
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        dispatch = ctx.server["dispatch"]
        assert sorted(dispatch) == [0, 1, 2, 3] and sorted(dispatch.values()) == [0, 1, 2, 3]
        seen.append(dict(dispatch))
    assert len({tuple(sorted(d.items())) for d in seen}) > 1
    engine, again = prepared(**RAW)
    engine.run_round(again, 1)
    assert again.server["dispatch"] == seen[0]  # seeded: the same spec, the same dispatch


def test_every_client_is_evaluated_on_the_global_model():
    engine, ctx = prepared(**RAW)
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    assert all(far_apart(m, ctx.server["global"], list(m)) for m in ctx.server["middleware"])
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("alpha", 1.5), ("alpha", -0.1), ("alpha", float("nan")),
                                            ("collaborator", "random"), ("fedavg_rounds", -1),
                                            ("fedavg_rounds", "1")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    refused_at_key(RAW, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**RAW, "algorithm.params.collaborator": "nearest"}))
    assert line.startswith("pfl-run: error: algorithm.params.collaborator:")


def test_the_defaults_resolve():
    params = resolve(tiny_raw(algorithm={"name": "fedcross"})).plugins[-1].params
    assert (params.alpha, params.collaborator, params.fedavg_rounds) == (0.99, "lowest_similarity", 0)


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.alpha": 0.75, "experiment.participation": 0.75,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedcross", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fedcross", "algorithm.params.alpha": 0.75,
                 "algorithm.params.collaborator": "in_order", "experiment.participation": 0.75}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
