"""Issue 12, "no traceback on any input": the classes a spec fuzzer found. Each bad input ends
as exit code 2 and one stderr line that starts with the TOML key path at fault (where there
is one), never a traceback, a hang or an internal error."""

import io
import zipfile

import numpy as np
import pytest
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core.spec import dump_toml, tomlio

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
    monkeypatch.setattr(tomlio, "MAX_SPEC_BYTES", 1000)
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
    "no y_train": ({"x_train": X, "labels": Y}, "no 'y_train' array", "labels"),
    "labels per sample of another length": ({"x_train": X, "y_train": Y[:150]}, "y_train", "(150,) for 200 samples"),
    "2-d labels": ({"x_train": X, "y_train": Y.reshape(100, 2)}, "y_train", "one label per sample"),
    "a negative label": ({"x_train": X, "y_train": Y - 1}, "y_train", "[-1, 1]", "outside [0, 2)"),
    "a label beyond the class names": ({"x_train": X, "y_train": Y, "classes": np.array(["a", "b"])},
                                       "y_train", "outside [0, 2)"),
    "integer features": ({"x_train": (X * 10).astype(np.int64), "y_train": Y}, "x_train", "dtype int64"),
    "1-d features": ({"x_train": X[:, 0], "y_train": Y}, "x_train", "sample axis"),
    "test features of another shape": ({"x_train": X, "y_train": Y, "x_test": X[:20, :3], "y_test": Y[:20]},
                                       "(5,)", "(3,)"),
    "no training samples": ({"x_train": X[:0], "y_train": Y[:0]}, "training split is empty"),
    "an empty test split": ({"x_train": X, "y_train": Y, "x_test": X[:0], "y_test": Y[:0]}, "x_test", "empty"),
    "a NaN feature": ({"x_train": np.where(np.arange(200)[:, None] == 7, np.nan, X).astype(np.float32), "y_train": Y},
                      "x_train", "5 NaN or infinite values", "sample 7"),
    "infinite test features": ({"x_train": X, "y_train": Y, "x_test": np.full((20, 5), -np.inf, np.float32),
                                "y_test": Y[:20]}, "x_test", "100 NaN or infinite values", "sample 0"),
    "float64 beyond float32": ({"x_train": np.where(np.arange(200)[:, None] == 3, 1e300, X.astype(np.float64)),
                                "y_train": Y},
                               "x_train", "1e+300", "float32"),
}


def npy_bytes(header_shape, data: bytes, descr="<f4") -> bytes:
    """A .npy member whose header declares ``header_shape`` but which holds only ``data``."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": header_shape})
    return buffer.getvalue() + data


def npz_claiming_4_terabytes(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x_train.npy", npy_bytes((10**9, 1000), b"\0" * 64))
        archive.writestr("y_train.npy", npy_bytes((10**9,), b"\0" * 64, "<i8"))


@pytest.mark.parametrize("case", [*NPZ, ".npy file", "zip of other files", "text file", "directory",
                                  "header larger than the data"])
def test_bad_npz_files(tmp_path, capsys, case):
    path = tmp_path / "data.npz"
    if case == ".npy file":
        with open(path, "wb") as fh:
            np.save(fh, X)
        fragments = (".npy",)
    elif case == "zip of other files":
        npz_member_zip(path)
        fragments = ("no .npy arrays",)
    elif case == "text file":  # numpy itself would call it "pickled data" and suggest allow_pickle
        path.write_text("x_train,y_train\n0.5,1\n")
        fragments = ("is not an npz file",)
    elif case == "directory":
        path.mkdir()
        fragments = ("is a directory",)
    elif case == "header larger than the data":  # numpy would allocate the declared 4 TB first
        npz_claiming_4_terabytes(path)
        fragments = ("'x_train' is truncated or corrupt", "(1000000000, 1000)", "holds 64 bytes")
    else:
        arrays, *fragments = NPZ[case]
        np.savez(path, **arrays)
    raw = tiny_raw(**{"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid"})
    expect_error(capsys, [write_spec(tmp_path, raw)], "data.params.path", str(path), *fragments)


class Unpickled:
    """An object whose unpickling would be seen: object arrays must never be unpickled."""

    seen = False

    def __setstate__(self, state):
        Unpickled.seen = True


@pytest.mark.parametrize("key", ["x_train", "y_train", "classes"])
def test_object_arrays_are_refused_and_never_unpickled(tmp_path, capsys, key):
    arrays = {"x_train": X, "y_train": Y, "classes": np.array(["a", "b", "c"])}
    objects = np.empty(len(arrays[key]), dtype=object)
    objects[:] = [Unpickled() for _ in objects]
    if key == "x_train":
        objects = objects.reshape(-1, 1)
    arrays[key] = objects
    path = tmp_path / "objects.npz"
    np.savez(path, **arrays)  # numpy pickles the object array into the archive
    Unpickled.seen = False
    raw = tiny_raw(**{"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid"})
    expect_error(capsys, [write_spec(tmp_path, raw)], "data.params.path", str(path), f"'{key}' holds Python objects",
                 "never unpickles")
    assert not Unpickled.seen


# -- 9. classes the fuzzer (tests/test_fuzz.py) found -----------------------------------------

@pytest.mark.parametrize("key, toml, shown", [
    ("experiment.rounds", "1979-05-27", "1979-05-27 (date)"),
    ("training.lr", "07:32:00", "07:32:00 (time)"),
    ("algorithm.name", "1979-05-27T07:32:00Z", "1979-05-27T07:32:00+00:00 (datetime)"),
    ("evaluation.every", "[1979-05-27, 2]", "[1979-05-27, 2] (list)"),
])
def test_toml_dates_are_shown_as_toml_not_as_python(tmp_path, capsys, key, toml, shown):
    line = expect_error(capsys, [with_value_text(tmp_path, key, toml)], key, shown)
    assert "datetime." not in line  # Python's repr: datetime.date(1979, 5, 27)


@pytest.mark.parametrize("key, value, fragment", [
    ("training", 5, "expected a table, got 5 (int)"),  # was "argument of type 'int' is not iterable"
    ("public", [], "expected a table, got [] (list)"),  # was "'list' object has no attribute 'keys'"
    ("model", "mlp", "expected a table, got 'mlp' (str)"),
    ("addons", [5], "expected a table, got 5 (int)"),
])
def test_a_section_that_is_not_a_table(tmp_path, capsys, key, value, fragment):
    expect_error(capsys, [write_spec(tmp_path, tiny_raw(**{key: value}))], key, fragment)


@pytest.mark.parametrize("sweep, key, fragment", [
    ({"nonsense.key": [1, 2]}, "sweep.nonsense.key", "'nonsense', which is not a section"),
    ({"experimnt.seed": [1, 2]}, "sweep.experimnt.seed", "did you mean 'experiment'"),
    ({"points": [{"algorithm.name": "local"}, {"bogus": 1}]}, "sweep.points[1].bogus", "not a section"),
    ({"points": [{"points": [{}]}]}, "sweep.points[0].points", "not a section"),
    ({"training..lr": [1]}, "sweep.training..lr", "not a dotted key"),
])
def test_a_swept_key_outside_the_spec_is_named_where_it_is_written(tmp_path, capsys, sweep, key, fragment):
    # The points alone would say "nonsense: unknown key", a key that is nowhere in the file.
    expect_error(capsys, [write_spec(tmp_path, swept(sweep))], key, fragment)


@pytest.mark.parametrize("key, spelled", [('""', '""'), ('" "', '" "'), ('"a b"', '"a b"'), ('"a.b"', '"a.b"')])
def test_a_key_toml_must_quote_is_quoted(tmp_path, capsys, key, spelled):
    # An empty key made "pfl-run: error: training.: unknown key", a space "error:  : unknown key".
    raw = tiny_raw(**{f"training.{key}": 1})
    expect_error(capsys, [write_spec(tmp_path, raw)], f"training.{spelled}: unknown key")
    # a plugin's table: its prefix (addons[0].params) is one part of the path, never quoted
    raw = tiny_raw(addons=[{"name": "corrupted_clients", "params": {key.strip('"'): 1}}])
    expect_error(capsys, [write_spec(tmp_path, raw)], f"addons[0].params.{spelled}: unknown key")


def test_negative_zero_is_zero(tmp_path, capsys):
    # -0.0 passed ">= 0" and numpy then refused it as a scale ("scale < 0"): an internal error.
    code, out, err = run_cli(capsys, write_spec(tmp_path, tiny_raw(**{"data.params.beta": -0.0})), "--dry-run")
    assert code == 0, err
    assert "beta = 0.0" in out


def test_a_path_longer_than_the_file_system_allows(tmp_path, capsys):
    long_name = str(tmp_path / ("a" * 300 + ".npz"))
    raw = tiny_raw(**{"data.name": "npz", "data.params": {"path": long_name}, "partition.scheme": "iid"})
    expect_error(capsys, [write_spec(tmp_path, raw)], "data.params.path", "File name too long")
    expect_error(capsys, [long_name.replace(".npz", ".toml")], "", "cannot read spec file", "File name too long")


@pytest.mark.parametrize("arch_params, key, fragment", [
    ({"cnn2": {"bogus": 1}}, "model.arch_params.cnn2.bogus", "unknown key"),  # cnn2 is no client's model
    ({"cnn3": {}}, "model.arch_params.cnn3", "unknown model 'cnn3'"),
])
def test_parameters_of_an_architecture_no_client_uses_are_checked(tmp_path, capsys, arch_params, key, fragment):
    # A plugin may build it later (COSMOS's server_arch); a typo was found only then.
    expect_error(capsys, [write_spec(tmp_path, tiny_raw(**{"model.arch_params": arch_params}))], key, fragment)


def test_a_model_whose_size_overflows_64_bits(tmp_path, capsys):
    raw = tiny_raw(**{"model.name": "cnn4", "model.params": {"width": 1e30}, "data.name": "npz",
                      "data.params": {"path": str(tmp_path / "images.npz")}, "partition.scheme": "iid"})
    np.savez(tmp_path / "images.npz", x_train=np.zeros((40, 8, 8), np.uint8), y_train=np.arange(40) % 2)
    expect_error(capsys, [write_spec(tmp_path, raw)], "model.params", "too large to build", "64-bit")


@pytest.mark.parametrize("key, value", [("data.params.beta", 1e300), ("data.params.alpha", 1e300)])
def test_synthetic_data_beyond_float_range(tmp_path, capsys, key, value):
    # beta = 1e300 gave infinite float32 features and NaN losses, with a clean dry run.
    expect_error(capsys, [write_spec(tmp_path, tiny_raw(**{key: value}))], key, "1e+300")


@pytest.mark.parametrize("algorithm", ["fedavg", "pmixfed", "fedbn"])  # pmixfed, fedbn: probe the layers first
def test_a_model_larger_than_memory_is_refused_before_allocating(tmp_path, capsys, algorithm):
    # width = 1e6: 2.4 billion weights in conv1 alone were allocated and initialised (about a
    # minute and 10 GB) before the next layer failed to allocate.
    raw = tiny_raw(**{"model.name": "cnn4", "model.params": {"width": 1e6, "norm": "batch"}, "data.name": "npz",
                      "data.params": {"path": str(tmp_path / "images.npz")}, "partition.scheme": "iid",
                      "algorithm.name": algorithm})
    np.savez(tmp_path / "images.npz", x_train=np.zeros((40, 8, 8, 3), np.uint8), y_train=np.arange(40) % 2)
    expect_error(capsys, [write_spec(tmp_path, raw)], "model.params", "too large to build", "GiB, more than this")
