"""The tuning pool (issue 34): a tuning trial validates only on samples that no final run's test
split holds, whatever the seeds; a spec without ``[tune]`` splits its data exactly as before."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from test_cli import one_line_error, run_cli, write_spec
from test_tune import tune_raw
from tiny import tiny_raw

from pfl_core.data.federated import apportion, build_federated_data, stratified_split, tuning_pool_mask
from pfl_core.engine import resolve
from pfl_core.spec import dump_toml
from pfl_core.spec.schema import TUNING_POOL_DEFAULT
from pfl_core.study.points import Point, reference_points, resolve_points
from pfl_core.study.tune import plan_tuning, trial_point, tuned_raw, tuning_seeds

# Tiny's synthetic data split by domain, plus a label-skewed partition of a subsample, whose
# clients have few samples of some classes (where a restricted split runs short first).
SKEWED = {"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}, "partition.num_clients": 6,
          "data.subsample": 360}


def splits(data, split: str) -> set[int]:
    return {int(i) for c in data.clients for i in c.indices[split]}


def trial_and_final_data(raw: dict, tuning_seeds_given=None):
    """For every point of a tuned spec: the data of its trials (on each tuning seed) and of its
    final runs (each of experiment.seeds, at a chosen value), as the study builds them."""
    if tuning_seeds_given is not None:
        raw["tune"]["seeds"] = tuning_seeds_given
    points = resolve_points(raw, [])
    plans = plan_tuning(points, [p.resolved.spec.algorithm.name for p in points])
    out = []
    for plan in plans:
        trials = [build_federated_data(trial_point(plan.point, {"training.lr": 0.05}, seed).spec)
                  for seed in plan.seeds]
        final_raw = tuned_raw(plan.point, {"training.lr": 0.05})
        final = Point(plan.point.settings, resolve(final_raw), final_raw, plan.point.base)
        finals = [build_federated_data(final.for_seed(seed).spec) for seed in final.seeds]
        out.append((trials, finals))
    return points, out


@pytest.mark.parametrize("overrides", [{}, SKEWED], ids=["domain", "dirichlet-subsample"])
def test_no_tuning_validation_sample_is_in_any_final_test_split(overrides):
    raw = tune_raw(**overrides, **{"experiment.seeds": [0, 1, 2]})
    points, built = trial_and_final_data(raw, tuning_seeds_given=[3, 7])
    for trials, finals in built:
        tuning_val = set().union(*(splits(d, "val") for d in trials))
        final_test = set().union(*(splits(d, "test") for d in finals))
        assert len(tuning_val) > 0.05 * finals[0].pool_size  # validation of about the asked size
        assert final_test
        assert not tuning_val & final_test
        # the trial's validation comes from the pool, the final tests from outside it
        pool = np.flatnonzero(tuning_pool_mask(finals[0].dataset.load().y_train, TUNING_POOL_DEFAULT))
        assert tuning_val <= set(pool.tolist())
        assert not final_test & set(pool.tolist())
    # the reference runs (kept at the spec's settings, [tune] included) pair with the final runs
    raw["experiment"]["reference"] = ["local"]
    (_, ref), = reference_points(resolve_points(raw, []))
    for seed in ref.seeds:
        assert not splits(build_federated_data(ref.for_seed(seed).spec), "test") & tuning_val


def test_without_the_pool_the_issue_reproduces():
    """The scenario of the issue: the tuning seed's validation samples reappear in the final
    seeds' test splits when nothing keeps them apart."""
    val = splits(build_federated_data(resolve(tiny_raw(**{"experiment.seed": 3})).spec), "val")
    tests = set().union(*(splits(build_federated_data(resolve(tiny_raw(**{"experiment.seed": s})).spec), "test")
                          for s in (0, 1, 2)))
    assert val & tests


# Digests of the indices artifact (every split's pool positions) built by the code before the
# tuning pool existed: a spec without [tune] must split exactly as it did.
UNTUNED_DIGESTS = [
    ({}, "345da482e178c4f1"),
    ({"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}, "partition.num_clients": 6,
      "experiment.seed": 3}, "a69489d0fca5c56a"),
    ({"partition.scheme": "iid", "data.subsample": 300, "partition.val_fraction": 0.15}, "2c2c3acdc46eba48"),
]


@pytest.mark.parametrize("overrides, digest", UNTUNED_DIGESTS)
def test_an_untuned_spec_splits_exactly_as_before(overrides, digest):
    spec = resolve(tiny_raw(**overrides)).spec
    assert spec.partition.tuning_pool is None and not spec.partition.tuning_trial
    artifact = build_federated_data(spec).indices_artifact()
    assert hashlib.sha256(json.dumps(artifact, sort_keys=True).encode()).hexdigest()[:16] == digest


def old_stratified_split(labels, val_fraction, test_fraction, rng):
    """stratified_split as it was before the masks (verbatim)."""
    labels = np.asarray(labels)
    n = len(labels)
    classes, counts = np.unique(labels, return_counts=True)
    n_test = max(1, int(round(n * test_fraction)))
    test_counts = apportion(n_test, counts, counts - 1, rng)
    n_val = max(1, int(round(n * val_fraction))) if val_fraction > 0 else 0
    val_counts = apportion(n_val, counts, counts - 1 - test_counts, rng)
    train, val, test = [], [], []
    for cls, t, v in zip(classes, test_counts, val_counts):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        test.append(idx[:t])
        val.append(idx[t : t + v])
        train.append(idx[t + v :])
    cat = lambda parts: np.sort(np.concatenate(parts)).astype(np.int64)  # noqa: E731
    return cat(train), cat(val), cat(test)


def test_split_without_masks_is_the_old_split():
    draw = np.random.default_rng(0)
    for case in range(200):
        labels = draw.integers(0, draw.integers(1, 6), size=draw.integers(1, 60))
        fractions = (float(draw.choice([0.0, 0.1, 0.3])), float(draw.choice([0.1, 0.2, 0.4])))
        new = stratified_split(labels, *fractions, np.random.default_rng(case))
        old = old_stratified_split(labels, *fractions, np.random.default_rng(case))
        for a, b in zip(new, old):
            np.testing.assert_array_equal(a, b)


def test_masks_restrict_the_split_by_hand():
    labels = np.array([0] * 10 + [1] * 10)
    pool = np.zeros(20, dtype=bool)
    pool[[0, 1, 2, 10, 11, 12]] = True  # three samples of each class
    # a final run: 4 test samples (2 per class), none from the pool
    tr, va, te = stratified_split(labels, 0.1, 0.2, np.random.default_rng(0), test_from=~pool)
    assert len(te) == 4 and not pool[te].any() and list(np.bincount(labels[te])) == [2, 2]
    assert len(va) == 2 and sorted([*tr, *va, *te]) == list(range(20))
    # a trial: validation only from the pool; its test leaves the pool to validation
    tr, va, te = stratified_split(labels, 0.3, 0.2, np.random.default_rng(0), val_from=pool)
    assert len(va) == 6 and pool[va].all() and not pool[te].any()
    # validation asks for more than the pool holds: it gets the pool, never a sample outside
    tr, va, te = stratified_split(labels, 0.5, 0.2, np.random.default_rng(0), val_from=pool)
    assert sorted(va) == [0, 1, 2, 10, 11, 12]
    # a class with all its samples in the pool gives the other class its test share
    tr, va, te = stratified_split(labels, 0.1, 0.2, np.random.default_rng(0), test_from=labels == 1)
    assert list(labels[te]) == [1, 1, 1, 1]


def test_the_pool_is_fixed_per_data_set_and_stratified():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 7)
    mask = tuning_pool_mask(labels, 0.2)
    assert list(np.bincount(labels[mask])) == [10, 6, 1]
    np.testing.assert_array_equal(mask, tuning_pool_mask(labels, 0.2))  # no experiment seed in it
    # the same pool for the trials of every seed: each trial's validation lies in it
    for seed in (0, 5):
        spec = resolve(tiny_raw(**{"experiment.seed": seed, "partition.tuning_pool": 0.2,
                                   "partition.tuning_trial": True})).spec
        data = build_federated_data(spec)
        pool = tuning_pool_mask(data.dataset.load().y_train, 0.2)
        assert pool[sorted(splits(data, "val"))].all()


def test_the_spec_carries_the_pool_into_the_final_runs():
    plain = resolve(tiny_raw()).spec
    assert plain.partition.tuning_pool is None
    points = resolve_points(tune_raw(), [])
    assert {p.resolved.spec.partition.tuning_pool for p in points} == {TUNING_POOL_DEFAULT}
    final_raw = tuned_raw(points[0], {"training.lr": 0.05})
    assert "tune" not in final_raw and final_raw["partition"]["tuning_pool"] == TUNING_POOL_DEFAULT
    assert "tuning_pool = 0.2" in dump_toml(final_raw)  # tuned_spec.toml reproduces the final runs
    assert not resolve(final_raw).spec.partition.tuning_trial
    trial = trial_point(points[0], {"training.lr": 0.05}, tuning_seeds(points[0])[0])
    assert trial.spec.partition.tuning_trial and trial.spec.partition.tuning_pool == TUNING_POOL_DEFAULT
    given = resolve_points(tune_raw(**{"partition.tuning_pool": 0.3}), [])
    assert tuned_raw(given[0], {})["partition"]["tuning_pool"] == 0.3


@pytest.mark.parametrize("change, key, words", [
    ({"tuning_pool": 1.5}, "partition.tuning_pool", "1.5"),
    ({"tuning_trial": True}, "partition.tuning_trial", "no partition.tuning_pool"),
])
def test_bad_pool_settings_are_one_line(tmp_path, capsys, change, key, words):
    raw = tiny_raw()
    raw["partition"].update(change)
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and key in line and words in line
