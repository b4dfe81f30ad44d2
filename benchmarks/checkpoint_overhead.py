#!/usr/bin/env python
"""Run time with checkpoints off and on (the default, ``checkpoint.every = 0``: automatic period).

Two runs, each timed whole (``RunResult.seconds``: data loading, every round, evaluation):
the quickstart's FedAvg point (``specs/quickstart.toml --no-sweep``: 20 clients, 20 rounds) and
a 100-client FedAvg run (the quickstart's data and model with 100 devices, one client each).
Tracking is off and the checkpoints go to a temporary ``checkpoint.dir``, so the difference is
the checkpoints' cost alone. Off and on alternate; the figures are medians over the repeats of
the wall time and of the process's CPU time (on a shared machine the CPU time is the steadier
figure; the wall time also holds the fsyncs). One torch thread, the sequential executor.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_overhead.py              # 3 repeats
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pfl_core.engine import Engine, resolve
from pfl_core.spec import load_toml, set_dotted

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> dict:
    raw = load_toml(ROOT / "specs" / "quickstart.toml")
    raw.pop("sweep", None)
    return raw


def hundred_clients() -> dict:
    raw = quickstart()
    for key, value in {"data.params.num_devices": 100, "data.params.samples_per_device": 100,
                       "partition.num_clients": 100}.items():
        set_dotted(raw, key, value)
    return raw


def timed(raw: dict, enabled: bool, folder: str) -> tuple[float, float, int, float]:
    """(run wall seconds, run CPU seconds, checkpoints written, mean write wall seconds)."""
    raw = copy.deepcopy(raw)
    for key, value in {"tracking.enabled": False, "tracking.progress": False, "executor.name": "sequential",
                       "executor.threads": 1, "checkpoint.enabled": enabled, "checkpoint.dir": folder}.items():
        set_dotted(raw, key, value)
    engine = Engine(resolve(raw), progress=False)
    cpu = time.process_time()
    result = engine.run()
    cpu = time.process_time() - cpu
    writes = engine.checkpointer.write_seconds
    return result.seconds, cpu, len(writes), (statistics.mean(writes) if writes else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | rounds | wall off (s) | wall on (s) | wall overhead | CPU off (s) | CPU on (s) | CPU overhead "
          "| checkpoints written | mean write (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, raw in (("quickstart FedAvg (20 clients)", quickstart()), ("FedAvg, 100 clients", hundred_clients())):
        off, on, off_cpu, on_cpu, written, write = [], [], [], [], [], []
        with tempfile.TemporaryDirectory() as folder:
            timed(raw, False, folder)  # warm-up: imports, caches
            for _ in range(args.repeats):
                seconds, cpu, _, _ = timed(raw, False, folder)
                off.append(seconds)
                off_cpu.append(cpu)
                seconds, cpu, n, mean_write = timed(raw, True, folder)
                on.append(seconds)
                on_cpu.append(cpu)
                written.append(n)
                write.append(mean_write)
        a, b = statistics.median(off), statistics.median(on)
        c, d = statistics.median(off_cpu), statistics.median(on_cpu)
        print(f"| {name} | {raw['experiment']['rounds']} | {a:.2f} | {b:.2f} | {100 * (b - a) / a:+.1f}% | "
              f"{c:.2f} | {d:.2f} | {100 * (d - c) / c:+.1f}% | {statistics.median(written):.0f} | "
              f"{1000 * statistics.median(write):.1f} |")

if __name__ == "__main__":
    main()
