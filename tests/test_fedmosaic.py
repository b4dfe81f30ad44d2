"""FedMosaic and FedCT: the consensus, lambda, expertise, communication, equivalence, bad input."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pfl_core import tomlout
from pfl_core.cli import run_main
from pfl_core.context import load_state
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.payload import nbytes
from pfl_core.tracking import NullTracker
from plugins.fedct import FedCT, FedCTParams
from plugins.fedmosaic import (FedMosaic, FedMosaicParams, adaptive_lambda, consensus, dequantise,
                               expertise_scores, mean_loss, quantise)
from tiny import run_tiny, tiny_raw

# The engine's tiny MLP steps are dominated by thread contention on a loaded 2-core machine.
torch.set_num_threads(1)

PUBLIC = {"public.size": 60}


def mosaic(**params):
    return {"algorithm.name": "fedmosaic", **PUBLIC, **{f"algorithm.params.{k}": v for k, v in params.items()}}


# -- the consensus -------------------------------------------------------------------


def test_consensus_on_a_hand_computed_example_with_a_tie():
    # 3 clients, |U| = 4, C = 3.
    labels = [torch.tensor([0, 1, 2, 1]), torch.tensor([1, 1, 0, 2]), torch.tensor([1, 2, 0, 0])]
    experts = [torch.tensor([0.9, 0.2, 0.5, 0.4]), torch.tensor([0.3, 0.2, 0.25, 0.4]),
               torch.tensor([0.3, 0.1, 0.25, 0.4])]
    # S row 0: c0 = 0.9, c1 = 0.3 + 0.3 = 0.6            -> 0 (an expert outvotes two)
    # S row 1: c1 = 0.2 + 0.2 = 0.4, c2 = 0.1             -> 1
    # S row 2: c2 = 0.5, c0 = 0.25 + 0.25 = 0.5           -> tie: lowest class, 0
    # S row 3: c1 = c2 = c0 = 0.4                          -> three-way tie: 0
    got = consensus(zip(labels, experts), 4, 3)
    assert got.tolist() == [0, 1, 0, 0]
    # uniform weights (FedCT's majority vote): row 0 -> 1 (two votes), row 3 -> tie -> 0
    assert consensus(((l, None) for l in labels), 4, 3).tolist() == [1, 1, 0, 0]


# -- lambda --------------------------------------------------------------------------


def test_lambda_formula_and_its_three_regimes():
    assert adaptive_lambda(0.5, 0.8, eps=0) == pytest.approx(math.exp(-(0.8 - 0.5) / 0.5))
    conflict = adaptive_lambda(0.1, 2.0)            # consensus contradicts the local data
    alignment = adaptive_lambda(0.7, 0.7)
    enhancement = adaptive_lambda(1.0, 0.4)         # the consensus is easier than local data
    assert conflict < 1e-8
    assert alignment == pytest.approx(1.0, abs=1e-5)
    assert 1 < enhancement <= math.e
    assert adaptive_lambda(1.0, 0.0, eps=0) == pytest.approx(math.e)  # the upper bound
    t = adaptive_lambda(torch.tensor(0.5, requires_grad=True), torch.tensor(0.8, requires_grad=True))
    assert not t.requires_grad  # a weight, computed without gradient


# -- expertise -----------------------------------------------------------------------


def test_expertise_W_is_the_class_frequency_of_the_prediction_plus_eps():
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 2.0, 0.0]])
    e = expertise_scores("W", logits, [6, 0, 2], eps=1e-3)
    assert e.tolist() == pytest.approx([0.75 + 1e-3, 0.25 + 1e-3, 0.0 + 1e-3])


def test_expertise_U_is_log_C_minus_the_entropy_plus_eps():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0]])
    e = expertise_scores("U", logits, None, eps=1e-3)
    p = torch.tensor([0.5, 1 / 6, 1 / 6, 1 / 6])
    entropy = float(-(p * p.log()).sum())
    assert e.tolist() == pytest.approx([1e-3, math.log(4) - entropy + 1e-3])  # uniform: no expertise
    confident = expertise_scores("U", torch.tensor([[100.0, 0, 0, 0]]), None, eps=0)
    assert float(confident) == pytest.approx(math.log(4))


def test_quantisation_round_trip_within_half_a_step():
    values = torch.rand(1000, dtype=torch.float64) * math.log(10)
    back = dequantise(quantise(values, math.log(10), 8), math.log(10), 8)
    assert (back - values).abs().max() <= math.log(10) / 255 / 2 + 1e-12
    assert quantise(torch.tensor([-1.0, 9.0]), 1.0, 8).tolist() == [0, 255]  # clipped to [0, c]


# -- communication -------------------------------------------------------------------


def stand_in(num_public=10_000, num_classes=10):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, num_classes)
    ctx = SimpleNamespace(
        num_classes=num_classes,
        data=SimpleNamespace(public=SimpleNamespace(x=torch.randn(num_public, 4))),
        spec=SimpleNamespace(evaluation=SimpleNamespace(batch_size=4096)),
    )
    data = SimpleNamespace(label_counts=lambda split, c: [5] * c)
    return ctx, SimpleNamespace(model=model, data=data)


def test_the_papers_bits_example_120000_bits_up_per_client_and_round():
    ctx, client = stand_in()
    upload = FedMosaic(FedMosaicParams(expertise="U")).client_upload(ctx, client)
    assert nbytes(upload) == 15_000 == 10_000 * (4 + 8) // 8
    assert nbytes(FedCT(FedCTParams()).client_upload(ctx, client)) == 5_000  # labels only
    ctx.server = {"consensus": torch.zeros(10_000, dtype=torch.uint8)}
    assert nbytes(FedMosaic(FedMosaicParams()).on_broadcast(ctx, 0)) == 5_000  # 4 bits per label down


def test_counted_bytes_in_a_run_match_the_encoding():
    result, _ = run_tiny(**mosaic(), **{"experiment.rounds": 2})
    # 4 clients, |U| = 60, C = 10: up 60 * 12 bits = 90 bytes; down 30 bytes from round 2 on
    assert [h["comm_up_bytes"] for h in result.history] == [4 * 90, 8 * 90]
    assert [h["comm_down_bytes"] for h in result.history] == [0, 4 * 30]


# -- FedCT ---------------------------------------------------------------------------


def test_fedct_equals_fedmosaic_with_lambda_fixed_at_one_and_uniform_expertise():
    rounds = {"experiment.rounds": 3}
    _, ct = run_tiny(**{"algorithm.name": "fedct", **PUBLIC, **rounds})
    _, fixed = run_tiny(**mosaic(fixed_lambda=1.0, expertise="uniform"), **rounds)
    _, adaptive = run_tiny(**mosaic(expertise="uniform"), **rounds)
    for i in range(4):
        a, b, c = ct.ctx.store[i]["weights"], fixed.ctx.store[i]["weights"], adaptive.ctx.store[i]["weights"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the adaptive lambda does change training
    assert torch.equal(ct.ctx.server["consensus"], fixed.ctx.server["consensus"])


# -- lambda in a run: logged, plotted, "round" mode ------------------------------------


class Recorder(NullTracker):
    def __init__(self):
        self.metrics, self.figures, self.texts = {}, [], {}

    def log_metrics(self, metrics, step):
        self.metrics[step] = dict(metrics)

    def log_figure(self, figure, filename):
        self.figures.append(filename)

    def log_text(self, text, filename):
        self.texts[filename] = text


def test_lambda_is_logged_per_client_every_round_and_plotted_at_the_end():
    tracker = Recorder()
    engine = Engine(resolve(tiny_raw(**mosaic(), **{"experiment.rounds": 3})), tracker=tracker, progress=False)
    engine.run()
    assert not any(k.startswith("lambda/") for k in tracker.metrics[1])  # no consensus in round 1
    for r in (2, 3):
        assert {f"lambda/{i}" for i in range(4)} <= set(tracker.metrics[r])
        assert all(0 <= tracker.metrics[r][f"lambda/{i}"] <= math.e for i in range(4))
        assert 0 <= tracker.metrics[r]["consensus_acc"] <= 1
    assert "fedmosaic/lambda_by_round.png" in tracker.figures
    assert tracker.texts["fedmosaic/lambda_by_round.csv"].count("\n") == 1 + 4 * 2


def test_round_mode_lambda_comes_from_the_full_set_losses_before_training():
    engine = Engine(resolve(tiny_raw(**mosaic(lambda_mode="round"))), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    ctx.round_metrics = {}
    engine.run_round(ctx, 1)
    client = ctx.client(0)
    model = load_state(client.model, ctx.store[0]["weights"])
    pseudo = ctx.server["consensus"].long()
    l_priv = mean_loss(model, client.data.train_x, client.data.train_y, 1024)
    l_pseudo = mean_loss(model, ctx.data.public.x, pseudo, 1024)
    ctx.round_metrics = {}
    engine.run_round(ctx, 2)
    assert ctx.round_metrics["lambda/0"] == pytest.approx(adaptive_lambda(l_priv, l_pseudo, 1e-6), rel=1e-5)


# -- bad input -----------------------------------------------------------------------


def test_a_public_set_method_without_a_public_set_fails_at_validation():
    for name in ("fedmosaic", "fedct"):
        with pytest.raises(SpecError) as err:
            resolve(tiny_raw(**{"algorithm.name": name}))
        assert err.value.path == "public"


def test_an_unknown_expertise_mode_fails_naming_the_key():
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**mosaic(expertise="entropy")))
    assert err.value.path == "algorithm.params.expertise" and "'W', 'U', 'uniform'" in str(err.value)
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**mosaic(lambda_mode="epoch")))
    assert err.value.path == "algorithm.params.lambda_mode"


def test_a_public_set_larger_than_the_pool_fails_naming_the_key():
    with pytest.raises(SpecError) as err:
        Engine(resolve(tiny_raw(**{**mosaic(), "public.size": 10_000})), progress=False).prepare()
    assert err.value.path == "public.size"


def test_cli_dry_run_exits_2_with_one_line(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text(tomlout.dumps(tiny_raw(**mosaic(expertise="X"))))
    assert run_main([str(spec), "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "algorithm.params.expertise" in err[0]
