"""FedMD: transfer learning on labelled U, consensus distillation of averaged logits, revisiting."""

import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.context import Client, load_state
from pfl_core.runtime.evaluation import score
from pfl_plugins.fedmd import FedMD, FedMDParams

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


def test_phases_run_transfer_then_private_then_digest_then_revisit(monkeypatch):
    # Distinct epoch counts name the phases; the digest targets are the previous round's consensus.
    calls = []
    original = Client.train

    def spy(self, model=None, *, epochs=None, optimizer=None, x=None, y=None, loss_fn=None, **kw):
        calls.append((self.round, self.id, "public" if x is not None else "private", epochs,
                      None if y is None else y.clone(), loss_fn))
        return original(self, model, epochs=epochs, optimizer=optimizer, x=x, y=y, loss_fn=loss_fn, **kw)

    monkeypatch.setattr(Client, "train", spy)
    params = {"algorithm.params.transfer_epochs": 2, "algorithm.params.private_epochs": 3,
              "algorithm.params.digest_epochs": 4, "algorithm.params.revisit_epochs": 5}
    engine = Engine(resolve(tiny_raw(**BASE, **params)), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    ctx.round_metrics = {}
    engine.run_round(ctx, 1)
    consensus_1 = ctx.server["consensus"].clone()
    engine.run_round(ctx, 2)
    for i in range(4):
        mine = [c for c in calls if c[1] == i]
        assert [(c[0], c[2], c[3]) for c in mine] == [(1, "public", 2), (1, "private", 3),
                                                      (2, "public", 4), (2, "private", 5)]
        assert torch.equal(mine[0][4], ctx.data.public.y)          # transfer: U's labels
        assert torch.equal(mine[2][4], consensus_1)                # digest: last round's consensus
        assert mine[2][5].__name__ == "_distill" and mine[0][5].__name__ == "cross_entropy"


def test_the_evaluated_model_is_the_clients_own():
    result, engine = run_tiny(**BASE)
    ctx = engine.ctx
    for row in result.client_rows:
        client = ctx.client(row["client"])
        own = load_state(ctx.models.build(client.arch), ctx.store[client.id]["weights"])
        assert row["acc"] == score(own, client.data.test_x, client.data.test_y).accuracy


def test_the_declared_budget_counts_round_one_and_later_rounds_apart():
    params = {"algorithm.params.transfer_epochs": 2, "algorithm.params.private_epochs": 3,
              "algorithm.params.digest_epochs": 4, "algorithm.params.revisit_epochs": 5,
              "algorithm.params.alignment_size": 15, "experiment.rounds": 3}
    budget = resolve(tiny_raw(**{**BASE, **params})).as_dict["budget"]
    assert budget["private_epochs"] == 3 + 2 * 5
    assert budget["public_epochs"] == pytest.approx(2 + 2 * 4 * 15 / 60)
    result, _ = run_tiny(**{**BASE, **params})
    assert result.final["budget.public_epochs"] == pytest.approx(budget["public_epochs"])
    assert result.final["budget.private_epochs"] == pytest.approx(budget["private_epochs"])
