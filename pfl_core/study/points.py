"""Planning a study: the points of a spec (one, or one per sweep point) validated before any
run, their run names, the reference runs they share, and what the study's parent run records."""

from __future__ import annotations

import copy
import math
from typing import Any

import attrs
import torch

from pfl_core import registry
from pfl_core.data.federated import build_federated_data
from pfl_core.engine import Resolved, RunResult, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.context import ModelBank
from pfl_core.spec import POINTS, PluginRef, apply_overrides, expand_sweep, set_dotted, shown, structure
from pfl_core.study.stats import Summary
from pfl_core.tracking.tracker import flatten


@attrs.define
class Point:
    """One sweep point: its settings, the validated spec, and the seeds it runs with."""

    settings: dict[str, Any]
    resolved: Resolved
    raw: dict
    base: dict | None = None  # the spec before its sweep settings (--set applied): references start here

    @property
    def seeds(self) -> list[int] | None:
        """The repeat seeds (``experiment.seeds``), or None for one plain run."""
        return self.resolved.spec.experiment.seeds

    def for_seed(self, seed: int) -> Resolved:
        raw = copy.deepcopy(self.raw)
        experiment = raw.setdefault("experiment", {})
        experiment["seed"] = seed
        experiment.pop("seeds", None)
        return resolve(raw)


@attrs.define
class PointResult:
    """A point's runs: one per seed (or the single run), and the mean over them."""

    name: str
    seeds: list[int]
    runs: list[RunResult]
    summary: dict[str, Summary]
    run_id: str | None = None
    resolved_algorithm: str = ""
    group: str = ""  # the non-algorithm sweep settings it shares with its references
    seeded: bool = False  # experiment.seeds: one child run per seed

    def values(self, metric: str) -> list[float]:
        return [r.final.get(metric, math.nan) for r in self.runs]


def resolve_points(raw: dict, overrides: list[str], sweeps: list[str] = (), no_sweep: bool = False,
                   notes: list[str] | None = None) -> list[Point]:
    """Every run the spec describes (one, or one per sweep point), validated before any runs."""
    raw = apply_overrides(raw, overrides, sweeps, no_sweep, notes)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    expanded = expand_sweep(raw)  # validates the [sweep] table's shape
    if _sweeps_algorithm(raw.get("sweep", {})):
        try:
            check_base_algorithm(base)
        except SpecError as exc:
            raise SpecError(exc.path, exc.message + per_method_hint(raw, exc)) from None
    points = []
    for settings, point in expanded:
        try:
            points.append(Point(settings, resolve(point), point, base))
        except SpecError as exc:
            if settings and point_is_to_blame(exc, settings, base):  # say which sweep point broke
                where = ", ".join(f"{k}={shown(v)}" for k, v in settings.items())
                raise SpecError(exc.path, f"{exc.message} (sweep point {where}){per_method_hint(raw, exc)}") from None
            raise
    return points


PLUGIN_SELECTORS = ("name", "scheme")  # the key that picks a table's plugin, which decides its params


def point_is_to_blame(exc: SpecError, settings: dict[str, Any], base: dict) -> bool:
    """Whether a sweep point's error comes from the point: the failing key is one the point sets
    (or lies in a table it sets, or in the params of the plugin it picks), or the spec's own
    tables, without the sweep, validate (the point's value broke a rule between two keys). A
    typo or a wrong type in the spec's own tables is the spec's, not the point's."""
    if any(_sets_key(key, exc.path) for key in swept_keys(settings)):
        return True
    try:
        resolve(base)
    except SpecError:
        return False
    return True


def swept_keys(settings: dict[str, Any]) -> list[str]:
    """The dotted keys a point sets (a ``sweep.points`` entry's own keys)."""
    return [k for key, value in settings.items() for k in (value if key == POINTS else [key])]


def _sets_key(key: str, path: str) -> bool:
    """Whether setting ``key`` decides the value at the error's ``path``."""
    within = lambda inner, outer: inner == outer or inner.startswith((outer + ".", outer + "["))  # noqa: E731
    if within(path, key) or within(key, path):
        return True
    table, _, last = key.rpartition(".")
    return bool(table) and last in PLUGIN_SELECTORS and within(path, f"{table}.params")


def per_method_hint(raw: dict, exc: SpecError) -> str:
    """For a parameter one swept method lacks: the two ways to give each method its own
    parameters, written with the spec's own methods and the key that failed."""
    names = raw.get("sweep", {}).get("algorithm.name")
    if not (isinstance(names, list) and len(names) > 1 and exc.path.startswith("algorithm.params.")
            and "unknown key" in exc.message):
        return ""
    key = exc.path.removeprefix("algorithm.params.").split(".")[0]
    swept = raw["sweep"].get(f"algorithm.params.{key}")
    value = swept[0] if isinstance(swept, list) and swept else raw.get("algorithm", {}).get("params", {}).get(key, 0)
    for name in names:  # the method that has the key
        try:
            registry.instantiate(registry.ALGORITHM, str(name), {key: value}, "algorithm.name", "algorithm.params")
        except Exception:  # noqa: BLE001 - any refusal: not this one
            continue
        owner, others = str(name), [str(n) for n in names if n != name]
        break
    else:
        owner, others = "METHOD", [str(n) for n in names]
    own = f'{{ name = "{owner}", params = {{ {key} = {shown(value)} }} }}'
    rest = ", ".join(f'{{ name = "{n}" }}' for n in others)
    return (f"; parameters are not per method in a sweep over algorithm.name: sweep whole tables, "
            f"[sweep] algorithm = [{own}, {rest}], or use points = [{{ algorithm = {own} }}, "
            f"{', '.join(f'{{ algorithm = {{ name = {chr(34)}{n}{chr(34)} }} }}' for n in others)}] "
            f"(docs/spec-reference.md, Sweeps)")


def _sweeps_algorithm(sweep: dict) -> bool:
    """Whether the sweep sets the algorithm (its name, its whole table or its params), so the
    points alone never validate the spec's own [algorithm] table."""
    keys = [k for k in sweep if k != POINTS] + [k for entry in sweep.get(POINTS, []) for k in entry]
    return any(k == "algorithm" or k.startswith("algorithm.") for k in keys)


def check_base_algorithm(base: dict) -> None:
    """The spec's own [algorithm] table is what --no-sweep (and --set on the swept key) runs:
    a sweep over the algorithm must not hide a typo or a bad name in it."""

    table = base.get("algorithm")
    if table is None:
        return
    note = " (in the spec's own [algorithm] table, which the sweep replaces)"
    try:
        if not isinstance(table, dict) or "name" in table:
            ref = structure(table, PluginRef, "algorithm")
            registry.instantiate(registry.ALGORITHM, ref.name, ref.params, "algorithm.name", "algorithm.params")
        else:  # the sweep gives every point its name: check the table's keys and types only
            structure({"name": "", **table}, PluginRef, "algorithm")
    except SpecError as exc:
        raise SpecError(exc.path, exc.message + note) from None


def run_name_for(resolved: Resolved, settings: dict[str, Any]) -> str:
    base = resolved.spec.tracking.run_name or resolved.spec.algorithm.name
    flat = {}
    for key, value in settings.items():  # a sweep.points entry names its own overrides
        flat.update(value if key == POINTS else {key: value})
    # A sweep over algorithm.name or over whole [algorithm] tables is named by the algorithm.
    extras = [f"{k.split('.')[-1]}={v}" for k, v in flat.items() if k not in ("algorithm.name", "algorithm")]
    return " ".join([base, *extras])


def run_names(points: list[Point]) -> list[str]:
    """Each point's run name; points that would share one (two [algorithm] tables of the same
    method in a sweep) are told apart by the algorithm parameters whose values differ."""
    names = [run_name_for(p.resolved, p.settings) for p in points]
    for name in set(names):
        same = [i for i, n in enumerate(names) if n == name]
        if len(same) < 2:
            continue
        params = [flatten(points[i].resolved.as_dict.get("algorithm", {}).get("params", {})) for i in same]
        differing = [k for k in dict.fromkeys(k for p in params for k in p) if len({p.get(k) for p in params}) > 1]
        for i, p in zip(same, params):
            names[i] = " ".join([name, *[f"{k.split('.')[-1]}={p.get(k)}" for k in differing]])
    return names


ALGORITHM_KEYS = ("algorithm", "algorithm.name")


def _is_algorithm_key(key: str) -> bool:
    """Settings that vary the method (not the data): reference runs are shared across them.
    A ``sweep.points`` entry is a method with its own budget settings."""
    return key in ALGORITHM_KEYS or key.startswith("algorithm.") or key == POINTS


def reference_points(points: list[Point]) -> list[tuple[str, Point]]:
    """``experiment.reference`` baselines: once per spec (once per group of sweep points that
    share everything but the algorithm), on the identical data and seeds."""
    experiment = points[0].resolved.spec.experiment
    if not experiment.reference:
        return []

    for i, name in enumerate(experiment.reference):
        registry.resolve(registry.ALGORITHM, name, f"experiment.reference[{i}]")
    out, seen = [], set()
    for point in points:
        shared = {k: v for k, v in point.settings.items() if not _is_algorithm_key(k)}
        group = repr(sorted(shared.items()))
        if group in seen:
            continue
        seen.add(group)
        for name in experiment.reference:
            # the spec's own settings and this group's data settings, never a sweep point's
            # method-specific overrides (a FedAlt entry's local_epochs is not Local's budget)
            raw = copy.deepcopy(point.base if point.base is not None else point.raw)
            for key, value in shared.items():
                set_dotted(raw, key, value)
            raw["algorithm"] = {"name": name}
            try:
                ref = Point(shared, resolve(raw), raw)
            except SpecError as exc:
                raise SpecError(exc.path, f"{exc.message} (in the reference run {name!r}, experiment.reference)") from None
            label = " ".join([f"{name} (reference)", *[f"{k.split('.')[-1]}={v}" for k, v in shared.items()]])
            out.append((label, ref))
    return out


def same_run(a: Point, b: Point) -> bool:
    """Two points that would produce the same runs (so a reference is not run twice)."""
    strip = lambda d: {k: v for k, v in d.items() if k != "tracking"}  # noqa: E731
    return strip(a.resolved.as_dict) == strip(b.resolved.as_dict)


def check_compare_to(points: list[Point], names: list[str]) -> None:
    wanted = points[0].resolved.spec.experiment.compare_to
    if wanted and wanted not in names:
        raise SpecError("experiment.compare_to", f"names no run of this spec: {wanted!r}; runs: {', '.join(names)}")


def study_params(points: list[Point]) -> tuple[str, dict[str, str], dict[str, str]]:
    """The study parent run's experiment, params (what every sweep point shares) and tags."""
    spec = points[0].resolved.spec
    flat = [flatten(p.resolved.as_dict) for p in points]
    shared = {k: v for k, v in flat[0].items() if all(f.get(k) == v for f in flat[1:])}
    swept = list(dict.fromkeys(k for p in points for k in p.settings))
    tags = {"pfl.sweep": ", ".join(swept)} if swept else {}
    return spec.tracking_experiment, shared, {**tags, **spec.tracking.tags}


def server_archs(point: Point) -> dict[str, str]:
    """The server models a point's method (and add-ons) build beyond the clients': architecture
    -> the spec key naming it (:meth:`pfl_core.registry.Plugin.server_archs`)."""
    spec = point.resolved.spec
    return {arch: path for plugin in point.resolved.plugins for arch, path in plugin.server_archs(spec).items()}


def first_seed_spec(point: Point):
    """The spec of the point's first run (its first seed's)."""
    return point.for_seed(point.seeds[0]).spec if point.seeds else point.resolved.spec


def point_builds(point: Point):
    """Build what a point's run would build first: its data partition (of its first seed),
    every client's model and its method's server models (on the CPU); raises the SpecError or
    DataError the run would. Returns the federated data."""
    data = build_federated_data(first_seed_spec(point))
    ModelBank(point.resolved.spec, data.input_shape, data.num_classes, torch.device("cpu")).check_builds(
        server_archs(point))
    return data


def build_key(point: Point) -> str:
    """What :func:`point_builds` depends on: points with the same key (a sweep of the learning
    rate) build the same data and models, so each is built once."""
    shared = {key: point.resolved.as_dict.get(key) for key in ("data", "partition", "public", "model")}
    shared["seed"] = point.seeds[0] if point.seeds else point.resolved.spec.experiment.seed
    shared["server models"] = server_archs(point)
    return repr(shared)


def check_every_point_builds(points: list[Point], runs_first: Point | None = None):
    """Before the first run trains: every point's data and models build, so a bad value in the
    last sweep point is said now, not after the others trained. Points that share their data,
    partition, seeds and models are built once. Returns the data built for ``runs_first`` (the
    point whose run starts first), for that run to take (``data.cache.hand_over``), else None."""
    seen = set()
    first = None
    for point in points:
        key = build_key(point)
        if key not in seen:
            seen.add(key)
            data = point_builds(point)
            if runs_first is not None and key == build_key(runs_first):
                first = data
    return first
