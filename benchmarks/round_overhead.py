#!/usr/bin/env python
"""Round overhead of the pfl engine against a plain PyTorch loop (a script, not a test).

For each (N clients, batch size B) it builds a run context through the real code path (a
spec with npz data of random 32x32x3 uint8 images and labels, IID partition, 500 train /
0 val / 100 test samples per client, LeNet-5, FedAvg, SGD lr 0.01, 1 local epoch,
``Engine.prepare()`` and the ``setup`` hook) and measures:

1. ``Engine.run_round(ctx, r)`` with every client taking part, against one centralised
   epoch of a plain PyTorch loop (``for`` over a randperm, slice, SGD step) over the same
   pooled 500*N training samples, with a fresh LeNet-5 from ``ctx.models.build``, the same
   batch size, lr and torch threads, in the same process. Target: round / plain <= 1.10.
2. ``evaluate_clients(ctx)`` (every client's test split) as a fraction of one round.
   Target: <= 10%.
3. Memory: FedAvg must hold no model per client. After the rounds ``ctx.store`` holds no
   tensor and ``ctx.server`` at most one model; and the peak of live tensor memory during
   a round (torch.profiler allocation events) grows by less than half a model per added
   client, between a round of 2 clients and one of all N (and between the smallest and
   largest N). The peak RSS increase (VmHWM after resetting it through
   /proc/self/clear_refs) is printed too, for information: glibc's allocator makes it
   move by several MB from one run to the next.

Warm-up: a round and an evaluation of 2 clients and a plain epoch of 1,000 samples. Then
``--repeats`` times a round and a plain epoch back to back (their order alternating) and an
evaluation. The judged ratios are medians over the repeats of the ratios within a repeat,
so that slow and fast phases of a shared machine hit both sides; the best and median
times are printed too. A repeat during which other processes were busy is retried.

    python benchmarks/round_overhead.py                      # N 20 100, B 10 50, 3 repeats
    python benchmarks/round_overhead.py --quick              # N 20, B 50, no retries (a quick check, ~20 s)
    python benchmarks/round_overhead.py --clients 20 --batch 10 --repeats 5

Exit status 0 whatever the figures (``--strict``: 1 when a target is missed). See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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
from pfl_core.runtime.evaluation import evaluate_clients

TRAIN_PER_CLIENT = 500
TEST_PER_CLIENT = 100  # default: 20% of the 500 training samples (--test-per-client)
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
LR = 0.01

RATIO_TARGET = 1.10  # sequential executor
POOL_RATIO_TARGET = 0.60  # a process pool on 2 cores (issue 11)
# --executor / --workers / --algorithm, set once by main()
RUN = {"executor": {"name": "sequential"}, "algorithm": "fedavg"}
# What FedRep and FedMosaic need beyond FedAvg's spec (FedMosaic: a public unlabeled set).
ALGORITHM_EXTRAS = {"fedmosaic": {"public": {"size": 1000}}}
EVAL_TARGET = 0.10
PER_CLIENT_GROWTH_LIMIT = 0.5  # model copies per added client
FEW = 2  # clients in the small round the memory check compares against


# ---------------------------------------------------------------------------
# Memory helpers (Linux /proc)


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) if m else None


def _cpu_snapshot() -> tuple[float, int, int] | None:
    """(wall time, busy ticks of the whole machine, CPU ticks of this process) or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        # this process, its reaped children and its live ones (the process executor's workers)
        return time.perf_counter(), user + nice + system + irq + softirq + steal, sum(int(v) for v in own[11:15]) + _children_ticks()
    except (OSError, ValueError, IndexError):
        return None


def _children_ticks() -> int:
    """CPU ticks used so far by this process's live child processes (Linux /proc)."""
    total = 0
    for tasks in Path("/proc/self/task").glob("*/children"):
        for pid in tasks.read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(stat[11]) + int(stat[12])
            except (OSError, ValueError, IndexError):  # exited meanwhile: counted once reaped
                pass
    return total


def _others_cores(before, after) -> float:
    """CPU cores used on average by other processes between two snapshots (0 if unknown)."""
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    ticks = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, ticks / os.sysconf("SC_CLK_TCK") / (after[0] - before[0]))


def _wait_for_quiet(busy_limit: float, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) until other processes use <= busy_limit cores for 1 s.

    Returns the seconds waited.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait:
        before = _cpu_snapshot()
        time.sleep(min(1.0, max_wait))
        if _others_cores(before, _cpu_snapshot()) <= busy_limit:
            break
    return time.perf_counter() - started


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so that RSS is the live set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _tensor_peak(fn) -> tuple[int, int] | None:
    """(peak, net) bytes of CPU tensor memory allocated while ``fn`` runs, or None.

    From the allocation/free events of ``torch.profiler`` (profile_memory=True) summed in
    time order. Frees of blocks allocated before profiling started are not reported by the
    profiler, so the figures can only err upwards. The profiler's own console chatter is
    silenced.
    """
    from torch.profiler import ProfilerActivity, profile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = prof.profiler.kineto_results.events()
        allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except Exception:  # a torch without these internals: report n/a
        return None
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return peak, live


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


def write_npz(path: Path, num_clients: int, test_per_client: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = num_clients * (TRAIN_PER_CLIENT + test_per_client)
    x = rng.integers(0, 256, size=(n, *IMAGE_SHAPE), dtype=np.uint8)
    y = rng.integers(0, NUM_CLASSES, size=n).astype(np.int64)
    np.savez(path, x_train=x, y_train=y, classes=np.array([str(c) for c in range(NUM_CLASSES)]))


def make_spec(npz: Path, num_clients: int, batch_size: int, test_per_client: int, threads: int) -> dict:
    # The IID partition deals out equal shares; stratified_split then takes
    # round(share * test_fraction) test samples, which is exactly test_per_client.
    test_fraction = test_per_client / (TRAIN_PER_CLIENT + test_per_client)
    return {
        "experiment": {"name": "round_overhead", "seed": 0, "rounds": 1},
        "data": {"name": "npz", "params": {"path": str(npz)}},
        "partition": {"scheme": "iid", "num_clients": num_clients, "val_fraction": 0.0,
                      "test_fraction": test_fraction},
        "model": {"name": "lenet5"},
        "algorithm": {"name": RUN["algorithm"]},
        "training": {"local_epochs": 1, "batch_size": batch_size, "lr": LR},
        "tracking": {"enabled": False, "progress": False},
        # threads 0 (the default): one thread per process; the plain loop runs after prepare()
        # in the same process, so it always gets the same number as one worker.
        "executor": {**RUN["executor"], "threads": threads},
        **ALGORITHM_EXTRAS.get(RUN["algorithm"], {}),
    }


def prepare(npz: Path, num_clients: int, batch_size: int, test_per_client: int, threads: int):
    engine = Engine(resolve(make_spec(npz, num_clients, batch_size, test_per_client, threads)), progress=False)
    ctx = engine.prepare()
    sizes = {(c.num_train, len(c.test_y)) for c in ctx.data.clients}
    if sizes != {(TRAIN_PER_CLIENT, test_per_client)}:
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


def bench(npz: Path, num_clients: int, batch_size: int, repeats: int, test_per_client: int, threads: int,
          busy_limit: float, max_attempts: int, max_wait: float) -> dict:
    engine, ctx = prepare(npz, num_clients, batch_size, test_per_client, threads)
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

    def timed(fn) -> tuple[float, float]:
        """(seconds, CPU cores other processes used meanwhile) of one call of ``fn``."""
        gc.collect()
        before = _cpu_snapshot()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        return seconds, _others_cores(before, _cpu_snapshot())

    def one_round():
        nonlocal rnd
        rnd += 1
        engine.run_round(ctx, rnd)

    def one_plain():
        model, opt = fresh_plain()
        plain_epoch(model, opt, x, y, batch_size, generator)

    everyone = list(ctx.training_clients)
    few = everyone[:FEW]

    def with_clients(clients: list[int], fn):
        """Run ``fn`` while only ``clients`` take part (ctx.training_clients)."""
        ctx.training_clients = clients
        try:
            return fn()
        finally:
            ctx.training_clients = everyone

    # warm-up (same shapes and code paths, a fraction of the cost): a round and an
    # evaluation of FEW clients, a plain epoch over FEW clients' worth of samples
    with_clients(few, one_round)
    evaluate_clients(ctx, client_ids=few)
    plain_epoch(*fresh_plain(), x[: FEW * TRAIN_PER_CLIENT], y[: FEW * TRAIN_PER_CLIENT], batch_size, generator)

    # timed repeats: a round and a plain epoch (alternating which goes first) and an
    # evaluation. A repeat during which other processes used more than busy_limit CPU
    # cores is set aside and tried again (after waiting for a quiet second, at most
    # max_wait seconds in all per configuration), up to max_attempts repeats in all; if
    # too few are clean, the least disturbed set-aside ones are used too.
    clean: list[tuple] = []
    noisy: list[tuple] = []
    attempts = 0
    wait_left = max_wait
    while len(clean) < repeats and attempts < max_attempts:
        wait_left -= _wait_for_quiet(busy_limit, max(0.0, wait_left))
        if attempts % 2 == 0:
            rd = timed(one_round)
            pl = timed(one_plain)
        else:
            pl = timed(one_plain)
            rd = timed(one_round)
        ev = timed(lambda: evaluate_clients(ctx))
        attempts += 1
        (clean if max(rd[1], pl[1], ev[1]) <= busy_limit else noisy).append((rd, pl, ev))
    used = clean + sorted(noisy, key=lambda t: max(t[0][1], t[1][1], t[2][1]))[: repeats - len(clean)]
    rounds = [u[0][0] for u in used]
    plains = [u[1][0] for u in used]
    evals = [u[2][0] for u in used]
    busiest = max(max(u[0][1], u[1][1], u[2][1]) for u in used)

    # memory 1 (the target): peak of live tensor bytes allocated during a round of FEW
    # clients and of all N, from the profiler's allocation events (exact, deterministic).
    # A model kept per client (or per upload) would add (N - FEW) model copies to the second.
    def tensor_peak() -> tuple[int, int] | None:
        nonlocal rnd
        rnd += 1
        return _tensor_peak(lambda: engine.run_round(ctx, rnd))

    tpeak_few = with_clients(few, tensor_peak)
    tpeak_all = tensor_peak()

    # memory 2 (for information): peak RSS increase of one round of FEW and of all N clients
    def rss_round() -> tuple[int | None, int | None]:
        nonlocal rnd
        gc.collect()
        _trim()
        before = _status_kb("VmRSS")
        ok = _reset_peak()
        rnd += 1
        engine.run_round(ctx, rnd)
        hwm = _status_kb("VmHWM")
        gc.collect()
        _trim()
        after = _status_kb("VmRSS")
        if before is None or after is None:
            return None, None
        return (hwm - before if ok and hwm is not None else None), after - before

    rss_few, _ = with_clients(few, rss_round)
    rss_all, kept = rss_round()

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
        # judged: the median over repeats of round / plain epoch run back to back, which
        # cancels slow and fast phases of the machine that a best-of-each would not
        "ratio": statistics.median(r / p for r, p in zip(rounds, plains)),
        "ratio_best": min(rounds) / min(plains),
        "rounds": rounds,
        "clean": len(clean),
        "attempts": attempts,
        "busiest": busiest,
        "eval_frac": statistics.median(e / r for e, r in zip(evals, rounds)),
        "tpeak_few": None if tpeak_few is None else tpeak_few[0],
        "tpeak_all": None if tpeak_all is None else tpeak_all[0],
        "rss_few_kb": rss_few,
        "rss_all_kb": rss_all,
        "kept_kb": kept,
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


def _mb(value, scale=1 / 2**20, sign="") -> str:
    return "n/a" if value is None else f"{value * scale:{sign}.2f}"


def report(results: list[dict]) -> bool:
    print()
    print(f"{'N':>4} {'B':>3} {'steps':>5} | {'round s':>7} {'(med)':>7} | {'plain s':>7} {'(med)':>7} | "
          f"{'ratio':>5} {'(bst)':>5} | {'eval s':>6} {'eval/rd':>7} | {'tensor peak MB':>14} | "
          f"{'RSS peak MB':>11} {'kept':>5} | {'N*model':>7} | {'store':>5} {'server':>11} | {'clean':>5}")
    print(f"{'':>4} {'':>3} {'':>5} | {'':>7} {'':>7} | {'':>7} {'':>7} | {'':>5} {'':>5} | {'':>6} {'':>7} | "
          f"{f'{FEW} cl.':>6} {'N cl.':>7} | {f'{FEW} cl.':>5} {'N cl.':>5} {'MB':>5} | {'MB':>7} | "
          f"{'tens.':>5} {'tens. (kB)':>11} | {'':>5}")
    print("-" * 156)
    for r in results:
        print(f"{r['N']:>4} {r['B']:>3} {r['steps']:>5} | {r['round_best']:>7.3f} {r['round_med']:>7.3f} | "
              f"{r['plain_best']:>7.3f} {r['plain_med']:>7.3f} | {r['ratio']:>5.3f} {r['ratio_best']:>5.3f} | "
              f"{r['eval_best']:>6.3f} {r['eval_frac'] * 100:>6.1f}% | "
              f"{_mb(r['tpeak_few']):>6} {_mb(r['tpeak_all']):>7} | "
              f"{_mb(r['rss_few_kb'], 1 / 1024):>5} {_mb(r['rss_all_kb'], 1 / 1024):>5} "
              f"{_mb(r['kept_kb'], 1 / 1024, '+'):>5} | {r['N'] * r['model_bytes'] / 2**20:>7.2f} | "
              f"{r['store_tensors']:>5} {r['server_tensors']:>3} ({r['server_bytes'] / 1024:>4.0f}) | "
              f"{r['clean']:>2}/{r['attempts']:<2}")
    print()
    print("steps: optimizer steps per round (= per plain epoch); times in seconds, best of the repeats, (med): median")
    print("ratio: median over the repeats of round / plain epoch run back to back, (bst): best round / best plain epoch;")
    print("eval/rd: median over the repeats of evaluation / round; eval s: best evaluation")
    print(f"tensor peak: most CPU tensor memory live at once during a round of {FEW} clients / of all N clients beyond "
          "what was live before (torch.profiler allocation events)")
    print(f"RSS peak: VmHWM during a round of {FEW} / N clients minus VmRSS before (heap trimmed first; allocator noise "
          "of several MB, information only); kept: VmRSS after the N-client round minus before")
    print("N*model: N copies of the model's state; store / server: tensors held in ctx.store (all clients) / "
          "ctx.server after the rounds")
    print("clean: timed repeats during which other processes used <= --busy-limit CPU cores / repeats tried")

    all_ok = True
    print()
    print("Targets")
    for r in results:
        tag = f"N={r['N']:<3} B={r['B']:<3}"
        if r["clean"] < len(r["rounds"]):
            print(f"  {tag} (timings disturbed: only {r['clean']} of {r['attempts']} repeats ran with other processes "
                  f"below the busy limit; up to {r['busiest']:.2f} CPU cores were in use elsewhere)")
        target = RATIO_TARGET if RUN["executor"]["name"] == "sequential" else POOL_RATIO_TARGET
        ok1 = r["ratio"] <= target
        ok2 = r["eval_frac"] <= EVAL_TARGET
        print(f"  {tag} round / plain epoch        {r['ratio']:6.3f}  <= {target:.2f}   {verdict(ok1)}")
        print(f"  {tag} evaluation / round        {r['eval_frac'] * 100:5.1f}%  <= {EVAL_TARGET * 100:.0f}%    {verdict(ok2)}")
        all_ok &= ok1 and ok2
    for r in results if RUN["algorithm"] == "fedavg" else []:  # the memory targets are FedAvg's
        tag = f"N={r['N']:<3} B={r['B']:<3}"
        model = r["model_bytes"]
        ok = r["store_tensors"] == 0 and r["server_bytes"] <= model
        print(f"  {tag} held after a round: {r['store_tensors']} tensors in ctx.store, "
              f"{r['server_bytes'] / model:.2f} model in ctx.server (<= 1)   {verdict(ok)}")
        all_ok &= ok
        if r["tpeak_all"] is None or r["tpeak_few"] is None:
            print(f"  {tag} tensor peak: not measurable with this torch   n/a")
            continue
        per_client = (r["tpeak_all"] - r["tpeak_few"]) / (r["N"] - FEW) / model
        ok = per_client < PER_CLIENT_GROWTH_LIMIT
        print(f"  {tag} tensor peak of a round {FEW} -> {r['N']} clients: {_mb(r['tpeak_few'])} -> "
              f"{_mb(r['tpeak_all'])} MB = {per_client:+.3f} model per added client (< {PER_CLIENT_GROWTH_LIMIT})"
              f"   {verdict(ok)}")
        all_ok &= ok
    ns = sorted({r["N"] for r in results})
    if len(ns) > 1:
        for b in sorted({r["B"] for r in results}):
            rows = {r["N"]: r for r in results if r["B"] == b and r["tpeak_all"] is not None}
            lo, hi = rows.get(ns[0]), rows.get(ns[-1])
            if lo and hi:
                per_client = (hi["tpeak_all"] - lo["tpeak_all"]) / (hi["N"] - lo["N"]) / lo["model_bytes"]
                ok = per_client < PER_CLIENT_GROWTH_LIMIT
                print(f"  B={b:<3}       tensor peak of a round N={lo['N']} -> N={hi['N']}: {_mb(lo['tpeak_all'])} -> "
                      f"{_mb(hi['tpeak_all'])} MB = {per_client:+.3f} model per added client "
                      f"(< {PER_CLIENT_GROWTH_LIMIT})   {verdict(ok)}")
                all_ok &= ok
    return all_ok


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 100], help="numbers of clients (N)")
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 50], help="batch sizes (B)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after warm-up (default 3; medians of the ratios are judged)")
    parser.add_argument("--test-per-client", type=int, default=TEST_PER_CLIENT,
                        help=f"test samples per client (default {TEST_PER_CLIENT}, 20%% of the 500 train)")
    parser.add_argument("--threads", type=int, default=0,
                        help="executor.threads for the run (and so the plain loop); 0: torch's default")
    parser.add_argument("--executor", default="sequential", choices=["sequential", "process"],
                        help="executor.name for the run (default sequential; process: target 0.6)")
    parser.add_argument("--workers", type=int, default=None, help="executor.workers (default: one per core)")
    parser.add_argument("--algorithm", default="fedavg", choices=["fedavg", "fedrep", "fedmosaic"],
                        help="the method timed (default fedavg; the memory checks are FedAvg's)")
    parser.add_argument("--busy-limit", type=float, default=0.1,
                        help="a repeat during which other processes used more CPU cores than this is retried")
    parser.add_argument("--max-attempts", type=int, default=None,
                        help="repeats tried at most per configuration (default 3 x --repeats; --quick: --repeats)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds per configuration to wait in all for other processes to quieten "
                             "(default 120; --quick: 0)")
    parser.add_argument("--quick", action="store_true",
                        help="N=20, B=50 only, no waiting or retrying on a busy machine (a quick check)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.batch = [20], [50]
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if min(args.clients) <= FEW or min(args.batch) < 1:
        parser.error(f"--clients must be > {FEW} (the memory check compares with a round of {FEW}) "
                     "and --batch >= 1")
    if args.test_per_client < 1 or args.threads < 0:
        parser.error("--test-per-client must be >= 1 and --threads >= 0")
    if args.max_attempts is None:
        args.max_attempts = args.repeats if args.quick else 3 * args.repeats
    args.max_attempts = max(args.max_attempts, args.repeats)
    if args.max_wait is None:
        args.max_wait = 0.0 if args.quick else 120.0

    RUN["executor"] = {"name": args.executor, **({"workers": args.workers} if args.workers else {})}
    RUN["algorithm"] = args.algorithm
    started = time.perf_counter()
    print(f"pfl round overhead: python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {args.threads or 1} "
          f"(interop {torch.get_num_interop_threads()}), {platform.machine()}, load average {_loadavg()}")
    print(f"LeNet-5, {IMAGE_SHAPE[2]}x{IMAGE_SHAPE[0]}x{IMAGE_SHAPE[1]} inputs, {NUM_CLASSES} classes; per client "
          f"{TRAIN_PER_CLIENT} train / {args.test_per_client} test samples (IID, random uint8 images and labels); "
          f"{args.algorithm}, executor {RUN['executor']}, 1 local epoch, SGD lr {LR}; medians of {args.repeats} clean interleaved repeats after a warm-up")
    results = []
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        for n in args.clients:
            npz = Path(tmp) / f"random_{n}.npz"
            write_npz(npz, n, args.test_per_client, seed=n)
            for b in args.batch:
                t0 = time.perf_counter()
                r = bench(npz, n, b, args.repeats, args.test_per_client, args.threads, args.busy_limit,
                          args.max_attempts, args.max_wait)
                print(f"  N={n:<3} B={b:<3} done in {time.perf_counter() - t0:.0f}s: best round {r['round_best']:.3f}s, "
                      f"plain {r['plain_best']:.3f}s; ratio {r['ratio']:.3f}, eval {r['eval_frac'] * 100:.1f}%; "
                      f"{r['clean']} of {r['attempts']} repeats clean (load average {_loadavg()})", flush=True)
                results.append(r)
            npz.unlink()
    ok = report(results)
    print()
    print(f"overall: {verdict(ok)}   (total {time.perf_counter() - started:.0f}s, load average {_loadavg()})")
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
