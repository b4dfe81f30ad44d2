#!/usr/bin/env python
"""How long the process executor's items and results take to pickle (a script, not a test).

A LeNet-5 message as a round sends it (the global model's state, 62,006 parameters in 10
tensors) and the same with ``--public`` uint8 labels (a label-only upload), pickled and
unpickled with the plain pickler (torch's own tensor reduction) and with the executor's
``_pickled`` (tensors as raw bytes). Medians of ``--repeats`` in milliseconds, one thread.

With ``--rounds N``, also the whole effect: two runs of round_overhead's FedAvg set-up (LeNet-5,
100 clients x 500 samples, batch ``--batch``) under the ``process`` executor, one with each
pickler (its workers forked with it), N rounds each after a warm-up, alternating which goes
first; it prints each pair (with the parent's CPU seconds in the round and the workers' CPU
seconds per client) and the median of (raw bytes round / plain-pickle round).

    OMP_NUM_THREADS=1 python benchmarks/pickling.py
    OMP_NUM_THREADS=1 python benchmarks/pickling.py --rounds 6 --batch 50

See docs/benchmarks.md (Every core).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from unittest import mock

import torch

from pfl_core import registry
from pfl_core.execution import executors
from pfl_core.execution.process import _pickled


def plain_pickled(item) -> bytes:
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def rounds_with_each_pickler(rounds: int, batch: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import round_overhead as ro

    ro.RUN["executor"] = {"name": "process"}
    picklers = {"plain pickle": plain_pickled, "raw bytes": _pickled}
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        npz = Path(tmp) / "random.npz"
        ro.write_npz(npz, 100, ro.TEST_PER_CLIENT, seed=0)
        runs = {}
        for name, pickler in picklers.items():
            engine, ctx = ro.prepare(npz, 100, batch, ro.TEST_PER_CLIENT, 0)
            with mock.patch.object(executors, "_pickled", pickler):  # the pool forks with it
                engine.run_round(ctx, 1)
            runs[name] = engine, ctx
        seconds = {name: [] for name in picklers}
        for r in range(rounds):
            line = []
            for name in (list(picklers) if r % 2 == 0 else list(picklers)[::-1]):
                engine, ctx = runs[name]
                with mock.patch.object(executors, "_pickled", picklers[name]):
                    started, parent_cpu = time.perf_counter(), time.process_time()
                    engine.run_round(ctx, r + 2)
                    seconds[name].append(time.perf_counter() - started)
                    parent_cpu = time.process_time() - parent_cpu
                # the workers' CPU seconds per client, as the executor measured them for its chunk sizes
                (worker_cpu,) = ctx.executor._item_seconds.values()
                line.append(f"{name} {seconds[name][-1]:.2f}s (parent CPU {parent_cpu:.2f}s, "
                            f"workers' CPU {worker_cpu:.3f}s per client)")
            print(f"  round {r + 2}: " + ", ".join(line), flush=True)
        for _engine, ctx in runs.values():
            ctx.executor.close()
    ratio = statistics.median(new / old for new, old in zip(seconds["raw bytes"], seconds["plain pickle"]))
    print(f"FedAvg round, 100 clients, B={batch}, process executor: raw bytes / plain pickle, median {ratio:.3f}")


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return 1e3 * statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--public", type=int, default=1000, help="labels in the label-only message (default 1,000)")
    parser.add_argument("--rounds", type=int, default=0, help="also time this many FedAvg rounds with each pickler")
    parser.add_argument("--batch", type=int, default=50, help="the rounds' batch size (default 50)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = registry.instantiate(registry.MODEL, "lenet5", {}, "model.name", "model.params").build((3, 32, 32), 10)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    messages = {"LeNet-5 state": {"weights": state},
                f"{args.public} uint8 labels": {"labels": torch.randint(0, 10, (args.public,), dtype=torch.uint8)}}
    print(f"torch {torch.__version__}, 1 thread; median of {args.repeats} (ms)")
    print(f"{'message':<20} {'plain dumps':>11} {'_pickled':>9} {'plain loads':>11} {'loads of _pickled':>17} {'bytes plain / ours':>19}")
    for name, message in messages.items():
        plain, ours = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), _pickled(message)
        print(f"{name:<20} "
              f"{median_ms(lambda: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), args.repeats):>11.3f} "
              f"{median_ms(lambda: _pickled(message), args.repeats):>9.3f} "
              f"{median_ms(lambda: pickle.loads(plain), args.repeats):>11.3f} "
              f"{median_ms(lambda: pickle.loads(ours), args.repeats):>17.3f} "
              f"{len(plain):>10} / {len(ours)}")
    if args.rounds:
        rounds_with_each_pickler(args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
