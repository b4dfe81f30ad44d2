"""Test-only driver: ``pfl-run`` with a fault injected at a chosen point (tests/test_checkpoint.py).

    python tests/killpoints.py POINT [POINT ...] -- PFL-RUN ARGS ...

Each POINT patches the code of this process only (nothing in pfl_core knows about it), then
``pfl_core.cli.run_main`` runs as ``pfl-run`` would:

- ``round:R``     SIGKILL as round R starts (between rounds: round R-1 is logged)
- ``train:R:B``   SIGKILL at the B-th mini-batch of local training in round R (mid-round)
- ``eval:R``      SIGKILL as round R's evaluation starts (the round trained, nothing logged)
- ``sigterm:R``   SIGTERM to itself as round R starts (the clean-interrupt path)
- ``ckpt-before:R``  SIGKILL as the checkpoint of round R starts to be written
- ``ckpt-during:R``  SIGKILL while it is written (its client states are on disk, its run file not)
- ``ckpt-after:R``   SIGKILL right after it is complete (its folder renamed; nothing after that)
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
    elif kind in ("ckpt-before", "ckpt-during", "ckpt-after"):
        from pfl_core.state import checkpoint

        write, prune, save_clients = checkpoint.Checkpointer.write, checkpoint.Checkpointer.prune, checkpoint.save_clients

        def patched_write(self, ctx, round, *args, **kwargs):
            if kind == "ckpt-before" and round == numbers[0]:
                _kill()
            return write(self, ctx, round, *args, **kwargs)

        def patched_prune(self):  # the first step after the checkpoint's folder got its name
            if kind == "ckpt-after" and self.written_round == numbers[0]:
                _kill()
            return prune(self)

        def patched_save_clients(store, folder):
            save_clients(store, folder)
            if kind == "ckpt-during" and folder.name.startswith(f".round-{numbers[0]:06d}.tmp-"):
                _kill()

        checkpoint.Checkpointer.write = patched_write
        checkpoint.Checkpointer.prune = patched_prune
        checkpoint.save_clients = patched_save_clients
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
