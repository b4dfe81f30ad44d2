"""FedSimSup: Eq. 7-10 by hand, the server's bookkeeping, the r = 1 reduction, bad input."""

import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfl_core import seeding
from pfl_core.cli import run_main
from pfl_core.context import clone_state, load_state
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.models.zoo import LeNet5
from pfl_core.training import make_optimizer, run_epochs
from plugins.fedsimsup import (FedSimSup, Summed, beta_schedule, cosine_similarity, lambdas,
                               mix_non_participants, supervisor_ratio)
from tiny import tiny_raw

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
    p = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.2, 0.2]])
    s = cosine_similarity(p)
    r = 1 / math.sqrt(2)
    expected = np.array([[1, r, 0, r], [r, 1, r, 1], [0, r, 1, r], [r, 1, r, 1]])
    np.testing.assert_allclose(s, expected, atol=1e-12)


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
                "sizes": {0: 10, 1: 10, 2: 10}, "proportions_sent": set()},
        round=1, spec=types.SimpleNamespace(experiment=types.SimpleNamespace(rounds=5)), log=lambda *a, **k: None)

    def uploads():
        yield 0, {"theta": live, "label_proportions": torch.ones(2)}
        live["w"].fill_(7.0)  # the next client reuses the working model
        yield 1, {"theta": {"w": torch.tensor([3.0, 4.0])}}

    plugin.server_aggregate(ctx, uploads(), {0: 0.5, 1: 0.5})
    assert torch.equal(ctx.server["theta"][0]["w"], torch.tensor([1.0, 2.0]))
    assert torch.equal(ctx.server["theta"][1]["w"], torch.tensor([3.0, 4.0]))
    assert ctx.server["proportions_sent"] == {0}
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
        from plugins.fedsimsup import build_supervisor
        sup = build_supervisor(ctx, "mlp", "algorithm")
        data = ctx.data.clients[i]
        ce = lambda model, x, y, logits: F.cross_entropy(logits, y)  # noqa: E731
        for r in (1, 2):
            summed = Summed(theta, sup)
            for params, epochs in ((sup.parameters(), 2), (theta.parameters(), 1)):
                run_epochs(summed, make_optimizer(params, spec.training), data.train_x, data.train_y,
                           epochs=epochs, batch_size=spec.training.batch_size, loss_fn=ce,
                           generator=seeding.torch_generator(spec.experiment.seed, "train", r, i))
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
