"""FedSimSup: Eq. 7-10 by hand, the server's bookkeeping, the r = 1 reduction, bad input."""

import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_raw

from pfl_core import seeding
from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.models.zoo import LeNet5
from pfl_core.runtime.context import clone_state, load_state
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_core.runtime.training import make_optimizer, run_epochs
from pfl_plugins.fedsimsup import (
    FedSimSup,
    Summed,
    beta_schedule,
    cosine_similarity,
    label_proportions,
    lambdas,
    mix_non_participants,
    mixing_weights,
)

SUP = {"algorithm.name": "fedsimsup", "algorithm.params.supervisor": "mlp",
       "algorithm.params.supervisor_arch_params": {"mlp": {"hidden": [4]}}}


def engine_for(**overrides):
    engine = Engine(resolve(tiny_raw(**{**SUP, **overrides})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def test_beta_schedule_at_its_boundary():
    # C T^gamma = 2 * 100^0.5 = 20: beta = 1 before round 20, (20 / t)^2 from it (continuous at 20)
    assert beta_schedule(19, 100, 2.0, 0.5) == 1.0
    assert beta_schedule(20, 100, 2.0, 0.5) == 1.0
    assert beta_schedule(21, 100, 2.0, 0.5) == pytest.approx((20 / 21) ** 2)
    assert beta_schedule(40, 100, 2.0, 0.5) == pytest.approx(0.25)
    # paper defaults, T = 1000: boundary 40 * 1000^(3/7) = 772.4...
    boundary = 40 * 1000 ** (3 / 7)
    assert beta_schedule(math.floor(boundary), 1000, 40, 3 / 7) == 1.0
    assert beta_schedule(math.ceil(boundary), 1000, 40, 3 / 7) < 1.0


def test_lambda_by_hand():
    sizes = {0: 100, 1: 50, 2: 30, 3: 150}
    lam = lambdas(sizes, participants=[0, 1], clients=[2, 3])
    assert lam[2] == pytest.approx(150 / (150 + 2 * 30))  # 5/7
    assert lam[3] == pytest.approx(150 / (150 + 2 * 150))  # 1/3: more own data, less mixing


def test_similarity_matrix():
    p = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.2, 0.2], [0.0, 0.0]])
    s = cosine_similarity(p)
    r = 1 / math.sqrt(2)
    expected = np.array([[1, r, 0, r, 0], [r, 1, r, 1, 0], [0, r, 1, r, 0], [r, 1, r, 1, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_allclose(s, expected, atol=1e-12)  # a client without labels is similar to nobody


def test_label_proportions():
    np.testing.assert_array_equal(label_proportions([[1, 0, 0], [0, 0, 0], [2, 2, 4]]),
                                  [[1, 0, 0], [0, 0, 0], [0.25, 0.25, 0.5]])


def test_mixing_weight_options():
    sim = {2: {0: 0.9, 1: 0.1}}
    sizes = {0: 10, 1: 30, 2: 5}
    assert mixing_weights(2, [0, 1], sim, sizes) == pytest.approx({0: 0.9, 1: 0.1})
    assert mixing_weights(2, [0, 1], sim, sizes, "data_size") == pytest.approx({0: 0.25, 1: 0.75})
    assert mixing_weights(2, [0, 1], sim, sizes, "uniform") == pytest.approx({0: 0.5, 1: 0.5})


def test_defaults_are_the_papers():
    p = FedSimSup().params
    assert (p.C, p.gamma, p.tau_s, p.tau_theta, p.weighting, p.supervisor) == (40.0, 3 / 7, 1, 1, "similarity", "lenet5")


@pytest.mark.parametrize("key, value", [("algorithm.params.tau_s", 0), ("algorithm.params.tau_theta", 0),
                                        ("algorithm.params.gamma", 1.0),
                                        ("algorithm.params.weighting", "data_size")])
def test_edge_values_are_accepted(key, value):
    assert resolve(tiny_raw(**{**SUP, key: value})).spec.algorithm.name == "fedsimsup"


def test_mixing_three_clients_by_hand():
    thetas = {0: {"w": torch.tensor([1.0])}, 1: {"w": torch.tensor([3.0])}, 2: {"w": torch.tensor([10.0])}}
    sim = {2: {0: 0.5, 1: 1.0}}
    sizes = {0: 100, 1: 50, 2: 30}
    alphas = mix_non_participants(thetas, [0, 1], sim, sizes, beta=1.0)
    # lambda_2 = 5/7, weights 1/3, 2/3: mix = 7/3; theta_2 = 2/7 * 10 + 5/7 * 7/3 = 95/21
    assert alphas == {2: pytest.approx(5 / 7)}
    assert thetas[2]["w"].item() == pytest.approx(95 / 21, rel=1e-6)
    assert thetas[0]["w"].item() == 1.0 and thetas[1]["w"].item() == 3.0
    # no similar participant: data-size weights (100, 50) / 150 -> mix = 5/3
    thetas[2] = {"w": torch.tensor([10.0])}
    mix_non_participants(thetas, [0, 1], {2: {0: 0.0, 1: 0.0}}, sizes, beta=0.5)
    a = 5 / 7 * 0.5
    assert thetas[2]["w"].item() == pytest.approx((1 - a) * 10 + a * 5 / 3, rel=1e-6)


def test_participants_unchanged_by_aggregation():
    plugin = FedSimSup()
    live = {"w": torch.tensor([1.0, 2.0])}  # an upload's live tensor, overwritten by the next client
    ctx = types.SimpleNamespace(
        server={"theta": {0: {"w": torch.zeros(2)}, 1: {"w": torch.zeros(2)}, 2: {"w": torch.ones(2)}},
                "similarity": {i: {j: 1.0 for j in range(3)} for i in range(3)},
                "sizes": {0: 10, 1: 10, 2: 10}},
        round=1, spec=types.SimpleNamespace(experiment=types.SimpleNamespace(rounds=5)), log=lambda *a, **k: None)

    def uploads():
        yield 0, {"theta": live, "label_proportions": torch.ones(2)}
        live["w"].fill_(7.0)  # the next client reuses the working model
        yield 1, {"theta": {"w": torch.tensor([3.0, 4.0])}}

    plugin.server_aggregate(ctx, uploads(), {0: 0.5, 1: 0.5})
    assert torch.equal(ctx.server["theta"][0]["w"], torch.tensor([1.0, 2.0]))
    assert torch.equal(ctx.server["theta"][1]["w"], torch.tensor([3.0, 4.0]))
    # client 2: lambda = 20 / (20 + 2 * 10) = 1/2, mix = (2, 3): theta_2 = (1 + 2, 1 + 3) / 2
    assert torch.allclose(ctx.server["theta"][2]["w"], torch.tensor([1.5, 2.0]))


def test_non_participant_mixed_on_two_clients_by_hand():
    two = {"data.params.num_devices": 2, "partition.num_clients": 2, "experiment.participation": 0.5,
           "experiment.rounds": 4}
    engine, ctx = engine_for(**two)
    sizes = [ctx.data.clients[i].num_train for i in range(2)]
    for r in (1, 2):
        before = {i: clone_state(ctx.server["theta"][i]) for i in range(2)}
        engine.run_round(ctx, r)
        (p,) = ctx.participants
        o = 1 - p
        a = sizes[p] / (sizes[p] + 1 * sizes[o]) * 1.0  # K = 1, beta = 1 (C T^gamma = 72 > r)
        assert not torch.equal(ctx.server["theta"][p]["fc1.weight"], before[p]["fc1.weight"])  # trained
        for key, old in before[o].items():
            expected = (1 - a) * old + a * ctx.server["theta"][p][key]
            assert torch.allclose(ctx.server["theta"][o][key], expected, atol=1e-6), key


def test_r_equal_one_is_local_training_of_the_summed_model_bit_for_bit():
    engine, ctx = engine_for(**{"experiment.rounds": 2, "algorithm.params.tau_s": 2})
    for r in (1, 2):
        engine.run_round(ctx, r)
        assert "alpha_mean" not in ctx.round_metrics  # nobody is mixed
    spec = ctx.spec
    for i in range(4):
        theta = ctx.models.build("mlp")
        from pfl_plugins.fedsimsup import build_supervisor
        sup = build_supervisor(ctx, "mlp", "algorithm")
        data = ctx.data.clients[i]
        ce = lambda model, x, y, logits: F.cross_entropy(logits, y)  # noqa: E731
        for r in (1, 2):
            summed = Summed(theta, sup)
            for params, epochs in ((sup.parameters(), 2), (theta.parameters(), 1)):
                run_epochs(summed, make_optimizer(params, spec.training), data.train_x, data.train_y,
                           epochs=epochs, batch_size=spec.training.batch_size, loss_fn=ce,
                           generator=seeding.torch_generator(spec.experiment.seed, "train", r, i),
                           drop_last=spec.training.drop_last)
        for key, value in theta.state_dict().items():
            assert torch.equal(ctx.server["theta"][i][key], value), (i, key)
        for key, value in sup.state_dict().items():
            assert torch.equal(ctx.store[i]["supervisor"][key], value), (i, key)


def test_label_proportions_counted_once_per_client():
    engine = Engine(resolve(tiny_raw(**SUP, **{"experiment.rounds": 2})), progress=False)
    result = engine.run()
    theta_bytes = sum(v.numel() * v.element_size() for v in engine.ctx.server["theta"][0].values())
    proportions = 4 * engine.ctx.num_classes * 4  # 4 clients, float32, first upload only
    assert result.history[0]["comm_up_bytes"] == 4 * theta_bytes + proportions
    assert result.history[1]["comm_up_bytes"] == 8 * theta_bytes + proportions


def test_default_supervisor_is_about_a_sixth_of_lenet5():
    # Supervisor = LeNet-5 at width 0.4: 9,722 parameters; inter-learning LeNet-5: 62,006.
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    sup = LeNet5(LeNet5.Params(width=0.4)).build((3, 32, 32), 10)
    inter = LeNet5(LeNet5.Params()).build((3, 32, 32), 10)
    assert (count(sup), count(inter)) == (9722, 62006)
    assert abs(count(sup) / count(inter) - 1 / 6) < 0.01
    assert FedSimSup().params.supervisor_arch_params == {"lenet5": {"width": 0.4}}


@pytest.mark.parametrize("key, value", [
    ("algorithm.params.tau_s", -1),
    ("algorithm.params.tau_theta", -1),
    ("algorithm.params.supervisor", "lenet6"),
    ("experiment.participation", 0.0),
    ("experiment.participation", 1.5),
    ("algorithm.params.C", 0.0),
    ("algorithm.params.gamma", 0.0),
    ("algorithm.params.gamma", 1.5),
    ("algorithm.params.weighting", "cosine"),
])
def test_bad_input_names_the_key(key, value):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**SUP, key: value}))
    assert info.value.path == key, str(info.value)


def test_supervisor_pool_names_the_entry():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**SUP, "algorithm.params.supervisor_pool": ["mlp", "transformerx"]}))
    assert info.value.path == "algorithm.params.supervisor_pool[1]"


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text(
        '[data]\nname = "synthetic"\n[partition]\nscheme = "domain"\nnum_clients = 4\n'
        '[model]\nname = "mlp"\n[algorithm]\nname = "fedsimsup"\n[algorithm.params]\ntau_s = -1\n'
        '[tracking]\nenabled = false\n')
    assert run_main([str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.params.tau_s" in err and len(err.strip().splitlines()) == 1
    assert run_main([str(spec), "--dry-run", "--set", "algorithm.params.tau_s=1",
                     "--set", "algorithm.params.supervisor=nosuch"]) == 2
    assert "algorithm.params.supervisor" in capsys.readouterr().err


def test_similarity_ablation_changes_the_mixing():
    raw = {**SUP, "experiment.participation": 0.5, "experiment.rounds": 2, "partition.scheme": "iid"}
    _, sim = engine_run(raw)
    _, size = engine_run({**raw, "algorithm.params.weighting": "uniform"})
    assert any(not torch.equal(sim.ctx.server["theta"][i]["fc1.weight"], size.ctx.server["theta"][i]["fc1.weight"])
               for i in range(4))


def engine_run(overrides):
    engine = Engine(resolve(tiny_raw(**overrides)), progress=False)
    return engine.run(), engine


# -- the local update, the evaluated model, what is sent ------------------------------------

LINEAR = {"model.params.hidden": [], "algorithm.params.supervisor_arch_params": {"mlp": {"hidden": []}},
          "data.params.num_classes": 3, "data.params.dim": 5, "data.params.samples_per_device": 20,
          "training.batch_size": 64, "training.lr": 0.5}  # logistic regressions; one batch per epoch


def hand_step(W, b, X, onehot, W_other, b_other, lr):
    """One full-batch SGD step on (W, b) of mean CE(softmax(X (W + W_o)^T + b + b_o))."""
    z = X @ (W + W_other).T + b + b_other
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = (p - onehot) / len(X)
    return W - lr * g.T @ X, b - lr * g.sum(0)


def hand_local_update(theta, sup, X, y, order, lr):
    onehot = np.eye(3)[y]
    parts = {"theta": [theta[0].copy(), theta[1].copy()], "s": [sup[0].copy(), sup[1].copy()]}
    for part, epochs in order:
        other = parts["s" if part == "theta" else "theta"]
        for _ in range(epochs):
            parts[part] = list(hand_step(*parts[part], X, onehot, *other, lr))
    return parts


def test_local_update_supervisor_first_then_theta_by_hand():
    engine, ctx = engine_for(**LINEAR, **{"algorithm.params.tau_s": 2, "algorithm.params.tau_theta": 1})
    ctx.round = 1
    gen = torch.Generator().manual_seed(5)
    theta0 = {"fc1.weight": torch.randn(3, 5, generator=gen), "fc1.bias": torch.randn(3, generator=gen)}
    sup0 = {"fc1.weight": torch.randn(3, 5, generator=gen), "fc1.bias": torch.randn(3, generator=gen)}
    ctx.server["theta"][1] = clone_state(theta0)
    ctx.store[1]["supervisor"] = clone_state(sup0)
    client = ctx.client(1)
    assert client.num_train < 64
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=1))
    theta, sup = client.model, client.scratch["supervisor"]
    phases, train = [], client.train

    def spy(**kw):  # which part each call to the training loop changed, bit for bit
        before = clone_state(theta), clone_state(sup)
        for p in [*theta.parameters(), *sup.parameters()]:
            p.grad = None
        out = train(**kw)
        phases.append(tuple(any(not torch.equal(m.state_dict()[k], old[k]) for k in old)
                            for m, old in zip((theta, sup), before)))
        phases.append(tuple(any(p.grad is not None for p in m.parameters()) for m in (theta, sup)))
        return out
    client.train = spy
    ctx.hooks.local_train(ctx=ctx, client=client)
    # tau_s: only s moves (and only s gets gradients); tau_theta: only theta
    assert phases == [(False, True), (False, True), (True, False), (True, False)]
    assert all(p.requires_grad for p in [*theta.parameters(), *sup.parameters()])  # unfrozen afterwards

    X, y = client.data.train_x.double().numpy(), client.data.train_y.numpy()
    as_np = lambda st: [st["fc1.weight"].double().numpy(), st["fc1.bias"].double().numpy()]  # noqa: E731
    ours = hand_local_update(as_np(theta0), as_np(sup0), X, y, [("s", 2), ("theta", 1)], 0.5)
    swapped = hand_local_update(as_np(theta0), as_np(sup0), X, y, [("theta", 1), ("s", 2)], 0.5)
    got = {"theta": as_np(theta.state_dict()), "s": as_np(sup.state_dict())}
    for part in ("theta", "s"):
        for g, e, w in zip(got[part], ours[part], swapped[part]):
            np.testing.assert_allclose(g, e, atol=1e-5)
            assert np.abs(e - w).max() > 1e-3  # the swapped order is a different update
    for key, value in sup.state_dict().items():  # the supervisor stays on the client
        assert torch.equal(ctx.store[1]["supervisor"][key], value)


def test_evaluated_model_is_the_sum_of_theta_and_the_supervisor():
    engine, ctx = engine_for(**{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    sat_out = next(i for i in range(4) if i not in ctx.participants)
    x = ctx.data.clients[0].test_x
    for i in (ctx.participants[0], sat_out):
        model = evaluated_models(ctx, ctx.client(i))[""]
        inter = load_state(ctx.models.build("mlp"), ctx.server["theta"][i])
        from pfl_plugins.fedsimsup import build_supervisor
        sup = build_supervisor(ctx, "mlp", "algorithm")
        if i in ctx.participants:
            load_state(sup, ctx.store[i]["supervisor"])
        else:
            assert "supervisor" not in ctx.store[i]  # never trained: the seeded initial supervisor
        with torch.no_grad():
            assert torch.allclose(model(x), inter(x) + sup(x), atol=1e-6)
            assert not torch.allclose(model(x), inter(x), atol=1e-3)


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {"keys": set(message), "theta": clone_state(message["theta"]),
                                    "label_proportions": message.get("label_proportions")}
        return message
    ctx.hooks.client_upload = spy
    return uploads


def test_uploads_are_theta_only_and_stored_as_sent():
    engine, ctx = engine_for(**{"experiment.participation": 0.5, "experiment.rounds": 3})
    uploads = spy_uploads(ctx)
    sent = set()
    for r in (1, 2, 3):
        uploads.clear()
        engine.run_round(ctx, r)
        for j in ctx.participants:
            up = uploads[j]
            first = j not in sent
            assert up["keys"] == ({"theta", "label_proportions"} if first else {"theta"})  # p_j once
            assert set(up["theta"]) == set(ctx.models.working("mlp").state_dict())  # theta, not s
            for key, value in up["theta"].items():  # Eq. 6: no aggregation for participants
                assert torch.equal(ctx.server["theta"][j][key], value), (r, j, key)
            if first:
                counts = ctx.data.clients[j].label_counts("train", ctx.num_classes)
                assert torch.allclose(up["label_proportions"], torch.tensor(counts / counts.sum(), dtype=torch.float32))
            sent.add(j)


def test_non_participants_mixed_by_hand_across_the_beta_boundary():
    # T = 4, C = 0.75, gamma = 0.5: C T^gamma = 1.5, so beta_1 = 1 and beta_2 = (1.5 / 2)^2
    raw = {"experiment.participation": 0.5, "experiment.rounds": 4, "algorithm.params.C": 0.75,
           "algorithm.params.gamma": 0.5, "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.5}}
    engine, ctx = engine_for(**raw)
    counts = np.stack([ctx.data.clients[i].label_counts("train", ctx.num_classes) for i in range(4)]).astype(float)
    m = counts.sum(1)
    unit = counts / np.linalg.norm(counts, axis=1, keepdims=True)  # cosine of proportions = of counts
    s = unit @ unit.T
    assert len({round(v, 6) for v in s[np.triu_indices(4, 1)]}) > 2  # the weights really differ
    for r, beta in ((1, 1.0), (2, 0.5625)):
        before = {i: clone_state(ctx.server["theta"][i]) for i in range(4)}
        engine.run_round(ctx, r)
        assert ctx.round_metrics["beta"] == pytest.approx(beta)
        part = ctx.participants
        assert len(part) == 2
        for i in set(range(4)) - set(part):
            a = m[part].sum() / (m[part].sum() + 2 * m[i]) * beta  # Eq. 8-9, K = 2
            w = s[i, part] / s[i, part].sum()
            for key, old in before[i].items():
                mix = w[0] * ctx.server["theta"][part[0]][key] + w[1] * ctx.server["theta"][part[1]][key]
                assert torch.allclose(ctx.server["theta"][i][key], (1 - a) * old + a * mix, atol=1e-6), (r, i, key)


def test_local_work_is_both_phases_and_matches_what_runs():
    raw = tiny_raw(**SUP, **{"algorithm.params.tau_s": 2, "algorithm.params.tau_theta": 1,
                             "experiment.rounds": 2, "training.drop_last": False})
    resolved = resolve(raw)
    assert resolved.as_dict["budget"]["private_epochs_per_round"] == 3
    result = Engine(resolved, progress=False).run()
    assert result.final["budget.private_epochs"] == pytest.approx(2 * 3)  # every client, every round


# -- cold start -------------------------------------------------------------------------------

from pfl_plugins.fedsimsup import build_supervisor, coldstart_schedule, newcomer_theta  # noqa: E402

COLD = {"experiment.coldstart_clients": 1, "experiment.participation": 0.5, "experiment.rounds": 2,
        "partition.scheme": "dirichlet", "partition.params": {"alpha": 0.5}}


def test_coldstart_schedule_follows_the_local_update_for_the_newcomer_budget():
    assert coldstart_schedule(1, 1, 0) == []
    assert coldstart_schedule(1, 1, 1) == [("s", 1)]
    assert coldstart_schedule(1, 1, 3) == [("s", 1), ("theta", 1), ("s", 1)]
    assert coldstart_schedule(2, 1, 5) == [("s", 2), ("theta", 1), ("s", 2)]
    assert coldstart_schedule(0, 2, 3) == [("theta", 3)]
    assert coldstart_schedule(0, 0, 3) == []


def test_newcomer_theta_is_the_similarity_mix_with_the_data_size_fallback():
    ctx = types.SimpleNamespace(
        params=FedSimSup().params,
        server={"theta": {0: {"w": torch.tensor([1.0])}, 1: {"w": torch.tensor([4.0])}},
                "proportions": {0: np.array([1.0, 0.0, 0.0]), 1: np.array([0.0, 1.0, 0.0])},
                "sizes": {0: 30, 1: 10},
                "newcomer_proportions": {7: np.array([0.6, 0.8, 0.0]), 8: np.array([0.0, 0.0, 1.0])}})
    # s_70 = 0.6, s_71 = 0.8 -> (0.6 * 1 + 0.8 * 4) / 1.4
    assert newcomer_theta(ctx, 7)["w"].item() == pytest.approx(3.8 / 1.4)
    # no shared class: data sizes 30, 10 -> (30 * 1 + 10 * 4) / 40
    assert newcomer_theta(ctx, 8)["w"].item() == pytest.approx(70 / 40)
    assert set(ctx.server["theta"]) == {0, 1}  # newcomers are not stored among the mixed models


def test_coldstart_starts_from_the_hand_computed_mix_then_trains():
    engine, ctx = engine_for(**COLD, **{"experiment.coldstart_epochs": 2})
    for r in (1, 2):
        engine.run_round(ctx, r)
    (n,) = ctx.coldstart_clients
    trained = ctx.training_clients
    counts = {i: ctx.data.clients[i].label_counts("train", ctx.num_classes).astype(float) for i in range(4)}
    cos = {j: counts[n] @ counts[j] / np.linalg.norm(counts[n]) / np.linalg.norm(counts[j]) for j in trained}
    assert sum(cos.values()) > 0
    expected = {k: sum(cos[j] * ctx.server["theta"][j][k] for j in trained) / sum(cos.values())
                for k in ctx.server["theta"][trained[0]]}
    initial_sup = build_supervisor(ctx, "mlp", "algorithm").state_dict()

    client = ctx.client(n)
    starts, train = [], client.train

    def spy(**kw):
        starts.append((clone_state(client.model), clone_state(client.scratch["supervisor"])))
        return train(**kw)
    client.train = spy
    up, down = ctx.comm_up, ctx.comm_down
    models = coldstart_models(ctx, client)
    theta_start, sup_start = starts[0]
    for key, value in expected.items():  # before fine-tuning: the similarity mix ...
        assert torch.allclose(theta_start[key], value, atol=1e-6), key
    for key, value in initial_sup.items():  # ... and a fresh seeded supervisor
        assert torch.equal(sup_start[key], value), key
    assert len(starts) == 2  # coldstart_epochs = 2: one supervisor epoch, then one theta epoch
    assert torch.equal(starts[1][0]["fc1.weight"], theta_start["fc1.weight"])  # theta frozen in the s epoch
    assert not torch.equal(client.model.state_dict()["fc1.weight"], theta_start["fc1.weight"])  # then trained
    assert ctx.comm_up - up == ctx.num_classes * 4  # the newcomer's label proportions, float32
    assert ctx.comm_down - down == sum(v.numel() * v.element_size() for v in expected.values())
    x = client.data.test_x
    with torch.no_grad():
        assert torch.allclose(models[""](x), client.model(x) + client.scratch["supervisor"](x))
    assert n not in ctx.server["theta"]


def test_a_run_with_coldstart_clients_finishes():
    result, engine = engine_run({**SUP, **COLD, "experiment.coldstart_clients": 2})
    assert not result.errors
    assert "coldstart_acc_mean" in result.final and "acc_mean" in result.final
    assert sum(row["coldstart"] for row in result.client_rows) == 2
