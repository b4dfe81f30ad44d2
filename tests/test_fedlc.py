"""FedLC (plugins/fedlc): the calibrated cross-entropy (L1) by hand, the same numbers as the guide's
add-on, each client calibrated by its own label counts (not the federation's, as PFLlib does), a
round recomputed independently, tau = 0 is FedAvg bit for bit, the evaluated model is the global
one, bad input, lost uploads, the process executor and a killed run's resume."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, mean_of, prepared, train_reference
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from test_task_loss import guide_fedlc
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedlc import FedLC, FedLCParams, calibrated_cross_entropy, calibration_offsets

# label skew (Dirichlet 0.3): each client's counts differ from the others' and from the federation's
SKEWED = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}}
BASE = {"algorithm.name": "fedlc", "model.params.hidden": [8], **SKEWED}


def loss_with_counts(counts, tau):
    return lambda model, x, y, logits: calibrated_cross_entropy(logits, y, counts, tau)


# -- (L1) by hand ----------------------------------------------------------------------------------


def test_the_offsets_by_hand():
    like = torch.zeros(1)
    # tau = 2, counts (81, 16, 1, 0): 2 * 81^(-1/4) = 2/3, 2 * 16^(-1/4) = 1, 2 * 1 = 2, absent: as one sample, 2
    assert torch.allclose(calibration_offsets([81, 16, 1, 0], 2.0, like), torch.tensor([2 / 3, 1.0, 2.0, 2.0]))
    assert calibration_offsets([5], 1.0, torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


def test_the_calibrated_cross_entropy_by_hand():
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    counts = [16, 1, 81]  # tau = 1: offsets 0.5, 1, 1/3
    z = logits - torch.tensor([0.5, 1.0, 1 / 3])
    # row 0 (y = 0): -log(e^0.5 / (e^0.5 + e^-1 + e^(-1/3))); row 1 (y = 2): -log(e^(-1/3) / (e^-.5 + e^1 + e^(-1/3)))
    row0 = -0.5 + math.log(math.exp(0.5) + math.exp(-1) + math.exp(-1 / 3))
    row1 = 1 / 3 + math.log(math.exp(-0.5) + math.exp(1.0) + math.exp(-1 / 3))
    loss = calibrated_cross_entropy(logits, torch.tensor([0, 2]), counts, 1.0)
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    assert torch.equal(loss, F.cross_entropy(z, torch.tensor([0, 2])))
    # the margin: with counts (1, 81) a sample of the rare class 0 costs more than under the plain
    # cross-entropy (its logit must rise further), one of the common class 1 less
    zero, rare_first = torch.zeros(2, 2), [1, 81]
    calibrated = F.cross_entropy(zero - calibration_offsets(rare_first, 1.0, zero), torch.tensor([0, 1]),
                                 reduction="none")
    assert calibrated[0] > math.log(2) > calibrated[1]  # log 2: the plain loss at equal logits
    # tau = 0: the plain cross-entropy, bit for bit, absent classes included
    assert torch.equal(calibrated_cross_entropy(logits, torch.tensor([0, 1]), [3, 0, 0], 0.0),
                       F.cross_entropy(logits, torch.tensor([0, 1])))


def test_the_plugin_computes_the_guides_add_on_bit_for_bit():
    _, ctx = prepared(**BASE)
    guide_cls = guide_fedlc()
    generator = torch.Generator().manual_seed(0)
    for tau in (0.0, 0.5, 3.0):
        guide = guide_cls(guide_cls.Params(tau=tau))
        plugin = FedLC(FedLCParams(tau=tau))
        for i in range(4):
            client = ctx.client(i)
            logits = torch.randn(7, ctx.num_classes, generator=generator)
            y = client.data.train_y[:7]
            assert torch.equal(plugin.task_loss(ctx, client, logits, y), guide.task_loss(ctx, client, logits, y))


def test_each_client_is_calibrated_by_its_own_counts_not_the_federations():
    _, ctx = prepared(**BASE)
    federation = sum(ctx.data.clients[i].label_counts() for i in range(4))
    logits = torch.randn(10, ctx.num_classes, generator=torch.Generator().manual_seed(1))
    for i in range(4):
        client = ctx.client(i)
        y = client.data.train_y[:10]
        own = calibrated_cross_entropy(logits, y, client.data.label_counts(), 1.0)
        assert torch.equal(FedLC(FedLCParams(tau=1.0)).task_loss(ctx, client, logits, y), own)
        pfllib = calibrated_cross_entropy(logits, y, federation, 1.0)  # PFLlib's global counts
        assert abs(own.item() - pfllib.item()) > 1e-3


# -- in a run --------------------------------------------------------------------------------------


def test_a_round_recomputed_independently_trains_on_each_clients_calibrated_loss():
    engine, ctx = prepared(**BASE, **{"algorithm.params.tau": 2.0})
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(sizes.values())
    expected = mean_of((sizes[i] / total, train_reference(
        ctx, i, start, loss_fn=loss_with_counts(ctx.data.clients[i].label_counts(), 2.0))) for i in range(4))
    assert_close(ctx.server["global"], expected, atol=1e-5)
    plain = mean_of((sizes[i] / total, train_reference(ctx, i, start)) for i in range(4))
    assert far_apart(expected, plain, list(plain), atol=1e-3)  # the test tells FedLC from FedAvg


def test_tau_zero_is_fedavg_bit_for_bit():
    _, lc = run_tiny(**BASE, **{"algorithm.params.tau": 0.0})
    _, avg = run_tiny(**{**BASE, "algorithm.name": "fedavg"})
    assert_same(lc.ctx.server["global"], avg.ctx.server["global"])
    _, calibrated = run_tiny(**BASE)
    assert far_apart(calibrated.ctx.server["global"], avg.ctx.server["global"], list(avg.ctx.server["global"]))
    assert (calibrated.ctx.comm_up, calibrated.ctx.comm_down) == (avg.ctx.comm_up, avg.ctx.comm_down)


def test_each_client_is_scored_with_the_global_models_plain_logits():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for i in range(4):
        models = evaluated_models(ctx, ctx.client(i))
        assert list(models) == [""]
        assert_same(models[""].state_dict(), ctx.server["global"])


def test_a_newcomer_trains_from_the_global_model_on_its_own_calibrated_loss():
    engine, ctx = prepared(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (newcomer,) = ctx.coldstart_clients
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    client = ctx.client(newcomer)
    models = ctx.hooks.coldstart_personalize(ctx=ctx, client=client, message=ctx.broadcast(newcomer))
    counts = ctx.data.clients[newcomer].label_counts()
    expected = train_reference(ctx, newcomer, start, epochs=2, loss_fn=loss_with_counts(counts, 1.0))
    assert_close(models[""].state_dict(), expected, atol=1e-5)
    assert far_apart(expected, train_reference(ctx, newcomer, start, epochs=2), list(expected), atol=1e-3)


def test_with_lost_uploads_the_run_keeps_no_client_state():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 4,
                                         "addons": [{"name": "dropout", "params": {"p": 0.5}}]})
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    assert all(engine.ctx.store[i] == {} for i in range(4))  # nothing to stage: no state at all


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [-0.1, float("nan"), float("inf"), "1", True])
def test_a_bad_tau_is_refused_at_its_key(tau):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"algorithm.params.tau": tau}))
    assert info.value.path == "algorithm.params.tau"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.tau": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.tau") and ">= 0" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "fedlc averages weights" in info.value.message


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {**SKEWED, "model.params.hidden": [8], "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedlc", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):
    overrides = {**BASE, "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


@pytest.mark.gpu
def test_runs_on_cuda_and_tau_zero_is_fedavg_there_too():
    """executor.device = "cuda": the offsets meet CUDA logits (the counts come from the client's
    labels, on the device); a newcomer and lost uploads included."""
    overrides = {**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    result, engine = run_tiny(**overrides)
    assert all(t.device.type == "cuda" for t in engine.ctx.server["global"].values())
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
    _, zero = run_tiny(**{**overrides, "algorithm.params.tau": 0.0})
    _, avg = run_tiny(**{**overrides, "algorithm.name": "fedavg"})
    assert_same(zero.ctx.server["global"], avg.ctx.server["global"])
    assert far_apart(engine.ctx.server["global"], avg.ctx.server["global"], list(avg.ctx.server["global"]))
