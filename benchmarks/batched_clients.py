#!/usr/bin/env python
"""Clients trained together (``executor.name = "batched"``) against the sequential loop (a
script, not a test).

One FedAvg round of ``--clients`` LeNet-5 clients (random 32x32x3 uint8 images, 10 random
labels, each client a seeded random number of training samples in ``--samples MIN MAX``,
batch ``--batch``, 1 local epoch, SGD lr 0.01), every client taking part, run through the real
code path (``resolve``, ``Engine.prepare``, the ``setup`` hook, ``Engine.run_round``) twice:
with ``executor.name = "sequential"`` and with ``"batched"``, on ``--device cpu`` or ``cuda``.
Both engines start each timed round from the same global model, so their aggregated models
must agree: the script prints the largest absolute difference between them.

A warm-up round (not timed) comes first for each, then ``--repeats`` timed rounds, the two
executors alternating; the medians are compared. Target (issue 11): batched >= 5x the
sequential loop on a GPU; on a CPU it is reported, not judged.

    python benchmarks/batched_clients.py --device cuda                     # 100 clients, 50-500 samples, batch 10
    python benchmarks/batched_clients.py --device cpu --clients 20 --samples 50 100 --repeats 1

Exit status 0 whatever the figures. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.context import clone_state

SPEEDUP_TARGET = 5.0  # on a GPU
NUM_CLASSES = 10


def write_images(path: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, NUM_CLASSES, count), classes=np.array([str(c) for c in range(NUM_CLASSES)]))


def prepared(npz: Path, executor: str, args):
    """An engine after ``prepare`` and ``setup``, each client cut to its seeded size."""
    raw = {
        "experiment": {"name": "batched_clients", "seed": 0, "rounds": 1},
        "data": {"name": "npz", "params": {"path": str(npz)}},
        "partition": {"scheme": "iid", "num_clients": args.clients, "val_fraction": 0.0, "test_fraction": 0.01},
        "model": {"name": "lenet5"},
        "algorithm": {"name": "fedavg"},
        "training": {"local_epochs": 1, "batch_size": args.batch, "lr": 0.01},
        "tracking": {"enabled": False, "progress": False},
        "executor": {"name": executor, "device": args.device, "threads": args.threads},
    }
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    sizes = np.random.default_rng(1).integers(args.samples[0], args.samples[1] + 1, args.clients)
    for client, n in zip(ctx.data.clients, sizes):
        client.train_x, client.train_y = client.train_x[:n], client.train_y[:n]
    return engine, ctx


def timed_round(engine, ctx, start: dict) -> float:
    """Seconds of round 1 from the global model ``start`` (the device's queue drained)."""
    ctx.server["global"] = clone_state(start)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    engine.run_round(ctx, 1)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--samples", type=int, nargs=2, default=(50, 500), metavar=("MIN", "MAX"))
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (executor.threads)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        npz = Path(folder) / "images.npz"
        write_images(npz, int(args.clients * args.samples[1] * 1.02) + args.clients)
        engines = {name: prepared(npz, name, args) for name in ("sequential", "batched")}
        start = clone_state(engines["sequential"][1].server["global"])
        sizes = [c.num_train for c in engines["sequential"][1].data.clients]
        print(f"{args.clients} LeNet-5 clients, {min(sizes)}-{max(sizes)} training samples each "
              f"({sum(sizes)} in all), batch {args.batch}, 1 epoch, device {args.device}, "
              f"torch threads {torch.get_num_threads()}")
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        for name, (engine, ctx) in engines.items():  # warm-up
            timed_round(engine, ctx, start)
        for repeat in range(args.repeats):
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for name in order:
                seconds[name].append(timed_round(*engines[name], start))
        batched_ctx = engines["batched"][1]
        assert batched_ctx.resolved_values.get("executor.batched") == "yes", batched_ctx.resolved_values
        sequential, batched = (statistics.median(seconds[n]) for n in ("sequential", "batched"))
        a, b = engines["sequential"][1].server["global"], batched_ctx.server["global"]
        difference = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        for name in engines:
            print(f"  {name:10s} round: median {statistics.median(seconds[name]):.3f} s "
                  f"(all: {', '.join(f'{s:.3f}' for s in seconds[name])})")
        ratio = sequential / batched
        verdict = ("PASS" if ratio >= SPEEDUP_TARGET else "MISS") if args.device == "cuda" else "not judged on a CPU"
        print(f"  speed-up sequential / batched: {ratio:.2f}x (target >= {SPEEDUP_TARGET:g}x on a GPU: {verdict})")
        print(f"  max |aggregated weights sequential - batched|: {difference:.3g}")


if __name__ == "__main__":
    main()
