#!/usr/bin/env python
"""pfl on PFLlib's FedAvg CIFAR workload, phase by phase (a script, not a test; issue 37).

The workload: 100 clients x 500 training / 167 test CIFAR-shaped samples (uint8 32x32x3, 10
classes; random pixels and labels drawn from ``--seed``: the time of a run does not depend on
what it learns), one npz file; PFLlib's CIFAR CNN (``FedAvgCNN``: conv5x5(32), pool, conv5x5(64),
pool, fc 1600->512, fc 512->10, no padding, 582,026 parameters), FedAvg, SGD lr 0.005, batch 10,
1 local epoch, every client every round, evaluation every round, ``--rounds`` rounds (2),
tracking on into a fresh SQLite store, the default executor. pfl has no such model in its zoo
(cnn2 pads its convolutions: 2.2M parameters), so the script writes it as a third-party model
plugin (``pfllib_cnn``, one module and a ``.dist-info`` with its entry point) into the work
folder and puts that folder on ``PYTHONPATH``: pfl discovers it like any installed plugin.

1. Writes the npz (``workload.npz``, 205 MB, made once per seed and kept in ``--dir``, default
   /tmp/pfl-pfllib-workload; never in the repository), the plugin and the spec.
2. ``--runs`` fresh ``pfl-run`` processes on a fresh store each: the whole wall time and, inside
   the process, the time of each phase: interpreter start, ``import torch``, pfl's imports, the
   store (its check and creation), the data build (reading the npz, standardising, the tensors)
   with the partition (the partitioner and the per-client splits) inside it, the MLflow run's
   start, the rounds (training), the evaluation, the artifacts (partition and result tables and
   pictures), the checkpoints and what is left (spec, models, the rest). "outside the rounds,
   beyond import torch" is the total less the rounds, the evaluation and ``import torch``.
3. The evaluation's batch size: one forward pass over every client's test split (eval mode,
   no gradients) at each of ``--eval-batches``, the best of ``--repeats``; the fastest is
   marked. pfl's ``evaluation.batch_size`` (default 1024) is what a run uses.
4. ``--pfllib DIR`` (PFLlib's ``system/`` folder, see docs/benchmarks.md): also converts the
   npz to PFLlib's per-client files (``DIR/../dataset/Cifar10_pfl_workload/{train,test}/i.npz``) and
   times PFLlib's ``main.py`` on it, alternated with pfl's runs, same threads.

    python benchmarks/pfllib_workload.py                        # 1 run of pfl, 2 rounds
    python benchmarks/pfllib_workload.py --runs 3 --pfllib /tmp/speed37/pfllib/system
    python benchmarks/pfllib_workload.py --profile /tmp/prof    # py-spy record of one run (raw)

The machine's load average is printed before and after each run. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLIENTS, TRAIN, TEST, CLASSES = 100, 500, 167, 10
SHAPE = (32, 32, 3)
PFLLIB_DATASET = "Cifar10_pfl_workload"
PFLLIB_PYTHON = sys.executable  # --pfllib-python: PFLlib's own venv (it also needs h5py, calmsize, cvxpy)

MODEL_MODULE = '''\
"""PFLlib's CIFAR CNN (``FedAvgCNN`` in PFLlib's system/flcore/trainmodel/models.py) as a pfl
model plugin, written by benchmarks/pfllib_workload.py."""
import torch
from torch import nn
from pfl_core.api import ModelPlugin, NoParams


class _FedAvgCNN(nn.Module):
    def __init__(self, in_features, num_classes, dim):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(in_features, 32, kernel_size=5, padding=0, stride=1, bias=True),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=(2, 2)))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, kernel_size=5, padding=0, stride=1, bias=True),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=(2, 2)))
        self.fc1 = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        out = self.conv2(self.conv1(x))
        return self.fc(self.fc1(torch.flatten(out, 1)))


class PFLlibCNN(ModelPlugin):
    """PFLlib's FedAvgCNN: conv5x5(32) -> relu -> pool2 -> conv5x5(64) -> relu -> pool2 ->
    fc(512) -> relu -> fc(C), unpadded (1600 features at 32x32)."""

    name = "pfllib_cnn"
    Params = NoParams

    def build(self, input_shape, num_classes):
        c, h, w = self.check_shape(input_shape, num_classes)
        side = lambda n: ((n - 4) // 2 - 4) // 2
        return _FedAvgCNN(c, num_classes, 64 * side(h) * side(w))
'''

SPEC = '''\
# PFLlib's FedAvg CIFAR workload (benchmarks/pfllib_workload.py)
[experiment]
name = "pfllib_workload"
seed = 0
rounds = {rounds}

[data]
name = "npz"
include_test = true
[data.params]
path = "{npz}"

[partition]
scheme = "domain"          # client i: the samples of domain i (its 500 train + 167 test)
num_clients = {clients}
val_fraction = 0.0
test_fraction = 0.25       # 167 of 667, as PFLlib's train_ratio 0.75

[model]
name = "pfllib_cnn"

[algorithm]
name = "fedavg"

[training]
local_epochs = 1
batch_size = 10
lr = 0.005                 # PFLlib's default -lr

[evaluation]
every = 1

[tracking]
uri = "sqlite:///{store}"
progress = false
'''


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min), {os.cpu_count()} cores"


# ---------------------------------------------------------------------------
# The workload's files


def make_npz(folder: Path, seed: int) -> Path:
    """The workload's npz (made once per seed): x_train/y_train/domain_train (client i's 500
    training samples are domain i), x_test/y_test/domain_test (its 167 test samples)."""
    import numpy as np

    path = folder / f"workload-seed{seed}.npz"
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, per_client in (("train", TRAIN), ("test", TEST)):
        n = CLIENTS * per_client
        arrays[f"x_{split}"] = rng.integers(0, 256, size=(n, *SHAPE), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, CLASSES, size=n).astype(np.int64)
        arrays[f"domain_{split}"] = np.repeat(np.arange(CLIENTS, dtype=np.int64), per_client)
    arrays["domains"] = np.array([f"client{i}" for i in range(CLIENTS)])
    partial = path.with_name(path.name + ".partial.npz")
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def write_plugin(folder: Path) -> Path:
    """``pflbench_models.py`` and its ``.dist-info`` (entry point ``pfllib_cnn``) in ``folder``."""
    site = folder / "site"
    info = site / "pflbench_models-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (site / "pflbench_models.py").write_text(MODEL_MODULE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pflbench-models\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pfl]\npfllib_cnn = pflbench_models:PFLlibCNN\n")
    return site


def write_spec(folder: Path, npz: Path, store: Path, rounds: int) -> Path:
    spec = folder / "workload.toml"
    spec.write_text(SPEC.format(rounds=rounds, npz=npz, clients=CLIENTS, store=store))
    return spec


def convert_for_pfllib(npz: Path, dataset_dir: Path) -> None:
    """PFLlib's files of the same data: ``train/i.npz`` and ``test/i.npz`` holding
    ``data = {'x': float32 (N, 3, 32, 32) standardised, 'y': int64}`` (what PFLlib's
    ``utils/data_utils.py: read_data`` loads, ``allow_pickle``), as PFLlib's own
    ``dataset/generate_Cifar10.py`` writes them (its transform: ToTensor, Normalize 0.5/0.5)."""
    import numpy as np

    with np.load(npz) as f:
        arrays = {k: f[k] for k in f.files}
    for split in ("train", "test"):
        (dataset_dir / split).mkdir(parents=True, exist_ok=True)
        x, y, d = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"domain_{split}"]
        for i in range(CLIENTS):
            mine = d == i
            xi = (x[mine].transpose(0, 3, 1, 2).astype(np.float32) / 255.0 - 0.5) / 0.5
            np.savez_compressed(dataset_dir / split / f"{i}.npz", data={"x": xi, "y": y[mine]})


# ---------------------------------------------------------------------------
# One pfl-run, timed phase by phase (in a child process: --child)


def child(argv: list[str]) -> None:
    """Run ``pfl-run argv`` in this process with each phase's time summed; print them as JSON on
    the last line of stderr. Times are taken around the functions that do each phase."""
    started, started_cpu = time.perf_counter(), time.process_time()
    import torch  # noqa: F401

    after_torch, after_torch_cpu = time.perf_counter(), time.process_time()
    from pfl_core.cli import cli
    from pfl_core.data import federated
    from pfl_core.engine import engine
    from pfl_core.state import checkpoint
    from pfl_core.study import points, run
    from pfl_core.tracking import tracker as tracker_module

    after_imports, after_imports_cpu = time.perf_counter(), time.process_time()
    phases: dict[str, float] = {}
    active: list[str] = []  # nested phases: only the innermost one counts

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            active.append(name)
            begun, begun_cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent, spent_cpu = time.perf_counter() - begun, time.process_time() - begun_cpu
                active.pop()
                for key, value in ((name, spent), (f"cpu {name}", spent_cpu)):
                    phases[key] = phases.get(key, 0.0) + value
                    if active:  # the outer phase does not count the inner one
                        outer = active[-1] if not key.startswith("cpu ") else f"cpu {active[-1]}"
                        phases[outer] = phases.get(outer, 0.0) - value
        return wrapper

    run.check_store = timed("store", run.check_store)
    points.build_federated_data = timed("data build", points.build_federated_data)
    engine.build_federated_data = timed("data build", engine.build_federated_data)
    original_instantiate = federated.instantiate

    def instantiate(kind, *args, **kwargs):  # the partitioner's split: the partition phase
        plugin = original_instantiate(kind, *args, **kwargs)
        if kind == federated.PARTITIONER:
            plugin.split = timed("partition", plugin.split)
        return plugin

    federated.instantiate = instantiate
    federated.stratified_split = timed("partition", federated.stratified_split)
    engine.Engine.run_round = timed("rounds", engine.Engine.run_round)
    engine.evaluate_clients = timed("evaluation", engine.evaluate_clients)
    engine.Engine._log_partition = timed("artifacts", engine.Engine._log_partition)
    engine.Engine._log_results = timed("artifacts", engine.Engine._log_results)
    tracker_module.MlflowTracker.start = timed("run start", tracker_module.MlflowTracker.start)
    tracker_module.MlflowTracker.end = timed("run end", tracker_module.MlflowTracker.end)
    checkpoint.Checkpointer.after_round = timed("checkpoints", checkpoint.Checkpointer.after_round)
    if os.environ.get("PFLBENCH_FIXED_ONLY"):  # --fixed-only: no training, no evaluation
        engine.Engine.run_round = timed("rounds", lambda self, ctx, round: None)
        engine.evaluate_clients = timed("evaluation", lambda ctx, **kwargs: ({"acc_mean": 0.0}, []))
    code = cli.run_main(argv)
    ended, ended_cpu = time.perf_counter(), time.process_time()
    report = {"import torch": after_torch - started, "pfl imports": after_imports - after_torch,
              "cpu import torch": after_torch_cpu - started_cpu, "cpu pfl imports": after_imports_cpu - after_torch_cpu,
              **phases, "in process": ended - started, "cpu in process": ended_cpu - started_cpu, "exit code": code}
    sys.stdout.flush()
    print(json.dumps(report), file=sys.stderr)


PHASES = ("interpreter", "import torch", "pfl imports", "store", "data build", "partition", "run start",
          "rounds", "evaluation", "checkpoints", "artifacts", "run end", "other")


def time_pfl(spec: Path, site: Path, store: Path, env: dict) -> dict:
    """One fresh ``pfl-run`` process (a new store each time): its phases and its wall time."""
    for path in store.parent.glob(store.name + "*"):
        path.unlink()
    shutil.rmtree(store.parent / "mlartifacts", ignore_errors=True)
    shutil.rmtree(store.parent / "checkpoints", ignore_errors=True)
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}
    begun = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", str(spec)], cwd=store.parent, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - begun
    lines = done.stderr.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        sys.exit(f"pfl-run failed:\n{done.stderr[-3000:]}")
    if report.pop("exit code"):
        sys.exit(f"pfl-run failed:\n{done.stderr[-3000:]}")
    report["total"] = wall
    report["interpreter"] = wall - report.pop("in process")
    report["other"] = wall - sum(v for k, v in report.items() if k != "total" and not k.startswith("cpu "))
    cpu_total = report.pop("cpu in process")  # this process's CPU (not its workers'), interpreter start aside
    report["cpu other"] = cpu_total - sum(v for k, v in report.items() if k.startswith("cpu "))
    report["cpu total"] = cpu_total
    return report


def time_pfllib(system: Path, rounds: int, env: dict) -> float:
    """PFLlib's main.py on the converted data (its own timing aside): the wall time."""
    command = pfllib_command(rounds)
    begun = time.perf_counter()
    done = subprocess.run(command, cwd=system, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.perf_counter() - begun
    if done.returncode:
        sys.exit(f"PFLlib failed ({' '.join(command)}):\n{done.stdout[-3000:]}")
    return wall


def pfllib_command(rounds: int) -> list[str]:
    # -gr counts rounds from 0 (PFLlib runs gr + 1 rounds, evaluating before each and after the last)
    # the dataset's name must hold "Cifar10": PFLlib picks its CNN's input size by the name
    return [PFLLIB_PYTHON, "main.py", "-data", PFLLIB_DATASET, "-m", "CNN", "-algo", "FedAvg", "-nc", str(CLIENTS),
            "-jr", "1", "-ls", "1", "-lbs", "10", "-gr", str(rounds - 1), "-eg", "1", "-dev", "cpu", "-ncl", str(CLASSES)]


# ---------------------------------------------------------------------------
# The evaluation's batch size


def eval_batch_sizes(npz: Path, site: Path, sizes: list[int], repeats: int) -> dict[int, float]:
    """Seconds of one forward pass (eval mode, no_grad) over the 100 clients' test splits, client
    by client, at each batch size: the best of ``repeats``."""
    sys.path.insert(0, str(site))
    import numpy as np
    import pflbench_models
    import torch

    torch.manual_seed(0)
    model = pflbench_models.PFLlibCNN().build((3, 32, 32), CLASSES).eval()
    with np.load(npz) as f:
        x = torch.from_numpy(f["x_test"]).permute(0, 3, 1, 2).float().div_(255.0)
    clients = x.split(TEST)
    best = {}
    with torch.no_grad():
        for size in sizes:
            times = []
            for _ in range(repeats):
                begun = time.perf_counter()
                for xs in clients:
                    for batch in xs.split(size):
                        model(batch)
                times.append(time.perf_counter() - begun)
            best[size] = min(times)
    return best


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "pfl-pfllib-workload",
                        help="work folder: the npz, the plugin, the spec, the store (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the npz's pixels and labels (default 0)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1, help="fresh pfl-run processes (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both libraries (default: left as it is)")
    parser.add_argument("--eval-batches", default="10,32,64,167,1024",
                        help="evaluation batch sizes to time (default %(default)s; empty: skip)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each evaluation timing (default 3)")
    parser.add_argument("--pfllib", type=Path, default=None,
                        help="PFLlib's system/ folder: also time its main.py on the same data")
    parser.add_argument("--profile", type=Path, default=None,
                        help="record one pfl run with py-spy (raw format) into this file instead of timing")
    parser.add_argument("--fixed-only", action="store_true",
                        help="pfl's rounds and evaluation replaced by no-ops: the fixed cost alone, quickly")
    parser.add_argument("--pfllib-python", default=sys.executable,
                        help="the Python that runs PFLlib (default: this one)")
    args = parser.parse_args(argv)
    global PFLLIB_PYTHON
    PFLLIB_PYTHON = args.pfllib_python
    args.dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.fixed_only:
        env["PFLBENCH_FIXED_ONLY"] = "1"
    npz = make_npz(args.dir, args.seed)
    site = write_plugin(args.dir)
    run_dir = args.dir / "run"
    run_dir.mkdir(exist_ok=True)
    store = run_dir / "mlflow.db"
    spec = write_spec(args.dir, npz, store, args.rounds)
    print(f"# workload: {CLIENTS} clients x {TRAIN} train / {TEST} test, {npz} ({npz.stat().st_size / 1e6:.0f} MB), "
          f"{args.rounds} rounds; spec {spec}")
    if args.profile is not None:
        py_spy = shutil.which("py-spy") or sys.exit("--profile needs py-spy on PATH (pip install py-spy)")
        time_pfl(spec, site, store, env)  # not profiled: warms the page cache
        for path in store.parent.glob(store.name + "*"):
            path.unlink()
        shutil.rmtree(run_dir / "mlartifacts", ignore_errors=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        subprocess.run([py_spy, "record", "-f", "raw", "-r", "50", "-o", str(args.profile), "--",
                        sys.executable, __file__, "--child", str(spec)], cwd=run_dir, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        print(f"# py-spy profile: {args.profile}")
        return 0
    if args.pfllib is not None:
        dataset_dir = args.pfllib.parent / "dataset" / PFLLIB_DATASET
        if not (dataset_dir / "test" / f"{CLIENTS - 1}.npz").exists():
            convert_for_pfllib(npz, dataset_dir)
        print(f"# PFLlib: {' '.join(pfllib_command(args.rounds))}  (in {args.pfllib})")
    reports, pfllib_walls = [], []
    for i in range(args.runs):
        print(f"# run {i + 1}: {load_line()}", flush=True)
        reports.append(time_pfl(spec, site, store, env))
        print(f"#   pfl {reports[-1]['total']:.1f} s", flush=True)
        if args.pfllib is not None:
            pfllib_walls.append(time_pfllib(args.pfllib, args.rounds, env))
            print(f"#   PFLlib {pfllib_walls[-1]:.1f} s; {load_line()}", flush=True)
    print(f"\n{'phase: wall s (CPU s)':<28}" + "".join(f"{f'run {i + 1}':>16}" for i in range(len(reports)))
          + f"{'median':>16}")
    for phase in (*PHASES, "total"):
        values = [r.get(phase, 0.0) for r in reports]
        cpus = [r.get(f"cpu {phase}") for r in reports]
        label = {"partition": "  of which partition"}.get(phase, phase)
        cells = [f"{v:7.2f}" + (f" ({c:6.2f})" if c is not None else " " * 9) for v, c in zip(values, cpus)]
        middle = f"{statistics.median(values):7.2f}" + (f" ({statistics.median(cpus):6.2f})" if None not in cpus else " " * 9)
        print(f"{label:<28}" + "".join(f"{c:>16}" for c in cells) + f"{middle:>16}")
    fixed = [r["total"] - r.get("rounds", 0) - r.get("evaluation", 0) - r["import torch"] for r in reports]
    print(f"{'outside rounds, beyond torch':<28}" + "".join(f"{v:16.2f}" for v in fixed)
          + f"{statistics.median(fixed):16.2f}")
    if pfllib_walls:
        print(f"{'PFLlib end to end':<28}" + "".join(f"{v:16.2f}" for v in pfllib_walls)
              + f"{statistics.median(pfllib_walls):16.2f}")
        print(f"PFLlib / pfl (median): {statistics.median(pfllib_walls) / statistics.median(r['total'] for r in reports):.2f}x")
    if args.eval_batches:
        sizes = [int(s) for s in args.eval_batches.split(",")]
        best = eval_batch_sizes(npz, site, sizes, args.repeats)
        fastest = min(best, key=best.get)
        print(f"\nevaluation forward pass over the 100 clients' test splits (best of {args.repeats}):")
        for size, seconds in best.items():
            print(f"  batch {size:>5}: {seconds:6.3f} s" + ("  <- fastest" if size == fastest else ""))
    print(f"# {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
