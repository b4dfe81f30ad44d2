"""Issue 35, item 10: ``pfl new plugin NAME`` writes a plugin package that pfl discovers through
its entry point and runs. The package is put in the installed form by hand (its module and a
dist-info with the entry points its pyproject.toml declares, as tests/test_third_party_plugin.py
does without setuptools) into a folder on sys.path: pip is not run, the registry's discovery
is. Its own spec runs for a round and its own tests pass."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from pfl_core import registry
from pfl_core.cli.cli import main
from pfl_core.engine import Engine, resolve

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NAME = "my_method"
FILES = ["README.md", "pfl_my_method/__init__.py", "pyproject.toml", "spec.toml", "tests/test_my_method.py"]


def install_by_hand(package: Path, site: Path) -> None:
    """What ``pip install --target site package`` leaves: the module and its dist-info."""
    project = tomllib.loads((package / "pyproject.toml").read_text())
    meta = project["project"]
    for module in project["tool"]["setuptools"]["packages"]:
        shutil.copytree(package / module, site / module)
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        for group, eps in meta["entry-points"].items()))


@pytest.fixture
def package(tmp_path, capsys):
    assert main(["new", "plugin", NAME, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    target = tmp_path / "pfl-my-method"
    assert out.splitlines()[0].startswith(f"pfl new: wrote {target}/")
    return target


@pytest.fixture
def installed(package, tmp_path, monkeypatch):
    site = tmp_path / "site"
    install_by_hand(package, site)
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    yield package
    monkeypatch.undo()
    for module in [m for m in sys.modules if m == "pfl_my_method" or m.startswith("pfl_my_method.")]:
        del sys.modules[module]
    registry.refresh()


def test_writes_the_package_files(package):
    assert sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()) == FILES
    project = tomllib.loads((package / "pyproject.toml").read_text())
    assert project["project"]["name"] == "pfl-my-method"
    assert project["project"]["entry-points"][registry.ENTRY_POINT_GROUP] == {NAME: "pfl_my_method:MyMethod"}
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    module = (package / "pfl_my_method" / "__init__.py").read_text()
    assert module.count("@hookimpl") == 1 and '"""One mini-batch\'s task loss' in module


def test_the_registry_finds_it_and_its_spec_runs_a_round(installed):
    entry = registry.discovered()[NAME]
    assert (entry.distribution, entry.version) == ("pfl-my-method", "0.1.0")
    cls = registry.plugin_class(NAME)
    assert cls.name == NAME and registry.implemented_hooks(cls)[-1] == "task_loss"
    raw = tomllib.loads((installed / "spec.toml").read_text())
    raw["experiment"]["rounds"] = 1
    raw["tracking"] = {"enabled": False, "progress": False}
    result = Engine(resolve(raw), progress=False).run()
    assert len(result.history) == 1 and 0.0 <= result.final["acc_mean"] <= 1.0


def test_its_own_tests_pass(installed):
    path = installed / "tests" / "test_my_method.py"
    spec = importlib.util.spec_from_file_location("generated_test_my_method", path)
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    names = sorted(n for n in vars(tests) if n.startswith("test_"))
    assert names == ["test_no_smoothing_is_fedavg_exactly", "test_parameters_are_checked_with_their_key",
                     "test_the_spec_runs"]
    for name in names:
        getattr(tests, name)()


def test_refuses_an_existing_folder_and_changes_nothing(package, tmp_path, capsys):
    (package / "spec.toml").write_text("# mine\n")
    assert main(["new", "plugin", NAME, "--dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"pfl new: error: {package} already exists; nothing was written (choose another NAME, or --dir)"]
    assert (package / "spec.toml").read_text() == "# mine\n"


@pytest.mark.parametrize("argv, message", [
    (["new", "plugin", "My-Method"], ("NAME: 'My-Method' is not a plugin name: lower-case letters, digits and "
                                      "underscores, starting with a letter (e.g. fedmine)")),
    (["new", "plugin", "fedavg"], "NAME: 'fedavg' is already a plugin (package pfl "),
    (["new", "plugin", "fine", "--dir", "missing"], "--dir: missing is not a folder"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"pfl new: error: {message}")
    assert list(tmp_path.iterdir()) == []
