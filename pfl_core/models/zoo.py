"""pfl's built-in architectures.

Every model returns logits (no softmax), takes any number of input channels (1 for MNIST-like
data, 3 for CIFAR-like data), any reasonable spatial size (28, 32, 64, ...) and any number of
classes. Weights come only from torch's RNG (never downloaded), so ``torch.manual_seed`` makes
``build`` reproducible.

The small-input adaptations of the ImageNet architectures follow what CIFAR papers do; each
class docstring says what changed and why. Parameter counts at 3x32x32 inputs, 10 classes, with
default parameters:

========================  ==========
lenet5                        62,006
mlp (hidden [200, 200])      656,810
cnn2                       2,156,490
cnn4                         106,538
alexnet                    4,557,642
resnet18                  11,173,962
mobilenet_v2               2,236,682
squeezenet                   727,626
vgg16                     15,245,130
========================  ==========
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.errors import SpecError
from pfl_core.models.base import ModelPlugin
from pfl_core.registry import NoParams
from pfl_core.spec import FieldError, at_least, between, described, finite, greater_than, one_of

__all__ = [
    "AlexNet",
    "CNN2",
    "CNN4",
    "LeNet5",
    "MLP",
    "MobileNetV2",
    "ResNet18",
    "SqueezeNet",
    "VGG16",
]


# ---------------------------------------------------------------------------
# Helpers


def _scaled(count: int, width: float) -> int:
    """``count * width`` rounded half up, at least 1."""
    return max(1, int(math.floor(count * width + 0.5)))


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _max_pool2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2)``, with a faster exact path where no gradient is taken.

    On the CPU, torch's max_pool2d kernel for a 2x2 window takes 3.0 ms on a (100, 6, 28, 28)
    batch with one thread, more than LeNet-5's first convolution; the same values as three
    elementwise maxima of the four strided quarters take 0.38 ms (benchmarks/max_pool.py).
    The maximum is exact, so evaluation gives bit-identical logits. Training keeps torch's
    kernel: its backward sends a tied window's gradient to the first maximum, which
    ``torch.maximum`` would split.
    """
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return F.max_pool2d(x, 2)
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2  # floor mode drops an odd last row/column
    return torch.maximum(torch.maximum(x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2]),
                         torch.maximum(x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]))


@described("each >= 1")
def _positive_sizes(_instance, attribute, value):
    if any(isinstance(v, bool) or v < 1 for v in value):
        raise FieldError(attribute.name, f"must be a list of sizes >= 1, got {value!r}")


_WIDTH = dict(default=1.0, validator=[finite, greater_than(0)])
_DROPOUT = [finite, between(0, 1, high_open=True)]
# ``norm = "batch"``: as in the FedBN paper's networks (Li et al., ICLR 2021, App. Table 5:
# conv -> BN -> ReLU -> pool, fc -> BN1d -> ReLU, none after the classifier).
_NORM = dict(default="none", validator=one_of("none", "batch"), metadata={
    "doc": '"batch": a BatchNorm after every convolution and hidden fully connected layer, before its '
           "ReLU (FedBN's networks); the other weights are those of the plain model under the same seed. "
           '"none" builds exactly the model without it (same modules, state-dict keys and initial weights)'})


def _norm(kind: str, channels: int, dims: int) -> nn.Module:
    """BatchNorm{1,2}d(channels) for ``kind = "batch"``, else a parameter-free identity.

    BatchNorm's initial weights (ones) and biases (zeros) use no random numbers, so the other
    layers of a ``norm = "batch"`` model get exactly the weights of the plain model built under
    the same seed."""
    if kind == "batch":
        return nn.BatchNorm2d(channels) if dims == 2 else nn.BatchNorm1d(channels)
    return nn.Identity()


class _SmallInputCheck:
    """Mixin: a SpecError when the spatial size is too small for the architecture."""

    def too_small(self: ModelPlugin, input_shape, detail: str):
        raise SpecError(
            self.name_path,
            f"{self.name} cannot take inputs of shape {tuple(input_shape)!r}: {detail}",
        )


# ---------------------------------------------------------------------------
# Small models


class _LeNet5Net(nn.Module):
    def __init__(self, in_channels, height, width, num_classes, scale, norm="none"):
        super().__init__()
        c1, c2 = _scaled(6, scale), _scaled(16, scale)
        f1, f2 = _scaled(120, scale), _scaled(84, scale)
        self.pad = 2 if min(height, width) < 32 else 0
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=5, padding=self.pad)
        self.bn1 = _norm(norm, c1, 2)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5)
        self.bn2 = _norm(norm, c2, 2)
        h = _conv_out(_conv_out(height, 5, 1, self.pad) // 2, 5) // 2
        w = _conv_out(_conv_out(width, 5, 1, self.pad) // 2, 5) // 2
        self.fc1 = nn.Linear(c2 * h * w, f1)
        self.bn3 = _norm(norm, f1, 1)
        self.fc2 = nn.Linear(f1, f2)
        self.bn4 = _norm(norm, f2, 1)
        self.fc3 = nn.Linear(f2, num_classes)

    def forward(self, x):
        x = _max_pool2(F.relu(self.bn1(self.conv1(x))))
        x = _max_pool2(F.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(x, 1)
        x = F.relu(self.bn3(self.fc1(x)))
        x = F.relu(self.bn4(self.fc2(x)))
        return self.fc3(x)


class LeNet5(_SmallInputCheck, ModelPlugin):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling, as used in FL benchmarks.

    conv5x5(6) -> relu -> maxpool2 -> conv5x5(16) -> relu -> maxpool2 -> fc120 -> relu ->
    fc84 -> relu -> fc(C). Modules are named ``conv1, conv2, fc1, fc2, fc3``.

    Adapted: inputs smaller than 32 pixels on a side (MNIST's 28x28) get padding 2 on the first
    convolution, exactly as LeNet-5 padded 28x28 digits to 32x32, so both give 16x5x5 features;
    larger inputs (64x64) keep the unpadded convolution and a larger first fully connected
    layer. ``width`` multiplies every channel and unit count (6, 16, 120, 84), rounded half up,
    at least 1. ``norm = "batch"`` adds ``bn1..bn4`` after conv1, conv2, fc1, fc2.
    """

    name = "lenet5"

    @define
    class Params:
        width: float = field(**_WIDTH, metadata={"doc": "multiplies every channel and unit count "
                                                         "(6, 16, 120, 84), rounded half up, at least 1"})
        norm: str = field(**_NORM)

    def build(self, input_shape, num_classes):
        shape = self.check_shape(input_shape, num_classes)
        c, h, w = shape
        pad = 2 if min(h, w) < 32 else 0
        if min(_conv_out(_conv_out(h, 5, 1, pad) // 2, 5), _conv_out(_conv_out(w, 5, 1, pad) // 2, 5)) < 2:
            self.too_small(shape, "LeNet-5 needs at least 12x12 pixels")
        return _LeNet5Net(c, h, w, num_classes, self.params.width, self.params.norm)


class _MLPNet(nn.Module):
    def __init__(self, in_features, hidden, num_classes, norm="none"):
        super().__init__()
        sizes = [in_features, *hidden, num_classes]
        self.num_layers = len(sizes) - 1
        for i in range(self.num_layers):
            self.add_module(f"fc{i + 1}", nn.Linear(sizes[i], sizes[i + 1]))
            if i < self.num_layers - 1 and norm != "none":
                self.add_module(f"bn{i + 1}", _norm(norm, sizes[i + 1], 1))

    def forward(self, x):
        x = torch.flatten(x, 1)
        for i in range(1, self.num_layers + 1):
            x = getattr(self, f"fc{i}")(x)
            if i < self.num_layers:
                bn = getattr(self, f"bn{i}", None)
                x = F.relu(x if bn is None else bn(x))
        return x


class MLP(ModelPlugin):
    """Multi-layer perceptron on the flattened input: fc(h1) -> relu -> ... -> fc(C).

    Works on feature vectors and on images (flattened). ``hidden = []`` gives multinomial
    logistic regression. Layers are named ``fc1, fc2, ...``; the last is the classifier.
    ``norm = "batch"`` adds ``bn<i>`` (BatchNorm1d) after each hidden layer ``fc<i>``.
    """

    name = "mlp"
    requires_image = False

    @define
    class Params:
        hidden: list[int] = field(factory=lambda: [200, 200], validator=_positive_sizes, metadata={
            "doc": "hidden layer sizes; [] is multinomial logistic regression"})
        norm: str = field(**_NORM)

    def build(self, input_shape, num_classes):
        shape = self.check_shape(input_shape, num_classes)
        return _MLPNet(math.prod(shape), list(self.params.hidden), num_classes, self.params.norm)


class _CNN2Net(nn.Module):
    def __init__(self, in_channels, height, width, num_classes, scale, norm="none"):
        super().__init__()
        c1, c2, f1 = _scaled(32, scale), _scaled(64, scale), _scaled(512, scale)
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=5, padding=2)
        self.bn1 = _norm(norm, c1, 2)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5, padding=2)
        self.bn2 = _norm(norm, c2, 2)
        self.fc1 = nn.Linear(c2 * (height // 4) * (width // 4), f1)
        self.bn3 = _norm(norm, f1, 1)
        self.fc2 = nn.Linear(f1, num_classes)

    def forward(self, x):
        x = _max_pool2(F.relu(self.bn1(self.conv1(x))))
        x = _max_pool2(F.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.bn3(self.fc1(x))))


class _SmallCNN(_SmallInputCheck, ModelPlugin):
    """The small CNNs: a ``width`` multiplier, optional BatchNorm (``norm``), at least 4x4
    pixels, then ``network``."""

    @define
    class Params:
        width: float = field(**_WIDTH, metadata={"doc": "multiplies the channel and unit counts "
                                                         "(cnn2: 32, 64, 512; cnn4: 32, 64), rounded half up"})
        norm: str = field(**_NORM)

    def build(self, input_shape, num_classes):
        shape = self.check_shape(input_shape, num_classes)
        c, h, w = shape
        if min(h, w) < 4:
            self.too_small(shape, "the CNN needs at least 4x4 pixels")
        return self.network(c, h, w, num_classes, self.params.width, self.params.norm)


class CNN2(_SmallCNN):
    """The MNIST CNN of FedAvg (McMahan et al. 2017), also pMixFed's MNIST model.

    conv5x5(32) -> relu -> maxpool2 -> conv5x5(64) -> relu -> maxpool2 -> fc512 -> relu ->
    fc(C): two convolutional and two fully connected layers (``conv1, conv2, fc1, fc2``).
    The convolutions are "same"-padded (padding 2), which reproduces the paper's count of
    1,663,370 parameters for 1x28x28 inputs and 10 classes; other sizes change only the input
    of ``fc1`` (64 x H/4 x W/4). ``width`` multiplies 32, 64 and 512 (default 1).
    ``norm = "batch"`` adds ``bn1, bn2`` (BatchNorm2d) after the convolutions and ``bn3``
    (BatchNorm1d) after ``fc1``.
    """

    name = "cnn2"
    network = _CNN2Net


class _CNN4Net(nn.Module):
    def __init__(self, in_channels, height, width, num_classes, scale, norm="none"):
        super().__init__()
        c1, c2 = _scaled(32, scale), _scaled(64, scale)
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=3, padding=1)
        self.bn1 = _norm(norm, c1, 2)
        self.conv2 = nn.Conv2d(c1, c1, kernel_size=3, padding=1)
        self.bn2 = _norm(norm, c1, 2)
        self.conv3 = nn.Conv2d(c1, c2, kernel_size=3, padding=1)
        self.bn3 = _norm(norm, c2, 2)
        self.conv4 = nn.Conv2d(c2, c2, kernel_size=3, padding=1)
        self.bn4 = _norm(norm, c2, 2)
        self.fc = nn.Linear(c2 * (height // 4) * (width // 4), num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = _max_pool2(F.relu(self.bn2(self.conv2(x))))
        x = F.relu(self.bn3(self.conv3(x)))
        x = _max_pool2(F.relu(self.bn4(self.conv4(x))))
        return self.fc(torch.flatten(x, 1))


class CNN4(_SmallCNN):
    """pMixFed's CIFAR CNN: four convolutional layers and one fully connected layer.

    conv3x3(32) -> relu -> conv3x3(32) -> relu -> maxpool2 -> conv3x3(64) -> relu ->
    conv3x3(64) -> relu -> maxpool2 -> fc(C), all convolutions with padding 1; modules
    ``conv1..conv4, fc``. For 32x32 inputs the classifier sees 64x8x8 features. ``width``
    multiplies the channel counts 32 and 64 (default 1). ``norm = "batch"`` adds ``bn1..bn4``
    (BatchNorm2d) after the four convolutions.
    """

    name = "cnn4"
    network = _CNN4Net


# ---------------------------------------------------------------------------
# ImageNet architectures adapted to small inputs


class _AlexNetSmall(nn.Module):
    """torchvision's AlexNet layout (same module names) with a CIFAR-sized stem and head."""

    def __init__(self, in_channels, num_classes, hidden, dropout):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 2 * 2, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class AlexNet(ModelPlugin):
    """AlexNet (Krizhevsky et al. 2012) in torchvision's layout, adapted to 28-64 px inputs.

    Same five convolutions (64, 192, 384, 256, 256 channels; kernels 5 and 3 after the first),
    the same three 3x3/stride-2 max pools and the same module names (``features.0`` ...
    ``classifier.6``) as ``torchvision.models.alexnet``. Adapted, CIFAR style:

    * the first convolution is 3x3, stride 1, padding 1 instead of 11x11 stride 4 (which
      leaves a 32x32 image 7x7 before the first pool), and takes any number of channels;
      feature maps are 32 -> 15 -> 7 -> 3 (28 -> 13 -> 6 -> 2);
    * the adaptive average pool outputs 2x2 instead of 6x6, so the classifier sees
      256*2*2 = 1024 features, and its two hidden layers have ``hidden`` units (default 1024
      instead of 4096: 4096 would put 21M of the parameters in a head fed by 1024 numbers).

    Inputs need at least 15x15 pixels. Default init (PyTorch's, as torchvision's AlexNet).
    """

    name = "alexnet"

    @define
    class Params:
        hidden: int = field(default=1024, validator=at_least(1),
                            metadata={"doc": "units of each of the classifier's two hidden layers"})
        dropout: float = field(default=0.5, validator=_DROPOUT,
                               metadata={"doc": "dropout probability before each hidden layer of the classifier"})

    def build(self, input_shape, num_classes):
        c, h, w = self.check_shape(input_shape, num_classes)
        model = _AlexNetSmall(c, num_classes, self.params.hidden, self.params.dropout)
        return self.check_forward(model, (c, h, w), num_classes)


class ResNet18(ModelPlugin):
    """ResNet-18 (He et al. 2016): ``torchvision.models.resnet18(weights=None)``, CIFAR style.

    Adapted as in the CIFAR ResNet literature: the 7x7 stride-2 stem convolution becomes 3x3
    stride 1 padding 1 (taking any number of input channels, Kaiming-initialised like
    torchvision's) and the stem max pool is removed, so a 32x32 image reaches the last stage
    at 4x4 instead of 1x1. Everything else (BatchNorm, blocks, the global average pool and the
    ``fc`` classifier) is torchvision's, with the same module names.
    """

    name = "resnet18"
    Params = NoParams

    def build(self, input_shape, num_classes):
        import torchvision  # lazily: it imports torch._dynamo, seconds of start-up

        c, h, w = self.check_shape(input_shape, num_classes)
        model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
        model.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
        return self.check_forward(model, (c, h, w), num_classes)


class MobileNetV2(ModelPlugin):
    """MobileNetV2 (Sandler et al. 2018): ``torchvision.models.mobilenet_v2(weights=None)``.

    Adapted: the stem convolution has stride 1 instead of 2 (and takes any number of input
    channels), so the total stride is 16 instead of 32 and a 32x32 image ends at 2x2 rather
    than 1x1. ``width`` is torchvision's ``width_mult`` (channels rounded to multiples of 8)
    and ``dropout`` the classifier's dropout (torchvision's default 0.2).
    """

    name = "mobilenet_v2"

    @define
    class Params:
        width: float = field(**_WIDTH, metadata={"doc": "torchvision's width_mult (channels rounded to "
                                                         "multiples of 8)"})
        dropout: float = field(default=0.2, validator=_DROPOUT,
                               metadata={"doc": "the classifier's dropout probability (torchvision's default)"})

    def build(self, input_shape, num_classes):
        import torchvision  # lazily: it imports torch._dynamo, seconds of start-up

        c, h, w = self.check_shape(input_shape, num_classes)
        model = torchvision.models.mobilenet_v2(
            weights=None, num_classes=num_classes, width_mult=self.params.width, dropout=self.params.dropout
        )
        stem = model.features[0][0]
        model.features[0][0] = nn.Conv2d(c, stem.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.features[0][0].weight, mode="fan_out")
        return self.check_forward(model, (c, h, w), num_classes)


class SqueezeNet(ModelPlugin):
    """SqueezeNet 1.1 (Iandola et al. 2016): ``torchvision.models.squeezenet1_1(weights=None)``.

    Adapted: the stem convolution is 3x3 with stride 1 and padding 1 instead of stride 2 and
    no padding (and takes any number of input channels), so a 32x32 image keeps 32x32 until
    the first max pool and the last Fire modules work on 4x4 maps (3x3 for 28x28) instead of
    almost nothing. The head is torchvision's: dropout, a 1x1 convolution to C channels, ReLU,
    global average pool; note the ReLU makes its logits non-negative, as in the original.
    """

    name = "squeezenet"

    @define
    class Params:
        dropout: float = field(default=0.5, validator=_DROPOUT,
                               metadata={"doc": "dropout probability before the final convolution (torchvision's)"})

    def build(self, input_shape, num_classes):
        import torchvision  # lazily: it imports torch._dynamo, seconds of start-up

        c, h, w = self.check_shape(input_shape, num_classes)
        model = torchvision.models.squeezenet1_1(weights=None, num_classes=num_classes, dropout=self.params.dropout)
        model.features[0] = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1)
        nn.init.kaiming_uniform_(model.features[0].weight)
        nn.init.constant_(model.features[0].bias, 0)
        return self.check_forward(model, (c, h, w), num_classes)


class _VGGSmall(nn.Module):
    """torchvision's VGG layout (same module names) with a global-pool head."""

    def __init__(self, features, channels, num_classes, hidden, dropout):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(
            nn.Linear(channels, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        # torchvision's VGG initialisation.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class VGG16(ModelPlugin):
    """VGG-16 (Simonyan & Zisserman 2015), configuration D, built with torchvision's
    ``vgg.make_layers``/``vgg.cfgs["D"]`` and torchvision's initialisation and module names.

    Adapted, CIFAR style:

    * the first convolution takes any number of input channels;
    * the five 2x2 max pools use ``ceil_mode=True``, so 28x28 inputs shrink 28 -> 14 -> 7 -> 4
      -> 2 -> 1 instead of vanishing (sizes that are powers of two are unaffected: 32 -> 1);
    * the 7x7 adaptive pool and the 25088-4096-4096 classifier (120M parameters) become a
      global average pool and a 512-``hidden``-``hidden``-C classifier (``hidden`` default 512),
      keeping torchvision's three Linear layers at ``classifier.0/3/6``.

    ``width`` multiplies the convolution channels (64 ... 512); ``batch_norm = true`` gives
    VGG-16-BN (torchvision's ``vgg16_bn`` layout).
    """

    name = "vgg16"

    @define
    class Params:
        width: float = field(**_WIDTH, metadata={"doc": "multiplies the convolution channels (64 ... 512)"})
        hidden: int = field(default=512, validator=at_least(1),
                            metadata={"doc": "units of each of the classifier's two hidden layers"})
        dropout: float = field(default=0.5, validator=_DROPOUT,
                               metadata={"doc": "dropout probability after each hidden layer of the classifier"})
        batch_norm: bool = field(default=False, metadata={"doc": "true: VGG-16-BN (torchvision's vgg16_bn layout)"})

    def build(self, input_shape, num_classes):
        import torchvision  # lazily: it imports torch._dynamo, seconds of start-up

        c, h, w = self.check_shape(input_shape, num_classes)
        cfg = [v if v == "M" else _scaled(v, self.params.width) for v in torchvision.models.vgg.cfgs["D"]]
        features = torchvision.models.vgg.make_layers(cfg, batch_norm=self.params.batch_norm)
        features[0] = nn.Conv2d(c, cfg[0], kernel_size=3, padding=1)
        for layer in features:
            if isinstance(layer, nn.MaxPool2d):
                layer.ceil_mode = True
        model = _VGGSmall(features, cfg[-2], num_classes, self.params.hidden, self.params.dropout)
        return self.check_forward(model, (c, h, w), num_classes)


# The built-in model plugins, in the order of the table above.
MODEL_CLASSES = (LeNet5, MLP, CNN2, CNN4, AlexNet, ResNet18, MobileNetV2, SqueezeNet, VGG16)
