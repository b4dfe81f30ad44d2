"""``--set`` overrides and ``--sweep`` axes on a raw spec dict, and the expansion of a
``[sweep]`` table into the raw spec of each point."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import attrs

from pfl_core.errors import SpecError, did_you_mean
from pfl_core.spec.convert import _type_name, shown
from pfl_core.spec.schema import Spec
from pfl_core.spec.tomlio import parse_value, tomllib
from pfl_core.spec.validators import MAX_SWEEP_POINTS

# A sweep axis whose values are whole sets of overrides applied together (zipped, not
# crossed): one method with its own budget settings per entry.
POINTS = "points"


def split_key(dotted: str) -> list[str]:
    """``a.b."c.d"`` -> ["a", "b", "c.d"]: TOML's own dotted-key rules, so a quoted part (a
    sweep axis named by a dotted key) stays one part."""
    try:
        node = tomllib.loads(f"{dotted} = 0")
    except tomllib.TOMLDecodeError:
        raise SpecError("--set", f"{dotted!r} is not a dotted key (quote parts that contain dots: "
                                 f'sweep."training.lr")') from None
    parts = []
    while isinstance(node, dict):
        (key, node), = node.items()
        parts.append(key)
    return parts


def set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict; list items are addressed as ``addons.0.params.x``."""
    parts = split_key(dotted)
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(".".join(parts[: i + 1]), f"no list item {part}")
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            if parts[i + 1].isdigit():
                raise SpecError(".".join(parts[: i + 1]), f"has no list item {parts[i + 1]} to set")
            node[part] = {}
        elif not isinstance(node[part], (dict, list)):
            raise SpecError(".".join(parts[: i + 1]), "is a value, not a table")
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise SpecError(dotted, f"no list item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def _split_override(item: str, option: str) -> tuple[str, str]:
    if "=" not in item:
        raise SpecError(option, f"expected dotted.key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise SpecError(option, f"empty key in {item!r}")
    return key, text.strip()


def swept_axes_replaced(sweep: dict, key: str) -> list[str]:
    """The sweep axes a ``--set key=...`` decides: the same key, a key inside it, or the
    table it is inside (``algorithm.name`` decides the axis ``algorithm``)."""
    return [axis for axis in sweep if axis == key or axis.startswith(key + ".") or key.startswith(axis + ".")]


def apply_overrides(raw: dict, overrides: list[str], sweeps: list[str] = (), no_sweep: bool = False,
                    notes: list[str] | None = None) -> dict:
    """Apply ``--set`` overrides, then ``--sweep`` axes (``key=v1,v2`` or ``key=[v1, v2]``);
    ``no_sweep`` drops the spec's sweep. A ``--set`` on a key the spec sweeps replaces that axis
    with the single value, and says so in ``notes``."""
    raw = copy.deepcopy(raw)
    if no_sweep:
        raw.pop("sweep", None)
    for item in overrides:
        key, text = _split_override(item, "--set")
        sweep = raw.get("sweep")
        if isinstance(sweep, dict) and split_key(key)[0] != "sweep":
            for axis in swept_axes_replaced(sweep, key):
                sweep.pop(axis)
                if notes is not None:
                    notes.append(f"--set {key} replaces the spec's sweep over {axis}")
        set_dotted(raw, key, parse_value(text, key))
    for item in sweeps:
        key, text = _split_override(item, "--sweep")
        value = parse_value(text, key)
        if not isinstance(value, list):
            value = [parse_value(v.strip(), key) for v in text.split(",")]
        if not value or any(v == "" for v in value):
            raise SpecError(f"--sweep {key}", f"expected key=v1,v2,... or key=[v1, v2], got {item!r}")
        sweep = raw.setdefault("sweep", {})
        if not isinstance(sweep, dict):
            raise SpecError("sweep", "expected a table of dotted.key = [values]")
        sweep[key] = value
    return raw


def expand_sweep(raw: dict) -> list[tuple[dict[str, Any], dict]]:
    """The raw spec for each point of the sweep's cartesian product, with its settings."""
    sweep = raw.get("sweep", {})
    if not isinstance(sweep, dict):  # `sweep = []` is not "no sweep"
        raise SpecError("sweep", f"expected a table of dotted.key = [values], got {_type_name(sweep)} {shown(sweep)}")
    for key, values in sweep.items():
        if isinstance(values, dict):
            raise SpecError(f"sweep.{key}", "a sweep axis is one quoted dotted key with a list of values, e.g. "
                                            f'sweep."{key}.x" = [1, 2] in TOML, or --sweep {key}.x=1,2')
        if not isinstance(values, list) or not values:
            raise SpecError(f"sweep.{key}", "expected a non-empty list of values")
    for i, entry in enumerate(sweep.get(POINTS, [])):
        if not isinstance(entry, dict) or not entry:
            raise SpecError(f"sweep.{POINTS}[{i}]", "expected a table of dotted.key = value overrides, e.g. "
                                                    '{ algorithm = { name = "local" }, "training.local_epochs" = 3 }')
        for key in entry:
            _check_swept_key(key, f"sweep.{POINTS}[{i}].{key}")
    for key in sweep:
        if key != POINTS:
            _check_swept_key(key, f"sweep.{key}")
    sizes = [len(values) for values in sweep.values()]
    if math.prod(sizes) > MAX_SWEEP_POINTS:
        raise SpecError("sweep", f"expands to {math.prod(sizes)} points ({' x '.join(map(str, sizes))} values), "
                                 f"above the limit of {MAX_SWEEP_POINTS} sweep points; split it over several specs or "
                                 "narrow it with --set/--sweep")
    base = {k: v for k, v in raw.items() if k != "sweep"}
    keys = list(sweep)
    points = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        point = copy.deepcopy(base)
        settings = dict(zip(keys, combo))
        for key, value in settings.items():
            for dotted, item in (value.items() if key == POINTS else [(key, value)]):
                set_dotted(point, dotted, item)
        points.append((settings, point))
    return points


def _check_swept_key(key: str, path: str) -> None:
    """A swept key must lead into a section of the spec; else the points' own errors would name
    a key (``nonsense: unknown key``) that is nowhere in the file."""
    try:
        section = split_key(key)[0]
    except SpecError:
        raise SpecError(path, f"{key!r} is not a dotted key into the spec, e.g. \"training.lr\"") from None
    sections = [f.name for f in attrs.fields(Spec) if f.name not in ("sweep", "budget")]
    if section not in sections:
        raise SpecError(path, f"sets '{section}', which is not a section of the spec"
                              f"{did_you_mean(section, sections)}; sections: {', '.join(sections)}")

