"""Datasets whose clients' data are generated on demand, each client's from (the dataset's seed,
its id) alone (issue 37: a million clients): the plugin base class, the clients' sequence that
builds a client when it is asked for, and FedProx's synthetic data made that way."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from attrs import define, field

from pfl_core.data.base import DatasetPlugin, RawDataset
from pfl_core.data.datasets import Synthetic
from pfl_core.data.federated import SPLITS, ClientData, FederatedData, _labels_tensor, _to_tensor
from pfl_core.data.splits import stratified_split
from pfl_core.errors import DataError, SpecError
from pfl_core.seeding import numpy_rng
from pfl_core.spec import at_least, finite

__all__ = ["OnDemandClients", "OnDemandDatasetPlugin", "SyntheticClients"]


class OnDemandDatasetPlugin(DatasetPlugin):
    """A dataset whose clients' data are generated on demand, each client's from (the dataset's
    own seed, the client's id) alone: nothing per client is held for all clients, so a run can
    have a million of them (:func:`pfl_core.data.federated.build_federated_data` gives such a
    run an :class:`OnDemandClients` in place of a list of clients).

    There is no pool to partition: client ``i`` is the dataset's ``i``-th generating device
    (``partition.scheme = "domain"``, ``partition.num_clients`` of them). Subclasses give
    ``num_classes`` and ``client_arrays``."""

    def num_classes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def client_arrays(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        """Client ``client_id``'s samples: float32 features (n, ...) and int64 labels (n,); the
        same arrays every time, in every process."""
        raise NotImplementedError

    def load(self) -> RawDataset:
        raise DataError(f"data.name: dataset '{self.name}' generates each client's data on demand and has no "
                        "pool of samples to load")

    def federated_data(self, spec, partitioner, device: torch.device) -> FederatedData:
        """What :func:`~pfl_core.data.federated.build_federated_data` builds for this dataset."""
        return _build_on_demand(spec, self, partitioner, device)


class OnDemandClients(Sequence):
    """The clients of an :class:`OnDemandDatasetPlugin`: ``clients[i]`` is
    client ``i``'s :class:`ClientData`, built when asked from the dataset's arrays for ``i`` and
    split as any client's (:func:`stratified_split`, generator (seed, "split", i)). The
    ``cache_size`` most recently used are kept; nothing is held per client for all clients, so
    a million clients cost what the few in use do. ``indices`` are positions in the client's
    own samples. Pickled without its cache (a worker builds the same clients again)."""

    on_demand = True  # FederatedData.on_demand
    NOTE = ("each client's data are generated on demand from its id (the dataset's client_arrays), split into "
            "train/val/test by the generator (experiment.seed, 'split', client id); indices are positions in "
            "the client's own samples")
    CACHE_SIZE = 256  # about a round's participants at 0.1% of 256,000 clients; a hit saves one generation
    PLANNING_CLIENTS = 16  # clients the executor planner looks at (FederatedData.mean_num_train)

    def __init__(self, dataset: OnDemandDatasetPlugin, num_clients: int, spec_partition, seed: int,
                 device: torch.device, cache_size: int = CACHE_SIZE):
        self.dataset = dataset
        self.num_clients = num_clients
        self.val_fraction = spec_partition.val_fraction
        self.test_fraction = spec_partition.test_fraction
        self.min_samples = spec_partition.min_samples
        self.seed = seed
        self.device = device
        self.cache_size = cache_size
        self._cache: OrderedDict[int, ClientData] = OrderedDict()
        self.built = 0  # clients built (cache misses): for tests and benchmarks

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, client_id):
        if isinstance(client_id, slice):
            return [self[i] for i in range(self.num_clients)[client_id]]
        index = int(client_id)
        if index < 0:
            index += self.num_clients
        if not 0 <= index < self.num_clients:
            raise IndexError(f"client {client_id} of {self.num_clients}")
        client = self._cache.get(index)
        if client is None:
            client = self._cache[index] = self._build(index)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(index)
        return client

    def _build(self, client_id: int) -> ClientData:
        x, y = self.dataset.client_arrays(client_id)
        self.built += 1
        if len(y) < self.min_samples:
            raise SpecError("partition.min_samples", f"client {client_id} has {len(y)} samples (data.name "
                                                     f"'{self.dataset.name}'), fewer than {self.min_samples}")
        split = stratified_split(y, self.val_fraction, self.test_fraction,
                                 numpy_rng(self.seed, "split", client=client_id))
        if len(split[2]) == 0:
            raise SpecError("partition.min_samples", f"client {client_id} has {len(y)} samples but no class with "
                                                     "two or more, so none can go to its test split")
        tensors = {}
        for name, pos in zip(SPLITS, split):
            tensors[f"{name}_x"] = _to_tensor(x[pos], None, None, self.device)
            tensors[f"{name}_y"] = _labels_tensor(y[pos], self.device)
        return ClientData(id=client_id, indices=dict(zip(SPLITS, split)), domain=client_id,
                          num_classes=self.dataset.num_classes(), **tensors)

    def __getstate__(self):
        return {**self.__dict__, "_cache": OrderedDict()}


def _build_on_demand(spec, dataset: OnDemandDatasetPlugin, partitioner, device) -> FederatedData:
    """:func:`build_federated_data` for a dataset that generates each client's data on demand:
    nothing is built per client until a client is asked for (client 0 is, for the input shape)."""
    refused = {"partition.scheme": spec.partition.scheme != "domain", "data.subsample": spec.data.subsample is not None,
               "public": spec.public is not None, "partition.tuning_pool": spec.partition.tuning_pool is not None}
    for key, given in refused.items():
        if given:
            raise SpecError(key, f"data.name '{spec.data.name}' generates each client's data on demand (one client "
                                 "per generating device, partition.scheme = \"domain\"), so "
                                 + ("it takes no other scheme" if key == "partition.scheme" else
                                    "it has no pool to subsample, carve a public set or a tuning pool from"))
    check_sizes = getattr(dataset, "check_sizes", None)
    if check_sizes is not None:
        check_sizes()
    clients = OnDemandClients(dataset, spec.partition.num_clients, spec.partition, spec.experiment.seed, device)
    num_classes = dataset.num_classes()
    return FederatedData(
        clients=clients,
        public=None,
        num_classes=num_classes,
        input_shape=tuple(clients[0].train_x.shape[1:]),
        class_names=[str(c) for c in range(num_classes)],
        domain_names=None,
        pool_size=0,
        partitioner=partitioner,
        dataset=dataset,
    )


# ---------------------------------------------------------------------------
# FedProx's Synthetic(alpha, beta), client by client


@define
class SyntheticClientsParams:
    alpha: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "how much the clients' labelling models differ (FedProx's Synthetic(alpha, beta))"})
    beta: float = field(default=1.0, validator=[finite, at_least(0)],
                        metadata={"doc": "how much the clients' inputs differ"})
    samples_per_client: int = field(default=300, validator=at_least(1),
                                    metadata={"doc": "samples generated per client"})
    dim: int = field(default=60, validator=at_least(1), metadata={"doc": "feature dimension"})
    num_classes: int = field(default=10, validator=at_least(2), metadata={"doc": "number of classes"})
    seed: int = field(default=0, validator=at_least(0), metadata={
        "doc": "the generator's own seed (the data stay fixed while experiment.seed varies)"})


class SyntheticClients(OnDemandDatasetPlugin):
    """FedProx's Synthetic(alpha, beta), each client's data generated when it is needed.

    Client ``i`` is a generating device of :class:`Synthetic` (the same distributions: u, B, v,
    W, b and x as there), drawn from a generator seeded by (``seed``, ``i``) alone, so the same
    client gets the same data in every process, and nothing per client is kept for all clients:
    a run can have a million clients (``partition.scheme = "domain"``, one client per device,
    ``partition.num_clients`` of them). Each client's samples are split into train/val/test
    as any client's are. The data differ from :class:`Synthetic`'s of the same seed (one
    generator per client, not one for all devices).
    """

    name = "synthetic_clients"
    Params = SyntheticClientsParams
    MAX_SAMPLE_VALUES = 100_000_000  # samples_per_client * dim: 400 MB of float32 for one client
    MAX_MODEL_VALUES = Synthetic.MAX_MODEL_VALUES

    def check_sizes(self) -> None:
        p = self.params
        if p.samples_per_client * p.dim > self.MAX_SAMPLE_VALUES:
            key = "samples_per_client" if p.samples_per_client > p.dim else "dim"
            raise SpecError(f"{self.spec_path}.params.{key}", f"samples_per_client x dim = {p.samples_per_client} "
                            f"x {p.dim} feature values per client, above the limit of {self.MAX_SAMPLE_VALUES}")
        if p.dim * p.num_classes > self.MAX_MODEL_VALUES:
            raise SpecError(f"{self.spec_path}.params.{'dim' if p.dim > p.num_classes else 'num_classes'}",
                            f"dim x num_classes = {p.dim} x {p.num_classes} = {p.dim * p.num_classes} weights per "
                            f"client, above the limit of {self.MAX_MODEL_VALUES}")
        # as Synthetic's checks, for the largest draws of a million clients (within 10 standard deviations)
        largest_x, largest_w = 10.0 * p.beta + 20.0, 10.0 * p.alpha + 10.0
        if largest_x > float(np.finfo(np.float32).max) or largest_x * largest_w * p.dim > 1e300:
            raise SpecError(f"{self.spec_path}.params.{'beta' if p.beta > p.alpha else 'alpha'}",
                            f"alpha = {p.alpha} and beta = {p.beta} make features or labelling models beyond "
                            "float range; use smaller values")

    def num_classes(self) -> int:
        return self.params.num_classes

    def client_arrays(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        rng = numpy_rng(p.seed, "synthetic_clients", client=int(client_id))
        u = rng.normal(0.0, p.alpha)
        v = rng.normal(rng.normal(0.0, p.beta), 1.0, p.dim)
        w = rng.normal(u, 1.0, (p.dim, p.num_classes))
        b = rng.normal(u, 1.0, p.num_classes)
        scale = np.arange(1, p.dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt(Sigma_jj), as in Synthetic
        x = v + scale * rng.standard_normal((p.samples_per_client, p.dim))
        return x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int64)
