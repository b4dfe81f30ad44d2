"""Bad input to the issue-10 baselines (ditto, apfl, pfedme, perfedavg, fedphp, fedbn, fedpac,
fedas, pfedfda, and comet under its alias perfed_ckt): every parameter's wrong types (a string,
a bool for a number, a float for an integer), non-finite numbers, out-of-range values and
misspelt names, and the models the methods cannot use. Each is one line naming its TOML key
path, refused when the spec is resolved (before any data is loaded); through ``pfl-run`` it
is exit code 2 and a single stderr line, no traceback, ``--dry-run`` included.

The per-method test files keep a few of these next to the method; this file is the audit
table for all of them. Edge values the methods document as meaningful (pFedMe's beta = 1,
APFL's alpha = 0 and 1, Ditto's lam = 0, zero-epoch phases, ...) are checked to be accepted."""

import math

import attrs
import numpy as np
import pytest
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

from pfl_core import registry
from pfl_core.engine import resolve
from pfl_core.errors import SpecError

# What each method needs beyond the tiny spec to resolve with its defaults.
BASE = {
    "ditto": {}, "apfl": {}, "pfedme": {}, "perfedavg": {}, "fedphp": {}, "fedpac": {}, "fedas": {}, "pfedfda": {},
    "fedbn": {"model.params": {"hidden": [8], "norm": "batch"}},
    "comet": {"public.size": 60}, "perfed_ckt": {"public.size": 60},
}

# Every parameter of every method, by kind: "float", "int", "bool" or the valid strings.
FLOAT, INT, BOOL = "float", "int", "bool"
PARAMS = {
    "ditto": {"lam": FLOAT, "personal_epochs": INT},
    "apfl": {"alpha": FLOAT, "adaptive": BOOL, "alpha_lr": FLOAT},
    "pfedme": {"lam": FLOAT, "k": INT, "personal_lr": FLOAT, "beta": FLOAT},
    "perfedavg": {"alpha": FLOAT, "beta": FLOAT, "variant": ("fo", "hf"), "delta": FLOAT, "eval_steps": INT},
    "fedphp": {"lam": FLOAT, "transfer": ("mmd", "kd"), "mu_max": FLOAT, "temperature": FLOAT, "kernels": INT,
               "kernel_mul": FLOAT},
    "fedbn": {},
    "fedpac": {"lam": FLOAT, "head_epochs": INT, "body_epochs": INT, "head_lr_scale": FLOAT, "collaborate": BOOL},
    "fedas": {"align_epochs": INT, "align_lr": FLOAT, "fisher": ("all", "body"), "weighting": ("fisher", "samples")},
    "pfedfda": {"beta": ("single", "separate", "local"), "folds": INT, "min_count": INT, "eps": FLOAT},
    "comet": {"pretrain_epochs": INT, "finetune_epochs": INT, "distill_epochs": INT, "temperature": FLOAT,
              "label_dtype": ("float32", "float16"), "distill_batch_size": INT, "num_clusters": INT,
              "kmeans_iterations": INT},
}
PARAMS["perfed_ckt"] = PARAMS["comet"]

# (value, message fragment) that every parameter of a kind refuses.
WRONG = {
    FLOAT: [("0.5", "expected a number, got '0.5' (str)"), (True, "expected a number, got True (bool)"),
            ([1.0], "expected a number, got [1.0] (list)"), (math.nan, "must be a finite number, got nan"),
            (math.inf, "must be a finite number, got inf"), (-math.inf, "must be a finite number, got -inf")],
    INT: [("2", "expected an integer, got '2' (str)"), (False, "expected an integer, got False (bool)"),
          (2.0, "expected an integer, got 2.0 (float)"), (1.5, "expected an integer, got 1.5 (float)"),
          (math.inf, "expected an integer, got inf (float)")],
    BOOL: [("true", "expected true or false, got 'true' (str)"), (1, "expected true or false, got 1 (int)")],
}


def at(name: str) -> str:
    return f"algorithm.params.{name}"


def type_cases():
    for algorithm, params in PARAMS.items():
        for name, kind in params.items():
            if isinstance(kind, tuple):  # a choice of strings
                wrong = [(1, "expected a string, got 1 (int)"),
                         (kind[0].upper(), f"must be one of {', '.join(map(repr, kind))}, got {kind[0].upper()!r}"),
                         (kind[0] + kind[0][-1], f"(did you mean {kind[0]!r}?)")]
            else:
                wrong = WRONG[kind]
            for value, fragment in wrong:
                yield algorithm, {at(name): value}, at(name), fragment


def unknown_name_cases():
    for algorithm, params in PARAMS.items():
        if not params:
            yield algorithm, {at("lam"): 1.0}, at("lam"), "unknown key; this table takes no keys"
            continue
        name = next(iter(params))
        typo = name[:-1] + name[-1] * 2  # "lam" -> "lamm"
        yield algorithm, {at(typo): 1}, at(typo), f"unknown key (did you mean '{name}'?); valid keys here: {name}, "
        yield algorithm, {at("mu"): 0.1}, at("mu"), "valid keys here: "  # FedProx's, not this method's


NO_EXTRACTOR = "needs a feature extractor before the classifier, but mlp has 1 parameterised layer(s)"
NO_BATCHNORM = "has none (FedBN would be FedAvg)"
NO_PUBLIC = "needs a public unlabeled set U: add a [public] table"

RANGE_CASES = [
    # Ditto: a negative proximal weight rewards moving away from w (the case)
    ("ditto", {at("lam"): -0.5}, at("lam"), "must be >= 0, got -0.5"),
    ("ditto", {at("lam"): -1}, at("lam"), "must be >= 0, got -1"),
    ("ditto", {at("personal_epochs"): -1}, at("personal_epochs"), "must be >= 0, got -1"),
    # APFL: alpha is a mixing weight in [0, 1] (the case)
    ("apfl", {at("alpha"): -0.1}, at("alpha"), "must be in [0, 1], got -0.1"),
    ("apfl", {at("alpha"): 1.5}, at("alpha"), "must be in [0, 1], got 1.5"),
    ("apfl", {at("alpha"): 2}, at("alpha"), "must be in [0, 1], got 2"),
    ("apfl", {at("alpha_lr"): 0.0}, at("alpha_lr"), "must be > 0, got 0.0"),
    ("apfl", {at("alpha_lr"): -0.01}, at("alpha_lr"), "must be > 0, got -0.01"),
    # pFedMe: negative or zero lambda, K = 0, a beta that freezes the global model (the cases)
    ("pfedme", {at("lam"): -15.0}, at("lam"), "must be > 0, got -15.0"),
    ("pfedme", {at("lam"): 0.0}, at("lam"), "must be > 0, got 0.0"),
    ("pfedme", {at("k"): 0}, at("k"), "must be >= 1, got 0"),
    ("pfedme", {at("k"): -3}, at("k"), "must be >= 1, got -3"),
    ("pfedme", {at("beta"): 0.0}, at("beta"), "must be > 0, got 0.0: with beta = 0.0 the server step"),
    ("pfedme", {at("beta"): 0}, at("beta"), "never moves w towards the clients (1 is plain averaging"),
    ("pfedme", {at("beta"): -1.0}, at("beta"), "must be > 0, got -1.0"),
    ("pfedme", {at("personal_lr"): 0.0}, at("personal_lr"), "must be > 0, got 0.0"),
    ("pfedme", {at("personal_lr"): -0.09}, at("personal_lr"), "must be > 0, got -0.09"),
    # Per-FedAvg
    ("perfedavg", {at("alpha"): -0.01}, at("alpha"), "must be >= 0, got -0.01"),
    ("perfedavg", {at("beta"): 0.0}, at("beta"), "must be > 0, got 0.0"),
    ("perfedavg", {at("beta"): -0.001}, at("beta"), "must be > 0, got -0.001"),
    ("perfedavg", {at("delta"): 0.0}, at("delta"), "must be > 0, got 0.0"),
    ("perfedavg", {at("eval_steps"): -1}, at("eval_steps"), "must be >= 0, got -1"),
    ("perfedavg", {at("variant"): "hff"}, at("variant"), "must be one of 'fo', 'hf', got 'hff' (did you mean 'hf'?)"),
    # FedPHP: lam = 1 drops the labels, mu_max = 1 never lets the hPM learn
    ("fedphp", {at("lam"): 1.0}, at("lam"), "must be in [0, 1), got 1.0"),
    ("fedphp", {at("lam"): -0.1}, at("lam"), "must be in [0, 1), got -0.1"),
    ("fedphp", {at("mu_max"): 1.0}, at("mu_max"), "must be in [0, 1), got 1.0"),
    ("fedphp", {at("mu_max"): -0.5}, at("mu_max"), "must be in [0, 1), got -0.5"),
    ("fedphp", {at("temperature"): 0.0}, at("temperature"), "must be > 0, got 0.0"),
    ("fedphp", {at("kernels"): 0}, at("kernels"), "must be >= 1, got 0"),
    ("fedphp", {at("kernel_mul"): -2.0}, at("kernel_mul"), "must be > 0, got -2.0"),
    # FedBN: a model without BatchNorm would be FedAvg (the case), reported at the key naming it
    ("fedbn", {"model.params": {"hidden": [8]}}, "model.name", f"but 'mlp' {NO_BATCHNORM}"),
    ("fedbn", {"model.params": {"hidden": [8], "norm": "none"}}, "model.name", f"but 'mlp' {NO_BATCHNORM}"),
    ("fedbn", {"model.name": "lenet5", "model.params": {}}, "model.name", f"but 'lenet5' {NO_BATCHNORM}"),
    ("fedbn", {"model.params": {"hidden": [8]}, "model.pool": ["mlp"]}, "model.pool", f"but 'mlp' {NO_BATCHNORM}"),
    ("fedbn", {"model.params": {"hidden": [8]}, "model.clients": ["mlp"] * 4}, "model.clients",
     f"but 'mlp' {NO_BATCHNORM}"),
    # FedPAC
    ("fedpac", {at("lam"): -1.0}, at("lam"), "must be >= 0, got -1.0"),
    ("fedpac", {at("head_epochs"): -1}, at("head_epochs"), "must be >= 0, got -1"),
    ("fedpac", {at("body_epochs"): -2}, at("body_epochs"), "must be >= 0, got -2"),
    ("fedpac", {at("head_lr_scale"): 0.0}, at("head_lr_scale"), "must be > 0, got 0.0"),
    ("fedpac", {at("head_layers"): 2}, at("head_layers"), "unknown key"),  # fixed: the last layer
    # FedAS
    ("fedas", {at("align_epochs"): -1}, at("align_epochs"), "must be >= 0, got -1"),
    ("fedas", {at("align_lr"): 0.0}, at("align_lr"), "must be > 0, got 0.0"),
    ("fedas", {at("align_lr"): -0.01}, at("align_lr"), "must be > 0, got -0.01"),
    ("fedas", {at("weighting"): "fishr"}, at("weighting"), "(did you mean 'fisher'?)"),
    # pFedFDA
    ("pfedfda", {at("folds"): 1}, at("folds"), "must be >= 2, got 1"),
    ("pfedfda", {at("folds"): 0}, at("folds"), "must be >= 2, got 0"),
    ("pfedfda", {at("min_count"): -1}, at("min_count"), "must be >= 0, got -1"),
    ("pfedfda", {at("eps"): 0.0}, at("eps"), "must be in (0, 1), got 0.0"),
    ("pfedfda", {at("eps"): 1.0}, at("eps"), "must be in (0, 1), got 1.0"),
    ("pfedfda", {at("eps"): -1e-4}, at("eps"), "must be in (0, 1), got -0.0001"),
    # the classifier methods need a feature extractor, at the key that names the model
    *[(m, {"model.params.hidden": []}, "model.name", f"{m} {NO_EXTRACTOR}") for m in ("fedpac", "fedas", "pfedfda")],
    *[(m, {"model.params.hidden": [], "model.pool": ["mlp"]}, "model.pool", f"{m} {NO_EXTRACTOR}")
      for m in ("fedpac", "fedas", "pfedfda")],
    ("fedas", {"model.params.hidden": [], "model.clients": ["mlp"] * 4}, "model.clients", f"fedas {NO_EXTRACTOR}"),
    ("fedpac", {"model.name": "lenet5", "model.params": {}, "model.pool": ["mlp"],
                "model.arch_params": {"mlp": {"hidden": []}}}, "model.pool", f"fedpac {NO_EXTRACTOR}"),
    # pFedFDA writes its generative classifier into a Linear last layer: squeezenet's is a convolution
    ("pfedfda", {"model.name": "squeezenet", "model.params": {}}, "model.name",
     "pfedfda needs a model whose last layer is a Linear classifier; squeezenet's is a Conv2d"),
    ("pfedfda", {"model.pool": ["squeezenet"], "model.params": {}}, "model.pool", "squeezenet's is a Conv2d"),
    *[(m, {"model.clients": ["mlp", "mlp", "mlp", "lenet5"]}, "model.clients",
       f"{m} averages weights, so every client needs the same architecture") for m in ("fedbn", "fedpac", "pfedfda")],
    # COMET and its alias PerFed-CKT
    *[(m, {at("num_clusters"): 0}, at("num_clusters"), "must be >= 1, got 0") for m in ("comet", "perfed_ckt")],
    *[(m, {at("kmeans_iterations"): 0}, at("kmeans_iterations"), "must be >= 1, got 0")
      for m in ("comet", "perfed_ckt")],
    ("perfed_ckt", {at("pretrain_epochs"): -1}, at("pretrain_epochs"), "must be >= 0, got -1"),
    ("perfed_ckt", {at("finetune_epochs"): -1}, at("finetune_epochs"), "must be >= 0, got -1"),
    ("perfed_ckt", {at("distill_epochs"): -1}, at("distill_epochs"), "must be >= 0, got -1"),
    ("perfed_ckt", {at("distill_batch_size"): 0}, at("distill_batch_size"), "must be >= 1, got 0"),
    ("perfed_ckt", {at("temperature"): 0.0}, at("temperature"), "must be > 0, got 0.0"),
    ("perfed_ckt", {at("label_dtype"): "int8"}, at("label_dtype"), "must be one of 'float32', 'float16'"),
    *[(m, {"public": None}, "public", f"comet {NO_PUBLIC}") for m in ("comet", "perfed_ckt")],
    # a value with a line break is still reported on one line
    ("ditto", {at("lam"): "1\n2"}, at("lam"), "expected a number, got '1\\n2' (str)"),
]

CASES = [*RANGE_CASES, *type_cases(), *unknown_name_cases()]


def case_id(case) -> str:
    algorithm, overrides, _path, _fragment = case
    return f"{algorithm}-" + ",".join(f"{k.removeprefix('algorithm.params.')}={v!r}" for k, v in overrides.items())


def raw_spec(algorithm: str, overrides: dict) -> dict:
    raw = tiny_raw(**{"algorithm.name": algorithm, **BASE[algorithm], **overrides})
    if "public" in overrides and overrides["public"] is None:
        del raw["public"]
    return raw


@pytest.mark.parametrize("algorithm,overrides,path,fragment", CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_one_line_at_its_key_path(algorithm, overrides, path, fragment):
    with pytest.raises(SpecError) as info:
        resolve(raw_spec(algorithm, overrides))
    error = info.value
    assert error.path == path, str(error)
    assert fragment in error.message, str(error)
    assert str(error).startswith(f"{path}: ") and "\n" not in str(error)


def test_the_table_covers_every_parameter_of_every_method():
    for algorithm, params in PARAMS.items():
        cls = registry.resolve(registry.ALGORITHM, algorithm, "algorithm.name")
        assert sorted(a.name for a in attrs.fields(cls.Params)) == sorted(params), algorithm
        covered = {path for a, _, path, _ in CASES if a == algorithm}
        assert {at(name) for name in params} <= covered, algorithm


@pytest.mark.parametrize("algorithm,params", [
    ("ditto", {"lam": 0.0, "personal_epochs": 0}),  # lam = 0 is Local; no personal epochs (tested in test_ditto)
    ("ditto", {"lam": 2}),  # an integer where a number is expected
    ("apfl", {"alpha": 0.0, "adaptive": False}),  # FedAvg
    ("apfl", {"alpha": 1, "alpha_lr": 1}),  # Local; integers for numbers
    ("pfedme", {"beta": 1.0, "k": 1}),  # beta = 1 is plain averaging
    ("pfedme", {"beta": 2.0, "lam": 30}),  # the paper's tuned beta = 2
    ("perfedavg", {"alpha": 0.0, "eval_steps": 0, "variant": "hf"}),
    ("fedphp", {"lam": 0.0, "mu_max": 0.0, "transfer": "kd", "kernels": 1}),
    ("fedpac", {"lam": 0.0, "head_epochs": 0, "body_epochs": 0, "collaborate": False}),
    ("fedas", {"align_epochs": 0, "fisher": "body", "weighting": "samples"}),
    ("pfedfda", {"beta": "local", "folds": 2, "min_count": 0, "eps": 0.5}),
    ("perfed_ckt", {"pretrain_epochs": 0, "finetune_epochs": 0, "distill_epochs": 0, "num_clusters": 1,
                    "label_dtype": "float16"}),
])
def test_edge_values_the_methods_document_are_accepted(algorithm, params):
    resolved = resolve(raw_spec(algorithm, {"algorithm.params": params}))
    assert {k: resolved.as_dict["algorithm"]["params"][k] for k in params} == params


def test_fedbn_with_batchnorm_and_pfedfda_on_a_linear_classifier_are_accepted():
    resolve(raw_spec("fedbn", {"model.name": "lenet5", "model.params": {"norm": "batch"}}))
    resolve(raw_spec("pfedfda", {"model.name": "lenet5", "model.params": {}}))


# -- through pfl-run: exit code 2, one stderr line starting with the key path, no traceback ---------------------------


@pytest.mark.parametrize("algorithm,overrides,path,fragment", [
    ("ditto", {at("lam"): -1.0}, at("lam"), ">= 0"),
    ("pfedme", {at("k"): 0}, at("k"), ">= 1"),
    ("pfedme", {at("beta"): 0.0}, at("beta"), "never moves w"),
    ("apfl", {at("alpha"): 1.5}, at("alpha"), "[0, 1]"),
    ("fedphp", {at("temperature"): math.nan}, at("temperature"), "finite"),  # TOML's nan
    ("fedpac", {at("head_epochs"): 1.0}, at("head_epochs"), "integer"),
    ("perfed_ckt", {at("num_clusterz"): 3}, at("num_clusterz"), "did you mean 'num_clusters'"),
    ("fedbn", {"model.params": {"hidden": [8]}}, "model.name", "BatchNorm"),
])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_pfl_run_exits_2_with_one_line_at_the_key(tmp_path, capsys, algorithm, overrides, path, fragment, dry_run):
    spec = write_spec(tmp_path, raw_spec(algorithm, overrides))
    code, _, err = run_cli(capsys, spec, "--no-tracking", "--quiet", *(["--dry-run"] if dry_run else []))
    assert code == 2
    line = one_line_error(err)
    assert line.startswith(f"pfl-run: error: {path}: ") and fragment in line, line


def test_pfl_run_set_override_is_refused_like_the_spec(tmp_path, capsys):
    spec = write_spec(tmp_path, raw_spec("pfedme", {}))
    for value, fragment in (("-1", "must be > 0, got -1.0"), ("true", "expected a number, got True (bool)"),
                            ("inf", "must be a finite number, got inf")):
        code, _, err = run_cli(capsys, spec, "--dry-run", "--set", f"algorithm.params.lam={value}")
        assert code == 2
        line = one_line_error(err)
        assert line.startswith("pfl-run: error: algorithm.params.lam: ") and fragment in line, line
    code, out, err = run_cli(capsys, spec, "--dry-run", "--set", "algorithm.params.beta=1")
    assert code == 0 and "beta = 1.0" in out, err


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_pfedfda_on_a_model_without_a_linear_classifier_stops_before_any_data(tmp_path, capsys, dry_run):
    """On images squeezenet builds, so nothing else stops the spec: ``--dry-run`` must report
    the convolutional classifier itself (it used to pass, and the run stopped at set-up)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (80, 32, 32, 3), dtype=np.uint8), y_train=np.repeat(np.arange(4), 20))
    raw = raw_spec("pfedfda", {"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
                               "model.name": "squeezenet", "model.params": {}})
    code, out, err = run_cli(capsys, write_spec(tmp_path, raw), "--no-tracking", "--quiet",
                             *(["--dry-run"] if dry_run else []))
    assert code == 2 and "# ok" not in out
    line = one_line_error(err)
    assert line == ("pfl-run: error: model.name: pfedfda needs a model whose last layer is a Linear classifier; "
                    "squeezenet's is a Conv2d"), line
