"""The built-in plugins' parameter reference, generated from the code (``pfl docs``).

For every plugin the ``pfl`` distribution registers (entry points in its ``pyproject.toml``),
grouped by kind: its name (and aliases: other entry-point names for the same class), the
first paragraph of its class docstring (of its module's where the class has none), and a
table of its ``Params`` fields: the key as a spec writes it, type, default, the constraint its
validators enforce (their ``describe`` text, see :func:`pfl_core.spec.described`) and the
field's ``metadata["doc"]``.

``docs/spec-reference.md`` holds the output between :data:`BEGIN` and :data:`END`;
``pfl docs --write docs/spec-reference.md`` replaces that region, ``pfl docs --check`` tells
whether it is current (``tests/test_docs.py`` does the same).
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import attrs

from pfl_core.errors import PflError
from pfl_core.registry import plugins as registry

BEGIN = "<!-- generated: pfl docs; do not edit by hand -->"
END = "<!-- end generated -->"
COMMAND = "pfl docs --write docs/spec-reference.md"
DISTRIBUTION = "pfl"

# Kind, heading, and the key under which a spec sets that kind's parameters.
SECTIONS = (
    (registry.ALGORITHM, "Algorithms", "algorithm.params"),
    (registry.ADDON, "Add-ons", "addons[].params"),
    (registry.DATASET, "Datasets", "data.params"),
    (registry.PARTITIONER, "Partitioners", "partition.params"),
    (registry.MODEL, "Models", "model.params"),
)
WIDTH = 92


@attrs.frozen
class PluginDoc:
    name: str
    kind: str
    cls: type
    aliases: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.cls.__module__}:{self.cls.__qualname__}"


@attrs.frozen
class ParamDoc:
    key: str  # as a spec writes it: algorithm.params.mu
    type: str
    default: str  # markdown: `0.01`, none, required
    constraint: str
    doc: str
    undescribed: tuple[str, ...] = ()  # validators without a describe text


def builtin_plugins(distribution: str = DISTRIBUTION) -> list[PluginDoc]:
    """The plugins ``distribution`` registers, one per class: the entry point named like the
    class's ``name`` is the plugin, the others are its aliases."""
    by_class: dict[type, list[str]] = {}
    for name, entry in sorted(registry.discovered().items()):
        if entry.distribution != distribution:
            continue
        by_class.setdefault(registry.plugin_class(name), []).append(name)
    plugins = []
    for cls, names in by_class.items():
        main = cls.name if cls.name in names else names[0]
        plugins.append(PluginDoc(main, cls.kind, cls, tuple(n for n in names if n != main)))
    return sorted(plugins, key=lambda p: p.name)


# ---------------------------------------------------------------------------
# Text from the code


def first_paragraph(cls: type) -> str:
    """The first paragraph of the class's own docstring, else of its module's, as one line
    with reStructuredText literals and roles turned into Markdown code spans."""
    doc = cls.__dict__.get("__doc__") or sys.modules[cls.__module__].__doc__ or ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return markdown_text(" ".join(paragraph.split()))


def markdown_text(text: str) -> str:
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def type_text(tp: Any) -> str:
    """``int`` -> integer, ``Optional[float]`` -> float, ``list[str]`` -> list of strings."""
    names = {int: "integer", float: "float", str: "string", bool: "bool", Any: "any"}
    if tp in names:
        return names[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_text(a) for a in rest)
    if origin in (list, tuple):
        item = type_text(args[0]) if args else "any"
        return "list" if item == "any" else f"list of {_plural(item)}"
    if origin is dict:
        value = type_text(args[1]) if len(args) == 2 else "any"
        return "table" if value == "any" else f"table of {_plural(value)}"
    return getattr(tp, "__name__", str(tp))


def _plural(word: str) -> str:
    if word.startswith("table of ") or word.startswith("list of "):
        return word.replace("table of", "tables of", 1).replace("list of", "lists of", 1)
    return word if word.endswith("s") else word + "s"


def toml_value(value: Any) -> str:
    """``value`` as it is written in a spec, on one line (tomli-w writes an array one item a
    line: joined here)."""
    import tomli_w

    if isinstance(value, dict):  # tomli-w writes a table value as a [table], not inline
        keys = [tomli_w.dumps({k: 0}).rsplit(" = ", 1)[0] for k in value]  # quoted where needed
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in zip(keys, value.values())) + "}"
    text = tomli_w.dumps({"v": value}, indent=0).removeprefix("v = ").rstrip("\n")
    return text.replace("[\n", "[").replace(",\n]", "]").replace(",\n", ", ")  # strings escape newlines


def default_text(attribute: attrs.Attribute) -> str:
    default = attribute.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):
        if default.takes_self:
            return "computed"
        default = default.factory()
    if default is None:
        return "none"
    return f"`{toml_value(default)}`"


def validator_texts(validator) -> tuple[list[str], list[str]]:
    """(descriptions, names of validators without one); ``[a, b]`` validators in order."""
    if validator is None:
        return [], []
    inner = getattr(validator, "_validators", None)  # attrs' and_(), what a list becomes
    if inner is not None:
        texts, missing = [], []
        for item in inner:
            t, m = validator_texts(item)
            texts += t
            missing += m
        return texts, missing
    text = getattr(validator, "describe", None)
    if text:
        return [text], []
    name = getattr(validator, "__qualname__", None) or repr(validator)
    return [f"checked by `{name}`"], [name]


def param_docs(cls: type, prefix: str) -> list[ParamDoc]:
    params = cls.Params
    try:
        hints = typing.get_type_hints(params)
    except Exception:  # an annotation that does not resolve: shown as written
        hints = {}
    out = []
    for attribute in attrs.fields(params):
        texts, missing = validator_texts(attribute.validator)
        out.append(ParamDoc(
            key=f"{prefix}.{attribute.name}",
            type=type_text(hints.get(attribute.name, attribute.type)),
            default=default_text(attribute),
            constraint=", ".join(texts),
            doc=" ".join(str(attribute.metadata.get("doc", "")).split()),
            undescribed=tuple(missing),
        ))
    return out


# ---------------------------------------------------------------------------
# Markdown


def _no_tags(text: str) -> str:
    """``<`` escaped outside code spans (``<key>_train`` would otherwise be an HTML tag)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    """Text for a table cell: Markdown code, no tags, ``|`` escaped."""
    return _no_tags(markdown_text(text)).replace("|", "\\|")


def _constraint_cell(text: str) -> str:
    """Quoted choices as code: ``"sgd" or "adam"`` -> ```"sgd"` or `"adam"```."""
    return re.sub(r'("[^"]*")', r"`\1`", _cell(text))


def plugin_markdown(plugin: PluginDoc, prefix: str) -> str:
    lines = [f"#### `{plugin.name}`", ""]
    aliases = ", ".join(f"`{a}`" for a in plugin.aliases)
    also = f"; also registered as {aliases} (an alias: the same class)" if aliases else ""
    lines += [f"*{plugin.kind}*, `{plugin.where}`{also}.", ""]
    summary = _no_tags(first_paragraph(plugin.cls))
    if summary:
        lines += [textwrap.fill(summary, WIDTH, break_long_words=False, break_on_hyphens=False), ""]
    params = param_docs(plugin.cls, prefix)
    if not params:
        lines += ["No parameters.", ""]
        return "\n".join(lines)
    lines += ["| key | type | default | constraint | meaning |", "|---|---|---|---|---|"]
    for p in params:
        lines.append(f"| `{p.key}` | {_cell(p.type)} | {p.default.replace('|', chr(92) + '|')} | "
                     f"{_constraint_cell(p.constraint)} | {_cell(p.doc)} |")
    return "\n".join(lines) + "\n"


def generate(distribution: str = DISTRIBUTION) -> str:
    """The generated region's Markdown (without the marker lines)."""
    plugins = builtin_plugins(distribution)
    parts = [f"<!-- regenerate: {COMMAND} (pfl_core/registry/docgen.py) -->", ""]
    for kind, heading, prefix in SECTIONS:
        members = [p for p in plugins if p.kind == kind]
        if not members:
            continue
        parts += [f"### {heading}", ""]
        parts += [plugin_markdown(p, prefix) for p in members]
    others = sorted({p.kind for p in plugins} - {kind for kind, _, _ in SECTIONS})
    for kind in others:  # a kind added to the registry but not here yet: still documented
        parts += [f"### {kind}", ""]
        parts += [plugin_markdown(p, f"{kind}.params") for p in plugins if p.kind == kind]
    return "\n".join(parts).rstrip("\n") + "\n"


def undescribed(distribution: str = DISTRIBUTION) -> list[str]:
    """``key: validator`` for every validator of a built-in plugin without a describe text."""
    prefixes = {kind: prefix for kind, _, prefix in SECTIONS}
    out = []
    for plugin in builtin_plugins(distribution):
        for p in param_docs(plugin.cls, prefixes.get(plugin.kind, f"{plugin.kind}.params")):
            out += [f"{plugin.name}: {p.key}: {name}" for name in p.undescribed]
    return out


# ---------------------------------------------------------------------------
# `pfl plugins`: the listing

LISTING_WIDTH = 100  # columns a `pfl plugins` line fits in
MIN_LAST_COLUMN = 30  # narrower than this, the last column starts on a line of its own


def listing_lines(header: tuple, rows: list[tuple], width: int = LISTING_WIDTH) -> list[str]:
    """A plain-text table in ``width`` columns: every column but the last padded to its widest
    cell; the last (``pfl plugins``' hooks, or a broken plugin's import error) wrapped between
    words, its continuation lines indented under it."""
    fixed = len(header) - 1
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(fixed)]
    indent = sum(widths) + 2 * fixed
    lines = []
    for row in [header, *rows]:
        lead = "  ".join(str(v).ljust(w) for v, w in zip(row[:fixed], widths)) + "  "
        if width - indent >= MIN_LAST_COLUMN:
            parts = textwrap.wrap(str(row[fixed]), width - indent) or [""]
            lines.append((lead + parts[0]).rstrip())
            lines += [" " * indent + part for part in parts[1:]]
        else:  # very long names: the last column goes below the row, indented
            lines.append(lead.rstrip())
            lines += ["    " + part for part in textwrap.wrap(str(row[fixed]), width - 4)]
    return lines


# ---------------------------------------------------------------------------
# The region in a file


def _split(text: str, path: str) -> tuple[str, str, str]:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise PflError(f"{path} has no generated region: put a line '{BEGIN}' and, after it, "
                       f"a line '{END}' where the reference belongs")
    head = text[: start + len(BEGIN)]
    return head, text[start + len(BEGIN): end], text[end:]


def replace_region(text: str, generated: str, path: str = "the file") -> str:
    head, _, tail = _split(text, path)
    return f"{head}\n{generated}\n{tail}"  # a blank line ends the last table before the marker


def read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PflError(f"cannot read {path}: {exc.strerror or exc}") from None


def is_current(path: str | Path, generated: str | None = None) -> bool:
    text = read(path)
    return replace_region(text, generate() if generated is None else generated, str(path)) == text


def write(path: str | Path, generated: str | None = None) -> bool:
    """Replace the region in ``path``; True when the file changed."""
    text = read(path)
    new = replace_region(text, generate() if generated is None else generated, str(path))
    if new == text:
        return False
    Path(path).write_text(new, encoding="utf-8")
    return True
