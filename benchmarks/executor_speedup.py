#!/usr/bin/env python
"""The process pool against the one-process loop and a plain loop of the same work (a script, not a test).

``benchmarks/round_overhead.py`` compares a FedAvg round with a plain centralised epoch over
the same samples. FedRep's and FedMosaic's rounds are not one plain epoch of work, so this
script writes out, for each, a plain single-process PyTorch loop doing the same arithmetic
on the pooled 50,000 training samples with one model (no clients, no messages, no state):

- FedRep (1 head + 1 body epoch a round): one epoch with the body frozen and an optimiser
  over the head, then one epoch with the head frozen and an optimiser over the body.
- FedMosaic (a round after the first: consensus labels exist): in blocks of one client's
  500 samples, each SGD step takes a private batch and its share of the public set U (U once
  per epoch, split over the epoch's steps as the plugin splits it), loss l_priv + lambda *
  l_pseudo with lambda from the two detached losses (Alg. 1 lines 3-7); after each block
  the prediction pass over U, labels and "W" expertise (lines 9-11).

It runs the same rounds (round_overhead's set-up: LeNet-5, 100 clients x 500 random
32x32x3 images, 100 test images each, 1 local epoch) with ``executor.name = "sequential"``
and ``"process"`` (one worker per core), in one process, and the plain loop, in paired
repeats (order rotating) after a warm-up round. It prints the medians of process round /
plain loop (the target: <= 0.6), process / sequential, and sequential / plain, the
evaluation's share of the process round (target <= 10%), and checks both runs reach the
same accuracy.

    OMP_NUM_THREADS=1 python benchmarks/executor_speedup.py --algorithm fedrep fedmosaic --batch 10 50
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
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pfl_core.methods.codistill import predict_logits  # noqa: E402
from pfl_core.runtime.evaluation import evaluate_clients  # noqa: E402
from pfl_plugins.fedmosaic import adaptive_lambda, expertise_scores  # noqa: E402

# FedRep at one epoch of local work per round like the others: 1 head epoch is too little to
# compare, so 1 head + 1 body epoch (its paper's default is 10 + 1; the ratio does not depend on it).
PARAMS = {"fedrep": {"head_epochs": 1, "body_epochs": 1}}


def sgd(ctx, params):
    training = ctx.spec.training
    return torch.optim.SGD(params, lr=training.lr, momentum=training.momentum, weight_decay=training.weight_decay)


def plain_fedrep(engine, ctx, x, y, batch: int, generator) -> None:
    """An epoch of the head with the body frozen, then an epoch of the body with the head frozen."""
    model = ctx.models.build(ctx.models.arch_of(0))
    head_keys = set(engine.resolved.algorithm.head_keys(ctx))
    parts = {"head": [p for k, p in model.named_parameters() if k in head_keys],
             "body": [p for k, p in model.named_parameters() if k not in head_keys]}
    for part, frozen in (("head", "body"), ("body", "head")):
        for p in parts[frozen]:
            p.requires_grad_(False)
        ro.plain_epoch(model, sgd(ctx, parts[part]), x, y, batch, generator)
        for p in parts[frozen]:
            p.requires_grad_(True)


def plain_fedmosaic(engine, ctx, x, y, batch: int, generator) -> None:
    """Per block of one client's samples: co-training steps on private + public batches, then
    the prediction pass over U with labels and expertise."""
    public_x = ctx.data.public.x
    pseudo_y = ctx.server["consensus"].long()
    model = ctx.models.build(ctx.models.arch_of(0))
    optimizer = sgd(ctx, model.parameters())
    eval_batch, num_classes = ctx.spec.evaluation.batch_size, ctx.num_classes
    order = torch.randperm(len(y), generator=generator)
    steps = -(-ro.TRAIN_PER_CLIENT // batch)
    for block in range(0, len(y), ro.TRAIN_PER_CLIENT):
        model.train()
        public_parts = torch.tensor_split(torch.randperm(len(public_x), generator=generator), steps)
        for step, pidx in enumerate(public_parts):
            idx = order[block + step * batch : min(block + (step + 1) * batch, block + ro.TRAIN_PER_CLIENT)]
            optimizer.zero_grad(set_to_none=True)
            l_priv = F.cross_entropy(model(x[idx]), y[idx])
            l_pseudo = F.cross_entropy(model(public_x[pidx]), pseudo_y[pidx])
            loss = l_priv + adaptive_lambda(l_priv.detach(), l_pseudo.detach()) * l_pseudo
            loss.backward()
            optimizer.step()
        logits = predict_logits(model, public_x, eval_batch)
        logits.argmax(dim=1)
        expertise_scores("W", logits, torch.bincount(y[order[block : block + ro.TRAIN_PER_CLIENT]],
                                                     minlength=num_classes), 1e-6)


PLAIN = {"fedrep": plain_fedrep, "fedmosaic": plain_fedmosaic}


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
    parser.add_argument("--algorithm", nargs="+", default=["fedrep", "fedmosaic"], choices=sorted(PLAIN))
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"process pool vs sequential loop vs a plain loop of the same work; LeNet-5, 100 clients x 500 samples; "
          f"load average {ro._loadavg()}")
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        npz = Path(tmp) / "random.npz"
        ro.write_npz(npz, 100, ro.TEST_PER_CLIENT, seed=100)
        for algorithm in args.algorithm:
            for batch in args.batch:
                runs = {name: prepared(npz, algorithm, batch, name) for name in ("sequential", "process")}
                for engine, ctx in runs.values():  # warm-up round (round 1: FedMosaic's has no consensus yet)
                    engine.run_round(ctx, 1)
                plain = PLAIN[algorithm]
                generator = torch.Generator().manual_seed(0)
                engine, ctx = runs["sequential"]
                x, y = ctx.data.pooled_train()  # the plain loop's data, as round_overhead's
                plain(engine, ctx, x[:1000], y[:1000], batch, generator)  # warm-up
                names = ("sequential", "process", "plain")
                seconds = {name: [] for name in names}
                ratios = {"process/plain": [], "process/sequential": [], "sequential/plain": []}
                eval_shares = []
                for repeat in range(args.repeats):
                    took = {}
                    for name in names[repeat % 3:] + names[: repeat % 3]:  # the order rotates
                        engine, ctx = runs["sequential" if name == "plain" else name]
                        if name == "plain":
                            took[name] = timed(lambda: plain(engine, ctx, x, y, batch, generator))
                        else:
                            took[name] = timed(lambda: engine.run_round(ctx, repeat + 2))
                        seconds[name].append(took[name])
                    for ratio in ratios:
                        over, under = ratio.split("/")
                        ratios[ratio].append(took[over] / took[under])
                    engine, ctx = runs["process"]
                    eval_shares.append(timed(lambda: evaluate_clients(ctx)) / took["process"])
                accuracy = {name: evaluate_clients(ctx)[0]["acc_mean"] for name, (_, ctx) in runs.items()}
                for engine, ctx in runs.values():
                    ctx.executor.close()
                judged = statistics.median(ratios["process/plain"])
                share = statistics.median(eval_shares)
                print(f"  {algorithm:<9} B={batch:<3} round s (median): sequential "
                      f"{statistics.median(seconds['sequential']):6.2f}, process {statistics.median(seconds['process']):6.2f}, "
                      f"plain loop {statistics.median(seconds['plain']):6.2f}; "
                      + ", ".join(f"{name} {statistics.median(values):.3f}" for name, values in ratios.items())
                      + f"; evaluation/round {100 * share:4.1f}%; same acc_mean: "
                      f"{accuracy['sequential'] == accuracy['process']} (load average {ro._loadavg()})", flush=True)
                print(f"    process round / plain loop {judged:.3f} <= {ro.POOL_RATIO_TARGET:.2f} "
                      f"{ro.verdict(judged <= ro.POOL_RATIO_TARGET)}; evaluation / round {100 * share:.1f}% <= "
                      f"{100 * ro.EVAL_TARGET:.0f}% {ro.verdict(share <= ro.EVAL_TARGET)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
