"""Reliability figures of the pfl checkout whose Python runs this script (the interpreter's installed
``pfl_core``), on a tiny synthetic spec, in three parts:

fuzz         every int/float key of the spec schema x the fuzzer's value classes (huge, tiny,
             negative, zero, nan, inf, a string, a newline), through ``run_main`` in-process: a
             one-round run and a ``--dry-run``; each ends as "ok", "user error" (exit 2, one line),
             "internal error", "multi-line error", "other" or "uncaught" (run_main raised).
kill         SIGKILL as round R starts, before / during / after the checkpoint of round C, and
             SIGTERM as round 3 starts, in a 4-round tracked run with a checkpoint every round; each
             resumed once by MLflow run id and once (a fresh kill) by checkpoint folder: the resume's
             exit code, whether the run ends FINISHED, and whether its metric histories equal those
             of an uninterrupted run value for value (timing metrics, which differ between two
             uninterrupted runs, are left out and named).
concurrency  N ``pfl-run`` started at once on one new SQLite store (T times), and K runs sent SIGINT
             0.5..4.0 s after start (--signal-window), each followed by one more run on that store;
             whether the store file existed when the signal was sent is recorded (on a slow machine
             the store appears only 4-7 s after start: widen the window to hit its creation).

Commands (run one after the other; the machine is small):
    /tmp/baseline/.venv/bin/python benchmarks/reliability.py --part all --json /tmp/rel_before.json
    /work/main/.venv/bin/python benchmarks/reliability.py --part all --json /tmp/rel_after.json
    PYTHON benchmarks/reliability.py --part concurrency --trials 0 --signal-window 3.0,7.0
The tree measured may be edited meanwhile: the figures name a hash of its source at the start and
the end. To measure one commit of an editable install, put an exported copy first on PYTHONPATH
(with ``pfl_plugins`` linked to its ``plugins``); the children inherit it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared: one thread, here and in children
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

BASE_SPEC = """[experiment]
name = "tiny"
seed = 0
rounds = {rounds}
[data]
name = "synthetic"
[data.params]
num_devices = 4
samples_per_device = 120
dim = 20
[partition]
scheme = "domain"
num_clients = 4
[model]
name = "mlp"
[model.params]
hidden = [16]
[algorithm]
name = "fedavg"
[training]
local_epochs = 1
batch_size = 10
lr = 0.1
[tracking]
enabled = {tracking}
progress = false
"""

# The numeric keys of pfl_core.spec.Spec as tests/test_numeric_keys.py's numeric_keys() lists them
# in the new tree (the old tree's schema has the same ones): hard-coded so both trees get the same cases.
NUMERIC_KEYS = [
    "data.subsample", "partition.num_clients", "partition.min_samples", "partition.val_fraction",
    "partition.test_fraction", "experiment.seed", "experiment.seeds", "experiment.rounds",
    "experiment.participation", "experiment.coldstart_clients", "experiment.coldstart_epochs", "public.size",
    "public.fraction", "public.alpha", "training.local_epochs", "training.batch_size", "training.lr",
    "training.momentum", "training.weight_decay", "evaluation.every", "evaluation.batch_size", "executor.threads",
    "executor.workers", "executor.retries", "checkpoint.every", "checkpoint.keep", "state.cache_clients",
]
LIST_KEYS = {"experiment.seeds"}  # a list of ints: the value goes inside [ ]
# A valid huge value of these is a run that never ends: only --dry-run is tried.
DRY_RUN_ONLY = {"experiment.rounds", "training.local_epochs", "experiment.coldstart_epochs"}
VALUES = {  # as TOML text, the form --set parses; "newline" is a TOML string holding a newline
    "huge": "1e39", "huger": "1e308", "huge int": str(2**62), "tiny": "1e-320", "negative": "-1", "zero": "0",
    "nan": "nan", "inf": "inf", "-inf": "-inf", "string": '"x"', "newline": '"a\\nb"',
}
FINE = ("ok", "user error")


def write_spec(folder: Path, rounds: int, tracking_uri: str | None = None, checkpoint_every: int | None = None) -> Path:
    text = BASE_SPEC.format(rounds=rounds, tracking="true" if tracking_uri else "false")
    if tracking_uri:
        text += f'uri = "{tracking_uri}"\n'
    text += f"[checkpoint]\nevery = {checkpoint_every}\n" if checkpoint_every else "[checkpoint]\nenabled = false\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.toml"
    path.write_text(text)
    return path


def classify(code, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 1 or "internal error" in err or "Traceback" in err:
        return "internal error"
    if code == 0:
        return "ok"
    if code == 2 and len(lines) == 1 and lines[0].startswith("pfl-run: error:"):
        return "user error"
    if code == 2 and len(lines) > 1:
        return "multi-line error"
    return "other"


def first_line(text: str, width: int = 120) -> str:
    """The first line pfl wrote (MLflow's and alembic's INFO log lines, on store creation, skipped)."""
    lines = [line for line in text.splitlines() if line.strip() and " INFO " not in line]
    return lines[0][:width] if lines else ""


# -- part 1: fuzz ----------------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """Raised by SIGALRM: a case that runs past --case-timeout (not an Exception, so run_main's
    last-resort handler does not swallow it)."""


def _time_out(signum, frame):
    raise CaseTimeout()


def call_run_main(argv: list[str], timeout: int) -> tuple[str, str]:
    """One in-process ``run_main`` call: its class and what it wrote to stderr."""
    from pfl_core.cli import run_main

    err, out = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _time_out)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = run_main(argv)
        return classify(code, err.getvalue()), err.getvalue()
    except CaseTimeout:
        return "timeout", f"still running after {timeout} s"
    except BaseException as exc:  # noqa: BLE001 -- SystemExit included: run_main is meant to return a code
        return "uncaught", f"{type(exc).__name__}: {exc} | {err.getvalue()}"
    finally:
        signal.alarm(0)


def part_fuzz(workdir: Path, timeout: int) -> dict:
    spec = str(write_spec(workdir / "fuzz", rounds=3))
    cases, failing = [], []
    for key in NUMERIC_KEYS:
        for label, text in VALUES.items():
            value = f"[{text}]" if key in LIST_KEYS else text
            base = [spec, "--set", f"{key}={value}", "--no-tracking", "--quiet"]
            one_round = [] if key == "experiment.rounds" else ["--set", "experiment.rounds=1"]
            real, real_err = ("dry run only", "") if key in DRY_RUN_ONLY else call_run_main(base + one_round, timeout)
            dry, dry_err = call_run_main(base + ["--dry-run"], timeout)
            case = {"key": key, "value": value, "label": label, "run": real, "dry_run": dry,
                    "dry_passed_run_failed": dry == "ok" and real not in FINE + ("dry run only",)}
            cases.append(case)
            shown = f"{key}={value!r}"
            if real not in FINE + ("dry run only",):
                failing.append(f"run      {shown} -> {real}: {first_line(real_err)}")
            if dry not in FINE:
                failing.append(f"dry-run  {shown} -> {dry}: {first_line(dry_err)}")
            if case["dry_passed_run_failed"]:
                failing.append(f"dry run passed but the run failed: {shown}")
    return {"cases": len(cases), "run": dict(Counter(c["run"] for c in cases)),
            "dry_run": dict(Counter(c["dry_run"] for c in cases)),
            "dry_passed_run_failed": sum(c["dry_passed_run_failed"] for c in cases), "failing": failing}


# -- part 2: kill matrix ---------------------------------------------------------------------------

# The child: patch the kill point in, then run pfl-run as the console script would.
KILL_DRIVER = r'''
import os, signal, sys
from pathlib import Path
from pfl_core.cli import run_main
from pfl_core.engine import Engine
try:
    from pfl_core.state import checkpoint as ckpt
except ImportError:  # the older layout
    from pfl_core import checkpoint as ckpt
where, at, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
stop = lambda: os.kill(os.getpid(), sig)
if where == "round_start":
    original_run_round = Engine.run_round
    def run_round(self, ctx, round):
        if round == at:
            stop()
        return original_run_round(self, ctx, round)
    Engine.run_round = run_round
elif where == "ckpt_before":
    original_write = ckpt.Checkpointer.write
    def write(self, ctx, round, *rest):
        if round == at:
            stop()
        return original_write(self, ctx, round, *rest)
    ckpt.Checkpointer.write = write
elif where == "ckpt_during":  # Checkpointer.write calls the module's save_clients into .round-N.tmp-PID
    original_save = ckpt.save_clients
    def save_clients(store, folder):
        original_save(store, folder)
        if Path(folder).name.startswith(".round-%06d" % at):
            stop()
    ckpt.save_clients = save_clients
elif where == "ckpt_after":  # prune runs once the round-N folder has been renamed into place
    original_prune = ckpt.Checkpointer.prune
    def prune(self):
        original_prune(self)
        if self.written_round == at:
            stop()
    ckpt.Checkpointer.prune = prune
sys.exit(run_main(sys.argv[4:]))
'''


def pfl_run_command() -> list[str]:
    script = Path(sys.executable).parent / "pfl-run"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from pfl_core.cli import run_main; sys.exit(run_main())"]


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV, timeout=timeout, check=False)


def metric_histories(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def compare_metrics(got: dict, want: dict, ignored: set) -> str:
    keys = sorted((set(want) | set(got)) - ignored)
    differ = [k for k in keys if got.get(k) != want.get(k)]
    if not differ:
        return "equal"
    # The same value per step, but a step logged twice (a round run again after the resume)?
    if all(dict(got.get(k, [])) == dict(want.get(k, [])) for k in differ):
        return f"same values, duplicate steps in {', '.join(differ[:4])}"
    return f"DIFFER: {', '.join(differ[:6])}"


def part_kill(workdir: Path, checkpoint_rounds: list[int]) -> dict:
    import mlflow

    folder = workdir / "kill"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    spec = str(write_spec(folder, rounds=4, tracking_uri=uri, checkpoint_every=1))
    driver = folder / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    client = mlflow.MlflowClient(tracking_uri=uri)
    seen: set[str] = set()

    def new_run_id() -> str | None:
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        fresh = [r.info.run_id for r in runs if r.info.run_id not in seen]
        seen.update(fresh)
        return fresh[0] if fresh else None

    # Two uninterrupted runs: the reference, and which metrics are timings (differ between them).
    references = []
    for _ in range(2):
        done = run(pfl_run_command() + [spec, "--quiet"])
        assert done.returncode == 0, done.stderr
        references.append(metric_histories(client, new_run_id()))
    reference = references[0]
    timings = {k for k in reference if references[0][k] != references[1].get(k)}

    points = [(f"SIGKILL as round {r} starts", "round_start", r, "SIGKILL") for r in (2, 3)]
    for c in checkpoint_rounds:
        points += [(f"SIGKILL before checkpoint {c} is written", "ckpt_before", c, "SIGKILL"),
                   (f"SIGKILL during checkpoint {c} (clients saved)", "ckpt_during", c, "SIGKILL"),
                   (f"SIGKILL right after checkpoint {c}", "ckpt_after", c, "SIGKILL")]
    points.append(("SIGTERM as round 3 starts", "round_start", 3, "SIGTERM"))
    rows = []
    for name, where, at, sig in points:
        for by in ("run id", "folder"):
            killed = run([sys.executable, str(driver), where, str(at), sig, spec, "--quiet"])
            run_id = new_run_id()
            row = {"kill point": name, "resume by": by, "kill rc": killed.returncode}
            if run_id is None:
                rows.append({**row, "result": f"no run was created: {first_line(killed.stderr)}"})
                continue
            ckpt_folder = Path(client.get_run(run_id).data.tags.get("pfl.checkpoint")
                               or folder / "checkpoints" / run_id)
            had_checkpoint = ckpt_folder.is_dir() and any(p.name.startswith("round-") for p in ckpt_folder.iterdir())
            target = [run_id, "--tracking-uri", uri] if by == "run id" else [str(ckpt_folder)]
            resumed = run(pfl_run_command() + ["--resume", *target, "--quiet"])
            row["resume rc"] = resumed.returncode
            if not had_checkpoint and resumed.returncode == 2 and classify(2, resumed.stderr) == "user error":
                rows.append({**row, "result": "n/a (no checkpoint yet)", "message": first_line(resumed.stderr)})
                continue
            status = client.get_run(run_id).info.status
            row.update({"finished": status == "FINISHED", "status": status,
                        "metrics": compare_metrics(metric_histories(client, run_id), reference, timings)})
            if resumed.returncode != 0:
                row["message"] = first_line(resumed.stderr)
            rows.append(row)
    return {"timing metrics left out": sorted(timings), "rows": rows}


# -- part 3: concurrency ---------------------------------------------------------------------------


def part_concurrency(workdir: Path, processes: int, trials: int, signal_trials: int, window: tuple[float, float],
                     seed: int) -> dict:
    failures: dict[str, int] = {}
    succeeded = 0
    for trial in range(trials):
        folder = workdir / f"concurrent-{trial}"
        spec = str(write_spec(folder, rounds=1, tracking_uri=f"sqlite:///{folder / 'mlflow.db'}"))
        # Started in a tight loop, so all of them find the store missing and create it together.
        started = [subprocess.Popen(pfl_run_command() + [spec, "--quiet"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, env=CHILD_ENV) for _ in range(processes)]
        for process in started:
            _, err = process.communicate()
            if process.returncode == 0:
                succeeded += 1
            else:
                # The trial's folder named generically, so the same failure in each trial counts once.
                line = f"rc {process.returncode}: {first_line(err, 200)}".replace(str(folder), "<trial folder>")
                failures[line] = failures.get(line, 0) + 1

    rng = random.Random(seed)
    low, high = window
    signals = []
    for trial in range(signal_trials):
        folder = workdir / f"sigint-{trial}"
        store = folder / "mlflow.db"
        spec = str(write_spec(folder, rounds=1, tracking_uri=f"sqlite:///{store}"))
        delay = rng.uniform(low, high)
        process = subprocess.Popen(pfl_run_command() + [spec, "--quiet"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
        time.sleep(delay)
        store_existed = store.exists()  # did the signal land after the store file appeared?
        process.send_signal(signal.SIGINT)
        _, err = process.communicate()
        follow_up = run(pfl_run_command() + [spec, "--quiet"])
        signals.append({"trial": trial, "delay_s": round(delay, 2), "store existed": store_existed,
                        "interrupted rc": process.returncode, "interrupted said": first_line(err, 200),
                        "follow-up rc": follow_up.returncode, "follow-up said": first_line(follow_up.stderr, 200)})
    return {"started at once": f"{succeeded} of {processes * trials} exit 0", "failures": failures,
            "SIGINT window s": [low, high], "SIGINT trials": signals,
            "signalled after the store file appeared": sum(t["store existed"] for t in signals),
            "interrupted run exited 0 (signal not honoured)": sum(t["interrupted rc"] == 0 for t in signals),
            "stores left unusable": sum(t["follow-up rc"] != 0 for t in signals)}


# -- report ----------------------------------------------------------------------------------------


def source_fingerprint(package: Path) -> str:
    """A hash of pfl_core's and plugins' .py files: the measured tree may be edited while this runs."""
    digest = hashlib.sha256()
    for root in (package, package.parent / "plugins"):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(package.parent)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def print_figures(figures: dict) -> None:
    print(f"pfl {figures['pfl']} at {figures['pfl_core']}; source {figures['source at start']} at the start, "
          f"{figures['source at end']} at the end{'' if figures['source at start'] == figures['source at end'] else ' (CHANGED DURING THE RUN: figures are mixed)'}")
    if "fuzz" in figures:
        fuzz = figures["fuzz"]
        print(f"\n== fuzz: {fuzz['cases']} cases ({len(NUMERIC_KEYS)} keys x {len(VALUES)} values)")
        print(f"  one-round run: {fuzz['run']}")
        print(f"  --dry-run:     {fuzz['dry_run']}")
        print(f"  dry run passed but the run failed: {fuzz['dry_passed_run_failed']}")
        for line in fuzz["failing"]:
            print(f"  {line}")
    if "kill" in figures:
        kill = figures["kill"]
        print(f"\n== kill matrix (timing metrics left out of the comparison: {', '.join(kill['timing metrics left out'])})")
        print(f"  {'kill point':44} {'resume by':9} {'kill rc':>7} {'resume rc':>9}  {'FINISHED':8}  metrics vs uninterrupted")
        for row in kill["rows"]:
            result = row.get("result") or f"{row['finished']!s:8}  {row['metrics']}"
            print(f"  {row['kill point']:44} {row['resume by']:9} {row['kill rc']:>7} {row.get('resume rc', '-'):>9}  {result}")
            if row.get("message"):
                print(f"  {'':44}   resume said: {row['message']}")
    if "concurrency" in figures:
        conc = figures["concurrency"]
        print(f"\n== concurrency: {conc['started at once']}")
        for line, n in conc["failures"].items():
            print(f"  {n} x {line}")
        print(f"  SIGINT {conc['SIGINT window s'][0]}..{conc['SIGINT window s'][1]} s after start: "
              f"{conc['stores left unusable']} of {len(conc['SIGINT trials'])} stores left unusable; "
              f"{conc['signalled after the store file appeared']} signals landed after the store file appeared; "
              f"{conc['interrupted run exited 0 (signal not honoured)']} interrupted runs exited 0")
        for t in conc["SIGINT trials"]:
            print(f"  {t['delay_s']:5.2f} s store {'existed' if t['store existed'] else 'absent '} rc {t['interrupted rc']:>3} "
                  f"{t['interrupted said'][:70]!r} -> follow-up rc {t['follow-up rc']} {t['follow-up said'][:90]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("fuzz", "kill", "concurrency", "all"), default="all")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also save the figures to this file")
    parser.add_argument("--case-timeout", type=int, default=120, help="seconds one fuzz case may run")
    parser.add_argument("--checkpoint-rounds", default="1,2", help="rounds whose checkpoint write is killed")
    parser.add_argument("--processes", type=int, default=8, help="pfl-run started at once (N)")
    parser.add_argument("--trials", type=int, default=3, help="times N are started at once (T)")
    parser.add_argument("--signal-trials", type=int, default=10, help="SIGINT-during-creation trials (K)")
    parser.add_argument("--signal-window", default="0.5,4.0", help="SIGINT delay range in seconds, LOW,HIGH")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SIGINT delays")
    args = parser.parse_args()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="pfl-reliability-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    import pfl_core

    figures = {"pfl": getattr(pfl_core, "__version__", "?"), "pfl_core": str(Path(pfl_core.__file__).parent),
               "workdir": str(workdir), "source at start": source_fingerprint(Path(pfl_core.__file__).parent)}
    parts = ("fuzz", "kill", "concurrency") if args.part == "all" else (args.part,)
    for part in parts:
        started = time.perf_counter()
        if part == "fuzz":
            figures["fuzz"] = part_fuzz(workdir, args.case_timeout)
        elif part == "kill":
            figures["kill"] = part_kill(workdir, [int(r) for r in args.checkpoint_rounds.split(",") if r])
        else:
            window = tuple(float(x) for x in args.signal_window.split(","))
            figures["concurrency"] = part_concurrency(workdir, args.processes, args.trials, args.signal_trials,
                                                      window, args.seed)
        print(f"[{part} took {time.perf_counter() - started:.0f} s]", file=sys.stderr)
    figures["source at end"] = source_fingerprint(Path(pfl_core.__file__).parent)
    print_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
