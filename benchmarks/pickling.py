#!/usr/bin/env python
"""How long the process executor's items and results take to pickle (a script, not a test).

A LeNet-5 message as a round sends it (the global model's state, 62,006 parameters in 10
tensors) and the same with ``--public`` uint8 labels (a label-only upload), pickled and
unpickled with the plain pickler (torch's own tensor reduction) and with the executor's
``_pickled`` (tensors as raw bytes). Medians of ``--repeats`` in milliseconds, one thread.

    OMP_NUM_THREADS=1 python benchmarks/pickling.py

See docs/benchmarks.md (Every core).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch

from pfl_core import registry
from pfl_core.executors import _pickled


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--public", type=int, default=1000, help="labels in the label-only message (default 1,000)")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
