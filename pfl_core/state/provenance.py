"""What a checkpoint must match to be resumed: the code that wrote it (pfl's version and a hash
of the source of pfl_core and of the spec's plugins) and the resolved spec, less the keys a
resume may change."""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path

CORE = Path(__file__).resolve().parents[1]  # pfl_core/, not this module's own folder


def _package_files(module_file: Path) -> list[Path]:
    """A plugin's source: its package's .py files when it is a package, else its one file."""
    if module_file.name == "__init__.py":
        return sorted(module_file.parent.rglob("*.py"))
    return [module_file]


def source_files(plugin_names: list[str]) -> list[Path]:
    """The files whose source decides a run's results: every module of ``pfl_core`` and of the
    plugins the spec names that live outside it."""
    import sys

    from pfl_core import registry

    files = sorted(CORE.rglob("*.py"))
    for name in sorted(set(plugin_names)):
        try:
            module = sys.modules[registry.plugin_class(name).__module__]
        except Exception:  # an unknown name was refused when the spec was resolved
            continue
        if getattr(module, "__file__", None):
            path = Path(module.__file__).resolve()
            if CORE not in path.parents:
                files += _package_files(path)
    return [path for path in files if "__pycache__" not in path.parts]


def code_version(plugin_names: list[str]) -> dict[str, str]:
    """pfl's version, the git commit of its checkout (if any; for information) and a SHA-256
    over :func:`source_files` (what decides results). Computed once per process and set of
    plugins: the code a process runs is the code it loaded, whatever changes on disk later."""
    return dict(_code_version(tuple(sorted(set(plugin_names)))))


@functools.cache
def _code_version(plugin_names: tuple[str, ...]) -> dict[str, str]:
    from pfl_core._version import __version__

    sha = hashlib.sha256()
    for path in source_files(list(plugin_names)):
        sha.update(path.name.encode())
        sha.update(path.read_bytes())
    try:
        done = subprocess.run(["git", "-C", str(CORE), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        commit = done.stdout.strip() if done.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"pfl": __version__, "source_sha256": sha.hexdigest(), "git_commit": commit}


def plugin_names(spec) -> list[str]:
    """Every plugin a spec names: algorithm, add-ons, dataset, partitioner, models."""
    names = [spec.algorithm.name, *(a.name for a in spec.addons), spec.data.name, spec.partition.scheme,
             spec.model.name, *(spec.model.clients or []), *(spec.model.pool or [])]
    return names


# -- values stateio cannot hold as they are -------------------------------------------------------


def spec_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved spec dicts."""
    out = []
    for key in dict.fromkeys([*a, *b]):
        path = f"{prefix}{key}"
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            out += spec_differences(a[key], b[key], f"{path}.")
        elif key not in a or key not in b or a[key] != b[key]:
            out.append(path)
    return out


# Keys a resumed or kept run may differ in: where and how often checkpoints are written, the
# progress line, and [report] (the table's correction and columns): never what a run trains.
FREE_KEYS = ("checkpoint", "tracking.progress", "report")


def differing_keys(saved: dict, resolved) -> list[str]:
    """The dotted keys where a checkpoint's spec (``saved``, as parsed from its TOML) and the
    ``resolved`` spec differ, less the keys a resume may change."""
    from pfl_core.spec import tomllib

    return spec_differences(compared(saved), compared(tomllib.loads(resolved.toml())))


def compared(as_dict: dict) -> dict:
    import copy

    out = copy.deepcopy(as_dict)
    for key in FREE_KEYS:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return out
