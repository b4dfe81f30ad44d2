"""FedKD (plugins/fedkd): the energy schedule (E1) and the truncated SVD (E2) by hand, the adaptive
mutual distillation losses (L2)-(L4) and their gradients by hand, a client's round recomputed
independently, the server's compressed mean, who receives an update and who the whole model
(lost uploads, clients that sat out), the mentor evaluated, bytes, bad input, the process
executor and a killed run's resume."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, far_apart, prepared, recorded_training
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.payload import nbytes
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedkd import (
    FedKD,
    FedKDParams,
    apply_update,
    compress,
    decompress,
    energy,
    fedkd_losses,
    kept_rank,
)

BASE = {"algorithm.name": "fedkd", "model.params.hidden": [8], "partition.scheme": "dirichlet",
        "partition.params": {"alpha": 0.5}}
WEIGHTS = ["fc1.weight", "fc2.weight"]  # the matrices (E2) compresses; the biases travel dense


# -- (E1) and (E2) by hand -------------------------------------------------------------------------


def test_the_energy_schedule_runs_from_t_start_in_round_1_to_t_end_in_the_last():
    assert [energy(r, 5, 0.5, 0.9) for r in range(1, 6)] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert energy(2, 3, 0.9, 0.9) == 0.9 and energy(1, 1, 0.5, 0.9) == 0.9
    # an off-by-one (the authors' r / R) would give 0.58 in round 1 and 0.74 in round 3
    assert energy(1, 5, 0.5, 0.9) != pytest.approx(0.5 + 0.4 / 5)


def test_the_kept_rank_is_the_smallest_reaching_the_energy_share():
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert kept_rank(s, 0.5) == 1  # 9/14 = 0.64
    assert kept_rank(s, 0.7) == 2  # 9/14 < 0.7 <= 13/14
    assert kept_rank(s, 13 / 14) == 2  # exactly reached: >=
    assert kept_rank(s, 0.95) == 3
    assert kept_rank(s, 1.0) == 3  # every value (the references' loop keeps none here)
    assert kept_rank(torch.zeros(3), 0.9) == 0


def test_compression_sends_the_truncated_factors_and_reconstructs_the_rank_k_matrix():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    v = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    G = u @ torch.diag(torch.tensor([3.0, 1.0])) @ v  # 3 x 4, singular values 3 and 1 (energies 9, 1)
    delta = {"w": G, "b": torch.tensor([1.0, 2.0, 3.0]), "n": torch.tensor(5)}
    low = compress(delta, 0.8)  # 9/10 >= 0.8: one value
    assert set(low["w"]) == {"u", "s", "v"} and low["w"]["u"].shape == (3, 1) and low["w"]["v"].shape == (1, 4)
    assert nbytes(low["w"]) == 4 * (3 + 1 + 4)  # K (m + n + 1) floats
    assert torch.equal(low["b"], delta["b"]) and torch.equal(low["n"], delta["n"])
    out = decompress(low, delta)
    assert torch.allclose(out["w"], torch.tensor([[3.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]), atol=1e-6)
    assert torch.allclose(decompress(compress(delta, 0.95), delta)["w"], G, atol=1e-6)  # both values
    assert out["w"].dtype == torch.float32


def test_a_conv_kernel_is_compressed_as_out_by_in_times_kernel():
    kernel = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    packed = compress({"k": kernel}, 1.0)["k"]
    assert packed["u"].shape == (4, 4) and packed["v"].shape == (4, 12)
    assert torch.allclose(decompress({"k": packed}, {"k": kernel})["k"], kernel, atol=1e-5)


def test_an_update_adds_to_floating_tensors_and_replaces_counters():
    base = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    out = apply_update(base, {"w": torch.tensor([0.5, -1.0]), "n": torch.tensor(7)})
    assert torch.equal(out["w"], torch.tensor([1.5, 1.0])) and int(out["n"]) == 7


# -- (L2)-(L4) by hand -----------------------------------------------------------------------------


def test_the_mutual_losses_by_hand_and_each_model_learns_only_from_its_own():
    z_T = torch.tensor([[2.0, 0.0]], requires_grad=True)
    z_S = torch.tensor([[0.0, 1.0]], requires_grad=True)
    H_T = torch.tensor([[1.0, 2.0]], requires_grad=True)
    H_S = torch.tensor([[0.0, 1.0]], requires_grad=True)
    W_T, W_S = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        W_T.weight.copy_(torch.eye(2))
        W_S.weight.copy_(2 * torch.eye(2))
    y = torch.tensor([0])
    task_T, task_S = F.cross_entropy(z_T, y), F.cross_entropy(z_S, y)
    mentor, mentee = fedkd_losses(task_T, task_S, z_T, z_S, H_T, H_S, W_T, W_S)
    p_T, p_S = F.softmax(z_T, 1).detach()[0], F.softmax(z_S, 1).detach()[0]
    a = 1 / (task_T.item() + task_S.item())
    kl_S_T = float((p_S * (p_S / p_T).log()).sum())  # KL(p_S || p_T)
    kl_T_S = float((p_T * (p_T / p_S).log()).sum())
    # MSE(H_T, W_T H_S) = ((1 - 0)^2 + (2 - 1)^2) / 2 = 1;  MSE(H_T, W_S H_S) = (1 + 0) / 2
    assert mentor.item() == pytest.approx(task_T.item() + a * kl_S_T + a * 1.0, rel=1e-6)
    assert mentee.item() == pytest.approx(task_S.item() + a * kl_T_S + a * 0.5, rel=1e-6)
    mentor.backward()
    assert z_S.grad is None and H_S.grad is None and W_S.weight.grad is None  # constants in the mentor's loss
    assert W_T.weight.grad is not None
    # the weight a is a constant: the gradient is the task loss's plus a times the cross terms'
    z = z_T.detach().clone().requires_grad_(True)
    (F.cross_entropy(z, y) + a * F.kl_div(F.log_softmax(z, 1), p_S[None], reduction="batchmean")).backward()
    assert torch.allclose(z_T.grad, z.grad, atol=1e-6)
    mentee.backward()
    assert torch.equal(z_T.grad, z.grad)  # the mentee's loss adds nothing to the mentor's logits
    assert z_S.grad is not None and H_S.grad is not None and W_S.weight.grad is not None


# -- in a run --------------------------------------------------------------------------------------


class ReferencePair(nn.Module):
    """Mentor and mentee written out again for the recomputation: logits of both and the
    classifier inputs (MLP with one hidden layer: relu(fc1 x))."""

    def __init__(self, mentor, mentee):
        super().__init__()
        self.mentor, self.mentee = mentor, mentee
        self.W_T, self.W_S = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.W_T.weight.copy_(torch.eye(8))
            self.W_S.weight.copy_(torch.eye(8))

    def features(self, model, x):
        return F.relu(model.fc1(x.flatten(1)))

    def forward(self, x):
        self.H_T, self.H_S = self.features(self.mentor, x), self.features(self.mentee, x)
        self.z_S = self.mentee.fc2(self.H_S)
        return self.mentor.fc2(self.H_T)


def reference_loss(model, x, y, z_T):
    z_S, H_T, H_S = model.z_S, model.H_T, model.H_S
    ce_T, ce_S = F.cross_entropy(z_T, y), F.cross_entropy(z_S, y)
    a = 1.0 / (ce_T.item() + ce_S.item())

    def kl(z, target):
        return F.kl_div(F.log_softmax(z, 1), F.softmax(target.detach(), 1), reduction="batchmean")

    mentor = ce_T + a * kl(z_T, z_S) + a * ((H_T - model.W_T(H_S.detach())) ** 2).mean()
    mentee = ce_S + a * kl(z_S, z_T) + a * ((H_T.detach() - model.W_S(H_S)) ** 2).mean()
    return mentor + mentee


def test_a_clients_round_recomputed_independently(monkeypatch):
    uploads = record_uploads(monkeypatch)  # before the plugin is registered
    engine, ctx = prepared(**BASE)
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)
    client = ctx.client(0)
    mentor, mentee = ctx.models.build("mlp"), ctx.models.build("mlp")
    mentor.load_state_dict(ctx.models.initial_state("mlp"))
    mentee.load_state_dict(start)
    pair = ReferencePair(mentor, mentee)
    client.train(pair, optimizer=torch.optim.SGD(pair.parameters(), lr=ctx.spec.training.lr), loss_fn=reference_loss)
    assert_close(ctx.store[0]["mentor"], mentor.state_dict(), atol=1e-5)
    assert_close(ctx.store[0]["projections"], {"W_T.weight": pair.W_T.weight, "W_S.weight": pair.W_S.weight}, atol=1e-5)
    sent = decompress(uploads[1][0], start)
    delta = {k: mentee.state_dict()[k] - start[k] for k in start}
    assert_close(sent, decompress(compress(delta, 0.95), start), atol=1e-5)  # round 1 of 3 at T_start
    assert far_apart(ctx.store[0]["mentor"], ctx.models.initial_state("mlp"), WEIGHTS)  # the mentor trained
    assert far_apart(sent, delta, WEIGHTS, atol=1e-5)  # and the upload is truncated, not the whole update


def test_round_after_round_the_mentor_and_projections_continue_from_the_clients_own(monkeypatch):
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 4})
    for r in (1, 2, 3):
        kept = {i: {"mentor": dict(ctx.store[i].get("mentor") or ctx.models.initial_state("mlp")),
                    "projections": dict(ctx.store[i].get("projections") or {})} for i in range(4)}
        w_r = {k: v.clone() for k, v in ctx.server["global"].items()}
        with recorded_training(monkeypatch) as calls:
            engine.run_round(ctx, r)
        assert [c["client"] for c in calls] == [0, 1, 2, 3]
        for call in calls:
            before, i = call["before"], call["client"]
            assert_same({k[len("mentor."):]: v for k, v in before.items() if k.startswith("mentor.")}, kept[i]["mentor"])
            assert_same({k[len("mentee."):]: v for k, v in before.items() if k.startswith("mentee.")}, w_r)
            projections = {k[len("projections."):]: v for k, v in before.items() if k.startswith("projections.")}
            if r == 1:  # identities before any training
                assert all(torch.equal(v, torch.eye(8)) for v in projections.values()) and len(projections) == 2
            else:
                assert_same(projections, kept[i]["projections"])
            if r == 3:  # round 1 leaves them at I (mentor = mentee all round: every cross term 0); round 2 moved them
                assert not torch.equal(projections["W_T.weight"], torch.eye(8))


def record_uploads(monkeypatch) -> dict:
    """{round: {client: the uploaded compressed update}}, recorded from FedKD.client_upload."""
    seen = {}
    original = FedKD.client_upload

    @hookimpl
    def spy(self, ctx, client):
        out = original(self, ctx, client)
        seen.setdefault(ctx.round, {})[client.id] = out["update"]
        return out

    monkeypatch.setattr(FedKD, "client_upload", spy)
    return seen


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_the_server_adds_the_compressed_mean_of_the_decompressed_updates(monkeypatch, weighting):
    uploads = record_uploads(monkeypatch)
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 4, "algorithm.params.T_start": 0.5,
                                      "algorithm.params.T_end": 0.95, "algorithm.params.weighting": weighting})
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    assert len(set(sizes.values())) > 1  # unequal clients: the two weightings differ
    changed = []
    for r in (1, 2, 3):
        before = {k: v.clone() for k, v in ctx.server["global"].items()}
        engine.run_round(ctx, r)
        w = {i: (0.25 if weighting == "uniform" else sizes[i] / sum(sizes.values())) for i in range(4)}
        mean = {k: sum(w[i] * decompress(uploads[r][i], before)[k].double() for i in range(4)).float() for k in before}
        share = 0.5 + 0.45 * (r - 1) / 3  # (E1): 0.5, 0.65, 0.8
        expected = {k: before[k] + decompress(compress(mean, share), before)[k] for k in before}
        assert_close(ctx.server["global"], expected, atol=1e-6)
        assert far_apart(expected, {k: before[k] + mean[k] for k in before}, WEIGHTS, atol=1e-6)  # truncated
        # the authors' offset (r / R) would have kept a different energy share: another global model
        offset = 0.5 + 0.45 * r / 4
        shifted = {k: before[k] + decompress(compress(mean, offset), before)[k] for k in before}
        changed.append(far_apart(expected, shifted, WEIGHTS, atol=1e-6))
    assert any(changed)


def test_a_client_whose_upload_arrived_gets_the_update_and_rebuilds_the_servers_model_bit_for_bit():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 4})
    engine.run_round(ctx, 1)
    w2 = {k: v.clone() for k, v in ctx.server["global"].items()}
    assert ctx.server["holders"] == [0, 1, 2, 3]
    assert set(ctx.broadcast(0)) == {"update"}
    down = ctx.comm_down
    engine.run_round(ctx, 2)
    for i in range(4):  # on_receive: w^1 + Delta^ = w^2, the server's bits
        assert_same(ctx.store[i]["mentee"], w2)
    full = nbytes({"weights": w2})
    assert ctx.comm_down - down < 4 * full  # factors, not four whole models


def test_clients_that_sat_out_or_lost_their_upload_get_the_whole_model():
    result, engine = run_tiny(**BASE, **{"experiment.rounds": 5, "experiment.participation": 0.5,
                                         "addons": [{"name": "dropout", "params": {"p": 0.4}}]})
    assert sum(row.get("dropped_clients", 0) for row in result.history) > 0
    ctx = engine.ctx
    holders = ctx.server["holders"]
    for i in range(4):
        assert set(engine.ctx.hooks.on_broadcast(ctx=ctx, client_id=i)) == ({"update"} if i in holders else {"weights"})


def test_the_mentee_base_always_matches_the_servers_model_it_was_sent(monkeypatch):
    # round by round, with lost uploads and half the clients: each participant's w^r is the server's w^r
    kinds = []
    original = FedKD.on_broadcast

    @hookimpl
    def spy(self, ctx, client_id):
        out = original(self, ctx, client_id)
        kinds.append(set(out))
        return out

    monkeypatch.setattr(FedKD, "on_broadcast", spy)
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 6, "experiment.participation": 0.5,
                                      "addons": [{"name": "dropout", "params": {"p": 0.4}}]})
    for r in range(1, 7):
        w_r = {k: v.clone() for k, v in ctx.server["global"].items()}
        engine.run_round(ctx, r)
        for i in ctx.participants:
            assert_same(ctx.store[i]["mentee"], w_r)
    assert {"update"} in kinds and {"weights"} in kinds[4:]  # both kinds after round 2


def test_a_round_where_nothing_arrives_drops_its_participants_from_the_holders():
    engine, ctx = prepared(**BASE, **{"experiment.rounds": 4, "addons": [{"name": "dropout", "params": {"p": 1.0}}]})
    zero = {k: torch.zeros_like(v) for k, v in ctx.server["global"].items()}
    ctx.server["holders"], ctx.server["update"] = [0, 1, 2, 3], compress(zero, 0.9)
    for i in range(4):  # as if each held the model before a zero update
        ctx.store[i]["mentee"] = {k: v.clone() for k, v in ctx.server["global"].items()}
    engine.run_round(ctx, 1)  # every upload lost: no aggregate
    assert ctx.server["holders"] == []


def test_each_client_is_scored_with_its_mentor():
    _, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(model, ctx.store[i]["mentor"])
        assert far_apart(model, ctx.server["global"], WEIGHTS)


def test_a_client_that_never_trained_is_scored_with_the_initial_weights():
    _, ctx = prepared(**BASE)
    model = evaluated_models(ctx, ctx.client(2))[""].state_dict()
    assert_same(model, ctx.models.initial_state("mlp"))


def test_the_upload_is_the_factors_and_both_models_count_as_work():
    _, engine = run_tiny(**BASE, **{"experiment.rounds": 1})
    _, avg = run_tiny(**{**BASE, "algorithm.name": "fedavg", "experiment.rounds": 1})
    assert engine.ctx.comm_up < avg.ctx.comm_up  # T_end = 0.98 of 8-wide matrices: fewer numbers
    assert engine.ctx.comm_down == avg.ctx.comm_down  # round 1: everyone gets w^1 whole
    assert FedKD(FedKDParams()).local_work(engine.spec).private_epochs_per_round == 2.0


def test_a_newcomer_gets_the_whole_model_and_is_scored_with_its_fresh_mentor():
    engine, ctx = prepared(**BASE, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (newcomer,) = ctx.coldstart_clients
    message = ctx.broadcast(newcomer)
    assert set(message) == {"weights"}
    models = ctx.hooks.coldstart_personalize(ctx=ctx, client=ctx.client(newcomer), message=message)
    assert_same(models[""].state_dict(), ctx.store[newcomer]["mentor"])
    assert far_apart(ctx.store[newcomer]["mentor"], ctx.models.initial_state("mlp"), WEIGHTS)


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("T_start", 0.0), ("T_start", 1.5), ("T_end", float("nan")),
                                       ("T_start", "0.9"), ("weighting", "mean")])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{f"algorithm.params.{key}": value}))
    assert info.value.path == f"algorithm.params.{key}"


def test_t_end_below_t_start_is_one_line_naming_t_end(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.T_start": 0.9,
                                                               "algorithm.params.T_end": 0.8}))
    assert line.startswith("pfl-run: error: algorithm.params.T_end") and "T_start" in line


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"


# -- executors and resume --------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {**BASE, "experiment.participation": 0.75, "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedkd", rounds=4, **overrides)


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
