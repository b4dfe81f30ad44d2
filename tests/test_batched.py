"""Issue 11: ``executor.name = "batched"``. Where a round's clients train together (stacked
parameters, torch.func.vmap) the result equals the sequential loop's within float rounding
(final weights within ATOL, the same accuracies); where they cannot (a method's own training
loop, BatchNorm, Adam) every client runs one by one, bit-identical to ``sequential``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import dry_run_error, fresh_model, prepared
from test_executors import assert_identical, metrics_of
from tiny import tiny_raw

from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.execution.batched import train_together

ATOL = 1e-5  # on every final weight; accuracies must be equal

# Unequal clients (Dirichlet sizes), short last batches kept, momentum and weight decay: the
# cases where a wrong mask, batch order or SGD update would show.
UNEVEN = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.5}, "partition.num_clients": 5,
          "training.drop_last": False, "training.momentum": 0.9, "training.weight_decay": 1e-3,
          "training.batch_size": 16, "training.local_epochs": 2, "experiment.rounds": 2}


def run(executor, **overrides):
    engine = Engine(resolve(tiny_raw(**{"executor.name": executor, **overrides})), progress=False)
    return engine.run(), engine


def weights_of(engine) -> dict[str, torch.Tensor]:
    """Every trained weight the run kept: the global model and each client's own."""
    out = {f"server.{k}": v for k, v in engine.ctx.server.get("global", {}).items()}
    for client_id in engine.ctx.store:
        state = engine.ctx.store[client_id]
        for key, value in state.get("weights", {}).items():
            out[f"client{client_id}.{key}"] = value
    return out


def assert_close_to_sequential(overrides):
    sequential, seq = run("sequential", **overrides)
    together, bat = run("batched", **overrides)
    assert bat.ctx.resolved_values["executor.batched"] == "yes"  # really trained together
    a, b = weights_of(seq), weights_of(bat)
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=ATOL), key
    assert [r["acc"] for r in together.client_rows] == [r["acc"] for r in sequential.client_rows]
    for s, t in zip(sequential.history, together.history):
        assert t["acc_mean"] == s["acc_mean"]
        assert t["train_loss_mean"] == pytest.approx(s["train_loss_mean"], rel=1e-5)
        assert t["budget.private_epochs"] == s["budget.private_epochs"]  # the same work counted
    assert (bat.ctx.comm_up, bat.ctx.comm_down) == (seq.ctx.comm_up, seq.ctx.comm_down)
    return seq, bat


@pytest.mark.parametrize("name, extra", [
    ("fedavg", {}),
    ("fedprox", {"algorithm.params": {"mu": 0.5}}),  # a large mu: a missing term would show
    ("local", {}),
    ("lgfedavg", {}),
])
def test_clients_trained_together_match_the_sequential_loop(name, extra):
    seq, bat = assert_close_to_sequential({"algorithm.name": name, **UNEVEN, **extra})
    sizes = {bat.ctx.data.clients[i].num_train for i in bat.ctx.store}
    assert len(sizes) > 1  # the clients really had different numbers of batches


def test_stragglers_budgets_are_kept_per_client():
    """A straggler stops after its batch budget while the others go on (masked updates)."""
    assert_close_to_sequential({"algorithm.name": "fedavg", **UNEVEN,
                                "addons": [{"name": "stragglers", "params": {"fraction": 0.6}}]})


def test_lenet5_on_images_matches_the_sequential_loop(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (160, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 160))
    assert_close_to_sequential({"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
                                "model.name": "lenet5", "model.params": {}, "algorithm.name": "fedavg",
                                "experiment.rounds": 2, "training.momentum": 0.5})


def test_a_parameter_one_client_does_not_train_keeps_its_value_and_momentum():
    """Client 1 trains without fc1.weight (requires_grad off, as a method's on_receive may
    leave it); torch's SGD gives that parameter no update and no weight decay."""
    _, ctx = prepared(**{"training.momentum": 0.9, "training.weight_decay": 0.01})
    ctx.round = 1
    clients = [ctx.client(i) for i in (0, 1, 2)]
    start = ctx.models.initial_state("mlp")
    names = [n for n, _ in ctx.models.working("mlp").named_parameters()]
    trainable = [set(names), set(names) - {"fc1.weight"}, set(names)]
    trained = train_together(ctx.models.working("mlp"), clients, [start] * 3, trainable, ctx.spec.training)
    for client, keys, result in zip(clients, trainable, trained):
        model = fresh_model(ctx, start)
        for name, p in model.named_parameters():
            p.requires_grad_(name in keys)
        optimizer = torch.optim.SGD(model.parameters(), lr=ctx.spec.training.lr, momentum=0.9, weight_decay=0.01)
        metrics = client.train(model=model, optimizer=optimizer)
        for name, p in model.named_parameters():
            assert torch.allclose(result.weights[name], p.detach(), rtol=0, atol=ATOL), (client.id, name)
        assert result.loss_total.item() / result.steps == pytest.approx(metrics["train_loss"], rel=1e-5)
    assert torch.equal(trained[1].weights["fc1.weight"], start["fc1.weight"])
    assert not torch.equal(trained[0].weights["fc1.weight"], start["fc1.weight"])


@pytest.mark.parametrize("name", ["local", "fedavg"])
def test_a_diverged_client_is_skipped_and_restored_as_in_the_sequential_loop(name):
    """training.on_nonfinite = "skip_client": client 1's data holds a NaN, so its loss is
    NaN; it is left out of the aggregate and its state is what it was before the round."""
    runs = {}
    for executor in ("sequential", "batched"):
        engine, ctx = prepared(**{"algorithm.name": name, "executor.name": executor,
                                  "training.on_nonfinite": "skip_client"})
        ctx.data.clients[1].train_x[0, 0] = float("nan")
        skipped = []
        for round in (1, 2):
            ctx.round_metrics = {}
            engine.run_round(ctx, round)
            skipped.append(ctx.round_metrics["skipped_clients"])
        runs[executor] = (engine, skipped)
    (seq, seq_skipped), (bat, bat_skipped) = runs["sequential"], runs["batched"]
    assert seq_skipped == bat_skipped == [1.0, 1.0]
    assert "weights" not in bat.ctx.store[1]  # restored: Local's client 1 never kept weights
    a, b = weights_of(seq), weights_of(bat)
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=ATOL), key


@pytest.mark.parametrize("name, extra, reason", [
    ("fedrep", {}, "local_train of fedrep"),  # its own training loop
    ("fedbn", {"model.params": {"hidden": [16], "norm": "batch"}}, "buffers"),
    ("fedavg", {"training.optimizer": "adam"}, "training.optimizer"),
])
def test_what_cannot_train_together_runs_one_by_one_bit_identical(name, extra, reason):
    overrides = {"algorithm.name": name, "experiment.rounds": 2, **extra}
    sequential, seq = run("sequential", **overrides)
    together, bat = run("batched", **overrides)
    assert reason in bat.ctx.resolved_values["executor.batched"]
    assert metrics_of(together) == metrics_of(sequential)
    assert together.client_rows == sequential.client_rows
    assert_identical(bat.ctx.server, seq.ctx.server)
    for client_id in seq.ctx.store:
        assert_identical(bat.ctx.store[client_id], seq.ctx.store[client_id])


def test_batched_with_several_architectures_is_refused_at_executor_name(tmp_path, capsys):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"executor.name": "batched", "algorithm.name": "local", "model.pool": ["mlp", "cnn2"]}))
    assert info.value.path == "executor.name"
    line = dry_run_error(tmp_path, capsys, tiny_raw(**{"executor.name": "batched", "algorithm.name": "local",
                                                      "model.clients": ["mlp", "mlp", "mlp", "cnn2"]}))
    assert "executor.name" in line and "model.clients" in line
    resolve(tiny_raw(**{"executor.name": "batched", "model.pool": ["mlp", "mlp"]}))  # one architecture: fine


@pytest.mark.gpu
@pytest.mark.parametrize("name, extra", [("fedavg", {}), ("fedprox", {"algorithm.params": {"mu": 0.5}})])
def test_on_cuda_clients_trained_together_match_the_sequential_loop(name, extra):
    # An MLP: cuDNN may run convolutions in TF32, which would blur the comparison.
    assert_close_to_sequential({"algorithm.name": name, **UNEVEN, **extra, "executor.device": "cuda"})


def test_what_on_receive_put_in_scratch_reaches_client_upload(monkeypatch):
    """Trained together, each client's later hooks run on a fresh Client: the scratch its
    on_receive filled (FedProx's anchor w_t here) must still be there in client_upload."""
    from pfl_core.api import hookimpl
    from pfl_plugins.fedprox import FedProx

    seen = []
    original = FedProx.client_upload

    def client_upload(self, ctx, client):
        seen.append([t.clone() for t in client.scratch["w_t"]])  # KeyError if the scratch was lost
        return original(self, ctx, client)

    monkeypatch.setattr(FedProx, "client_upload", hookimpl(client_upload), raising=True)
    assert_close_to_sequential({"algorithm.name": "fedprox", "algorithm.params": {"mu": 0.5}, **UNEVEN})
    sequential_anchors, batched_anchors = seen[:len(seen) // 2], seen[len(seen) // 2:]
    assert len(sequential_anchors) == len(batched_anchors) > 0
    for a, b in zip(sequential_anchors, batched_anchors):
        assert all(torch.allclose(x, y, rtol=0, atol=ATOL) for x, y in zip(a, b))
