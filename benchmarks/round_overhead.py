#!/usr/bin/env python
"""Round overhead of the pfl engine against a plain PyTorch loop (a script, not a test).

For each (N clients, batch size B) it builds a real run context from a spec (npz data of
random 32x32x3 uint8 images, IID partition, 625 samples per client split into 500 train /
0 val / 125 test, LeNet-5, FedAvg, SGD lr 0.01, 1 local epoch) and measures:

1. ``Engine.run_round(ctx, r)`` (every client takes part) against one centralised epoch of a
   plain PyTorch loop over the same pooled 500*N training samples, same model, batch size,
   lr and torch threads, in the same process. Target: round / plain <= 1.10.
2. ``evaluate_clients(ctx)`` (every client's test split) as a fraction of one round.
   Target: <= 10%.
3. Peak RSS increase during one round (VmHWM after resetting it through
   /proc/self/clear_refs) against N model copies, and the tensors left in ``ctx.store`` /
   ``ctx.server`` after the round. Target: FedAvg holds no model per client: nothing in
   ctx.store, one model in ctx.server, and the peak increase of a round grows by less than
   half a model per added client between the smallest and largest N (with one N only: the
   peak increase stays below N/2 model copies).

Engine rounds, plain epochs and evaluations are interleaved within each repeat (the order
of the engine and the plain loop alternates) so that drift on a noisy machine hits both;
each figure is the best (minimum) of ``--repeats`` runs after one warm-up of each.

    python benchmarks/round_overhead.py                      # N 20 100, B 10 50, 3 repeats
    python benchmarks/round_overhead.py --quick              # N 20, B 50 (smoke run)
    python benchmarks/round_overhead.py --clients 20 --batch 10 --repeats 5

Exit status 0 whatever the figures (pass ``--strict`` to exit 1 on a MISS).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pfl_core.engine import Engine, resolve
from pfl_core.evaluation import evaluate_clients

TRAIN_PER_CLIENT = 500
TEST_PER_CLIENT = 125
PER_CLIENT = TRAIN_PER_CLIENT + TEST_PER_CLIENT  # test_fraction 0.2 of 625 = 125
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
LR = 0.01

RATIO_TARGET = 1.10
EVAL_TARGET = 0.10
PER_CLIENT_GROWTH_LIMIT = 0.5  # model copies per added client


# ---------------------------------------------------------------------------
# Memory helpers (Linux /proc)


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) if m else None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _tensors(obj, seen: set[int] | None = None) -> tuple[int, int]:
    """(number of tensors, bytes of their distinct storages) reachable through containers."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 1, 0
        seen.add(key)
        return 1, obj.untyped_storage().nbytes()
    count = size = 0
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    else:
        return 0, 0
    for item in items:
        c, s = _tensors(item, seen)
        count += c
        size += s
    return count, size


# ---------------------------------------------------------------------------
# Set-up through the real code path


def write_npz(path: Path, num_clients: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = num_clients * PER_CLIENT
    x = rng.integers(0, 256, size=(n, *IMAGE_SHAPE), dtype=np.uint8)
    y = rng.integers(0, NUM_CLASSES, size=n).astype(np.int64)
    np.savez(path, x_train=x, y_train=y, classes=np.array([str(c) for c in range(NUM_CLASSES)]))


def make_spec(npz: Path, num_clients: int, batch_size: int) -> dict:
    return {
        "experiment": {"name": "round_overhead", "seed": 0, "rounds": 1},
        "data": {"name": "npz", "params": {"path": str(npz)}},
        "partition": {"scheme": "iid", "num_clients": num_clients, "val_fraction": 0.0, "test_fraction": 0.2},
        "model": {"name": "lenet5"},
        "algorithm": {"name": "fedavg"},
        "training": {"local_epochs": 1, "batch_size": batch_size, "lr": LR},
        "tracking": {"enabled": False, "progress": False},
        # executor.threads unset: torch's default intra-op threads, same for the plain loop
    }


def prepare(npz: Path, num_clients: int, batch_size: int):
    engine = Engine(resolve(make_spec(npz, num_clients, batch_size)), progress=False)
    ctx = engine.prepare()
    sizes = {(c.num_train, len(c.test_y)) for c in ctx.data.clients}
    if sizes != {(TRAIN_PER_CLIENT, TEST_PER_CLIENT)}:
        raise SystemExit(f"unexpected client split sizes {sorted(sizes)}")
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


# ---------------------------------------------------------------------------
# The plain loop


def plain_epoch(model, optimizer, x, y, batch_size: int, generator: torch.Generator) -> None:
    model.train()
    n = len(y)
    order = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        xb, yb = x[idx], y[idx]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()


# ---------------------------------------------------------------------------
# One configuration


def bench(npz: Path, num_clients: int, batch_size: int, repeats: int) -> dict:
    engine, ctx = prepare(npz, num_clients, batch_size)
    arch = ctx.models.arch_of(0)
    x, y = ctx.data.pooled_train()
    assert len(y) == num_clients * TRAIN_PER_CLIENT
    torch.set_flush_denormal(True)  # the engine sets it in prepare(); stated here for the plain loop
    generator = torch.Generator().manual_seed(0)
    training = ctx.spec.training

    def fresh_plain():
        model = ctx.models.build(arch)
        return model, torch.optim.SGD(model.parameters(), lr=training.lr, momentum=training.momentum,
                                      weight_decay=training.weight_decay)

    rnd = 0

    def time_round() -> float:
        nonlocal rnd
        rnd += 1
        gc.collect()
        t0 = time.perf_counter()
        engine.run_round(ctx, rnd)
        return time.perf_counter() - t0

    def time_plain() -> float:
        model, opt = fresh_plain()
        gc.collect()
        t0 = time.perf_counter()
        plain_epoch(model, opt, x, y, batch_size, generator)
        return time.perf_counter() - t0

    def time_eval() -> float:
        gc.collect()
        t0 = time.perf_counter()
        evaluate_clients(ctx)
        return time.perf_counter() - t0

    # warm-up: one of each
    time_round()
    time_plain()
    time_eval()

    rounds, plains, evals = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            rounds.append(time_round())
            plains.append(time_plain())
        else:
            plains.append(time_plain())
            rounds.append(time_round())
        evals.append(time_eval())

    # memory: peak RSS increase during one round, and what the stores hold afterwards
    gc.collect()
    rss_before = _status_kb("VmRSS")
    peak_ok = _reset_peak()
    rnd += 1
    engine.run_round(ctx, rnd)
    hwm = _status_kb("VmHWM")
    gc.collect()
    rss_after = _status_kb("VmRSS")
    peak_kb = (hwm - rss_before) if (peak_ok and hwm is not None and rss_before is not None) else None
    store_n, store_b = _tensors([ctx.store[i] for i in ctx.store])
    server_n, server_b = _tensors(ctx.server)
    model_bytes = sum(v.numel() * v.element_size() for v in ctx.models.working(arch).state_dict().values())
    model_tensors = len(ctx.models.working(arch).state_dict())

    del x, y, ctx, engine
    gc.collect()
    return {
        "N": num_clients,
        "B": batch_size,
        "steps": num_clients * TRAIN_PER_CLIENT // batch_size,
        "round_best": min(rounds),
        "round_med": statistics.median(rounds),
        "plain_best": min(plains),
        "plain_med": statistics.median(plains),
        "eval_best": min(evals),
        "eval_med": statistics.median(evals),
        "ratio": min(rounds) / min(plains),
        "ratio_med": statistics.median(r / p for r, p in zip(rounds, plains)),
        "eval_frac": min(evals) / min(rounds),
        "peak_kb": peak_kb,
        "retained_kb": None if rss_after is None or rss_before is None else rss_after - rss_before,
        "model_bytes": model_bytes,
        "model_tensors": model_tensors,
        "store_tensors": store_n,
        "store_bytes": store_b,
        "server_tensors": server_n,
        "server_bytes": server_b,
    }


# ---------------------------------------------------------------------------
# Report


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(results: list[dict]) -> bool:
    mb = 1 / 1024  # kB -> MB
    print()
    print(f"{'N':>4} {'B':>3} {'steps':>6} | {'round s':>8} {'(med)':>8} | {'plain s':>8} {'(med)':>8} | "
          f"{'ratio':>6} {'(med)':>6} | {'eval s':>7} {'eval/rnd':>8} | {'peak dRSS MB':>12} "
          f"{'N*model MB':>10} | {'store':>5} {'server':>11}")
    print("-" * 136)
    for r in results:
        peak = "n/a" if r["peak_kb"] is None else f"{r['peak_kb'] * mb:.1f}"
        print(f"{r['N']:>4} {r['B']:>3} {r['steps']:>6} | {r['round_best']:>8.3f} {r['round_med']:>8.3f} | "
              f"{r['plain_best']:>8.3f} {r['plain_med']:>8.3f} | {r['ratio']:>6.3f} {r['ratio_med']:>6.3f} | "
              f"{r['eval_best']:>7.3f} {r['eval_frac'] * 100:>7.1f}% | {peak:>12} "
              f"{r['N'] * r['model_bytes'] / 2**20:>10.2f} | {r['store_tensors']:>5} "
              f"{r['server_tensors']:>3} ({r['server_bytes'] / 1024:.0f} kB)")
    print()
    print("round/plain: best-of-repeats engine round over best-of-repeats plain epoch ((med): median of paired ratios)")
    print("store: tensors in ctx.store (all clients); server: tensors in ctx.server (their distinct bytes)")

    all_ok = True
    print()
    print("Targets")
    for r in results:
        tag = f"N={r['N']:<3} B={r['B']:<3}"
        ok1 = r["ratio"] <= RATIO_TARGET
        ok2 = r["eval_frac"] <= EVAL_TARGET
        print(f"  {tag} round / plain epoch   {r['ratio']:.3f} <= {RATIO_TARGET:.2f}   {verdict(ok1)}")
        print(f"  {tag} eval / round          {r['eval_frac'] * 100:5.1f}% <= {EVAL_TARGET * 100:.0f}%   {verdict(ok2)}")
        all_ok &= ok1 and ok2

    # memory
    for r in results:
        tag = f"N={r['N']:<3} B={r['B']:<3}"
        ok = r["store_tensors"] == 0 and r["server_bytes"] <= r["model_bytes"]
        print(f"  {tag} state after round: {r['store_tensors']} tensors in ctx.store, "
              f"{r['server_bytes'] / r['model_bytes']:.2f} model(s) in ctx.server (<= 1)   {verdict(ok)}")
        all_ok &= ok
    by_batch: dict[int, list[dict]] = {}
    for r in results:
        if r["peak_kb"] is not None:
            by_batch.setdefault(r["B"], []).append(r)
    if not by_batch:
        print("  peak RSS: not measurable here (/proc/self/clear_refs unavailable)   n/a")
    for b, rows in sorted(by_batch.items()):
        rows = sorted(rows, key=lambda r: r["N"])
        model_kb = rows[0]["model_bytes"] / 1024
        lo, hi = rows[0], rows[-1]
        if lo["N"] != hi["N"]:
            per_client = (hi["peak_kb"] - lo["peak_kb"]) / (hi["N"] - lo["N"]) / model_kb
            ok = per_client < PER_CLIENT_GROWTH_LIMIT
            print(f"  B={b:<3} peak round RSS N={lo['N']} -> N={hi['N']}: {lo['peak_kb'] / 1024:.1f} -> "
                  f"{hi['peak_kb'] / 1024:.1f} MB = {per_client:+.3f} model copies per added client "
                  f"(< {PER_CLIENT_GROWTH_LIMIT})   {verdict(ok)}")
        else:
            copies = lo["peak_kb"] / model_kb
            ok = copies < lo["N"] * PER_CLIENT_GROWTH_LIMIT
            print(f"  B={b:<3} peak round RSS N={lo['N']}: {lo['peak_kb'] / 1024:.1f} MB = {copies:.1f} model "
                  f"copies (< N/2 = {lo['N'] * PER_CLIENT_GROWTH_LIMIT:.0f})   {verdict(ok)}")
        all_ok &= ok
    return all_ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 100], help="numbers of clients (N)")
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 50], help="batch sizes (B)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after warm-up (best is reported)")
    parser.add_argument("--quick", action="store_true", help="N=20, B=50 only (smoke run)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.batch = [20], [50]
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    started = time.perf_counter()
    print(f"pfl round overhead: python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} "
          f"(interop {torch.get_num_interop_threads()}), {platform.machine()}")
    print(f"LeNet-5, {IMAGE_SHAPE[2]}x{IMAGE_SHAPE[0]}x{IMAGE_SHAPE[1]} inputs, {NUM_CLASSES} classes; per client "
          f"{TRAIN_PER_CLIENT} train / {TEST_PER_CLIENT} test samples; FedAvg, 1 local epoch, SGD lr {LR}; "
          f"repeats {args.repeats} (best reported)")
    results = []
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        for n in args.clients:
            npz = Path(tmp) / f"random_{n}.npz"
            write_npz(npz, n, seed=n)
            for b in args.batch:
                t0 = time.perf_counter()
                r = bench(npz, n, b, args.repeats)
                print(f"  N={n:<3} B={b:<3} done in {time.perf_counter() - t0:.0f}s: round {r['round_best']:.3f}s, "
                      f"plain {r['plain_best']:.3f}s, ratio {r['ratio']:.3f}, eval {r['eval_frac'] * 100:.1f}%",
                      flush=True)
                results.append(r)
            npz.unlink()
    ok = report(results)
    print()
    print(f"overall: {verdict(ok)}   (total {time.perf_counter() - started:.0f}s)")
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
