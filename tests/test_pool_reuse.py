"""Tuning trials run one after another share their data and their process pool: the data is
handed from trial to trial while nothing changed it (``data_fingerprint``), the pool serves the
next trial while that trial's data is the one its workers forked with, and every trial's result
equals the one it gets in a pool of its own."""

from __future__ import annotations

import io

import pytest
from test_tune import trials_of, tune_raw

from pfl_core.data.cache import DataCache, data_fingerprint
from pfl_core.engine import resolve
from pfl_core.execution import process
from pfl_core.study import tune
from pfl_core.study.points import resolve_points


def _spec():
    return resolve(tune_raw(sweep=None, public={"size": 30})).spec  # a public set: its parts are data too


CHANGES = {
    "a label changed in place": lambda d: d.clients[1].train_y.__setitem__(0, 1 - d.clients[1].train_y[0]),
    "an input changed through a view": lambda d: d.clients[0].train_x[0].zero_(),
    "a test tensor replaced by an equal copy": lambda d: setattr(d.clients[2], "test_y", d.clients[2].test_y.clone()),
    "an index array written": lambda d: d.clients[0].indices["train"].__setitem__(0, -1),
    "a client dropped": lambda d: d.clients.pop(),
    "a client replaced by itself elsewhere": lambda d: d.clients.__setitem__(0, d.clients[1]),
    "a scalar field": lambda d: setattr(d, "num_classes", d.num_classes + 1),
    "a client's domain": lambda d: setattr(d.clients[0], "domain", 3),
    "a class renamed": lambda d: d.class_names.__setitem__(0, "renamed"),
    "a public input changed in place": lambda d: d.public.x[0].mul_(2),
    "the public labels' truth replaced": lambda d: setattr(d.public, "true_y", d.public.true_y.clone()),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_the_fingerprint_sees_every_change_to_the_data(change):
    data = DataCache().get(_spec())
    before = data_fingerprint(data)
    assert data_fingerprint(data) == before  # reading it changes nothing
    CHANGES[change](data)
    assert data_fingerprint(data) != before


def test_the_cache_hands_back_unchanged_data_and_a_pristine_copy_of_changed_data():
    spec, cache = _spec(), DataCache()
    first = cache.get(spec)
    labels = first.clients[0].train_y.clone()
    assert cache.get(spec) is not first  # still in use: a second run gets its own copy
    cache.release(first)
    again = cache.get(spec)
    assert again is first
    again.clients[0].train_y += 1  # a trial that changed its data
    cache.release(again)
    fresh = cache.get(spec)
    assert fresh is not again and fresh.clients[0].train_y.equal(labels)
    other = resolve(tune_raw(sweep=None, **{"experiment.seed": 3})).spec
    assert cache.get(other).clients[0].indices["train"].tolist() != fresh.clients[0].indices["train"].tolist()


def _tuned_trials(tmp_path, monkeypatch, reuse: bool, addons=(), algorithm="fedavg", trials=4):
    """Objective of every trial of a tuning on a 2-worker pool, and the pools forked."""
    monkeypatch.setattr(tune, "REUSE_POOLS", reuse)
    forked = []
    new_pool = process.ProcessExecutor._new_pool

    def counting(self, fn=None, runtime=None):
        forked.append(runtime is not None)
        return new_pool(self, fn=fn, runtime=runtime)

    monkeypatch.setattr(process.ProcessExecutor, "_new_pool", counting)
    folder = tmp_path / f"{algorithm}-{'reused' if reuse else 'forked'}"
    folder.mkdir()
    monkeypatch.chdir(folder)
    raw = tune_raw(trials, sweep=None, **{"tune.pruner": "none", "tracking.enabled": False, "algorithm.name": algorithm,
                                          "executor.name": "process", "executor.workers": 2})
    raw["addons"] = list(addons)
    (plan,) = tune.plan_tuning(resolve_points(raw, []), [algorithm])
    tune.tune_point(plan, None, True, False, DataCache())
    (trials,) = trials_of(folder / "optuna.db").values()
    return [(t.params, t.value) for t in trials], sum(forked)


def test_trials_share_one_pool_and_get_what_a_pool_of_their_own_gives(tmp_path, monkeypatch):
    shared, shared_forks = _tuned_trials(tmp_path, monkeypatch, reuse=True)
    own, own_forks = _tuned_trials(tmp_path, monkeypatch, reuse=False)
    assert len(shared) == 4 and shared == own  # the same trials, each with the same objective
    assert len({value for _, value in shared}) > 1  # the trials differ: a run not updated would repeat one
    assert (shared_forks, own_forks) == (1, 4)


@pytest.mark.parametrize("algorithm", ["scaffold", "ditto", "pfedme", "fedrep"])
def test_methods_with_client_state_get_the_same_trials_in_a_shared_pool(tmp_path, monkeypatch, algorithm):
    shared, shared_forks = _tuned_trials(tmp_path, monkeypatch, True, algorithm=algorithm, trials=2)
    own, _ = _tuned_trials(tmp_path, monkeypatch, False, algorithm=algorithm, trials=2)
    assert shared == own and shared_forks == 1


def test_a_trial_that_changes_its_data_forks_a_new_pool(tmp_path, monkeypatch):
    corrupt = [{"name": "corrupted_clients", "params": {"clients": [0]}}]
    shared, shared_forks = _tuned_trials(tmp_path, monkeypatch, reuse=True, addons=corrupt)
    own, own_forks = _tuned_trials(tmp_path, monkeypatch, reuse=False, addons=corrupt)
    assert shared == own and shared_forks == own_forks == 4


def test_a_kept_pool_loads_the_next_run_in_every_worker():
    """The parts of the run (not the data) travel to the workers by position in the data: the
    worker's unpickled runtime refers to its own copy of the data, not a copy of the parent's."""
    data = DataCache().get(_spec())
    parts = process.data_parts(data)
    buffer = io.BytesIO()
    held = {"spec": "s", "tensor": data.clients[0].train_x, "clients": data.clients}
    process._RuntimePickler(buffer, parts).dump(held)
    assert len(buffer.getvalue()) < data.clients[0].train_x.numel()  # the tensor did not travel
    loaded = process._RuntimeUnpickler(io.BytesIO(buffer.getvalue()), parts).load()
    assert loaded["tensor"] is data.clients[0].train_x and loaded["clients"] is data.clients
    assert loaded["spec"] == "s"


class _SameData:
    """Hands every run the very same data object, unchecked (what ``DataCache`` never does):
    the pool itself must notice that a run changed the data its workers forked with."""

    def __init__(self, spec):
        self.data = DataCache().get(spec)

    def get(self, spec, device="cpu"):
        return self.data

    def release(self, data):
        pass


def test_a_kept_pool_forks_again_when_the_data_changed_under_it():
    from pfl_core.engine import Engine
    from pfl_core.execution.planner import ExecutorCache

    process_raw = {"executor.name": "process", "executor.workers": 2, "experiment.rounds": 2}
    clean = resolve(tune_raw(sweep=None, **process_raw))
    corrupt_raw = tune_raw(sweep=None, **process_raw)
    corrupt_raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [0, 1, 2]}}]
    corrupt = resolve(corrupt_raw)
    same, executors = _SameData(clean.spec), ExecutorCache()
    try:
        Engine(clean, progress=False, data_cache=same, executor_cache=executors).run()
        kept = Engine(corrupt, progress=False, data_cache=same, executor_cache=executors)
        flipped = kept.run()  # its set-up flipped labels in the object the pool forked with
        forked = kept.ctx.executor.pools_forked
    finally:
        executors.close()
    alone = Engine(corrupt, progress=False).run()
    timed = ("round_seconds", "eval_seconds")
    assert forked == 2
    assert {k: v for k, v in flipped.final.items() if k not in timed} == {
        k: v for k, v in alone.final.items() if k not in timed}
