"""FedFed (plugins/fedfed): the phases by round, the KL and the noisy copies by hand; a distillation
round (F1)-(F4) recomputed independently for every client (classifier and generator); the sharing
round (F5) recomputed exactly (every client takes part, s = x - x_r with the global generator, the
two noise levels); the FedAvg phase (F6): the pool sent once per client, each round's training set
= own data + a fresh draw of the pool, over rounds past the first where "once" and "every time"
differ; lost sharing uploads leave their features out of the pool; what is evaluated; bad input;
process executor and resume bit-identical."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from bit_identity import assert_killed_run_resumes_identical, assert_pool_matches_sequential
from harness import assert_close, assert_same, dry_run_error, fresh_model, prepared, refused_at_key
from test_checkpoint import (  # noqa: F401 - the fixtures are used by name
    empty_store,
    same_code_all_along,
)
from tiny import tiny_raw

from pfl_core.api import batch_order, batch_starts, load_state, make_optimizer, numpy_rng, torch_generator
from pfl_core.engine import resolve
from pfl_core.runtime.context import Client
from pfl_plugins.faults import upload_is_lost
from pfl_plugins.fedfed import FeatureVAE, FedFed, FedFedParams, kl_to_standard_normal, noisy_copies

BASE = {"algorithm.name": "fedfed", "model.params.hidden": [8], "algorithm.params.distill_rounds": 1,
        "experiment.rounds": 4}


# -- the pieces by hand ------------------------------------------------------------------------------


def test_the_phases_by_round():
    plugin = FedFed(FedFedParams(distill_rounds=2))
    assert [plugin.phase(r) for r in range(1, 6)] == ["distill", "distill", "share", "fedavg", "fedavg"]


def test_kl_to_the_standard_normal_by_hand():
    assert kl_to_standard_normal(torch.zeros(3, 2), torch.zeros(3, 2)) == 0
    mu, logvar = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, math.log(2.0)]])
    # -0.5 mean(1 + 0 - 1 - 1, 1 + ln 2 - 0 - 2) = (2 - ln 2) / 4
    assert torch.isclose(kl_to_standard_normal(mu, logvar), torch.tensor((2 - math.log(2.0)) / 4))


def test_the_two_noisy_copies_use_their_own_noise_level():
    s = torch.arange(6.0).view(3, 2)
    first, second = noisy_copies(s, 0.0, 2.0, torch_generator(0, "t"))
    assert_same({"s": first}, {"s": s})
    g = torch_generator(0, "t")
    torch.randn(s.shape, generator=g)  # the first copy's draw
    assert torch.allclose(second, s + 2.0 * torch.randn(s.shape, generator=g))


# -- (F1)-(F4): a distillation round recomputed ---------------------------------------------------------


def reference_distill(ctx, i, theta, vae_state, p):
    """What client i's classifier and generator become in round 1 (one epoch of each pass)."""
    training, seed, r = ctx.spec.training, ctx.spec.experiment.seed, 1
    model = fresh_model(ctx, theta)
    vae = load_state(FeatureVAE(ctx.models.input_shape, p.vae_hidden, p.vae_latent), vae_state)
    opt = make_optimizer(model.parameters(), training)
    vae_opt = torch.optim.AdamW(vae.parameters(), lr=p.vae_lr, weight_decay=p.vae_weight_decay)
    orders, mixing, noise = torch_generator(seed, "fedfed-batches", r, i), numpy_rng(seed, "fedfed-mixup", r, i), \
        torch_generator(seed, "fedfed-noise", r, i)
    x_all, y_all = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
    n = len(y_all)

    def batches():
        order = batch_order(n, orders, training.shuffle)
        return [(x_all[order[s:s + training.batch_size]], y_all[order[s:s + training.batch_size]])
                for s in batch_starts(n, training.batch_size, training.drop_last)]

    model.train()
    for x, y in batches():
        lam = float(mixing.beta(p.mixup_alpha, p.mixup_alpha))
        perm = torch.randperm(len(y), generator=orders)
        out = model(lam * x + (1 - lam) * x[perm])
        opt.zero_grad()
        (lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])).backward()
        opt.step()

    def generator_terms(x):
        h = vae.encoder(x)
        mu, logvar = vae.fc_mu(h), vae.fc_logvar(h)
        robust = vae.decoder(mu + torch.exp(0.5 * logvar) * torch.randn(mu.shape, generator=noise))
        kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).mean()
        return robust, p.rec_weight * ((robust - x) ** 2).mean() + p.kl_weight * kl

    for x, _ in batches():
        vae_opt.zero_grad()
        generator_terms(x)[1].backward()
        vae_opt.step()
    for x, y in batches():
        robust, loss = generator_terms(x)
        s = x - robust
        s1 = s + p.noise_std1 * torch.randn(s.shape, generator=noise)
        s2 = s + p.noise_std2 * torch.randn(s.shape, generator=noise)
        loss = loss + p.sensitive_ce_weight * (F.cross_entropy(model(s1), y) + F.cross_entropy(model(s2), y)) / 2 \
            + p.x_ce_weight * F.cross_entropy(model(x), y)
        opt.zero_grad()
        vae_opt.zero_grad()
        loss.backward()
        opt.step()
        vae_opt.step()
    return model.state_dict(), vae.state_dict()


def test_a_distillation_round_recomputed_for_every_client():
    engine, ctx = prepared(**{**BASE, "model.params.hidden": []})  # a linear classifier: no BatchNorm mode
    p = FedFedParams(distill_rounds=1)
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    vae0 = {k: v.clone() for k, v in ctx.server["vae"].items()}
    engine.run_round(ctx, 1)
    sizes = {i: ctx.data.clients[i].num_train for i in range(4)}
    total = sum(sizes.values())
    done = {i: reference_distill(ctx, i, theta, vae0, p) for i in range(4)}
    assert_close(ctx.server["global"], {k: sum(sizes[i] / total * done[i][0][k] for i in done) for k in theta},
                 atol=1e-5)
    assert_close(ctx.server["vae"], {k: sum(sizes[i] / total * done[i][1][k] for i in done) for k in vae0},
                 atol=1e-5)
    assert all(not torch.equal(ctx.server["vae"][k], vae0[k]) for k in vae0)  # the generator trained
    assert set(ctx.store[0]["vae_optimizer"]["state"])  # the client keeps its AdamW moments


# -- (F5): the sharing round --------------------------------------------------------------------------


def test_every_client_shares_its_noisy_sensitive_features():
    engine, ctx = prepared(**{**BASE, "experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    assert len(ctx.participants) == 2
    theta = {k: v.clone() for k, v in ctx.server["global"].items()}
    vae = load_state(FeatureVAE(ctx.models.input_shape, 64, 16), ctx.server["vae"]).eval()
    engine.run_round(ctx, 2)
    assert ctx.participants == [0, 1, 2, 3]  # whatever experiment.participation
    xs, ys = [], []
    with torch.no_grad():
        for i in range(4):
            x, y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
            s = x - vae.decoder(vae.fc_mu(vae.encoder(x)))  # z = mu in evaluation mode
            g = torch_generator(ctx.spec.experiment.seed, "fedfed-share", 2, i)
            xs += [s + 0.15 * torch.randn(s.shape, generator=g)]
            xs += [s + 0.25 * torch.randn(s.shape, generator=g)]
            ys += [y, y]
    pool_x, pool_y = ctx.server["shared_x"], ctx.server["shared_y"]
    assert len(pool_y) == 2 * sum(ctx.data.clients[i].num_train for i in range(4))
    order = [0, 1, 2, 3, 4, 5, 6, 7]  # client 0's s_1, s_2, client 1's ...
    assert torch.allclose(pool_x, torch.cat([xs[k] for k in order]), atol=1e-5)
    assert torch.equal(pool_y, torch.cat(ys))
    assert_same(ctx.server["global"], theta)  # nothing trains in the sharing round


# -- (F6): FedAvg on local + shared data ---------------------------------------------------------------


def spy_training(monkeypatch):
    calls, original = [], Client.train

    def spy(self, model=None, **kwargs):
        calls.append({"round": self.round, "client": self.id, "x": kwargs.get("x"), "y": kwargs.get("y")})
        return original(self, model, **kwargs)

    monkeypatch.setattr(Client, "train", spy)
    return calls


@pytest.mark.parametrize("ratio", [1.0, 0.3])
def test_fedavg_rounds_train_on_own_data_plus_a_fresh_draw_of_the_pool(monkeypatch, ratio):
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 5, "experiment.participation": 0.5,
                              "algorithm.params.shared_ratio": ratio})
    for r in (1, 2):
        engine.run_round(ctx, r)
    pool_x, pool_y = ctx.server["shared_x"].clone(), ctx.server["shared_y"].clone()
    calls = spy_training(monkeypatch)
    draws = {}
    for r in (3, 4, 5):  # three rounds: a fixed draw, or one reused from round 3, differs by round 4
        theta = {k: v.clone() for k, v in ctx.server["global"].items()}
        engine.run_round(ctx, r)
        for i in ctx.participants:
            call = next(c for c in calls if c["round"] == r and c["client"] == i)
            own_x, own_y = ctx.data.clients[i].train_x, ctx.data.clients[i].train_y
            drawn = math.ceil(ratio * len(own_y))
            index = torch.randperm(len(pool_y), generator=torch_generator(0, "fedfed-draw", r, i))[:drawn]
            assert torch.equal(call["x"], torch.cat([own_x, pool_x[index]]))
            assert torch.equal(call["y"], torch.cat([own_y, pool_y[index]]))
            draws.setdefault(i, []).append(index)
        assert not torch.equal(ctx.server["global"]["fc1.weight"], theta["fc1.weight"])
        assert torch.equal(ctx.server["shared_x"], pool_x)  # P stays as the sharing round left it
    assert any(len(d) > 1 and not torch.equal(d[0], d[1]) for d in draws.values())  # a fresh draw per visit


def test_each_round_sends_only_the_draw():
    engine, ctx = prepared(**{**BASE, "experiment.rounds": 4})
    for r in (1, 2):
        engine.run_round(ctx, r)
    before = ctx.comm_down
    engine.run_round(ctx, 3)
    model = sum(v.numel() * v.element_size() for v in ctx.server["global"].values())
    draw = sum(ctx.data.clients[i].num_train * (20 * 4 + 8) for i in range(4))  # 20 float32 features, an int64 label
    assert ctx.comm_down - before == 4 * model + draw


def test_every_client_is_evaluated_on_the_global_classifier():
    engine, ctx = prepared(**BASE)
    for r in (1, 2, 3):
        engine.run_round(ctx, r)
    for i in range(4):
        message = ctx.hooks.evaluation_message(ctx=ctx, client_id=i)
        assert set(message) == {"weights"} and message["weights"] is ctx.server["global"]
        models = ctx.hooks.personalized_models(ctx=ctx, client=ctx.client(i), message=message)
        assert_same(models[""].state_dict(), ctx.server["global"])


# -- lost uploads -------------------------------------------------------------------------------------


def test_a_lost_sharing_upload_leaves_its_features_out_of_the_pool():
    p = 0.5
    lost = [i for i in range(4) if upload_is_lost(0, 2, i, p)]
    assert 0 < len(lost) < 4
    engine, ctx = prepared(**BASE, addons=[{"name": "dropout", "params": {"p": p}}])
    engine.run_round(ctx, 1)
    uploads, original = {}, ctx.hooks.client_upload

    def recording(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: v.clone() for k, v in message.items()}
        return message

    ctx.hooks.client_upload = recording
    engine.run_round(ctx, 2)
    kept = [i for i in range(4) if i not in lost]
    assert torch.equal(ctx.server["shared_x"], torch.cat([uploads[i]["shared_x"] for i in kept]))
    assert torch.equal(ctx.server["shared_y"], torch.cat([uploads[i]["shared_y"] for i in kept]))


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("distill_rounds", 0), ("vae_local_epochs", 0), ("vae_lr", 0.0),
                                            ("vae_hidden", 0), ("vae_latent", 0), ("noise_std1", -0.1),
                                            ("noise_std2", float("nan")), ("mixup_alpha", -1.0),
                                            ("kl_weight", float("inf")), ("shared_ratio", 0.0),
                                            ("vae_weight_decay", -1e-3)])
def test_a_bad_parameter_is_refused_at_its_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{**BASE, "algorithm.params.noise_std1": -1.0}))
    assert line.startswith("pfl-run: error: algorithm.params.noise_std1: must be >= 0")


def test_a_run_too_short_for_a_fedavg_round_is_warned_about(capsys):
    resolve(tiny_raw(**{**BASE, "algorithm.params.distill_rounds": 3}))
    err = capsys.readouterr().err
    assert "pfl: warning: fedfed: algorithm.params.distill_rounds = 3 leaves no FedAvg round" in err
    resolve(tiny_raw(**{**BASE, "algorithm.params.distill_rounds": 2}))
    assert "warning" not in capsys.readouterr().err


# -- executors and resume ------------------------------------------------------------------------------


def test_the_process_pool_is_bit_identical_with_lost_uploads():
    overrides = {"model.params.hidden": [8], "algorithm.params.distill_rounds": 1,
                 "addons": [{"name": "dropout", "params": {"p": 0.3}}]}
    assert_pool_matches_sequential("fedfed", rounds=4, **overrides)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill runs in a forked process")
def test_a_killed_run_resumes_bit_identical(tmp_path, empty_store):  # noqa: F811 - the imported fixture
    # killed in round 2 of 2 distillation rounds: the resumed round reloads a client's AdamW state
    # from the checkpoint; the sharing round and two FedAvg rounds follow
    overrides = {"algorithm.name": "fedfed", "algorithm.params.distill_rounds": 2, "experiment.participation": 0.5}
    server = assert_killed_run_resumes_identical(tmp_path, empty_store, rounds=5, kill_at=2, **overrides)
    assert len(server["shared_y"]) > 0  # the run reached the FedAvg phase with a pool
