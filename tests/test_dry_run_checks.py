"""What ``pfl-run --dry-run`` checks that the real run would stop at (issue 33): a method's
server model builds (and fits this machine's memory) as the clients' models do, with the real
run's own one line, and a dry run of a study larger than the real run takes without ``--yes``
says its size, and builds the data and models of points that share them once."""

from __future__ import annotations

import numpy as np
import pytest
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.study import report

# An MLP of two hidden layers of 10^7 units: 10^14 weights, 400 TB: larger than any machine's
# memory, refused on torch's meta device before anything is allocated.
HUGE_MLP = {"hidden": [10_000_000, 10_000_000]}


def cosmos_on_images(tmp_path, **overrides) -> dict:
    """COSMOS on 160 random 32x32 colour images: clients cnn4, the server model an MLP."""
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (160, 32, 32, 3), dtype=np.uint8), y_train=np.repeat(np.arange(4), 40))
    return tiny_raw(**{
        "data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid", "public.size": 32,
        "experiment.rounds": 1, "model.name": "cnn4", "model.params": {"width": 0.25},
        "algorithm.name": "cosmos", "algorithm.params": {"server_arch": "mlp", "pretrain_epochs": 1,
                                                         "server_epochs": 1, "num_augment": 1},
        **overrides})


def real_run_error(raw: dict) -> str:
    """The line the real run stops with, from the run itself (round 1 builds the server model)."""
    with pytest.raises(SpecError) as info:
        Engine(resolve(raw), progress=False).run()
    return f"pfl-run: error: {info.value}"


def dry_run(tmp_path, capsys, raw: dict, *args: str) -> tuple[int, str, str]:
    code = run_main([write_spec(tmp_path, raw), "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def test_an_oversized_server_model_is_refused_by_the_dry_run_with_the_real_runs_line(tmp_path, capsys):
    raw = cosmos_on_images(tmp_path, **{"model.arch_params": {"mlp": HUGE_MLP}})
    expected = real_run_error(raw)
    assert expected.startswith("pfl-run: error: model.arch_params.mlp: mlp with these parameters is too large to "
                               "build for 4 classes and inputs (3, 32, 32) (its weights need "), expected
    code, _, err = dry_run(tmp_path, capsys, raw)
    assert (code, err) == (2, expected)


def test_a_server_model_that_cannot_take_the_inputs_is_refused_by_the_dry_run(tmp_path, capsys):
    """COSMOS's default server model, VGG-16, on feature vectors: the real run failed at round 1
    after the clients' pre-training; the dry run now says it, naming the key that chose it."""
    raw = tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60})
    expected = real_run_error(raw)
    assert expected == ("pfl-run: error: algorithm.params.server_arch: vgg16 needs image inputs (C, H, W); this "
                        "dataset gives feature vectors of shape (20,)")
    code, _, err = dry_run(tmp_path, capsys, raw)
    assert (code, err) == (2, expected)


def test_a_server_model_that_fits_passes_the_dry_run(tmp_path, capsys):
    raw = cosmos_on_images(tmp_path, **{"model.arch_params": {"mlp": {"hidden": [8]}}})
    code, out, err = dry_run(tmp_path, capsys, raw)
    assert code == 0, err
    assert "# ok: 4 clients" in out


def test_every_swept_server_model_is_checked_though_the_points_share_their_data(tmp_path, capsys, monkeypatch):
    """Points that differ only in their server model share data and client models; the one whose
    server model cannot be built is still found (by the dry run, and before a real run trains)."""
    monkeypatch.setattr(Engine, "run_round", lambda *a, **k: pytest.fail("a round trained"))
    raw = tiny_raw(**{"algorithm.name": "cosmos", "public.size": 60, "algorithm.params.server_arch": "mlp"})
    sweep = ["--sweep", 'algorithm.params.server_arch="mlp","vgg16"']
    code, _, err = dry_run(tmp_path, capsys, raw, *sweep)
    assert (code, err) == (2, "pfl-run: error: algorithm.params.server_arch: vgg16 needs image inputs (C, H, W); "
                              "this dataset gives feature vectors of shape (20,)")
    assert run_main([write_spec(tmp_path, raw), "--no-tracking", "--quiet", *sweep]) == 2
    assert capsys.readouterr().err.strip() == err


LRS = "0.01,0.02,0.03,0.04,0.05,0.06"
BATCH_SIZES = "1,2,3,4,5,6,7,8,9,10,11,12"


@pytest.mark.parametrize("yes", [False, True])
def test_a_dry_run_of_a_144_point_sweep_says_its_size_and_builds_shared_data_once(tmp_path, capsys, monkeypatch,
                                                                                  yes):
    """6 learning rates x 12 batch sizes x 2 data sizes: 144 runs, more than the 100 a real run
    starts without --yes; only the data size changes what is built: 2 builds, not 144."""
    built = []
    point_builds = report.point_builds
    monkeypatch.setattr(report, "point_builds", lambda point: built.append(point) or point_builds(point))
    code, out, err = dry_run(tmp_path, capsys, tiny_raw(), "--sweep", f"training.lr={LRS}", "--sweep",
                             f"training.batch_size={BATCH_SIZES}", "--sweep", "data.params.samples_per_device=120,100",
                             *(["--yes"] if yes else []))
    assert code == 0, err
    needs = "--yes is given" if yes else "the real run needs --yes"
    assert err == (f"note: a dry run of 144 sweep point(s) x 1 seed(s): 144 runs, more than 100: {needs}; all 144 "
                   f"points are checked, building the data and models of their 2 distinct setting(s)")
    assert len(built) == 2
    assert {p.resolved.spec.data.params["samples_per_device"] for p in built} == {100, 120}
    ok = [line for line in out.splitlines() if line.startswith("# ok:")]
    assert len(ok) == 144 and len(set(ok)) == 2  # every point reported, with its own data's sizes


def test_a_real_run_of_the_144_point_sweep_still_needs_yes(tmp_path, capsys):
    code = run_main([write_spec(tmp_path, tiny_raw()), "--sweep", f"training.lr={LRS}", "--sweep",
                     f"training.batch_size={BATCH_SIZES}", "--sweep", "data.params.samples_per_device=120,100"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("pfl-run: error: the spec is a study of 144 sweep point(s) x 1 seed(s): 144 runs, "
                                 "more than 100; run it with --yes, or narrow it with --set / --sweep (--dry-run "
                                 "checks it first)")
