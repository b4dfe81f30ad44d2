"""COSMOS (and the round protocol it shares with COMET): clustering, distances, Eq. (1)/(2)
on a hand-set linear model, the transformation ball, cluster targets, the round order,
which models are evaluated, bytes, the budget, heterogeneous clients, bad input, the paper's
CIFAR-100 spec through pfl-run on a fake CIFAR-100 directory, and (GPU only) a CUDA run.
COMET's own tests: tests/test_comet.py."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import run_tiny, tiny_raw

import pfl_core.methods.codistill as codistill
import pfl_plugins.cosmos as cosmos
from pfl_core import hookimpl
from pfl_core.cli import run_main
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.methods.codistill import kl_to_target, mean_l1_distances, predict
from pfl_core.runtime.context import Client, clone_state, load_state
from pfl_core.runtime.evaluation import score
from pfl_plugins.cosmos import CosmosParams, augment, auto_clusters, eq1_distill, greedy_clusters

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"public.size": 60, "experiment.rounds": 2, "model.arch_params": {},
         "algorithm.params": {"server_arch": "mlp", "pretrain_epochs": 1, "server_epochs": 1}}


def test_greedy_clustering_on_a_hand_made_distance_matrix():
    d = np.array([
        [0.0, 0.1, 0.2, 1.5, 1.6],
        [0.1, 0.0, 0.9, 1.5, 1.6],
        [0.2, 0.9, 0.0, 1.4, 1.5],
        [1.5, 1.5, 1.4, 0.0, 0.3],
        [1.6, 1.6, 1.5, 0.3, 0.0],
    ])
    # B0 = 0.25: client 0 has two neighbours (1, 2) -> {0, 1, 2}; then {3}? 3 and 4 are 0.3 apart.
    assert greedy_clusters(d, 0.25) == [[0, 1, 2], [3], [4]]
    assert greedy_clusters(d, 0.3) == [[0, 1, 2], [3, 4]]
    assert greedy_clusters(d, 0.05) == [[0], [1], [2], [3], [4]]
    assert greedy_clusters(d, 2.0) == [[0, 1, 2, 3, 4]]


def test_greedy_ties_go_to_the_lowest_index():
    d = np.array([[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]], dtype=float) * 0.5
    d[0, 1] = d[1, 0] = d[2, 3] = d[3, 2] = 0.1  # two equal pairs
    assert greedy_clusters(d, 0.1) == [[0, 1], [2, 3]]


def test_auto_b0_grows_until_at_most_max_clusters():
    d = np.array([[0, 0.1, 1.0], [0.1, 0, 1.0], [1.0, 1.0, 0]])
    assert auto_clusters(d, 3) == (0.0, [[0], [1], [2]])
    assert auto_clusters(d, 2) == (0.1, [[0, 1], [2]])
    assert auto_clusters(d, 1) == (1.0, [[0, 1, 2]])


def test_distance_is_the_mean_l1_over_u():
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # 2 clients, |U| = 2
    d = mean_l1_distances(p)
    assert d[0, 1] == pytest.approx((2.0 + 0.0) / 2) and d[1, 0] == d[0, 1] and d[0, 0] == 0
    doubled = mean_l1_distances(torch.cat([p, p], dim=1))  # |U| doubled: same distance
    assert torch.allclose(d, doubled)


def test_distance_is_the_l1_norm_per_sample_not_a_squared_or_max_norm():
    p = torch.tensor([[[0.6, 0.4, 0.0]], [[0.2, 0.2, 0.6]], [[0.6, 0.4, 0.0]]])  # 3 clients, |U| = 1
    d = mean_l1_distances(p)
    assert d[0, 1].item() == pytest.approx(0.4 + 0.2 + 0.6) and d[0, 2] == 0 and d.dtype == torch.float64
    assert d.device.type == "cpu"  # ready for .numpy() whatever device the predictions are on


# -- Eq. (1) / (2) on a hand-set linear model ---------------------------------------------


def test_kl_goes_from_the_target_to_the_model():
    target = torch.tensor([[0.9, 0.1]])
    logits = torch.zeros(1, 2)  # model: (0.5, 0.5)
    expected = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)  # KL(target || model)
    assert kl_to_target(logits, target, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # T = 2 divides the logits: logits (2, 0) / 2 -> softmax(1, 0)
    model = torch.softmax(torch.tensor([1.0, 0.0]), 0)
    expected_t = float((target[0] * (target[0] / model).log()).sum())
    assert kl_to_target(torch.tensor([[2.0, 0.0]]), target, 2.0).item() == pytest.approx(expected_t, rel=1e-6)


def hand_set_linear() -> torch.nn.Linear:
    model = torch.nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -0.5], [0.2, 0.3], [-0.4, 0.8]]))
        model.bias.copy_(torch.tensor([0.1, 0.0, -0.1]))
    return model


@pytest.mark.parametrize("lam,temperature", [(5.0, 1.0), (0.7, 2.0), (0.0, 1.0), (1.0, 1.0)])  # 1.0: the default
def test_one_step_of_eq1_is_kl_plus_lambda_times_the_consistency_term(lam, temperature):
    """One SGD step on one batch equals the step on the loss written out by hand:
    mean_x KL(t(x) || h(x)) + lam * sum_{s=1,2} mean_x KL(h(x) || h(x + noise_s)), h(x) fixed."""
    x = torch.tensor([[0.5, -1.0], [1.0, 2.0], [-0.3, 0.4], [2.0, 0.1]])
    targets = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3], [0.05, 0.9, 0.05]])
    params = CosmosParams(lam=lam, num_augment=2, noise_std=0.5, temperature=temperature, distill_batch_size=8)
    lr, seed = 0.5, 7

    # By hand: the same generator draws the batch order, then each augmented copy's noise.
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    xb, tb = x[order], targets[order]
    w = torch.tensor([[1.0, -0.5], [0.2, 0.3], [-0.4, 0.8]], requires_grad=True)
    b = torch.tensor([0.1, 0.0, -0.1], requires_grad=True)

    def log_h(inp):
        return F.log_softmax((inp @ w.T + b) / temperature, dim=1)

    kl = (tb * (tb.log() - log_h(xb))).sum(dim=1).mean()
    anchor = log_h(xb).exp().detach()
    consistency = sum((anchor * (anchor.log() - log_h(xb + 0.5 * torch.randn(xb.shape, generator=g)))).sum(dim=1).mean()
                      for _ in range(2))
    (kl + lam * consistency).backward()
    expected_w, expected_b = w - lr * w.grad, b - lr * b.grad
    if lam > 0:  # the regulariser is not negligible here (so a flipped or dropped term is caught)
        assert consistency.item() > 1e-3

    model = hand_set_linear()
    g = torch.Generator().manual_seed(seed)
    eq1_distill(model, torch.optim.SGD(model.parameters(), lr=lr), x, targets, params, epochs=1, order=g, augment=g)
    assert torch.allclose(model.weight, expected_w, atol=1e-6) and torch.allclose(model.bias, expected_b, atol=1e-6)
    if lam > 0:
        plain = hand_set_linear()
        g = torch.Generator().manual_seed(seed)
        eq1_distill(plain, torch.optim.SGD(plain.parameters(), lr=lr), x, targets,
                    CosmosParams(lam=0.0, temperature=temperature, distill_batch_size=8), epochs=1, order=g, augment=g)
        assert not torch.allclose(plain.weight, expected_w, atol=1e-4)


# -- the transformation ball ------------------------------------------------------------


def test_augment_is_one_crop_offset_a_per_image_flip_and_gaussian_noise():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).reshape(2, 1, 4, 4)
    out = augment(x, torch.Generator().manual_seed(3), noise_std=0.0)
    padded = F.pad(x, (2, 2, 2, 2), mode="replicate")
    crops = [padded[:, :, dy : dy + 4, dx : dx + 4] for dy in range(5) for dx in range(5)]
    # one shared crop offset; each image either as cropped or mirrored left-right
    assert any(all(torch.equal(out[i], c[i]) or torch.equal(out[i], c[i].flip(2)) for i in range(2)) for c in crops)
    flat = torch.randn(5, 3)
    noisy = augment(flat, torch.Generator().manual_seed(4), noise_std=0.25)
    assert torch.equal(noisy, flat + 0.25 * torch.randn(5, 3, generator=torch.Generator().manual_seed(4)))


def test_augment_draws_on_a_cpu_generator_and_stays_on_the_data_device():
    """The device bug: CPU noise and flip masks combined with device tensors. The meta device
    rejects a CPU operand as CUDA does, so this runs without a GPU."""
    generator = torch.Generator()  # CPU, as client.generator / ctx.generator make them
    for shape in [(3, 1, 8, 8), (3, 5)]:
        out = augment(torch.zeros(shape, device="meta"), generator, noise_std=0.1)
        assert out.device.type == "meta" and out.shape == shape


# -- server and client steps ------------------------------------------------------------

COSMOS_ONE = {**SMALL, "algorithm.name": "cosmos", "experiment.rounds": 1}


def fake_predictions(ctx, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (len(ctx.data.public.x), ctx.num_classes)
    return {i: torch.softmax(3 * torch.randn(shape, generator=g), dim=1) for i in range(4)}


def test_server_targets_are_plain_member_means_and_members_get_their_cluster_model(monkeypatch):
    _, engine = run_tiny(**COSMOS_ONE)
    ctx = engine.ctx
    ctx.server.update(clusters=[[0, 2], [1, 3]], cluster_models={}, targets={})
    preds = fake_predictions(ctx, 0)
    fitted = []
    real = cosmos.eq1_distill
    monkeypatch.setattr(cosmos, "eq1_distill", lambda model, opt, x, targets, *a, **k: (
        fitted.append(targets.clone()), real(model, opt, x, targets, *a, **k))[1])
    skewed = {0: 0.7, 1: 0.1, 2: 0.1, 3: 0.1}  # sample weights must not enter the cluster mean
    uploads = ((i, {"soft_labels": p}) for i, p in preds.items())
    ctx.hooks.server_aggregate(ctx=ctx, uploads=uploads, weights=skewed)
    assert len(fitted) == 2
    assert torch.allclose(fitted[0], (preds[0] + preds[2]) / 2) and torch.allclose(fitted[1], (preds[1] + preds[3]) / 2)
    server = ctx.models.build("mlp")
    for k, members in enumerate([[0, 2], [1, 3]]):
        h_k = predict(load_state(server, ctx.server["cluster_models"][k]), ctx.data.public.x, 1.0)
        for i in members:  # what client i distils from next round: h_pi(i)(U)
            assert torch.equal(ctx.server["targets"][i], h_k)
    assert not torch.allclose(ctx.server["targets"][0], ctx.server["targets"][1])


@pytest.mark.parametrize("name,params", [
    ("cosmos", {"server_arch": "mlp", "server_epochs": 1, "b0": 1e-9}),  # every client its own cluster
    ("comet", {"num_clusters": 4}),
])
def test_round_order_pretrain_once_then_distil_finetune_send(monkeypatch, name, params):
    """Round 1: E0 epochs on D_i, then f_i(U) up; round t >= 2: distil from the client's own
    targets of round t - 1, fine-tune ``finetune_epochs`` on D_i, then f_i(U) up."""
    events, trained, sent = [], {}, {}
    real_train = Client.train

    def train(self, *args, **kwargs):
        events.append(("train", self.round, self.id, kwargs.get("epochs")))
        out = real_train(self, *args, **kwargs)
        trained[self.round, self.id] = clone_state(self.model)
        return out

    plugin_class = cosmos.Cosmos if name == "cosmos" else codistill.PublicPredictionMethod
    real_distill = plugin_class.client_distill
    held = {}  # (round, client) -> the server's targets for the client when it broadcast
    real_broadcast = codistill.PublicPredictionMethod.on_broadcast

    def on_broadcast(self, ctx, client_id):  # server side: may look at the server's state
        held[ctx.round, client_id] = ctx.server.get("targets", {}).get(client_id)
        return real_broadcast(self, ctx, client_id)

    def client_distill(self, ctx, client, model, targets):  # client side: sees only its message
        assert torch.equal(targets, held[client.round, client.id])  # its own, from last round
        events.append(("distill", client.round, client.id, None))
        return real_distill(self, ctx, client, model, targets)

    real_collect = codistill.PublicPredictionMethod.collect_predictions

    def collect(uploads):
        out = real_collect(uploads)
        sent[len(sent) + 1] = out
        return out

    monkeypatch.setattr(Client, "train", train)
    monkeypatch.setattr(plugin_class, "client_distill", client_distill)
    monkeypatch.setattr(codistill.PublicPredictionMethod, "on_broadcast", hookimpl(on_broadcast))
    monkeypatch.setattr(codistill.PublicPredictionMethod, "collect_predictions", staticmethod(collect))
    _, engine = run_tiny(**{**SMALL, "algorithm.name": name, "experiment.rounds": 3,
                            "algorithm.params": {**params, "pretrain_epochs": 3, "finetune_epochs": 2}})
    for i in range(4):
        mine = [e for e in events if e[2] == i]
        assert mine == [("train", 1, i, 3), ("distill", 2, i, None), ("train", 2, i, 2),
                        ("distill", 3, i, None), ("train", 3, i, 2)]
    model = engine.ctx.models.build("mlp")
    for r in (1, 2, 3):  # what was sent is the model right after that round's training on D_i
        for i in range(4):
            expected = predict(load_state(model, trained[r, i]), engine.ctx.data.public.x, 1.0)
            assert torch.allclose(sent[r][i], expected, atol=1e-6)


def test_acc_is_the_client_model_and_server_acc_its_cluster_model():
    result, engine = run_tiny(**{**SMALL, "algorithm.name": "cosmos",
                                 "algorithm.params": {**SMALL["algorithm.params"], "b0": 1e-9}})
    ctx = engine.ctx
    assert len(ctx.server["clusters"]) == 4  # one server model per client: a swap shows
    client_model, server_model = ctx.models.build("mlp"), ctx.models.build("mlp")
    for row in result.client_rows:
        i = row["client"]
        data = ctx.data.clients[i]
        own = score(load_state(client_model, ctx.store[i]["weights"]), data.test_x, data.test_y)
        (k,) = [k for k, members in enumerate(ctx.server["clusters"]) if i in members]
        cluster = score(load_state(server_model, ctx.server["cluster_models"][k]), data.test_x, data.test_y)
        assert row["acc"] == own.accuracy and row["loss"] == pytest.approx(own.loss, rel=1e-6)
        assert row["server_acc"] == cluster.accuracy and row["server_loss"] == pytest.approx(cluster.loss, rel=1e-6)
    assert len({round(r["server_loss"], 6) for r in result.client_rows}) > 1


@pytest.mark.parametrize("name,params", [
    ("cosmos", {"server_arch": "mlp", "server_epochs": 1}),
    ("comet", {"num_clusters": 2}),
])
def test_budget_declared_and_measured(name, params):
    """E0 in round 1 instead of a round's fine-tuning; distillation from round 2 on."""
    overrides = {**SMALL, "algorithm.name": name, "experiment.rounds": 3, "training.drop_last": False,
                 "training.local_epochs": 2, "algorithm.params": {**params, "pretrain_epochs": 3, "distill_epochs": 2}}
    budget = resolve(tiny_raw(**overrides)).as_dict["budget"]
    assert budget["private_epochs"] == 3 + 2 * 2 and budget["public_epochs"] == 2 * 2
    result, engine = run_tiny(**overrides)  # |U| = 60 < distill_batch_size: one batch per epoch, no drop
    assert result.final["budget.private_epochs"] == pytest.approx(7)
    assert result.final["budget.public_epochs"] == pytest.approx(4)
    # the steps: the distillation on U is public work, one batch an epoch; D_i's batches are private
    batch = engine.ctx.spec.training.batch_size
    per_client = [7 * math.ceil(c.num_train / batch) for c in engine.ctx.data.clients]
    assert result.final["budget.public_steps"] == 4
    assert result.final["budget.private_steps"] == pytest.approx(sum(per_client) / len(per_client))


@pytest.mark.parametrize("name,params", [
    ("cosmos", SMALL["algorithm.params"]),
    ("comet", {"num_clusters": 2, "pretrain_epochs": 1}),
])
def test_bytes_are_u_times_c_probabilities_each_way(name, params):
    result, engine = run_tiny(**{**SMALL, "algorithm.name": name, "algorithm.params": params})
    soft = 60 * 10  # |U| x C probabilities per client and round
    # 2 rounds x 4 clients up; down only in round 2 (nothing to send before the first upload)
    assert result.final["comm_up_bytes"] == 2 * 4 * soft * 4 and result.final["comm_down_bytes"] == 1 * 4 * soft * 4
    half, _ = run_tiny(**{**SMALL, "algorithm.name": name, "algorithm.params": {**params, "label_dtype": "float16"}})
    assert half.final["comm_up_bytes"] == 2 * 4 * soft * 2 and half.final["comm_down_bytes"] == 1 * 4 * soft * 2


def test_cosmos_runs_and_reports_client_and_server_accuracy():
    result, engine = run_tiny(**SMALL, **{"algorithm.name": "cosmos"})
    assert {"acc_mean", "server_acc_mean", "num_clusters"} <= set(result.final)
    ctx = engine.ctx
    assert sorted(i for c in ctx.server["clusters"] for i in c) == [0, 1, 2, 3]
    assert result.final["num_clusters"] == len(ctx.server["clusters"])


def write_images(tmp_path) -> Path:
    """160 random 32x32 colour images of 4 classes: exercises the crop/flip augmentations."""
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    y = np.repeat(np.arange(4), 40)
    np.savez(path, x_train=rng.integers(0, 256, (160, 32, 32, 3), dtype=np.uint8), y_train=y)
    return path


def test_cosmos_with_four_client_architectures(tmp_path):
    path = write_images(tmp_path)
    result, engine = run_tiny(**{
        "data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
        "public.size": 32, "experiment.rounds": 1, "model.name": "lenet5", "model.params": {},
        "model.clients": ["lenet5", "cnn4", "mlp", "squeezenet"], "algorithm.name": "cosmos",
        "algorithm.params": {"server_arch": "cnn4", "pretrain_epochs": 1, "server_epochs": 1, "num_augment": 1},
        "model.arch_params": {"mlp": {"hidden": [8]}, "cnn4": {"width": 0.25}},
        "training.batch_size": 16,
    })
    assert [r["arch"] for r in result.client_rows] == ["lenet5", "cnn4", "mlp", "squeezenet"]
    assert "server_acc_mean" in result.final


@pytest.mark.parametrize("params,path", [
    ({"b0": 0}, "algorithm.params.b0"),
    ({"b0": -0.5}, "algorithm.params.b0"),
    ({"b0": "big"}, "algorithm.params.b0"),
    ({"b0": True}, "algorithm.params.b0"),
    ({"b0": float("nan")}, "algorithm.params.b0"),
    ({"max_clusters": 0}, "algorithm.params.max_clusters"),
    ({"server_arch": "vgg61"}, "algorithm.params.server_arch"),
    ({"finetune_epochs": -1}, "algorithm.params.finetune_epochs"),
    ({"pretrain_epochs": -1}, "algorithm.params.pretrain_epochs"),
    ({"distill_epochs": -1}, "algorithm.params.distill_epochs"),
    ({"server_epochs": -1}, "algorithm.params.server_epochs"),
    ({"server_finetune_epochs": -1}, "algorithm.params.server_finetune_epochs"),
    ({"server_lr": 0.0}, "algorithm.params.server_lr"),
    ({"lam": -1.0}, "algorithm.params.lam"),
    ({"num_augment": -1}, "algorithm.params.num_augment"),
    ({"noise_std": -0.1}, "algorithm.params.noise_std"),
    ({"temperature": 0.0}, "algorithm.params.temperature"),
])
def test_bad_cosmos_params_name_their_key(params, path):
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "algorithm.params": params}))
    assert info.value.path == path
    if path.endswith("b0"):
        assert '"auto"' in info.value.message and repr(params["b0"]) in info.value.message


@pytest.mark.parametrize("params", [
    {"b0": 0.01}, {"b0": 2}, {"max_clusters": 1}, {"pretrain_epochs": 0}, {"finetune_epochs": 0},
    {"distill_epochs": 0}, {"server_epochs": 0}, {"server_finetune_epochs": 0}, {"lam": 0.0},
    {"num_augment": 0}, {"noise_std": 0.0},
])
def test_edge_values_are_accepted(params):
    resolved = resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "algorithm.params": params}))
    assert {k: resolved.as_dict["algorithm"]["params"][k] for k in params} == params


def test_defaults_are_the_papers_and_the_documented_choices():
    p = CosmosParams()
    assert (p.lam, p.temperature) == (5.0, 1.0)  # Sec. 6: lambda = 5, T = 1 work best
    # the module docstring's decisions: E0 = 5, 5 server epochs then 1, Adam 1e-3, VGG-16 server
    assert (p.pretrain_epochs, p.server_epochs, p.server_finetune_epochs, p.server_lr) == (5, 5, 1, 1e-3)
    assert (p.b0, p.max_clusters, p.server_arch, p.finetune_epochs, p.distill_epochs) == ("auto", 5, "vgg16", None, 1)
    assert (p.num_augment, p.noise_std) == (2, 0.05)


def test_cosmos_needs_a_public_set_and_matching_client_architectures():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos"}))
    assert info.value.path == "public"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "model.clients": ["mlp"] * 3}))
    assert info.value.path == "model.clients"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "model.pool": ["mlp", "alexnett"]}))
    assert info.value.path == "model.pool[1]"


def test_cosmos_needs_every_client_in_round_1():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "experiment.participation": 0.5}))
    assert info.value.path == "experiment.participation"


def test_cifar100_spec_offline_without_files_stops_with_one_line(tmp_path, capsys):
    code = run_main([str(ROOT / "specs/cosmos_cifar100.toml"), "--set", f'data.params.root="{tmp_path}"',
                     "--set", "data.params.download=false", "--no-tracking"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(tmp_path) in err[0] and "Traceback" not in err[0]


def test_cifar100_spec_runs_through_pfl_run_on_fake_files(tmp_path, capsys):
    from fakes import torchvision_md5_bypass, write_fake_cifar100

    write_fake_cifar100(tmp_path, n_train=500, n_test=10, seed=0)
    shrink = [f'data.params.root="{tmp_path}"', "data.params.download=false", "partition.num_clients=4",
              "partition.params.groups=2", "partition.min_samples=5", "experiment.rounds=1", "public.fraction=0.1",
              "algorithm.params.server_arch=lenet5", "algorithm.params.pretrain_epochs=1",
              "algorithm.params.server_epochs=1", "algorithm.params.num_augment=1",
              'model.pool=["lenet5", "cnn4"]', "executor.device=cpu"]
    with torchvision_md5_bypass():
        code = run_main([str(ROOT / "specs/cosmos_cifar100.toml"), "--no-tracking", "--quiet", "--clients",
                         *[arg for item in shrink for arg in ("--set", item)]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "server_acc" in out and out.count("lenet5") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("name,params", [
    ("cosmos", {"server_arch": "cnn4", "server_epochs": 1, "num_augment": 1}),
    ("comet", {"num_clusters": 2}),
])
def test_runs_on_cuda(tmp_path, name, params):
    """executor.device = "cuda" on images: round 1 (pre-training, clustering, server
    distillation with crop/flip/noise) and round 2 (client distillation, fine-tuning), so every
    step that draws on a CPU generator or turns predictions into numpy meets CUDA tensors."""
    result, engine = run_tiny(**{
        "data.name": "npz", "data.params": {"path": str(write_images(tmp_path))}, "partition.scheme": "iid",
        "public.size": 32, "experiment.rounds": 2, "model.name": "cnn4", "model.params": {"width": 0.25},
        "executor.device": "cuda", "training.batch_size": 16, "algorithm.name": name,
        "algorithm.params": {**params, "pretrain_epochs": 1, "distill_batch_size": 16},
    })
    targets = engine.ctx.server["targets"]
    assert sorted(targets) == [0, 1, 2, 3] and all(t.device.type == "cuda" for t in targets.values())
    assert result.final["comm_up_bytes"] == 2 * 4 * 32 * 4 * 4  # |U| x C float32, 4 clients, 2 rounds
    assert len(result.client_rows) == 4 and np.isfinite(result.final["acc_mean"])


def test_uploaded_predictions_are_the_softmax_of_the_logits_over_t_by_hand():
    from pfl_core.methods.codistill import predict

    model = hand_set_linear()
    x = torch.tensor([[0.5, -1.0], [1.0, 2.0]])
    logits = x @ torch.tensor([[1.0, -0.5], [0.2, 0.3], [-0.4, 0.8]]).T + torch.tensor([0.1, 0.0, -0.1])
    for temperature in (1.0, 2.0, 0.5):
        expected = torch.exp(logits / temperature) / torch.exp(logits / temperature).sum(dim=1, keepdim=True)
        assert torch.allclose(predict(model, x, temperature), expected, atol=1e-6)


def test_augment_replays_its_draws_exactly_pad_two_each_side_and_a_fair_flip():
    """The transformation ball spelled out: the first draw is one crop offset (dy, dx) in 0..4 of
    the image padded by 2 pixels on every side (replicated edges), the second a flip per image
    with probability 1/2, the third the noise. Over 16 images both flipped and unflipped occur."""
    x = torch.arange(16 * 1 * 4 * 4, dtype=torch.float32).reshape(16, 1, 4, 4)
    out = augment(x, torch.Generator().manual_seed(5), noise_std=0.1)
    g = torch.Generator().manual_seed(5)
    dy, dx = (int(v) for v in torch.randint(0, 5, (2,), generator=g))
    flip = torch.rand(16, generator=g) < 0.5
    crop = F.pad(x, (2, 2, 2, 2), mode="replicate")[:, :, dy : dy + 4, dx : dx + 4]
    expected = torch.where(flip[:, None, None, None], crop.flip(3), crop) + 0.1 * torch.randn(x.shape, generator=g)
    assert torch.equal(out, expected)
    assert 0 < int(flip.sum()) < 16
