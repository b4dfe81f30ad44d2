"""Dataset plugins: FedProx's synthetic data, generic npz files and torchvision's datasets."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import zipfile
from pathlib import Path

import numpy as np
from attrs import define, field

from pfl_core.data.base import DatasetPlugin, RawDataset
from pfl_core.errors import DataError, SpecError
from pfl_core.spec import at_least, finite, one_of

__all__ = ["Synthetic", "Npz", "MNIST", "FashionMNIST", "CIFAR10", "CIFAR100", "EMNIST"]

# Classes a dataset may have (docs/spec-reference.md, "Limits"): an npz file whose one stray
# label is 10**6 would otherwise give every model a million outputs.
MAX_CLASSES = 100_000


# ---------------------------------------------------------------------------
# Synthetic(alpha, beta)


@define
class SyntheticParams:
    alpha: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "how much the devices' labelling models differ (FedProx's Synthetic(alpha, beta))"})
    beta: float = field(default=1.0, validator=[finite, at_least(0)],
                        metadata={"doc": "how much the devices' inputs differ"})
    num_devices: int = field(default=20, validator=at_least(1), metadata={
        "doc": 'generating devices (the domains; partition.scheme = "domain" gives one client per device)'})
    samples_per_device: int = field(default=300, validator=at_least(1),
                                    metadata={"doc": "samples generated per device"})
    dim: int = field(default=60, validator=at_least(1), metadata={"doc": "feature dimension"})
    num_classes: int = field(default=10, validator=at_least(2), metadata={"doc": "number of classes"})
    seed: int = field(default=0, validator=at_least(0), metadata={
        "doc": "the generator's own seed (the data stay fixed while experiment.seed varies)"})


class Synthetic(DatasetPlugin):
    """FedProx's Synthetic(alpha, beta) (Li et al. 2020, Sec. 5.1).

    For each device k: u_k ~ N(0, alpha), W_k ~ N(u_k, 1) of shape dim x classes,
    b_k ~ N(u_k, 1); B_k ~ N(0, beta), v_k ~ N(B_k, 1) per dimension; x ~ N(v_k, Sigma) with
    Sigma diagonal, Sigma_jj = j^-1.2; y = argmax softmax(W_k^T x + b_k). alpha controls how
    much the devices' models differ, beta how much their inputs differ. As in FedProx's
    generator code, alpha and beta are used as standard deviations.

    Differences from FedProx: every device has the same ``samples_per_device`` samples
    (FedProx drew sizes from a power law) so that every client has enough data to split
    into train/val/test. ``seed`` is the generator's own seed, so the data stay fixed while
    ``experiment.seed`` varies the partition and training.

    Features are float32 (N, dim) and are not standardised by the core (they are already
    well scaled). ``domain_train`` is the device index (``domain_names`` "device0", ...), so
    ``partition.scheme = "domain"`` with ``num_clients = num_devices`` gives FedProx's
    one-device-per-client partition. There is no official test split (``x_test`` is None):
    every client's test data come from its own samples.
    """

    name = "synthetic"
    Params = SyntheticParams

    # Sizes checked before generating (docs/spec-reference.md, "Limits"): the features of all
    # devices, one device's labelling model (dim x classes) and the devices generated one by one.
    MAX_FEATURE_VALUES = 250_000_000  # num_devices * samples_per_device * dim: 1 GB of float32
    MAX_MODEL_VALUES = 10_000_000  # dim * num_classes
    MAX_DEVICES = 100_000

    def check_sizes(self) -> None:
        p = self.params

        def refuse(key, message):
            raise SpecError(f"{self.spec_path}.params.{key}", message)

        if p.num_devices > self.MAX_DEVICES:
            refuse("num_devices", f"{p.num_devices} devices is above the limit of {self.MAX_DEVICES}")
        sizes = {"num_devices": p.num_devices, "samples_per_device": p.samples_per_device, "dim": p.dim}
        values = p.num_devices * p.samples_per_device * p.dim
        if values > self.MAX_FEATURE_VALUES:
            refuse(max(sizes, key=sizes.get), f"num_devices x samples_per_device x dim = {p.num_devices} x "
                   f"{p.samples_per_device} x {p.dim} = {values} feature values, above the limit of "
                   f"{self.MAX_FEATURE_VALUES} (1 GB of float32)")
        if p.dim * p.num_classes > self.MAX_MODEL_VALUES:
            refuse("dim" if p.dim > p.num_classes else "num_classes",
                   f"dim x num_classes = {p.dim} x {p.num_classes} = {p.dim * p.num_classes} weights per device, "
                   f"above the limit of {self.MAX_MODEL_VALUES}")

    def load(self) -> RawDataset:
        self.check_sizes()
        p = self.params
        rng = np.random.default_rng(p.seed)
        n, dim, c = p.samples_per_device, p.dim, p.num_classes
        u = rng.normal(0.0, p.alpha, p.num_devices)
        big_b = rng.normal(0.0, p.beta, p.num_devices)
        v = rng.normal(big_b[:, None], 1.0, (p.num_devices, dim))
        # |x| is about |v| (scale <= 1) and the logits x @ w about |v| |u| dim: both must fit
        # (float32 features, float64 logits), else the data are infinite or NaN.
        largest_x, largest_w = float(np.abs(v).max()) + 10.0, float(np.abs(u).max()) + 10.0
        if largest_x > float(np.finfo(np.float32).max):
            raise SpecError(f"{self.spec_path}.params.beta", f"{p.beta} makes features of about {largest_x:.3g}, "
                                                             "beyond float32's range; use a smaller beta")
        if largest_x * largest_w * dim > 1e300:
            raise SpecError(f"{self.spec_path}.params.alpha", f"{p.alpha} with beta = {p.beta} makes the labelling "
                                                              "models' outputs overflow; use smaller values")
        scale = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt(Sigma_jj)
        xs, ys = [], []
        for k in range(p.num_devices):
            w = rng.normal(u[k], 1.0, (dim, c))
            b = rng.normal(u[k], 1.0, c)
            x = v[k] + scale * rng.standard_normal((n, dim))
            xs.append(x.astype(np.float32))
            ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))
        return RawDataset(
            x_train=np.concatenate(xs),
            y_train=np.concatenate(ys),
            x_test=None,
            y_test=None,
            num_classes=c,
            domain_train=np.repeat(np.arange(p.num_devices, dtype=np.int64), n),
            domain_test=None,
            class_names=[str(i) for i in range(c)],
            domain_names=[f"device{k}" for k in range(p.num_devices)],
        )


# ---------------------------------------------------------------------------
# npz files


@define
class NpzParams:
    path: str = field(metadata={
        "doc": "a .npz file with x_train, y_train (and optionally x_test, y_test, classes, domain arrays); "
               "~ expanded, relative to the working directory"})
    domain_key: str = field(default="domain", metadata={
        "doc": "prefix of the domain arrays: <key>_train, <key>_test, <key>s (names)"})


class Npz(DatasetPlugin):
    """A dataset in one ``.npz`` file (read with ``numpy.load``, no pickle).

    Keys: ``x_train``, ``y_train`` (required), ``x_test``, ``y_test`` (optional, both or
    neither); images as uint8 (N, H, W) or (N, H, W, C), or float features (N, D); labels
    integer class indices. Optional: ``classes`` (class names; their number is the number of
    classes, else max label + 1), ``<domain_key>_train`` / ``<domain_key>_test`` (int domain
    index per sample) and ``<domain_key>s`` (domain names; e.g. ``domains``).
    ``path`` may start with ``~``; a relative path is relative to the working directory.
    """

    name = "npz"
    Params = NpzParams

    def load(self) -> RawDataset:
        path = Path(os.path.expanduser(self.params.path))

        def fail(message):  # every problem with the file names the key that chose it
            raise DataError(f"data.params.path: {message}")

        write_one = "write one with numpy.savez(path, x_train=..., y_train=...)"
        try:
            exists, is_dir, is_file = path.exists(), path.is_dir(), path.is_file()
            with open(path, "rb") if is_file else contextlib.nullcontext() as fh:
                magic = fh.read(6) if is_file else b""
        except OSError as exc:  # unreadable, or a name longer than the file system allows
            fail(f"cannot read npz file {path}: {exc.strerror or exc}")
        if is_dir:
            fail(f"{path} is a directory, not an npz file")
        if not is_file:
            fail(f"{path} is not a regular file" if exists else f"npz file not found: {path}")
        if magic == b"\x93NUMPY":
            fail(f"{path} is a single .npy array, not an .npz archive of named arrays; {write_one}")
        if not magic.startswith(b"PK"):  # numpy would call any other file "pickled data"
            fail(f"{path} is not an npz file (a zip archive of .npy arrays); {write_one}")
        key = self.params.domain_key
        try:
            _check_npy_headers(path, fail)
            with np.load(path, allow_pickle=False) as f:  # object arrays are refused, never unpickled
                members = list(f.files)
                # a member that is not a .npy file reads as bytes
                arrays = {name: value for name in members if isinstance(value := f[name], np.ndarray)}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            fail(f"cannot read npz file {path}: {first}")
        except MemoryError:
            fail(f"npz file {path} is too large to load into this machine's memory")
        if not arrays:
            fail(f"npz file {path} holds no .npy arrays (members: {', '.join(sorted(members)) or 'none'}); write "
                 "it with numpy.savez(path, x_train=..., y_train=...)")
        for required in ("x_train", "y_train"):
            if required not in arrays:
                fail(f"npz file {path} has no '{required}' array (keys: {', '.join(sorted(arrays))})")
        source = f"data.params.path: npz file {path}"
        y_all = {name: arrays[name] for name in ("y_train", "y_test") if name in arrays}
        for name, y in y_all.items():
            if not np.issubdtype(y.dtype, np.integer):
                fail(f"npz file {path}: {name} must hold integer class indices, got dtype {y.dtype}")
        classes = arrays.get("classes")
        if classes is not None and classes.ndim != 1:
            fail(f"npz file {path}: 'classes' must be a list (1-d array) of class names, got an array of shape "
                 f"{classes.shape}")
        if classes is not None:
            num_classes = len(classes)
        else:
            maxes = {name: int(y.max()) for name, y in y_all.items() if y.size}
            num_classes = max(maxes.values()) + 1 if maxes else 1
            if num_classes > MAX_CLASSES:
                name = max(maxes, key=maxes.get)
                fail(f"npz file {path}: {name} has label {maxes[name]}, which makes {num_classes} classes (max label "
                     f"+ 1; there is no 'classes' array), above the limit of {MAX_CLASSES}; number the classes "
                     "0..C-1")
        if num_classes > MAX_CLASSES:
            fail(f"npz file {path}: 'classes' names {num_classes} classes, above the limit of {MAX_CLASSES}")
        domain_names = arrays.get(f"{key}s")
        if domain_names is not None and domain_names.ndim != 1:
            fail(f"npz file {path}: '{key}s' must be a list (1-d array) of domain names, got an array of shape "
                 f"{domain_names.shape}")
        raw = RawDataset(
            x_train=arrays["x_train"],
            y_train=arrays["y_train"],
            x_test=arrays.get("x_test"),
            y_test=arrays.get("y_test"),
            num_classes=num_classes,
            domain_train=arrays.get(f"{key}_train"),
            domain_test=arrays.get(f"{key}_test"),
            class_names=[str(c) for c in classes] if classes is not None else None,
            domain_names=[str(d) for d in domain_names] if domain_names is not None else None,
        )
        return raw.validate(source)


def _check_npy_headers(path: Path, fail) -> None:
    """Read each member's .npy header (never its data) and refuse, naming the array: object
    arrays (only pickle could load them), and a header whose shape needs more bytes than the
    member holds (truncated or corrupt; numpy would allocate the declared size first) or than
    this machine has memory."""
    memory = _physical_memory()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[: -len(".npy")]
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read_header is None:  # a newer format: numpy.load checks it
                    continue
                shape, _fortran, dtype = read_header(member)
                if dtype.hasobject:
                    fail(f"npz file {path}: '{name}' holds Python objects (dtype object), which only pickle "
                         "can load, and pfl never unpickles a data file; save numeric arrays")
                needed = math.prod(shape) * dtype.itemsize
                held = info.file_size - member.tell()
            if needed > held:
                fail(f"npz file {path}: '{name}' is truncated or corrupt: its header says shape {tuple(shape)} "
                     f"({needed} bytes) but it holds {held} bytes")
            if memory and needed > memory:
                fail(f"npz file {path}: '{name}' needs {needed / 2**30:.1f} GiB, more than this machine's "
                     f"memory ({memory / 2**30:.1f} GiB)")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not on this platform
        return None


# ---------------------------------------------------------------------------
# torchvision datasets

# Seconds a download may wait on a silent socket (module level so tests can lower it).
DOWNLOAD_TIMEOUT = 15.0


@define
class TorchvisionParams:
    root: str = field(default="~/.cache/pfl/data", metadata={
        "doc": "where torchvision's files are (torchvision's layout; ~ expanded)"})
    download: bool = field(default=True, metadata={"doc": "download into root when missing"})


def _short(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


class _Torchvision(DatasetPlugin):
    """Shared loading logic; subclasses name the torchvision class and its folder."""

    Params = TorchvisionParams
    tv_name = ""  # torchvision.datasets attribute
    display = ""  # name in messages
    folder = ""  # the folder torchvision keeps the files in, relative to root

    def _open(self, root: str, train: bool, download: bool):
        import torchvision.datasets as tvd

        return getattr(tvd, self.tv_name)(root, train=train, download=download)

    def _load_both(self, root: str):
        return self._open(root, True, False), self._open(root, False, False)

    def load(self) -> RawDataset:
        root = os.path.expanduser(self.params.root)
        try:
            train, test = self._load_both(root)
        except Exception as first:  # torchvision raises RuntimeError (missing or bad md5)
            reason = _short(first)
            if not self.params.download:
                reason = "data.params.download is false"
                folder = os.path.join(root, self.folder)
                if os.path.isdir(folder) and os.listdir(folder):
                    reason = f"files under {self.folder}/ are incomplete or fail torchvision's check; " + reason
            else:
                reason = self._try_download(root)
            if reason is not None:
                raise DataError(
                    f"data.params.root: {self.display} not found under {root} and could not be downloaded "
                    f"({reason}); put torchvision's {self.display} files there "
                    f"(e.g. {os.path.join(root, self.folder)}{os.sep}) or set data.params.root"
                ) from None
            try:
                train, test = self._load_both(root)
            except Exception as exc:
                raise DataError(
                    f"data.params.root: {self.display} was downloaded to {root} but cannot be read ({_short(exc)}); "
                    f"delete {os.path.join(root, self.folder)} and try again"
                ) from None
        return self._to_raw(train, test)

    def _try_download(self, root: str):
        """None on success, else a short reason."""
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
        try:
            self._open(root, True, True)
            self._open(root, False, True)
        except Exception as exc:  # network errors, bad archives, md5 mismatches...
            return f"download failed: {_short(exc)}"
        finally:
            socket.setdefaulttimeout(previous)
        return None

    @staticmethod
    def _array(values, dtype) -> np.ndarray:
        if hasattr(values, "numpy"):
            values = values.numpy()
        return np.ascontiguousarray(np.asarray(values), dtype=dtype)

    def _to_raw(self, train, test) -> RawDataset:
        classes = [str(c) for c in train.classes]
        raw = RawDataset(
            x_train=self._array(train.data, np.uint8),
            y_train=self._array(train.targets, np.int64),
            x_test=self._array(test.data, np.uint8),
            y_test=self._array(test.targets, np.int64),
            num_classes=len(classes),
            class_names=classes,
        )
        return raw.validate(self.display)


class MNIST(_Torchvision):
    """MNIST through ``torchvision.datasets.MNIST``: 28x28 grey digits, 60000/10000.

    Files are looked for under ``root`` (torchvision's layout, ``<root>/MNIST/raw/``) and
    downloaded there if missing and ``download`` is true.
    """

    name = "mnist"
    tv_name = "MNIST"
    display = "MNIST"
    folder = "MNIST/raw"


class FashionMNIST(_Torchvision):
    """Fashion-MNIST through ``torchvision.datasets.FashionMNIST`` (``<root>/FashionMNIST/raw/``)."""

    name = "fashion_mnist"
    tv_name = "FashionMNIST"
    display = "FashionMNIST"
    folder = "FashionMNIST/raw"


class CIFAR10(_Torchvision):
    """CIFAR-10 through ``torchvision.datasets.CIFAR10`` (``<root>/cifar-10-batches-py/``).

    torchvision verifies every batch file's md5 when loading, so only the official files load.
    """

    name = "cifar10"
    tv_name = "CIFAR10"
    display = "CIFAR-10"
    folder = "cifar-10-batches-py"


class CIFAR100(_Torchvision):
    """CIFAR-100 (fine labels) through ``torchvision.datasets.CIFAR100``
    (``<root>/cifar-100-python/``); files are md5-verified by torchvision."""

    name = "cifar100"
    tv_name = "CIFAR100"
    display = "CIFAR-100"
    folder = "cifar-100-python"


EMNIST_SPLITS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")


@define
class EMNISTParams:
    root: str = field(default="~/.cache/pfl/data", metadata={
        "doc": "where torchvision's files are (torchvision's layout; ~ expanded)"})
    download: bool = field(default=True, metadata={"doc": "download into root when missing"})
    split: str = field(default="balanced", validator=one_of(*EMNIST_SPLITS), metadata={
        "doc": "the EMNIST split (letters' labels are shifted to 0..25)"})


class EMNIST(_Torchvision):
    """EMNIST through ``torchvision.datasets.EMNIST`` (``<root>/EMNIST/raw/``), one ``split``.

    torchvision keeps EMNIST's images transposed; they are transposed back so characters are
    upright like MNIST's. The "letters" split's labels run 1..26 with an unused class 0
    ("N/A") in torchvision; here they are shifted to 0..25 (classes "a".."z") so that no class
    is empty.
    """

    name = "emnist"
    Params = EMNISTParams
    tv_name = "EMNIST"
    display = "EMNIST"
    folder = "EMNIST/raw"

    def _open(self, root: str, train: bool, download: bool):
        import torchvision.datasets as tvd

        return tvd.EMNIST(root, split=self.params.split, train=train, download=download)

    def _to_raw(self, train, test) -> RawDataset:
        classes = [str(c) for c in train.classes]
        y_train = self._array(train.targets, np.int64)
        y_test = self._array(test.targets, np.int64)
        if self.params.split == "letters":
            classes = classes[1:]
            y_train, y_test = y_train - 1, y_test - 1
        raw = RawDataset(
            x_train=np.ascontiguousarray(self._array(train.data, np.uint8).transpose(0, 2, 1)),
            y_train=y_train,
            x_test=np.ascontiguousarray(self._array(test.data, np.uint8).transpose(0, 2, 1)),
            y_test=y_test,
            num_classes=len(classes),
            class_names=classes,
        )
        return raw.validate(f"EMNIST ({self.params.split})")
