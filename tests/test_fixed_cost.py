"""The fixed cost of a run (issue 37): the data a study's check built is the first run's, a new
SQLite store is a copy of a template made once per MLflow version, and the data build's
histogram and conversion are faster, each with the result it had before."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.data import cache as data_cache
from pfl_core.data import federated
from pfl_core.engine import engine as engine_module
from pfl_core.study import points as points_module
from pfl_core.study import run as run_module
from pfl_core.tracking import store_check

# -- the first run takes the data its check built ------------------------------------------------


@pytest.fixture
def builds(monkeypatch):
    """Every build_federated_data call of a study: the spec's seed, and the data built."""
    made = []

    def counted(spec, *args, **kwargs):
        data = federated.build_federated_data(spec, *args, **kwargs)
        made.append(data)
        return data

    monkeypatch.setattr(points_module, "build_federated_data", counted)
    monkeypatch.setattr(engine_module, "build_federated_data", counted)
    return made


def study(tmp_path, raw, *overrides):
    return run_module.run_spec_file(write_spec(tmp_path, raw), list(overrides), quiet=True, out=open(os.devnull, "w"))


def test_a_run_uses_the_data_its_check_built_and_gets_the_same_results(tmp_path, monkeypatch, builds):
    raw = tiny_raw(**{"experiment.rounds": 2})
    taken = []
    take = engine_module.take_handed_over
    monkeypatch.setattr(engine_module, "take_handed_over", lambda *a: taken.append(take(*a)) or taken[-1])
    (handed,) = study(tmp_path, raw)
    assert len(builds) == 1 and taken == [builds[0]]  # built once, by the check, and that object trained
    monkeypatch.setattr(engine_module, "take_handed_over", lambda *a: None)  # as before: built again
    (rebuilt,) = study(tmp_path, raw)
    assert len(builds) == 3
    assert untimed(handed.runs[0].history) == untimed(rebuilt.runs[0].history)
    assert handed.runs[0].client_rows == rebuilt.runs[0].client_rows


def untimed(history):
    return [{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in history]


def test_only_the_first_run_takes_the_checked_data_and_the_others_build_their_own(tmp_path, builds):
    raw = tiny_raw(**{"experiment.rounds": 1, "experiment.seeds": [0, 1]})
    raw["sweep"] = {"training.lr": [0.1, 0.05]}  # two points of the same data: checked once
    study(tmp_path, raw)
    assert len(builds) == 4  # the check (seed 0), then 3 of the 4 runs: the first took the check's
    assert data_cache._handed_over == {}


def test_handed_over_data_is_taken_once_and_only_by_a_run_of_the_same_data():
    from pfl_core.engine import resolve

    same, other = resolve(tiny_raw()).spec, resolve(tiny_raw(**{"experiment.seed": 1})).spec
    data = object()
    data_cache.hand_over(same, data)
    assert data_cache.take_handed_over(other) is None  # another run's data: dropped
    assert data_cache.take_handed_over(same) is None
    data_cache.hand_over(same, data)
    assert data_cache.take_handed_over(same, "cuda") is None  # another device
    data_cache.hand_over(same, data)
    assert data_cache.take_handed_over(same) is data and data_cache.take_handed_over(same) is None


def test_a_study_that_stops_before_its_first_run_keeps_no_data(tmp_path, monkeypatch, builds):
    def stopped(*args, **kwargs):
        assert data_cache._handed_over  # kept for the run that was to start
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_point", stopped)
    with pytest.raises(KeyboardInterrupt):
        study(tmp_path, tiny_raw())
    assert data_cache._handed_over == {} and len(builds) == 1


# -- a new SQLite store: a copy of the template ------------------------------------------------


def dump(db):
    """What a store holds, in an order-free form (MLflow's own creations differ in the order of
    columns and indexes in their SQL text): each table's columns, the indexes, every row but
    the default experiment's times."""
    with sqlite3.connect(db) as con:
        tables = [row[0] for row in con.execute("select name from sqlite_master where type = 'table'")]
        columns = {table: sorted(con.execute(f"select name, type, \"notnull\", dflt_value, pk from "
                                             f"pragma_table_info('{table}')").fetchall()) for table in tables}
        indexes = set(con.execute("select name, tbl_name from sqlite_master where type = 'index'").fetchall())
        rows = {table: sorted(map(repr, con.execute(f'select * from "{table}"').fetchall()))
                for table in tables if table != "experiments"}
        experiments = con.execute("select experiment_id, name, artifact_location, lifecycle_stage, workspace "
                                  "from experiments").fetchall()
    return columns, indexes, rows, experiments


def test_a_copied_store_is_the_store_mlflow_creates(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    made = []
    creates = store_check._mlflow_creates
    monkeypatch.setattr(store_check, "_mlflow_creates", lambda path: made.append(path) or creates(path))
    store_check.create_sqlite_store(f"sqlite:///{tmp_path / 'a.db'}")
    monkeypatch.chdir(tmp_path)  # the default experiment's artifact location is made from it
    for name in ("b.db", "c.db"):
        store_check.create_sqlite_store(f"sqlite:///{tmp_path / name}")
    assert len(made) == 1 and made[0].parent == store_check.template_cache()  # made once, as the template
    creates(tmp_path / "mlflow_made.db")
    copied, made_by_mlflow = dump(tmp_path / "b.db"), dump(tmp_path / "mlflow_made.db")
    assert copied == made_by_mlflow
    assert copied[3] == [(0, "Default", str(tmp_path / "mlruns" / "0"), "active", "default")]
    with sqlite3.connect(tmp_path / "c.db") as con:
        (created,) = con.execute("select creation_time from experiments where experiment_id = 0").fetchone()
    with sqlite3.connect(store_check.template_store()) as con:
        (template_created,) = con.execute("select creation_time from experiments where experiment_id = 0").fetchone()
    assert created >= template_created and created > 0
    assert not list(tmp_path.glob(".*creating*")) and not list(store_check.template_cache().glob(".*creating*"))


def test_the_template_is_made_whole_or_not_at_all(tmp_path, monkeypatch):
    import mlflow

    search = mlflow.MlflowClient.search_experiments

    def interrupted(self, *args, **kwargs):
        search(self, *args, **kwargs)  # its tables written
        raise KeyboardInterrupt

    monkeypatch.setattr(mlflow.MlflowClient, "search_experiments", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store_check.create_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert not (tmp_path / "new.db").exists()
    assert [p.name for p in store_check.template_cache().iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(mlflow.MlflowClient, "search_experiments", search)
    store_check.create_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert store_check._store_revision(tmp_path / "new.db") == mlflow_head()


def mlflow_head():
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


@pytest.mark.parametrize("broken", [b"", b"not a database", "half-built"])
def test_a_broken_template_is_made_again_not_copied(tmp_path, broken):
    template = store_check._template_path()
    template.parent.mkdir(parents=True)
    if broken == "half-built":  # MLflow's tables without its alembic_version
        store_check._mlflow_creates(template)
        with sqlite3.connect(template) as con:
            con.execute("drop table alembic_version")
    else:
        template.write_bytes(broken)
    store_check.create_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert store_check._store_revision(tmp_path / "new.db") == mlflow_head()
    assert store_check._store_revision(template) == mlflow_head()


def test_without_a_writable_cache_mlflow_creates_the_store(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("PFL_CACHE_DIR", str(blocker))  # its mlflow-stores folder cannot be made
    assert store_check.template_store() is None
    store_check.create_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert store_check._store_revision(tmp_path / "new.db") == mlflow_head()


def test_the_schema_head_is_read_from_the_template_and_is_mlflows(monkeypatch):
    import mlflow.store.db.utils as db_utils

    head = mlflow_head()
    assert store_check._schema_head() == head  # no template yet: from MLflow's scripts
    store_check.template_store()
    monkeypatch.setattr(db_utils, "_get_latest_schema_revision", lambda: pytest.fail("read MLflow's scripts"))
    assert store_check._schema_head() == head


def test_two_first_runs_at_once_make_one_template_and_two_stores(tmp_path):
    code = ("import sys; from pfl_core.tracking.store_check import create_sqlite_store; "
            "create_sqlite_store('sqlite:///' + sys.argv[1])")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"{i}.db")]) for i in range(3)]
    assert [run.wait(timeout=600) for run in runs] == [0, 0, 0]
    for i in range(3):
        assert store_check._store_revision(tmp_path / f"{i}.db") == mlflow_head()
    assert len(list(store_check.template_cache().glob("*.db"))) == 1


# -- the data build: the same numbers, faster --------------------------------------------------


def reference_channel_stats(arrays):
    """pfl 0.2's histogram: int32 codes channel * 256 + value, numpy's bincount."""
    channels = 1 if arrays[0].ndim == 3 else arrays[0].shape[-1]
    offsets = (np.arange(channels, dtype=np.int32) * 256)[None, :]
    hist = np.zeros(256 * channels, dtype=np.int64)
    for x in arrays:
        flat = x.reshape(-1, channels)
        hist += np.bincount((flat.astype(np.int32) + offsets).ravel(), minlength=256 * channels)
    hist = hist.reshape(channels, 256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    count = hist.sum(axis=1)
    mean = hist @ values / count
    std = np.sqrt(np.maximum(hist @ values**2 / count - mean**2, 0.0))
    std[std < 1e-6] = 1.0
    return mean, std


@pytest.mark.parametrize("shape", [(1100, 64, 64, 3), (300, 28, 28), (50, 8, 8, 2)])
def test_the_channel_statistics_are_those_of_the_plain_histogram(shape):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, size=shape, dtype=np.uint8)  # 1100 x 64 x 64: more than one chunk
    train[..., -1] = 7 if len(shape) == 4 else train[..., -1]  # a constant channel
    test = rng.integers(0, 200, size=(40, *shape[1:]), dtype=np.uint8)
    test.flags.writeable = False  # a read-only array (a dataset plugin's memory map)
    raw = federated.RawDataset(x_train=train, y_train=np.zeros(len(train), np.int64), x_test=test,
                               y_test=np.zeros(len(test), np.int64), num_classes=1)
    mean, std = federated._channel_stats(federated._Pool(raw, include_test=True))
    expected_mean, expected_std = reference_channel_stats([train, test])
    assert np.array_equal(mean, expected_mean) and np.array_equal(std, expected_std)


@pytest.mark.parametrize("shape", [(20, 32, 32, 3), (7, 28, 28)])
def test_images_become_the_same_standardised_tensors(shape):
    x = np.random.default_rng(1).integers(0, 256, size=shape, dtype=np.uint8)
    channels = 1 if len(shape) == 3 else shape[-1]
    mean, std = np.linspace(0.3, 0.5, channels), np.linspace(0.2, 0.3, channels)
    t = torch.from_numpy(x)
    t = t.unsqueeze(1) if t.dim() == 3 else t.permute(0, 3, 1, 2).contiguous()  # pfl 0.2's steps
    t = t.to(torch.float32).div_(255.0)
    t.sub_(torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
    t.div_(torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
    got = federated._to_tensor(x, mean, std, "cpu")
    assert got.is_contiguous() and got.dtype == torch.float32 and torch.equal(got, t)
