#!/usr/bin/env python
"""Start-up time of ``pfl-run --dry-run`` (a script, not a test).

1. Wall time of ``--runs`` dry runs of the spec, each a fresh ``pfl-run`` process (stdout
   discarded, ``OMP_NUM_THREADS=1``): the median and the best wall time, and the same of the
   CPU time (user + system), which a busy machine inflates far less; beside it, alternated with
   them, as the floor no lazy import can go below, as many bare ``python -c "import torch"``.
2. One more dry run under ``python -X importtime``: the ``--top`` packages by import time
   (the sum of their modules' own times) with the module that first imported each one (why it
   is there), and the ``--top`` modules by their own import time. ``-X importtime`` itself
   slows imports down, so these times add up to more than a plain run's.

The machine's load average is printed before and after: on a shared machine the figures
move with it.

    python benchmarks/startup.py                            # specs/quickstart.toml, 5 runs
    python benchmarks/startup.py --runs 9 --top 20 specs/other.toml

Target (issue 11): under 3 s of wall time for the quickstart. Exit status 0 whatever the
figures (``--strict``: 1 when the median misses the target). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parents[1]
PFL_RUN = Path(sys.executable).parent / "pfl-run"
TARGET_S = 3.0
BARE_TORCH = 'python -c "import torch"'


@attrs.define
class Imported:
    """One line of ``-X importtime``: a module, its own and cumulative microseconds."""

    name: str
    self_us: int
    cumulative_us: int
    depth: int
    parent: "Imported | None" = None

    @property
    def package(self) -> str:
        return self.name.split(".")[0]


def parse_importtime(stderr: str) -> list[Imported]:
    """The modules of a ``-X importtime`` report, each linked to the module that imported it.

    The report lists a module after everything it imported (post-order), indented two
    spaces per level, so a line's children are the deeper lines waiting just before it."""
    modules: list[Imported] = []
    waiting: dict[int, list[Imported]] = defaultdict(list)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = line[len("import time:"):].split("|", 2)
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        module = Imported(name.strip(), int(own), int(cumulative), depth)
        for child in waiting.pop(depth + 1, []):
            child.parent = module
        waiting[depth].append(module)
        modules.append(module)
    return modules


def first_importer(module: Imported) -> str:
    """The nearest module outside ``module``'s package on its import chain: why it is loaded.
    ``-``: imported by the program itself or by a function at run time (a lazy import, such
    as a plugin loaded from its entry point), not while another module was being imported."""
    node = module.parent
    while node is not None and node.package == module.package:
        node = node.parent
    return node.name if node is not None else "-"


def timed(command: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``command``. On a busy
    machine the CPU time is close to what the wall time would be on a quiet one."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", nargs="?", default=str(REPO / "specs" / "quickstart.toml"))
    parser.add_argument("--runs", type=int, default=5, help="dry runs timed (and bare torch imports)")
    parser.add_argument("--top", type=int, default=15, help="rows of each import-time table")
    parser.add_argument("--strict", action="store_true", help=f"exit 1 when the median is over {TARGET_S} s")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dry_run = [str(PFL_RUN), "--dry-run", args.spec]

    print(f"{' '.join(dry_run)}\nbefore: {load()}")
    subprocess.run(dry_run, stdout=subprocess.DEVNULL, env=env, check=True, cwd=REPO)  # warm the file cache
    runs, torch_only = [], []
    for _ in range(args.runs):  # alternated, so that a busy spell of the machine hits both
        runs.append(timed(dry_run, env))
        torch_only.append(timed([sys.executable, "-c", "import torch"], env))
    print(f"after:  {load()}\n")
    print(f"{'':28} {'wall median':>11} {'best':>6} {'CPU median':>11} {'best':>6}   ({args.runs} runs)")
    for label, times, note in (("pfl-run --dry-run", runs, ""),
                               (BARE_TORCH, torch_only, "   (the floor: torch is needed)")):
        wall, cpu = [t[0] for t in times], [t[1] for t in times]
        if not note:
            note = f"   {'PASS' if statistics.median(wall) < TARGET_S else 'MISS'}: wall median < {TARGET_S:.0f} s"
        print(f"{label:28} {statistics.median(wall):10.2f}s {min(wall):5.2f}s {statistics.median(cpu):10.2f}s "
              f"{min(cpu):5.2f}s{note}")

    report = subprocess.run([sys.executable, "-X", "importtime", *dry_run], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, check=True, cwd=REPO).stderr
    modules = parse_importtime(report)
    total_ms = sum(m.self_us for m in modules) / 1000
    by_package: dict[str, list[Imported]] = defaultdict(list)
    for module in modules:
        by_package[module.package].append(module)
    print(f"\n-X importtime: {len(modules)} modules, {total_ms:.0f} ms of imports in all (inflated by the "
          f"measurement)\n\ntop {args.top} packages by import time (own time of their modules):")
    print(f"{'package':24} {'ms':>7} {'share':>6}  first imported by")
    ranked = sorted(by_package.items(), key=lambda item: -sum(m.self_us for m in item[1]))
    for package, members in ranked[:args.top]:
        ms = sum(m.self_us for m in members) / 1000
        # importing any submodule imports the package first, so its own line says who did
        entry = next((m for m in members if m.name == package), members[0])
        print(f"{package:24} {ms:7.0f} {ms / total_ms:6.1%}  {first_importer(entry)}")
    print(f"\ntop {args.top} modules by own import time:")
    print(f"{'module':44} {'own ms':>7} {'cum ms':>7}  imported by")
    for module in sorted(modules, key=lambda m: -m.self_us)[:args.top]:
        print(f"{module.name:44} {module.self_us / 1000:7.0f} {module.cumulative_us / 1000:7.0f}  "
              f"{module.parent.name if module.parent else '-'}")
    return 1 if args.strict and statistics.median(t[0] for t in runs) >= TARGET_S else 0


if __name__ == "__main__":
    sys.exit(main())
