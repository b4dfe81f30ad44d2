"""pfl's import graph, read from the source with ``ast`` (every import, function-level ones too).

    python scripts/import_graph.py [ROOT]          # figures: modules, floors, circles, longest module
    python scripts/import_graph.py ROOT --edges    # every module and what it imports

Nodes are the modules of ``pfl_core`` (a package counts as its ``__init__``) with ``plugins/``
and ``benchmarks/`` as one node each. A *floor* is a step of the longest import chain: a
module that imports nothing of pfl is on floor 1, any other one floor above the highest module
it imports (over the graph without its circles' back edges). A *circle* is a set of modules
that import each other (a strongly connected component of more than one module).

``tests/test_layers.py`` uses :func:`module_graph` to check the layers documented in
docs/architecture.md against the code.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

GROUPED = ("plugins", "benchmarks")  # whole folders that count as one node


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(root: Path) -> dict[str, Path]:
    """Every module of pfl_core, plugins/ and benchmarks/ by its dotted name (as the tree
    spells it: plugins/ is the folder, installed as pfl_plugins)."""
    files = [*root.glob("pfl_core/**/*.py"), *root.glob("plugins/**/*.py"), *root.glob("benchmarks/*.py")]
    return {module_name(root, p): p for p in sorted(files) if "__pycache__" not in p.parts}


def imported_names(module: str, path: Path) -> list[str]:
    """Absolute dotted names of everything ``module`` imports (``from a import b`` gives
    ``a.b``, which is a module or an attribute of ``a``)."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out += [f"{prefix}.{alias.name}" for alias in node.names]
    return out


def module_graph(root: Path) -> dict[str, set[str]]:
    """{module: the pfl modules it imports}, over pfl_core's modules and the plugin and
    benchmark modules (not grouped here); ``pfl_plugins.x`` is read as ``plugins.x``."""
    modules = source_modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            if name.startswith("pfl_plugins"):
                name = "plugins" + name[len("pfl_plugins"):]
            while name and name not in modules:  # an attribute of a module: that module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def grouped(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with plugins/ and benchmarks/ each one node."""
    def node(name: str) -> str:
        top = name.split(".")[0]
        return top if top in GROUPED else name

    out: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in graph.items():
        out[node(module)] |= {node(t) for t in targets} - {node(module)}
        out[node(module)]  # a node that imports nothing is still a node
    return dict(out)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor over the graph with each circle merged into one node."""
    member_of = {m: tuple(c) for c in circles(graph) for m in c}
    key = lambda n: member_of.get(n, n)  # noqa: E731
    merged: dict = collections.defaultdict(set)
    for node, targets in graph.items():
        merged[key(node)] |= {key(t) for t in targets} - {key(node)}
    memo: dict = {}

    def floor(n) -> int:
        if n not in memo:
            memo[n] = 1 + max((floor(t) for t in merged.get(n, ())), default=0)
        return memo[n]

    return {node: floor(key(node)) for node in graph}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--edges", action="store_true", help="print every node and what it imports")
    args = parser.parse_args()
    root = Path(args.root)
    graph = grouped(module_graph(root))
    found = circles(graph)
    levels = floors(graph)
    core = {m: p for m, p in source_modules(root).items() if m.startswith("pfl_core")}
    lines = {m: sum(1 for _ in p.open()) for m, p in core.items()}
    longest = sorted(lines, key=lines.get, reverse=True)[:5]
    print(f"nodes: {len(graph)} ({len(core)} pfl_core modules, plugins/ and benchmarks/ one node each)")
    print(f"floors: {max(levels.values())}")
    print(f"circles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    print("longest pfl_core modules: " + ", ".join(f"{m} ({lines[m]})" for m in longest))
    print(f"pfl_core modules over 500 lines: {sum(n > 500 for n in lines.values())}")
    if args.edges:
        for node in sorted(graph, key=lambda n: (levels[n], n)):
            print(f"{levels[node]:2d} {node} -> {', '.join(sorted(graph[node]))}")


if __name__ == "__main__":
    main()
