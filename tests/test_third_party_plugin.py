"""The example third-party package examples/pfl-fedavgm, installed and discovered for real.

The package is installed (offline, no dependencies) into a temporary folder, which then
goes on PYTHONPATH: pfl finds ``fedavgm_example`` through the ``pfl`` entry-point group exactly as
it would after ``pip install pfl-fedavgm``. Nothing is written to the repository or the venv.
pfl's own FedAvgM is ``fedavgm`` (plugins/fedopt); the example registers a name of its own, and
the two are checked to agree.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pfl_core import SpecError, registry
from pfl_core.engine import Engine, resolve

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "pfl-fedavgm"
BIN = Path(sys.executable).parent  # the venv's console scripts (pfl-run, pfl)

TINY_TOML = """
[experiment]
name = "fedavgm-test"
rounds = 2

[data]
name = "synthetic"
params = { num_devices = 4, samples_per_device = 60, dim = 20 }

[partition]
scheme = "domain"
num_clients = 4

[model]
name = "mlp"
params = { hidden = [8] }

[algorithm]
name = "fedavgm_example"

[tracking]
progress = false
"""


def _install(site: Path, work: Path) -> None:
    """pip-install a copy of the example into ``site`` (the copy keeps build/ and *.egg-info
    out of the repository). Without setuptools in this environment (needed for an offline
    build), write the installed form by hand from the package's own pyproject.toml."""
    source = work / "pfl-fedavgm"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    if importlib.util.find_spec("setuptools") is not None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
             "--no-index", "--target", str(site), str(source)],
            check=True, capture_output=True, text=True,
        )
        return
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    shutil.copytree(source / "pfl_fedavgm", site / "pfl_fedavgm")
    info = site / f"pfl_fedavgm-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in groups.items())
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("fedavgm")
    site = work / "site"
    _install(site, work)
    assert list(site.glob("pfl_fedavgm-0.1.0.dist-info/entry_points.txt"))
    return site


def _env(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _script(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"console script {name} not found next to {sys.executable}")
    return str(path)


# -- a fresh process finds the plugin through its entry point ----------------------------


def test_pfl_run_discovers_installed_plugin(site, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(TINY_TOML)
    proc = subprocess.run([_script("pfl-run"), str(spec), "--no-tracking", "--clients"], cwd=tmp_path, env=_env(site),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "== fedavgm_example: per-client results (test split) ==" in proc.stdout
    table = proc.stdout.split("per-client results (test split) ==")[1].splitlines()
    assert table[1].split()[:3] == ["client", "arch", "num_train"]
    assert [line.split()[0] for line in table[2:6]] == ["0", "1", "2", "3"]
    assert "acc_mean" in proc.stdout
    assert not (tmp_path / "mlflow.db").exists()


def test_pfl_plugins_lists_package_version_and_hook(site, tmp_path):
    proc = subprocess.run([_script("pfl"), "plugins"], cwd=tmp_path, env=_env(site),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fedavgm_example "))
    row = lines[start]
    for line in lines[start + 1:]:  # the hooks column wraps onto indented lines
        if not line.startswith(" "):
            break
        row += " " + line.strip()
    name, kind, package, version, hooks = row.split(None, 4)
    assert (kind, package, version) == ("algorithm", "pfl-fedavgm", "0.1.0")
    assert "server_aggregate" in [h.strip() for h in hooks.split(",")]


def test_bad_param_is_one_line_exit_2(site, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(TINY_TOML)
    proc = subprocess.run([_script("pfl-run"), str(spec), "--no-tracking", "--dry-run",
                           "--set", "algorithm.params.beta=1.0"],
                          cwd=tmp_path, env=_env(site), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pfl-run: error: algorithm.params.beta: must be in [0, 1), got 1.0"
    ]


# -- in process: same discovery, then the numbers -----------------------------------------


@pytest.fixture
def discovered(site, monkeypatch):
    """The installed package on sys.path and pfl's discovery cache refreshed (and undone)."""
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    yield
    monkeypatch.undo()
    sys.modules.pop("pfl_fedavgm", None)
    registry.refresh()
    registry.plugin_class.cache_clear()


def _raw(algorithm: str, **params) -> dict:
    raw = tomllib.loads(TINY_TOML)
    raw["algorithm"] = {"name": algorithm, "params": params}
    raw["tracking"] = {"enabled": False, "progress": False}
    return raw


def _final_state(raw: dict):
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    for r in range(1, ctx.spec.experiment.rounds + 1):
        engine.run_round(ctx, r)
    return ctx


def test_beta0_lr1_equals_fedavg_exactly(discovered):
    assert registry.discovered()["fedavgm_example"].distribution == "pfl-fedavgm"
    fedavg = _final_state(_raw("fedavg")).server["global"]
    same = _final_state(_raw("fedavgm_example", beta=0.0, server_lr=1.0))
    assert same.server["global"].keys() == fedavg.keys()
    for key, value in fedavg.items():
        assert torch.equal(same.server["global"][key], value), key
    assert set(same.server["momentum"]) == set(fedavg)  # the buffer is engine-owned server state

    moved = _final_state(_raw("fedavgm_example")).server["global"]  # default beta = 0.9
    assert any(not torch.equal(moved[k], v) for k, v in fedavg.items())


def test_params_are_validated_with_their_key(discovered):
    with pytest.raises(SpecError, match=r"^algorithm\.params\.server_lr: must be > 0, got 0\.0$"):
        resolve(_raw("fedavgm_example", server_lr=0.0))
    with pytest.raises(SpecError, match=r"^algorithm\.params\.momentum: unknown key"):
        resolve(_raw("fedavgm_example", momentum=0.9))


def test_server_update_follows_the_paper(discovered):
    """Two server steps by hand: v <- beta v + (w_t - w_avg); w <- w_t - lr v."""
    from pfl_fedavgm import FedAvgM

    plugin = FedAvgM(FedAvgM.Params(beta=0.5, server_lr=2.0))
    gen = torch.Generator().manual_seed(0)
    w0 = {"w": torch.randn(3, 2, generator=gen), "n": torch.tensor(7)}
    ctx = types.SimpleNamespace(server={"global": w0})
    w_t, v = w0["w"].clone(), torch.zeros(3, 2)
    for _ in range(2):
        ups = [{"w": torch.randn(3, 2, generator=gen), "n": torch.tensor(1)} for _ in range(2)]
        weights = {0: 0.25, 1: 0.75}
        plugin.server_aggregate(ctx, iter([(0, {"weights": ups[0]}), (1, {"weights": ups[1]})]), weights)
        w_avg = 0.25 * ups[0]["w"] + 0.75 * ups[1]["w"]
        v = 0.5 * v + (w_t - w_avg)
        w_t = w_t - 2.0 * v
        assert torch.allclose(ctx.server["global"]["w"], w_t, atol=1e-6)
        assert torch.allclose(ctx.server["momentum"]["w"], v, atol=1e-6)
        assert ctx.server["global"]["n"].item() == 1  # non-float entries: FedAvg's (first upload's)


def test_the_example_and_the_builtin_fedavgm_agree(discovered):
    """The tutorial's FedAvgM and pfl's own (plugins/fedopt: beta1 is the example's beta) give the
    same weights on the same run; the built-in keeps the name ``fedavgm``."""
    assert registry.discovered()["fedavgm"].distribution == "pfl"
    for beta, lr in ((0.9, 1.0), (0.5, 0.7)):
        example = _final_state(_raw("fedavgm_example", beta=beta, server_lr=lr))
        builtin = _final_state(_raw("fedavgm", beta1=beta, server_lr=lr))
        for key, value in example.server["global"].items():
            assert torch.allclose(builtin.server["global"][key], value, rtol=0, atol=1e-6), key
        for key, v in example.server["momentum"].items():  # the example's v is the built-in's -m
            assert torch.allclose(builtin.server["m"][key], -v, rtol=0, atol=1e-6), key
