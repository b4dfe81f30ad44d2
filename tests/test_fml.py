"""FML (plugins/fml): the mutual losses (1) and (2) and their gradients by hand, a client's round
recomputed independently, alpha = 1 is Local's personal models and beta = 1 FedAvg's global model
bit for bit, the personal model evaluated, the weighting, bad input, lost uploads, the process
executor and a killed run's resume."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, mean_of, prepared
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fml import FML, FMLParams, fml_losses

BASE = {"algorithm.name": "fml", "model.params.hidden": [8], "partition.scheme": "dirichlet",
        "partition.params": {"alpha": 0.5}}
KEYS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


# -- (1) and (2) by hand ---------------------------------------------------------------------------


def test_the_mutual_losses_by_hand_and_each_model_learns_only_from_its_own():
    z_L = torch.tensor([[2.0, 0.0]], requires_grad=True)
    z_M = torch.tensor([[0.0, 1.0]], requires_grad=True)
    y = torch.tensor([0])
    ce_L, ce_M = F.cross_entropy(z_L, y), F.cross_entropy(z_M, y)
    personal, meme = fml_losses(ce_L, ce_M, z_L, z_M, alpha=0.25, beta=0.75)
    p_L, p_M = F.softmax(z_L, 1).detach()[0], F.softmax(z_M, 1).detach()[0]
    kl_M_L = float((p_M * (p_M / p_L).log()).sum())  # KL(p_M || p_L)
    kl_L_M = float((p_L * (p_L / p_M).log()).sum())
    assert personal.item() == pytest.approx(0.25 * ce_L.item() + 0.75 * kl_M_L, rel=1e-6)
    assert meme.item() == pytest.approx(0.75 * ce_M.item() + 0.25 * kl_L_M, rel=1e-6)
    assert kl_M_L != pytest.approx(kl_L_M, rel=1e-3)  # the two directions differ: a swap is seen
    personal.backward()
    assert z_M.grad is None  # the meme's prediction is a constant in the personal loss
    meme.backward()
    # d/dz_M of 0.75 CE + 0.25 KL(p_L || p_M) = 0.75 (p_M - onehot) + 0.25 (p_M - p_L)
    expected = 0.75 * (p_M - torch.tensor([1.0, 0.0])) + 0.25 * (p_M - p_L)
    assert torch.allclose(z_M.grad[0], expected, atol=1e-6)


# -- in a run --------------------------------------------------------------------------------------


class ReferencePair(nn.Module):
    def __init__(self, personal, meme):
        super().__init__()
        self.personal, self.meme = personal, meme

    def forward(self, x):
        self.z_M = self.meme(x)
        return self.personal(x)


def reference_loss(alpha, beta):
    def loss(model, x, y, z_L):
        z_M = model.z_M

        def kl(z, peer):
            return F.kl_div(F.log_softmax(z, 1), F.softmax(peer.detach(), 1), reduction="batchmean")

        return (alpha * F.cross_entropy(z_L, y) + (1 - alpha) * kl(z_L, z_M)
                + beta * F.cross_entropy(z_M, y) + (1 - beta) * kl(z_M, z_L))
    return loss


def test_a_round_recomputed_independently():
    engine, ctx = prepared(**BASE, **{"algorithm.params.alpha": 0.3, "algorithm.params.beta": 0.6})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    memes = {}
    for i in range(4):
        personal, meme = ctx.models.build("mlp"), ctx.models.build("mlp")
        personal.load_state_dict(ctx.models.initial_state("mlp"))
        meme.load_state_dict(start)
        pair = ReferencePair(personal, meme)
        ctx.client(i).train(pair, optimizer=torch.optim.SGD(pair.parameters(), lr=ctx.spec.training.lr),
                            loss_fn=reference_loss(0.3, 0.6))
        assert_close(ctx.store[i]["personal"], personal.state_dict(), atol=1e-5)
        memes[i] = {k: v.detach() for k, v in meme.state_dict().items()}
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(sizes.values())
    assert_close(ctx.server["global"], mean_of((sizes[i] / total, memes[i]) for i in range(4)), atol=1e-5)
    assert far_apart(ctx.store[0]["personal"], memes[0], KEYS)


def test_alpha_one_is_locals_personal_models_and_beta_one_fedavgs_global_model_bit_for_bit():
    _, fml = run_tiny(**BASE, **{"algorithm.params.alpha": 1.0, "algorithm.params.beta": 1.0})
    _, local = run_tiny(**{**BASE, "algorithm.name": "local"})
    _, avg = run_tiny(**{**BASE, "algorithm.name": "fedavg"})
    assert_same(fml.ctx.server["global"], avg.ctx.server["global"])
    for i in range(4):
        assert_same(fml.ctx.store[i]["personal"], local.ctx.store[i]["weights"])
    _, mutual = run_tiny(**BASE)  # the defaults (0.5, 0.5) move both away
    assert far_apart(mutual.ctx.server["global"], avg.ctx.server["global"], KEYS)
    assert far_apart(mutual.ctx.store[0]["personal"], local.ctx.store[0]["weights"], KEYS)
    assert (fml.ctx.comm_up, fml.ctx.comm_down) == (avg.ctx.comm_up, avg.ctx.comm_down)


def test_uniform_weighting_is_the_plain_mean_of_the_memes():
    _, ctx = prepared(**BASE)
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    assert len(set(sizes.values())) > 1
    _, uniform = run_tiny(**BASE, **{"algorithm.params.weighting": "uniform", "experiment.rounds": 1})
    _, samples = run_tiny(**BASE, **{"experiment.rounds": 1})
    assert FML(FMLParams(weighting="uniform")).client_weighting(ctx, [0, 1, 2, 3]) == {i: 0.25 for i in range(4)}
    assert FML(FMLParams()).client_weighting(ctx, [0, 1]) is None  # the core's n_k / n
    assert far_apart(uniform.ctx.server["global"], samples.ctx.server["global"], KEYS, atol=1e-6)


def test_each_client_is_scored_with_its_personal_model():
    _, engine = run_tiny(**BASE, **{"experiment.participation": 0.5, "experiment.rounds": 1})
    ctx = engine.ctx
    trained = [i for i in range(4) if "personal" in ctx.store[i]]
    assert 0 < len(trained) < 4  # half the clients in one round: two never trained
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        expected = ctx.store[i]["personal"] if "personal" in ctx.store[i] else ctx.models.initial_state("mlp")
        assert_same(model, expected)
        assert far_apart(model, ctx.server["global"], KEYS)


def test_lost_uploads_keep_the_personal_model_and_leave_the_meme_out():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 4, "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert all(set(engine.ctx.store[i]) <= {"personal"} for i in range(4))  # nothing staged, nothing else kept


def test_a_newcomer_trains_its_fresh_personal_model_with_the_final_meme():
    engine, ctx = prepared(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (newcomer,) = ctx.coldstart_clients
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    models = ctx.hooks.coldstart_personalize(ctx=ctx, client=ctx.client(newcomer), message=ctx.broadcast(newcomer))
    personal, meme = ctx.models.build("mlp"), ctx.models.build("mlp")
    personal.load_state_dict(ctx.models.initial_state("mlp"))
    meme.load_state_dict(start)
    pair = ReferencePair(personal, meme)
    ctx.client(newcomer).train(pair, epochs=2, optimizer=torch.optim.SGD(pair.parameters(), lr=ctx.spec.training.lr),
                               loss_fn=reference_loss(0.5, 0.5))
    assert_close(models[""].state_dict(), personal.state_dict(), atol=1e-5)


def test_local_work_counts_both_models():
    spec = resolve(tiny_raw(**BASE, **{"training.local_epochs": 3})).spec
    assert FML(FMLParams()).local_work(spec).private_epochs_per_round == 6.0


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("alpha", -0.1), ("alpha", 1.5), ("beta", float("nan")), ("beta", "0.5"),
                                       ("weighting", "mean")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.beta": 2.0}))
    assert line.startswith("pfl-run: error: algorithm.params.beta") and "[0, 1]" in line


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {**BASE, "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fml", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_with_lost_uploads_and_a_newcomer():
    overrides = {**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    assert all(t.device.type == "cuda" for t in engine.ctx.server["global"].values())
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
