"""Base classes of the data layer: the raw dataset and the two plugin kinds that make it.

A *dataset* plugin loads arrays (:class:`RawDataset`); a *partitioner* plugin decides which
samples each client holds. :func:`pfl_core.data.federated.build_federated_data` combines the
two into per-client tensors.
"""

from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

from pfl_core.errors import DataError
from pfl_core.registry import DATASET, PARTITIONER, Plugin


@attrs.define(eq=False)
class RawDataset:
    """Arrays as a dataset plugin returns them.

    ``x_*`` are uint8 images, shape (N, H, W) for grey or (N, H, W, C) for colour, or float
    features of shape (N, D) (any other float array is passed to the model unchanged).
    ``y_*`` are int64 class indices in ``[0, num_classes)``. ``x_test``/``y_test`` are None
    when the dataset has no official test split (clients then split their own data anyway).
    ``domain_*`` are optional int64 domain indices (feature-shift datasets), indexing
    ``domain_names`` when that is given.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: Optional[np.ndarray]
    y_test: Optional[np.ndarray]
    num_classes: int
    domain_train: Optional[np.ndarray] = None
    domain_test: Optional[np.ndarray] = None
    class_names: Optional[list[str]] = None
    domain_names: Optional[list[str]] = None

    def validate(self, source: str = "dataset") -> "RawDataset":
        """Check shapes, dtypes and label ranges; raise a one-line DataError naming ``source``.

        Converts labels and domains to int64 in place. Returns self.
        """

        def fail(msg):
            raise DataError(f"{source}: {msg}")

        if (self.x_test is None) != (self.y_test is None):
            fail("give both x_test and y_test or neither")
        if self.num_classes < 1:
            fail(f"num_classes must be >= 1, got {self.num_classes}")
        splits = [("train", self.x_train, self.y_train, self.domain_train)]
        if self.x_test is not None:
            splits.append(("test", self.x_test, self.y_test, self.domain_test))
        shape = None
        for split, x, y, d in splits:
            x, y = np.asarray(x), np.asarray(y)
            if x.ndim < 2:
                fail(f"x_{split} must have a sample axis and at least one more, got shape {x.shape}")
            if 0 in x.shape[1:]:
                fail(f"x_{split} has empty samples (shape {x.shape}): every sample needs at least one value")
            if x.dtype == np.uint8:
                if x.ndim not in (3, 4):
                    fail(f"uint8 x_{split} must be images (N,H,W) or (N,H,W,C), got shape {x.shape}")
            elif not np.issubdtype(x.dtype, np.floating):
                fail(f"x_{split} must be uint8 images or float features, got dtype {x.dtype}")
            else:
                _check_finite_float32(x, f"x_{split}", fail)
            if split == "test" and len(x) == 0:
                fail("x_test and y_test are empty; leave both out when there is no test split")
            if shape is None:
                shape = x.shape[1:]
            elif x.shape[1:] != shape:
                fail(f"x_train has sample shape {shape} but x_test has {x.shape[1:]}")
            if y.ndim != 1 or len(y) != len(x):
                fail(f"y_{split} must be one label per sample: shape {y.shape} for {len(x)} samples")
            if not np.issubdtype(y.dtype, np.integer):
                fail(f"y_{split} must hold integer class indices, got dtype {y.dtype}")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                fail(f"y_{split} has labels in [{y.min()}, {y.max()}], outside [0, {self.num_classes})")
            if d is not None:
                d = np.asarray(d)
                if d.shape != (len(x),):
                    fail(f"domain_{split} must be one domain index per sample, got shape {d.shape}")
                if not np.issubdtype(d.dtype, np.integer):
                    fail(f"domain_{split} must hold integer domain indices, got dtype {d.dtype}")
                if len(d) and d.min() < 0:
                    fail(f"domain_{split} has domain index {d.min()}; domain indices must be >= 0")
                if len(d) and self.domain_names is not None and d.max() >= len(self.domain_names):
                    fail(f"domain_{split} has domain index {d.max()} but there are {len(self.domain_names)} "
                         "domain names")
        if len(self.x_train) == 0:
            fail("the training split is empty")
        has_train_dom = self.domain_train is not None
        if self.x_test is not None and has_train_dom != (self.domain_test is not None):
            fail("give domain labels for both splits (domain_train and domain_test) or for neither")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            fail(f"{len(self.class_names)} class names for {self.num_classes} classes")
        self.y_train = np.asarray(self.y_train).astype(np.int64, copy=False)
        if self.y_test is not None:
            self.y_test = np.asarray(self.y_test).astype(np.int64, copy=False)
        if self.domain_train is not None:
            self.domain_train = np.asarray(self.domain_train).astype(np.int64, copy=False)
        if self.domain_test is not None:
            self.domain_test = np.asarray(self.domain_test).astype(np.int64, copy=False)
        return self


def _check_finite_float32(x: np.ndarray, name: str, fail) -> None:
    """Features are used as float32: a NaN or infinite value, or one beyond float32's range
    (which becomes infinite), would turn every loss into NaN."""
    finite = np.isfinite(x)
    if not finite.all():
        bad = ~finite
        sample = int(np.argmax(bad.reshape(len(x), -1).any(axis=1)))
        count = int(bad.sum())
        fail(f"{name} has {count} NaN or infinite value{'s' if count > 1 else ''} (the first in sample {sample}); "
             "replace or drop those samples")
    if x.dtype.itemsize > 4 and x.size:
        largest = float(np.abs(x).max())
        if largest > float(np.finfo(np.float32).max):
            fail(f"{name} has values up to {largest:.3g}, beyond float32's range (features are used as "
                 "float32); rescale them")


class DatasetPlugin(Plugin):
    """A dataset: ``load()`` returns a :class:`RawDataset`."""

    kind = DATASET

    def load(self) -> RawDataset:  # pragma: no cover - abstract
        raise NotImplementedError


class PartitionerPlugin(Plugin):
    """A partition scheme: which pool positions each client holds."""

    kind = PARTITIONER

    def split(
        self,
        labels: np.ndarray,
        domains: Optional[np.ndarray],
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        *,
        min_samples: int = 1,
    ) -> list[np.ndarray]:  # pragma: no cover - abstract
        """For each client, an int64 array of positions into ``labels`` (disjoint; need not
        cover every position).

        ``domains`` is None when the dataset has no domain labels. ``min_samples`` is
        ``partition.min_samples``: schemes that can resample retry until every client has at
        least that many samples; the others may ignore it (the core checks it afterwards).
        Problems raise ``SpecError("partition.params.<key>", ...)`` (or ``partition.<key>``).
        """
        raise NotImplementedError
