"""FedMD: transfer learning on labelled U, consensus distillation of averaged logits, revisiting."""

import pytest
import torch

from pfl_core.errors import SpecError
from pfl_core.engine import Engine, resolve
from plugins.fedmd import FedMD, FedMDParams
from tiny import run_tiny, tiny_raw

torch.set_num_threads(1)  # tiny models: thread contention dominates on a loaded 2-core machine

BASE = {"algorithm.name": "fedmd", "public.size": 60, "public.labelled": True, "experiment.rounds": 2}


def test_fedmd_needs_a_labelled_public_set():
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{"algorithm.name": "fedmd"}))
    assert err.value.path == "public"
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**{**BASE, "public.labelled": False}))
    assert err.value.path == "public.labelled"
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**BASE, **{"algorithm.params.alignment_size": 61}))
    assert err.value.path == "algorithm.params.alignment_size"


def test_server_averages_the_logits():
    ctx = type("Ctx", (), {})()
    ctx.server, ctx.participants = {"align_idx": None}, [0, 1]
    ctx.data = type("D", (), {"public": type("P", (), {"true_y": torch.tensor([0, 1])})()})()
    ctx.log = lambda *a, **k: None
    uploads = iter([(0, {"scores": torch.tensor([[2.0, 0.0], [0.0, 1.0]])}),
                    (1, {"scores": torch.tensor([[0.0, 4.0], [1.0, 3.0]])})])
    FedMD(FedMDParams()).server_aggregate(ctx, uploads, {0: 0.5, 1: 0.5})
    assert torch.equal(ctx.server["consensus"], torch.tensor([[1.0, 2.0], [0.5, 2.0]]))


def test_fedmd_runs_transfers_once_and_counts_logits_both_ways():
    result, engine = run_tiny(**BASE)
    # |U| = 60, C = 10, float32: 2,400 bytes per client each way (down from round 2 on)
    assert [h["comm_up_bytes"] for h in result.history] == [4 * 2400, 8 * 2400]
    assert [h["comm_down_bytes"] for h in result.history] == [0, 4 * 2400]
    assert all(engine.ctx.store[i]["transferred"] for i in range(4))
    assert 0 <= result.final["consensus_acc"] <= 1


def test_digesting_the_consensus_changes_the_models():
    _, with_digest = run_tiny(**BASE)
    _, without = run_tiny(**BASE, **{"algorithm.params.digest_epochs": 0})
    a, b = with_digest.ctx.store[0]["weights"], without.ctx.store[0]["weights"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_alignment_subsets_are_drawn_and_their_indices_sent():
    result, engine = run_tiny(**BASE, **{"algorithm.params.alignment_size": 20})
    # up: 20 x 10 float32 = 800 bytes; down from round 2: consensus 800 + two index lists 2 x 20 x 6 bits
    assert [h["comm_up_bytes"] for h in result.history] == [4 * 800, 8 * 800]
    assert result.history[0]["comm_down_bytes"] == 4 * 15
    assert result.history[1]["comm_down_bytes"] - result.history[0]["comm_down_bytes"] == 4 * (800 + 15 + 15)
