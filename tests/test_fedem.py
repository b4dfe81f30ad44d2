"""FedEM (plugins/fedem): the E-step, the M-step and the responsibility-weighted loss by hand,
the mixture of probabilities a client is scored with, a round recomputed independently (each
component trained alone on its q-weighted loss, averaged by n_i), pi carried across rounds and
kept only with a delivered upload, M = 1 as FedAvg, bytes, budget, cold start, bad input, and
bit-identity under the process executor and across a killed-and-resumed run."""

import math
import os
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, prepared, shrink
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core import hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedem import FedEM, Mixture, component_losses, e_step, m_step, weighted_loss

BASE = {"algorithm.name": "fedem", "model.params.hidden": [8], "experiment.rounds": 3}
LN2, LN4 = math.log(2.0), math.log(4.0)


# -- the paper's steps by hand -----------------------------------------------------------------------


def test_the_e_step_weighs_each_component_by_pi_times_exp_minus_loss():
    pi = torch.tensor([0.5, 0.25, 0.25])
    losses = torch.tensor([[0.0, LN2, LN2],    # pi exp(-l) = (0.5, 0.125, 0.125) -> (2/3, 1/6, 1/6)
                           [LN4, 0.0, 0.0]])   # (0.125, 0.25, 0.25) -> (0.2, 0.4, 0.4)
    q = e_step(pi, losses)
    assert torch.allclose(q, torch.tensor([[2 / 3, 1 / 6, 1 / 6], [0.2, 0.4, 0.4]]), atol=1e-6)
    # a component with no weight gets no responsibility, however well it fits
    q = e_step(torch.tensor([0.0, 1.0]), torch.tensor([[0.0, 50.0]]))
    assert q.tolist() == [[0.0, 1.0]]
    # losses large enough that every exp(-l) underflows still give the softmax
    q = e_step(torch.tensor([0.5, 0.5]), torch.tensor([[1000.0, 1000.0 + LN2]]))
    assert torch.allclose(q, torch.tensor([[2 / 3, 1 / 3]]), atol=1e-4)  # float32 near 1000: ulp 6e-5


def test_the_m_step_is_the_mean_responsibility_over_the_samples():
    q = torch.tensor([[2 / 3, 1 / 6, 1 / 6], [0.2, 0.4, 0.4]])
    pi = m_step(q)
    assert torch.allclose(pi, torch.tensor([13 / 30, 17 / 60, 17 / 60]), atol=1e-6)
    assert float(pi.sum()) == pytest.approx(1.0)


def test_the_weighted_loss_by_hand_and_its_gradient():
    # two samples, two components, two classes; logits (0, 0) has cross-entropy ln 2
    logits = torch.zeros(2, 2, 2, requires_grad=True)
    with torch.no_grad():
        logits[1, 0] = torch.tensor([0.0, math.log(3.0)])  # sample 1, component 0: p(y=1) = 3/4
    y = torch.tensor([0, 1])
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    loss = weighted_loss(logits, y, q)
    # component 0: (1 * ln 2 + 0.5 * ln(4/3)) / 2; component 1: (0 + 0.5 * ln 2) / 2
    expected = (LN2 + 0.5 * math.log(4 / 3)) / 2 + 0.5 * LN2 / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert logits.grad[0, 1].abs().sum() == 0  # q = 0: sample 0 does not move component 1
    # d/dlogits of q/B * CE = q/B (softmax - onehot): sample 0, component 0: 1/2 (1/2 - 1, 1/2)
    assert torch.allclose(logits.grad[0, 0], torch.tensor([-0.25, 0.25]))


def fixed(logits):
    """A module answering ``logits`` for every input row."""
    class Fixed(nn.Module):
        def forward(self, x):
            return torch.tensor(logits).expand(len(x), -1)
    return Fixed()


def test_the_client_predicts_with_the_mixture_of_probabilities_not_of_logits():
    a, b = fixed([10.0, 0.0]), fixed([0.0, 1.0])
    pi = torch.tensor([0.3, 0.7])
    out = Mixture([a, b], pi)(torch.zeros(1, 4))
    p_a, p_b = F.softmax(torch.tensor([10.0, 0.0]), 0), F.softmax(torch.tensor([0.0, 1.0]), 0)
    expected = 0.3 * p_a + 0.7 * p_b  # (0.488, 0.512): class 1
    assert torch.allclose(out.exp()[0], expected, atol=1e-6)
    assert int(out.argmax()) == 1
    # mixing the logits (FL-bench's predictor) gives 0.3 (10, 0) + 0.7 (0, 1) = (3, 0.7): class 0
    assert int((0.3 * torch.tensor([10.0, 0.0]) + 0.7 * torch.tensor([0.0, 1.0])).argmax()) == 0
    # the evaluation's cross-entropy on the output is the mixture's negative log-likelihood
    assert float(F.cross_entropy(out, torch.tensor([1]))) == pytest.approx(-math.log(float(expected[1])), rel=1e-5)


def test_the_losses_of_the_e_step_are_taken_in_eval_mode_over_every_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x, y = torch.randn(7, 3), torch.randint(0, 2, (7,))
    losses = component_losses([model, model], x, y, batch_size=3)  # batches of 3, 3 and 1
    model.eval()
    expected = F.cross_entropy(model(x), y, reduction="none")
    assert losses.shape == (7, 2)
    assert torch.allclose(losses[:, 0], expected) and torch.allclose(losses[:, 1], expected)
    model.train()
    component_losses([model], x, y, batch_size=3)
    assert model.training  # the module's mode is given back


# -- in a run ------------------------------------------------------------------------------------------


def test_the_components_start_apart_the_first_one_at_the_runs_initial_weights():
    _, ctx = prepared(**BASE)
    components = ctx.server["components"]
    assert len(components) == 3
    assert_same(components[0], ctx.models.initial_state("mlp"))
    keys = list(components[0])
    assert far_apart(components[0], components[1], keys) and far_apart(components[1], components[2], keys)
    _, again = prepared(**BASE)
    for mine, theirs in zip(components, again.server["components"]):
        assert_same(mine, theirs)  # seeded


def model_state(ctx, state):
    model = ctx.models.build("mlp")
    model.load_state_dict(state)
    return model


def losses_of(ctx, components, client_id):
    data = ctx.data.clients[client_id]
    return component_losses([model_state(ctx, s) for s in components], data.train_x, data.train_y, 1024)


def one_component_alone(ctx, client_id, state, q_column):
    """Component m trained alone by its LocalSolver: plain SGD on 1/|B| sum q_im l_i, the client's
    seeded batch order for this round (a loop of its own: shares nothing with the plugin's)."""
    model = model_state(ctx, state)
    client = ctx.client(client_id)
    labels = client.data.train_y

    def loss(model, x, index, logits):
        return (F.cross_entropy(logits, labels[index], reduction="none") * q_column[index]).sum() / len(index)

    client.train(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=ctx.spec.training.lr),
                 y=torch.arange(len(labels)), loss_fn=loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_round_recomputed_by_hand_each_component_alone_then_averaged_by_sample_count():
    engine, ctx = prepared(**BASE)
    shrink(ctx, {0: 30, 1: 50, 2: 70})  # unequal n_i: weights n_i / n
    start = [{k: v.clone() for k, v in s.items()} for s in ctx.server["components"]]
    uniform = torch.full((3,), 1 / 3)
    q = {i: e_step(uniform, losses_of(ctx, start, i)) for i in range(4)}
    engine.run_round(ctx, 1)
    for i in range(4):
        assert torch.allclose(ctx.store[i]["pi"], m_step(q[i]), atol=1e-6)  # (M-pi) after (E)
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    n = sum(sizes.values())
    for m in range(3):
        trained = {i: one_component_alone(ctx, i, start[m], q[i][:, m]) for i in range(4)}
        expected = {k: sum(sizes[i] / n * trained[i][k] for i in range(4)) for k in start[m]}
        assert_close(ctx.server["components"][m], expected, atol=1e-5)
    # the responsibilities matter: component 0 trained on the plain loss lands elsewhere
    plain = {i: one_component_alone(ctx, i, start[0], torch.ones(sizes[i])) for i in range(4)}
    unweighted = {k: sum(sizes[i] / n * plain[i][k] for i in range(4)) for k in start[0]}
    assert far_apart(ctx.server["components"][0], unweighted, list(unweighted), atol=1e-3)


def test_the_e_step_starts_from_the_pi_the_client_kept_round_after_round():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    engine.run_round(ctx, 2)
    kept = torch.tensor([0.98, 0.01, 0.01])
    ctx.store[0]["pi"] = kept  # as if rounds 1-2 had made client 0 favour component 0
    start = [{k: v.clone() for k, v in s.items()} for s in ctx.server["components"]]
    losses = losses_of(ctx, start, 0)
    engine.run_round(ctx, 3)
    expected = m_step(e_step(kept, losses))
    assert torch.allclose(ctx.store[0]["pi"], expected, atol=1e-6)
    assert far_apart({"pi": expected}, {"pi": m_step(e_step(torch.full((3,), 1 / 3), losses))}, ["pi"], atol=1e-3)


def test_each_client_is_scored_with_its_own_mixture_of_the_current_components():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    x = ctx.data.clients[0].test_x
    fresh = evaluated_models(ctx, ctx.client(0))[""]  # before any round: pi = 1/3
    probs = sum(F.softmax(model_state(ctx, s)(x), dim=1) / 3 for s in ctx.server["components"])
    assert torch.allclose(fresh(x).exp(), probs, atol=1e-5)
    engine.run_round(ctx, 1)
    took_part = [i for i in range(4) if "pi" in ctx.store[i]]
    assert 0 < len(took_part) < 4
    for i in range(4):
        x = ctx.data.clients[i].test_x
        pi = ctx.store[i]["pi"] if i in took_part else torch.full((3,), 1 / 3)
        models = [model_state(ctx, s).eval() for s in ctx.server["components"]]
        probs = sum(pi[m] * F.softmax(models[m](x), dim=1) for m in range(3))
        mixture = evaluated_models(ctx, ctx.client(i))[""]
        assert torch.allclose(mixture(x).exp(), probs, atol=1e-5)


def test_one_component_is_fedavg_bit_for_bit():
    fedem, fedem_engine = run_tiny(**{**BASE, "algorithm.params.M": 1})
    fedavg, fedavg_engine = run_tiny(**{**BASE, "algorithm.name": "fedavg"})
    assert_same(fedem_engine.ctx.server["components"][0], fedavg_engine.ctx.server["global"])
    assert [r["acc"] for r in fedem.client_rows] == [r["acc"] for r in fedavg.client_rows]
    assert fedem.final["loss_mean"] == pytest.approx(fedavg.final["loss_mean"], rel=1e-5)


def test_bytes_are_m_models_each_way_and_the_budget_m_passes_per_epoch():
    result, engine = run_tiny(**{**BASE, "experiment.rounds": 2, "training.local_epochs": 2})
    ctx = engine.ctx
    model_bytes = sum(t.numel() * t.element_size() for t in ctx.models.initial_state("mlp").values())
    assert ctx.comm_down == ctx.comm_up == 2 * 4 * 3 * model_bytes  # rounds x clients x M models
    assert FedEM(FedEM.Params(M=3)).local_work(ctx.spec).private_epochs_per_round == 6.0
    assert result.final["budget.private_epochs"] == pytest.approx(2 * 3 * 2)  # rounds x M x epochs
    batches = sum(len(range(0, c.num_train - c.num_train % 10, 10)) for c in ctx.data.clients) / 4
    assert result.final["budget.private_steps"] == pytest.approx(2 * 2 * 3 * batches)  # one step per model


# -- lost uploads --------------------------------------------------------------------------------------


def dropout_run(p, rounds=4, executor="sequential", algorithm=FedEM):
    raw = tiny_raw(**{**BASE, "experiment.rounds": rounds, "executor.name": executor,
                      "addons": [{"name": "dropout", "params": {"p": p}}]})
    resolved = resolve(raw)
    resolved.plugins[-1] = algorithm(resolved.plugins[-1].params)
    engine = Engine(resolved, progress=False)
    return engine.run(), engine


class RecordingFedEM(FedEM):
    """FedEM that remembers the pi each client computed each round (sequential runs only)."""

    computed: ClassVar[dict] = {}

    @hookimpl
    def local_train(self, ctx, client):
        metrics = super().local_train(ctx, client)
        RecordingFedEM.computed[(ctx.round, client.id)] = client.staged["pi"].clone()
        return metrics


class EagerFedEM(FedEM):
    """The bug the lost-upload rule prevents: pi advances even when the upload is lost."""

    @hookimpl
    def local_train(self, ctx, client):
        metrics = super().local_train(ctx, client)
        client.state["pi"] = client.staged.pop("pi")
        return metrics


def test_a_client_keeps_the_pi_of_its_last_delivered_upload():
    RecordingFedEM.computed = {}
    result, engine = dropout_run(0.5, rounds=5, algorithm=RecordingFedEM)
    seed = engine.ctx.spec.experiment.seed
    lost = {(r, i) for r in range(1, 6) for i in range(4) if upload_is_lost(seed, r, i, 0.5)}
    assert lost and any(r > 2 for r, _ in lost)  # losses after the rounds where "last" and "first" coincide
    assert sum(row.get("dropped_clients", 0) for row in result.history) == len(lost)
    for i in range(4):
        delivered = [r for r in range(1, 6) if (r, i) not in lost]
        if delivered:
            assert torch.equal(engine.ctx.store[i]["pi"], RecordingFedEM.computed[(delivered[-1], i)])
        else:
            assert "pi" not in engine.ctx.store[i]


def test_pi_that_advanced_on_a_lost_upload_is_caught():
    _, kept = dropout_run(0.5, rounds=5)
    _, eager = dropout_run(0.5, rounds=5, algorithm=EagerFedEM)
    assert any(not torch.equal(kept.ctx.store[i]["pi"], eager.ctx.store[i]["pi"]) for i in range(4)
               if "pi" in kept.ctx.store[i])


def test_when_every_upload_is_lost_nothing_moves():
    _, engine = dropout_run(1.0, rounds=2)
    _, start = prepared(**BASE)
    for now, before in zip(engine.ctx.server["components"], start.server["components"]):
        assert_same(now, before)
    assert all("pi" not in engine.ctx.store[i] for i in range(4))


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedem", rounds=3, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "fedem", "model.params.hidden": [8], "experiment.participation": 0.5}
    assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)


# -- cold start ----------------------------------------------------------------------------------------


def test_a_newcomer_runs_em_on_pi_alone_with_the_components_fixed():
    _, ctx = prepared(**BASE, **{"experiment.coldstart_epochs": 2})
    components = [{k: v.clone() for k, v in s.items()} for s in ctx.server["components"]]
    client = ctx.client(1)
    models = FedEM(FedEM.Params(M=3)).coldstart_personalize(ctx, client, {"components": components})
    losses = losses_of(ctx, components, 1)
    pi = m_step(e_step(m_step(e_step(torch.full((3,), 1 / 3), losses)), losses))  # two EM iterations
    assert torch.allclose(client.state["pi"], pi, atol=1e-6)
    assert far_apart({"pi": pi}, {"pi": m_step(e_step(torch.full((3,), 1 / 3), losses))}, ["pi"], atol=1e-4)
    mixture = models[""]
    for module, state in zip(mixture.components, components):
        assert_same(module.state_dict(), state)  # not trained


def test_a_cold_start_run_scores_its_newcomers():
    result, _ = run_tiny(**{**BASE, "partition.num_clients": 4, "experiment.coldstart_clients": 1})
    assert 0 <= result.final["coldstart_acc_mean"] <= 1


# -- parameters and the spec -------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True])
def test_m_must_be_a_positive_integer(value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "algorithm.params.M": value}))
    assert info.value.path == "algorithm.params.M"


def test_clients_of_different_architectures_are_refused_in_one_line(tmp_path, capsys):
    raw = tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]})
    assert "model.pool" in dry_run_error(tmp_path, capsys, raw)


@pytest.mark.gpu
def test_runs_on_cuda_with_lost_uploads_and_a_newcomer():
    """executor.device = "cuda": the E-step's losses, the positions used as the loop's labels,
    the staged pi and the evaluated mixture all meet CUDA tensors."""
    result, engine = run_tiny(**{**BASE, "executor.device": "cuda", "experiment.coldstart_clients": 1,
                                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]})
    ctx = engine.ctx
    assert all(t.device.type == "cuda" for state in ctx.server["components"] for t in state.values())
    kept = [ctx.store[i]["pi"] for i in ctx.training_clients if "pi" in ctx.store[i]]
    assert kept and all(pi.device.type == "cuda" and float(pi.sum()) == pytest.approx(1.0, abs=1e-5) for pi in kept)
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
    _, one_engine = run_tiny(**{**BASE, "executor.device": "cuda", "algorithm.params.M": 1})
    _, fedavg_engine = run_tiny(**{**BASE, "executor.device": "cuda", "algorithm.name": "fedavg"})
    assert_same(one_engine.ctx.server["components"][0], fedavg_engine.ctx.server["global"])  # M = 1 on CUDA too
