#!/usr/bin/env python
"""Peak memory of a run with 10,000 clients against the same run with 100 (a script, not a test).

Issue 11: per-client state lives in a store with a bounded in-memory cache and spill to disk
(pfl_core/state/store.py), so a run's peak memory must not grow with the number of clients. For
each method (Local and FedRep: every client keeps a personal model, or a personal head) and
each number of clients it runs one complete experiment in a fresh subprocess with one torch
thread, and reads that subprocess's peak resident set size from the kernel
(``os.wait4``: the child's own ``ru_maxrss``, the per-child form of ``RUSAGE_CHILDREN``):

- data: ``synthetic`` (FedProx's Synthetic(1, 1)), ``dim`` features (default 60), 4 classes,
  one device per client (``partition.scheme = "domain"``), ``--samples`` per client (default 5: 4 train,
  1 test, no validation split);
- model: an MLP ``dim -> 1000 -> 4`` (65,004 parameters, 254 KiB of float32 per personal
  model; FedRep's personal head is its last layer, 4,004 parameters);
- 10% participation, ``--rounds`` rounds (default 2), batch 10, 1 local epoch (FedRep: its
  default head and body epochs), every client evaluated after the last round only (evaluating
  10,000 clients reads every state);
- ``[state]`` left at its defaults (automatic cache: at most 256 states / 256 MiB in memory),
  unless ``--cache-clients`` says otherwise; tracking off.

Left out by default (``--partition-figure`` keeps it): ``Engine._log_partition``, whose
artifacts are all dropped with tracking off, but which draws the partition figure anyway, one
bar per client and class: 41 s for 1,000 clients on this machine, and its patches grow with
the number of clients (a figure 0.35 inch wide per client), so it would measure matplotlib,
not the client store.

Each run prints its peak RSS, wall time, and the store's spill-file writes and reads; then the
ratio of the peak at the large number of clients to the peak at the small one, per method.
Target (issue 11): <= 1.5.

    python benchmarks/client_memory.py                         # Local and FedRep, 100 and 10,000 clients
    python benchmarks/client_memory.py --clients 100 1000      # a quicker check
    python benchmarks/client_memory.py --methods local --cache-clients 100000   # no spill: memory grows

Exit status 0 whatever the figures (``--strict``: 1 when a ratio is above the target).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

TARGET = 1.5
HIDDEN = 1000
# Fewer classes than samples per client: some class has two samples, which the stratified
# test split needs (with 10 classes some of 10,000 clients draw 5 distinct labels).
CLASSES = 4


def spec_for(method: str, clients: int, samples: int, dim: int, rounds: int, cache_clients: int | None) -> dict:
    spec = {
        "experiment": {"name": "client-memory", "seed": 0, "rounds": rounds, "participation": 0.1},
        "data": {"name": "synthetic", "params": {"num_devices": clients, "samples_per_device": samples, "dim": dim,
                                                  "num_classes": CLASSES}},
        "partition": {"scheme": "domain", "num_clients": clients, "min_samples": samples,
                      "val_fraction": 0.0, "test_fraction": 1 / samples},
        "model": {"name": "mlp", "params": {"hidden": [HIDDEN]}},
        "algorithm": {"name": method},
        "training": {"local_epochs": 1, "batch_size": 10, "lr": 0.05},
        "evaluation": {"every": rounds},  # the last round only
        "executor": {"name": "sequential", "threads": 1},
        "tracking": {"enabled": False, "progress": False},
    }
    if cache_clients is not None:
        spec["state"] = {"cache_clients": cache_clients}
    return spec


def child(args) -> None:
    """One run, in this (fresh) process; prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    from pfl_core.engine import Engine, resolve

    if not args.partition_figure:  # see the module docstring
        Engine._log_partition = lambda self, ctx: None
    spec = spec_for(args.method, args.child_clients, args.samples, args.dim, args.rounds, args.cache_clients)
    engine = Engine(resolve(spec), progress=False)
    started = time.perf_counter()
    result = engine.run()
    store = engine.ctx.store
    model = engine.ctx.models.working(engine.ctx.models.arch_of(0))
    print(json.dumps({
        "seconds": time.perf_counter() - started,
        "acc_mean": result.final.get("acc_mean"),
        "train_samples": int(engine.ctx.data.clients[0].num_train),
        "test_samples": len(engine.ctx.data.clients[0].test_y),
        "parameters": sum(p.numel() for p in model.parameters()),
        "cache_clients": store.cache_clients,
        "in_memory": len(store.in_memory),
        "writes": store.writes,
        "reads": store.reads,
    }))


def measure(method: str, clients: int, args) -> dict:
    """Run ``child`` in a subprocess; its report plus its peak RSS from ``os.wait4``."""
    command = [sys.executable, __file__, "--child-method", method, "--child-clients", str(clients),
               "--samples", str(args.samples), "--dim", str(args.dim), "--rounds", str(args.rounds)]
    if args.cache_clients is not None:
        command += ["--cache-clients", str(args.cache_clients)]
    if args.partition_figure:
        command.append("--partition-figure")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{method} with {clients} clients failed (exit {proc.returncode}):\n{err[-3000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    report["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: kilobytes
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["local", "fedrep"])
    parser.add_argument("--clients", nargs=2, type=int, default=[100, 10_000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--samples", type=int, default=5, help="samples per client (one is the test split)")
    parser.add_argument("--dim", type=int, default=60, help="feature dimension of the synthetic data")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-clients", type=int, default=None, help="state.cache_clients (default: automatic)")
    parser.add_argument("--partition-figure", action="store_true",
                        help="keep Engine._log_partition (draws one bar per client and class even with tracking off)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a ratio is above the target")
    parser.add_argument("--child-method", help=argparse.SUPPRESS)
    parser.add_argument("--child-clients", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_method:
        args.method = args.child_method
        child(args)
        return 0

    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; one torch thread per run")
    missed = False
    small, large = args.clients
    for method in args.methods:
        peaks = {}
        for clients in (small, large):
            r = measure(method, clients, args)
            peaks[clients] = r["peak_rss_mib"]
            print(f"{method:7s} {clients:6d} clients: peak RSS {r['peak_rss_mib']:7.1f} MiB, {r['seconds']:6.1f} s, "
                  f"acc_mean {r['acc_mean']:.3f}; {r['parameters']:,} parameters, {r['train_samples']} train / "
                  f"{r['test_samples']} test samples per client; store: at most {r['cache_clients']} states in "
                  f"memory, {r['writes']} spill writes, {r['reads']} reads", flush=True)
        ratio = peaks[large] / peaks[small]
        missed |= ratio > TARGET
        print(f"{method:7s} peak RSS {large} / {small} clients: {ratio:.2f}x (target <= {TARGET}x) "
              f"{'PASS' if ratio <= TARGET else 'MISS'}", flush=True)
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
