"""Strict structuring of TOML into the spec's attrs classes (cattrs): values are never coerced,
and any problem becomes one :class:`~pfl_core.errors.SpecError` naming its key path."""

from __future__ import annotations

import datetime
import json
import math
import re
import typing
from typing import Any

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn

from pfl_core.errors import SpecError, did_you_mean
from pfl_core.spec.validators import FLOAT_MAX, INT_MAX, INT_MIN, FieldError, describe_int


def _type_name(value) -> str:
    return type(value).__name__


def shown(value: Any, width: int = 60) -> str:
    """A spec value as an error message shows it, cut to ``width`` characters: Python's repr,
    except that TOML dates and times are spelled as in TOML (never ``datetime.date(...)``)."""

    def text(v):
        if isinstance(v, (datetime.date, datetime.time)):  # datetime.datetime is a date
            return v.isoformat()
        if isinstance(v, list):
            return "[" + ", ".join(map(text, v)) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {text(x)}" for k, x in v.items()) + "}"
        return repr(v)

    out = text(value)
    return out if len(out) <= width else out[: width - 3] + "..."


def _strict(kind, accept, description):
    def structure(value, _type):
        if not accept(value):
            raise TypeError(f"expected {description}, got {shown(value)} ({_type_name(value)})")
        return kind(value)

    return structure


def _in_toml_range(value):
    """TOML integers are 64-bit; Python's reader accepts any length (a 400-digit epoch count
    overflowed later, deep in the run)."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise TypeError(f"expected a 64-bit integer (TOML's range, -2**63 to 2**63 - 1), got {describe_int(value)}")
    return value


def _fits_float32(value):
    """A number for a float key: 1e39 is finite to Python but not to the float32 tensors it
    scales (``training.lr = 1e39`` ended a run as an internal error). inf and nan are left to
    the key's own validators (``finite``), which name what the key accepts."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and abs(value) > FLOAT_MAX:
        raise TypeError(f"expected a number a 32-bit float can hold (|x| <= 3.4e38), got {value:.6g}")
    return value


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    not_bool = lambda v: not isinstance(v, bool)  # noqa: E731
    is_int = _strict(int, lambda v: isinstance(v, int) and not_bool(v), "an integer")
    is_number = _strict(float, lambda v: isinstance(v, (int, float)) and not_bool(v), "a number")
    conv.register_structure_hook(int, lambda v, t: is_int(_in_toml_range(v), t))
    # + 0.0: -0.0 passes ">= 0" yet numpy refuses it as a scale ("scale < 0")
    conv.register_structure_hook(float, lambda v, t: is_number(_fits_float32(_in_toml_range(v)), t) + 0.0)
    conv.register_structure_hook(str, _strict(str, lambda v: isinstance(v, str), "a string"))
    conv.register_structure_hook(bool, _strict(bool, lambda v: isinstance(v, bool), "true or false"))
    conv.register_structure_hook(Any, lambda v, _t: v)
    def list_hook_factory(type_):
        items = list_structure_factory(type_, conv)  # cattrs' own: item errors keep their index

        def structure_list(value, _type):
            if not isinstance(value, list):  # a string or table is not iterated item by item
                raise TypeError(f"expected a list, got {shown(value)} ({_type_name(value)})")
            return items(value, _type)

        return structure_list

    conv.register_structure_hook_factory(lambda t: typing.get_origin(t) is list, list_hook_factory)

    def table_hook_factory(cls):
        fields = make_dict_structure_fn(cls, conv)

        def structure_table(value, _type):
            if not isinstance(value, dict):  # else cattrs' "'int' object has no attribute 'keys'"
                raise TypeError(f"expected a table, got {shown(value)} ({_type_name(value)})")
            return fields(value, _type)

        return structure_table

    conv.register_structure_hook_factory(attrs.has, table_hook_factory)
    return conv


converter = make_converter()


# Keys renamed for one vocabulary across the methods (issue 13; docs/writing-a-plugin.md, "Naming
# parameters"): old key -> (new key, how to translate). A spec that still uses the old key gets
# ``<path>.<old>: renamed to <new> (<how>)`` wherever the table it is in has the new key; there
# is no silent alias. Data only: a plugin that renames a parameter adds a row here.
RENAMED_KEYS: dict[str, tuple[str, str]] = {
    "split": ("head_layers", "the number of parameterised layers, counted from the output, that form "
                             "the head: split = -j is head_layers = j, split = k is head_layers = L - k; "
                             "none is still the middle"),
    "fixed_lambda": ("lam", "lambda is spelled lam in every plugin; same meaning and default"),
}


def _renamed(extra: str, known: list[str]) -> str | None:
    new, how = RENAMED_KEYS.get(extra, (None, ""))
    return f"renamed to {new} ({how})" if new in known else None


def _first_error(exc: BaseException, path: list[str]) -> tuple[list[str], str]:
    """Walk cattrs' exception groups down to the first leaf: (key path, message)."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            sub_path = list(path)
            for note in getattr(sub, "__notes__", []):
                if hasattr(note, "name"):
                    sub_path.append(str(note.name))
                elif hasattr(note, "index"):
                    sub_path.append(f"[{note.index}]")
            return _first_error(sub, sub_path)
        return path, str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [a.name for a in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        extra = sorted(exc.extra_fields)[0]
        renamed = _renamed(extra, known)
        if renamed:
            return path + [extra], renamed
        hint = did_you_mean(extra, known)
        valid = f"valid keys here: {', '.join(known)}" if known else "this table takes no keys"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", extra):  # spelled as in TOML: "", " ", "a.b"
            extra = json.dumps(extra, ensure_ascii=False)
        return path + [extra], f"unknown key{hint}; {valid}"
    if isinstance(exc, FieldError):
        return path + [exc.name], exc.message
    if isinstance(exc, KeyError):
        key = str(exc.args[0])
        return (path if path[-1:] == [key] else path + [key]), "required key is missing"
    if isinstance(exc, AttributeError) and exc.name == "items":  # a mapping field given a scalar or list
        return path, f"expected a table, got {shown(exc.obj)}"
    return path, str(exc)


def join_path(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if part.startswith("["):
            out += part
        else:
            out += ("." if out else "") + part
    return out


def structure(data: Any, cls: type, path: str = ""):
    """Structure ``data`` into ``cls``; any problem becomes a SpecError naming the key path."""
    prefix = [path] if path else []
    if not isinstance(data, dict) and attrs.has(cls):
        raise SpecError(path, f"expected a table, got {shown(data)} ({_type_name(data)})")
    try:
        return converter.structure(data, cls)
    except SpecError:
        raise
    except Exception as exc:  # cattrs raises exception groups; reduce to one line
        parts, message = _first_error(exc, prefix)
        raise SpecError(join_path(parts), message) from None


def unstructure(obj) -> Any:
    return converter.unstructure(obj)


