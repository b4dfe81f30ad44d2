"""What a fresh ``pip install -e .`` promises, it does: every third-party module the source
imports is declared (a dependency, or an optional extra behind a one-line error naming it),
the tuned quickstart the README advertises runs end to end, and every run records the versions
of the packages that decide its numbers. conftest.py's skip policy makes the suite fail when a
test skips for a missing core dependency (how CI once passed with every tuning test skipped)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest
from dependencies import (
    declared,
    feature_extras,
    imported_modules,
    missing_core_dependency,
    module_level_imports,
    normalized,
    undeclared,
)
from mlflow.tracking import MlflowClient
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw

ROOT = Path(__file__).resolve().parents[1]


def test_every_third_party_import_in_the_source_is_declared():
    imports = imported_modules()
    assert {"torch", "mlflow", "optuna"} <= set(imports)  # the reader sees function-level imports (optuna's)
    assert undeclared(imports) == [], "imported by pfl but declared in no dependency or extra of pyproject.toml"


def test_the_import_reader_finds_imports_in_functions_and_blocks_and_flags_an_undeclared_one(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "import os\nfrom . import sibling\nimport numpy as np\n"
        "def late():\n    import leftpad.sub\n    return leftpad\n"
        "if True:\n    from optuna.samplers import TPESampler\n"
        "class K:\n    def m(self):\n        from ray import get\n")
    found = imported_modules(roots=("pkg",), base=tmp_path)
    assert set(found) == {"numpy", "leftpad", "optuna", "ray"}  # os is stdlib, the relative import is pfl's own
    assert found["leftpad"] == ["pkg/mod.py:5"]
    assert [line.split(" ")[0] for line in undeclared(found)] == ["leftpad"]  # numpy, optuna: core; ray: an extra


def test_optuna_is_a_core_dependency_with_both_bounds():
    import tomllib

    requirement = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                       if normalized(r.split(">")[0].split("<")[0]) == "optuna")
    assert ">=" in requirement and "<" in requirement.replace("<=", "")


def _extra_modules(extra: str) -> list[str]:
    return sorted(name.replace("-", "_") for name in feature_extras()[extra])


@pytest.mark.parametrize("extra", sorted(feature_extras()))
def test_an_extras_module_is_never_imported_at_a_modules_top_level(extra):
    for module in _extra_modules(extra):
        assert module_level_imports(module) == [], f"{module} (extra [{extra}]) imported at module level"


# For each feature extra: the spec settings that need it. A new extra must add its line here,
# so its missing-package error is tested. None: no spec setting needs it; its own tests check the
# missing-package line (flower: the Flower app, tests/test_flower.py).
NEEDS_EXTRA = {
    "ray": {"executor.name": "ray"},
    "flower": None,
}


def test_every_feature_extra_has_its_missing_package_case():
    assert set(NEEDS_EXTRA) == set(feature_extras())


@pytest.mark.parametrize("extra", sorted(e for e, settings in NEEDS_EXTRA.items() if settings is not None))
def test_a_missing_extra_is_one_line_naming_the_extra_to_install(extra, tmp_path, capsys, monkeypatch):
    for module in _extra_modules(extra):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    spec = write_spec(tmp_path, tiny_raw(**NEEDS_EXTRA[extra]))
    code, _, err = run_cli(capsys, spec)
    assert code == 2
    assert f"pip install -e '.[{extra}]'" in one_line_error(err)


@pytest.mark.parametrize("reason,missing", [
    ("could not import 'optuna': No module named 'optuna'", "optuna"),
    ("No module named 'scipy.stats'", "scipy"),
    ("statsmodels is not installed", "statsmodels"),
    ("could not import 'yaml': No module named 'yaml'", None),  # not pfl's dependency: a test's own tool
    ("Ray is not installed (optional extra: pip install -e '.[ray]')", None),
    ("needs a CUDA GPU (executor.device = 'cuda'): torch.cuda.is_available() is False here", None),
    ("real datasets folder ../shared/data is absent (only on the project's machines)", None),
])
def test_the_skip_policy_names_a_missing_core_dependency_only(reason, missing):
    assert missing_core_dependency(reason) == missing


def test_the_suite_fails_when_a_test_skips_for_a_core_dependency(pytester):
    """The policy in conftest.py, run on a suite of one test that skips the way the tuning tests
    once did on CI's fresh venv: pytest exits non-zero and names the package."""
    pytester.makeconftest("import skip_policy\n\ndef pytest_configure(config):\n    skip_policy.install(config)\n")
    pytester.syspathinsert(str(ROOT / "tests"))
    pytester.makepyfile(test_one="""
        import pytest
        def test_tuning():
            pytest.skip("could not import 'optuna': No module named 'optuna'")
        def test_gpu():
            pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    """)
    result = pytester.runpytest("-p", "no:xdist", "-rs")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped for a missing core dependency*optuna*"])
    ok = pytester.makepyfile(test_one="""
        import pytest
        def test_gpu():
            pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    """)
    assert ok.exists()
    assert pytester.runpytest("-p", "no:xdist").ret == 0


def _installed(name: str) -> str:
    return metadata.version(name)


def test_the_tuned_quickstart_runs_end_to_end_and_every_run_records_the_versions(tmp_path, capsys, monkeypatch):
    """specs/quickstart_tuned.toml as the README runs it, with fewer trials, rounds and seeds."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    code, out, err = run_cli(capsys, str(ROOT / "specs" / "quickstart_tuned.toml"), "--tracking-uri", uri,
                             "--set", "tune.trials=2", "--set", "experiment.rounds=2",
                             "--set", "experiment.seeds=[0, 1]", "--set", "tracking.progress=false")
    assert code == 0, err
    for method in ("local", "fedavg", "centralized"):
        assert f"-- {method}: tuned in 2 trials" in out
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    # a study parent, a tuning parent with 2 trials per method, 2 final runs per method, and
    # the final runs' parent per method
    assert len(runs) >= 1 + 3 * (1 + 2 + 2)
    expected = {f"pfl.versions.{name}": _installed(name) for name in ("torch", "numpy", "mlflow", "optuna")}
    for run in runs:
        assert {k: run.data.tags.get(k) for k in expected} == expected, run.info.run_name


def test_an_untuned_run_records_the_versions_but_not_optunas(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    spec = write_spec(tmp_path, tiny_raw(**{"tracking.enabled": True, "experiment.rounds": 1}))
    code, _, err = run_cli(capsys, spec, "--tracking-uri", uri)
    assert code == 0, err
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["pfl.versions.torch"] == _installed("torch")
    assert run.data.tags["pfl.versions.numpy"] == _installed("numpy")
    assert "pfl.versions.optuna" not in run.data.tags
    import torch

    assert run.data.tags["pfl.machine.cpu_capability"] == torch.backends.cpu.get_cpu_capability() != ""


def test_declared_reads_the_extras():
    core, extras = declared()
    assert "torch" in core and "ray" in extras["ray"]
