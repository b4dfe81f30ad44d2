"""Spec structuring, overrides, sweeps and the resolved-spec TOML writer."""

import copy
import sys

import pytest

from pfl_core.errors import SpecError
from pfl_core.spec import Spec, apply_overrides, dump_toml, expand_sweep, parse_value, structure

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

BASE = {
    "experiment": {"name": "t", "rounds": 2},
    "data": {"name": "synthetic"},
    "partition": {"scheme": "domain", "num_clients": 4},
    "algorithm": {"name": "fedavg"},
}


def spec_error(raw) -> SpecError:
    with pytest.raises(SpecError) as info:
        structure(raw, Spec)
    return info.value


def with_(key, value):
    return apply_overrides(BASE, [f"{key}={value}"])


def test_defaults_fill_in():
    spec = structure(BASE, Spec)
    assert spec.training.batch_size == 10
    assert spec.public is None
    assert spec.experiment.participation == 1.0


def test_unknown_key_names_path_and_suggests():
    raw = {**BASE, "experiment": {"name": "t", "roudns": 3}}
    err = spec_error(raw)
    assert err.path == "experiment.roudns"
    assert "did you mean 'rounds'" in err.message


def test_unknown_section_is_reported_at_top_level():
    err = spec_error({**BASE, "trainig": {}})
    assert err.path == "trainig"
    assert "training" in err.message


def test_wrong_type_is_not_coerced():
    err = spec_error(with_("experiment.rounds", '"3"'))
    assert err.path == "experiment.rounds"
    assert "integer" in err.message
    err = spec_error(with_("tracking.enabled", '"false"'))
    assert err.path == "tracking.enabled"


def test_int_accepted_for_float_but_bool_is_not_a_number():
    assert structure(with_("training.lr", "1"), Spec).training.lr == 1.0
    assert spec_error(with_("training.lr", "true")).path == "training.lr"


@pytest.mark.parametrize(
    "key,value,path",
    [
        ("experiment.rounds", "-1", "experiment.rounds"),
        ("experiment.participation", "0", "experiment.participation"),
        ("experiment.participation", "1.5", "experiment.participation"),
        ("partition.num_clients", "0", "partition.num_clients"),
        ("training.lr", "-0.1", "training.lr"),
        ("training.lr", "nan", "training.lr"),
        ("training.optimizer", '"sgdd"', "training.optimizer"),
        ("public.alpha", "0", "public.alpha"),
    ],
)
def test_nonsense_values_name_their_key(key, value, path):
    raw = with_(key, value)
    if key.startswith("public"):
        raw["public"]["size"] = 10
    assert spec_error(raw).path == path


def test_coldstart_clients_must_leave_someone_to_train():
    assert spec_error(with_("experiment.coldstart_clients", "4")).path == "experiment.coldstart_clients"
    assert structure(with_("experiment.coldstart_clients", "3"), Spec).experiment.coldstart_clients == 3


def test_public_needs_exactly_one_of_size_and_fraction():
    assert spec_error(with_("public.sampling", '"balanced"')).path == "public.size"


def test_nested_list_path():
    raw = {**BASE, "addons": [{"name": "a"}, {"name": "b", "parms": {}}]}
    assert spec_error(raw).path == "addons[1].parms"


def test_overrides_parse_toml_values():
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value("fedprox") == "fedprox"  # a bare word is a string
    raw = apply_overrides(BASE, ["algorithm.params.mu=0.1", "experiment.rounds=7"])
    assert raw["algorithm"]["params"] == {"mu": 0.1}
    assert raw["experiment"]["rounds"] == 7
    assert BASE["experiment"]["rounds"] == 2  # the original is untouched


def test_override_without_equals_is_an_error():
    with pytest.raises(SpecError) as info:
        apply_overrides(BASE, ["experiment.rounds"])
    assert info.value.path == "--set"


def test_sweep_is_a_cartesian_product():
    raw = {**BASE, "sweep": {"algorithm.name": ["local", "fedavg"], "experiment.seed": [0, 1, 2]}}
    points = expand_sweep(raw)
    assert len(points) == 6
    assert {(p["algorithm"]["name"], p["experiment"]["seed"]) for _, p in points} == {
        (a, s) for a in ("local", "fedavg") for s in (0, 1, 2)
    }
    assert all("sweep" not in p for _, p in points)


def test_toml_writer_round_trips():
    data = {
        "experiment": {"name": 'a "quoted" name', "seed": 3, "rate": 0.25, "flag": True},
        "model": {"name": "mlp", "params": {"hidden": [200, 100]}, "arch_params": {}},
        "addons": [{"name": "x", "params": {"k": 1}}, {"name": "y", "params": {}}],
        "empty": {},
        "skipped": None,
    }
    parsed = tomllib.loads(dump_toml(data))
    expected = {k: v for k, v in data.items() if v is not None}
    assert parsed == expected


def test_sweep_points_apply_their_overrides_together_and_cross_other_axes():
    raw = copy.deepcopy(BASE)
    raw["sweep"] = {
        "points": [{"algorithm": {"name": "local"}, "training.local_epochs": 3},
                   {"algorithm.name": "fedavg"}],
        "training.lr": [0.1, 0.2],
    }
    points = expand_sweep(raw)
    assert len(points) == 4
    local = [p for s, p in points if p["algorithm"]["name"] == "local"]
    assert all(p["training"]["local_epochs"] == 3 for p in local)
    fedavg = [p for s, p in points if p["algorithm"]["name"] == "fedavg"]
    assert all(p.get("training", {}).get("local_epochs", BASE.get("training", {}).get("local_epochs")) != 3
               for p in fedavg)
    assert sorted(p["training"]["lr"] for p in local) == [0.1, 0.2]


@pytest.mark.parametrize("entry", [[], [3], [{}]])
def test_bad_sweep_points_name_the_entry(entry):
    raw = copy.deepcopy(BASE)
    raw["sweep"] = {"points": entry}
    with pytest.raises(SpecError) as info:
        expand_sweep(raw)
    assert info.value.path.startswith("sweep.points")


@pytest.mark.parametrize("params", [3, [1, 2], "lr=0.1"])
def test_plugin_params_that_are_not_a_table_name_the_key(params):
    from tiny import tiny_raw

    with pytest.raises(SpecError) as info:
        structure(tiny_raw(**{"algorithm.params": params}), Spec)
    assert str(info.value) == f"algorithm.params: expected a table, got {params!r}"
