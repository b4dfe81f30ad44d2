"""From a spec file to finished runs: overrides, sweep expansion, validation, tracking, output."""

from __future__ import annotations

import sys
from typing import Any

from .engine import Engine, Resolved, RunResult, resolve
from .errors import SpecError
from .spec import apply_overrides, expand_sweep, load_toml
from .tracking import make_tracker


def resolve_points(raw: dict, overrides: list[str]) -> list[tuple[dict[str, Any], Resolved]]:
    """Every run the spec describes (one, or one per sweep point), validated before any runs."""
    raw = apply_overrides(raw, overrides)
    points = []
    for settings, point in expand_sweep(raw):
        try:
            points.append((settings, resolve(point)))
        except SpecError as exc:
            if settings:  # say which sweep point broke
                where = ", ".join(f"{k}={v!r}" for k, v in settings.items())
                raise SpecError(exc.path, f"{exc.message} (sweep point {where})") from None
            raise
    return points


def run_name_for(resolved: Resolved, settings: dict[str, Any]) -> str:
    base = resolved.spec.tracking.run_name or resolved.spec.algorithm.name
    # A sweep over algorithm.name or over whole [algorithm] tables is named by the algorithm.
    extras = [f"{k.split('.')[-1]}={v}" for k, v in settings.items() if k not in ("algorithm.name", "algorithm")]
    return " ".join([base, *extras])


def run_spec_file(path: str, overrides: list[str], *, dry_run: bool = False, tracking_uri: str | None = None,
                  no_tracking: bool = False, quiet: bool = False, out=None) -> list[RunResult]:
    out = out or sys.stdout
    if no_tracking:
        overrides = [*overrides, "tracking.enabled=false"]
    points = resolve_points(load_toml(path), overrides)
    if dry_run:
        import torch

        from .context import ModelBank
        from .data.federated import build_federated_data

        for settings, resolved in points:
            if settings:
                print(f"# sweep point: {settings}", file=out)
            print(resolved.toml(), file=out)
            data = build_federated_data(resolved.spec)
            ModelBank(resolved.spec, data.input_shape, data.num_classes, torch.device("cpu")).check_builds()
            sizes = [c.num_train for c in data.clients]
            public = f", public set {len(data.public.indices)}" if data.public is not None else ""
            print(f"# ok: {len(data.clients)} clients, train sizes {min(sizes)}..{max(sizes)}, "
                  f"{data.num_classes} classes, input {tuple(data.input_shape)}{public}\n", file=out)
        return []

    results = []
    for settings, resolved in points:
        tracker = make_tracker(resolved.spec.tracking, tracking_uri)
        name = run_name_for(resolved, settings)
        result = Engine(resolved, tracker=tracker, progress=not quiet, run_name=name).run()
        results.append(result)
        print_client_table(result, name, out)
    if len(points) > 1:
        print_comparison([run_name_for(r, s) for s, r in points], results, out)
    return results


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:  # byte counts
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def print_table(header: list[str], rows: list[list], out) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def print_client_table(result: RunResult, name: str, out) -> None:
    rows = result.client_rows
    if not rows:
        return
    print(f"\n== {name}: per-client results (test split) ==", file=out)
    header = list(rows[0])
    print_table(header, [[r[k] for k in header] for r in rows], out)
    final = result.final
    summary = "  ".join(f"{k} {_fmt(final[k])}" for k in ("acc_mean", "acc_std", "acc_p10", "loss_mean") if k in final)
    comm = f"up {final.get('comm_up_bytes', 0) / 1e6:.2f} MB, down {final.get('comm_down_bytes', 0) / 1e6:.2f} MB"
    print(f"-- {summary}  ({comm})", file=out)
    coldstart = "  ".join(f"{k} {_fmt(final[k])}" for k in ("coldstart_acc_mean", "coldstart_acc_std") if k in final)
    if coldstart:
        print(f"-- cold-start clients: {coldstart}", file=out)
    if result.run_id:
        print(f"-- MLflow run {result.run_id}", file=out)


def print_comparison(names: list[str], results: list[RunResult], out) -> None:
    print("\n== comparison (same seed, same partition) ==", file=out)
    keys = ["acc_mean", "acc_std", "acc_p10", "loss_mean", "comm_up_bytes"]
    rows = [[name, *[r.final.get(k, float("nan")) for k in keys]] for name, r in zip(names, results)]
    print_table(["run", *keys], rows, out)
