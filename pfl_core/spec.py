"""The experiment spec: attrs classes structured from TOML with cattrs.

One TOML file is the whole experiment. Every section below is an attrs class; plugin
parameters (``algorithm.params``, ``addons[i].params``, ``data.params``, ``model.params``,
``partition.params``) are kept as raw tables here and structured into each plugin's own
attrs ``Params`` class by the registry, with the same strict converter, so a wrong key or
type is always reported with its full TOML key path.
"""

from __future__ import annotations

import collections
import copy
import datetime
import itertools
import json
import typing
import math
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import attrs
import cattrs
from attrs import define, field
from cattrs.cols import list_structure_factory
from cattrs.gen import make_dict_structure_fn
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)

from .errors import SpecError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


# ---------------------------------------------------------------------------
# Validators: they raise FieldError, which the structuring code turns into a SpecError
# carrying the full key path.


class FieldError(ValueError):
    def __init__(self, name: str, message: str):
        self.name = name
        self.message = message
        super().__init__(f"{name}: {message}")


def described(text: str):
    """Mark a validator with the constraint it enforces, in words (``"each >= 1"``): the
    ``constraint`` column of the generated parameter reference (``pfl docs``,
    :mod:`pfl_core.docgen`). Only sets the attribute ``describe``; the check is unchanged."""

    def mark(validator):
        validator.describe = text
        return validator

    return mark


def _check(predicate, description):
    @described(description)
    def validator(_instance, attribute, value):
        if value is not None and not predicate(value):
            raise FieldError(attribute.name, f"must be {description}, got {value!r}")

    return validator


def at_least(bound):
    return _check(lambda v: v >= bound, f">= {bound}")


def greater_than(bound):
    return _check(lambda v: v > bound, f"> {bound}")


def at_most(bound):
    return _check(lambda v: v <= bound, f"<= {bound}")


def between(low, high, *, low_open=False, high_open=False):
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")

    def ok(v):
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return _check(ok, f"in {lo}{low}, {high}{hi}")


@described("finite")
def finite(_instance, attribute, value):
    if value is not None and not math.isfinite(value):
        raise FieldError(attribute.name, f"must be a finite number, got {value!r}")


def choices_text(choices) -> str:
    """``"a"``, ``"a" or "b"``, ``"a", "b" or "c"`` (strings quoted as in TOML)."""
    words = [json.dumps(c) if isinstance(c, str) else repr(c) for c in choices]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def one_of(*choices):
    @described(choices_text(choices))
    def validator(_instance, attribute, value):
        if value not in choices:
            raise FieldError(
                attribute.name,
                f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
                + did_you_mean(value, choices),
            )

    return validator


# ---------------------------------------------------------------------------
# Limits (docs/spec-reference.md, "Limits"): what no experiment needs and what would exhaust
# memory or never finish is refused at its key before anything is allocated.

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # TOML's integers are 64-bit
MAX_CLIENTS = 1_000_000  # partition.num_clients
MAX_SWEEP_POINTS = 1000  # points of a sweep's cartesian product
MAX_NESTING = 32  # levels of arrays and tables in a value
MAX_SPEC_BYTES = 10 * 2**20  # a spec file


def describe_int(value: int) -> str:
    """An integer for a message: itself, or its number of digits when it is very long."""
    text = str(value)
    return text if len(text) <= 24 else f"a {len(text.lstrip('-'))}-digit number"


# ---------------------------------------------------------------------------
# Spec sections


@described("non-empty, distinct, each >= 0")
def _valid_seeds(_instance, attribute, value):
    if value is None:
        return
    if not value:
        raise FieldError(attribute.name, "must list at least one seed, e.g. [0, 1, 2]")
    negative = [s for s in value if s < 0]
    if negative:
        raise FieldError(attribute.name, f"seeds must be >= 0, got {negative[0]}")
    repeated = _repeated(value)
    if repeated:
        raise FieldError(attribute.name, f"lists seed {repeated[0]} more than once; each seed must be distinct")


def _repeated(values) -> list:
    """The values listed more than once, sorted (linear: 100000 seeds are not a hang)."""
    return sorted(v for v, n in collections.Counter(values).items() if n > 1)


def _distinct(what):
    @described("distinct")
    def validator(_instance, attribute, value):
        repeated = _repeated(value)
        if repeated:
            raise FieldError(attribute.name, f"lists {repeated[0]!r} more than once")

    return validator


@define
class ExperimentSection:
    name: str = "pfl"
    seed: int = field(default=0, validator=at_least(0))
    # Repeats: run the whole experiment once per seed (partition, initialisation, training),
    # report mean, std and 95% interval over them. Overrides `seed`.
    seeds: Optional[list[int]] = field(default=None, validator=_valid_seeds)
    # The run label every other sweep point is compared with (default: the first point).
    compare_to: str = ""
    # Reference baselines run once per spec on the identical partition and seeds as sibling
    # runs; every run then logs gain_vs_local and gain_vs_best_reference (does collaboration
    # help here?). E.g. ["local", "centralized"].
    reference: list[str] = field(factory=list, validator=_distinct("reference"))
    rounds: int = field(default=10, validator=at_least(1))
    # Fraction of clients sampled each round with the round's seeded RNG.
    participation: float = field(default=1.0, validator=between(0, 1, low_open=True))
    # Cold-start clients: held out of training entirely (seeded choice); after the last round
    # each personalises from the final federated state for coldstart_epochs local epochs and
    # is evaluated separately (coldstart_acc_mean ...): the participation gap.
    coldstart_clients: int = field(default=0, validator=at_least(0))
    coldstart_epochs: int = field(default=1, validator=at_least(0))
    description: str = ""


@define
class DataSection:
    name: str
    params: dict[str, Any] = field(factory=dict)
    # Pool the dataset's official test split with its training split before partitioning.
    include_test: bool = False
    # Use a seeded uniform subset of this many pool samples (quick experiments, tests).
    subsample: Optional[int] = field(default=None, validator=at_least(1))


@define
class PartitionSection:
    num_clients: int = field(validator=[at_least(1), at_most(MAX_CLIENTS)])
    scheme: str = "iid"
    params: dict[str, Any] = field(factory=dict)
    # Each client must receive at least this many samples (before its train/val/test split).
    min_samples: int = field(default=10, validator=at_least(1))
    val_fraction: float = field(default=0.1, validator=between(0, 1, high_open=True))
    test_fraction: float = field(default=0.2, validator=between(0, 1, low_open=True, high_open=True))

    def __attrs_post_init__(self):
        if self.val_fraction + self.test_fraction >= 1:
            raise FieldError(
                "test_fraction",
                f"val_fraction + test_fraction must be < 1, got "
                f"{self.val_fraction} + {self.test_fraction}",
            )


@define
class PublicSection:
    """The public unlabeled set U, carved from the training pool, disjoint from all clients."""

    size: Optional[int] = field(default=None, validator=at_least(1))
    fraction: Optional[float] = field(default=None, validator=between(0, 1, low_open=True, high_open=True))
    sampling: str = field(default="balanced", validator=one_of("balanced", "dirichlet"))
    alpha: float = field(default=1.0, validator=[finite, greater_than(0)])
    # Whether U's labels are available to plugins (FedMD's transfer-learning step needs them).
    labelled: bool = False

    def __attrs_post_init__(self):
        if (self.size is None) == (self.fraction is None):
            raise FieldError("size", "give exactly one of public.size or public.fraction")


@define
class ModelSection:
    name: str = "lenet5"
    params: dict[str, Any] = field(factory=dict)
    # Per-client architectures: an explicit list (one per client) or a pool assigned round-robin.
    clients: Optional[list[str]] = None
    pool: Optional[list[str]] = None
    # Parameters for architectures named in clients/pool other than `name`.
    arch_params: dict[str, dict[str, Any]] = field(factory=dict)

    def __attrs_post_init__(self):
        if self.clients is not None and self.pool is not None:
            raise FieldError("pool", "give model.clients or model.pool, not both")
        for key in ("clients", "pool"):
            if getattr(self, key) is not None and len(getattr(self, key)) == 0:
                raise FieldError(key, "must not be empty")


@define
class PluginRef:
    name: str
    params: dict[str, Any] = field(factory=dict)


@define
class TrainingSection:
    local_epochs: int = field(default=1, validator=at_least(0))
    batch_size: int = field(default=10, validator=at_least(1))
    optimizer: str = field(default="sgd", validator=one_of("sgd", "adam"))
    lr: float = field(default=0.01, validator=[finite, greater_than(0)])
    momentum: float = field(default=0.0, validator=between(0, 1, high_open=True))
    weight_decay: float = field(default=0.0, validator=[finite, at_least(0)])
    shuffle: bool = True
    # Skip each epoch's last partial batch (kept when it is a client's only batch). The papers
    # leave it open; on by default because a full-learning-rate step on a 1-2 sample
    # remainder cost small clients up to 7 points (docs/spec-reference.md).
    drop_last: bool = True
    # A client whose training loss or upload becomes NaN/inf: "stop" the run (one line naming
    # round, client and method) or "skip_client" (left out of this round's aggregate, its
    # state restored; skipped_clients is logged per round).
    on_nonfinite: str = field(default="stop", validator=one_of("stop", "skip_client"))


@define
class EvaluationSection:
    every: int = field(default=1, validator=at_least(1))
    batch_size: int = field(default=1024, validator=at_least(1))
    # Also score each client's personalized model on its validation split (val_acc_mean ...),
    # the split to tune hyperparameters on (never the test split).
    validation: bool = False


@define
class TrackingSection:
    enabled: bool = True
    # Empty: MLflow's own default (a SQLite file mlflow.db in the working directory).
    uri: str = ""
    # Empty: experiment.name.
    experiment: str = ""
    # Empty: "<algorithm>" (plus the sweep values for a sweep).
    run_name: str = ""
    tags: dict[str, str] = field(factory=dict)
    progress: bool = True


@define
class ExecutorSection:
    # "auto": a process pool on a multi-core CPU when a round has enough work to share, else
    # sequential (pfl_core/executors.py: plan). Every executor gives bit-identical results,
    # except "batched" (one architecture's clients trained together with torch.func.vmap,
    # pfl_core/batched.py), equal to them up to float rounding where it trains clients together.
    name: str = field(default="auto", validator=one_of("auto", "sequential", "process", "ray", "batched"))
    device: str = field(default="cpu", validator=one_of("cpu", "cuda", "auto"))
    # torch intra-op threads per process; 0 = 1 (more threads per process oversubscribe the
    # cores of a shared or parallel machine).
    threads: int = field(default=0, validator=at_least(0))
    # worker processes (process executor); left out: one per available core.
    workers: Optional[int] = field(default=None, validator=at_least(1))
    # times a client whose worker process died is run again before the run stops
    retries: int = field(default=1, validator=at_least(0))
    # ray executor: "" starts Ray on this machine; "auto" joins the cluster this machine is part
    # of (ray start); "host:6379" or "ray://host:10001" an existing cluster (docs/architecture.md).
    address: str = ""


@define
class CheckpointSection:
    enabled: bool = True
    # Rounds between checkpoints; 0: automatic, the shortest period whose writes cost under 5%
    # of the run time (measured: the last write's time against the mean round time).
    every: int = field(default=0, validator=at_least(0))
    # Folder under which each run gets its own folder (named by its MLflow run id); empty:
    # ``checkpoints/`` beside the SQLite tracking store (the working directory for a server).
    # Without tracking and without a folder, nothing is checkpointed.
    dir: str = ""
    # How many checkpoints each run keeps (the older ones are deleted).
    keep: int = field(default=2, validator=at_least(1))


@define
class StateSection:
    # Client states kept in memory (the least recently used others are spilled to disk as
    # safetensors files, pfl_core/store.py); 0: automatic, at most 256 states and 256 MiB of
    # their tensors. Results do not depend on it.
    cache_clients: int = field(default=0, validator=at_least(0))
    # Folder in which the run's spill folder is made (and removed at the end of the run);
    # empty: the system's temporary folder.
    spill_dir: str = ""


@define
class Spec:
    data: DataSection
    partition: PartitionSection
    algorithm: PluginRef
    experiment: ExperimentSection = field(factory=ExperimentSection)
    model: ModelSection = field(factory=ModelSection)
    public: Optional[PublicSection] = None
    addons: list[PluginRef] = field(factory=list)
    training: TrainingSection = field(factory=TrainingSection)
    evaluation: EvaluationSection = field(factory=EvaluationSection)
    tracking: TrackingSection = field(factory=TrackingSection)
    executor: ExecutorSection = field(factory=ExecutorSection)
    # dotted key -> list of values; the cartesian product runs as separate runs.
    sweep: dict[str, list[Any]] = field(factory=dict)
    # Computed by resolve() (declared local work, pfl_core/budget.py); a value given here is
    # replaced, so a resolved spec can be run again as it is.
    budget: dict[str, Any] = field(factory=dict)
    checkpoint: CheckpointSection = field(factory=CheckpointSection)
    state: StateSection = field(factory=StateSection)

    def __attrs_post_init__(self):
        if self.experiment.coldstart_clients >= self.partition.num_clients:
            raise FieldError(
                "experiment.coldstart_clients",
                f"{self.experiment.coldstart_clients} cold-start clients leave no client to train "
                f"(partition.num_clients = {self.partition.num_clients})",
            )
        archs = sorted(set(self.model.clients or self.model.pool or [self.model.name]))
        if self.executor.name == "batched" and len(archs) > 1:
            raise FieldError("executor.name", f"'batched' trains clients of one architecture together, but "
                                              f"{'model.clients' if self.model.clients else 'model.pool'} gives "
                                              f"{len(archs)} ({', '.join(archs)}); use 'sequential' or 'process'")


# ---------------------------------------------------------------------------
# Strict structuring: TOML values are never coerced ("3" is not an int, "false" not a bool).


def _type_name(value) -> str:
    return type(value).__name__


def shown(value: Any, width: int = 60) -> str:
    """A spec value as an error message shows it, cut to ``width`` characters: Python's repr,
    except that TOML dates and times are spelled as in TOML (never ``datetime.date(...)``)."""

    def text(v):
        if isinstance(v, (datetime.date, datetime.time)):  # datetime.datetime is a date
            return v.isoformat()
        if isinstance(v, list):
            return "[" + ", ".join(map(text, v)) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {text(x)}" for k, x in v.items()) + "}"
        return repr(v)

    out = text(value)
    return out if len(out) <= width else out[: width - 3] + "..."


def _strict(kind, accept, description):
    def structure(value, _type):
        if not accept(value):
            raise TypeError(f"expected {description}, got {shown(value)} ({_type_name(value)})")
        return kind(value)

    return structure


def _in_toml_range(value):
    """TOML integers are 64-bit; Python's reader accepts any length (a 400-digit epoch count
    overflowed later, deep in the run)."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise TypeError(f"expected a 64-bit integer (TOML's range, -2**63 to 2**63 - 1), got {describe_int(value)}")
    return value


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    not_bool = lambda v: not isinstance(v, bool)  # noqa: E731
    is_int = _strict(int, lambda v: isinstance(v, int) and not_bool(v), "an integer")
    is_number = _strict(float, lambda v: isinstance(v, (int, float)) and not_bool(v), "a number")
    conv.register_structure_hook(int, lambda v, t: is_int(_in_toml_range(v), t))
    # + 0.0: -0.0 passes ">= 0" yet numpy refuses it as a scale ("scale < 0")
    conv.register_structure_hook(float, lambda v, t: is_number(_in_toml_range(v), t) + 0.0)
    conv.register_structure_hook(str, _strict(str, lambda v: isinstance(v, str), "a string"))
    conv.register_structure_hook(bool, _strict(bool, lambda v: isinstance(v, bool), "true or false"))
    conv.register_structure_hook(Any, lambda v, _t: v)
    def list_hook_factory(type_):
        items = list_structure_factory(type_, conv)  # cattrs' own: item errors keep their index

        def structure_list(value, _type):
            if not isinstance(value, list):  # a string or table is not iterated item by item
                raise TypeError(f"expected a list, got {shown(value)} ({_type_name(value)})")
            return items(value, _type)

        return structure_list

    conv.register_structure_hook_factory(lambda t: typing.get_origin(t) is list, list_hook_factory)

    def table_hook_factory(cls):
        fields = make_dict_structure_fn(cls, conv)

        def structure_table(value, _type):
            if not isinstance(value, dict):  # else cattrs' "'int' object has no attribute 'keys'"
                raise TypeError(f"expected a table, got {shown(value)} ({_type_name(value)})")
            return fields(value, _type)

        return structure_table

    conv.register_structure_hook_factory(attrs.has, table_hook_factory)
    return conv


converter = make_converter()


# Keys renamed for one vocabulary across the methods (issue 13; docs/writing-a-plugin.md, "Naming
# parameters"): old key -> (new key, how to translate). A spec that still uses the old key gets
# ``<path>.<old>: renamed to <new> (<how>)`` wherever the table it is in has the new key; there
# is no silent alias. Data only: a plugin that renames a parameter adds a row here.
RENAMED_KEYS: dict[str, tuple[str, str]] = {
    "split": ("head_layers", "the number of parameterised layers, counted from the output, that form "
                             "the head: split = -j is head_layers = j, split = k is head_layers = L - k; "
                             "none is still the middle"),
    "fixed_lambda": ("lam", "lambda is spelled lam in every plugin; same meaning and default"),
}


def _renamed(extra: str, known: list[str]) -> str | None:
    new, how = RENAMED_KEYS.get(extra, (None, ""))
    return f"renamed to {new} ({how})" if new in known else None


def _first_error(exc: BaseException, path: list[str]) -> tuple[list[str], str]:
    """Walk cattrs' exception groups down to the first leaf: (key path, message)."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            sub_path = list(path)
            for note in getattr(sub, "__notes__", []):
                if hasattr(note, "name"):
                    sub_path.append(str(note.name))
                elif hasattr(note, "index"):
                    sub_path.append(f"[{note.index}]")
            return _first_error(sub, sub_path)
        return path, str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [a.name for a in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        extra = sorted(exc.extra_fields)[0]
        renamed = _renamed(extra, known)
        if renamed:
            return path + [extra], renamed
        hint = did_you_mean(extra, known)
        valid = f"valid keys here: {', '.join(known)}" if known else "this table takes no keys"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", extra):  # spelled as in TOML: "", " ", "a.b"
            extra = json.dumps(extra, ensure_ascii=False)
        return path + [extra], f"unknown key{hint}; {valid}"
    if isinstance(exc, FieldError):
        return path + [exc.name], exc.message
    if isinstance(exc, KeyError):
        key = str(exc.args[0])
        return (path if path[-1:] == [key] else path + [key]), "required key is missing"
    if isinstance(exc, AttributeError) and exc.name == "items":  # a mapping field given a scalar or list
        return path, f"expected a table, got {shown(exc.obj)}"
    return path, str(exc)


def join_path(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if part.startswith("["):
            out += part
        else:
            out += ("." if out else "") + part
    return out


def structure(data: Any, cls: type, path: str = ""):
    """Structure ``data`` into ``cls``; any problem becomes a SpecError naming the key path."""
    prefix = [path] if path else []
    if not isinstance(data, dict) and attrs.has(cls):
        raise SpecError(path, f"expected a table, got {shown(data)} ({_type_name(data)})")
    try:
        return converter.structure(data, cls)
    except SpecError:
        raise
    except Exception as exc:  # cattrs raises exception groups; reduce to one line
        parts, message = _first_error(exc, prefix)
        raise SpecError(join_path(parts), message) from None


def unstructure(obj) -> Any:
    return converter.unstructure(obj)


# ---------------------------------------------------------------------------
# Loading, overrides and sweeps


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise SpecError("", f"cannot read spec file {path}: {exc.strerror or exc}") from None
    if not exists:
        raise SpecError("", f"spec file not found: {path}")
    if is_dir:
        raise SpecError("", f"spec path {path} is a directory, not a TOML file")
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)  # never all of /dev/zero
    except OSError as exc:
        raise SpecError("", f"cannot read spec file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("", f"spec file {path} is larger than {MAX_SPEC_BYTES // 2**20} MiB; is it a spec?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError("", f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                            "TOML files are UTF-8: save it as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("", f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise _too_deep_to_read(sys.exc_info()[2], f"in {path}") from None
    check_nesting(raw)
    return raw


def dump_toml(data: dict) -> str:
    """TOML text for a spec dict (tomli-w), read back by :func:`load_toml` as the same dict.
    Keys whose value is None are left out: TOML has no null, and a missing key takes its
    default, which is what None stands for in a resolved spec."""
    import tomli_w

    def without_none(value):
        if isinstance(value, dict):
            return {k: without_none(v) for k, v in value.items() if v is not None}
        if isinstance(value, (list, tuple)):
            return [without_none(v) for v in value]
        return value

    return tomli_w.dumps(without_none(data))


def _too_deep_to_read(tb, where: str) -> SpecError:
    """The TOML reader recursed out of stack on a deeply nested value: name the key it was
    reading (the outermost key-value pair on the stack of ``tomllib``'s own parser) where
    the stack shows it, else just say so."""
    header, key = (), ()
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "key_value_rule" and not header:
            header = tuple(frame.f_locals.get("header") or ())
        if frame.f_code.co_name == "parse_key_value_pair" and not key:
            key = tuple(frame.f_locals.get("key") or ())
        tb = tb.tb_next
    path = ".".join(str(part) for part in header + key) if key else ""
    return SpecError(path, f"a value {where} is nested too deeply to read; arrays and tables in a spec may "
                           f"nest at most {MAX_NESTING} levels")


def check_nesting(value: Any, path: str = "") -> None:
    """Refuse arrays and tables nested more than MAX_NESTING levels (counted from the top of
    the spec, or of a --set value), naming the key the deep value is under. Iterative: the
    check itself never runs out of stack, and later steps (copies, output) then cannot."""
    stack = [(value, [path] if path else [], 0)]
    while stack:
        node, parts, depth = stack.pop()
        if depth > MAX_NESTING:
            keys = list(itertools.takewhile(lambda p: not p.startswith("["), parts))[:4]
            raise SpecError(join_path(keys), f"is nested more than {MAX_NESTING} levels deep; arrays and "
                                             f"tables in a spec may nest at most {MAX_NESTING} levels")
        if isinstance(node, dict):
            stack.extend((v, parts + [str(k)], depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, parts + [f"[{i}]"], depth + 1) for i, v in enumerate(node))


def parse_value(text: str, key: str = "--set") -> Any:
    """A --set value: TOML syntax (3, 0.1, true, "x", [1, 2]); a bare word is a string.
    ``key`` is the option's dotted key, named when the value is nested too deeply."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise SpecError(key, f"the value is nested too deeply to read; arrays and tables in a spec may nest at "
                             f"most {MAX_NESTING} levels") from None
    check_nesting(value, key)
    return value


def split_key(dotted: str) -> list[str]:
    """``a.b."c.d"`` -> ["a", "b", "c.d"]: TOML's own dotted-key rules, so a quoted part (a
    sweep axis named by a dotted key) stays one part."""
    try:
        node = tomllib.loads(f"{dotted} = 0")
    except tomllib.TOMLDecodeError:
        raise SpecError("--set", f"{dotted!r} is not a dotted key (quote parts that contain dots: "
                                 f'sweep."training.lr")') from None
    parts = []
    while isinstance(node, dict):
        (key, node), = node.items()
        parts.append(key)
    return parts


def set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict; list items are addressed as ``addons.0.params.x``."""
    parts = split_key(dotted)
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(".".join(parts[: i + 1]), f"no list item {part}")
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            if parts[i + 1].isdigit():
                raise SpecError(".".join(parts[: i + 1]), f"has no list item {parts[i + 1]} to set")
            node[part] = {}
        elif not isinstance(node[part], (dict, list)):
            raise SpecError(".".join(parts[: i + 1]), "is a value, not a table")
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise SpecError(dotted, f"no list item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def _split_override(item: str, option: str) -> tuple[str, str]:
    if "=" not in item:
        raise SpecError(option, f"expected dotted.key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise SpecError(option, f"empty key in {item!r}")
    return key, text.strip()


def swept_axes_replaced(sweep: dict, key: str) -> list[str]:
    """The sweep axes a ``--set key=...`` decides: the same key, a key inside it, or the
    table it is inside (``algorithm.name`` decides the axis ``algorithm``)."""
    return [axis for axis in sweep if axis == key or axis.startswith(key + ".") or key.startswith(axis + ".")]


def apply_overrides(raw: dict, overrides: list[str], sweeps: list[str] = (), no_sweep: bool = False,
                    notes: list[str] | None = None) -> dict:
    """Apply ``--set`` overrides, then ``--sweep`` axes (``key=v1,v2`` or ``key=[v1, v2]``);
    ``no_sweep`` drops the spec's sweep. A ``--set`` on a key the spec sweeps replaces that axis
    with the single value, and says so in ``notes``."""
    raw = copy.deepcopy(raw)
    if no_sweep:
        raw.pop("sweep", None)
    for item in overrides:
        key, text = _split_override(item, "--set")
        sweep = raw.get("sweep")
        if isinstance(sweep, dict) and split_key(key)[0] != "sweep":
            for axis in swept_axes_replaced(sweep, key):
                sweep.pop(axis)
                if notes is not None:
                    notes.append(f"--set {key} replaces the spec's sweep over {axis}")
        set_dotted(raw, key, parse_value(text, key))
    for item in sweeps:
        key, text = _split_override(item, "--sweep")
        value = parse_value(text, key)
        if not isinstance(value, list):
            value = [parse_value(v.strip(), key) for v in text.split(",")]
        if not value or any(v == "" for v in value):
            raise SpecError(f"--sweep {key}", f"expected key=v1,v2,... or key=[v1, v2], got {item!r}")
        sweep = raw.setdefault("sweep", {})
        if not isinstance(sweep, dict):
            raise SpecError("sweep", "expected a table of dotted.key = [values]")
        sweep[key] = value
    return raw


def expand_sweep(raw: dict) -> list[tuple[dict[str, Any], dict]]:
    """The raw spec for each point of the sweep's cartesian product, with its settings."""
    sweep = raw.get("sweep", {})
    if not isinstance(sweep, dict):  # `sweep = []` is not "no sweep"
        raise SpecError("sweep", f"expected a table of dotted.key = [values], got {_type_name(sweep)} {shown(sweep)}")
    for key, values in sweep.items():
        if isinstance(values, dict):
            raise SpecError(f"sweep.{key}", "a sweep axis is one quoted dotted key with a list of values, e.g. "
                                            f'sweep."{key}.x" = [1, 2] in TOML, or --sweep {key}.x=1,2')
        if not isinstance(values, list) or not values:
            raise SpecError(f"sweep.{key}", "expected a non-empty list of values")
    for i, entry in enumerate(sweep.get(POINTS, [])):
        if not isinstance(entry, dict) or not entry:
            raise SpecError(f"sweep.{POINTS}[{i}]", "expected a table of dotted.key = value overrides, e.g. "
                                                    '{ algorithm = { name = "local" }, "training.local_epochs" = 3 }')
        for key in entry:
            _check_swept_key(key, f"sweep.{POINTS}[{i}].{key}")
    for key in sweep:
        if key != POINTS:
            _check_swept_key(key, f"sweep.{key}")
    sizes = [len(values) for values in sweep.values()]
    if math.prod(sizes) > MAX_SWEEP_POINTS:
        raise SpecError("sweep", f"expands to {math.prod(sizes)} points ({' x '.join(map(str, sizes))} values), "
                                 f"above the limit of {MAX_SWEEP_POINTS} sweep points; split it over several specs or "
                                 "narrow it with --set/--sweep")
    base = {k: v for k, v in raw.items() if k != "sweep"}
    keys = list(sweep)
    points = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        point = copy.deepcopy(base)
        settings = dict(zip(keys, combo))
        for key, value in settings.items():
            for dotted, item in (value.items() if key == POINTS else [(key, value)]):
                set_dotted(point, dotted, item)
        points.append((settings, point))
    return points


def _check_swept_key(key: str, path: str) -> None:
    """A swept key must lead into a section of the spec; else the points' own errors would name
    a key (``nonsense: unknown key``) that is nowhere in the file."""
    try:
        section = split_key(key)[0]
    except SpecError:
        raise SpecError(path, f"{key!r} is not a dotted key into the spec, e.g. \"training.lr\"") from None
    sections = [f.name for f in attrs.fields(Spec) if f.name not in ("sweep", "budget")]
    if section not in sections:
        raise SpecError(path, f"sets '{section}', which is not a section of the spec"
                              f"{did_you_mean(section, sections)}; sections: {', '.join(sections)}")


# A sweep axis whose values are whole sets of overrides applied together (zipped, not
# crossed): one method with its own budget settings per entry.
POINTS = "points"
