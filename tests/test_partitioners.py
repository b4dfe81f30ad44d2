"""Partition schemes: structure, determinism and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from pfl_core import registry
from pfl_core.data.partitioners import GroupDirichlet, Pathological, split_by_proportions
from pfl_core.errors import SpecError

C = 10


def make_labels(n=2000, num_classes=C, seed=0):
    return np.random.default_rng(seed).permutation(np.arange(n) % num_classes).astype(np.int64)


def make_domains(n=2000, num_domains=4, seed=1):
    return np.random.default_rng(seed).permutation(np.arange(n) % num_domains).astype(np.int64)


def part(name, params=None):
    return registry.instantiate(
        registry.PARTITIONER, name, params or {}, "partition.scheme", "partition.params"
    )


def run(name, params=None, labels=None, domains=None, num_clients=10, seed=0, min_samples=1, num_classes=C):
    labels = make_labels() if labels is None else labels
    p = part(name, params)
    out = p.split(labels, domains, num_clients, num_classes, np.random.default_rng(seed), min_samples=min_samples)
    return p, out


def assert_disjoint(parts, n, cover=True):
    allpos = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert len(np.unique(allpos)) == len(allpos), "a sample went to two clients"
    assert allpos.min() >= 0 and allpos.max() < n
    if cover:
        assert len(allpos) == n, "some samples were dropped"


SCHEMES = [
    ("iid", {}, 10),
    ("dirichlet", {"alpha": 0.3}, 10),
    ("pathological", {"classes_per_client": 2}, 10),
    ("domain", {}, 8),
    ("hybrid", {"classes_per_client": 2}, 20),
    ("group_dirichlet", {"groups": 5, "shared": 0.1}, 10),
]


@pytest.mark.parametrize("name,params,clients", SCHEMES)
def test_disjoint_and_covering(name, params, clients):
    labels, domains = make_labels(), make_domains()
    plugin, parts = run(name, params, labels, domains, num_clients=clients)
    assert len(parts) == clients
    # Pathological/hybrid with num_clients * k >= classes hold every class, so all cover.
    assert_disjoint(parts, len(labels))
    assert type(plugin).name == name


@pytest.mark.parametrize("name,params,clients", SCHEMES)
def test_same_seed_same_partition_other_seed_differs(name, params, clients):
    labels, domains = make_labels(), make_domains()
    _, a = run(name, params, labels, domains, clients, seed=3)
    _, b = run(name, params, labels, domains, clients, seed=3)
    _, c = run(name, params, labels, domains, clients, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_split_by_proportions():
    pos = np.arange(10)
    chunks = split_by_proportions(pos, [0.5, 0.3, 0.2])
    assert [len(c) for c in chunks] == [5, 3, 2]
    equal = split_by_proportions(np.arange(11), np.full(3, 1 / 3))
    assert sorted(len(c) for c in equal) == [3, 4, 4]
    assert np.array_equal(np.concatenate(equal), np.arange(11))


def test_iid_sizes_even():
    _, parts = run("iid", num_clients=7)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 2000


def test_pathological_exactly_k_classes_and_balanced_holders():
    labels = make_labels()
    for k in (1, 2, 3):
        _, parts = run("pathological", {"classes_per_client": k}, labels, num_clients=15)
        holders = np.zeros(C, dtype=int)
        for p in parts:
            classes = np.unique(labels[p])
            assert len(classes) == k
            holders[classes] += 1
        assert holders.max() - holders.min() <= 1
        # Each class's samples are cut into equal shards among its holders.
        for cls in range(C):
            shares = [np.sum(labels[p] == cls) for p in parts if np.any(labels[p] == cls)]
            assert max(shares) - min(shares) <= 1


def test_pathological_too_many_classes():
    labels = make_labels(300, 3)
    with pytest.raises(SpecError) as err:
        run("pathological", {"classes_per_client": 4}, labels, num_clients=3, num_classes=3)
    assert err.value.path == "partition.params.classes_per_client"
    assert "4 classes per client but the dataset has 3 classes" in str(err.value)


def test_pathological_class_too_small():
    labels = np.array([0] * 2 + [1] * 50)
    with pytest.raises(SpecError) as err:
        run("pathological", {"classes_per_client": 1}, labels, num_clients=6, num_classes=2)
    assert err.value.path == "partition.num_clients"


def test_dirichlet_skew_grows_as_alpha_falls():
    labels = make_labels(5000)

    def mean_max_share(alpha):
        _, parts = run("dirichlet", {"alpha": alpha}, labels, num_clients=10)
        return np.mean([np.bincount(labels[p], minlength=C).max() / len(p) for p in parts])

    assert mean_max_share(0.1) > mean_max_share(100.0) + 0.3
    assert mean_max_share(100.0) < 0.2  # close to uniform over 10 classes


def test_dirichlet_min_samples_retry_error():
    labels = make_labels(1000)
    with pytest.raises(SpecError) as err:
        run("dirichlet", {"alpha": 0.01, "max_tries": 3}, labels, num_clients=50, min_samples=15)
    assert err.value.path == "partition.params.alpha"
    assert "after 3 tries" in err.value.message and "fewer than 15 samples" in err.value.message


def test_dirichlet_min_samples_is_honoured():
    labels = make_labels(1000)
    _, parts = run("dirichlet", {"alpha": 0.5}, labels, num_clients=20, min_samples=20)
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_impossible_min_samples():
    with pytest.raises(SpecError) as err:
        run("dirichlet", {}, make_labels(100), num_clients=20, min_samples=10)
    assert err.value.path == "partition.num_clients"


def test_domain_round_robin_and_iid_within_domain():
    labels, domains = make_labels(), make_domains(num_domains=4)
    _, parts = run("domain", {}, labels, domains, num_clients=8)
    for i, p in enumerate(parts):
        assert set(np.unique(domains[p])) == {i % 4}
    for d in range(4):
        sizes = [len(parts[i]) for i in range(8) if i % 4 == d]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == np.sum(domains == d)
    # 9 clients over 4 domains: domain 0 gets clients 0, 4, 8
    _, parts = run("domain", {}, labels, domains, num_clients=9)
    assert [int(np.unique(domains[p])[0]) for p in parts] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_domain_errors():
    with pytest.raises(SpecError) as err:
        run("domain", {}, make_labels(), None, num_clients=4)
    assert err.value.path == "partition.scheme" and "no domain labels" in err.value.message
    with pytest.raises(SpecError) as err:
        run("domain", {}, make_labels(), make_domains(num_domains=4), num_clients=3)
    assert err.value.path == "partition.num_clients"


def test_hybrid_domains_and_classes():
    labels, domains = make_labels(), make_domains(num_domains=4)
    _, parts = run("hybrid", {"classes_per_client": 2}, labels, domains, num_clients=20)
    for i, p in enumerate(parts):
        assert set(np.unique(domains[p])) == {i // 5}
        assert len(np.unique(labels[p])) == 2
    assert_disjoint(parts, len(labels))
    with pytest.raises(SpecError) as err:
        run("hybrid", {}, labels, domains, num_clients=10)
    assert err.value.path == "partition.num_clients" and "multiple of 4" in err.value.message
    with pytest.raises(SpecError) as err:
        run("hybrid", {}, labels, None, num_clients=8)
    assert err.value.path == "partition.scheme"


def test_group_dirichlet_without_sharing_keeps_groups():
    labels = make_labels(3000)
    plugin, parts = run("group_dirichlet", {"groups": 5, "shared": 0.0}, labels, num_clients=25)
    assert isinstance(plugin, GroupDirichlet)
    assert np.array_equal(plugin.true_groups, np.arange(25) % 5)
    groups = plugin.class_groups
    assert sorted(np.concatenate(groups).tolist()) == list(range(C))
    assert all(len(g) == 2 for g in groups)
    for i, p in enumerate(parts):
        assert set(np.unique(labels[p])) <= set(groups[plugin.true_groups[i]].tolist())
    assert_disjoint(parts, len(labels))


def test_group_dirichlet_shares_about_ten_percent():
    labels = make_labels(5000)
    params = {"groups": 5, "alpha": 5.0}
    plugin0, before = run("group_dirichlet", {**params, "shared": 0.0}, labels, num_clients=25, seed=7)
    plugin1, after = run("group_dirichlet", {**params, "shared": 0.1}, labels, num_clients=25, seed=7)
    assert_disjoint(after, len(labels))
    received, foreign = [], []
    for i in range(25):
        own = np.isin(after[i], before[i])
        received.append(1 - own.mean())
        group_classes = plugin1.class_groups[plugin1.true_groups[i]]
        foreign.append(np.mean(~np.isin(labels[after[i]], group_classes)))
        # A client keeps 90% (rounded) of its pre-sharing samples; a few of the pooled ones
        # may come back to it.
        assert own.sum() >= len(before[i]) - round(0.1 * len(before[i]))
    assert 0.06 < np.mean(received) < 0.14
    assert max(received) < 0.25
    # About (groups-1)/groups of the received samples are from other groups' classes.
    assert 0.05 < np.mean(foreign) < 0.11 and min(foreign) > 0


def test_group_dirichlet_errors():
    with pytest.raises(SpecError) as err:
        run("group_dirichlet", {"groups": 11}, make_labels(), num_clients=20)
    assert err.value.path == "partition.params.groups"
    with pytest.raises(SpecError) as err:
        run("group_dirichlet", {"groups": 5}, make_labels(), num_clients=4)
    assert err.value.path == "partition.num_clients"
    with pytest.raises(SpecError) as err:
        run("group_dirichlet", {"alpha": 0.01, "max_tries": 2, "shared": 0.0},
            make_labels(500), num_clients=25, min_samples=15)
    assert err.value.path == "partition.params.alpha"


@pytest.mark.parametrize(
    "name,params,path",
    [
        ("dirichlet", {"alpha": 0}, "partition.params.alpha"),
        ("dirichlet", {"alpha": float("inf")}, "partition.params.alpha"),
        ("dirichlet", {"max_tries": 0}, "partition.params.max_tries"),
        ("dirichlet", {"alpah": 1.0}, "partition.params.alpah"),
        ("pathological", {"classes_per_client": 0}, "partition.params.classes_per_client"),
        ("pathological", {"classes_per_client": "2"}, "partition.params.classes_per_client"),
        ("group_dirichlet", {"shared": 1.0}, "partition.params.shared"),
        ("group_dirichlet", {"groups": 0}, "partition.params.groups"),
        ("iid", {"alpha": 1.0}, "partition.params.alpha"),
        ("dirichlett", {}, "partition.scheme"),
    ],
)
def test_bad_params(name, params, path):
    with pytest.raises(SpecError) as err:
        part(name, params)
    assert err.value.path == path


def test_pathological_reused_by_hybrid():
    # One domain only: hybrid equals pathological applied to that domain (same draws).
    labels = make_labels(1000)
    domains = np.zeros(1000, dtype=np.int64)
    _, hyb = run("hybrid", {"classes_per_client": 2}, labels, domains, num_clients=5, seed=2)
    path = Pathological(Pathological.Params(classes_per_client=2))
    ref = path.split(labels, None, 5, C, np.random.default_rng(2))
    assert all(np.array_equal(a, b) for a, b in zip(hyb, ref))
