"""Floco (plugins/floco): the simplex projection, the Riesz energy, the PCA scores and the
placement (F4, F5) by hand; the per-batch draw (F2); three engine rounds recomputed independently
(uniform draws, the placement at round tau with every client taking part, then draws around each
client's centre); which model is evaluated (F6); Floco+'s pull by hand and its personal simplices
recomputed over three rounds (state carried past the first), evaluated at the centre (P1, P2); a
lost round-tau upload; bad input; the process executor and a killed run's resume (with Floco+)."""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, dry_run_error, far_apart, fresh_model, mean_of, prepared
from test_checkpoint import empty_store
from tiny import tiny_raw
from torch.func import functional_call

from pfl_core import hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_plugins.floco import (
    Floco,
    draw_alpha,
    log_riesz_energy,
    place_clients,
    principal_scores,
    project_onto_simplex,
)

assert empty_store  # the fixture used by the resume test (imported, not called)

KEY = "fc1.weight"  # hidden = []: one Linear, the simplex's layer
SMALL = {"model.params.hidden": [], "algorithm.name": "floco", "algorithm.params.endpoints": 3,
         "algorithm.params.tau": 2, "algorithm.params.rho": 0.2}


# -- (F4), (F5) by hand ----------------------------------------------------------------------------


def test_the_projection_onto_the_simplex_by_hand():
    points = np.array([[0.5, 0.2, -0.1], [1.0, 0.8, 0.0], [2.0, 0.0, 0.0]])
    # row 1: all three in the support, shift -0.4 / 3; row 2: two, shift 0.4; row 3: one, shift 1
    expected = np.array([[0.5 + 0.4 / 3, 0.2 + 0.4 / 3, -0.1 + 0.4 / 3], [0.6, 0.4, 0.0], [1.0, 0.0, 0.0]])
    assert np.allclose(project_onto_simplex(points, 1.0), expected)
    # sum z = 0.5: (1, 0.8, 0) -> two in the support, shift (1.8 - 0.5) / 2
    assert np.allclose(project_onto_simplex(points[1:2], 0.5), [[0.35, 0.15, 0.0]])


def test_the_log_riesz_energy_by_hand():
    vertices = np.eye(3)  # three pairs at distance sqrt(2): 1 / d^2 = 1/2 each, mean 1/2
    assert math.isclose(log_riesz_energy(vertices), math.log(0.5))
    # two coincident points count at the floor distance 1e-4: (1e8 + 1/2 + 1/2) / 3
    assert math.isclose(log_riesz_energy(np.array([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0]])),
                        math.log((1e8 + 1.0) / 3))


def test_the_principal_scores_by_hand():
    rows = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])  # centred: -(3, 4), 0, (3, 4); axis (0.6, 0.8)
    assert np.allclose(principal_scores(rows, 3), [[-5.0, 0, 0], [0, 0, 0], [5.0, 0, 0]])  # rank 1: zeros after
    # the sign makes each axis's largest entry positive: negated rows give negated scores
    assert np.allclose(principal_scores(-rows, 1), [[5.0], [0.0], [-5.0]])


def test_the_placement_spreads_two_clients_to_the_vertices_at_the_first_z():
    # kappa = (-2.5, 0), (2.5, 0): every z <= 2.5 puts them on opposite vertices (the lowest energy),
    # so the first z of the grid wins; the larger score is the first vertex
    betas, z = place_clients(np.array([[0.0, 0.0], [3.0, 4.0]]), 2)
    assert np.allclose(betas, [[0.0, 1.0], [1.0, 0.0]]) and z == pytest.approx(1e-4)
    # small scores (kappa = -/+ 0.25): still the vertices (z <= 0.25), not the z = 1 points (0.375, 0.625)
    betas, _ = place_clients(np.array([[0.0, 0.0], [0.3, 0.4]]), 2)
    assert np.allclose(betas, [[0.0, 1.0], [1.0, 0.0]])


def test_a_placement_lies_on_the_simplex():
    rows = np.random.default_rng(0).normal(size=(6, 12))
    betas, z = place_clients(rows, 4)
    assert betas.shape == (6, 4) and (betas >= 0).all() and np.allclose(betas.sum(axis=1), 1.0)
    assert 1e-4 <= z <= 1


# -- (F2) ------------------------------------------------------------------------------------------


def test_the_draws_without_and_with_a_subregion():
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([draw_alpha(4, None, 0.1, g) for _ in range(200)])
    assert (draws >= 0).all() and torch.allclose(draws.sum(dim=1), torch.ones(200, dtype=torch.float64))
    assert draws.std(dim=0).min() > 0.1  # the whole simplex, not its centre
    center = torch.tensor([0.7, 0.1, 0.1, 0.1])
    around = torch.stack([draw_alpha(4, center, 0.1, g) for _ in range(200)])
    radius = (around - center.double()).abs().sum(dim=1)  # the L1 distance r ~ U(0, rho)
    assert radius.max() <= 0.1 + 1e-12 and radius.max() > 0.09 and radius.min() < 0.01


# -- in a run --------------------------------------------------------------------------------------


def reference_train(ctx, i, state, endpoints, center, rho, purpose="floco_alpha", anchor=None, lam=0.0, epochs=None):
    """Client i's trained state (without the layer's own weight) and vertices from (state, endpoints)
    in the current round: plain SGD on cross-entropy (+ lam/2 ||theta - anchor||^2 over the trained
    parameters), a fresh alpha per batch from the client's ``purpose`` stream, the last layer's own
    weight not trained."""
    count = endpoints.shape[0]
    model = fresh_model(ctx, state)
    vertices = torch.nn.Parameter(endpoints.clone())
    generator = ctx.client(i).generator(purpose)

    def draw():
        if center is None:
            e = torch.empty(count, dtype=torch.float64).exponential_(generator=generator)
            return e / e.sum()
        v = torch.rand(count, dtype=torch.float64, generator=generator) * 2 - 1
        r = torch.rand((), dtype=torch.float64, generator=generator) * rho
        return center.double() + r * v / v.abs().sum()

    class Simplex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.vertices = model, vertices

        def forward(self, x):
            alpha = draw().float()
            weight = (alpha[:, None, None] * self.vertices).sum(dim=0)
            return functional_call(self.inner, {KEY: weight}, (x,))

    named = [(n, p) for n, p in model.named_parameters() if n != KEY] + [("vertices", vertices)]

    def loss(m, x, y, logits):
        value = F.cross_entropy(logits, y)
        if anchor is not None:
            value = value + lam / 2 * sum(((p - anchor[n]) ** 2).sum() for n, p in named)
        return value

    optimizer = torch.optim.SGD([p for _, p in named], lr=ctx.spec.training.lr)
    ctx.client(i).train(model=Simplex(), optimizer=optimizer, loss_fn=loss, epochs=epochs)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != KEY}, vertices.detach().clone()


def reference_round(ctx, server, endpoints, centers, rho):
    """Every participant's reference_train from the server's model."""
    return {i: reference_train(ctx, i, server, endpoints, centers.get(i), rho) for i in ctx.participants}


def averaged(ctx, trained):
    sizes = {i: ctx.data.clients[i].num_train for i in trained}
    total = sum(sizes.values())
    state = mean_of((sizes[i] / total, s) for i, (s, _) in trained.items())
    vertices = mean_of((sizes[i] / total, {"e": e}) for i, (_, e) in trained.items())["e"]
    return state, vertices


def test_three_rounds_recomputed_independently():
    engine, ctx = prepared(**SMALL, **{"experiment.participation": 0.5})
    server = {k: v.clone() for k, v in ctx.server["global"].items()}
    endpoints = ctx.server["endpoints"].clone()
    assert endpoints.shape == (3, *server[KEY].shape) and far_apart({"a": endpoints[0]}, {"a": endpoints[1]}, ["a"])
    centers = {}
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        assert len(ctx.participants) == (4 if t == 2 else 2)  # round tau: every training client
        trained = reference_round(ctx, server, endpoints, centers, rho=0.2)
        state, endpoints = averaged(ctx, trained)
        server.update(state)
        assert_close({k: ctx.server["global"][k] for k in state}, state, atol=1e-5)
        assert_close({"e": ctx.server["endpoints"]}, {"e": endpoints}, atol=1e-5)
        if t == 2:  # placed by the clients' trained vertices
            rows = np.stack([trained[i][1].double().numpy().ravel() for i in sorted(trained)])
            betas, _ = place_clients(rows, 3)
            centers = {i: torch.tensor(b, dtype=torch.float32) for i, b in zip(sorted(trained), betas)}
            assert sorted(ctx.server["centers"]) == [0, 1, 2, 3]
            for i, beta in centers.items():
                assert torch.allclose(ctx.server["centers"][i], beta, atol=1e-4)
        if t == 3:  # the test tells draws around the centres from uniform draws
            uniform = averaged(ctx, reference_round(ctx, server, ctx.server["endpoints"], {}, rho=0.2))[1]
            assert far_apart({"e": endpoints}, {"e": uniform}, ["e"])
        if t < 2:
            assert ctx.server["centers"] == {}


def test_each_client_is_evaluated_at_its_subregions_centre():
    engine, ctx = prepared(**SMALL)
    engine.run_round(ctx, 1)
    endpoints = ctx.server["endpoints"]
    for i in range(4):  # not placed yet: the simplex centre
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert torch.allclose(message["weights"][KEY], endpoints.mean(dim=0), atol=1e-6)
    engine.run_round(ctx, 2)
    endpoints = ctx.server["endpoints"]
    weights = []
    for i in range(4):
        beta = ctx.server["centers"][i]
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        expected = sum(beta[m] * endpoints[m] for m in range(3))
        assert torch.allclose(message["weights"][KEY], expected, atol=1e-6)
        model = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)[""]
        assert torch.equal(model.state_dict()[KEY], message["weights"][KEY])
        assert torch.equal(model.state_dict()["fc1.bias"], ctx.server["global"]["fc1.bias"])
        weights.append(message["weights"][KEY])
    assert far_apart({"a": weights[0]}, {"a": weights[1]}, ["a"])  # personalised: different points


# -- Floco+ (P1, P2) --------------------------------------------------------------------------------


def test_the_personal_pull_and_its_gradient_by_hand():
    from types import SimpleNamespace

    from pfl_plugins.floco import FlocoParams
    plugin = Floco(FlocoParams(personal_epochs=1, lam=0.5))
    simplex = torch.nn.Linear(2, 1)
    with torch.no_grad():
        simplex.weight.copy_(torch.tensor([[1.0, 2.0]]))
        simplex.bias.fill_(0.5)
    named = [("model.w", simplex.weight), ("model.b", simplex.bias)]
    anchor = {"model.w": torch.tensor([[0.0, 4.0]]), "model.b": torch.tensor([1.5])}
    client = SimpleNamespace(scratch={"floco": {"anchor": anchor, "training": (simplex, named)}})
    term = plugin.local_objective(ctx=None, client=client, model=simplex, x=None, y=None, logits=None)
    assert torch.isclose(term, torch.tensor(0.25 * (1 + 4 + 1)))  # lam/2 ||v - w||^2
    term.backward()  # lam (v - w), not lam v - w
    assert torch.allclose(simplex.weight.grad, torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(simplex.bias.grad, torch.tensor([-0.5]))
    other = torch.nn.Linear(2, 1)  # the global pass's model or any other: no term
    assert plugin.local_objective(ctx=None, client=client, model=other, x=None, y=None, logits=None) is None
    client.scratch["floco"].pop("anchor")  # the global pass: no term
    assert plugin.local_objective(ctx=None, client=client, model=simplex, x=None, y=None, logits=None) is None


def test_three_rounds_of_personal_simplices_recomputed_independently():
    lam = 0.5
    plus = {**SMALL, "algorithm.params.personal_epochs": 2, "algorithm.params.lam": lam}
    engine, ctx = prepared(**plus)
    plain_engine, plain = prepared(**SMALL)  # Floco, to check the global pass is untouched
    server = {k: v.clone() for k, v in ctx.server["global"].items()}
    endpoints = ctx.server["endpoints"].clone()
    personal, centers = {}, {}
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        plain_engine.run_round(plain, t)
        for i in range(4):
            start, start_vertices = personal.get(i, ({k: v for k, v in server.items() if k != KEY}, endpoints))
            anchor = {f"inner.{k}": v for k, v in server.items() if k != KEY}
            anchor = {**{k.replace("inner.", ""): v for k, v in anchor.items()}, "vertices": endpoints}
            personal[i] = reference_train(ctx, i, start, start_vertices, centers.get(i), 0.2,
                                          purpose="floco_personal_alpha", anchor=anchor, lam=lam, epochs=2)
            stored = ctx.store[i]["personal"]
            assert_close({k: stored[k] for k in personal[i][0]}, personal[i][0], atol=1e-5)
            assert_close({"e": stored["floco.endpoints"]}, {"e": personal[i][1]}, atol=1e-5)
        for key, value in plain.server["global"].items():  # the upload is the global pass's
            assert torch.equal(ctx.server["global"][key], value), key
        assert torch.equal(ctx.server["endpoints"], plain.server["endpoints"])
        server = {k: v.clone() for k, v in ctx.server["global"].items()}
        endpoints = ctx.server["endpoints"].clone()
        centers = dict(ctx.server["centers"])
    unpulled = reference_train(ctx, 0, server, endpoints, centers[0], 0.2, purpose="floco_personal_alpha", epochs=2)
    assert far_apart({"e": personal[0][1]}, {"e": unpulled[1]}, ["e"])  # the pull matters here
    for i in range(4):  # (P2) the personal simplex at the subregion's centre
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        model = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)[""]
        vertices = ctx.store[i]["personal"]["floco.endpoints"]
        expected = sum(centers[i][m] * vertices[m] for m in range(3))
        assert torch.allclose(model.state_dict()[KEY], expected, atol=1e-6)
        assert torch.equal(model.state_dict()["fc1.bias"], ctx.store[i]["personal"]["fc1.bias"])
        assert far_apart({"a": model.state_dict()[KEY]}, {"a": message["weights"][KEY]}, ["a"])


# -- lost uploads ----------------------------------------------------------------------------------


ARRIVED: dict[int, list[int]] = {}  # round -> the clients whose uploads reached Recording's server


class Recording(Floco):
    """Floco that records whose uploads arrived in each round (in ARRIVED)."""

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        seen = ARRIVED.setdefault(ctx.round, [])

        def recorded():
            for client_id, message in uploads:
                seen.append(client_id)
                yield client_id, message
        return super().server_aggregate(ctx, recorded(), weights)


def test_a_client_whose_round_tau_upload_is_lost_stays_unplaced():
    ARRIVED.clear()
    raw = tiny_raw(**{**SMALL, "algorithm.params.tau": 1, "experiment.rounds": 2,
                      "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = Recording(resolved.plugins[-1].params)
    engine = Engine(resolved, progress=False)
    engine.run()
    ctx = engine.ctx
    placed = sorted(ARRIVED[1])
    assert 0 < len(placed) < 4  # some arrived, some were lost (this seed)
    assert sorted(ctx.server["centers"]) == placed
    lost = next(i for i in range(4) if i not in placed)
    message = ctx.hooks.evaluation_message(ctx=ctx, client_id=lost)
    assert torch.allclose(message["weights"][KEY], ctx.server["endpoints"].mean(dim=0), atol=1e-6)
    assert "center" not in ctx.hooks.on_broadcast(ctx=ctx, client_id=lost)
    assert "center" in ctx.hooks.on_broadcast(ctx=ctx, client_id=placed[0])


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("endpoints", 1), ("endpoints", 2.5), ("tau", 0), ("rho", 0.0),
                                            ("rho", float("nan")), ("rho", "0.1"), ("tau", 4),
                                            ("personal_epochs", -1), ("lam", -0.1), ("lam", float("inf"))])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**SMALL, f"algorithm.params.{key}": value}))  # 3 rounds: tau = 4 never comes
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**SMALL, "algorithm.params.tau": 9}))
    assert line.startswith("pfl-run: error: algorithm.params.tau: must not exceed experiment.rounds (3)")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.endpoints": 3, "algorithm.params.tau": 2,
                 "algorithm.params.personal_epochs": 1, "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("floco", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "floco", "algorithm.params.endpoints": 3, "algorithm.params.tau": 2,
                 "algorithm.params.personal_epochs": 1, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
