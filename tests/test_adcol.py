"""ADCOL (plugins/adcol): the adversarial term by hand, three engine rounds under partial
participation recomputed independently (each client's own model trained on cross-entropy plus
mu * KL(u || D_t(z)) against the discriminator it received, the representations it uploads, the
server's discriminator training on them labelled by client index; round 3 checks that both keep
accumulating), no model averaging, mu = 0 is Local bit for bit, what is evaluated, lost uploads,
cold start, bytes, bad input, process executor and resume bit-identical."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import (
    assert_close,
    assert_same,
    dry_run_error,
    far_apart,
    prepared,
    record_messages,
    refused_at_key,
    train_reference,
)
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_core.seeding import torch_generator
from pfl_plugins.adcol import ADCOLParams, Discriminator, kl_from_uniform
from pfl_plugins.faults import upload_is_lost

MU = 2.0
BASE = {"algorithm.name": "adcol", "model.params.hidden": [8], "algorithm.params.hidden": 6,
        "algorithm.params.mu": MU, "algorithm.params.dis_lr": 0.5}
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


# -- the adversarial term by hand ----------------------------------------------------------------


def test_the_term_is_the_batch_mean_of_kl_from_uniform_to_the_discriminators_softmax():
    assert kl_from_uniform(torch.zeros(3, 4)).item() == pytest.approx(0.0, abs=1e-7)  # already uniform
    # N = 2, p = (3/4, 1/4): KL(u || p) = 1/2 log(1/2 / 3/4) + 1/2 log(1/2 / 1/4) = 1/2 log(4/3)
    one = torch.tensor([[math.log(3.0), 0.0]])
    assert kl_from_uniform(one).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    # a batch of that row and a uniform one: the mean, not the sum
    assert kl_from_uniform(torch.cat([one, torch.zeros(1, 2)])).item() == pytest.approx(0.25 * math.log(4 / 3), rel=1e-6)
    # KL(u || p), not KL(p || u): p = (0.9, 0.1, 0) is not the same in the two directions
    p = torch.tensor([[0.6, 0.3, 0.1]])
    expected = sum(1 / 3 * math.log((1 / 3) / q) for q in p[0].tolist())
    assert kl_from_uniform(p.log()).item() == pytest.approx(expected, rel=1e-6)


def test_the_term_pushes_the_representation_towards_where_the_discriminator_is_uncertain():
    logits = torch.tensor([[2.0, 0.0]], requires_grad=True)
    kl_from_uniform(logits).backward()
    # d/dl_1 of -log 2 - (log p_1 + log p_2) / 2 = p_1 - 1/2 > 0: descending lowers the confident logit
    p1 = torch.softmax(logits.detach(), 1)[0, 0].item()
    assert logits.grad[0].tolist() == pytest.approx([p1 - 0.5, 0.5 - p1], rel=1e-6)


def test_the_discriminator_is_flbenchs_shape_without_biases():
    d = Discriminator(5, 7, 3)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items() if v.dim() == 2}
    assert shapes == {"layers.0.weight": (7, 5), "layers.3.weight": (7, 7), "layers.6.weight": (3, 7)}
    assert not any("bias" in k and k.startswith(("layers.0", "layers.3", "layers.6")) for k in d.state_dict())
    assert d(torch.randn(4, 5)).shape == (4, 3)


# -- three rounds recomputed ----------------------------------------------------------------------


def representation(model, x):
    """z = relu(fc1(x)): the input of the MLP's classifier fc2, written out."""
    return F.relu(model.fc1(x.flatten(1)))


def frozen(ctx, state):
    d = Discriminator(state["layers.0.weight"].shape[1], state["layers.0.weight"].shape[0],
                      state["layers.6.weight"].shape[0])
    d.load_state_dict(state)
    d.eval()
    d.requires_grad_(False)
    return d


def reference_client(ctx, i, own, d_state, mu):
    """Client i's model after (A2): CE + mu * sum_k u_k (log u_k - log p_k), batch mean."""
    d = frozen(ctx, d_state)

    def loss(model, x, y, logits):
        log_p = F.log_softmax(d(representation(model, x)), dim=1)
        u = torch.full_like(log_p, 1 / log_p.shape[1])
        return F.cross_entropy(logits, y) + mu * (u * (u.log() - log_p)).sum(1).mean()

    return train_reference(ctx, i, own, loss_fn=loss)


def reference_server(ctx, round, d_state, uploads, lr, epochs, batch):
    """(A4) written out: SGD on CE(D(z), index of z's client in the training clients)."""
    d = Discriminator(d_state["layers.0.weight"].shape[1], d_state["layers.0.weight"].shape[0],
                      d_state["layers.6.weight"].shape[0])
    d.load_state_dict(d_state)
    d.train()
    ids = sorted(uploads)
    z = torch.cat([uploads[i] for i in ids])
    owner = torch.cat([torch.full((len(uploads[i]),), ctx.training_clients.index(i)) for i in ids])
    generator = torch_generator(ctx.spec.experiment.seed, "adcol:discriminator", round)
    optimizer = torch.optim.SGD(d.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(owner), generator=generator)
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            if len(rows) > 1:
                optimizer.zero_grad()
                F.cross_entropy(d(z[rows]), owner[rows]).backward()
                optimizer.step()
    return {k: v.detach().clone() for k, v in d.state_dict().items()}


def test_three_rounds_with_partial_participation_recomputed():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.75, "algorithm.params.dis_epochs": 2})
    initial = ctx.models.initial_state("mlp")
    own = {i: {k: v.clone() for k, v in initial.items()} for i in range(4)}
    d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    sent, uploads = record_messages(ctx, "on_broadcast"), record_messages(ctx, "client_upload")
    idle_seen = False
    for t in (1, 2, 3):
        sent.clear()
        uploads.clear()
        engine.run_round(ctx, t)
        participants = list(ctx.participants)
        assert len(participants) == 3
        for i in participants:
            assert_same(sent[i]["discriminator"], d_state)  # (A1): D_t, the same for everyone
            expected = reference_client(ctx, i, own[i], d_state, MU)
            assert_close(ctx.store[i]["weights"], expected, PARAMS, atol=1e-5)
            trained = {k: v.clone() for k, v in ctx.store[i]["weights"].items()}
            # (A3): one representation per training sample, of the trained model
            model = ctx.models.build("mlp")
            model.load_state_dict(trained)
            with torch.no_grad():
                assert_close({"z": uploads[i]["representations"]},
                             {"z": representation(model, ctx.data.clients[i].train_x)}, atol=1e-6)
            own[i] = trained
        for i in set(range(4)) - set(participants):  # an idle client's model waits for it
            idle_seen = idle_seen or t > 1
            assert_same(ctx.store[i].get("weights", initial), own[i], PARAMS)
        expected_d = reference_server(ctx, t, d_state, {i: uploads[i]["representations"] for i in participants},
                                      lr=0.5, epochs=2, batch=ctx.spec.training.batch_size)
        assert_close(ctx.server["discriminator"], expected_d, atol=1e-5)
        assert far_apart(ctx.server["discriminator"], d_state, ["layers.6.weight"])
        d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    assert idle_seen


def test_the_clients_learn_to_fool_the_discriminator_and_the_server_learns_to_tell_them_apart():
    def round_two(mu):
        result, _ = run_tiny(**{**BASE, "algorithm.params.mu": mu})
        return result.history[1]

    adversarial, alone = round_two(MU), round_two(0.0)
    # D_1 on round 2's representations: trained against it they are attributed to their client
    # far less often than representations trained without the term
    assert adversarial["adcol_discriminator_acc_before"] < alone["adcol_discriminator_acc_before"] - 0.3
    # and the server's training then tells them apart again
    assert adversarial["adcol_discriminator_acc"] > adversarial["adcol_discriminator_acc_before"] + 0.3


def test_the_adversarial_term_changes_training_and_nothing_is_averaged():
    engine, ctx = prepared(**BASE)
    d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    engine.run_round(ctx, 1)
    initial = ctx.models.initial_state("mlp")
    plain = train_reference(ctx, 0, initial)  # cross-entropy alone
    assert far_apart(ctx.store[0]["weights"], plain, PARAMS)
    assert_close(ctx.store[0]["weights"], reference_client(ctx, 0, initial, d_state, MU), PARAMS, atol=1e-5)
    # four different models after the round: no averaging, no global model
    assert far_apart(ctx.store[0]["weights"], ctx.store[1]["weights"], PARAMS)
    assert set(ctx.server) == {"discriminator"}


def test_mu_zero_is_local_bit_for_bit():
    adcol, adcol_engine = run_tiny(**{**BASE, "algorithm.params.mu": 0.0, "experiment.participation": 0.75})
    local, local_engine = run_tiny(**{"algorithm.name": "local", "model.params.hidden": [8],
                                      "experiment.participation": 0.75})
    for i in range(4):
        assert_same(adcol_engine.ctx.store[i]["weights"], local_engine.ctx.store[i]["weights"])
    assert adcol.final["acc_mean"] == local.final["acc_mean"] and adcol.final["loss_mean"] == local.final["loss_mean"]


def test_each_client_is_evaluated_on_its_own_model():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    initial = ctx.models.initial_state("mlp")
    for i in range(4):  # a client that has not trained yet is scored on the seeded initial weights
        scored = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        expected = ctx.store[i]["weights"] if i in ctx.participants else initial
        assert_same(scored, expected, PARAMS)
    trained = [i for i in range(4) if i in ctx.participants]
    assert far_apart(ctx.store[trained[0]]["weights"], initial, PARAMS)


def test_the_bytes_are_the_discriminator_down_and_the_representations_up():
    engine, ctx = prepared(**BASE)
    engine.run_round(ctx, 1)
    d = sum(v.numel() * v.element_size() for v in ctx.server["discriminator"].values())
    assert ctx.comm_down == 4 * d
    assert ctx.comm_up == sum(ctx.data.clients[i].num_train * 8 * 4 for i in range(4))  # n_i x K floats


# -- lost uploads ------------------------------------------------------------------------------------


def test_a_lost_upload_keeps_the_clients_model_and_never_reaches_the_discriminator():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 4  # seed 0 drops some in round 2 and keeps some
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    own = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4) if "weights" in ctx.store[i]}
    uploads = record_messages(ctx, "client_upload")
    engine.run_round(ctx, 2)
    for i in lost:  # it trained: its model is its own and stays trained
        start = own.get(i, ctx.models.initial_state("mlp"))
        assert_close(ctx.store[i]["weights"], reference_client(ctx, i, start, d_state, MU), PARAMS, atol=1e-5)
    arrived = {i: uploads[i]["representations"] for i in range(4) if i not in lost}
    expected = reference_server(ctx, 2, d_state, arrived, lr=0.5, epochs=3, batch=ctx.spec.training.batch_size)
    assert_close(ctx.server["discriminator"], expected, atol=1e-5)


def test_when_every_upload_is_lost_the_discriminator_stays():
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": 1.0}}])
    d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    engine.run_round(ctx, 1)
    assert_same(ctx.server["discriminator"], d_state)


def test_a_cold_start_client_trains_the_initial_model_against_the_final_discriminator():
    engine, ctx = prepared(**{**BASE, "experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    (newcomer,) = ctx.coldstart_clients
    engine.run_round(ctx, 1)
    assert ctx.server["discriminator"]["layers.6.weight"].shape[0] == 3  # D knows the 3 training clients
    d_state = {k: v.clone() for k, v in ctx.server["discriminator"].items()}
    model = coldstart_models(ctx, ctx.client(newcomer))[""]
    d = frozen(ctx, d_state)
    initial = ctx.models.initial_state("mlp")

    def loss(m, x, y, logits):
        log_p = F.log_softmax(d(representation(m, x)), dim=1)
        return F.cross_entropy(logits, y) + MU * (-math.log(3) - log_p.mean(1).mean())

    expected = train_reference(ctx, newcomer, initial, epochs=2, loss_fn=loss)
    assert_close(model.state_dict(), expected, PARAMS, atol=1e-5)


# -- bit identity: process executor, resume ---------------------------------------------------------------


def test_the_process_pool_is_bit_identical_to_the_sequential_loop():
    assert_pool_matches_sequential("adcol", rounds=3, **{**BASE, "experiment.participation": 0.75,
                                                         "addons": [{"name": "dropout", "params": {"p": 0.3}}]})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    overrides = {"algorithm.name": "adcol", "experiment.participation": 0.5,
                 "algorithm.params": {"hidden": 6, "mu": MU}, "model.params": {"hidden": [8]},
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    ref_server = assert_killed_run_resumes_identical(tmp_path, empty_store, **overrides)
    assert "discriminator" in ref_server  # D is part of what resumes


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("mu", -0.1), ("mu", float("nan")), ("mu", "0.5"), ("dis_lr", 0.0),
                                       ("dis_lr", float("inf")), ("dis_epochs", 0), ("dis_epochs", 1.5),
                                       ("hidden", 0), ("hidden", True)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.mu": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.mu:")


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**BASE, "model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool"


def test_defaults_are_flbenchs():
    p = ADCOLParams()
    assert (p.mu, p.dis_lr, p.dis_epochs, p.hidden) == (0.5, 0.01, 3, 512)
