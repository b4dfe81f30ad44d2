"""Checks on real data from ../shared/data (skipped where that folder is absent)."""

import pytest

from pfl_core.engine import Engine, resolve
from pfl_core.spec import apply_overrides, load_toml

SPEC = "specs/mnist_pathological.toml"


@pytest.fixture
def mnist_spec(shared_data, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the spec's data path is relative to the repo root
    return load_toml(root / SPEC)


def test_local_beats_fedavg_on_pathological_mnist(mnist_spec):
    """FedMosaic's Table 2 pattern (Local >> FedAvg under 2-classes-per-client label skew),
    at a scale for CI: 10 clients, 400 samples each, 3 rounds, lr 0.05."""
    finals = {}
    for algorithm in ("local", "fedavg"):
        raw = apply_overrides(mnist_spec, ["sweep={}", f"algorithm.name={algorithm}", "data.subsample=4000",
                                           "experiment.rounds=3", "training.lr=0.05", "tracking.enabled=false"])
        finals[algorithm] = Engine(resolve(raw), progress=False).run().final["acc_mean"]
    assert finals["local"] > 0.85
    assert finals["local"] > finals["fedavg"] + 0.2, finals
