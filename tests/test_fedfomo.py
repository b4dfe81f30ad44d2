"""FedFomo (plugins/fedfomo): the weights with max(0, .) and their normalisation by hand, the
update, the epsilon-greedy choice, a client's update in a run recomputed from its validation
losses, the affinities, the bytes of M downloads, M = 0 = Local bit for bit, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import assert_same, dry_run_error, model_bytes, prepared, recorded_training, refused_at_key
from tiny import tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models
from pfl_plugins.fedfomo import choose_downloads, distance, fomo_update, fomo_weights, normalised

BASE = {"algorithm.name": "fedfomo", "model.params.hidden": [8], "experiment.rounds": 3}


# -- (F1), (F2) by hand ------------------------------------------------------------------------------


def test_weights_by_hand():
    # L_i(theta_i) = 1.0; models with losses 0.5, 1.5, 0.2 at distances 2, 1, 4
    assert fomo_weights(1.0, [0.5, 1.5, 0.2], [2.0, 1.0, 4.0]) == pytest.approx([0.25, -0.5, 0.2])
    assert fomo_weights(1.0, [0.0], [0.0]) == [0.0]  # the same model: no information
    a, b = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(1)}, {"w": torch.tensor([4.0, 6.0]), "n": torch.tensor(9)}
    assert distance(a, b, ["w"]) == pytest.approx(5.0)  # sqrt(9 + 16), parameters only


def test_negative_weights_are_dropped_and_the_rest_sum_to_one():
    assert normalised([0.25, -0.5, 0.2]) == pytest.approx([0.25 / 0.45, 0.0, 0.2 / 0.45])
    assert normalised([-1.0, -2.0]) == [0.0, 0.0]  # nothing helps: no move
    assert normalised([0.0, 3.0]) == [0.0, 1.0]


def test_the_update_by_hand():
    own = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(5)}
    models = [{"w": torch.tensor([3.0, 1.0]), "n": torch.tensor(7)}, {"w": torch.tensor([1.0, 5.0]), "n": torch.tensor(8)},
              {"w": torch.tensor([100.0, 100.0]), "n": torch.tensor(9)}]
    out = fomo_update(own, models, [0.25, 0.75, 0.0])
    # (1, 1) + 0.25 (2, 0) + 0.75 (0, 4) = (1.5, 4); the third has weight 0
    assert torch.allclose(out["w"], torch.tensor([1.5, 4.0])) and int(out["n"]) == 5
    assert torch.equal(fomo_update(own, models, [0.0, 0.0, 0.0])["w"], own["w"])


def test_epsilon_greedy_choice():
    rng = np.random.default_rng(0)
    affinity = {1: 0.5, 2: 3.0, 3: -1.0, 4: 2.0}
    assert choose_downloads([1, 2, 3, 4], affinity, 2, 0.0, rng) == [2, 4]  # greedy: the best two
    assert choose_downloads([1, 2, 3, 4], affinity, 4, 0.0, rng) == [1, 2, 3, 4]  # no more than there are
    assert choose_downloads([1, 2], affinity, 0, 0.0, rng) == []
    explored = {tuple(choose_downloads([1, 2, 3, 4], affinity, 2, 1.0, np.random.default_rng(s))) for s in range(30)}
    assert len(explored) > 3  # epsilon = 1: random choices, not the greedy pair
    ties = {choose_downloads([1, 2, 3], {}, 1, 0.0, np.random.default_rng(s))[0] for s in range(30)}
    assert ties == {1, 2, 3}  # equal affinities: broken at random


# -- in a run ---------------------------------------------------------------------------------------


def val_loss(ctx, i, state):
    model = ctx.models.build("mlp")
    model.load_state_dict(state)
    data = ctx.data.clients[i]
    with torch.no_grad():
        return float(F.cross_entropy(model.eval()(data.val_x), data.val_y))


def test_a_clients_update_recomputed_from_its_validation_losses(monkeypatch):
    # IID clients: another client's model is often better on my validation split (w_n > 0)
    engine, ctx = prepared(**BASE, **{"algorithm.params.M": 2, "partition.scheme": "iid"})
    engine.run_round(ctx, 1)
    own = {i: {k: v.clone() for k, v in ctx.store[i]["weights"].items()} for i in range(4)}
    ctx.round = 2  # the broadcasts of round 2: the same seeded draws as the engine's
    sent = {i: ctx.hooks.on_broadcast(ctx=ctx, client_id=i)["models"] for i in range(4)}
    with recorded_training(monkeypatch) as calls:
        engine.run_round(ctx, 2)
    names = [n for n, _ in ctx.models.build("mlp").named_parameters()]
    moved = 0
    for call in calls:
        i = call["client"]
        ids = sorted(sent[i])
        assert len(ids) == 2 and i not in ids
        L = val_loss(ctx, i, own[i])
        w = []
        for n in ids:
            d = sum(((sent[i][n][k] - own[i][k]) ** 2).sum() for k in names).sqrt()
            w.append((L - val_loss(ctx, i, sent[i][n])) / float(d))
        positive = [max(x, 0.0) for x in w]
        expected = {k: v.clone() for k, v in own[i].items()}
        if sum(positive) > 0:
            moved += 1
            for k in expected:
                expected[k] = own[i][k] + sum(p / sum(positive) * (sent[i][n][k] - own[i][k]) for p, n in zip(positive, ids))
        for k, v in call["before"].items():
            assert torch.allclose(v, expected[k], atol=1e-6), (i, k)
        # (F3): the server added the raw w_n to p_{i,n}
        assert ctx.server["P"][i] == {n: pytest.approx(x, abs=1e-5) for n, x in zip(ids, w)}
        logged = [row["value"] for row in ctx.client_series
                  if row["round"] == 2 and row["client"] == i and row["name"] == "fomo_positive"]
        assert logged == [sum(x > 0 for x in w)]
    assert moved  # some client found a helpful model: the update was exercised


class WeightSpy(Plugin):
    """Each participant's uploaded w_n, by round (a wrapper: after the algorithm)."""

    name = "weight_spy"

    def __init__(self):
        super().__init__()
        self.seen = {}

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.seen[(ctx.round, client.id)] = dict(upload["fomo"])
        return upload


def test_the_affinities_are_the_sum_of_every_rounds_weights_not_the_last():
    # M = 3 of the 3 other clients: every client downloads every other model in rounds 2-4, so
    # p_{i,n} = w_n(2) + w_n(3) + w_n(4); "sum" and "last" differ from round 3 on
    resolved = resolve(tiny_raw(**{**BASE, "experiment.rounds": 4, "algorithm.params.M": 3, "partition.scheme": "iid"}))
    spy = WeightSpy()
    resolved.plugins.insert(0, spy)
    engine = Engine(resolved, progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    for r in (1, 2, 3, 4):
        engine.run_round(ctx, r)
        for i in range(4):
            expected = {n: sum(spy.seen[(t, i)][n] for t in range(2, r + 1)) for n in range(4) if n != i and r > 1}
            assert ctx.server["P"].get(i, {}) == pytest.approx(expected, abs=1e-12), (r, i)
            if r > 2:  # the sum is not the last round's weights
                assert max(abs(ctx.server["P"][i][n] - spy.seen[(r, i)][n]) for n in expected) > 1e-3, (r, i)


def test_the_client_is_charged_for_m_downloads():
    engine, ctx = prepared(**BASE, **{"algorithm.params.M": 2})
    one = model_bytes(ctx.models.initial_state("mlp"))
    engine.run_round(ctx, 1)
    assert ctx.comm_down == 0  # nobody has uploaded yet: nothing to download
    assert ctx.comm_up == 4 * one  # the models, and no weights yet
    for r in (2, 3):
        engine.run_round(ctx, r)
    assert ctx.comm_down == 2 * 4 * 2 * one  # rounds 2-3 x 4 participants x M = 2 models
    assert ctx.comm_up == 3 * 4 * one + 2 * 4 * 2 * 8  # and M = 2 weights (8 bytes each) from round 2


def test_m_zero_is_local_bit_for_bit_and_the_evaluated_model_is_the_clients_own():
    def run(**extra):
        engine, ctx = prepared(**{**BASE, **extra, "experiment.participation": 0.5})
        for r in (1, 2, 3):
            engine.run_round(ctx, r)
        return ctx

    fomo, local = run(**{"algorithm.params.M": 0}), run(**{"algorithm.name": "local"})
    trained = [i for i in range(4) if "weights" in local.store[i]]
    assert trained == [i for i in range(4) if "weights" in fomo.store[i]]
    for i in trained:
        assert_same(fomo.store[i]["weights"], local.store[i]["weights"])
    assert fomo.comm_down == 0
    ctx = run()
    for i in range(4):
        model = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert_same(model, ctx.store[i].get("weights") or ctx.models.initial_state("mlp"))


def test_the_epsilon_schedule():
    from pfl_plugins.fedfomo import FedFomo, FedFomoParams

    plugin = FedFomo(FedFomoParams(epsilon=0.3, epsilon_decay=0.1))
    assert [plugin.epsilon(t) for t in (1, 2, 4, 5)] == pytest.approx([0.3, 0.2, 0.0, 0.0])


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("M", -1), ("M", 2.0), ("epsilon", 1.5), ("epsilon_decay", -0.1)])
def test_bad_parameters_are_refused_at_their_key(key, value):
    refused_at_key(BASE, key, value)


def test_no_validation_split_is_refused_before_data_loads():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"partition.val_fraction": 0.0}))
    assert info.value.path == "partition.val_fraction" and "validation split" in info.value.message
    assert info.value.message.endswith("split: set it > 0 (or M = 0)")
    with pytest.raises(SpecError):  # one download needs the split too
        resolve(tiny_raw(**BASE, **{"partition.val_fraction": 0.0, "algorithm.params.M": 1}))
    resolve(tiny_raw(**BASE, **{"partition.val_fraction": 0.0, "algorithm.params.M": 0}))  # Local needs none


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**BASE, **{"model.pool": ["mlp", "lenet5"]}))
    assert info.value.path == "model.pool" and "fedfomo averages weights" in info.value.message


def test_cli_dry_run_exits_2_naming_the_key(tmp_path, capsys):
    line = dry_run_error(tmp_path, capsys, tiny_raw(**BASE, **{"algorithm.params.M": -2}))
    assert line.startswith("pfl-run: error: algorithm.params.M") and ">= 0" in line
