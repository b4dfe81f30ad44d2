"""The model zoo: every registered architecture, its parameters, determinism and layer bookkeeping."""

from __future__ import annotations

import pytest
import torch

from pfl_core import registry
from pfl_core.errors import SpecError
from pfl_core.models import (
    ModelPlugin,
    count_parameters,
    layer_keys,
    layer_of_parameter,
    parameterised_layers,
    split_at,
    split_index,
)
from pfl_core.models.zoo import MODEL_CLASSES

MODEL_NAMES = ["lenet5", "mlp", "cnn2", "cnn4", "alexnet", "resnet18", "mobilenet_v2", "squeezenet", "vgg16"]
IMAGE_ONLY = [n for n in MODEL_NAMES if n != "mlp"]


def plugin(name, params=None):
    return registry.instantiate(registry.MODEL, name, params or {}, "model.name", "model.params")


def build(name, shape, num_classes=10, params=None, seed=0):
    torch.manual_seed(seed)
    return plugin(name, params).build(shape, num_classes)


def test_all_models_are_registered():
    assert set(MODEL_NAMES) <= set(registry.names_of_kind(registry.MODEL))
    for cls in MODEL_CLASSES:
        assert registry.plugin_class(cls.name) is cls
        assert issubclass(cls, ModelPlugin) and cls.kind == registry.MODEL


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("shape,num_classes", [((1, 28, 28), 10), ((3, 32, 32), 7)])
def test_builds_and_gives_logits(name, shape, num_classes):
    model = build(name, shape, num_classes)
    assert isinstance(model, torch.nn.Module) and model.training
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, num_classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["lenet5", "cnn2", "cnn4", "alexnet", "squeezenet"])
def test_builds_for_64px(name):
    model = build(name, (3, 64, 64))
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n != "vgg16"])
def test_backward_reaches_every_parameter(name):
    model = build(name, (3, 32, 32))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_lenet5_parameter_count_by_hand():
    expected = (3 * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (16 * 5 * 5 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    assert count_parameters(build("lenet5", (3, 32, 32))) == expected == 62006
    # 28x28 inputs are padded to behave like 32x32: only conv1's input channels differ.
    assert count_parameters(build("lenet5", (1, 28, 28))) == expected - 2 * 6 * 25


def test_cnn2_matches_fedavg_paper_count():
    assert count_parameters(build("cnn2", (1, 28, 28))) == 1_663_370


def test_width_scales_parameter_counts():
    counts = [count_parameters(build("lenet5", (3, 32, 32), params={"width": w})) for w in (0.5, 1.0, 2.0, 4.0)]
    assert counts == sorted(counts) and len(set(counts)) == 4
    conv = lambda m: sum(p.numel() for n, p in m.named_parameters() if n.startswith("conv2"))  # noqa: E731
    ratio = conv(build("lenet5", (3, 32, 32), params={"width": 2.0})) / conv(build("lenet5", (3, 32, 32)))
    assert 3.5 < ratio < 4.5
    tiny = build("lenet5", (1, 28, 28), params={"width": 0.01})  # every count rounds up to 1
    assert tiny.conv1.out_channels == 1 and tiny.fc2.out_features == 1
    for name in ("cnn2", "cnn4", "mobilenet_v2"):
        assert count_parameters(build(name, (3, 32, 32), params={"width": 0.5})) < count_parameters(
            build(name, (3, 32, 32))
        )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_weights(name):
    a, b = build(name, (3, 32, 32), seed=3), build(name, (3, 32, 32), seed=3)
    c = build(name, (3, 32, 32), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_build_leaves_no_trace_on_rng_and_bn_stats():
    torch.manual_seed(0)
    model = plugin("resnet18").build((3, 32, 32), 10)
    after_build = torch.rand(1)
    torch.manual_seed(0)
    plugin("resnet18").build((3, 32, 32), 10)
    assert torch.equal(after_build, torch.rand(1))
    assert int(model.bn1.num_batches_tracked) == 0 and torch.all(model.bn1.running_mean == 0)


def test_mlp_on_feature_vectors_and_logistic_regression():
    model = build("mlp", (60,), 5)
    assert model(torch.randn(2, 60)).shape == (2, 5)
    logreg = build("mlp", (60,), 5, params={"hidden": []})
    assert [n for n, _ in parameterised_layers(logreg)] == ["fc1"]
    assert count_parameters(logreg) == 60 * 5 + 5
    assert build("mlp", (1, 28, 28), params={"hidden": [32]})(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("name", IMAGE_ONLY)
def test_image_models_reject_feature_vectors(name):
    with pytest.raises(SpecError) as info:
        plugin(name).build((60,), 10)
    assert info.value.path == "model.name"
    assert "needs image inputs (C, H, W)" in str(info.value) and "(60,)" in str(info.value)


@pytest.mark.parametrize("name", ["lenet5", "alexnet", "squeezenet"])
def test_too_small_images_give_spec_error(name):
    # (resnet18 and vgg16, with ceil-mode pools, legitimately accept even 2x2 images.)
    with pytest.raises(SpecError) as info:
        plugin(name).build((1, 2, 2), 10)
    assert info.value.path == "model.name"


def test_lenet5_layers_in_order():
    layers = parameterised_layers(build("lenet5", (1, 28, 28)))
    assert [n for n, _ in layers] == ["conv1", "conv2", "fc1", "fc2", "fc3"]
    name, head = layers[-1]
    assert isinstance(head, torch.nn.Linear) and head.out_features == 10


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_ends_in_its_classifier(name):
    model = build(name, (3, 32, 32), num_classes=7)
    _, head = parameterised_layers(model)[-1]
    out = head.out_features if isinstance(head, torch.nn.Linear) else head.out_channels
    assert out == 7
    keys = layer_of_parameter(model)
    assert list(keys) == list(model.state_dict())


def test_layer_of_parameter_resnet18():
    model = build("resnet18", (3, 32, 32))
    layers = parameterised_layers(model)
    mapping = layer_of_parameter(model)
    assert set(mapping) == set(model.state_dict())
    indices = [mapping[k] for k in model.state_dict()]
    assert indices == sorted(indices)
    assert set(indices) == set(range(len(layers)))
    assert mapping["bn1.running_mean"] == mapping["bn1.weight"] == mapping["conv1.weight"] + 1
    assert mapping["bn1.num_batches_tracked"] == mapping["bn1.weight"]
    assert mapping["fc.weight"] == mapping["fc.bias"] == len(layers) - 1
    names = dict(layers)
    assert isinstance(names["bn1"], torch.nn.BatchNorm2d)
    assert layer_keys(model)[1] == ["bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
                                    "bn1.num_batches_tracked"]


def test_buffers_of_parameterless_modules_go_to_preceding_layer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, affine=False), torch.nn.Linear(4, 2))
    assert [n for n, _ in parameterised_layers(model)] == ["0", "2"]
    mapping = layer_of_parameter(model)
    assert mapping["1.running_mean"] == 0 and mapping["2.weight"] == 1


def test_split_at():
    model = build("lenet5", (3, 32, 32))
    base, head = split_at(model)
    assert split_index(model) == 2
    assert base == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}
    assert base | head == set(model.state_dict()) and not base & head
    assert split_at(model, 0.5) == (base, head)
    assert split_at(model, -1)[1] == {"fc3.weight", "fc3.bias"}
    assert split_at(model, 4) == split_at(model, -1)
    assert split_at(model, 0)[0] == set() and split_at(model, 1.0)[1] == set()
    with pytest.raises(ValueError):
        split_at(model, 6)
    with pytest.raises(ValueError):
        split_at(model, 1.5)
    with pytest.raises(TypeError):
        split_at(model, True)
    resnet = build("resnet18", (3, 32, 32))
    base, head = split_at(resnet)
    n = len(parameterised_layers(resnet))
    assert len({layer_of_parameter(resnet)[k] for k in base}) == n // 2
    assert "conv1.weight" in base and "fc.weight" in head and "bn1.running_var" in base


def test_unknown_model_suggests_close_name():
    with pytest.raises(SpecError) as info:
        plugin("lenet")
    assert info.value.path == "model.name"
    assert "did you mean 'lenet5'" in str(info.value)


def test_wrong_param_type_and_value():
    with pytest.raises(SpecError) as info:
        plugin("lenet5", {"width": "big"})
    assert info.value.path == "model.params.width"
    with pytest.raises(SpecError) as info:
        plugin("lenet5", {"width": 0})
    assert info.value.path == "model.params.width"
    with pytest.raises(SpecError) as info:
        plugin("mlp", {"hidden": [10, 0]})
    assert info.value.path == "model.params.hidden"
    with pytest.raises(SpecError) as info:
        plugin("mlp", {"hidden": ["ten"]})
    assert info.value.path.startswith("model.params.hidden")
    with pytest.raises(SpecError) as info:
        plugin("cnn4", {"widht": 2.0})
    assert info.value.path == "model.params.widht" and "did you mean 'width'" in str(info.value)
    with pytest.raises(SpecError):
        plugin("resnet18", {"width": 2.0})


def test_vgg16_options():
    bn = build("vgg16", (3, 32, 32), params={"batch_norm": True, "width": 0.25, "hidden": 64})
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in bn.modules())
    assert bn.classifier[0].in_features == 128 and bn.classifier[6].out_features == 10
    assert bn(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# -- BatchNorm variants (norm = "batch"), for FedBN and any method that wants them ----------

BN_LAYOUT = {  # the BatchNorm modules norm = "batch" adds, in forward order, and their widths
    "mlp": [("bn1", torch.nn.BatchNorm1d, 16), ("bn2", torch.nn.BatchNorm1d, 8)],
    "lenet5": [("bn1", torch.nn.BatchNorm2d, 6), ("bn2", torch.nn.BatchNorm2d, 16),
               ("bn3", torch.nn.BatchNorm1d, 120), ("bn4", torch.nn.BatchNorm1d, 84)],
    "cnn2": [("bn1", torch.nn.BatchNorm2d, 32), ("bn2", torch.nn.BatchNorm2d, 64),
             ("bn3", torch.nn.BatchNorm1d, 512)],
    "cnn4": [("bn1", torch.nn.BatchNorm2d, 32), ("bn2", torch.nn.BatchNorm2d, 32),
             ("bn3", torch.nn.BatchNorm2d, 64), ("bn4", torch.nn.BatchNorm2d, 64)],
}
BN_PARAMS = {"mlp": {"hidden": [16, 8]}}


def batchnorms(model):
    return [(n, type(m), m.num_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("name", sorted(BN_LAYOUT))
def test_norm_batch_adds_a_batchnorm_after_each_conv_and_hidden_layer(name):
    params = BN_PARAMS.get(name, {})
    plain = build(name, (3, 32, 32), params=params, seed=5)
    bn = build(name, (3, 32, 32), params={**params, "norm": "batch"}, seed=5)
    assert batchnorms(plain) == [] and batchnorms(bn) == BN_LAYOUT[name]
    # The other layers are the plain model's, weight for weight (BatchNorm draws no random
    # numbers), so the two variants differ only by the BatchNorm keys.
    plain_state, bn_state = plain.state_dict(), bn.state_dict()
    extra = [k for k in bn_state if k not in plain_state]
    assert extra and all(k.split(".")[0] in {n for n, *_ in BN_LAYOUT[name]} for k in extra)
    assert all(torch.equal(plain_state[k], bn_state[k]) for k in plain_state)
    # ... and each BatchNorm is its own layer, right after the layer it normalises
    names = [n for n, _ in parameterised_layers(bn)]
    for bn_name, *_ in BN_LAYOUT[name]:
        assert names.index(bn_name) > 0 and not names[names.index(bn_name) - 1].startswith("bn")


@pytest.mark.parametrize("name", sorted(BN_LAYOUT))
def test_norm_batch_models_normalise_in_training_and_use_running_stats_in_eval(name):
    params = {**BN_PARAMS.get(name, {}), "norm": "batch"}
    model = build(name, (3, 32, 32), params=params)
    first = dict(model.named_modules())["bn1"]
    x = 3.0 + 2.0 * torch.randn(8, 3, 32, 32)
    model(x).sum().backward()
    assert int(first.num_batches_tracked) == 1 and first.running_mean.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():  # eval mode: running statistics, so one sample gives the same logits alone
        assert torch.allclose(model(x[:1]), model(x)[:1], atol=1e-5)
    assert int(first.num_batches_tracked) == 1


def test_norm_none_is_the_unchanged_model_and_bad_norms_are_refused():
    default = build("cnn2", (1, 28, 28))
    assert count_parameters(default) == 1_663_370 and batchnorms(default) == []
    assert list(default.state_dict()) == list(build("cnn2", (1, 28, 28), params={"norm": "none"}).state_dict())
    with pytest.raises(SpecError) as info:
        plugin("mlp", {"norm": "layer"})
    assert info.value.path == "model.params.norm" and "'none', 'batch'" in str(info.value)


def _pool_inputs():
    """Batches where the 2x2 windows tie (quantised values, a constant region, zeros after a
    ReLU), hold -inf and NaN, and have an odd number of rows and columns (floor mode)."""
    gen = torch.Generator().manual_seed(0)
    quantised = torch.randint(0, 3, (4, 6, 28, 28), generator=gen).float()
    quantised[:, :, :8, :8] = 1.5
    odd = torch.randn(2, 3, 9, 7, generator=gen)
    odd[0, 0, 0, 0], odd[1, 2, 4, 4] = float("-inf"), float("nan")
    unbatched = torch.randn(5, 9, 6, generator=gen)  # (C, H, W), H // 2 != W // 2
    return [quantised, torch.relu(torch.randn(3, 16, 10, 10, generator=gen)), odd, unbatched]


@pytest.mark.parametrize("index", range(4))
def test_fast_max_pool_is_torch_max_pool_bit_for_bit(index):
    from pfl_core.models.zoo import _max_pool2

    x = _pool_inputs()[index]
    expected = torch.nn.functional.max_pool2d(x, 2)
    with torch.no_grad():
        got = _max_pool2(x)
    assert got.shape == expected.shape
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_fast_max_pool_leaves_training_gradients_to_torch():
    """A tied window's gradient goes to its first maximum, as torch's max_pool2d sends it
    (``torch.maximum`` would split it between the tied elements)."""
    from pfl_core.models.zoo import _max_pool2

    x = _pool_inputs()[0].requires_grad_()
    _max_pool2(x).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    torch.nn.functional.max_pool2d(x, 2).sum().backward()
    assert torch.equal(ours, x.grad)
    assert set(ours.unique().tolist()) == {0.0, 1.0}  # whole gradients only: ties were present


@pytest.mark.parametrize("name", ["lenet5", "cnn2", "cnn4"])
def test_evaluation_logits_equal_training_path_logits(name):
    """Without autograd the zoo's CNNs take the fast pooling path; their logits stay bit-identical."""
    model = build(name, (3, 32, 32)).eval()
    x = torch.randint(0, 4, (8, 3, 32, 32)).float()  # ties in the pooling windows
    with_grad = model(x)
    with torch.no_grad():
        without = model(x)
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), without)


@pytest.mark.parametrize("grad_enabled,requires_grad", [(True, True), (True, False), (False, True), (False, False)])
def test_torch_pooling_kernel_only_where_a_gradient_is_taken(grad_enabled, requires_grad):
    """The fast path serves every CPU call that builds no graph (evaluation, a frozen body's
    forward in training); torch's kernel only the calls autograd will differentiate."""
    from unittest import mock

    from pfl_core.models import zoo

    x = torch.randn(2, 3, 8, 8, requires_grad=requires_grad)
    with mock.patch.object(zoo.F, "max_pool2d", wraps=torch.nn.functional.max_pool2d) as kernel:
        with torch.set_grad_enabled(grad_enabled):
            zoo._max_pool2(x)
    assert kernel.called == (grad_enabled and requires_grad)
