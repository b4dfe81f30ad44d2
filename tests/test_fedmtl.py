"""FedMTL (plugins/fedmtl): Omega and the pull v_i by hand, client i's part of lam tr(W Omega W^T)
and its gradient 2 lam (w_i - mean of the columns), lam = 0 is Local bit for bit, the regulariser
changes training (PFLlib's has no gradient), W's columns move only with a delivered upload
(dropout), which model is evaluated, bad input, the process executor and a killed run's resume."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, linear, prepared, train_reference
from test_checkpoint import (
    empty_store,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_plugins.fedmtl import FedMTL, FedMTLParams, pull_for, relationship

assert empty_store  # the fixture used by the resume test (imported, not called)

BASE = {"algorithm.name": "fedmtl", "algorithm.params.lam": 0.5}
PARAMS = tuple(name for name, _ in prepared(**BASE)[1].models.build("mlp").named_parameters())


def test_omega_is_the_centring_matrix():
    omega = relationship(4)
    assert torch.allclose(omega, torch.eye(4) - torch.full((4, 4), 0.25))


def test_the_pull_is_minus_one_mth_of_the_other_columns():
    columns = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([3.0, 6.0])}, {"w": torch.tensor([5.0, 3.0])}]
    pull = pull_for(1, relationship(3), columns)  # -(1/3)(w_0 + w_2)
    assert torch.allclose(pull["w"], torch.tensor([-2.0, -1.0]))


def test_the_term_and_its_gradient_by_hand():
    """Three clients, this one w = (1, 2 | 0.5), the others (0, 0 | 0) and (3, -1 | 2.5): Omega_ii = 2/3,
    v = -(1/3)(3, -1 | 2.5). The term is lam (2/3) ||w - mean of the others||^2, the gradient
    2 lam (w - mean of all three) = 2 lam ((1, 2 | 0.5) - (4/3, 1/3 | 1))."""
    model = linear([1.0, 2.0], [0.5])
    others = [{"weight": torch.zeros(1, 2), "bias": torch.zeros(1)},
              {"weight": torch.tensor([[3.0, -1.0]]), "bias": torch.tensor([2.5])}]
    columns = [others[0], {k: v.detach() for k, v in model.named_parameters()}, others[1]]
    omega = relationship(3)
    message = {"self_weight": omega[1, 1].item(), "pull": pull_for(1, omega, columns)}
    client = SimpleNamespace(id=1, model=model, arch="mlp", state={"weights": model.state_dict()}, scratch={},
                             staged={})
    ctx = SimpleNamespace(models=SimpleNamespace(initial_state=lambda arch: None))
    plugin = FedMTL(FedMTLParams(lam=0.3))
    assert plugin.on_receive(ctx=ctx, client=client, message=message)
    term = plugin.local_objective(ctx=ctx, client=client, model=model, x=None, y=None, logits=None)
    # mean of the others (1.5, -0.5 | 1.25): ||w - it||^2 = 0.25 + 6.25 + 0.5625 = 7.0625
    assert torch.isclose(term, torch.tensor(0.3 * 2 / 3 * 7.0625))
    term.backward()
    assert torch.allclose(model.weight.grad, 0.6 * torch.tensor([[1 - 4 / 3, 2 - 1 / 3]]))
    assert torch.allclose(model.bias.grad, 0.6 * torch.tensor([0.5 - 1.0]))


def test_the_broadcast_reads_every_training_clients_column():
    """The server's v_i uses every training client's last delivered column, initial weights otherwise."""
    _, ctx = prepared(**BASE)
    plugin = FedMTL(FedMTLParams(lam=0.5))
    init = ctx.models.initial_state("mlp")
    planted = {n: init[n] + 1.0 for n in PARAMS}
    ctx.server["columns"] = {2: planted}
    message = plugin.on_broadcast(ctx=ctx, client_id=0)
    m = len(ctx.training_clients)
    assert message["self_weight"] == pytest.approx(1 - 1 / m)
    for n in PARAMS:  # -(1/m) (sum of the m - 1 other columns): m - 2 initial ones and the planted one
        assert torch.allclose(message["pull"][n], -((m - 2) * init[n] + planted[n]) / m, atol=1e-6)


# -- engine runs -----------------------------------------------------------------------------------


def test_lam_zero_is_local_bit_for_bit():
    _, mtl = run_tiny(**{**BASE, "algorithm.params.lam": 0.0})
    _, local = run_tiny(**{"algorithm.name": "local"})
    for i in mtl.ctx.training_clients:
        assert_same(mtl.ctx.store[i]["weights"], local.ctx.store[i]["weights"])


def test_the_regulariser_pulls_the_models_together():
    """PFLlib's term is built from detached tensors and changes nothing; this one must."""
    def spread(engine):
        states = [engine.ctx.store[i]["weights"] for i in engine.ctx.training_clients]
        mean = {n: sum(s[n] for s in states) / len(states) for n in PARAMS}
        return sum(((s[n] - mean[n]) ** 2).sum().item() for s in states for n in PARAMS)
    _, coupled = run_tiny(**{**BASE, "algorithm.params.lam": 2.0})
    _, alone = run_tiny(**{**BASE, "algorithm.params.lam": 0.0})
    assert spread(coupled) < 0.5 * spread(alone)


def mean_regularised_loss(others: list[dict], lam: float, m: int):
    """Cross-entropy + lam (1 - 1/m) ||w - mean of the other columns||^2, written from Eq. 1 directly."""
    target = {n: sum(o[n] for o in others) / len(others) for n in PARAMS}

    def loss(model, x, y, logits):
        term = sum(((p - target[n]) ** 2).sum() for n, p in model.named_parameters())
        return F.cross_entropy(logits, y) + lam * (1 - 1 / m) * term
    return loss


def test_three_rounds_recomputed_independently():
    """Every round each client trains its own model against the columns of the round before;
    by round 3 the columns are the round-2 models (a stale or first-round W would differ)."""
    lam = 0.5
    engine, ctx = prepared(**BASE)
    init = ctx.models.initial_state("mlp")
    own = {i: {k: v.clone() for k, v in init.items()} for i in range(4)}
    for t in (1, 2, 3):
        engine.run_round(ctx, t)
        columns = {i: {n: own[i][n] for n in PARAMS} for i in range(4)}
        own = {i: train_reference(ctx, i, own[i], loss_fn=mean_regularised_loss(
            [columns[j] for j in range(4) if j != i], lam, 4)) for i in range(4)}
        for i in range(4):
            assert_close(ctx.store[i]["weights"], own[i], atol=1e-5)
            assert_close(ctx.server["columns"][i], {n: own[i][n] for n in PARAMS}, atol=1e-5)


def test_every_client_is_evaluated_on_its_own_model():
    _, engine = run_tiny(**{**BASE, "experiment.rounds": 2})
    ctx = engine.ctx
    plugin = FedMTL(FedMTLParams(lam=0.5))
    client = ctx.client(1)
    model = plugin.personalized_models(ctx=ctx, client=client, message={})[""]
    assert_same({n: p.detach() for n, p in model.named_parameters()}, {n: ctx.store[1]["weights"][n] for n in PARAMS})


def dropout_engine():
    return run_tiny(**{**BASE, "experiment.rounds": 5, "experiment.participation": 0.75,
                       "addons": [{"name": "dropout", "params": {"p": 0.4}}]})


def test_a_lost_upload_leaves_the_column_and_the_client_keeps_its_model():
    result, engine = dropout_engine()
    ctx = engine.ctx
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    stale = [i for i in ctx.training_clients
             if far_apart(ctx.server["columns"].get(i, ctx.models.initial_state("mlp")), ctx.store[i]["weights"],
                          list(PARAMS))]
    assert stale  # some client trained in its last visit and lost the upload: its column is older
    fresh = [i for i in ctx.training_clients if i not in stale]
    for i in fresh:
        assert_same({n: ctx.server["columns"][i][n] for n in PARAMS}, {n: ctx.store[i]["weights"][n] for n in PARAMS})


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("lam", -0.1), ("lam", float("nan")), ("lam", float("inf")),
                                            ("lam", "1")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.lam": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.lam: must be >= 0")


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.lam": 0.5,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedmtl", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {"algorithm.name": "fedmtl", "algorithm.params.lam": 0.5, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
