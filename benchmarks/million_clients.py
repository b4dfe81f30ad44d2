#!/usr/bin/env python
"""Set-up time, time per round and peak memory from 100 to 1,000,000 clients (a script, not a test).

Issue 37 ("a million clients"): 1,000,000 clients at 0.1% participation (1,000 per round),
each client's data generated on demand from (the data's seed, its id) by the dataset
``synthetic_clients`` (pfl_core/data/datasets.py), every client's state in the client store
(pfl_core/state/store.py: at most 256 in memory, the rest spilled to disk), a sample of clients
evaluated (``evaluation.clients``). Set-up must not grow with the number of clients faster than
linearly, and the peak memory of a million clients must stay within 2x that of 100.

For each number of clients it runs one experiment in a fresh subprocess with one torch thread:

- data: ``synthetic_clients`` (FedProx's Synthetic(1, 1), 60 features, 10 classes), ``--samples``
  per client (default 300, as the quickstart), one client per generating device;
- model: multinomial logistic regression (``mlp`` with no hidden layer, as the quickstart);
  ``--method`` (default FedAvg; ``local`` keeps a personal model per client in the store);
- participation 0.1% (``max(1, round(0.001 N))`` clients a round), ``--rounds`` rounds (default
  3; the first is shown apart: it also imports what torch.optim loads lazily, seconds), batch 10, 1 local epoch, sequential executor; ``evaluation.clients = --evaluate``
  (default 100) clients evaluated after the last round only; tracking off.

It prints per run: set-up seconds (``Engine.prepare``: the data, the model bank, the client
store and the run context), the Python heap allocated during set-up (``tracemalloc``'s peak,
numpy's arrays included: what a list or an array per client would show), seconds per round
(training only, its participants' data generated on demand included) and per participant, the
evaluation's seconds, and the subprocess's peak resident set size (``os.wait4``: the child's
own ``ru_maxrss``); then each peak RSS against that of the smallest run.

    python benchmarks/million_clients.py                              # 100 .. 1,000,000 clients
    python benchmarks/million_clients.py --clients 100 1000 10000     # a quicker check
    python benchmarks/million_clients.py --method local               # personal models: the store spills

Exit status 0 whatever the figures (``--strict``: 1 when the largest run's peak RSS is above
2x the smallest's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

TARGET = 2.0
PARTICIPATION = 0.001


def spec_for(method: str, clients: int, samples: int, rounds: int, evaluate: int) -> dict:
    return {
        "experiment": {"name": "million-clients", "seed": 0, "rounds": rounds, "participation": PARTICIPATION},
        "data": {"name": "synthetic_clients", "params": {"samples_per_client": samples}},
        "partition": {"scheme": "domain", "num_clients": clients},
        "model": {"name": "mlp", "params": {"hidden": []}},
        "algorithm": {"name": method},
        "training": {"local_epochs": 1, "batch_size": 10, "lr": 0.05},
        "evaluation": {"every": rounds, "clients": min(evaluate, clients)},  # the last round only
        "executor": {"name": "sequential", "threads": 1},
        "tracking": {"enabled": False, "progress": False},
    }


def child(args) -> None:
    """One run, in this (fresh) process; prints one JSON line."""
    import tracemalloc

    import torch

    torch.set_num_threads(1)
    from pfl_core.engine import Engine, resolve
    from pfl_core.runtime import evaluation

    times: dict[str, list[float]] = {"setup": [], "round": [], "evaluation": []}
    heap: dict[str, int] = {}

    def timed(name, function):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                times[name].append(time.perf_counter() - started)
        return wrapper

    prepare = Engine.prepare

    def traced_prepare(self):
        tracemalloc.start()
        try:
            return prepare(self)
        finally:
            heap["setup_peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    Engine.prepare = timed("setup", traced_prepare)
    Engine.run_round = timed("round", Engine.run_round)
    import pfl_core.engine.engine as engine_module

    engine_module.evaluate_clients = timed("evaluation", evaluation.evaluate_clients)
    spec = spec_for(args.method, args.child_clients, args.samples, args.rounds, args.evaluate)
    engine = Engine(resolve(spec), progress=False)
    started = time.perf_counter()
    result = engine.run()
    ctx = engine.ctx
    participants = max(1, int(PARTICIPATION * args.child_clients + 0.5))
    print(json.dumps({
        "seconds": time.perf_counter() - started,
        "setup_seconds": times["setup"][0],
        "setup_heap_mib": heap["setup_peak"] / 2**20,
        "first_round_seconds": times["round"][0],
        # the first round also imports what torch.optim loads lazily (torch._dynamo: seconds)
        "round_seconds": sum(times["round"][1:]) / max(len(times["round"]) - 1, 1),
        "participants": participants,
        "evaluation_seconds": sum(times["evaluation"]),
        "evaluated": len(result.client_rows),
        "acc_mean": result.final.get("acc_mean"),
        "clients_built": getattr(ctx.data.clients, "built", None),
        "store_writes": ctx.store.writes,
        "store_reads": ctx.store.reads,
    }))


def measure(clients: int, args) -> dict:
    """Run ``child`` in a subprocess; its report plus its peak RSS from ``os.wait4``."""
    command = [sys.executable, __file__, "--child-clients", str(clients), "--method", args.method,
               "--samples", str(args.samples), "--rounds", str(args.rounds), "--evaluate", str(args.evaluate)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()  # the child writes one note line to stderr
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{clients} clients failed (exit {proc.returncode}):\n{err[-3000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    report["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: kilobytes
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--samples", type=int, default=300, help="samples per client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--evaluate", type=int, default=100, help="evaluation.clients: clients evaluated")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the largest peak is above the target")
    parser.add_argument("--child-clients", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_clients:
        child(args)
        return 0

    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; one torch thread per run; {args.method}, "
          f"{PARTICIPATION:.1%} participation, {args.rounds} rounds, {args.samples} samples per client")
    peaks = {}
    for clients in args.clients:
        r = measure(clients, args)
        peaks[clients] = r["peak_rss_mib"]
        print(f"{clients:9,d} clients: set-up {r['setup_seconds']:6.2f} s (heap {r['setup_heap_mib']:6.2f} MiB), "
              f"round 1 {r['first_round_seconds']:6.2f} s, later rounds {r['round_seconds']:7.2f} s "
              f"for {r['participants']:5,d} participants "
              f"({1000 * r['round_seconds'] / r['participants']:5.1f} ms each), evaluation of "
              f"{r['evaluated']} clients {r['evaluation_seconds']:5.2f} s, peak RSS {r['peak_rss_mib']:7.1f} MiB, "
              f"acc_mean {r['acc_mean']:.3f}; clients built {r['clients_built']}, store writes "
              f"{r['store_writes']}, reads {r['store_reads']}", flush=True)
    smallest, largest = min(peaks), max(peaks)
    ratio = peaks[largest] / peaks[smallest]
    print(f"peak RSS {largest:,} / {smallest:,} clients: {ratio:.2f}x (target <= {TARGET}x) "
          f"{'PASS' if ratio <= TARGET else 'MISS'}; load average now {os.getloadavg()[0]:.1f}", flush=True)
    return 1 if (ratio > TARGET and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
