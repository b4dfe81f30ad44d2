#!/usr/bin/env python
"""``training.precision = "bf16"`` against fp32 (issue 37; a script, not a test).

Speed (the default): one FedAvg round of ``--clients`` clients with the CIFAR CNN ``cnn2``
(PFLlib's FedAvgCNN: two 5x5 convolutions, 32 and 64 channels, a 512-unit layer) on random
32x32x3 uint8 images (``--samples`` training samples per client, 10 labels, batch ``--batch``,
1 local epoch, SGD lr 0.01, every client taking part, sequential executor), run through the
real code path (``resolve``, ``Engine.prepare``, ``setup``, ``Engine.run_round``) with fp32 and
with bf16, and the evaluation of every client (``evaluate_clients``). Both precisions start
every timed round from the same global model; a warm-up round each, then ``--repeats`` rounds
alternating the two; medians compared. The machine's load average is printed with the
figures: on a shared machine they move with it.

Accuracy (``--accuracy``): ``--spec`` (default specs/quickstart.toml, FedAvg) on 5 seeds with
``training.precision`` swept over fp32 and bf16 (the same partitions, initialisations and
budget per seed), into a throw-away MLflow store; prints pfl-run's table, whose bf16 row carries
the paired difference to fp32 with its 95% interval (marked when the interval excludes 0).

    python benchmarks/bf16.py                                  # 20 clients x 500 samples, 3 repeats
    python benchmarks/bf16.py --accuracy                        # 5 seeds, quickstart, fedavg
    python benchmarks/bf16.py --accuracy --spec specs/X.toml --set algorithm.name=fedavg
    python benchmarks/bf16.py --emulated --clients 10           # a CPU without avx512_bf16 (this one)

Exit status 0 whatever the figures; 2 on a CPU without native bfloat16 (avx512_bf16 or AMX)
unless ``--emulated`` is given, which runs the oneDNN emulation (the numerics of bfloat16, not
its speed). See
docs/benchmarks.md, "bf16".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pfl_core.engine import Engine, resolve
from pfl_core.runtime import precision
from pfl_core.runtime.context import clone_state
from pfl_core.runtime.evaluation import evaluate_clients
from pfl_core.runtime.precision import bf16_supported

NUM_CLASSES = 10
PRECISIONS = ("fp32", "bf16")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def write_images(path: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, NUM_CLASSES, count), classes=np.array([str(c) for c in range(NUM_CLASSES)]))


def prepared(npz: Path, precision: str, args):
    raw = {
        "experiment": {"name": "bf16", "seed": 0, "rounds": 1},
        "data": {"name": "npz", "params": {"path": str(npz)}},
        "partition": {"scheme": "iid", "num_clients": args.clients, "val_fraction": 0.0, "test_fraction": 0.25},
        "model": {"name": "cnn2"},
        "algorithm": {"name": "fedavg"},
        "training": {"local_epochs": 1, "batch_size": args.batch, "lr": 0.01, "precision": precision},
        "tracking": {"enabled": False, "progress": False},
        "executor": {"name": "sequential", "threads": args.threads},
    }
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def timed(engine, ctx, start: dict) -> tuple[float, float]:
    """(seconds of round 1's training from ``start``, seconds of evaluating every client)."""
    ctx.server["global"] = clone_state(start)
    began = time.perf_counter()
    engine.run_round(ctx, 1)
    trained = time.perf_counter()
    evaluate_clients(ctx)
    return trained - began, time.perf_counter() - trained


def speed(args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        npz = Path(folder) / "images.npz"
        per_client = int(args.samples / 0.75) + 1  # test_fraction 0.25
        write_images(npz, args.clients * per_client)
        engines = {p: prepared(npz, p, args) for p in PRECISIONS}
        start = clone_state(engines["fp32"][1].server["global"])
        ctx = engines["fp32"][1]
        print(f"{args.clients} cnn2 clients x {ctx.data.clients[0].num_train} training samples, batch {args.batch}, "
              f"1 epoch, sequential, torch threads {torch.get_num_threads()}, evaluation batch "
              f"{ctx.spec.evaluation.batch_size}; {load()}")
        rounds: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        evals: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for p in PRECISIONS:  # warm-up
            timed(*engines[p], start)
        for repeat in range(args.repeats):
            for p in (PRECISIONS if repeat % 2 == 0 else PRECISIONS[::-1]):
                train, evaluation = timed(*engines[p], start)
                rounds[p].append(train)
                evals[p].append(evaluation)
        for p in PRECISIONS:
            print(f"  {p}: round (training) median {statistics.median(rounds[p]):.2f} s "
                  f"(all: {', '.join(f'{s:.2f}' for s in rounds[p])}); evaluation median "
                  f"{statistics.median(evals[p]):.2f} s")
        a, b = engines["fp32"][1].server["global"], engines["bf16"][1].server["global"]
        difference = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        print(f"  speed-up bf16 over fp32 per round: {statistics.median(rounds['fp32']) / statistics.median(rounds['bf16']):.2f}x"
              f", per evaluation: {statistics.median(evals['fp32']) / statistics.median(evals['bf16']):.2f}x")
        print(f"  max |aggregated weights fp32 - bf16| after one round: {difference:.3g}; "
              f"weights' dtype in bf16: {sorted({str(t.dtype) for t in b.values()})}")
        print(f"  {load()}")


def accuracy(args) -> int:
    from pfl_core.cli import run_main

    with tempfile.TemporaryDirectory() as folder:
        print(f"{args.spec}, 5 seeds, training.precision fp32 vs bf16; {load()}", flush=True)
        sets = [item for value in args.set for item in ("--set", value)]
        code = run_main([args.spec, *sets, "--set", "experiment.seeds=[0,1,2,3,4]",
                         "--sweep", "training.precision=fp32,bf16", "--tracking-uri", f"sqlite:///{folder}/mlflow.db",
                         "--out", f"{folder}/out"])
        print(f"{load()}")
        return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--samples", type=int, default=500, help="training samples per client")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (executor.threads)")
    parser.add_argument("--accuracy", action="store_true", help="the 5-seed comparison instead of the speed")
    parser.add_argument("--spec", default=str(Path(__file__).resolve().parent.parent / "specs" / "quickstart.toml"))
    parser.add_argument("--set", action="append", default=["algorithm.name=fedavg"], metavar="KEY=VALUE",
                        help="passed to pfl-run (default: algorithm.name=fedavg)")
    parser.add_argument("--emulated", action="store_true",
                        help="run bf16 even on a CPU without avx512_bf16 or AMX (pfl-run refuses it there): "
                             "oneDNN then emulates bfloat16, so the speed is that of the emulation")
    args = parser.parse_args()
    if not bf16_supported("cpu"):
        if not args.emulated:
            print("bf16.py: this CPU has no native bfloat16 (avx512_bf16 or AMX), so pfl-run refuses "
                  "training.precision = 'bf16' here; --emulated measures it anyway", file=sys.stderr)
            return 2
        precision.bf16_supported = lambda device: True  # this process only: the emulated path
        print("bf16 EMULATED: this CPU has no avx512_bf16 or AMX instructions")
    if args.accuracy:
        return accuracy(args)
    speed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
