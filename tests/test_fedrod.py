"""FedRoD (plugins/fedrod), linear variant: the balanced softmax loss by hand (a class the client
lacks included), the personal loss trains only the personal head, one engine round recomputed
with two optimisers (the body and generic head on BSM, the personal head on CE of the summed
logits), evaluation with generic + personal logits, what is sent, cold start and parameters."""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, dry_run_error, far_apart, mean_of, prepared
from tiny import run_tiny, tiny_raw
from torch import nn

from pfl_core import seeding
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_core.runtime.training import run_epochs
from pfl_plugins.fedrod import (
    FedRoDParams,
    balanced_softmax_loss,
    class_counts,
    classifier_gives_the_logits,
    personal_loss,
)

FEDROD = {"algorithm.name": "fedrod"}
BODY, GENERIC = ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]  # mlp [16]


def test_balanced_softmax_by_hand_with_a_missing_class():
    logits = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]], requires_grad=True)
    y = torch.tensor([0, 1])
    counts = torch.tensor([3.0, 1.0, 0.0])  # class 2: none on this client
    # row 0: -log(3 e^1 / (3 e^1 + 1 e^2 + 0)) = log(1 + e / 3); row 1: -log(e^2 / (3 e + e^2)) = log(1 + 3 / e)
    expected = (math.log(1 + math.e / 3) + math.log(1 + 3 / math.e)) / 2
    loss = balanced_softmax_loss(logits, y, counts)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert loss.item() != pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-3)  # not plain CE
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[:, 2], torch.zeros(2))  # the missing class is out of the softmax
    p0 = 3 * math.e / (3 * math.e + math.e ** 2)  # d/dg_0 of row 0: (p_0 - 1) / 2
    assert logits.grad[0, 0].item() == pytest.approx((p0 - 1) / 2, abs=1e-6)


def test_class_counts():
    assert class_counts(torch.tensor([2, 0, 2, 2]), 4).tolist() == [1.0, 0.0, 3.0, 0.0]


def test_the_personal_loss_adds_the_logits_and_trains_only_the_head():
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        head.bias.zero_()
    z = torch.tensor([[1.0, 2.0]], requires_grad=True)
    logits = torch.tensor([[0.5, 0.0, -1.0]], requires_grad=True)
    loss = personal_loss(logits, z, head, torch.tensor([2]))
    summed = torch.tensor([[1.5, 2.0, 2.0]])  # g + W z
    assert loss.item() == pytest.approx(-math.log(math.exp(2.0) / torch.exp(summed).sum().item()), abs=1e-6)
    loss.backward()
    assert z.grad is None and logits.grad is None  # the body and the generic head get nothing from it
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


def fedrod_reference(ctx, client_id, start, head_state, bsm=True):
    """One client's local update written out: two SGD optimisers (as PFLlib), the same seeded
    batches; the body and generic head step on BSM (or CE), the personal head on CE(g + h(z))."""
    model = ctx.models.build("mlp")
    model.load_state_dict(start)
    head = nn.Linear(16, ctx.num_classes)
    head.load_state_dict({"weight": head_state["fc2.weight"], "bias": head_state["fc2.bias"]})
    data = ctx.data.clients[client_id]
    counts = torch.bincount(data.train_y, minlength=ctx.num_classes).float()
    lr = ctx.spec.training.lr
    opt_model, opt_head = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(head.parameters(), lr=lr)

    def loss(m, x, y, logits):  # steps the personal head itself, returns the generic model's loss
        z = F.relu(x @ m.fc1.weight.T + m.fc1.bias).detach()
        personal = F.cross_entropy(logits.detach() + head(z), y)
        opt_head.zero_grad()
        personal.backward()
        opt_head.step()
        shifted = logits + counts.log() if bsm else logits
        return F.cross_entropy(shifted, y)

    run_epochs(model, opt_model, data.train_x, data.train_y, epochs=ctx.spec.training.local_epochs,
               batch_size=ctx.spec.training.batch_size, loss_fn=loss,
               generator=seeding.torch_generator(ctx.spec.experiment.seed, "train", ctx.round, client_id),
               drop_last=ctx.spec.training.drop_last)
    return model.state_dict(), {"fc2.weight": head.weight.detach(), "fc2.bias": head.bias.detach()}


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_round_trains_the_generic_model_on_bsm_and_the_personal_head_on_the_summed_logits(rounds):
    engine, ctx = prepared(**FEDROD, **{"experiment.rounds": 2, "partition.scheme": "dirichlet",
                                        "partition.params": {"alpha": 0.3}, "partition.num_clients": 4})
    assert any((class_counts(ctx.data.clients[i].train_y, ctx.num_classes) == 0).any() for i in range(4))
    for r in range(1, rounds):
        engine.run_round(ctx, r)
    start = {k: v.clone() for k, v in ctx.server["global"].items()}
    initial = ctx.models.initial_state("mlp")
    heads = {i: {k: v.clone() for k, v in ctx.store[i].get("head", initial).items() if k in GENERIC}
             for i in range(4)}
    engine.run_round(ctx, rounds)
    sizes = [ctx.data.clients[i].num_train for i in range(4)]
    results = [fedrod_reference(ctx, i, start, heads[i]) for i in range(4)]
    expected = mean_of((n / sum(sizes), state) for n, (state, _) in zip(sizes, results))
    assert_close(ctx.server["global"], expected, atol=1e-5)
    for i, (_, head) in enumerate(results):
        assert set(ctx.store[i]["head"]) == set(GENERIC)  # only the head is kept
        assert_close(ctx.store[i]["head"], head, atol=1e-5)
    plain = mean_of((n / sum(sizes), fedrod_reference(ctx, i, start, heads[i], bsm=False)[0])
                    for i, n in enumerate(sizes))
    assert far_apart(expected, plain, BODY + GENERIC)  # BSM is not CE on these skewed clients


def test_the_personalized_model_adds_the_personal_logits_to_the_generic_ones():
    engine, ctx = prepared(**FEDROD, **{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    glob = ctx.server["global"]
    sat_out = next(i for i in range(4) if i not in ctx.participants)
    initial = ctx.models.initial_state("mlp")
    for i, head in ((ctx.participants[0], ctx.store[ctx.participants[0]]["head"]), (sat_out, initial)):
        models = evaluated_models(ctx, ctx.client(i))
        x = ctx.data.clients[i].test_x[:8]
        z = F.relu(x @ glob["fc1.weight"].T + glob["fc1.bias"])
        generic = z @ glob["fc2.weight"].T + glob["fc2.bias"]
        personal = z @ head["fc2.weight"].T + head["fc2.bias"]
        with torch.no_grad():
            assert torch.allclose(models[""](x), generic + personal, atol=1e-5)
            assert torch.allclose(models["generic_"](x), generic, atol=1e-5)
    result, _ = run_tiny(**FEDROD, **{"experiment.rounds": 1})
    assert {"acc_mean", "generic_acc_mean"} <= set(result.final)


def test_only_the_generic_model_is_sent():
    result, _ = run_tiny(**FEDROD, **{"experiment.rounds": 1})
    fedavg, _ = run_tiny(**{"experiment.rounds": 1})
    assert result.final["comm_up_bytes"] == fedavg.final["comm_up_bytes"]
    assert result.final["comm_down_bytes"] == fedavg.final["comm_down_bytes"]


def test_with_cross_entropy_the_global_model_is_fedavgs_bit_for_bit():
    _, fedavg = run_tiny(**{"experiment.rounds": 2})
    _, fedrod = run_tiny(**FEDROD, **{"experiment.rounds": 2, "algorithm.params.generic_loss": "ce"})
    for key, value in fedavg.ctx.server["global"].items():
        assert torch.equal(fedrod.ctx.server["global"][key], value), key


def test_coldstart_trains_only_the_personal_head_on_the_final_model():
    engine, ctx = prepared(**FEDROD, **{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (n,) = ctx.coldstart_clients
    models = coldstart_models(ctx, ctx.client(n))
    state = models["generic_"].state_dict()
    assert all(torch.equal(state[k], v) for k, v in ctx.server["global"].items())  # frozen
    assert all(p.requires_grad for p in models["generic_"].parameters())  # and unfrozen afterwards
    initial = ctx.models.initial_state("mlp")
    assert far_apart(ctx.store[n]["head"], initial, GENERIC)  # the personal head learned


def test_the_classifier_must_give_the_logits():
    x = torch.randn(4, 3)
    assert classifier_gives_the_logits(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)), x)
    torch.manual_seed(0)
    assert not classifier_gives_the_logits(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2), nn.Tanh()), x)


def test_a_model_whose_last_layer_is_not_the_output_is_refused_naming_the_model(monkeypatch):
    from pfl_plugins import fedrod

    seen = []
    monkeypatch.setattr(fedrod, "classifier_gives_the_logits", lambda model, x: seen.append(x.shape) and False)
    with pytest.raises(SpecError) as info:
        prepared(**FEDROD)
    assert seen == [(2, 20)]  # asked once, on two training samples
    assert info.value.path == "model.name"
    assert info.value.message == ("fedrod adds a personal head's logits to the classifier's, so the model's last "
                                  "layer must output its logits; mlp's does not")


def test_defaults_and_bad_parameters(tmp_path, capsys):
    assert FedRoDParams().generic_loss == "bsm"
    line = dry_run_error(tmp_path, capsys, tiny_raw(**FEDROD, **{"algorithm.params.generic_loss": "bms"}))
    assert line.startswith("pfl-run: error: algorithm.params.generic_loss: must be one of 'bsm', 'ce', got 'bms'")
    assert "did you mean 'bsm'" in line
