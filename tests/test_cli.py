"""The command line: bad input gets one line naming the key and exit code 2, no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from tiny import tiny_raw

import pfl_core
from pfl_core.cli import main, run_main
from pfl_core.spec import dump_toml

BIN = Path(sys.executable).parent


def write_spec(tmp_path, raw, name="spec.toml") -> str:
    path = tmp_path / name
    path.write_text(dump_toml(raw))
    return str(path)


def run_cli(capsys, *args):
    code = run_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({"experiment.roudns": 3}, ["experiment.roudns", "did you mean 'rounds'"]),
        ({"experiment.rounds": -1}, ["experiment.rounds", ">= 1"]),
        ({"experiment.rounds": "many"}, ["experiment.rounds", "integer"]),
        ({"algorithm.name": "fedavgg"}, ["algorithm.name", "did you mean 'fedavg'"]),
        ({"data.name": "mnistt"}, ["data.name", "did you mean 'mnist'"]),
        ({"model.name": "lenet"}, ["model.name", "did you mean 'lenet5'"]),
        ({"partition.scheme": "dirichlet", "partition.params.alpha": 0}, ["partition.params.alpha", "> 0"]),
        ({"partition.scheme": "dirichlet", "partition.params.alpah": 1}, ["partition.params.alpah", "alpha"]),
        ({"partition.scheme": "pathological", "partition.params.classes_per_client": 11},
         ["partition.params.classes_per_client", "11"]),
        ({"algorithm.name": "fedprox", "algorithm.params.mu": -1}, ["algorithm.params.mu", ">= 0"]),
        ({"data.name": "npz", "data.params": {"path": "/nonexistent/x.npz"}}, ["/nonexistent/x.npz", "data.params.path"]),
        ({"model.clients": ["mlp", "mlp"]}, ["model.clients", "2 architectures for 4 clients"]),
        ({"model.pool": ["mlp", "lenet5"]}, ["model.pool", "same architecture"]),
        ({"data.name": "lenet5"}, ["data.name", "is a model plugin"]),
    ],
)
def test_bad_specs_exit_2_with_one_line_naming_the_key(tmp_path, capsys, overrides, expected):
    code, out, err = run_cli(capsys, write_spec(tmp_path, tiny_raw(**overrides)), "--dry-run")
    assert code == 2
    line = one_line_error(err)
    for fragment in expected:
        assert fragment in line, line


def test_bad_override_is_reported_like_a_bad_spec(tmp_path, capsys):
    spec = write_spec(tmp_path, tiny_raw())
    code, _, err = run_cli(capsys, spec, "--set", "training.lr=fast", "--dry-run")
    assert code == 2 and "training.lr" in one_line_error(err)
    code, _, err = run_cli(capsys, spec, "--set", "training.lrr=0.1", "--dry-run")
    assert code == 2 and "training.lrr" in one_line_error(err)


def test_missing_spec_file_and_invalid_toml(tmp_path, capsys):
    code, _, err = run_cli(capsys, str(tmp_path / "nope.toml"))
    assert code == 2 and "not found" in one_line_error(err)
    bad = tmp_path / "bad.toml"
    bad.write_text("[experiment\nname = 1\n")
    code, _, err = run_cli(capsys, str(bad))
    assert code == 2 and "not valid TOML" in one_line_error(err)


def test_bad_sweep_point_is_named(tmp_path, capsys):
    raw = tiny_raw(**{"sweep": {"algorithm.name": ["local", "fedavgx"]}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "algorithm.name" in line and "sweep point" in line


def test_dry_run_prints_the_resolved_spec_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny_raw(**{"algorithm.name": "fedprox", "tracking.enabled": True})
    code, out, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run", "--set", "experiment.rounds=5")
    assert code == 0, err
    import tomllib

    resolved = tomllib.loads(out.split("# ok")[0])
    assert resolved["experiment"]["rounds"] == 5
    assert resolved["algorithm"]["params"] == {"mu": 0.01}  # the plugin's default, filled in
    assert resolved["data"]["params"]["alpha"] == 1.0
    assert "# ok: 4 clients" in out
    assert not (tmp_path / "mlflow.db").exists()


def test_run_prints_the_per_client_table_only_with_clients(tmp_path, capsys):
    code, out, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--quiet", "--clients")
    assert code == 0, err
    assert "per-client results" in out and out.count(" mlp ") == 4
    code, out, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--quiet")
    assert code == 0, err
    assert "per-client results" not in out and " mlp " not in out
    (line,) = [line for line in out.splitlines() if line.strip()]  # --quiet: the run's summary line only
    assert line.startswith("-- fedavg: acc_mean ") and " std " in line and " p10 " in line
    assert "worst client " in line and "up " in line and " kB" in line and line.endswith(" s")


def test_pfl_plugins_lists_builtins_with_versions_and_hooks(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows, name = {}, None
    for line in out.splitlines()[1:]:  # a wrapped hooks column continues on indented lines
        name = name if line.startswith(" ") else line.split()[0]
        rows[name] = rows.get(name, "") + line
    for name in ("fedavg", "fedprox", "local", "centralized", "synthetic", "npz", "cifar100",
                 "dirichlet", "group_dirichlet", "lenet5", "vgg16"):
        assert name in rows, name
    assert "local_objective" in rows["fedprox"] and "server_aggregate" in rows["fedprox"]
    assert " pfl " in rows["fedavg"] and pfl_core.__version__ in rows["fedavg"]
    assert "dataset" in rows["npz"] and "model" in rows["lenet5"]


def test_console_script_exits_2_without_traceback(tmp_path):
    spec = write_spec(tmp_path, tiny_raw(**{"partition.params.alpha": 1}))
    proc = subprocess.run([str(BIN / "pfl-run"), spec], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    line = one_line_error(proc.stderr)
    assert line.startswith("pfl-run: error: partition.params.alpha")


def test_dry_run_builds_the_models_for_the_data(tmp_path, capsys):
    spec = write_spec(tmp_path, tiny_raw(**{"model.name": "lenet5", "model.params": {}}))
    code, _, err = run_cli(capsys, spec, "--dry-run")
    assert code == 2 and one_line_error(err).startswith("pfl-run: error: model.name: lenet5 needs image inputs")


def test_set_into_a_missing_list_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), "--set", "addons.0.params.x=1", "--dry-run")
    assert code == 2 and "addons: has no list item 0" in one_line_error(err)


def test_pfl_version_and_bare_pfl_print_usage_not_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("pfl ")
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: pfl" in out and "plugins" in out and "run" in out


def test_an_internal_error_is_one_line_and_the_traceback_only_with_debug(tmp_path, capsys, monkeypatch):
    import pfl_core.study as study
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a plugin")

    monkeypatch.setattr(study, "run_spec_file", broken)
    spec = write_spec(tmp_path, tiny_raw())
    code, _, err = run_cli(capsys, spec)
    line = one_line_error(err)
    assert code == 1 and "internal error" in line and "ZeroDivisionError" in line and "--debug" in line
    with pytest.raises(ZeroDivisionError):
        run_main([spec, "--debug"])


def _documented_commands(spec: Path) -> list[list[str]]:
    import shlex

    commands = []
    for line in spec.read_text().splitlines():
        text = line.lstrip("#").strip()
        if text.startswith("pfl-run "):
            commands.append(shlex.split(text)[1:])
    return commands


def test_every_command_in_the_quickstart_header_works(capsys, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    commands = _documented_commands(root / "specs" / "quickstart.toml")
    assert len(commands) >= 4
    for args in commands:
        code, out, err = run_cli(capsys, *args, "--dry-run")
        assert code == 0, (args, err)
        assert "# ok:" in out


def test_set_on_a_swept_key_replaces_the_axis_and_says_so(tmp_path, capsys):
    raw = tiny_raw()
    raw["sweep"] = {"algorithm.name": ["local", "fedavg"], "training.lr": [0.1, 0.2]}
    spec = write_spec(tmp_path, raw)
    code, out, err = run_cli(capsys, spec, "--set", "algorithm.name=fedprox", "--set", "algorithm.params.mu=0.5",
                             "--dry-run")
    assert code == 0 and "replaces the spec's sweep over algorithm.name" in err
    assert out.count("# sweep point") == 2 and "mu = 0.5" in out and "'training.lr': 0.2" in out
    code, out, err = run_cli(capsys, spec, "--no-sweep", "--dry-run")
    assert code == 0 and "# sweep point" not in out and 'name = "fedavg"' in out
    code, out, _ = run_cli(capsys, spec, "--sweep", "training.batch_size=5,20", "--dry-run")
    assert out.count("# sweep point") == 8
    code, out, _ = run_cli(capsys, spec, "--no-sweep", "--set", 'sweep."training.lr"=[0.01, 0.02]', "--dry-run")
    assert out.count("# sweep point") == 2 and "'training.lr': 0.02" in out


@pytest.mark.parametrize("args, key", [
    (["--sweep", "training.lr="], "--sweep training.lr"),
    (["--sweep", "training.lr"], "--sweep"),
    (["--set", "sweep.training.lr=[1]"], "sweep.training"),
    (["--set", "a..b=1"], "--set"),
])
def test_malformed_sweep_options_are_one_line(tmp_path, capsys, args, key):
    code, _, err = run_cli(capsys, write_spec(tmp_path, tiny_raw()), *args, "--dry-run")
    assert code == 2 and key in one_line_error(err)


def test_pfl_plugins_name_shows_docstring_parameters_and_hooks(capsys):
    assert main(["plugins", "fedprox"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fedprox  (algorithm, pfl_plugins.fedprox:FedProx")
    assert "proximal" in out  # the docstring
    assert "parameters (algorithm.params):" in out
    assert "  mu: float = 0.01  [finite, >= 0]" in out  # type, default, validation (docgen's text)
    hooks = next(line for line in out.splitlines() if line.startswith("hooks: "))
    assert "local_objective" in hooks and "server_aggregate" in hooks
    assert main(["plugins", "dirichlet"]) == 0
    out = capsys.readouterr().out
    assert "alpha: float = 0.5  [finite, > 0]" in out and "hooks: none (partitioner plugins implement split())" in out
    assert main(["plugins", "perfed_ckt"]) == 0
    assert "also registered as: comet" in capsys.readouterr().out


def test_pfl_plugins_unknown_name_is_one_line_with_did_you_mean_exit_2(capsys):
    assert main(["plugins", "fedavgg"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line_error(err)
    assert "unknown plugin 'fedavgg'" in line and "did you mean 'fedavg'" in line


# -- renamed keys (issue 13, one vocabulary): the old name is refused, naming the new one --


@pytest.mark.parametrize("name, old, value, new", [
    ("fedalt", "split", -1, "head_layers"), ("fedsim", "split", 2, "head_layers"),
    ("lgfedavg", "split", 1, "head_layers"), ("fedbabu", "split", -1, "head_layers"),
    ("fedmosaic", "fixed_lambda", 1.0, "lam"), ("fedct", "fixed_lambda", 1.0, "lam"),
])
def test_a_renamed_key_exits_2_with_one_line_naming_the_new_key(tmp_path, capsys, name, old, value, new):
    public = {"public.size": 60} if name in ("fedmosaic", "fedct") else {}
    raw = tiny_raw(**{"algorithm.name": name, "algorithm.params": {old: value}}, **public)
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    assert code == 2
    line = one_line_error(err)
    assert f"algorithm.params.{old}: renamed to {new} (" in line, line


def test_a_renamed_key_is_only_refused_where_the_new_key_exists(tmp_path, capsys):
    raw = tiny_raw(**{"algorithm.name": "fedavg", "algorithm.params": {"split": 1}})
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "algorithm.params.split: unknown key" in line and "renamed" not in line, line


@pytest.mark.parametrize("prog", ["pfl", "pfl-run"])
def test_version_names_pfl_torch_and_mlflow(capsys, prog):
    import mlflow
    import torch

    from pfl_core._version import __version__
    from pfl_core.cli import main

    with pytest.raises(SystemExit) as done:
        (main if prog == "pfl" else run_main)(["--version"])
    line = capsys.readouterr().out.strip()
    assert done.value.code == 0
    assert line.startswith(f"{prog} {__version__} (")
    assert f"torch {torch.__version__.split('+')[0]}" in line and f"mlflow {mlflow.__version__}" in line


@pytest.mark.parametrize("where", ["base", "swept"])
def test_a_per_method_parameter_in_a_sweep_shows_two_forms_that_work(tmp_path, capsys, where):
    from tiny import tiny_raw

    raw = tiny_raw()
    raw["sweep"] = {"algorithm.name": ["fedavg", "fedprox"]}
    if where == "base":
        raw["algorithm"] = {"name": "fedavg", "params": {"mu": 0.5}}
    else:
        raw["sweep"]["algorithm.params.mu"] = [0.5, 1.0]
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--no-tracking", "--dry-run")
    line = one_line_error(err)
    assert code == 2 and "error: algorithm.params.mu: unknown key" in line
    whole = line.split("[sweep] algorithm = ", 1)[1].split(", or use points = ")[0]
    points = line.split("or use points = ", 1)[1].rsplit(" (docs/", 1)[0]
    for form in (f"algorithm = {whole}", f"points = {points}"):  # each form, pasted into [sweep], runs
        fixed = {k: v for k, v in raw.items() if k != "sweep"}
        fixed["algorithm"] = {"name": "fedavg"}
        fixed["sweep"] = tomllib.loads(form)
        code, out, err = run_cli(capsys, write_spec(tmp_path, fixed, "fixed.toml"), "--no-tracking", "--dry-run")
        assert code == 0, err
        assert out.count("mu = 0.5") == 1 and out.count('name = "fedavg"') == 1, out
