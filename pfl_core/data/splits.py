"""How each client's samples are split: class-stratified train/val/test splits
(:func:`stratified_split`, whose counts :func:`apportion` deals out) and the tuning pool
(:func:`tuning_pool_mask`) that keeps tuning validation out of every test split. Indices are
positions (in a client's samples, or in the whole pool for the tuning pool)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from pfl_core.seeding import numpy_rng

__all__ = ["apportion", "stratified_split", "tuning_pool_mask", "TUNING_POOL_SEED"]


def apportion(total: int, weights, caps, rng: np.random.Generator) -> np.ndarray:
    """Integer counts summing to ``min(total, sum(caps))``, proportional to ``weights``
    (largest remainder, ties broken by ``rng``), never above ``caps``; what a capped entry
    cannot take goes to the others in proportion to their weights (uniformly if they all
    have weight 0)."""
    weights = np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0, posinf=0.0)
    weights = np.maximum(weights, 0.0)
    caps = np.asarray(caps, dtype=np.int64)
    counts = np.zeros(len(caps), dtype=np.int64)
    remaining = int(min(total, caps.sum()))
    while remaining > 0:
        room = caps - counts
        active = room > 0
        w = np.where(active, weights, 0.0)
        if w.sum() <= 0:
            w = active.astype(np.float64)
        quota = remaining * w / w.sum()
        base = np.minimum(np.floor(quota).astype(np.int64), room)
        left = remaining - int(base.sum())
        if left > 0:
            frac = np.where(room - base > 0, quota - np.floor(quota), -1.0)
            order = np.lexsort((rng.random(len(frac)), -frac))
            order = order[frac[order] >= 0][:left]
            base[order] += 1
        counts += base
        remaining -= int(base.sum())
    return counts


def stratified_split(
    labels: np.ndarray,
    val_fraction: float,
    test_fraction: float,
    rng: np.random.Generator,
    test_from: Optional[np.ndarray] = None,
    val_from: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split positions 0..len(labels)-1 into (train, val, test), stratified by class.

    The test split gets ``max(1, round(n * test_fraction))`` samples and the validation split
    ``round(n * val_fraction)`` (at least 1 when the fraction is > 0), both apportioned over
    the classes in proportion to their counts, so test labels follow the training
    distribution. Every class keeps at least one training sample (a class with one sample
    goes to train), which can make val/test smaller than asked for tiny clients; test is
    empty only if no class has two samples.

    ``test_from`` / ``val_from``: boolean masks of the positions the test / validation split
    may take (None: any); a class with too few such positions gives fewer and the shortfall
    goes to the other classes. Test takes the positions validation may not first, leaving the
    others to it. Without masks the draws are those of a split without them.
    """
    labels = np.asarray(labels)
    n = len(labels)
    classes, counts = np.unique(labels, return_counts=True)
    test_ok = np.ones(n, dtype=bool) if test_from is None else np.asarray(test_from, dtype=bool)
    val_ok = np.ones(n, dtype=bool) if val_from is None else np.asarray(val_from, dtype=bool)
    by_class = lambda mask: np.bincount(np.searchsorted(classes, labels[mask]), minlength=len(classes))  # noqa: E731
    n_test = max(1, int(round(n * test_fraction)))
    test_counts = apportion(n_test, counts, np.minimum(counts - 1, by_class(test_ok)), rng)
    # validation positions test had to take: those beyond the test-only ones of the class
    val_taken = np.maximum(test_counts - by_class(test_ok & ~val_ok), 0)
    n_val = max(1, int(round(n * val_fraction))) if val_fraction > 0 else 0
    val_counts = apportion(n_val, counts, np.minimum(counts - 1 - test_counts, by_class(val_ok) - val_taken), rng)
    train, val, test = [], [], []
    for cls, t, v in zip(classes, test_counts, val_counts):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        testable = idx[test_ok[idx]]
        testable = testable[np.argsort(val_ok[testable], kind="stable")]  # test-only positions first
        test_part = testable[:t]
        rest = idx[~np.isin(idx, test_part)]  # in permuted order
        val_part = rest[val_ok[rest]][:v]
        test.append(test_part)
        val.append(val_part)
        train.append(rest[~np.isin(rest, val_part)])
    cat = lambda parts: np.sort(np.concatenate(parts)).astype(np.int64)  # noqa: E731
    return cat(train), cat(val), cat(test)


TUNING_POOL_SEED = 0  # the tuning pool's seed: fixed, so every experiment seed sees the same pool


def tuning_pool_mask(labels: np.ndarray, fraction: float) -> np.ndarray:
    """Which positions of the whole pool (``labels``: one per position) are in the tuning pool:
    ``round(fraction * n_c)`` samples of each class c, chosen by a generator derived from
    :data:`TUNING_POOL_SEED` alone, so the pool is the same for every experiment seed,
    partition, public set and ``data.subsample`` of the data set (``partition.tuning_pool``)."""
    labels = np.asarray(labels)
    draw = numpy_rng(TUNING_POOL_SEED, "tuning_pool").random(len(labels))
    mask = np.zeros(len(labels), dtype=bool)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        chosen = members[np.argsort(draw[members], kind="stable")[: int(round(fraction * len(members)))]]
        mask[chosen] = True
    return mask
