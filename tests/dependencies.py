"""What pyproject.toml declares (the core dependencies and each optional extra) and what the
source imports: read by tests/test_fresh_install.py and by conftest.py's skip policy."""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("pfl_core", "plugins")
FIRST_PARTY = {"pfl_core", "pfl_plugins", "plugins"}
# Extras that hold tools for working on pfl, not features of it: no pfl code imports them.
DEVELOPMENT_EXTRAS = {"test"}


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them (``tomli_w`` = ``tomli-w``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """``"ray[client]==2.60.0"`` -> ``ray``; ``"tomli>=2.0; python_version < '3.11'"`` -> ``tomli``."""
    return normalized(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


@functools.cache
def declared() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(the core dependencies, {extra: its distributions}) of pyproject.toml, normalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = frozenset(requirement_name(r) for r in project["dependencies"])
    extras = {extra: frozenset(requirement_name(r) for r in reqs)
              for extra, reqs in project.get("optional-dependencies", {}).items()}
    return core, extras


@functools.cache
def _installed_providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The distributions that provide top-level module ``module``: from the installed metadata,
    else (a package not installed here, such as an extra's) the distribution of the same name."""
    return {normalized(d) for d in _installed_providers().get(module, [])} or {normalized(module)}


def imported_modules(roots=SOURCE_ROOTS, base: Path = ROOT) -> dict[str, list[str]]:
    """{top-level module: ["file:line", ...]} of every absolute ``import`` and ``from ... import``
    in the source folders, those inside functions and ``if`` blocks included; the standard
    library and pfl's own packages left out."""
    found: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in FIRST_PARTY or top == "__future__":
                        continue
                    found.setdefault(top, []).append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def module_level_imports(module: str, roots=SOURCE_ROOTS) -> list[str]:
    """Where ``module`` is imported at a module's top level (outside every function), where its
    absence would break ``import pfl_core...`` itself rather than one feature."""
    places = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in _outside_functions(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                if any(name.split(".")[0] == module for name in names):
                    places.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return places


def _outside_functions(tree: ast.AST):
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


@functools.cache
def core_module_names() -> frozenset[str]:
    """The import names of the core dependencies (``yaml`` for PyYAML) and their own names."""
    core, _ = declared()
    names = set(core) | {name.replace("-", "_") for name in core}
    names |= {module for module, dists in _installed_providers().items() if {normalized(d) for d in dists} & core}
    return frozenset(names)


# How a skip for an import that failed reads: pytest.importorskip's "could not import 'x'",
# Python's "No module named 'x'", and the usual "x is not installed".
_MISSING_MODULE = re.compile(r"could not import '([\w.]+)'|No module named '([\w.]+)'|\b([\w.-]+) is not installed")


def missing_core_dependency(reason: str) -> str | None:
    """The core dependency a skip's reason says is missing, or None. A skip may be for an
    optional extra or an absent outside resource, never for a package pyproject requires."""
    for match in _MISSING_MODULE.finditer(reason):
        name = next(g for g in match.groups() if g)
        top = name.split(".")[0]
        if top in core_module_names() or normalized(top) in declared()[0]:
            return top
    return None


def feature_extras() -> dict[str, frozenset[str]]:
    """The optional extras that are features of pfl (``ray``, ...), not development tools."""
    return {extra: dists for extra, dists in declared()[1].items() if extra not in DEVELOPMENT_EXTRAS}


def undeclared(imports: dict[str, list[str]]) -> list[str]:
    """``"module (file:line, ...)"`` for each imported third-party module that no core dependency
    and no feature extra provides."""
    core, _ = declared()
    allowed = core.union(*feature_extras().values())
    return [f"{module} ({', '.join(places[:3])})" for module, places in sorted(imports.items())
            if not distributions_of(module) & allowed]
