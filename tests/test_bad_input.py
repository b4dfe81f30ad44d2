"""Issue 12, "no traceback on any input": the classes a spec fuzzer found. Each bad input ends
as exit code 2 and one stderr line that starts with the TOML key path at fault (where there
is one), never a traceback, a hang or an internal error."""

import zipfile

import numpy as np
import pytest

from pfl_core import spec as spec_module
from pfl_core.spec import dump_toml
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

BIG = "1" + "0" * 400  # a 401-digit integer


def raw_text(tmp_path, text: str, name="spec.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def swept(sweep: dict, **overrides) -> dict:
    raw = tiny_raw(**overrides)
    raw["sweep"] = sweep
    return raw


def expect_error(capsys, args, key: str, *fragments: str) -> str:
    code, _, err = run_cli(capsys, *args, "--dry-run")
    line = one_line_error(err)  # exactly one line, no traceback
    assert code == 2, err
    assert line.startswith(f"pfl-run: error: {key}"), line
    for fragment in fragments:
        assert fragment in line, line
    return line


# -- 1. the spec path is not a readable UTF-8 file --------------------------------------------

def test_spec_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[experiment]\nname = "caf\xe9"\n')
    expect_error(capsys, [str(path)], "", "not UTF-8", "line 2")


def test_spec_path_that_is_a_directory_or_missing(tmp_path, capsys):
    expect_error(capsys, [str(tmp_path)], "", "is a directory")
    expect_error(capsys, [str(tmp_path / "nope.toml")], "", "not found")


def test_spec_file_too_large_to_be_a_spec(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(spec_module, "MAX_SPEC_BYTES", 1000)
    expect_error(capsys, [raw_text(tmp_path, "# " + "x" * 2000 + "\n")], "", "larger than")


# -- 2. deeply nested values ----------------------------------------------------------------

def with_value_text(tmp_path, key: str, value: str) -> str:
    """The tiny spec with ``key`` set to the TOML text ``value`` (which dump_toml cannot write)."""
    text = dump_toml(tiny_raw(**{key: "@VALUE@"}))
    return raw_text(tmp_path, text.replace('"@VALUE@"', value))


@pytest.mark.parametrize("value, key", [
    ("[" * 2000 + "]" * 2000, "experiment.name"),  # too deep for the TOML reader
    ("{a = " * 2000 + "1" + "}" * 2000, "training.lr"),
    ("[" * 100 + "]" * 100, "model.params.hidden"),  # read, but deeper than the limit
])
def test_deeply_nested_values(tmp_path, capsys, value, key):
    expect_error(capsys, [with_value_text(tmp_path, key, value)], key, "nested")


def test_deeply_nested_set_value(tmp_path, capsys):
    spec = write_spec(tmp_path, tiny_raw())
    expect_error(capsys, [spec, "--set", "training.lr=" + "[" * 2000 + "]" * 2000], "training.lr", "nested")
    expect_error(capsys, [spec, "--set", "training.lr=" + "[" * 100 + "]" * 100], "training.lr", "nested")


# -- 3. seeds -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, key, fragment", [
    (swept({"experiment.seed": [-1]}), "experiment.seed", ">= 0"),
    (tiny_raw(**{"experiment.seed": 2**63}), "experiment.seed", "64-bit"),
    (tiny_raw(**{"experiment.seed": 2**64 + 1}), "experiment.seed", "64-bit"),
    (tiny_raw(**{"experiment.seeds": [0, 2**63]}), "experiment.seeds[1]", "64-bit"),
    (swept({"experiment.seed": [0, 2**63]}), "experiment.seed", "64-bit"),
    (swept({"experiment.seeds": [[1, -2]]}), "experiment.seeds", ">= 0"),
])
def test_seeds_out_of_range(tmp_path, capsys, raw, key, fragment):
    expect_error(capsys, [write_spec(tmp_path, raw)], key, fragment)


def test_a_long_seed_list_is_checked_in_linear_time(tmp_path, capsys):
    raw = tiny_raw(**{"experiment.seeds": [*range(100_000), 5]})  # quadratic: minutes
    expect_error(capsys, [write_spec(tmp_path, raw)], "experiment.seeds", "seed 5 more than once")


# -- 4. huge sizes --------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, fragment", [
    ("data.params.samples_per_device", 10**12, "limit of 250000000"),
    ("data.params.samples_per_device", 2**62, "limit of 250000000"),
    ("data.params.num_devices", 10**9, "limit of 100000"),
    ("data.params.dim", 10**9, "limit of 250000000"),
    ("data.params.num_classes", 10**12, "limit of 10000000"),
    ("partition.num_clients", 10**9, "<= 1000000"),
])
def test_huge_sizes_are_refused_before_allocating(tmp_path, capsys, key, value, fragment):
    expect_error(capsys, [write_spec(tmp_path, tiny_raw(**{key: value}))], key, fragment)


@pytest.mark.parametrize("hidden", [2**50, 2**62])  # beyond any address space; beyond int64 bytes
def test_a_model_too_large_to_allocate(tmp_path, capsys, hidden):
    raw = tiny_raw(**{"model.params.hidden": [hidden]})
    expect_error(capsys, [write_spec(tmp_path, raw)], "model.params", "too large to build")


def test_more_clients_than_samples_is_refused_before_partitioning(tmp_path, capsys):
    raw = tiny_raw(**{"partition.num_clients": 100_000, "partition.scheme": "iid"})
    expect_error(capsys, [write_spec(tmp_path, raw)], "partition.num_clients", "480 samples")


@pytest.mark.parametrize("key", ["training.local_epochs", "experiment.rounds", "training.batch_size",
                                 "partition.min_samples", "evaluation.every", "data.params.samples_per_device",
                                 "training.lr", "experiment.seed"])
def test_a_400_digit_integer_is_refused_at_its_key(tmp_path, capsys, key):
    line = expect_error(capsys, [with_value_text(tmp_path, key, BIG)], key, "64-bit", "401-digit")
    assert BIG not in line


# -- 5. sweeps ------------------------------------------------------------------------------

def test_an_enormous_sweep_is_refused_without_expanding_it(tmp_path, capsys):
    axes = ["training.lr", "training.batch_size", "training.momentum", "experiment.rounds",
            "evaluation.every", "experiment.seed"]
    raw = swept({axis: list(range(1, 101)) for axis in axes})
    expect_error(capsys, [write_spec(tmp_path, raw)], "sweep", "1000000000000", "limit")


def test_a_sweep_that_is_not_a_table(tmp_path, capsys):
    text = "sweep = []\n" + dump_toml(tiny_raw())
    expect_error(capsys, [raw_text(tmp_path, text)], "sweep", "expected a table")


# -- 6. a sweep over the algorithm does not hide the base [algorithm] table ------------------

@pytest.mark.parametrize("base, sweep, key, fragment", [
    ({"algorithm.name": ""}, {"algorithm.name": ["local", "fedavg"]}, "algorithm.name", "unknown algorithm"),
    ({"algorithm.name": "os"}, {"algorithm.name": ["local", "fedavg"]}, "algorithm.name", "unknown algorithm 'os'"),
    ({"algorithm.name": "os"}, {"algorithm": [{"name": "local"}, {"name": "fedavg"}]}, "algorithm.name", "'os'"),
    ({"algorithm.name": "fedavgg"}, {"points": [{"algorithm": {"name": "local"}}]}, "algorithm.name",
     "did you mean 'fedavg'"),
    ({"algorithm.parms": {}}, {"algorithm": [{"name": "local"}, {"name": "fedavg"}]}, "algorithm.parms",
     "did you mean 'params'"),
    ({"algorithm": {"name": "fedprox", "params": {"mu": -1}}}, {"algorithm": [{"name": "local"}]},
     "algorithm.params.mu", ">= 0"),
])
def test_sweeping_the_algorithm_still_validates_the_base_table(tmp_path, capsys, base, sweep, key, fragment):
    line = expect_error(capsys, [write_spec(tmp_path, swept(sweep, **base))], key, fragment)
    assert "[algorithm]" in line


# -- 7. local_epochs = 0 where it is the only training --------------------------------------

@pytest.mark.parametrize("algorithm", ["fedavg", "local", "fedprox", "centralized", "pfedme"])
def test_zero_local_epochs_that_train_nothing(tmp_path, capsys, algorithm):
    raw = tiny_raw(**{"training.local_epochs": 0, "algorithm.name": algorithm})
    expect_error(capsys, [write_spec(tmp_path, raw)], "training.local_epochs", "trains nothing")


@pytest.mark.parametrize("algorithm", ["fedsimsup", "fedrep", "fedalt"])
def test_zero_local_epochs_for_methods_with_their_own_epochs(tmp_path, capsys, algorithm):
    raw = tiny_raw(**{"training.local_epochs": 0, "algorithm.name": algorithm})
    code, out, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    assert code == 0, err
    assert "# ok:" in out


# -- 8. bad npz files -----------------------------------------------------------------------

X = np.random.default_rng(0).random((200, 5)).astype(np.float32)
Y = np.arange(200) % 3


def npz_member_zip(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x_train.txt", "1 2 3")
        archive.writestr("notes", "hello")


NPZ = {
    "string labels": ({"x_train": X, "y_train": np.array(["a", "b"] * 100)}, "y_train", "integer"),
    "0-d classes": ({"x_train": X, "y_train": Y, "classes": np.array(3)}, "classes", "list"),
    "string domains": ({"x_train": X, "y_train": Y, "domain_train": np.array(["a", "b"] * 100)},
                       "domain_train", "integer"),
    "float domains": ({"x_train": X, "y_train": Y, "domain_train": np.arange(200) % 2 + 0.5},
                      "domain_train", "integer"),
    "negative domains": ({"x_train": X, "y_train": Y, "domain_train": np.arange(200) % 2 - 1},
                         "domain_train", ">= 0"),
    "zero-width features": ({"x_train": np.zeros((200, 0), np.float32), "y_train": Y}, "x_train", "empty"),
    "one huge label": ({"x_train": X, "y_train": np.where(np.arange(200) == 0, 10**6, Y)}, "1000000", "classes"),
    "a 10**12 label": ({"x_train": X, "y_train": np.where(np.arange(200) == 0, 10**12, Y)}, "classes", "limit"),
}


@pytest.mark.parametrize("case", [*NPZ, ".npy file", "zip of other files"])
def test_bad_npz_files(tmp_path, capsys, case):
    path = tmp_path / "data.npz"
    if case == ".npy file":
        with open(path, "wb") as fh:
            np.save(fh, X)
        fragments = (".npy",)
    elif case == "zip of other files":
        npz_member_zip(path)
        fragments = ("no .npy arrays",)
    else:
        arrays, *fragments = NPZ[case]
        np.savez(path, **arrays)
    raw = tiny_raw(**{"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid"})
    expect_error(capsys, [write_spec(tmp_path, raw)], "data.params.path", str(path), *fragments)
