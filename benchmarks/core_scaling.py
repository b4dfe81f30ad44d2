#!/usr/bin/env python
"""What two cores give two independent training loops on this machine (a script, not a test).

The floor under the ``process`` executor's round / plain-epoch ratio is not 0.5 when two
processes on two cores slow each other down (shared caches, memory bandwidth, a busy
hypervisor). This measures it without pfl's engine: a plain LeNet-5 epoch over ``--samples``
random 32x32x3 images (round_overhead's plain loop, one torch thread) in one process alone,
then in two processes at once, alternating, ``--repeats`` times per batch size. It prints
(each of the two at once) / (alone), per repeat and the median: 1.0 means two cores do twice
the work; the pool's round cannot beat 0.5 times that.

    OMP_NUM_THREADS=1 python benchmarks/core_scaling.py --batch 10 50 --repeats 3

See docs/benchmarks.md (Every core).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_epoch(batch: int, samples: int) -> float:
    """Seconds of one plain epoch in this process, after a short warm-up."""
    import torch

    sys.path.insert(0, str(HERE))
    import round_overhead as ro

    from pfl_core import registry
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    model = registry.instantiate(registry.MODEL, "lenet5", {}, "model.name", "model.params").build((3, 32, 32), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=ro.LR)
    x = torch.randint(0, 256, (samples, 3, 32, 32), dtype=torch.uint8).float() / 255
    y = torch.randint(0, 10, (samples,))
    generator = torch.Generator().manual_seed(0)
    ro.plain_epoch(model, optimizer, x[:1000], y[:1000], batch, generator)
    started = time.perf_counter()
    ro.plain_epoch(model, optimizer, x, y, batch, generator)
    return time.perf_counter() - started


def epochs_at_once(copies: int, batch: int, samples: int) -> list[float]:
    command = [sys.executable, __file__, "--child", str(batch), str(samples)]
    children = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    return [float(child.communicate()[0]) for child in children]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--samples", type=int, default=25_000, help="images per epoch (default 25,000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(one_epoch(*args.child))
        return 0
    with open("/proc/loadavg") as f:
        print(f"plain LeNet-5 epochs of {args.samples} images, 1 thread each; load average {' '.join(f.read().split()[:3])}")
    for batch in args.batch:
        ratios = []
        for repeat in range(args.repeats):
            (alone,) = epochs_at_once(1, batch, args.samples)
            pair = epochs_at_once(2, batch, args.samples)
            ratios += [seconds / alone for seconds in pair]
            print(f"  B={batch:<3} repeat {repeat + 1}: alone {alone:.2f}s, two at once "
                  f"{pair[0]:.2f}s and {pair[1]:.2f}s", flush=True)
        print(f"  B={batch:<3} two at once / alone: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}); floor of the pool's round / plain: "
              f"{0.5 * statistics.median(ratios):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
