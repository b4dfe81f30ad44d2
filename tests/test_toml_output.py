"""The spec's TOML writer (tomli-w): what it writes reads back as the same spec."""

import datetime
import math

import tomllib
from tiny import tiny_raw

from pfl_core.engine import resolve
from pfl_core.spec import dump_toml


def same(a, b) -> bool:
    """Equality with nan equal to nan (a spec may hold one; nan != nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_every_kind_of_value_reads_back_the_same():
    data = {
        "experiment": {"name": 'a "quoted"\nname\twith \\ escapes', "seed": 3, "flag": True, "date": datetime.date(2024, 5, 1)},
        "training": {"lr": 1e-5, "big": 1e300, "neg": -0.0, "inf": math.inf, "ninf": -math.inf, "nan": math.nan,
                     "int": 2**62},
        "sweep": {"training.lr": [0.01, 0.05], "model.params.hidden": [[16], [32, 32]], "odd key é": ["x"]},
        "addons": [{"name": "x", "params": {"k": [1, 2], "deep": {"a": {"b": 1}}}}, {"name": "y", "params": {}}],
        "model": {"params": {"hidden": [200, 100]}, "arch_params": {"lenet5": {"width": 0.4}}},
        "empty": {},
        "empty_list": [],
    }
    back = tomllib.loads(dump_toml(data))
    assert same(back, data), back
    assert math.copysign(1, back["training"]["neg"]) == -1  # -0.0 stays negative


def test_none_is_left_out_at_any_depth():
    data = {"a": None, "b": {"c": None, "d": 1}, "addons": [{"name": "x", "params": {"p": None}}]}
    assert tomllib.loads(dump_toml(data)) == {"b": {"d": 1}, "addons": [{"name": "x", "params": {}}]}


def test_a_resolved_spec_resolves_again_to_itself():
    """The resolved_spec.toml artifact re-runs the same experiment: written, read and resolved
    again, it gives the same resolved spec (seeds, lists, empty tables, add-ons included)."""
    raw = tiny_raw(**{"algorithm.name": "fedprox", "experiment.seeds": [0, 1], "training.lr": 1e-5})
    raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [1]}}]
    resolved = resolve(raw)
    again = resolve(tomllib.loads(resolved.toml()))
    assert again.as_dict == resolved.as_dict
    assert again.spec.training.lr == 1e-5 and again.spec.experiment.seeds == [0, 1]
