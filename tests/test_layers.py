"""The package structure holds: no import circle, no import from a lower layer to a higher one
(the layers as docs/architecture.md lists them), plugins take pfl's machinery only from
``pfl_core.api``, and nothing installs a top-level package named ``plugins``.

Read from the source (``ast``, every import, function-level ones too), by
``scripts/import_graph.py``, the script that prints the same graph's figures.
"""

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Modules that are one concern and read best whole, above the ~500-line guideline (say why in
# docs/architecture.md, "Packages").
LONG_MODULES = {"pfl_core.models.zoo"}
MAX_LINES = 500


def documented_layers(text: str | None = None) -> list[list[str]]:
    """The layer list of docs/architecture.md, lowest first: lines ``N  name name ...  # what``
    between the markers, numbered 1 (lowest) up, in any order."""
    text = text if text is not None else ARCHITECTURE.read_text()
    block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    numbered = {}
    for line in block.splitlines():
        found = re.match(r"^\s*(\d+)\s+([\w.\s]+?)\s*(#.*)?$", line)
        if found:
            assert int(found.group(1)) not in numbered, f"layer {found.group(1)} listed twice"
            numbered[int(found.group(1))] = found.group(2).split()
    assert sorted(numbered) == list(range(1, len(numbered) + 1)), "layers are numbered 1, 2, ... without gaps"
    return [numbered[i] for i in sorted(numbered)]


def unit(module: str) -> str:
    """What a layer lists: a pfl_core subpackage or top-level module (``runtime``, ``errors``),
    ``pfl_core`` for the package's own __init__, ``plugins`` for every plugin."""
    parts = module.split(".")
    if parts[0] == "plugins":
        return "plugins"
    return parts[1] if len(parts) > 1 else "pfl_core"


@pytest.fixture(scope="module")
def graph():
    return {m: t for m, t in import_graph.module_graph(ROOT).items() if not m.startswith("benchmarks")}


def test_no_import_circle_among_modules_or_packages(graph):
    assert import_graph.circles(graph) == []
    packages = {}
    for module, targets in graph.items():
        packages.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert import_graph.circles(packages) == []


def test_every_import_goes_down_the_documented_layers(graph):
    layers = documented_layers()
    floor = {name: i for i, names in enumerate(layers) for name in names}
    units = {unit(m) for m in graph}
    assert units - set(floor) == set(), "a package or module missing from docs/architecture.md's layer list"
    assert set(floor) - units == set(), "docs/architecture.md lists a layer member the code does not have"
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
              if unit(t) != unit(m) and floor[unit(t)] >= floor[unit(m)]]
    assert upward == [], "imports to the same or a higher layer (each layer imports only from the ones below)"


def test_the_layer_check_catches_an_upward_import_and_a_circle():
    """The checks above are not vacuous: an upward import and a circle are found."""
    layers = documented_layers("<!-- layers -->\n2  spec   # notes\n1  errors\n<!-- /layers -->")
    assert layers == [["errors"], ["spec"]]
    floor = {"errors": 0, "spec": 1}
    assert floor[unit("pfl_core.spec.schema")] > floor[unit("pfl_core.errors")]
    assert import_graph.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_graph.floors({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == {"a": 2, "b": 1, "c": 3}


def plugin_files():
    return sorted(p for p in (ROOT / "plugins").rglob("*.py") if "__pycache__" not in p.parts)


def imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


@pytest.mark.parametrize("path", [*plugin_files(), *sorted((ROOT / "examples").rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_take_pfl_machinery_only_from_the_api(path):
    """From pfl_core only ``pfl_core.api``; from another plugin only its plugin classes (FedProx on
    FedAvg), never a helper: those live in pfl_core and reach plugins through the api."""
    from pfl_core.registry import Plugin

    for module, names in imports_of(path):
        top = module.split(".")[0]
        assert top != "plugins", f"{module}: the plugins are installed as pfl_plugins"
        if top == "pfl_core":
            assert module == "pfl_core.api", f"imports {module}; take it from pfl_core.api"
        if top == "pfl_plugins":
            for name in names:
                value = getattr(importlib.import_module(module), name)
                assert isinstance(value, type) and issubclass(value, Plugin) and value.name, \
                    f"imports {name} from {module}: only plugin classes come from other plugins"


def test_the_api_exports_what_it_lists():
    import pfl_core.api as api

    assert sorted(api.__all__) == sorted(set(api.__all__))
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_the_plugins_folder_holds_only_plugins():
    """Every package under plugins/ provides an entry point of the pfl group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry_modules = {value.split(":")[0] for value in project["project"]["entry-points"]["pfl"].values()}
    folders = {f"pfl_plugins.{p.parent.name}" for p in (ROOT / "plugins").glob("*/__init__.py")}
    assert folders - entry_modules == set(), "a folder under plugins/ that is no plugin"
    assert sorted(p.name for p in (ROOT / "plugins").glob("*.py")) == ["__init__.py"]


def test_every_package_is_installed_and_none_is_named_plugins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"pfl_plugins": "plugins"}
    packages = set(setuptools["packages"])
    assert not any(p == "plugins" or p.startswith("plugins.") for p in packages)
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pfl_core").rglob("__init__.py")}
    on_disk |= {"pfl_plugins" + ".".join(("", *p.parent.relative_to(ROOT / "plugins").parts)).rstrip(".")
                for p in (ROOT / "plugins").rglob("__init__.py")}
    assert packages == on_disk, "pyproject.toml's [tool.setuptools] packages must list every package"


def test_loading_every_plugin_imports_no_top_level_plugins_package():
    probe = ("import sys; from pfl_core import registry\n"
             "[registry.plugin_class(n) for n in registry.discovered()]\n"
             "print(sorted(m for m in sys.modules if m == 'plugins' or m.startswith('plugins.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_modules_stay_small_unless_documented(graph):
    sizes = {m: sum(1 for _ in path.open()) for m, path in import_graph.source_modules(ROOT).items()
             if m.startswith("pfl_core")}
    assert {m for m, n in sizes.items() if n > MAX_LINES} <= LONG_MODULES
    text = ARCHITECTURE.read_text()
    assert all(m.split(".", 1)[1].replace(".", "/") + ".py" in text for m in LONG_MODULES)


@pytest.mark.parametrize("old, new", [("pfl_core.context", "pfl_core.runtime.context"),
                                      ("pfl_core.runner", "pfl_core.study"),
                                      ("pfl_core.executors", "pfl_core.execution")])
def test_a_flat_path_of_pfl_0_1_is_a_deprecated_alias_of_its_new_module(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    sys.modules.pop(old, None)


def test_deprecated_aliases_name_modules_that_exist():
    from pfl_core import _deprecated

    for old, new in _deprecated.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} exists; it is no alias"
