"""docs/spec-reference.md's plugin reference is generated from the code (``pfl docs``) and current:
every parameter of every built-in plugin is in it with its real default, and every validator
says in words what it enforces."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import attrs
import pytest

from pfl_core import registry
from pfl_core.cli import main
from pfl_core.registry import docgen
from pfl_core.spec import at_least, between, finite, greater_than, one_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "spec-reference.md"
PREFIX = {kind: prefix for kind, _, prefix in docgen.SECTIONS}


@pytest.fixture(scope="module")
def generated() -> str:
    return docgen.generate()


def region(text: str) -> str:
    start, end = text.index(docgen.BEGIN), text.index(docgen.END)
    return text[start:end]


def test_spec_reference_is_current(generated):
    text = REFERENCE.read_text(encoding="utf-8")
    expected = docgen.replace_region(text, generated, str(REFERENCE))
    if expected != text:
        diff = "".join(list(difflib.unified_diff(text.splitlines(True), expected.splitlines(True),
                                                 "docs/spec-reference.md", "generated", n=1))[:40])
        pytest.fail(f"docs/spec-reference.md is not current; run: {docgen.COMMAND}\n{diff}")


def sections(text: str) -> dict[str, str]:
    """Plugin name -> its part of the generated region (from its '#### `name`' heading)."""
    parts = re.split(r"^#### `([^`]+)`\n", region(text), flags=re.M)
    return {parts[i]: re.split(r"^### ", parts[i + 1], flags=re.M)[0] for i in range(1, len(parts), 2)}


def table(section: str) -> dict[str, list[str]]:
    """Key -> the row's cells, for the parameter table of one plugin's section."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0] != "`key`":
            rows[cells[0].strip("`")] = cells
    return rows


def default_of(attribute: attrs.Attribute):
    default = attribute.default
    if isinstance(default, attrs.Factory):
        return default.factory()
    return default


def parse_default(cell: str):
    if cell == "required":
        return attrs.NOTHING
    if cell == "none":
        return None
    assert cell.startswith("`") and cell.endswith("`"), cell
    return tomllib.loads(f"v = {cell[1:-1]}")["v"]


def test_every_builtin_parameter_is_documented_with_its_default():
    """Read back from the committed file, not from the generator: a parameter added to a
    plugin, or a default changed, fails here until the reference is regenerated."""
    documented = sections(REFERENCE.read_text(encoding="utf-8"))
    plugins = docgen.builtin_plugins()
    assert {p.name for p in plugins} <= set(documented), f"run: {docgen.COMMAND}"
    checked = 0
    for plugin in plugins:
        section = documented[plugin.name]
        for alias in plugin.aliases:
            assert f"`{alias}`" in section, f"{plugin.name}: alias {alias} not named; run: {docgen.COMMAND}"
        rows = table(section)
        fields = attrs.fields(plugin.cls.Params)
        if not fields:
            assert "No parameters." in section, plugin.name
        for attribute in fields:
            key = f"{PREFIX[plugin.kind]}.{attribute.name}"
            assert key in rows, f"{plugin.name}: {key} is not in docs/spec-reference.md; run: {docgen.COMMAND}"
            default = parse_default(rows[key][2])
            assert default == default_of(attribute), (
                f"{plugin.name}: {key} documented with default {rows[key][2]}, the code has "
                f"{default_of(attribute)!r}; run: {docgen.COMMAND}")
            checked += 1
        assert len(rows) == len(fields), f"{plugin.name}: documents parameters it does not have"
    assert checked > 100


def test_aliases_are_listed_not_duplicated(generated):
    plugins = {p.name: p for p in docgen.builtin_plugins()}
    assert plugins["comet"].aliases == ("perfed_ckt",)
    assert "perfed_ckt" not in plugins
    assert "#### `perfed_ckt`" not in generated


def test_every_validator_of_a_builtin_plugin_says_what_it_enforces():
    assert docgen.undescribed() == [], (
        "give these validators a constraint text with pfl_core.spec.described(...)")


def test_builtin_entry_points_are_the_installed_ones():
    """The reference is built from the installed entry points: an entry point added to
    pyproject.toml but not reinstalled would silently be missing from it."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        declared = set(tomllib.load(fh)["project"]["entry-points"]["pfl"])
    installed = {name for name, entry in registry.discovered().items() if entry.distribution == docgen.DISTRIBUTION}
    assert declared == installed, "reinstall pfl (pip install -e .) so its entry points match pyproject.toml"


def test_validator_texts_leave_the_checks_unchanged():
    assert at_least(0).describe == ">= 0"
    assert greater_than(0).describe == "> 0"
    assert between(0, 1, high_open=True).describe == "in [0, 1)"
    assert finite.describe == "finite"
    assert one_of("sgd", "adam").describe == '"sgd" or "adam"'
    assert one_of("a", "b", "c").describe == '"a", "b" or "c"'

    @attrs.define
    class P:
        x: float = attrs.field(default=1.0, validator=[finite, at_least(0)])
        mode: str = attrs.field(default="a", validator=one_of("a", "b"))

    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        P(x=-1.0)
    with pytest.raises(ValueError, match="must be one of 'a', 'b'"):
        P(mode="c")
    (param,) = [p for p in docgen.param_docs(type("X", (), {"Params": P}), "algorithm.params")
                if p.key.endswith(".x")]
    assert (param.type, param.default, param.constraint) == ("float", "`1.0`", "finite, >= 0")


def test_cli_writes_checks_and_refuses_a_file_without_the_region(tmp_path, capsys, generated):
    doc = tmp_path / "ref.md"
    doc.write_text(f"# Title\n\nprose\n\n{docgen.BEGIN}\nstale\n{docgen.END}\n\nmore prose\n")
    assert main(["docs", "--check", str(doc)]) == 1
    assert f"run: pfl docs --write {doc}" in capsys.readouterr().err
    assert main(["docs", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose\n\n") and text.endswith(f"{docgen.END}\n\nmore prose\n")
    assert generated in text and "stale" not in text
    assert main(["docs", "--check", str(doc)]) == 0
    capsys.readouterr()

    bare = tmp_path / "bare.md"
    bare.write_text("# no region\n")
    assert main(["docs", "--write", str(bare)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pfl docs: error:") and "no generated region" in err and "\n" not in err
    assert main(["docs", "--check", str(tmp_path / "missing.md")]) == 2


def test_every_builtin_parameter_says_what_it_means():
    """The ``meaning`` column: a parameter added without ``metadata={"doc": ...}`` fails."""
    missing = [f"{plugin.name}: {p.key}" for plugin in docgen.builtin_plugins()
               for p in docgen.param_docs(plugin.cls, PREFIX[plugin.kind]) if not p.doc]
    assert missing == [], 'give these fields field(..., metadata={"doc": "what it means"})'
