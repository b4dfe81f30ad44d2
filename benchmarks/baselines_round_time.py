#!/usr/bin/env python
"""Round time of Ditto, APFL, pFedMe, Per-FedAvg and FedBN relative to FedAvg (a script, not a test).

Each method runs the tests' tiny spec (synthetic data, 4 clients of 84 training samples, an MLP
with one hidden layer of 16 units, 1 local epoch, batch 10, every client every round) at its
default parameters; FedBN and its FedAvg reference use the same MLP with ``norm = "batch"``.
For every repeat, each method (in an order rotated per repeat) runs one round
(``Engine.run_round``) and one evaluation (``evaluate_clients``) on an engine prepared and
warmed up (one round, one evaluation) beforehand; the figures are the medians over the repeats
of the time per round and per evaluation, and their ratios to FedAvg's medians on the same model.

    OMP_NUM_THREADS=1 python benchmarks/baselines_round_time.py               # 7 repeats
    OMP_NUM_THREADS=1 python benchmarks/baselines_round_time.py --repeats 15

The ratios follow from each method's work per round: Ditto trains two models (2x the
samples), APFL two forward/backward passes per sample, pFedMe K = 5 inner steps per batch,
Per-FedAvg (FO) one pass plus the copies of a meta step, FedBN FedAvg's. Exit status 0.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from pfl_core.engine import Engine, resolve
from pfl_core.runtime.evaluation import evaluate_clients
from pfl_core.spec import set_dotted

TINY = {
    "experiment": {"name": "round-time", "seed": 0, "rounds": 1000},
    "data": {"name": "synthetic", "params": {"num_devices": 4, "samples_per_device": 120, "dim": 20}},
    "partition": {"scheme": "domain", "num_clients": 4},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "algorithm": {"name": "fedavg"},
    "training": {"local_epochs": 1, "batch_size": 10, "lr": 0.1},
    "tracking": {"enabled": False, "progress": False},
}
BN = {"model.params.norm": "batch"}
METHODS = {  # label -> (overrides, reference label)
    "fedavg": ({}, "fedavg"),
    "ditto": ({"algorithm.name": "ditto"}, "fedavg"),
    "apfl": ({"algorithm.name": "apfl"}, "fedavg"),
    "pfedme": ({"algorithm.name": "pfedme"}, "fedavg"),
    "perfedavg": ({"algorithm.name": "perfedavg"}, "fedavg"),
    "fedavg+bn": (BN, "fedavg+bn"),
    "fedbn": ({"algorithm.name": "fedbn", **BN}, "fedavg+bn"),
}


def prepared(overrides):
    raw = copy.deepcopy(TINY)
    for key, value in overrides.items():
        set_dotted(raw, key, value)
    engine = Engine(resolve(raw), progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    engine.run_round(ctx, 1)  # warm-up
    evaluate_clients(ctx)
    return engine, ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {label: prepared(overrides) for label, (overrides, _) in METHODS.items()}
    labels = list(METHODS)
    rounds = {label: [] for label in labels}
    evals = {label: [] for label in labels}
    for rep in range(args.repeats):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            engine, ctx = runs[label]
            r = ctx.round + 1
            start = time.perf_counter()
            engine.run_round(ctx, r)
            rounds[label].append(time.perf_counter() - start)
            start = time.perf_counter()
            evaluate_clients(ctx)
            evals[label].append(time.perf_counter() - start)
    print(f"{'method':<11} {'round ms':>9} {'x ref':>6} {'eval ms':>8} {'x ref':>6}  reference")
    for label in labels:
        ref = METHODS[label][1]
        r, e = statistics.median(rounds[label]), statistics.median(evals[label])
        r0, e0 = statistics.median(rounds[ref]), statistics.median(evals[ref])
        print(f"{label:<11} {1e3 * r:9.1f} {r / r0:6.2f} {1e3 * e:8.1f} {e / e0:6.2f}  {ref}")


if __name__ == "__main__":
    main()
