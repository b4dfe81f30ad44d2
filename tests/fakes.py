"""Tiny fake copies of torchvision datasets in torchvision's exact on-disk format.

They load through torchvision's real reading code (pickled CIFAR batches, IDX files for the
MNIST family). One thing cannot be faked: torchvision's CIFAR classes compare every file's
md5 with the official archive's (``CIFAR10._check_integrity`` and ``_load_meta``), also with
``download=False``; no fake file can match. :func:`torchvision_md5_bypass` therefore replaces
``torchvision.datasets.cifar.check_integrity`` with a file-exists check for its duration;
everything else (paths, pickle keys, reshaping to HWC, class names from the meta file) is
torchvision's own code. The MNIST family checks existence only, so those fakes need no bypass.

Usage::

    root = write_fake_cifar100(tmp_path, n_train=200, n_test=50, seed=0)
    with torchvision_md5_bypass():
        raw = CIFAR100(CIFAR100.Params(root=str(root), download=False)).load()
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
from pathlib import Path

import numpy as np

__all__ = [
    "write_fake_cifar10",
    "write_fake_cifar100",
    "write_fake_mnist",
    "write_fake_emnist",
    "torchvision_md5_bypass",
]


def _images(rng, n: int, shape) -> np.ndarray:
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _labels(rng, n: int, num_classes: int) -> np.ndarray:
    """Every class present when n >= num_classes (cyclic, then shuffled)."""
    return rng.permutation(np.arange(n) % num_classes).astype(np.int64)


def _dump(path: Path, obj) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=2)


def _cifar_rows(images_hwc: np.ndarray) -> np.ndarray:
    # CIFAR stores each image as 3072 bytes: the red plane, then green, then blue (CHW).
    return images_hwc.transpose(0, 3, 1, 2).reshape(len(images_hwc), -1)


def write_fake_cifar10(root, n_train: int = 100, n_test: int = 20, seed: int = 0) -> Path:
    """Write ``<root>/cifar-10-batches-py/`` (data_batch_1..5, test_batch, batches.meta).

    Returns ``root``. Labels cycle through the 10 classes so every class is present.
    """
    rng = np.random.default_rng(seed)
    root = Path(root)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    x = _images(rng, n_train, (32, 32, 3))
    y = _labels(rng, n_train, 10)
    for b, idx in enumerate(np.array_split(np.arange(n_train), 5), start=1):
        _dump(folder / f"data_batch_{b}", {
            "batch_label": f"training batch {b} of 5",
            "labels": [int(v) for v in y[idx]],
            "data": _cifar_rows(x[idx]),
            "filenames": [f"fake_{i}.png" for i in idx],
        })
    xt, yt = _images(rng, n_test, (32, 32, 3)), _labels(rng, n_test, 10)
    _dump(folder / "test_batch", {
        "batch_label": "testing batch 1 of 1",
        "labels": [int(v) for v in yt],
        "data": _cifar_rows(xt),
        "filenames": [f"fake_test_{i}.png" for i in range(n_test)],
    })
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _dump(folder / "batches.meta", {"num_cases_per_batch": n_train // 5, "label_names": names, "num_vis": 3072})
    return root


def write_fake_cifar100(root, n_train: int = 200, n_test: int = 100, seed: int = 0) -> Path:
    """Write ``<root>/cifar-100-python/`` (train, test, meta) with fine and coarse labels.

    Returns ``root``. Fine labels cycle through the 100 classes.
    """
    rng = np.random.default_rng(seed)
    root = Path(root)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    fine_names = [f"fine{i:02d}" for i in range(100)]
    coarse_names = [f"coarse{i:02d}" for i in range(20)]
    for split, n in (("train", n_train), ("test", n_test)):
        x, y = _images(rng, n, (32, 32, 3)), _labels(rng, n, 100)
        _dump(folder / split, {
            "filenames": [f"fake_{split}_{i}.png" for i in range(n)],
            "batch_label": f"{split} batch",
            "fine_labels": [int(v) for v in y],
            "coarse_labels": [int(v) // 5 for v in y],
            "data": _cifar_rows(x),
        })
    _dump(folder / "meta", {"fine_label_names": fine_names, "coarse_label_names": coarse_names})
    return root


def _write_idx(path: Path, array: np.ndarray) -> None:
    """IDX ("SN3 Pascal Vincent") file of uint8 data, as torchvision's MNIST reader expects."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(bytes([0, 0, 0x08, array.ndim]))
        fh.write(struct.pack(">" + "I" * array.ndim, *array.shape))
        fh.write(array.tobytes())


def write_fake_mnist(root, n_train: int = 100, n_test: int = 20, seed: int = 0, folder: str = "MNIST") -> Path:
    """Write uncompressed IDX files to ``<root>/<folder>/raw/`` (folder "MNIST" or
    "FashionMNIST"). Returns ``root``."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", _images(rng, n, (28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", _labels(rng, n, 10))
    return Path(root)


def write_fake_emnist(root, upright_train: np.ndarray, upright_test: np.ndarray,
                      y_train: np.ndarray, y_test: np.ndarray, split: str = "balanced") -> Path:
    """Write ``<root>/EMNIST/raw/emnist-<split>-{train,test}-*-idx?-ubyte``.

    Takes upright (N, 28, 28) images and stores them transposed, as the real EMNIST files
    are. Returns ``root``.
    """
    raw = Path(root) / "EMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for part, x, y in (("train", upright_train, y_train), ("test", upright_test, y_test)):
        _write_idx(raw / f"emnist-{split}-{part}-images-idx3-ubyte", np.asarray(x).transpose(0, 2, 1))
        _write_idx(raw / f"emnist-{split}-{part}-labels-idx1-ubyte", np.asarray(y))
    return Path(root)


@contextlib.contextmanager
def torchvision_md5_bypass():
    """Let fake CIFAR files pass torchvision's md5 checks (a file-exists check instead)."""
    import torchvision.datasets.cifar as cifar

    original = cifar.check_integrity
    cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)
    try:
        yield
    finally:
        cifar.check_integrity = original
