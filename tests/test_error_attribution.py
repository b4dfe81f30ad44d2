"""Issue 35, items 6 and 7: an error names what is wrong and where, and only that.

Item 6: a sweep point is blamed only when the bad value comes from it; a typo or a wrong type in
the spec's own tables ended with ``(sweep point algorithm.name='local')``.
Item 7: a missing data file left a new empty ``mlflow.db`` (and its lock) in the working
directory; with ``--dry-run`` the error came after a page of resolved spec."""

from __future__ import annotations

import os

import pytest
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

METHODS = {"sweep": {"algorithm.name": ["local", "fedavg"]}}


# -- item 6: which sweep point, if any, is to blame ---------------------------------------------


@pytest.mark.parametrize("bad,expected", [
    ({"training.lrr": 0.1}, "pfl-run: error: training.lrr: unknown key (did you mean 'lr'?); valid keys here: "),
    ({"training.lr": "fast"}, "pfl-run: error: training.lr: expected a number, got 'fast' (str)"),
], ids=["misspelled key", "wrong type"])
@pytest.mark.parametrize("own_algorithm", [True, False], ids=["spec names a method", "only the sweep does"])
def test_a_mistake_in_the_spec_s_own_tables_names_no_sweep_point(tmp_path, capsys, bad, expected, own_algorithm):
    raw = tiny_raw(**bad, **METHODS)
    if not own_algorithm:  # the spec alone does not validate (no method): its typo is still its own
        del raw["algorithm"]
    code, out, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and line.startswith(expected) and out == "", line
    assert "sweep point" not in line, line


@pytest.mark.parametrize("own_algorithm", [True, False], ids=["spec names a method", "only the sweep does"])
def test_a_bad_value_in_one_sweep_point_names_that_point(tmp_path, capsys, own_algorithm):
    raw = tiny_raw(**{"sweep": {"algorithm.name": ["local", "fedavg"], "training.lr": [0.1, "fast"]}})
    if not own_algorithm:
        del raw["algorithm"]
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    assert code == 2 and one_line_error(err) == ("pfl-run: error: training.lr: expected a number, got 'fast' (str) "
                                                 "(sweep point algorithm.name='local', training.lr='fast')")


def test_a_parameter_the_swept_plugin_lacks_names_the_point(tmp_path, capsys):
    """The error's key (partition.params.alpha) is the spec's own, but the point's scheme decides
    which parameters exist; the spec alone names no method, so it cannot be checked by itself."""
    raw = tiny_raw(**{"partition": {"scheme": "dirichlet", "num_clients": 4, "params": {"alpha": 0.5}},
                      "sweep": {"algorithm.name": ["fedavg"], "partition.scheme": ["dirichlet", "iid"]}})
    del raw["algorithm"]
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and line.startswith("pfl-run: error: partition.params.alpha: unknown key"), line
    assert line.endswith("(sweep point algorithm.name='fedavg', partition.scheme='iid')"), line


def test_a_bad_key_in_a_sweep_points_entry_names_that_entry(tmp_path, capsys):
    raw = tiny_raw(**{"sweep": {"points": [{"training.lr": 0.1}, {"training.lrr": 0.1}]}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and line.startswith("pfl-run: error: training.lrr: unknown key (did you mean 'lr'?)"), line
    assert line.endswith("(sweep point points={'training.lrr': 0.1})"), line


def test_a_method_s_parameter_the_swept_method_lacks_names_the_point(tmp_path, capsys):
    """The error's key is not the swept one, but the point's method decides which params exist."""
    raw = tiny_raw(**{"sweep": {"algorithm": [{"name": "fedprox", "params": {"mu": 0.1}},
                                              {"name": "fedavg", "params": {"mu": 0.1}}]}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and line.startswith("pfl-run: error: algorithm.params.mu: unknown key"), line
    assert "(sweep point algorithm={'name': 'fedavg', 'params': {'mu': 0.1}})" in line, line


def test_a_rule_between_keys_the_point_breaks_names_the_point(tmp_path, capsys):
    """training.local_epochs = 0 is right for the spec's FedRep (it has its own epochs) and wrong
    for the swept FedAvg: the key is the spec's, the mistake the point's."""
    raw = tiny_raw(**{"algorithm.name": "fedrep", "training.local_epochs": 0,
                      "sweep": {"algorithm.name": ["fedrep", "fedavg"]}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and line.startswith("pfl-run: error: training.local_epochs: is 0, and fedavg has no other"), line
    assert line.endswith("(sweep point algorithm.name='fedavg')"), line


# -- item 7: a missing data file, before any store is made and before the dry run's page -------


def missing_data_spec(tmp_path) -> str:
    raw = tiny_raw(**{"data": {"name": "npz", "params": {"path": "nope.npz"}}, "tracking.enabled": True, **METHODS})
    return write_spec(tmp_path, raw)


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_missing_data_file_is_one_line_and_leaves_no_store(tmp_path, capsys, monkeypatch, dry):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store: ./mlflow.db
    spec = missing_data_spec(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, spec, *dry)
    assert code == 2 and one_line_error(err) == "pfl-run: error: data.params.path: npz file not found: nope.npz"
    assert out == ""  # no page of resolved spec before (or instead of) the error
    assert sorted(os.listdir(tmp_path)) == before  # no mlflow.db, no mlflow.db.lock


def test_a_missing_data_file_leaves_an_existing_store_as_it_was(tmp_path, capsys, monkeypatch):
    """The default store already holds runs: it is neither removed nor changed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw(**{"tracking.enabled": True}), "ok.toml"), "--quiet")
    assert code == 0, err
    store = (tmp_path / "mlflow.db").read_bytes()
    code, _, err = run_cli(capsys, missing_data_spec(tmp_path))
    assert code == 2 and "npz file not found" in one_line_error(err)
    assert (tmp_path / "mlflow.db").read_bytes() == store


def test_an_unusable_store_is_still_said_before_the_data_loads(tmp_path, capsys, monkeypatch):
    """Checking the data first must not hide a store that cannot be used: a file that is not an
    MLflow store is named, untouched, even when the data is missing too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.db").write_bytes(b"not a database" * 100)
    code, _, err = run_cli(capsys, missing_data_spec(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path / 'notes.db'}")
    line = one_line_error(err)
    assert code == 2 and "notes.db" in line and "npz" not in line, line
