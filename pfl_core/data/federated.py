"""From a spec to per-client tensors: load, carve the public set, partition, split, convert.

The *pool* is the dataset's training split, followed by its official test split when
``data.include_test`` is true; every index in this module is a position in the pool. Each
pool sample belongs to at most one client or to the public set U.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import attrs
import numpy as np
import torch

from pfl_core.data.base import DatasetPlugin, PartitionerPlugin, RawDataset
from pfl_core.data.splits import TUNING_POOL_SEED, apportion, stratified_split, tuning_pool_mask
from pfl_core.errors import PflError, SpecError
from pfl_core.registry import DATASET, PARTITIONER, instantiate
from pfl_core.seeding import numpy_rng

__all__ = [
    "ClientData",
    "PublicData",
    "FederatedData",
    "build_federated_data",
    "apportion",
    "stratified_split",
    "tuning_pool_mask",
    "TUNING_POOL_SEED",
]

SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------
# Containers


@attrs.define(eq=False)
class ClientData:
    """One client's data. x are float32 tensors, y int64; ``indices`` maps each split name
    ("train", "val", "test") to the pool positions of its samples (same order as the
    tensors). ``domain`` is the domain all the client's samples share, else None."""

    id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    indices: dict[str, np.ndarray]
    domain: Optional[int] = None
    num_classes: Optional[int] = None  # the dataset's, so label_counts() has an entry per class

    @property
    def num_train(self) -> int:
        return int(self.train_y.shape[0])

    def label_counts(self, split: str = "train", num_classes: Optional[int] = None) -> np.ndarray:
        """Samples per class in ``split``: one entry per class of the dataset (``num_classes``
        of them, by default the run's), zeros for the classes this client lacks."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        y = getattr(self, f"{split}_y").detach().cpu().numpy()
        return np.bincount(y, minlength=num_classes or self.num_classes or 0).astype(np.int64)


@attrs.define(eq=False)
class PublicData:
    """The public set U: inputs ``x`` and their pool ``indices``.

    ``y`` holds the labels only when ``public.labelled`` is true, else None; plugins must
    only ever read ``y``. ``true_y`` always holds the labels, for analysis and reporting
    (e.g. the accuracy of a consensus labelling), never for training.
    """

    x: torch.Tensor
    y: Optional[torch.Tensor]
    indices: np.ndarray
    true_y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])


@attrs.define(eq=False)
class FederatedData:
    """Everything a run needs about its data.

    ``input_shape`` is one sample's tensor shape, e.g. (1, 28, 28) or (60,). ``mean``/``std``
    are the per-channel statistics images were standardised with (None for features).
    ``partitioner`` is the partition plugin after its split (e.g. ``GroupDirichlet`` keeps
    ``true_groups``); ``dataset`` the dataset plugin.
    """

    clients: list[ClientData]
    public: Optional[PublicData]
    num_classes: int
    input_shape: tuple
    class_names: list[str]
    domain_names: Optional[list[str]]
    pool_size: int
    train_size: int = 0
    includes_test: bool = False
    mean: Optional[tuple] = None
    std: Optional[tuple] = None
    partitioner: Optional[PartitionerPlugin] = None
    dataset: Optional[DatasetPlugin] = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def on_demand(self) -> bool:
        """Whether each client's data are generated when asked (``pfl_core.data.ondemand``): then
        nothing that walks every client is affordable (the partition table has no rows, and
        ``indices_artifact`` lists no client: each client's data follow from its id)."""
        return getattr(self.clients, "on_demand", False)

    def mean_num_train(self) -> float:
        """The clients' mean training-split size; for on-demand clients, that of the first
        ``clients.PLANNING_CLIENTS`` (what the executor planner needs, not an exact figure)."""
        clients = self.clients[:self.clients.PLANNING_CLIENTS] if self.on_demand else self.clients
        return sum(c.num_train for c in clients) / max(len(clients), 1)

    def partition_table(self) -> np.ndarray:
        """Clients x classes sample counts over each client's train + val + test."""
        table = np.zeros((0 if self.on_demand else len(self.clients), self.num_classes), dtype=np.int64)
        for i, client in enumerate(self.clients if not self.on_demand else []):
            for split in SPLITS:
                table[i] += client.label_counts(split, self.num_classes)
        return table

    def indices_artifact(self) -> dict[str, Any]:
        """The partition as JSON-serialisable data (pool positions per client and of U)."""
        if self.on_demand:
            return {"note": self.clients.NOTE, "pool_size": 0, "clients": [], "public": None}
        return {
            "note": (
                "Indices are positions in the pool: the dataset's train split (positions "
                f"0..{self.train_size - 1})"
                + (
                    f", followed by its test split (positions {self.train_size}.."
                    f"{self.pool_size - 1}), since data.include_test is true"
                    if self.includes_test
                    else "; the test split is not pooled (data.include_test is false)"
                )
            ),
            "pool_size": int(self.pool_size),
            "clients": [
                {
                    "id": int(c.id),
                    **{s: [int(i) for i in c.indices[s]] for s in SPLITS},
                    "domain": None if c.domain is None else int(c.domain),
                }
                for c in self.clients
            ],
            "public": None if self.public is None else [int(i) for i in self.public.indices],
        }

    def pooled_train(self, client_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The training tensors of ``client_ids`` (default: all) concatenated in order (x, y)."""
        chosen = self.clients if client_ids is None else [self.clients[i] for i in client_ids]
        return torch.cat([c.train_x for c in chosen]), torch.cat([c.train_y for c in chosen])


# ---------------------------------------------------------------------------
# Helpers


class _Pool:
    """The pool's arrays without concatenating train and test (which can be large)."""

    def __init__(self, raw: RawDataset, include_test: bool):
        self.raw = raw
        self.with_test = include_test and raw.x_test is not None
        self.n_train = len(raw.y_train)
        self.size = self.n_train + (len(raw.y_test) if self.with_test else 0)
        self.labels = raw.y_train if not self.with_test else np.concatenate([raw.y_train, raw.y_test])
        self.domains = None
        if raw.domain_train is not None:
            self.domains = (
                raw.domain_train
                if not self.with_test
                else np.concatenate([raw.domain_train, raw.domain_test])
            )

    def take_x(self, positions: np.ndarray) -> np.ndarray:
        x_train = self.raw.x_train
        if not self.with_test:
            return x_train[positions]
        out = np.empty((len(positions),) + x_train.shape[1:], dtype=x_train.dtype)
        in_train = positions < self.n_train
        out[in_train] = x_train[positions[in_train]]
        out[~in_train] = self.raw.x_test[positions[~in_train] - self.n_train]
        return out

    def arrays(self):
        yield self.raw.x_train
        if self.with_test:
            yield self.raw.x_test


def _is_image(x: np.ndarray) -> bool:
    return x.dtype == np.uint8


def _channel_stats(pool: _Pool) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std of the pool's images scaled to [0, 1].

    Computed from a per-channel histogram of the uint8 values, in chunks (no float copy):
    torch.bincount counts uint8 values as they are (numpy's widened them to int64 first, 2.4x
    slower); the counts, and so the mean and std, are exact either way.
    """
    x0 = pool.raw.x_train
    channels = 1 if x0.ndim == 3 else x0.shape[-1]
    hist = np.zeros((channels, 256), dtype=np.int64)
    for x in pool.arrays():
        flat = x.reshape(-1, channels)
        step = 1 << 22
        for start in range(0, len(flat), step):
            for c in range(channels):
                values = np.array(flat[start : start + step, c], copy=True)  # contiguous, writable
                hist[c] += torch.bincount(torch.from_numpy(values), minlength=256).numpy()
    hist = hist.astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    count = hist.sum(axis=1)
    mean = hist @ values / count
    var = hist @ values**2 / count - mean**2
    std = np.sqrt(np.maximum(var, 0.0))
    std[std < 1e-6] = 1.0  # a constant channel is left centred, not blown up
    return mean, std


def _to_tensor(x: np.ndarray, mean, std, device) -> torch.Tensor:
    if _is_image(x):
        t = torch.from_numpy(np.ascontiguousarray(x))
        t = t.unsqueeze(1) if t.dim() == 3 else t.permute(0, 3, 1, 2)  # NCHW
        t = t.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)  # one pass: layout and type
        t.sub_(torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        t.div_(torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
    else:
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(device)


def _labels_tensor(y: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)).to(device)


def _resolve_device(device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def _carve_public(spec_public, labels: np.ndarray, num_classes: int, seed: int) -> np.ndarray:
    """Pool positions of U (sorted). See :func:`build_federated_data`."""
    n = len(labels)
    if spec_public.size is not None:
        size, key = spec_public.size, "public.size"
    else:
        size, key = int(round(spec_public.fraction * n)), "public.fraction"
    if size < 1:
        raise SpecError(key, f"gives an empty public set for a pool of {n} samples: raise it")
    if size >= n:
        raise SpecError(
            key,
            f"{size} public samples is not smaller than the training pool of {n} samples: "
            "lower it (the clients need the rest)",
        )
    rng = numpy_rng(seed, "public")
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    avail = np.array([len(i) for i in by_class])
    if spec_public.sampling == "balanced":
        weights = np.ones(num_classes)
    else:  # "dirichlet"
        weights = rng.dirichlet(np.full(num_classes, spec_public.alpha))
    counts = apportion(size, weights, avail, rng)
    chosen = [rng.choice(idx, size=k, replace=False) for idx, k in zip(by_class, counts) if k]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def _check_partition(parts, num_clients: int, n: int, name: str) -> list[np.ndarray]:
    if not isinstance(parts, (list, tuple)) or len(parts) != num_clients:
        got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
        raise PflError(f"partitioner '{name}' returned {got} clients, expected {num_clients}")
    out = []
    for part in parts:
        part = np.asarray(part)
        if part.size and not np.issubdtype(part.dtype, np.integer):
            raise PflError(f"partitioner '{name}' returned non-integer positions ({part.dtype})")
        out.append(part.astype(np.int64).ravel())
    allpos = np.concatenate(out) if out else np.zeros(0, np.int64)
    if allpos.size and (allpos.min() < 0 or allpos.max() >= n):
        raise PflError(f"partitioner '{name}' returned positions outside [0, {n})")
    if len(np.unique(allpos)) != len(allpos):
        raise PflError(f"partitioner '{name}' gave some sample to two clients (or twice)")
    return out


# ---------------------------------------------------------------------------
# The builder


def build_federated_data(spec, device: Union[str, torch.device] = "cpu", stand_ins=None) -> FederatedData:
    """Load ``spec.data``, carve ``spec.public``, partition by ``spec.partition``, convert.

    Steps, all deterministic from ``spec.experiment.seed``:

    1. Load the dataset plugin; the pool is its train split (+ its test split if
       ``data.include_test`` and it has one).
    2. If ``spec.public`` is set, carve U first: ``public.size`` samples, or
       ``round(public.fraction * pool size)``. "balanced" takes equal counts per class (as
       equal as possible; a class with too few samples gives all it has and the shortfall is
       taken from the other classes, evenly); "dirichlet" draws class proportions
       ~ Dir(public.alpha) and samples without replacement (shortfalls likewise go to the
       other classes in proportion). U is disjoint from every client.
    3. Partition the rest with the partition plugin (generator derived from (seed,
       "partition")); every client must hold at least ``partition.min_samples`` samples.
    4. Split each client's samples into train/val/test by :func:`stratified_split` with a
       generator derived from (seed, "split", client id). With ``partition.tuning_pool`` (set
       by ``[tune]``), the tuning pool (:func:`tuning_pool_mask`, the same for every seed) is
       kept out of every test split, and a tuning trial (``partition.tuning_trial``) draws its
       validation split from the pool alone: no sample a trial validates on is in the test
       split of any run of the study, whatever its seed. Without it the splits are as before.
    5. Images (uint8) become float32 in [0, 1], NCHW, standardised per channel with the whole
       pool's mean/std; float features are left as they are. Only the selected samples are
       converted (no float copy of the whole pool is made).

    ``stand_ins(num_classes, input_shape)``, when given, gives every client's data in place of
    steps 3-4 (a Flower run whose nodes all hold their own split: nothing is partitioned).
    """
    seed = spec.experiment.seed
    device = _resolve_device(device)
    dataset = instantiate(DATASET, spec.data.name, spec.data.params, "data.name", "data.params")
    partitioner = instantiate(
        PARTITIONER, spec.partition.scheme, spec.partition.params, "partition.scheme", "partition.params"
    )
    if hasattr(dataset, "federated_data"):  # each client's data generated on demand (pfl_core/data/ondemand.py)
        return dataset.federated_data(spec, partitioner, device)
    raw = dataset.load().validate(f"data.name: dataset '{spec.data.name}'")
    pool = _Pool(raw, spec.data.include_test)
    num_classes = raw.num_classes

    # data.subsample: a seeded uniform subset of the pool stands in for the whole of it.
    universe = np.arange(pool.size, dtype=np.int64)
    if spec.data.subsample is not None and spec.data.subsample < pool.size:
        picked = numpy_rng(seed, "subsample").choice(pool.size, size=spec.data.subsample, replace=False)
        universe = np.sort(picked).astype(np.int64)

    public_pos = None
    if spec.public is not None:
        public_pos = universe[_carve_public(spec.public, pool.labels[universe], num_classes, seed)]
    if public_pos is None:
        remaining = universe
    else:
        keep = np.zeros(pool.size, dtype=bool)
        keep[universe] = True
        keep[public_pos] = False
        remaining = np.flatnonzero(keep).astype(np.int64)

    image = _is_image(raw.x_train)
    mean = std = None
    if image:
        mean, std = _channel_stats(pool)

    if stand_ins is not None:  # each client's data is on its own node (Flower, data-path): no partition here
        sample_shape = tuple(_to_tensor(pool.take_x(universe[:1]), mean, std, device).shape[1:])
        clients, partitioner = stand_ins(num_classes, sample_shape), None
    else:
        clients = _partitioned_clients(spec, pool, remaining, partitioner, num_classes, mean, std, device)
        sample_shape = tuple(clients[0].train_x.shape[1:])

    public = None
    if public_pos is not None:
        true_y = _labels_tensor(pool.labels[public_pos], device)
        public = PublicData(
            x=_to_tensor(pool.take_x(public_pos), mean, std, device),
            y=true_y.clone() if spec.public.labelled else None,
            indices=public_pos,
            true_y=true_y,
        )

    return FederatedData(
        clients=clients,
        public=public,
        num_classes=num_classes,
        input_shape=sample_shape,
        class_names=list(raw.class_names) if raw.class_names else [str(c) for c in range(num_classes)],
        domain_names=list(raw.domain_names) if raw.domain_names else None,
        pool_size=pool.size,
        train_size=pool.n_train,
        includes_test=pool.with_test,
        mean=None if mean is None else tuple(float(v) for v in mean),
        std=None if std is None else tuple(float(v) for v in std),
        partitioner=partitioner,
        dataset=dataset,
    )


def _partitioned_clients(spec, pool: _Pool, remaining: np.ndarray, partitioner, num_classes: int, mean, std,
                         device) -> list[ClientData]:
    """Steps 3-5 of :func:`build_federated_data` for the samples left after the public set."""
    seed = spec.experiment.seed
    num_clients = spec.partition.num_clients
    min_samples = spec.partition.min_samples
    if num_clients > len(remaining):  # before a partitioner allocates per client
        raise SpecError(
            "partition.num_clients",
            f"{num_clients} clients but only {len(remaining)} samples to partition (after data.subsample and the "
            f"public set): every client needs at least partition.min_samples = {min_samples}; use fewer clients",
        )
    parts = partitioner.split(
        pool.labels[remaining],
        None if pool.domains is None else pool.domains[remaining],
        num_clients,
        num_classes,
        numpy_rng(seed, "partition"),
        min_samples=min_samples,
    )
    parts = _check_partition(parts, num_clients, len(remaining), spec.partition.scheme)
    for i, part in enumerate(parts):
        if len(part) < min_samples:
            raise SpecError(
                "partition.min_samples",
                f"client {i} received {len(part)} samples, fewer than {min_samples}: use fewer "
                "clients, a larger alpha, or lower partition.min_samples",
            )

    in_tuning_pool = None
    if spec.partition.tuning_pool is not None:
        in_tuning_pool = tuning_pool_mask(pool.labels, spec.partition.tuning_pool)

    clients = []
    for i, part in enumerate(parts):
        positions = np.sort(remaining[part])
        labels = pool.labels[positions]
        masks = {}
        if in_tuning_pool is not None:
            masks = ({"val_from": in_tuning_pool[positions]} if spec.partition.tuning_trial
                     else {"test_from": ~in_tuning_pool[positions]})
        tr, va, te = stratified_split(
            labels, spec.partition.val_fraction, spec.partition.test_fraction,
            numpy_rng(seed, "split", client=i), **masks,
        )
        if len(te) == 0 and in_tuning_pool is not None and not spec.partition.tuning_trial:
            raise SpecError(
                "partition.tuning_pool",
                f"client {i} has {len(positions)} samples but none outside the tuning pool can go to its "
                "test split (each class keeps one for training): lower it or raise partition.min_samples",
            )
        if len(te) == 0:
            raise SpecError(
                "partition.min_samples",
                f"client {i} has {len(positions)} samples but no class with two or more, so "
                "none can go to its test split: raise partition.min_samples or use fewer clients",
            )
        domain = None
        if pool.domains is not None:
            doms = np.unique(pool.domains[positions])
            domain = int(doms[0]) if len(doms) == 1 else None
        split_pos = {"train": positions[tr], "val": positions[va], "test": positions[te]}
        tensors = {}
        for name, pos in split_pos.items():
            tensors[f"{name}_x"] = _to_tensor(pool.take_x(pos), mean, std, device)
            tensors[f"{name}_y"] = _labels_tensor(pool.labels[pos], device)
        clients.append(ClientData(id=i, indices=split_pos, domain=domain, num_classes=num_classes, **tensors))

    return clients
