"""Test-only driver: ``pfl-run`` with a fault injected at a chosen point (tests/test_checkpoint.py).

    python tests/killpoints.py POINT [POINT ...] -- PFL-RUN ARGS ...

Each POINT patches the code of this process only (nothing in pfl_core knows about it), then
``pfl_core.cli.run_main`` runs as ``pfl-run`` would:

- ``round:R``     SIGKILL as round R starts (between rounds: round R-1 is logged)
- ``train:R:B``   SIGKILL at the B-th mini-batch of local training in round R (mid-round)
- ``eval:R``      SIGKILL as round R's evaluation starts (the round trained, nothing logged)
- ``sigterm:R``   SIGTERM to itself as round R starts (the clean-interrupt path)
- ``coldstart-fails``  the cold-start evaluation raises
- ``no-rounds``   running any round is an error (a resume must run only the end)
"""

from __future__ import annotations

import os
import signal
import sys


def _kill(sig=signal.SIGKILL) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


def arm(point: str) -> None:
    from pfl_core.engine import engine
    from pfl_core.runtime import context
    kind, *where = point.split(":")
    numbers = [int(w) for w in where]
    if kind in ("round", "sigterm", "no-rounds"):
        run_round = engine.Engine.run_round

        def patched_round(self, ctx, round, *args, **kwargs):
            if kind == "no-rounds":
                raise AssertionError(f"round {round} ran, but the resume should only run the end")
            if round == numbers[0]:
                _kill(signal.SIGKILL if kind == "round" else signal.SIGTERM)
            return run_round(self, ctx, round, *args, **kwargs)

        engine.Engine.run_round = patched_round
    elif kind == "train":
        # every training loop asks take_batch before each mini-batch step (without it, an older
        # core: count_work, told after each epoch)
        name = "take_batch" if hasattr(context.Client, "take_batch") else "count_work"
        original = getattr(context.Client, name)
        taken = [0]

        def patched(self, *args, **kwargs):
            if self.round == numbers[0]:
                taken[0] += 1
                if taken[0] == numbers[1]:
                    _kill()
            return original(self, *args, **kwargs)

        setattr(context.Client, name, patched)
    elif kind == "eval":
        evaluate = engine.evaluate_clients

        def patched_evaluate(ctx, *args, **kwargs):
            if ctx.round == numbers[0] and not kwargs.get("prefix"):
                _kill()
            return evaluate(ctx, *args, **kwargs)

        engine.evaluate_clients = patched_evaluate
    elif kind == "coldstart-fails":
        def failing(self, ctx):
            raise RuntimeError("injected cold-start failure")

        engine.Engine._evaluate_coldstart = failing
    else:
        raise SystemExit(f"killpoints: unknown point {point!r}")


def main(argv: list[str]) -> int:
    split = argv.index("--")
    for point in argv[:split]:
        arm(point)
    from pfl_core.cli import run_main

    return run_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
