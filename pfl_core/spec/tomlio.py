"""Reading a spec file and a ``--set`` value as TOML (with the limits of
:mod:`pfl_core.spec.validators`), and writing a spec dict back as TOML."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

from pfl_core.errors import SpecError
from pfl_core.spec.convert import join_path
from pfl_core.spec.validators import MAX_NESTING, MAX_SPEC_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise SpecError("", f"cannot read spec file {path}: {exc.strerror or exc}") from None
    if not exists:
        raise SpecError("", f"spec file not found: {path}")
    if is_dir:
        raise SpecError("", f"spec path {path} is a directory, not a TOML file")
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)  # never all of /dev/zero
    except OSError as exc:
        raise SpecError("", f"cannot read spec file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("", f"spec file {path} is larger than {MAX_SPEC_BYTES // 2**20} MiB; is it a spec?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError("", f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                            "TOML files are UTF-8: save it as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("", f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise _too_deep_to_read(sys.exc_info()[2], f"in {path}") from None
    check_nesting(raw)
    return raw


def dump_toml(data: dict) -> str:
    """TOML text for a spec dict (tomli-w), read back by :func:`load_toml` as the same dict.
    Keys whose value is None are left out: TOML has no null, and a missing key takes its
    default, which is what None stands for in a resolved spec."""
    import tomli_w

    def without_none(value):
        if isinstance(value, dict):
            return {k: without_none(v) for k, v in value.items() if v is not None}
        if isinstance(value, (list, tuple)):
            return [without_none(v) for v in value]
        return value

    return tomli_w.dumps(without_none(data))


def _too_deep_to_read(tb, where: str) -> SpecError:
    """The TOML reader recursed out of stack on a deeply nested value: name the key it was
    reading (the outermost key-value pair on the stack of ``tomllib``'s own parser) where
    the stack shows it, else just say so."""
    header, key = (), ()
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "key_value_rule" and not header:
            header = tuple(frame.f_locals.get("header") or ())
        if frame.f_code.co_name == "parse_key_value_pair" and not key:
            key = tuple(frame.f_locals.get("key") or ())
        tb = tb.tb_next
    path = ".".join(str(part) for part in header + key) if key else ""
    return SpecError(path, f"a value {where} is nested too deeply to read; arrays and tables in a spec may "
                           f"nest at most {MAX_NESTING} levels")


def check_nesting(value: Any, path: str = "") -> None:
    """Refuse arrays and tables nested more than MAX_NESTING levels (counted from the top of
    the spec, or of a --set value), naming the key the deep value is under. Iterative: the
    check itself never runs out of stack, and later steps (copies, output) then cannot."""
    stack = [(value, [path] if path else [], 0)]
    while stack:
        node, parts, depth = stack.pop()
        if depth > MAX_NESTING:
            keys = list(itertools.takewhile(lambda p: not p.startswith("["), parts))[:4]
            raise SpecError(join_path(keys), f"is nested more than {MAX_NESTING} levels deep; arrays and "
                                             f"tables in a spec may nest at most {MAX_NESTING} levels")
        if isinstance(node, dict):
            stack.extend((v, parts + [str(k)], depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, parts + [f"[{i}]"], depth + 1) for i, v in enumerate(node))


def parse_value(text: str, key: str = "--set") -> Any:
    """A --set value: TOML syntax (3, 0.1, true, "x", [1, 2]); a bare word is a string.
    ``key`` is the option's dotted key, named when the value is nested too deeply."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise SpecError(key, f"the value is nested too deeply to read; arrays and tables in a spec may nest at "
                             f"most {MAX_NESTING} levels") from None
    check_nesting(value, key)
    return value

