#!/usr/bin/env python
"""2x2 max pooling without autograd: torch's kernel against the zoo's exact path (a script, not a test).

Prints the median time of ``F.max_pool2d(x, 2)`` and of ``pfl_core.models.zoo._max_pool2(x)``
under ``torch.no_grad()`` on LeNet-5's two pooling inputs for a batch, then the time of scoring
LeNet-5 on ``--images`` 32x32x3 images in batches of ``--batch`` (what an evaluation of 100
clients x 100 test images does) with each of them, one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/max_pool.py
    OMP_NUM_THREADS=1 python benchmarks/max_pool.py --batch 50 --repeats 50

See docs/benchmarks.md (Evaluation's pooling).
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from unittest import mock

import torch
import torch.nn.functional as F

from pfl_core import registry
from pfl_core.models import zoo
from pfl_core.runtime.evaluation import score


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return 1e3 * statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--batch", type=int, default=100, help="images per batch (default 100)")
    parser.add_argument("--images", type=int, default=10_000, help="images scored (default 10,000)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats, median printed (default 20)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    print(f"torch {torch.__version__}, 1 thread, batch {args.batch}; median of {args.repeats} (ms)")
    print(f"{'input':<20} {'F.max_pool2d':>13} {'_max_pool2':>11} {'ratio':>7}")
    with torch.no_grad():
        for shape in [(args.batch, 6, 28, 28), (args.batch, 16, 10, 10)]:
            x = torch.relu(torch.randn(shape))
            torch_ms = median_ms(lambda: F.max_pool2d(x, 2), args.repeats)
            ours_ms = median_ms(lambda: zoo._max_pool2(x), args.repeats)
            print(f"{str(shape):<20} {torch_ms:>13.3f} {ours_ms:>11.3f} {torch_ms / ours_ms:>6.1f}x")

    model = registry.instantiate(registry.MODEL, "lenet5", {}, "model.name", "model.params").build((3, 32, 32), 10)
    x = torch.randint(0, 256, (args.images, 3, 32, 32)).float() / 255
    y = torch.randint(0, 10, (args.images,))
    repeats = max(3, args.repeats // 4)
    ours_ms = median_ms(lambda: score(model, x, y, args.batch), repeats)
    with mock.patch.object(zoo, "_max_pool2", lambda t: F.max_pool2d(t, 2)):
        torch_ms = median_ms(lambda: score(model, x, y, args.batch), repeats)
    print(f"score(LeNet-5, {args.images} images): {torch_ms:.0f} ms with F.max_pool2d, "
          f"{ours_ms:.0f} ms with _max_pool2 ({torch_ms / ours_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
