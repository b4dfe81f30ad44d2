#!/usr/bin/env python
"""The process pool against the one-process loop on the same rounds (a script, not a test).

``benchmarks/round_overhead.py`` compares a FedAvg round with a plain centralised epoch over
the same samples. For methods whose round is not one plain epoch of work (FedRep's head and
body phases, FedMosaic's public-set passes and prediction uploads) there is no plain loop that
does the same work, so this script compares the same round under the two executors instead:
the same spec, data and seed (round_overhead's set-up: LeNet-5, 100 clients x 500 random
32x32x3 images, 100 test images each, 1 local epoch), run once with ``executor.name =
"sequential"`` and once with ``"process"`` (one worker per core), in one process, in paired
repeats after a warm-up round. It prints the median of (process round / sequential round),
the evaluation's share of the process round, and checks both runs reach the same accuracy.
With FedAvg's sequential round at 1.03-1.05 of a plain epoch (docs/benchmarks.md), a pool
ratio <= 0.57 puts a round under 0.6 of the plain epoch of the same work.

    python benchmarks/executor_speedup.py --algorithm fedrep fedmosaic --batch 10 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_overhead as ro  # noqa: E402  (the same data and spec)

from pfl_core.evaluation import evaluate_clients  # noqa: E402

# FedRep at one epoch of local work per round like the others: 1 head epoch is too little to
# compare, so 1 head + 1 body epoch (its paper's default is 10 + 1; the ratio does not depend on it).
PARAMS = {"fedrep": {"head_epochs": 1, "body_epochs": 1}}


def prepared(npz, algorithm: str, batch: int, executor: str):
    ro.RUN["algorithm"] = algorithm
    ro.RUN["executor"] = {"name": executor}
    spec = ro.make_spec(npz, 100, batch, ro.TEST_PER_CLIENT, 0)
    spec["algorithm"]["params"] = PARAMS.get(algorithm, {})
    from pfl_core.engine import Engine, resolve

    engine = Engine(resolve(spec), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", nargs="+", default=["fedrep", "fedmosaic"])
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"process pool vs sequential loop, same rounds; LeNet-5, 100 clients x 500 samples; "
          f"load average {ro._loadavg()}")
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        npz = Path(tmp) / "random.npz"
        ro.write_npz(npz, 100, ro.TEST_PER_CLIENT, seed=100)
        for algorithm in args.algorithm:
            for batch in args.batch:
                runs = {name: prepared(npz, algorithm, batch, name) for name in ("sequential", "process")}
                for engine, ctx in runs.values():  # warm-up round (round 1: FedMosaic's has no consensus yet)
                    engine.run_round(ctx, 1)
                ratios, eval_shares, seconds = [], [], {"sequential": [], "process": []}
                for repeat in range(args.repeats):
                    order = ("sequential", "process") if repeat % 2 == 0 else ("process", "sequential")
                    took = {}
                    for name in order:
                        engine, ctx = runs[name]
                        took[name] = timed(lambda: engine.run_round(ctx, repeat + 2))
                        seconds[name].append(took[name])
                    ratios.append(took["process"] / took["sequential"])
                    engine, ctx = runs["process"]
                    eval_shares.append(timed(lambda: evaluate_clients(ctx)) / took["process"])
                accuracy = {name: evaluate_clients(ctx)[0]["acc_mean"] for name, (_, ctx) in runs.items()}
                for engine, ctx in runs.values():
                    ctx.executor.close()
                print(f"  {algorithm:<9} B={batch:<3} sequential round {statistics.median(seconds['sequential']):6.2f}s  "
                      f"process round {statistics.median(seconds['process']):6.2f}s  "
                      f"process/sequential {statistics.median(ratios):.3f}  "
                      f"evaluation/round {100 * statistics.median(eval_shares):4.1f}%  "
                      f"same acc_mean: {accuracy['sequential'] == accuracy['process']}  "
                      f"(load average {ro._loadavg()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
