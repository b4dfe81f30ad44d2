"""``pfl-run SPEC --out DIR``: results on disk, with or without a tracker."""

import csv

import pytest
import tomllib
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.spec import dump_toml


def write_spec(tmp_path, raw) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(dump_toml(raw))
    return str(path)


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def sweep_raw(**overrides):
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 1], **overrides})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    return raw


def test_out_writes_comparison_differences_clients_and_spec(tmp_path, capsys):
    out = tmp_path / "results"
    code = run_main([write_spec(tmp_path, sweep_raw()), "--no-tracking", "--quiet", "--out", str(out),
                     "--set", "training.lr=0.05"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert "== comparison" in stdout  # the terminal output is unchanged
    rows = read_csv(out / "comparison.csv")
    assert [r["run"] for r in rows] == ["fedavg", "local"]
    assert rows[0]["n_seeds"] == "2" and rows[0]["seeds"] == "0 1"
    assert 0 < float(rows[0]["acc_mean_mean"]) <= 1 and float(rows[0]["acc_mean_ci95"]) >= 0
    assert "acc_p10_mean" in rows[0] and "acc_p10_ci95" in rows[0]
    diffs = read_csv(out / "differences.csv")
    acc = next(d for d in diffs if d["metric"] == "acc_mean")
    assert acc["run"] == "local" and acc["vs"] == "fedavg" and acc["n"] == "2"
    mean = float(rows[1]["acc_mean_mean"]) - float(rows[0]["acc_mean_mean"])
    assert float(acc["mean"]) == pytest.approx(mean, abs=1e-5)
    assert float(acc["low"]) <= float(acc["mean"]) <= float(acc["high"])
    for run in ("fedavg", "local"):
        for seed in (0, 1):
            clients = read_csv(out / "runs" / run / f"clients_seed{seed}.csv")
            assert len(clients) == 4 and "client" in clients[0]
        resolved = tomllib.loads((out / "runs" / run / "resolved_spec.toml").read_text())
        assert resolved["algorithm"]["name"] == run and resolved["training"]["lr"] == 0.05
    spec = tomllib.loads((out / "spec.toml").read_text())  # as run: --set applied, sweep kept
    assert spec["training"]["lr"] == 0.05 and spec["sweep"] == {"algorithm.name": ["fedavg", "local"]}
    assert not (out / "INCOMPLETE").exists()


def test_out_with_tracking_and_a_single_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "one"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 2, "tracking.enabled": True})
    code = run_main([write_spec(tmp_path, raw), "--quiet", "--tracking-uri", uri, "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert [r["run"] for r in read_csv(out / "comparison.csv")] == ["fedavg"]
    assert len(read_csv(out / "runs" / "fedavg" / "clients.csv")) == 4
    assert read_csv(out / "differences.csv") == []  # one run: nothing to difference


def test_existing_out_dir_is_refused_in_one_line_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    spec = write_spec(tmp_path, tiny_raw(**{"experiment.rounds": 1}))
    code = run_main([spec, "--quiet", "--out", str(out)])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(out) in lines[0] and "--overwrite" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # nothing written
    code = run_main([spec, "--quiet", "--out", str(out), "--overwrite"])
    assert code == 0, capsys.readouterr().err
    assert (out / "comparison.csv").exists() and (out / "mine.txt").read_text() == "keep me"


def test_nothing_is_written_before_the_spec_validates(tmp_path, capsys):
    out = tmp_path / "results"
    code = run_main([write_spec(tmp_path, tiny_raw(**{"experiment.rounds": -1})), "--out", str(out)])
    assert code == 2 and "experiment.rounds" in capsys.readouterr().err
    assert not out.exists()
    code = run_main([write_spec(tmp_path, tiny_raw()), "--dry-run", "--out", str(out)])
    assert code == 0 and not out.exists()


def test_a_late_failure_still_writes_what_finished(tmp_path, capsys, monkeypatch):
    from pfl_core.study import seeds
    real = seeds.Engine

    class FailingOnLocalSeed1(real):
        def run(self):
            if self.spec.algorithm.name == "local" and self.spec.experiment.seed == 1:
                raise RuntimeError("boom in round 2")
            return super().run()

    monkeypatch.setattr(seeds, "Engine", FailingOnLocalSeed1)
    out = tmp_path / "results"
    code = run_main([write_spec(tmp_path, sweep_raw()), "--no-tracking", "--quiet", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 1 and "boom in round 2" in err and "partial results" in err
    rows = read_csv(out / "comparison.csv")
    assert [(r["run"], r["seeds"]) for r in rows] == [("fedavg", "0 1"), ("local", "0")]  # local's seed 0 kept
    assert (out / "runs" / "local" / "clients_seed0.csv").exists()
    assert not (out / "runs" / "local" / "clients_seed1.csv").exists()
    assert "boom in round 2" in (out / "INCOMPLETE").read_text()
