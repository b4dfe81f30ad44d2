"""FedAMP (plugins/fedamp): the attention weights and the personalized cloud models of three
clients by hand (HeurFedAMP's cosine rule and Eq. 5's distance rule), the cloud model each
participant receives in a run, Eq. 6's proximal term and starting point, xi = 1 with lam = 0 =
Local bit for bit, what is evaluated, bytes, bad input."""

import math
from types import SimpleNamespace

import pytest
import torch
from harness import (
    assert_same,
    dry_run_error,
    far_apart,
    linear,
    model_bytes,
    prepared,
    recorded_training,
    refused_at_key,
)
from tiny import tiny_raw

from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedamp import FedAMP, FedAMPParams, attention_weights, cloud_model, with_defaults

BASE = {"algorithm.name": "fedamp", "model.params.hidden": [8], "experiment.rounds": 2}

# three clients' one-parameter "models"
W = {1: {"w": torch.tensor([1.0, 0.0])}, 2: {"w": torch.tensor([0.0, 1.0])}, 3: {"w": torch.tensor([1.0, 1.0])}}


# -- Eq. 5 by hand ---------------------------------------------------------------------------------


def test_cosine_attention_and_cloud_models_of_three_clients_by_hand():
    params = FedAMPParams(attention="cosine", sigma=2.0, xi=0.2)
    xi = attention_weights(1, W, W[1], ["w"], params)
    # cos(w1, w2) = 0, cos(w1, w3) = 1/sqrt(2): scores e^0 = 1 and e^(2/sqrt(2)) = e^sqrt(2)
    e = math.exp(math.sqrt(2))
    assert xi[1] == pytest.approx(0.2)
    assert xi[2] == pytest.approx(0.8 * 1 / (1 + e)) and xi[3] == pytest.approx(0.8 * e / (1 + e))
    u1 = cloud_model(xi, W, W[1], 1)["w"]
    # u1 = 0.2 (1, 0) + xi12 (0, 1) + xi13 (1, 1)
    assert torch.allclose(u1, torch.tensor([0.2 + 0.8 * e / (1 + e), 0.8 / (1 + e) + 0.8 * e / (1 + e)]))
    # client 3 is equally similar to 1 and 2: they share 1 - xi equally
    xi3 = attention_weights(3, W, W[3], ["w"], params)
    assert xi3[1] == pytest.approx(0.4) and xi3[2] == pytest.approx(0.4) and xi3[3] == pytest.approx(0.2)
    assert torch.allclose(cloud_model(xi3, W, W[3], 3)["w"], torch.tensor([0.6, 0.6]))
    # the larger sigma, the more the most similar model dominates
    sharp = attention_weights(1, W, W[1], ["w"], FedAMPParams(sigma=20.0, xi=0.2))
    assert sharp[3] > xi[3] and sharp[3] + sharp[2] == pytest.approx(0.8)


def test_distance_attention_is_eq7_with_the_negative_exponential():
    params = FedAMPParams(attention="distance", alpha_k=0.5, sigma=2.0)
    xi = attention_weights(1, W, W[1], ["w"], params)
    # ||w1 - w2||^2 = 2, ||w1 - w3||^2 = 1; xi_1j = alpha_k exp(-d / sigma) / sigma
    x12, x13 = 0.5 * math.exp(-1.0) / 2, 0.5 * math.exp(-0.5) / 2
    assert xi[2] == pytest.approx(x12) and xi[3] == pytest.approx(x13)
    assert xi[1] == pytest.approx(1 - x12 - x13)  # xi_ii = 1 - sum of the others
    assert sum(xi.values()) == pytest.approx(1.0)
    u1 = cloud_model(xi, W, W[1], 1)["w"]
    assert torch.allclose(u1, torch.tensor([1 - x12 - x13 + x13, x12 + x13]))


def test_alone_a_client_is_its_own_cloud_model_and_integers_are_its_own():
    assert attention_weights(1, {1: W[1]}, W[1], ["w"], FedAMPParams()) == {1: 1.0}
    own = {"w": torch.tensor([1.0]), "n": torch.tensor(3)}
    other = {"w": torch.tensor([3.0]), "n": torch.tensor(7)}
    u = cloud_model({1: 0.5, 2: 0.5}, {2: other}, own, 1)
    assert torch.equal(u["w"], torch.tensor([2.0])) and int(u["n"]) == 3


def test_the_proximal_term_by_hand():
    plugin = FedAMP(FedAMPParams(lam=3.0, alpha_k=0.5))
    model = linear([1.0, 2.0], [0.5])
    client = SimpleNamespace(scratch={"u": [torch.tensor([[0.0, -1.0]]), torch.tensor([1.5])]})
    # ||w - u||^2 = 1 + 9 + 1 = 11; lambda / (2 alpha_k) * 11 = 3 / 1 * 11
    term = plugin.local_objective(ctx=None, client=client, model=model, x=None, y=None, logits=None)
    assert term.item() == pytest.approx(33.0)
    assert plugin.local_objective(ctx=None, client=SimpleNamespace(scratch={}), model=model, x=None, y=None,
                                  logits=None) is None


# -- in a run ---------------------------------------------------------------------------------------


def test_each_participant_trains_from_its_cloud_model_built_from_every_clients_last_model(monkeypatch):
    engine, ctx = prepared(**BASE, **{"algorithm.params.sigma": 5.0, "algorithm.params.xi": 0.3})
    init = ctx.models.initial_state("mlp")
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 1)
    for call in calls:  # round 1: nobody uploaded yet, u_i = w_i = the initial weights
        assert_same(call["before"], init)
    models = {i: {k: v.clone() for k, v in ctx.server["models"][i].items()} for i in range(4)}
    for i in range(4):
        assert_same(models[i], ctx.store[i]["weights"])  # the server holds what each client uploaded
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    names = [n for n, _ in ctx.models.build("mlp").named_parameters()]
    for call in calls:
        i = call["client"]
        flat = {j: torch.cat([models[j][n].reshape(-1).double() for n in names]) for j in range(4)}
        score = {j: math.exp(5.0 * float(flat[i] @ flat[j] / (flat[i].norm() * flat[j].norm())))
                 for j in range(4) if j != i}
        xi = {j: 0.7 * s / sum(score.values()) for j, s in score.items()}
        for key, value in call["before"].items():
            expected = 0.3 * models[i][key].double() + sum(xi[j] * models[j][key].double() for j in xi)
            assert torch.allclose(value.double(), expected, atol=1e-6), key
        assert far_apart(call["before"], models[i], names)


def test_xi_one_and_lambda_zero_is_local_bit_for_bit():
    def run(**extra):
        engine, ctx = prepared(**{**BASE, **extra})
        for r in (1, 2, 3):
            engine.run_round(ctx, r)
        return ctx

    amp = run(**{"algorithm.params.xi": 1.0, "algorithm.params.lam": 0.0, "experiment.participation": 0.5})
    local = run(**{"algorithm.name": "local", "experiment.participation": 0.5})
    trained = [i for i in range(4) if "weights" in local.store[i]]
    assert trained and trained == [i for i in range(4) if "weights" in amp.store[i]]
    for i in trained:
        assert_same(amp.store[i]["weights"], local.store[i]["weights"])
    # ... and either xi < 1 or lam > 0 moves away from Local: the test can tell them apart
    for extra in ({"algorithm.params.xi": 0.5, "algorithm.params.lam": 0.0},
                  {"algorithm.params.xi": 1.0, "algorithm.params.lam": 1.0}):
        pulled = run(**extra, **{"experiment.participation": 0.5})
        assert far_apart(pulled.store[trained[-1]]["weights"], local.store[trained[-1]]["weights"],
                         list(local.store[trained[-1]]["weights"]))


def test_the_evaluated_model_is_the_clients_own_and_bytes_are_one_model_each_way():
    engine, ctx = prepared(**BASE, **{"experiment.participation": 0.5})
    for r in (1, 2):
        engine.run_round(ctx, r)
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(model, ctx.store[i].get("weights") or ctx.models.initial_state("mlp"))
    one = model_bytes(ctx.models.initial_state("mlp"))
    assert ctx.comm_down == ctx.comm_up == 2 * 2 * one  # 2 rounds x 2 participants x one model
    logged = [row for row in ctx.client_series if row["name"] == "fedamp_self_weight"]
    assert "u" not in ctx.server  # the round's cloud models are not kept after aggregation
    # round 1: nobody else has a model, xi_ii = 1; round 2: xi_ii = xi
    assert [(row["round"], row["value"]) for row in logged] == [(1, 1.0), (1, 1.0), (2, pytest.approx(0.1)),
                                                                (2, pytest.approx(0.1))]


def test_a_full_run_with_a_coldstart_client():
    from pfl_core.engine import Engine, resolve

    result = Engine(resolve(tiny_raw(**BASE, **{"experiment.coldstart_clients": 1,
                                                "algorithm.params.attention": "distance"})), progress=False).run()
    assert 0.0 <= result.final["coldstart_acc_mean"] <= 1.0


# -- the distance variant's weights stay on the simplex ---------------------------------------------


def test_the_variants_defaults_by_hand():
    assert with_defaults(FedAMPParams(), 20) == FedAMPParams(alpha_k=1.0, lam=1.0)  # cosine: PFLlib's
    distance = with_defaults(FedAMPParams(attention="distance", sigma=2.0), 4)
    assert (distance.alpha_k, distance.lam) == (0.5, 0.5)  # sigma / N, and lambda / alpha_k = 1
    assert with_defaults(FedAMPParams(attention="distance", alpha_k=0.3), 4).lam == 0.3
    assert with_defaults(FedAMPParams(attention="distance", lam=2.0), 4) == FedAMPParams(
        attention="distance", alpha_k=0.25, lam=2.0)
    # the closest models (distance 0, A' = 1 / sigma) of the 3 others: xi_ij = (sigma / 4) / sigma = 1/4, xi_ii = 1/4
    same = {j: {"w": torch.tensor([1.0, 2.0])} for j in range(4)}
    xi = attention_weights(0, same, same[0], ["w"], distance)
    assert xi == {0: pytest.approx(0.25), 1: pytest.approx(0.25), 2: pytest.approx(0.25), 3: pytest.approx(0.25)}
    old = attention_weights(0, same, same[0], ["w"], FedAMPParams(attention="distance", alpha_k=1.0, sigma=1.0))
    assert old[0] == pytest.approx(-2.0)  # PFLlib's alpha_k = sigma = 1: 1 - 3


def distance_run(capsys, **params):
    from pfl_core.engine import Engine, resolve

    raw = tiny_raw(**{**BASE, "experiment.rounds": 3, "algorithm.params.attention": "distance", "training.lr": 0.01,
                      **{f"algorithm.params.{k}": v for k, v in params.items()}})
    engine = Engine(resolve(raw), progress=False)
    engine.run()
    own = [row["value"] for row in engine.ctx.client_series if row["name"] == "fedamp_self_weight"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pfl: warning: fedamp")]
    return own, warnings


def test_weights_off_the_simplex_are_warned_once_and_the_defaults_keep_them_on_it(capsys):
    own, warnings = distance_run(capsys, alpha_k=1.0, sigma=1.0, lam=1.0)  # PFLlib's values, the old defaults
    assert min(own) < 0
    assert len(warnings) == 1  # rounds 2 and 3 both leave the simplex: said once
    assert warnings[0].startswith("pfl: warning: fedamp: in round 2 the cloud model's own weight xi_ii (Eq. 5) is "
                                  "negative for 4 client(s)")
    assert "algorithm.params.alpha_k <= sigma / (N - 1) = 0.333" in warnings[0]
    own, warnings = distance_run(capsys)  # alpha_k = sigma / N
    assert min(own) >= 0.25 and warnings == []


# -- bad input --------------------------------------------------------------------------------------


def test_clients_of_several_architectures_are_refused():
    from pfl_core.engine import resolve
    from pfl_core.errors import SpecError

    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "fedamp averages weights" in info.value.message


@pytest.mark.parametrize("key,value", [("xi", 1.5), ("xi", -0.1), ("sigma", 0.0), ("alpha_k", -1.0), ("lam", -1.0),
                                       ("attention", "cosin")])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.xi": 2.0}))
    assert line.startswith("pfl-run: error: algorithm.params.xi") and "[0, 1]" in line
