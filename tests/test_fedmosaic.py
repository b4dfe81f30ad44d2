"""FedMosaic and FedCT: the consensus, lambda, expertise, communication, equivalence, bad input."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import run_tiny, tiny_raw

from pfl_core import Plugin, hookimpl
from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.methods.codistill import predict_logits
from pfl_core.payload import nbytes
from pfl_core.runtime.context import load_state
from pfl_core.runtime.evaluation import score
from pfl_core.spec import dump_toml
from pfl_core.tracking.tracker import NullTracker
from pfl_plugins.fedct import FedCT, FedCTParams
from pfl_plugins.fedmosaic import (
    FedMosaic,
    FedMosaicParams,
    adaptive_lambda,
    consensus,
    consensus_scores,
    dequantise,
    expertise_scores,
    mean_loss,
    public_batches,
    quantise,
    tie_share,
)

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
    # the tie share: the rows the tie rule decides (weighted: rows 2 and 3; uniform: row 3)
    assert tie_share(consensus_scores(zip(labels, experts), 4, 3)) == 0.5
    assert tie_share(consensus_scores(((l, None) for l in labels), 4, 3)) == 0.25


def test_a_tie_is_a_tie_whatever_order_the_server_summed_the_votes_in():
    # class 0 gets 0.3 + 0.2 + 0.1 = 0.6 and class 1 gets 0.1 + 0.2 + 0.3 = 0.6000000000000001
    # in float64: the same three weights, summed in another order. Lowest class wins the tie.
    def vote(label, weight):
        return torch.tensor([label]), torch.tensor([weight], dtype=torch.float64)

    votes = [vote(0, 0.3), vote(1, 0.1), vote(0, 0.2), vote(1, 0.2), vote(0, 0.1), vote(1, 0.3)]
    scores = consensus_scores(votes, 1, 2)
    assert scores[0, 0] < scores[0, 1]  # the rounding this test is about
    assert consensus(votes, 1, 2).tolist() == [0] and tie_share(scores) == 1.0
    # a real difference (one 8-bit step of a weight) is not a tie
    votes[-1] = vote(1, 0.3 + 1 / 255)
    assert consensus(votes, 1, 2).tolist() == [1] and tie_share(consensus_scores(votes, 1, 2)) == 0.0


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
    mixed = adaptive_lambda(torch.tensor(0.5, requires_grad=True), 0.8)
    assert isinstance(mixed, torch.Tensor) and not mixed.requires_grad
    assert adaptive_lambda(0.5, 0.8, eps=0.5) == pytest.approx(math.exp(-0.3 / 1.0))  # eps added to l_priv
    assert float(adaptive_lambda(torch.tensor(0.5), torch.tensor(0.8), eps=0.5)) == pytest.approx(math.exp(-0.3))


# -- one local step on a hand-set model -------------------------------------------------


def one_step(pseudo_y=None, **params):
    """FedMosaic.local_train for one step (batch 1, SGD lr 0.5) of a Linear(2, 2) set to the
    identity, private example ([1, 0], y = 0), public example [0, 1]; no engine."""
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
        model.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logged, work = {}, []
    training = SimpleNamespace(batch_size=1, local_epochs=1, shuffle=False, drop_last=True)
    ctx = SimpleNamespace(spec=SimpleNamespace(training=training, evaluation=SimpleNamespace(batch_size=16)),
                          data=SimpleNamespace(public=SimpleNamespace(x=torch.tensor([[0.0, 1.0]]))),
                          round=2, log=lambda metrics=None, **more: logged.update(metrics or {}, **more))
    client = SimpleNamespace(
        id=0, model=model, optimizer=lambda: optimizer, state={}, generator=lambda purpose: torch.Generator(),
        data=SimpleNamespace(train_x=torch.tensor([[1.0, 0.0]]), train_y=torch.tensor([0])),
        scratch={} if pseudo_y is None else {"pseudo_y": torch.tensor([pseudo_y])},
        objective=lambda model, x, y, logits: F.cross_entropy(logits, y),
        take_batch=lambda: True,  # no straggler's budget
        count_work=lambda private=0, public=0: work.append((private, public)),
        log=lambda **values: logged.update(values))
    metrics = FedMosaic(FedMosaicParams(**{"warmup_epochs": 0, **params})).local_train(ctx, client)
    return model, metrics, logged, work


def softplus(v):
    return math.log1p(math.exp(v))


def test_batch_mode_takes_lambda_from_the_step_and_never_from_the_whole_sets(monkeypatch):
    """Alg. 1's per-step lambda: the full-set ("round") lambda is never computed in batch mode
    (here the two would coincide, one example each, so the call itself is what is checked)."""
    monkeypatch.setattr(FedMosaic, "_round_lambda", lambda *a, **k: pytest.fail("batch mode computed a round lambda"))
    _, _, logged, _ = one_step(pseudo_y=0)
    l_priv, l_pseudo = softplus(-1), softplus(1)
    assert logged["lambda"] == pytest.approx(math.exp(-(l_pseudo - l_priv) / (l_priv + 1e-6)), rel=1e-5)


def test_one_step_descends_l_priv_plus_a_gradient_free_lambda_times_l_pseudo():
    model, metrics, logged, work = one_step(pseudo_y=0)
    # logits: private [1, 0] (label 0), public [0, 1] (consensus label 0)
    l_priv, l_pseudo = softplus(-1), softplus(1)            # l_pseudo - l_priv = 1 exactly
    lam = math.exp(-(l_pseudo - l_priv) / (l_priv + 1e-6))  # ~0.041; a flipped sign gives ~24
    assert logged["lambda"] == pytest.approx(lam, rel=1e-5)
    assert metrics["train_loss"] == pytest.approx(l_priv + lam * l_pseudo, rel=1e-5)
    # d CE / d logits = softmax - onehot: private [-(1 - s), 1 - s], public [-s, s], s = sigmoid(1).
    # With lambda a constant (no gradient through it): W <- I - 0.5 (g_priv x_priv^T + lambda g_pub x_pub^T)
    s = 1 / (1 + math.exp(-1))
    expected_w = [[1 + 0.5 * (1 - s), 0.5 * lam * s], [-0.5 * (1 - s), 1 - 0.5 * lam * s]]
    expected_b = [0.5 * ((1 - s) + lam * s), -0.5 * ((1 - s) + lam * s)]
    assert model.weight.tolist() == [pytest.approx(row, rel=1e-5) for row in expected_w]
    assert model.bias.tolist() == pytest.approx(expected_b, rel=1e-5)
    assert work == [(1, 1)]  # one private and one public sample counted


def test_no_pseudo_term_before_any_consensus_exists():
    model, metrics, logged, work = one_step(pseudo_y=None)
    s = 1 / (1 + math.exp(-1))
    assert metrics["train_loss"] == pytest.approx(softplus(-1), rel=1e-6)
    assert model.weight.tolist() == [pytest.approx([1 + 0.5 * (1 - s), 0.0]), pytest.approx([-0.5 * (1 - s), 1.0])]
    assert model.bias.tolist() == pytest.approx([0.5 * (1 - s), -0.5 * (1 - s)])
    assert not logged and work == [(1, 0)]  # no lambda, no public sample


def test_a_fixed_lam_replaces_the_adaptive_weight():
    model, metrics, logged, _ = one_step(pseudo_y=0, lam=2.0)
    assert logged["lambda"] == 2.0
    assert metrics["train_loss"] == pytest.approx(softplus(-1) + 2 * softplus(1), rel=1e-6)


# -- expertise -----------------------------------------------------------------------


def test_expertise_W_is_the_class_frequency_of_the_prediction_plus_eps():
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 2.0, 0.0]])
    e = expertise_scores("W", logits, [6, 0, 2], eps=1e-3)
    assert e.tolist() == pytest.approx([0.75 + 1e-3, 0.25 + 1e-3, 0.0 + 1e-3])
    assert expertise_scores("W", logits[:1], [1, 0, 0], eps=0).tolist() == [1.0]  # a one-example client


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
    assert quantise(torch.tensor([1.0]), 1.0, 8).dtype == torch.uint8
    assert quantise(torch.tensor([1.0]), 1.0, 9).tolist() == [511]  # no wrap-around past 8 bits


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


def test_uploaded_labels_and_expertise_codes_by_hand():
    # C = 4, |U| = 2; logits chosen so the predictions and entropies are known.
    ctx, client = stand_in(num_public=2, num_classes=4)
    with torch.no_grad():
        client.model.weight.zero_()
        client.model.bias.copy_(torch.tensor([0.0, math.log(3), 0.0, 0.0]))
    client.data = SimpleNamespace(label_counts=lambda split, c: [1, 3, 0, 0])
    p = torch.tensor([1 / 6, 1 / 2, 1 / 6, 1 / 6])
    confidence = math.log(4) + float((p * p.log()).sum())  # log C - H
    upload = FedMosaic(FedMosaicParams(expertise="U")).client_upload(ctx, client)
    assert upload["labels"].value.tolist() == [1, 1] and upload["labels"].bits == 2
    assert upload["expertise"].value.tolist() == [round(confidence / math.log(4) * 255)] * 2
    upload = FedMosaic(FedMosaicParams(expertise="W")).client_upload(ctx, client)
    assert upload["expertise"].value.tolist() == [round(0.75 * 255)] * 2  # share of class 1


def test_public_batches_split_each_pass_over_u_evenly_over_an_epochs_steps():
    gen = torch.Generator().manual_seed(0)
    batches = public_batches(10, 3, 10, gen)
    epoch = [next(batches) for _ in range(3)]
    assert [len(b) for b in epoch] == [4, 3, 3]
    assert sorted(torch.cat(epoch).tolist()) == list(range(10))  # one pass: every example once
    second = torch.cat([next(batches) for _ in range(3)])
    assert sorted(second.tolist()) == list(range(10)) and not torch.equal(second, torch.cat(epoch))
    # 1.5 passes per epoch: over two epochs every example exactly three times
    batches = public_batches(10, 2, 15, torch.Generator().manual_seed(0))
    seen = torch.cat([next(batches) for _ in range(4)])
    assert torch.bincount(seen, minlength=10).tolist() == [3] * 10


def test_counted_bytes_in_a_run_match_the_encoding():
    result, _ = run_tiny(**mosaic(), **{"experiment.rounds": 2})
    # 4 clients, |U| = 60, C = 10: up 60 * 12 bits = 90 bytes; down 30 bytes from round 2 on
    assert [h["comm_up_bytes"] for h in result.history] == [4 * 90, 8 * 90]
    assert [h["comm_down_bytes"] for h in result.history] == [0, 4 * 30]


# -- FedCT ---------------------------------------------------------------------------


def test_fedct_equals_fedmosaic_with_lambda_fixed_at_one_and_uniform_expertise():
    rounds = {"experiment.rounds": 3}
    _, ct = run_tiny(**{"algorithm.name": "fedct", **PUBLIC, **rounds})
    _, fixed = run_tiny(**mosaic(lam=1.0, expertise="uniform", warmup_epochs=0), **rounds)
    _, adaptive = run_tiny(**mosaic(expertise="uniform", warmup_epochs=0), **rounds)
    for i in range(4):
        a, b, c = ct.ctx.store[i]["weights"], fixed.ctx.store[i]["weights"], adaptive.ctx.store[i]["weights"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the adaptive lambda does change training
    assert torch.equal(ct.ctx.server["consensus"], fixed.ctx.server["consensus"])
    # with a warm-up too (FedCT's default is none)
    _, ct = run_tiny(**{"algorithm.name": "fedct", **PUBLIC, "algorithm.params.warmup_epochs": 1})
    _, fixed = run_tiny(**mosaic(lam=1.0, expertise="uniform", warmup_epochs=1))
    assert all(torch.equal(ct.ctx.store[0]["weights"][k], fixed.ctx.store[0]["weights"][k]) for k in a)


# -- warm-up, phases, budget -----------------------------------------------------------


class UploadSpy(Plugin):
    """Records every upload as the server receives it (a test add-on, registered by hand)."""

    name = "upload_spy"

    def __init__(self):
        super().__init__()
        self.uploads = []

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.uploads.append((ctx.round, client.id, upload))
        return upload


def run_with_spy(**overrides):
    resolved = resolve(tiny_raw(**overrides))
    spy = UploadSpy()
    resolved.plugins.insert(0, spy)  # add-ons first, the algorithm last
    engine = Engine(resolved, progress=False)
    return engine.run(), engine, spy


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_warmup_is_private_training_before_the_first_upload():
    # Round 1 has no consensus: FedMosaic's round 1 with a 2-epoch warm-up is 3 epochs of
    # private training, exactly Local's 3 epochs (same batches, same optimiser), and the
    # first upload is that model's hard labels on U with its expertise.
    one = {"experiment.rounds": 1}
    result, mosaic_run, spy = run_with_spy(**mosaic(warmup_epochs=2), **one)
    local, local_run = run_tiny(**{"algorithm.name": "local", **PUBLIC, "training.local_epochs": 3}, **one)
    ctx = local_run.ctx
    for i in range(4):
        local_w = ctx.store[i]["weights"]
        assert same_weights(mosaic_run.ctx.store[i]["weights"], local_w)
        model = load_state(ctx.client(i).model, local_w)
        logits = predict_logits(model, ctx.data.public.x)
        (rnd, cid, upload), = [u for u in spy.uploads if u[1] == i]
        assert torch.equal(upload["labels"].value.long(), logits.argmax(1))
        counts = ctx.client(i).data.label_counts("train", ctx.num_classes)
        assert torch.equal(upload["expertise"].value, quantise(expertise_scores("W", logits, counts, 1e-6), 1.0, 8))
    assert result.final["budget.private_epochs"] == local.final["budget.private_epochs"]
    assert result.final["acc_mean"] == local.final["acc_mean"]


def test_warmup_happens_once_and_is_counted_in_the_budget():
    # FedMosaic: 2 warm-up epochs + 3 rounds x 1 epoch = 5 private epochs; Local 5 x 1.
    result, _ = run_tiny(**mosaic(warmup_epochs=2), **{"experiment.rounds": 3})
    local, _ = run_tiny(**{"algorithm.name": "local", **PUBLIC, "experiment.rounds": 5})
    assert result.final["budget.private_epochs"] == pytest.approx(local.final["budget.private_epochs"])
    declared = resolve(tiny_raw(**mosaic(warmup_epochs=2), **{"experiment.rounds": 3})).as_dict["budget"]
    assert declared["private_epochs"] == 5 and declared["pretrain_private_epochs"] == 2
    assert declared["private_epochs_per_round"] == 1
    # U: one pass per co-training epoch, rounds 2-3 only (no consensus in round 1)
    assert declared["public_epochs"] == 2 == pytest.approx(result.final["budget.public_epochs"])
    halved = resolve(tiny_raw(**mosaic(public_passes=0.5), **{"experiment.rounds": 3})).as_dict["budget"]
    assert halved["public_epochs"] == 1


def test_lambda_zero_is_local_training_bit_for_bit():
    # With lambda fixed at 0 the pseudo term adds exactly nothing: the private batches and
    # optimiser are client.train's, so the weights are Local's.
    _, zero = run_tiny(**mosaic(lam=0.0, warmup_epochs=0))
    _, local = run_tiny(**{"algorithm.name": "local", **PUBLIC})
    for i in range(4):
        assert same_weights(zero.ctx.store[i]["weights"], local.ctx.store[i]["weights"])


def test_uploads_are_hard_labels_and_expertise_never_parameters():
    _, engine, spy = run_with_spy(**mosaic(), **{"experiment.rounds": 2})
    num_public = len(engine.ctx.data.public.x)
    for _round, _cid, upload in spy.uploads:
        assert set(upload) == {"labels", "expertise"}
        assert upload["labels"].value.shape == upload["expertise"].value.shape == (num_public,)
        assert not upload["labels"].value.is_floating_point() and upload["expertise"].bits == 8
    _, _, spy = run_with_spy(**{"algorithm.name": "fedct", **PUBLIC, "experiment.rounds": 2})
    assert all(set(upload) == {"labels"} for _r, _c, upload in spy.uploads)


def test_the_evaluated_model_is_the_clients_own_h_i():
    result, engine = run_tiny(**mosaic(), **{"experiment.rounds": 2})
    ctx = engine.ctx
    for row in result.client_rows:
        client = ctx.client(row["client"])
        own = load_state(ctx.models.build(client.arch), ctx.store[client.id]["weights"])
        assert row["acc"] == score(own, client.data.test_x, client.data.test_y).accuracy
    assert not same_weights(ctx.store[0]["weights"], ctx.store[1]["weights"])


def test_consensus_diagnostics_are_logged_every_round_and_never_used():
    engine = Engine(resolve(tiny_raw(**mosaic(expertise="uniform"), **{"experiment.rounds": 2})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    shuffled = Engine(resolve(tiny_raw(**mosaic(expertise="uniform"), **{"experiment.rounds": 2})), progress=False)
    sctx = shuffled.prepare()
    sctx.hooks.setup(ctx=sctx)
    sctx.data.public.true_y = sctx.data.public.true_y.flip(0)  # other "true" labels for U
    for r in (1, 2):
        for e, c in ((engine, ctx), (shuffled, sctx)):
            c.round_metrics = {}
            e.run_round(c, r)
        labels = ctx.server["consensus"].long()
        assert torch.equal(labels, sctx.server["consensus"].long())  # the method never reads true_y
        assert ctx.round_metrics["consensus_acc"] == float((labels == ctx.data.public.true_y).double().mean())
        assert sctx.round_metrics["consensus_acc"] == float((labels == sctx.data.public.true_y).double().mean())
        assert "consensus_tie_share" in ctx.round_metrics
    assert same_weights(ctx.store[0]["weights"], sctx.store[0]["weights"])


# -- lambda in a run: logged, plotted, "round" mode ------------------------------------


class Recorder(NullTracker):
    def __init__(self):
        self.metrics, self.figures, self.texts = {}, [], {}

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_figure(self, figure, filename):
        self.figures.append(filename)

    def log_text(self, text, filename):
        self.texts[filename] = text


def test_lambda_is_logged_per_client_every_round_and_plotted_at_the_end():
    tracker = Recorder()
    engine = Engine(resolve(tiny_raw(**mosaic(), **{"experiment.rounds": 3})), tracker=tracker, progress=False)
    engine.run()
    lambdas = {(row["round"], row["client"]): row["value"] for row in engine.ctx.client_series
               if row["name"] == "lambda"}  # the run's per-client table (results/client_series.csv)
    assert sorted(lambdas) == [(r, i) for r in (2, 3) for i in range(4)]  # no consensus in round 1
    assert not any(k.startswith("lambda") for k in tracker.metrics[1])
    for r in (2, 3):
        assert all(0 <= lambdas[r, i] <= math.e for i in range(4))
        assert tracker.metrics[r]["lambda_mean"] == pytest.approx(np.mean([lambdas[r, i] for i in range(4)]))
        assert 0 <= tracker.metrics[r]["consensus_acc"] <= 1
    assert "fedmosaic/lambda_by_round.png" in tracker.figures
    assert tracker.texts["fedmosaic/lambda_by_round.csv"].count("\n") == 1 + 4 * 2
    assert not [key for key in tracker.metrics[3] if "/" in key]  # no metric per client


def test_corrupted_clients_sum_lambda_up_per_group():
    """corrupted_clients' final metrics: each group's mean of its clients' mean lambdas."""
    tracker = Recorder()
    raw = tiny_raw(**mosaic(), **{"experiment.rounds": 3})
    raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [1]}}]
    engine = Engine(resolve(raw), tracker=tracker, progress=False)
    engine.run()
    lambdas = {(row["round"], row["client"]): row["value"] for row in engine.ctx.client_series
               if row["name"] == "lambda"}
    mean_of = {i: (lambdas[2, i] + lambdas[3, i]) / 2 for i in range(4)}
    final = tracker.metrics[3]
    assert final["lambda_corrupted_mean"] == pytest.approx(mean_of[1])
    assert final["lambda_clean_mean"] == pytest.approx((mean_of[0] + mean_of[2] + mean_of[3]) / 3)


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
    (logged,) = [row["value"] for row in ctx.client_series if (row["round"], row["client"], row["name"]) == (2, 0, "lambda")]
    assert logged == pytest.approx(adaptive_lambda(l_priv, l_pseudo, 1e-6), rel=1e-5)


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


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_bad_warmup_fails_naming_the_key(value):
    for name in ("fedmosaic", "fedct"):
        with pytest.raises(SpecError) as err:
            resolve(tiny_raw(**{"algorithm.name": name, **PUBLIC, "algorithm.params.warmup_epochs": value}))
        assert err.value.path == "algorithm.params.warmup_epochs"


@pytest.mark.parametrize("key, bad, good", [("lam", -0.5, 0.0), ("comm_period", 0, 1),
                                           ("public_passes", 0.0, 0.01), ("expertise_bits", 0, 1),
                                           ("expertise_bits", 17, 16), ("eps", 0.0, 1e-12)])
def test_parameter_bounds_name_the_key(key, bad, good):
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**mosaic(**{key: bad})))
    assert err.value.path == f"algorithm.params.{key}"
    resolve(tiny_raw(**mosaic(**{key: good})))  # the bound itself is allowed


def test_comm_period_counts_local_steps_across_epochs():
    # 1 private example, batch 1: an epoch is 1 step; comm_period = 3 takes 3 steps (3 epochs)
    _, metrics, logged, work = one_step(pseudo_y=0, comm_period=3)
    assert work == [(1, 1)] * 3
    _, _, _, work = one_step(pseudo_y=None, comm_period=2, warmup_epochs=2)  # + warm-up on a first visit
    assert work == [(1, 0)] * 4


def test_a_public_set_larger_than_the_pool_fails_naming_the_key():
    with pytest.raises(SpecError) as err:
        Engine(resolve(tiny_raw(**{**mosaic(), "public.size": 10_000})), progress=False).prepare()
    assert err.value.path == "public.size"


@pytest.mark.parametrize("key, value", [("expertise", "X"), ("warmup_epochs", -2)])
def test_cli_dry_run_exits_2_with_one_line(tmp_path, capsys, key, value):
    spec = tmp_path / "bad.toml"
    spec.write_text(dump_toml(tiny_raw(**mosaic(**{key: value}))))
    assert run_main([str(spec), "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"algorithm.params.{key}" in err[0]


@pytest.mark.parametrize("key, value", [("lam", 0.0), ("lam", 0.5), ("comm_period", 1), ("warmup_epochs", 0)])
def test_fedct_accepts_its_boundary_values(key, value):
    """The smallest meaningful values pass validation (a bound off by one would refuse them)."""
    resolve(tiny_raw(**{"algorithm.name": "fedct", **PUBLIC, f"algorithm.params.{key}": value}))
