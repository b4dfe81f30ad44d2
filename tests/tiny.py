"""A tiny, fast experiment for end-to-end tests (synthetic data, no files, no tracking)."""

import copy

from pfl_core.engine import Engine, resolve
from pfl_core.spec import set_dotted

TINY = {
    "experiment": {"name": "tiny", "seed": 0, "rounds": 3},
    "data": {"name": "synthetic", "params": {"num_devices": 4, "samples_per_device": 120, "dim": 20}},
    "partition": {"scheme": "domain", "num_clients": 4},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "algorithm": {"name": "fedavg"},
    "training": {"local_epochs": 1, "batch_size": 10, "lr": 0.1},
    "tracking": {"enabled": False, "progress": False},
}


def tiny_raw(**overrides) -> dict:
    """TINY with dotted-key overrides: tiny_raw(**{"algorithm.name": "local"})."""
    raw = copy.deepcopy(TINY)
    for key, value in overrides.items():
        set_dotted(raw, key, value)
    return raw


def run_tiny(**overrides):
    """Run the tiny experiment; returns (result, engine) with engine.ctx for inspection."""
    engine = Engine(resolve(tiny_raw(**overrides)), progress=False)
    return engine.run(), engine
