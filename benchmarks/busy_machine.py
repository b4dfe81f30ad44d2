#!/usr/bin/env python
"""How a run's wall time holds up when another busy process shares the cores (a script, not a test).

Runs one spec (default: the quickstart's FedAvg run, ``--no-sweep``, no tracking) in a fresh
``pfl-run`` process, first on a quiet machine and then while a busy process (one thread
spinning in a torch matmul loop) runs beside it, for each executor configuration given:

- ``default``: no ``[executor]`` settings at all (``auto``: what a user gets);
- ``sequential-1``: ``executor.name = "sequential"``, one thread;
- ``sequential-torch``: ``executor.name = "sequential"`` with torch's own thread count (one per
  core), the setting this project used to default to.

It prints, per configuration, the median wall time of ``--repeats`` runs quiet and busy (the
two alternate, so a slow phase of the machine hits both) and busy / quiet. Target for
``default``: busy / quiet <= 1.3. Results are the same in every configuration (the script
checks the printed ``acc_mean``).

    python benchmarks/busy_machine.py                       # quickstart, 3 repeats
    python benchmarks/busy_machine.py --repeats 5 --configs default sequential-torch
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "default": [],
    "sequential-1": ["--set", "executor.name=sequential", "--set", "executor.threads=1"],
    "sequential-torch": ["--set", "executor.name=sequential", "--set", f"executor.threads={os.cpu_count() or 1}"],
}
TARGET = 1.3


def spin(stop) -> None:
    """A busy neighbour: one thread of dense matmuls until told to stop."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def one_run(spec: str, extra: list[str]) -> tuple[float, str]:
    command = [sys.executable, "-m", "pfl_core.cli", "run", spec, "--no-tracking", "--no-sweep", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    accuracy = re.findall(r"acc_mean\D*([0-9.]+)", done.stdout + done.stderr)
    return seconds, accuracy[-1] if accuracy else "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="specs/quickstart.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    print(f"{args.spec}, FedAvg, --no-sweep; {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    rows = []
    for name in args.configs:
        quiet, busy, accuracies = [], [], set()
        for _ in range(args.repeats):
            seconds, accuracy = one_run(args.spec, CONFIGS[name])
            quiet.append(seconds)
            accuracies.add(accuracy)
            stop = multiprocessing.Event()
            neighbour = multiprocessing.Process(target=spin, args=(stop,), daemon=True)
            neighbour.start()
            try:
                time.sleep(0.5)  # let it get going
                seconds, accuracy = one_run(args.spec, CONFIGS[name])
            finally:
                stop.set()
                neighbour.join(5)
            busy.append(seconds)
            accuracies.add(accuracy)
        q, b = statistics.median(quiet), statistics.median(busy)
        rows.append((name, q, b, b / q, ",".join(sorted(accuracies))))
        print(f"  {name:<17} quiet {q:6.2f}s  busy {b:6.2f}s  busy/quiet {b / q:5.2f}  acc_mean {rows[-1][4]}", flush=True)
    print()
    for name, q, b, ratio, _ in rows:
        if name == "default":
            print(f"default: busy / quiet {ratio:.2f} <= {TARGET}  {'PASS' if ratio <= TARGET else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
