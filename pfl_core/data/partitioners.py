"""Partition schemes: which samples of the pool each client holds.

Every scheme is a :class:`~pfl_core.data.base.PartitionerPlugin`. ``split`` receives the
labels (and domain labels, if any) of the positions to partition and a seeded
``numpy.random.Generator``; it returns one int64 array of positions per client, sorted,
disjoint, and not necessarily covering every position. Everything is deterministic given the
generator's state.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from attrs import define, field

from pfl_core.data.base import PartitionerPlugin
from pfl_core.errors import SpecError
from pfl_core.spec import at_least, between, finite, greater_than

__all__ = [
    "IID",
    "Dirichlet",
    "Pathological",
    "Domain",
    "Hybrid",
    "GroupDirichlet",
    "split_by_proportions",
    "pathological_split",
]


# ---------------------------------------------------------------------------
# Shared helpers


def split_by_proportions(positions: np.ndarray, proportions) -> list[np.ndarray]:
    """Cut ``positions`` (in the given order) into consecutive chunks of the given proportions.

    Chunk sizes are ``floor(cumsum(p) * n)`` differences, the cut used by Hsu et al. (2019)
    for Dirichlet label skew; equal proportions give sizes that differ by at most one.
    """
    positions = np.asarray(positions, dtype=np.int64)
    p = np.asarray(proportions, dtype=np.float64)
    total = p.sum()
    if len(p) == 0:
        return []
    if total <= 0:  # degenerate proportions: nothing to anyone but the first
        p = np.zeros_like(p)
        p[0] = 1.0
        total = 1.0
    cuts = np.floor(np.cumsum(p)[:-1] / total * len(positions) + 1e-9).astype(np.int64)
    return np.split(positions, cuts)


def _equal(n: int) -> np.ndarray:
    return np.full(n, 1.0 / n)


def _concat_sorted(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts).astype(np.int64, copy=False))


def _min_size(clients: list[list[np.ndarray]]) -> int:
    return min(sum(len(p) for p in parts) for parts in clients)


def _retry_error(max_tries: int, min_samples: int) -> SpecError:
    return SpecError(
        "partition.params.alpha",
        f"after {max_tries} tries some client still had fewer than {min_samples} samples: "
        "raise alpha, lower partition.min_samples or use fewer clients",
    )


def _check_enough_samples(n: int, num_clients: int, min_samples: int) -> None:
    if num_clients * min_samples > n:
        raise SpecError(
            "partition.num_clients",
            f"{num_clients} clients with at least {min_samples} samples each need "
            f"{num_clients * min_samples} samples but only {n} are available: "
            "use fewer clients or lower partition.min_samples",
        )


def _require_domains(domains: Optional[np.ndarray], scheme: str) -> np.ndarray:
    if domains is None:
        raise SpecError(
            "partition.scheme",
            f"the dataset has no domain labels; '{scheme}' needs a dataset with domains "
            "(e.g. an npz file with domain_train/domain_test) or use another scheme",
        )
    return np.asarray(domains)


def pathological_split(
    labels: np.ndarray,
    positions: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    where: str = "the dataset",
) -> list[np.ndarray]:
    """Each of ``num_clients`` clients holds exactly ``classes_per_client`` distinct classes.

    ``labels`` are the labels of ``positions``; the classes dealt out are those present in
    ``labels``. Client i takes the classes at places ``i*k .. i*k+k-1`` (cyclically) of a
    seeded permutation of them, so every class is held by as equal a number of clients as
    possible (counts differ by at most one). Each class's samples are shuffled and cut into
    equal shards, one per client holding it. ``where`` names the subset in error messages
    (e.g. "domain 2").
    """
    k = classes_per_client
    present = np.unique(labels)
    if k > len(present):
        raise SpecError(
            "partition.params.classes_per_client",
            f"{k} classes per client but {where} has {len(present)} classes",
        )
    order = present[rng.permutation(len(present))]
    holders: dict[int, list[int]] = {int(c): [] for c in present}
    for client in range(num_clients):
        for j in range(k):
            holders[int(order[(client * k + j) % len(present)])].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in present:
        held_by = holders[int(cls)]
        if not held_by:
            continue
        idx = positions[labels == cls]
        if len(idx) < len(held_by):
            raise SpecError(
                "partition.num_clients",
                f"class {cls} has {len(idx)} samples in {where} but {len(held_by)} clients "
                "must hold it: use fewer clients or fewer classes_per_client",
            )
        shards = split_by_proportions(rng.permutation(idx), _equal(len(held_by)))
        for client, shard in zip(held_by, shards):
            parts[client].append(shard)
    return [_concat_sorted(p) for p in parts]


# ---------------------------------------------------------------------------
# Plugins


class IID(PartitionerPlugin):
    """Shuffle the pool and deal it out as evenly as possible (sizes differ by at most one)."""

    name = "iid"

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        perm = rng.permutation(len(labels))
        return [np.sort(p) for p in split_by_proportions(perm, _equal(num_clients))]


@define
class DirichletParams:
    alpha: float = field(default=0.5, validator=[finite, greater_than(0)], metadata={
        "doc": "per class, client proportions ~ Dir(alpha); smaller is more skewed"})
    max_tries: int = field(default=100, validator=at_least(1), metadata={
        "doc": "resampling attempts until every client has partition.min_samples"})


class Dirichlet(PartitionerPlugin):
    """Label skew of Hsu et al. (2019) / Yurochkin et al. (2019).

    For every class c, proportions p_c ~ Dir(alpha, ..., alpha) over the clients; the class's
    shuffled samples are cut in those proportions. Smaller alpha: more skew. The proportions
    are resampled (up to ``max_tries`` times) until every client holds at least
    ``partition.min_samples`` samples.
    """

    name = "dirichlet"
    Params = DirichletParams

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        labels = np.asarray(labels)
        _check_enough_samples(len(labels), num_clients, min_samples)
        by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        alpha = np.full(num_clients, self.params.alpha)
        for _ in range(self.params.max_tries):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for idx in by_class:
                if len(idx) == 0:
                    continue
                for client, chunk in enumerate(split_by_proportions(idx, rng.dirichlet(alpha))):
                    parts[client].append(chunk)
            if _min_size(parts) >= min_samples:
                return [_concat_sorted(p) for p in parts]
        raise _retry_error(self.params.max_tries, min_samples)


@define
class PathologicalParams:
    classes_per_client: int = field(default=2, validator=at_least(1), metadata={
        "doc": "every client holds exactly this many classes, equal shards per class"})


class Pathological(PartitionerPlugin):
    """McMahan et al.'s pathological non-IID split: each client holds exactly k classes.

    Class assignment cycles through a seeded permutation of the classes (client i gets the
    classes at places i*k .. i*k+k-1, wrapping around), so every class is held by as equal a
    number of clients as possible; each class's samples are split into equal shards among
    the clients holding it. The classes dealt out are those present among the samples being
    partitioned. With ``num_clients * k`` smaller than the number of classes some classes are
    held by nobody and left out.
    """

    name = "pathological"
    Params = PathologicalParams

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        labels = np.asarray(labels)
        positions = np.arange(len(labels), dtype=np.int64)
        return pathological_split(labels, positions, num_clients, self.params.classes_per_client, rng)


class Domain(PartitionerPlugin):
    """Feature shift: client i belongs to domain i % D (round robin over the sorted domain
    indices) and each domain's samples are split IID among its clients. Needs domain labels
    and at least one client per domain. With the ``synthetic`` dataset (domain = device) and
    ``num_clients = num_devices`` this is FedProx's own partition.
    """

    name = "domain"

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        domains = _require_domains(domains, self.name)
        values = np.unique(domains)
        num_domains = len(values)
        if num_clients < num_domains:
            raise SpecError(
                "partition.num_clients",
                f"{num_clients} clients but the dataset has {num_domains} domains: "
                f"use at least {num_domains} clients (client i gets domain i % {num_domains})",
            )
        out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_clients
        for d_index, value in enumerate(values):
            members = list(range(d_index, num_clients, num_domains))
            idx = rng.permutation(np.flatnonzero(domains == value))
            for client, chunk in zip(members, split_by_proportions(idx, _equal(len(members)))):
                out[client] = np.sort(chunk)
        return out


@define
class HybridParams:
    classes_per_client: int = field(default=2, validator=at_least(1), metadata={
        "doc": "classes per client within its domain (num_clients / D clients per domain, pathological "
               "within each)"})


class Hybrid(PartitionerPlugin):
    """Feature shift plus label skew (FedMosaic's hybrid setting).

    ``num_clients`` must be a multiple of the number of domains D; with
    ``m = num_clients / D`` clients per domain, client i belongs to domain i // m, and each
    domain's samples are split among its m clients by the pathological scheme
    (``classes_per_client`` of the domain's classes each; same function as ``pathological``).
    """

    name = "hybrid"
    Params = HybridParams

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        labels = np.asarray(labels)
        domains = _require_domains(domains, self.name)
        values = np.unique(domains)
        num_domains = len(values)
        if num_clients % num_domains != 0:
            raise SpecError(
                "partition.num_clients",
                f"{num_clients} clients cannot be shared equally among the dataset's "
                f"{num_domains} domains: use a multiple of {num_domains}",
            )
        per_domain = num_clients // num_domains
        out: list[np.ndarray] = []
        for value in values:
            positions = np.flatnonzero(domains == value).astype(np.int64)
            out.extend(
                pathological_split(
                    labels[positions], positions, per_domain,
                    self.params.classes_per_client, rng, where=f"domain {value}",
                )
            )
        return out


@define
class GroupDirichletParams:
    groups: int = field(default=5, validator=at_least(1), metadata={
        "doc": "disjoint class groups; client i is in group i % groups. At most the number of classes "
               "and of clients (checked when partitioning)"})
    alpha: float = field(default=5.0, validator=[finite, greater_than(0)],
                         metadata={"doc": "Dirichlet concentration within a group"})
    shared: float = field(default=0.1, validator=between(0, 1, high_open=True), metadata={
        "doc": "share of every client's samples pooled and dealt back uniformly to all clients"})
    max_tries: int = field(default=100, validator=at_least(1), metadata={
        "doc": "resampling attempts until every client has partition.min_samples"})


class GroupDirichlet(PartitionerPlugin):
    """COSMOS's "group Dirichlet" partition.

    1. The classes are split into ``groups`` disjoint groups (a seeded permutation cut as
       evenly as possible) and client i is assigned to group i % groups.
    2. Each class's samples are split among its group's clients by Dirichlet(``alpha``).
    3. A fraction ``shared`` of every client's samples (rounded per client) is pooled,
       shuffled and dealt back uniformly to all clients (equal shares, a seeded choice of
       which clients get one more), so every client sees a little of every group.

    Step 2 is resampled (up to ``max_tries`` times) until every client ends with at least
    ``partition.min_samples`` samples. After ``split`` the attributes ``true_groups``
    (client -> group, an int array) and ``class_groups`` (group -> array of its classes)
    hold the ground truth, e.g. to score a clustering. With ``shared = 0`` each client holds
    only its group's classes. Steps 1-2 draw from the generator before step 3 does, so with
    the same seed (and no resampling) ``shared = 0`` gives exactly the partition that step 3
    then mixes.
    """

    name = "group_dirichlet"
    Params = GroupDirichletParams

    def __init__(self, params=None):
        super().__init__(params)
        self.true_groups: Optional[np.ndarray] = None
        self.class_groups: Optional[list[np.ndarray]] = None

    def split(self, labels, domains, num_clients, num_classes, rng, *, min_samples=1):
        labels = np.asarray(labels)
        p = self.params
        if p.groups > num_classes:
            raise SpecError(
                "partition.params.groups",
                f"{p.groups} groups but the dataset has only {num_classes} classes: "
                f"use at most {num_classes} groups",
            )
        if num_clients < p.groups:
            raise SpecError(
                "partition.num_clients",
                f"{num_clients} clients for {p.groups} groups: use at least {p.groups} "
                "clients or fewer partition.params.groups",
            )
        _check_enough_samples(len(labels), num_clients, min_samples)
        class_groups = [np.sort(g) for g in np.array_split(rng.permutation(num_classes), p.groups)]
        true_groups = np.arange(num_clients) % p.groups
        members = [np.flatnonzero(true_groups == g) for g in range(p.groups)]
        by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        for _ in range(p.max_tries):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for g, classes in enumerate(class_groups):
                alpha = np.full(len(members[g]), p.alpha)
                for cls in classes:
                    if len(by_class[cls]) == 0:
                        continue
                    chunks = split_by_proportions(by_class[cls], rng.dirichlet(alpha))
                    for client, chunk in zip(members[g], chunks):
                        parts[client].append(chunk)
            clients = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in parts]
            if p.shared > 0:
                clients = self._redistribute(clients, p.shared, rng)
            if min(len(c) for c in clients) >= min_samples:
                self.true_groups = true_groups
                self.class_groups = class_groups
                return [np.sort(c.astype(np.int64, copy=False)) for c in clients]
        raise _retry_error(p.max_tries, min_samples)

    @staticmethod
    def _redistribute(clients: list[np.ndarray], shared: float, rng) -> list[np.ndarray]:
        kept, pooled = [], []
        for positions in clients:
            positions = rng.permutation(positions)
            n_out = int(round(shared * len(positions)))
            kept.append(positions[n_out:])
            pooled.append(positions[:n_out])
        pool = rng.permutation(np.concatenate(pooled)) if pooled else np.zeros(0, np.int64)
        m = len(clients)
        # Equal shares; which clients get the extra sample of an uneven split is seeded.
        order = rng.permutation(m)
        shares = split_by_proportions(pool, _equal(m))
        out = list(kept)
        for slot, client in enumerate(order):
            out[client] = np.concatenate([out[client], shares[slot]])
        return out
