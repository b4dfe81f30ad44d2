"""A small TOML writer for resolved specs (the subset specs use: tables, arrays, scalars)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dumps(data: dict, _prefix: str = "") -> str:
    """TOML text for a nested dict; None values are left out (TOML has no null)."""
    lines: list[str] = []
    tables: list[tuple[str, dict]] = []
    arrays_of_tables: list[tuple[str, list]] = []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays_of_tables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    out = "\n".join(lines)
    for key, table in tables:
        name = f"{_prefix}{_key(key)}"
        body = dumps(table, name + ".")
        out += f"\n\n[{name}]\n{body}" if out or _prefix else f"[{name}]\n{body}"
    for key, items in arrays_of_tables:
        name = f"{_prefix}{_key(key)}"
        for item in items:
            out += f"\n\n[[{name}]]\n{dumps(item, name + '.')}"
    return out.strip("\n") + ("\n" if not _prefix else "")
