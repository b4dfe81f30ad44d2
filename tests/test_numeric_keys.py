"""Every number a spec holds is checked where it is read: the fuzzer's classes of values (huge,
tiny, negative, zero, NaN, inf, a string, a newline) through every int and float key of the spec
schema end in a resolved spec or in one SpecError naming that key, never in anything else; and
what resolves runs one round to exit 0 or to one line with exit 2, never an internal error.

(``training.lr = 1e39`` passed validation and ``--dry-run``, then ended as "internal error": a
float the float32 tensors cannot hold.)
"""

from __future__ import annotations

import typing

import attrs
import pytest
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.spec import Spec

VALUES = {  # the fuzzer's classes, as TOML values (spec files hold the same)
    "huge": "1e39", "huger": "1e308", "huge int": str(2**62), "tiny": "1e-320", "negative": "-1", "zero": "0",
    "nan": "nan", "inf": "inf", "-inf": "-inf", "string": '"x"', "newline": '"a\\nb"',
}
# Keys whose accepted values a one-round run would not finish with (rounds, epochs, sizes: a
# valid 2**62 is a run of that length, not an error); they are only resolved.
NOT_RUN = ("experiment.rounds", "training.local_epochs", "experiment.coldstart_epochs")


def numeric_keys(cls=Spec, prefix: str = "") -> list[tuple[str, type]]:
    """Every int and float field of the spec's attrs classes, as dotted keys."""
    out = []
    for field in attrs.fields(cls):
        tp = field.type
        if isinstance(tp, str):
            tp = typing.get_type_hints(cls)[field.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        inner = args[0]
        if attrs.has(inner):
            out += numeric_keys(inner, f"{prefix}{field.name}.")
        elif inner in (int, float) or typing.get_origin(inner) is list and typing.get_args(inner)[0] in (int, float):
            out.append((f"{prefix}{field.name}", inner))
    return out


KEYS = numeric_keys()


def test_the_schema_has_the_numeric_keys_it_should():
    names = [k for k, _ in KEYS]
    for key in ("training.lr", "training.weight_decay", "training.momentum", "experiment.rounds",
                "partition.num_clients", "experiment.seeds", "evaluation.every"):
        assert key in names, key


def _parsed(text: str):
    from pfl_core.spec import parse_value

    return parse_value(text)


@pytest.mark.parametrize("key", [k for k, _ in KEYS])
def test_every_value_class_resolves_or_is_one_error_naming_the_key(key):
    accepted = []
    for label, text in VALUES.items():
        value = _parsed(text)
        if key == "experiment.seeds":
            value = [value]
        try:
            resolve(tiny_raw(**{key: value}))
        except SpecError as exc:
            assert exc.path.startswith(key) or exc.path.startswith(key.split(".")[0]), (label, exc.path, str(exc))
            assert "\n" not in str(exc).replace("\\n", ""), (label, str(exc))
            continue
        accepted.append(label)
    assert "string" not in accepted and "newline" not in accepted
    assert "huge" not in accepted and "huger" not in accepted or _type(key) is int


def _type(key: str):
    return dict(KEYS)[key]


RUN = ([(k, label) for k, t in KEYS if t is float and k not in NOT_RUN for label in ("tiny", "zero", "negative")]
       # a huge int passes validation where a key has no upper bound: it must still run or be one line
       # (executor.threads = 2**62 reached torch.set_num_threads and was an internal error)
       + [(k, "huge int") for k, t in KEYS if t is int and k not in NOT_RUN])


@pytest.mark.parametrize("key, label", RUN)
def test_a_value_of_each_class_runs_a_round_or_is_one_line(tmp_path, capsys, key, label):
    """Resolved or not (1e-320 is 0.0 once a run has set the CPU to flush denormals), the
    command line ends in exit 0 or in one line with exit 2."""
    code = run_main([write_spec(tmp_path, tiny_raw(**{"experiment.rounds": 1})), "--quiet", "--set",
                     f"{key}={VALUES[label]}"])
    err = capsys.readouterr().err.strip()
    assert code in (0, 2), err
    assert "internal error" not in err and err.count("\n") == 0, err
    if code == 2:
        assert err.startswith(f"pfl-run: error: {key}: "), err


@pytest.mark.parametrize("key, value", [("training.lr", "1e39"), ("training.lr", "1e308"),
                                        ("training.weight_decay", "1e39")])
def test_dry_run_refuses_a_float_no_tensor_can_hold_naming_the_key(tmp_path, capsys, key, value):
    code = run_main([write_spec(tmp_path, tiny_raw()), "--dry-run", "--set", f"{key}={value}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and f"{key}: expected a number a 32-bit float can hold" in err, err


def test_a_newline_in_a_users_value_is_echoed_escaped_on_one_line(tmp_path, capsys):
    code = run_main([str(tmp_path / "no\nsuch.toml")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no\\nsuch.toml" in err, err


def test_the_float32_bound_is_exact():
    """float32's largest value is accepted; the next double above it is not."""
    import math

    from pfl_core.spec import FLOAT_MAX

    assert resolve(tiny_raw(**{"training.weight_decay": FLOAT_MAX})).spec.training.weight_decay == FLOAT_MAX
    with pytest.raises(SpecError, match="training.weight_decay: expected a number a 32-bit float can hold"):
        resolve(tiny_raw(**{"training.weight_decay": math.nextafter(FLOAT_MAX, math.inf)}))
    with pytest.raises(SpecError, match="training.lr"):
        resolve(tiny_raw(**{"training.lr": -math.nextafter(FLOAT_MAX, math.inf)}))
