"""Issue 12, "no traceback on any input": a seeded fuzzer of the shipped specs (``specs/*.toml``).

Each case takes one shipped spec, applies one to three mutations (a key deleted or added, a value
of the wrong type, a huge / negative / zero / NaN / infinite number, bytes that are not UTF-8,
deep nesting, a broken sweep, broken TOML, another plugin's name, an odd data path, bad
``--set`` / ``--sweep`` / ``--out`` arguments) and runs ``pfl-run SPEC --dry-run`` in this
process. Every case must end in exit code 0, or exit code 2 with one line on stderr that names a
key path or the spec file and shows no Python internals, within a time limit (SIGALRM; a hang
inside C code that the alarm cannot break ends the process with every thread's stack, via
faulthandler). ``note:`` lines (a ``--set`` replacing a sweep axis) are informational and not
counted as the error line. A case that no valid spec survives (bytes that are not UTF-8, nesting
deeper than 32, a key no table takes, a broken sweep) must not exit 0.

The specs' npz files are replaced by small stand-ins of the same layout (a seeded subset of the
real file: same keys, dtypes, sample shape, classes and domains) so that a spec that passes
validation is built in well under a second; without ``../shared/data`` the data path is left as
it is and such cases end in the "npz file not found" error. Torchvision datasets are not
downloaded (``download = false``).

Run as a script for longer campaigns; each failure is printed with its case index, and one case
is replayed with ``--only INDEX`` (a case depends only on the seed, its index and the specs)::

    python tests/test_fuzz.py --cases 2000 --seed 0 [--save DIR] [--only INDEX]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import io
import json
import math
import random
import re
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
SPECS = sorted((REPO / "specs").glob("*.toml"))
STAND_IN_TRAIN, STAND_IN_TEST = 3000, 400  # samples a stand-in npz keeps
CASE_TIMEOUT_S = 30.0  # a dry run of a shipped spec on the stand-ins takes well under 5 s
SUITE_CASES = 300  # in the test suite (the script's default is 2000)

# Fragments that mean Python's internals reached the user.
INTERNALS = re.compile(
    r"Traceback|File \"|<class|object at 0x|pfl_core\.|plugins\.\w+\.|NoneType|internal error|"
    r"\b(Key|Type|Value|Attribute|Index|Recursion|Memory|Overflow|ZeroDivision|Assertion|Runtime|Lookup|"
    r"Name|Import|OS|Unicode\w*|NotImplemented)Error\b|datetime\.|(?<![\w.])(numpy|np|torch)\.(?!savez)|dtype\(|"
    # Python's own TypeError / AttributeError texts
    r"object has no attribute|is not iterable|argument of type|not subscriptable|unhashable type|"
    r"not callable|positional argument|keyword argument|not supported between instances")
ERROR_PREFIX = "pfl-run: error: "


# ---------------------------------------------------------------------------
# Writing TOML (inline tables throughout: any value a mutation makes can be written)

class Raw(str):
    """TOML text written as it is (values the dict form cannot hold: deep nesting, datetimes)."""


def toml_value(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__}")


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def dumps(raw: dict) -> str:
    top = [f"{toml_key(k)} = {toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for name, table in raw.items():
        if isinstance(table, dict):
            top.append(f"\n[{toml_key(name)}]")
            top.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())
    return "\n".join(top) + "\n"


# ---------------------------------------------------------------------------
# The seed specs, with their npz files replaced by small stand-ins

def stand_in_npz(original: Path, target: Path) -> bool:
    """A seeded subset of ``original`` with the same arrays' layout; False if it is missing."""
    if not original.is_file():
        return False
    rng = np.random.default_rng(0)
    with np.load(original) as f:
        arrays = {name: f[name] for name in f.files}
    out = {}
    for split, keep in (("train", STAND_IN_TRAIN), ("test", STAND_IN_TEST)):
        per_sample = [k for k, v in arrays.items() if k.endswith(f"_{split}")]
        if not per_sample:
            continue
        n = len(arrays[per_sample[0]])
        picked = np.sort(rng.choice(n, size=min(n, keep), replace=False))
        out.update({k: arrays[k][picked] for k in per_sample})
    out.update({k: v for k, v in arrays.items() if k not in out})  # classes, domain names
    np.savez(target, **out)
    return True


def seed_specs(workdir: Path) -> list[tuple[str, dict]]:
    """(name, raw dict) for every shipped spec, npz paths pointing at stand-ins in ``workdir``."""
    made: dict[str, str] = {}
    seeds = []
    for path in SPECS:
        raw = tomllib.loads(path.read_text())
        data = raw.get("data", {})
        if data.get("name") == "npz":
            original = (REPO / data["params"]["path"]).resolve()  # relative to the repository root
            if str(original) not in made:
                target = workdir / f"standin_{original.name}"
                made[str(original)] = str(target) if stand_in_npz(original, target) else str(original)
            data["params"]["path"] = made[str(original)]
        elif "root" in data.get("params", {}):  # a torchvision dataset: no download attempts
            data["params"]["download"] = False
        seeds.append((path.name, raw))
    return seeds


# ---------------------------------------------------------------------------
# Mutations

@dataclass
class Case:
    index: int
    spec: str  # the seed spec's file name
    raw: dict | None  # the mutated spec, or None when ``text`` is given directly
    text: bytes = b""
    args: list[str] = field(default_factory=list)
    what: list[str] = field(default_factory=list)  # the mutations, for the report
    not_utf8: bool = False  # bytes that are not UTF-8 were put in the file

    def content(self) -> bytes:
        return self.text if self.raw is None else dumps(self.raw).encode()


def paths_in(value: Any, prefix=()) -> list[tuple]:
    """Every key path in a nested dict/list (tables, lists and leaves)."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append(prefix + (key,))
        found.extend(paths_in(child, prefix + (key,)))
    return found


def get_at(raw, path):
    for key in path:
        raw = raw[key]
    return raw


def set_at(raw, path, value):
    get_at(raw, path[:-1])[path[-1]] = value


def dotted(path) -> str:
    return ".".join(str(p) for p in path)


HUGE_NUMBERS = [0, -1, -7, 1, 2, 10**6, 10**9, 10**12, 2**31, 2**62, 2**63 - 1, -(2**63), math.nan, math.inf,
                -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.5, -0.5, 1e-300, 1e30, 3.7]
BEYOND_TOML_INTS = ["18446744073709551617", "-9223372036854775809", "1" + "0" * 80]
OTHER_TYPES = ["", "x", "auto", "fedavg", "../nope.npz", True, False, [], [1, "a"], [[]], {}, {"x": 1}, [{}],
               Raw("1979-05-27"), Raw("1979-05-27T07:32:00Z"), Raw("07:32:00"), "\u00e9\u4e2d", "a" * 5000,
               "1e400", "nan", "None", "0x10"]
# Names no table of a spec takes (a spec that gets one must fail), and names some tables take.
UNKNOWN_NAMES = ["colour", "__class__", "__init__", "", " ", "a.b", "\u00fcber", "1"]
MAYBE_KNOWN_NAMES = ["x", "params", "name", "seed", "lr", "epochs", "num-clients", "budget", "sweep", "mu"]


def mutate_delete(rng, case):
    paths = paths_in(case.raw)
    if paths:
        path = rng.choice(paths)
        container = get_at(case.raw, path[:-1])
        del container[path[-1]]
        case.what.append(f"delete {dotted(path)}")


def tables_in(raw) -> list[tuple]:
    return [()] + [p for p in paths_in(raw) if isinstance(get_at(raw, p), dict)]


def mutate_unknown_key(rng, case):
    table = rng.choice(tables_in(case.raw))
    existing = list(get_at(case.raw, table))
    name = rng.choice(UNKNOWN_NAMES + MAYBE_KNOWN_NAMES + [k + "s" for k in existing]
                      + [k[:-1] for k in existing if len(k) > 1])
    value = rng.choice([1, "x", 0.5, [1, 2], {"a": 1}, True])
    if name in get_at(case.raw, table):
        return
    get_at(case.raw, table)[name] = value
    case.what.append(f"add {dotted(table + (name,))} = {value!r}")
    # Tables whose keys are free (tags), or open (a sweep axis, the computed budget) may take it.
    free = table[:1] in {("sweep",), ("budget",)} or table[-1:] in {("tags",), ("arch_params",)} or table == ()


def leaves(raw) -> list[tuple]:
    return [p for p in paths_in(raw) if not isinstance(get_at(raw, p), (dict, list))]


def mutate_wrong_type(rng, case):
    paths = paths_in(case.raw)
    if paths:
        path = rng.choice(paths)
        value = copy.deepcopy(rng.choice(OTHER_TYPES))
        if isinstance(get_at(case.raw, path), dict) and rng.random() < 0.5:
            value = [get_at(case.raw, path)]  # a table given as a list of tables
        set_at(case.raw, path, value)
        case.what.append(f"set {dotted(path)} = {str(value)[:40]!r}")


def mutate_number(rng, case):
    numeric = [p for p in leaves(case.raw) if isinstance(get_at(case.raw, p), (int, float))]
    path = rng.choice(numeric or leaves(case.raw) or [("experiment", "seed")])
    if rng.random() < 0.15:
        value = Raw(rng.choice(BEYOND_TOML_INTS))
    else:
        value = rng.choice(HUGE_NUMBERS)
    try:
        set_at(case.raw, path, value)
    except (KeyError, TypeError, IndexError):
        case.raw.setdefault("experiment", {})["seed"] = value
    case.what.append(f"set {dotted(path)} = {value!r}")


def mutate_deep(rng, case):
    paths = leaves(case.raw) or [("experiment", "name")]
    path = rng.choice(paths)
    depth = rng.choice([33, 40, 100, 1000, 3000])
    if rng.random() < 0.5:
        value = Raw("[" * depth + "1" + "]" * depth)
    else:
        value = Raw("{a = " * depth + "1" + "}" * depth)
    try:
        set_at(case.raw, path, value)
    except (KeyError, TypeError, IndexError):
        return
    case.what.append(f"nest {dotted(path)} {depth} deep")


BAD_SWEEPS = [
    {}, [], 3, "x", [[]], {"training.lr": []}, {"training.lr": 0.1}, {"training.lr": "0.1,0.2"},
    {"training.lr": {"a": 1}}, {"training": {"lr": [0.1]}}, {"nonsense.key": [1, 2]}, {"": [1]},
    {"training..lr": [1]}, {"training.lr": [math.nan, -1.0]}, {"training.lr": [0.1] * 1001},
    {f"training.{k}": list(range(1, 11)) for k in ("lr", "batch_size", "local_epochs", "momentum")},
    {"experiment.seed": [-1, 0]}, {"experiment.seed": [2**63 - 1, 0]}, {"experiment.seeds": [[-1], [0]]},
    {"experiment.seeds": [[], [1]]}, {"experiment.seeds": [[1, 1]]}, {"experiment.rounds": [0, 1]},
    {"points": []}, {"points": [1, {}]}, {"points": [{"bogus": 1}]}, {"points": [{"algorithm.name": "os"}]},
    {"points": {"algorithm.name": "fedavg"}}, {"points": [{"points": [{}]}]}, {"algorithm": [{"name": ""}]},
    {"algorithm": [1, "fedavg"]}, {"algorithm": [{"name": "fedavg", "params": {"x": 1}}]},
    {"algorithm.name": ["", "os"]}, {"algorithm.name": [1, 2]}, {"data": [{"name": "npz"}]},
    {"data.name": ["synthetic", "npz"]}, {"model.name": ["mlp", "lenet5", "resnet18"]},
    {"partition.num_clients": [1, 10**9]}, {"sweep.training.lr": [1]}, {"experiment": [1]},
    {"training.local_epochs": [0]}, {"experiment.participation": [0.0, 2.0]},
]


def mutate_sweep(rng, case):
    bad = copy.deepcopy(rng.choice(BAD_SWEEPS))
    if isinstance(bad, dict) and isinstance(case.raw.get("sweep"), dict) and rng.random() < 0.5:
        case.raw["sweep"].update(bad)  # added to the spec's own axes
    else:
        case.raw["sweep"] = bad
    case.what.append(f"sweep {str(bad)[:80]}")


BAD_SETS = [
    "noequals", "=1", "training.lr=", "training.lr=[", "training.lr=nan", "training.lr=inf", "training.lr=-1",
    "experiment.rounds=1e400", "experiment.rounds=" + "9" * 30, "a..b=1", "data=3", "data.params.path.x=1",
    "sweep=[]", "sweep=3", "sweep.x=1", "sweep.x=[]", "experiment.seeds.0=1", "experiment.seed=-5",
    "x" * 3000 + "=1", "training.lr=" + "[" * 3000, "training.lr=" + "[" * 50 + "]" * 50, '"unterminated=1',
    "training=[1]", "experiment.rounds=1979-05-27", "\u00fcber.x=1", "experiment.name=\udcff", "addons.0.x=1",
    "addons=[1]", "algorithm=fedavg", "algorithm.name=", "algorithm.name=os", "algorithm.params={x=1}",
    "experiment.seeds=[]", "experiment.seeds=[-1]", "partition.num_clients=0", "partition.num_clients=2000000",
    "data.subsample=0", "training.batch_size=0", "evaluation.every=-1", "model.name=resnet1800",
    "experiment=1", "=", " . =1", "training.lr=0.1=0.2", "'a.b'=1", "experiment.rounds=true",
]
BAD_SWEEP_ARGS = [
    "training.lr=", "training.lr=,", "training.lr=[]", "training.lr=1,,2", "training.lr=a,b", "bogus.key=1,2",
    "experiment.seed=-1,0", "experiment.rounds=" + ",".join(map(str, range(1, 2002))), "sweep=1,2", "points=1,2",
    "points=[1]", "points=[{}]", "=1,2", "noequals", "training.lr=[" * 40, "algorithm=[1,2]",
    "algorithm.name=os,fedavg", "training.lr=nan,inf", "experiment.seeds=[[0],[0,0]]",
]


def mutate_args(rng, case):
    for _ in range(rng.choice([1, 1, 2])):
        if rng.random() < 0.6:
            case.args += ["--set", rng.choice(BAD_SETS)]
        else:
            case.args += ["--sweep", rng.choice(BAD_SWEEP_ARGS)]
    if rng.random() < 0.1:
        case.args.append("--no-sweep")
    if rng.random() < 0.1:  # a dry run checks the results folder too
        case.args += ["--out", rng.choice(["/dev/null", "/etc/passwd", "a" * 300, "specs", "/proc/self"])]
    case.what.append(f"args {' '.join(a[:40] for a in case.args)}")


def mutate_plugin_name(rng, case):
    """A valid name of another plugin, or of another kind: mostly valid specs, other combinations."""
    names = ["fedavg", "local", "centralized", "fedprox", "ditto", "fedrep", "fedper", "fedbn", "fedmosaic",
             "cosmos", "fedsimsup", "pmixfed", "apfl", "pfedme", "perfedavg", "fedproto", "fedmd", "lenet5",
             "mlp", "cnn2", "cnn4", "resnet18", "synthetic", "npz", "mnist", "iid", "dirichlet", "pathological",
             "domain", "hybrid", "shards", "group_dirichlet"]
    key = rng.choice([("algorithm", "name"), ("model", "name"), ("data", "name"), ("partition", "scheme")])
    name = rng.choice(names)
    case.raw.setdefault(key[0], {})
    if isinstance(case.raw[key[0]], dict):
        case.raw[key[0]][key[1]] = name
        case.what.append(f"set {dotted(key)} = {name!r}")


ODD_PATHS = ["/", "/dev/null", "/dev/zero", "/proc/self/status", "~", "", ".", "a" * 300, "no/such/file.npz",
             "specs/quickstart.toml", "\u00e9\u4e2d.npz", "/etc/shadow"]


def mutate_data_path(rng, case):
    """An odd data file or folder, or another spec's data file (another shape and classes)."""
    data = case.raw.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        return
    paths = [s["data"]["params"]["path"] for _, s in SEEDS if "path" in s.get("data", {}).get("params", {})]
    value = rng.choice(ODD_PATHS + paths)
    key = "path" if data.get("name") == "npz" else "root"
    data["params"][key] = value
    case.what.append(f"set data.params.{key} = {value[:60]!r}")


TEXT_MUTATIONS = ["non-utf8", "truncate", "duplicate line", "control char", "drop bracket"]


def mutate_text(rng, case):
    """Byte-level damage to the written file."""
    text = case.content()
    kind = rng.choice(TEXT_MUTATIONS)
    at = rng.randrange(len(text) + 1)
    if kind == "non-utf8":
        text = text[:at] + rng.choice([b"\xff", b"\xe9", b"\xc3", b"\x80\x80", b"\xfe\xff", b"\xed\xa0\x80"]) + text[at:]
        case.not_utf8 = True
    elif kind == "truncate":
        text = text[:at]
    elif kind == "duplicate line":
        lines = text.split(b"\n")
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
        text = b"\n".join(lines)
    elif kind == "control char":
        text = text[:at] + rng.choice([b"\x00", b"\x07", b"\x1b", b"\r"]) + text[at:]
    else:
        text = text.replace(b"]", b"", 1)
    case.raw, case.text = None, text
    case.what.append(f"text: {kind} at byte {at}")


STRUCTURAL = [mutate_delete, mutate_unknown_key, mutate_wrong_type, mutate_number, mutate_deep, mutate_sweep,
              mutate_args, mutate_plugin_name, mutate_data_path]
WEIGHTS = [3, 3, 4, 5, 1, 3, 2, 2, 1]
SEEDS: list[tuple[str, dict]] = []  # the seed specs of the running campaign


def make_case(seeds: list[tuple[str, dict]], seed: int, index: int) -> Case:
    """Case ``index`` of the campaign ``seed``: the same case whatever else runs."""
    rng = random.Random(f"{seed}:{index}")
    name, raw = rng.choice(seeds)
    case = Case(index, name, copy.deepcopy(raw))
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        if case.raw is None:
            break
        mutation = rng.choices(STRUCTURAL, WEIGHTS)[0]
        mutation(rng, case)
    if case.raw is not None and rng.random() < 0.08:
        mutate_text(rng, case)
    return case


# ---------------------------------------------------------------------------
# Running a case

class Hang(BaseException):
    """The case ran past its time limit (a BaseException: the CLI's handlers do not take it)."""


def _alarm(signum, frame):
    raise Hang()


@dataclass
class Outcome:
    kind: str  # ok | refused | bad-line | internal | escaped | hang | accepted-bad
    code: int | None
    stderr: str
    detail: str = ""
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # Python warnings the case raised


FREE_TABLES = {"sweep", "budget", "tags", "arch_params"}  # tables whose keys are not fixed


def must_fail(case: Case) -> str:
    """Why no valid spec survives the case's final state ('' when it may be valid): judged on
    what the mutations left (a later one may undo an earlier one), without --set/--sweep."""
    if case.not_utf8:
        return "not UTF-8"
    if case.raw is None or case.args:
        return ""
    for path in paths_in(case.raw):
        value = get_at(case.raw, path)
        if isinstance(value, Raw) and (value.startswith("[" * 33) or value.startswith("{a = " * 33)):
            return f"{dotted(path)} nested too deeply"
        if (isinstance(path[-1], str) and path[-1] in UNKNOWN_NAMES
                and not FREE_TABLES & {str(p) for p in path[:-1]}):
            return f"unknown key {dotted(path)}"
    sweep = case.raw.get("sweep", {})
    if not isinstance(sweep, dict) or any(isinstance(v, list) and not v for v in sweep.values()):
        return "a broken sweep"
    return ""


def allowed_heads(case: Case) -> set[str]:
    """First parts of the key paths an error line may start with."""
    import attrs

    from pfl_core.spec import Spec

    heads = {f.name for f in attrs.fields(Spec)} | {"--set", "--sweep", "sweep"}
    if case.raw is not None:
        heads |= {str(k) for k in case.raw}
    for option, value in zip(case.args, case.args[1:]):
        if option in ("--set", "--sweep"):
            try:
                heads.add(tomllib.loads(f"{value.split('=', 1)[0]} = 0").popitem()[0])  # TOML's key rules
            except tomllib.TOMLDecodeError:
                pass
    return heads


def judge(case: Case, spec_path: str, code: int | None, out: str, err: str) -> Outcome:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note: ")]
    if code == 0:
        if must_fail(case):
            return Outcome("accepted-bad", code, err, f"exit 0 for a spec that must fail ({must_fail(case)})")
        if lines:
            return Outcome("bad-line", code, err, "exit 0 but stderr has other lines than notes")
        return Outcome("ok", code, err)
    if code == 1 and "internal error" in err:
        return Outcome("internal", code, err, lines[-1] if lines else "")
    if code != 2:
        return Outcome("internal", code, err, f"exit code {code}")
    if len(lines) != 1:
        return Outcome("bad-line", code, err, f"{len(lines)} lines on stderr")
    line = lines[0]
    if not line.startswith(ERROR_PREFIX):
        return Outcome("bad-line", code, err, "does not start with 'pfl-run: error: '")
    leak = INTERNALS.search(line)
    if leak:
        return Outcome("bad-line", code, err, f"Python internals: {leak.group(0)!r}")
    message = line[len(ERROR_PREFIX):]
    quoted = re.match(r'"((?:[^"\\]|\\.)*)"', message)  # a key TOML must quote: "", " ", "a b"
    head = json.loads(quoted.group(0)) if quoted else re.split(r"[.\[:\s]", message, maxsplit=1)[0].strip("'")
    names_file = spec_path in message or Path(spec_path).name in message
    names_option = message.startswith(("--set", "--sweep", "argument"))
    if not (names_file or names_option or head in allowed_heads(case)):
        return Outcome("bad-line", code, err, "names no key path and not the spec file")
    return Outcome("refused", code, err)


def run_case(case: Case, workdir: Path, timeout: float | None = CASE_TIMEOUT_S) -> Outcome:
    """One case; ``timeout``: a case still running after it is a hang (the script's campaigns;
    the test suite passes None: no clock, a loaded machine only makes it slower)."""
    from pfl_core.cli import run_main

    spec_path = workdir / f"case{case.index}.toml"
    spec_path.write_bytes(case.content())
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    started = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    if timeout is not None:
        # The last resort for a hang the alarm cannot break (inside C code): stacks, then exit.
        faulthandler.dump_traceback_later(timeout * 4, exit=True)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        # Python warnings are recorded, not printed: a user sees each once, and the script lists them.
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                code = run_main([str(spec_path), *case.args, "--dry-run", "--quiet"])
            except SystemExit as exc:  # argparse's own usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        return Outcome("hang", None, err.getvalue(), f"over {timeout:.0f} s", time.perf_counter() - started)
    except BaseException as exc:  # noqa: BLE001 - anything that escaped the CLI is the finding
        return Outcome("escaped", None, err.getvalue(), f"{type(exc).__name__}: {str(exc)[:200]}",
                       time.perf_counter() - started)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
    outcome = judge(case, str(spec_path), code, out.getvalue(), err.getvalue())
    outcome.seconds = time.perf_counter() - started
    outcome.warnings = sorted({f"{w.category.__name__}: {w.message}"[:160] for w in caught})
    return outcome


def campaign(cases: int, seed: int, workdir: Path, only: int | None = None, report=None,
             timeout: float | None = CASE_TIMEOUT_S):
    """Run the cases; yields (case, outcome)."""
    seeds = seed_specs(workdir)
    SEEDS[:] = seeds
    indices = [only] if only is not None else range(cases)
    for index in indices:
        case = make_case(seeds, seed, index)
        yield case, run_case(case, workdir, timeout)


# ---------------------------------------------------------------------------
# The suite

def test_fuzzed_shipped_specs_end_in_exit_0_or_one_clean_line(tmp_path):
    failures = []
    counts: dict[str, int] = {}
    for case, outcome in campaign(SUITE_CASES, 0, tmp_path, timeout=None):
        counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
        if outcome.kind not in ("ok", "refused"):
            failures.append(describe(case, outcome))
    assert not failures, f"{len(failures)} of {SUITE_CASES} cases failed ({counts}):\n" + "\n".join(failures[:20])
    # The fuzzer reaches both ends: specs that build and specs that are refused (without the
    # shared data files only the synthetic quickstart can build).
    has_data = any("standin_" in str(raw["data"].get("params", {}).get("path", "")) for _, raw in SEEDS)
    assert counts.get("ok", 0) >= (5 if has_data else 0) and counts.get("refused", 0) >= SUITE_CASES // 2, counts


@pytest.mark.parametrize("behaviour, kind", [
    ("sleep", "hang"), ("KeyError", "internal"), ("two lines", "bad-line"), ("no key", "bad-line"),
    ("repr", "bad-line"), ("keyed", "refused"),
])
def test_the_judge_catches_each_kind_of_failure(tmp_path, monkeypatch, behaviour, kind):
    """The fuzzer's own checks: a run that hangs, raises, or prints a bad line is a failure."""
    from pfl_core.errors import PflError, SpecError
    import pfl_core.study as study

    def fake_run(*args, **kwargs):
        if behaviour == "sleep":
            time.sleep(30)
        if behaviour == "KeyError":
            raise KeyError("x")
        if behaviour == "two lines":
            print("warning: something", file=sys.stderr)
            raise SpecError("training.lr", "bad")
        if behaviour == "no key":
            raise PflError("something is wrong")
        if behaviour == "repr":
            raise SpecError("training.lr", "got <class 'float'>")
        raise SpecError("training.lr", "must be > 0")

    monkeypatch.setattr(study, "run_spec_file", fake_run)
    case = Case(0, "quickstart.toml", {"training": {"lr": 0.1}})
    assert run_case(case, tmp_path, timeout=0.5).kind == kind


def describe(case: Case, outcome: Outcome) -> str:
    err = " | ".join(line for line in outcome.stderr.splitlines()[-3:])[:400]
    return (f"case {case.index} [{outcome.seconds:.2f} s] ({case.spec}: {'; '.join(case.what)[:300]}): {outcome.kind} {outcome.detail}"
            f" -- stderr: {err}")


# ---------------------------------------------------------------------------
# As a script

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Fuzz pfl-run --dry-run with mutated shipped specs.")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, default=None, help="run only this case index (a replay)")
    parser.add_argument("--save", default=None, help="copy each failing case's spec and arguments here")
    parser.add_argument("--verbose", action="store_true", help="print every case")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    counts: dict[str, int] = {}
    warned: dict[str, list[int]] = {}
    slowest = (0.0, None)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case, outcome in campaign(args.cases, args.seed, Path(tmp), args.only):
            counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
            for text in outcome.warnings:
                warned.setdefault(text, []).append(case.index)
            slowest = max(slowest, (outcome.seconds, case.index), key=lambda s: s[0])
            failed = outcome.kind not in ("ok", "refused")
            if failed or args.verbose:
                print(describe(case, outcome), flush=True)
            if failed and args.save:
                target = Path(args.save)
                target.mkdir(parents=True, exist_ok=True)
                (target / f"case{case.index}.toml").write_bytes(case.content())
                (target / f"case{case.index}.args").write_text(json.dumps(case.args))
    total = sum(counts.values())
    for text, indices in sorted(warned.items(), key=lambda item: -len(item[1])):
        print(f"warning in {len(indices)} cases (e.g. case {indices[0]}): {text}")
    print(f"{total} cases (seed {args.seed}) in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; slowest case {slowest[1]} ({slowest[0]:.1f} s)")
    return 0 if total == counts.get("ok", 0) + counts.get("refused", 0) else 1


if __name__ == "__main__":
    sys.exit(main())
