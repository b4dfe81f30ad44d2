"""What a study prints: each run's line, a point's summary over seeds, the per-client table,
the comparison table with paired differences, the dry run's report and where the results are."""

from __future__ import annotations

import math

from pfl_core.engine import RunResult
from pfl_core.study.compare import COMPARED, GAINS, comparisons, family_note
from pfl_core.study.points import Point, PointResult, build_key, point_builds
from pfl_core.study.stats import Summary
from pfl_core.tracking.terminal import experiment_location, human_bytes, human_seconds, warning_line
from pfl_core.tracking.tracker import current_study


def print_locations(point: Point, out_dir: str | None, out) -> None:
    """Where the results are: the tracking URI, the experiment, the MLflow UI address of its
    runs, and the --out directory."""

    lines = []
    try:
        study = current_study()
        where = experiment_location(point.resolved.spec, study.id if study is not None else None)
    except Exception:  # a store that cannot be read back: the runs were logged; say nothing wrong
        where = None
    if where:
        lines.append(where)
    if out_dir is not None:
        lines.append(f"results: {out_dir}/ (comparison.csv, differences.csv, runs/<run>/clients*.csv, spec.toml)")
    if lines:
        print("\n" + "\n".join(lines), file=out)


def dry_run_report(points: list[Point], out) -> None:
    built: dict[str, str] = {}  # build_key -> its "# ok" line: points sharing data and models build once
    for point in points:
        if point.settings:
            print(f"# sweep point: {point.settings}", file=out)
        print(point.resolved.toml(), file=out)
        if point.seeds:
            print(f"# seeds: {', '.join(map(str, point.seeds))} ({len(point.seeds)} runs of this point, "
                  f"each with its own partition and initialisation)", file=out)
        key = build_key(point)
        if key not in built:
            data = point_builds(point)
            sizes = [c.num_train for c in data.clients]
            public = f", public set {len(data.public.indices)}" if data.public is not None else ""
            built[key] = (f"# ok: {len(data.clients)} clients, train sizes {min(sizes)}..{max(sizes)}, "
                          f"{data.num_classes} classes, input {tuple(data.input_shape)}{public}")
        print(built[key] + "\n", file=out)


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:  # byte counts
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _pm(s: Summary, digits: int = 4) -> str:
    if s.n < 2:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f} ± {s.ci95:.{digits}f}"


def print_table(header: list[str], rows: list[list], out) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def run_summary(result: RunResult) -> str:
    """One run in one line: accuracy mean, std, p10, the worst client, bytes, wall time."""
    final = result.final
    parts = [f"{label} {final[k]:.4f}" for k, label in (("acc_mean", "acc_mean"), ("acc_std", "std"),
                                                        ("acc_p10", "p10")) if k in final]
    scored = [r for r in result.client_rows if isinstance(r.get("acc"), (int, float)) and not r.get("coldstart")]
    if scored:
        worst = min(scored, key=lambda r: r["acc"])
        parts.append(f"worst client {worst.get('client', '?')} {worst['acc']:.4f}")
    if "coldstart_acc_mean" in final:
        parts.append(f"cold-start {final['coldstart_acc_mean']:.4f}")
    parts.append(f"up {human_bytes(final.get('comm_up_bytes', 0.0))}, down {human_bytes(final.get('comm_down_bytes', 0.0))}")
    if result.seconds:
        parts.append(human_seconds(result.seconds))
    return "  ".join(parts)


def print_run_line(result: RunResult, name: str, out) -> None:
    kept = f"  (kept: run {result.kept_from} of a stopped study)" if result.kept_from else ""
    print(f"-- {name}: {run_summary(result)}{kept}", file=out)
    for error in result.errors:
        print(f"-- {name}: error: {error}", file=out)


def print_point(result: PointResult, out, clients: bool = False) -> None:
    """A run's compact summary (``clients``: its per-client table first); a point with seeds:
    the mean ± 95% interval over them."""
    if len(result.runs) == 1 and len(result.seeds) <= 1 and not result.seeded:
        if clients:
            print_client_table(result.runs[0], result.name, out)
        print_run_line(result.runs[0], result.name, out)
        if result.run_id and not clients:
            print(f"-- MLflow run {result.run_id}", file=out)
        return
    if clients:
        for seed, run in zip(result.seeds, result.runs):
            print_client_table(run, f"{result.name} seed={seed}", out)
    print(f"\n== {result.name}: {len(result.runs)} seeds (mean ± 95% interval) ==", file=out)
    for key in ("acc_mean", "acc_std", "acc_p10", "server_acc_mean", "coldstart_acc_mean",
                "budget.private_epochs", "budget.public_epochs"):
        if key in result.summary:
            print(f"-- {key} {_pm(result.summary[key])}", file=out)
    if "comm_up_bytes" in result.summary:
        seconds = sum(r.seconds for r in result.runs)
        print(f"-- up {human_bytes(result.summary['comm_up_bytes'].mean)} per run, "
              f"{human_seconds(seconds)} in all", file=out)
    if result.run_id:
        print(f"-- MLflow parent run {result.run_id} (one child run per seed)", file=out)


def print_client_table(result: RunResult, name: str, out) -> None:
    rows = result.client_rows
    if not rows:
        return
    print(f"\n== {name}: per-client results (test split) ==", file=out)
    header = list(rows[0])
    print_table(header, [[r[k] for k in header] for r in rows], out)
    final = result.final
    coldstart = "  ".join(f"{k} {_fmt(final[k])}" for k in ("coldstart_acc_mean", "coldstart_acc_std") if k in final)
    if coldstart:
        print(f"-- cold-start clients: {coldstart}", file=out)
    if result.run_id:
        print(f"-- MLflow run {result.run_id}", file=out)


BUDGET_UNITS = {  # report.budget -> the final metrics that make up a run's budget in that unit
    "passes": ("budget.private_epochs", "budget.public_epochs"),
    "steps": ("budget.private_steps", "budget.public_steps", "budget.finetune_steps"),
}
BUDGET_TOLERANCE = 0.10  # compared methods whose budgets differ by more than this are warned about


def budget_columns(results: list[PointResult], unit: str) -> list[str]:
    """The chosen unit's budget entries that any run used (private always)."""
    keys = BUDGET_UNITS[unit]
    return [k for i, k in enumerate(keys) if i == 0 or any(r.summary.get(k) and r.summary[k].mean for r in results)]


def check_budgets(results: list[PointResult], unit: str) -> None:
    """A warning line when the compared runs' budgets (their sum in ``unit``) differ by more
    than ``BUDGET_TOLERANCE``: a comparison at unequal budgets is a comparison of budgets."""
    totals = {r.name: sum(r.summary[k].mean for k in BUDGET_UNITS[unit] if k in r.summary) for r in results
              if BUDGET_UNITS[unit][0] in r.summary}
    finite = {name: t for name, t in totals.items() if not math.isnan(t)}
    if len(finite) < 2 or min(finite.values()) <= 0:
        return
    if max(finite.values()) > (1 + BUDGET_TOLERANCE) * min(finite.values()):
        shown = ", ".join(f"{name} {total:g}" for name, total in finite.items())
        warning_line(f"the compared runs' local budgets ({unit}) differ by more than "
                     f"{BUDGET_TOLERANCE:.0%}: {shown} ({' + '.join(BUDGET_UNITS[unit])} per client); "
                     f"equalise them, or compare in the other unit (report.budget)")


def print_comparison(results: list[PointResult], reference: str, out, correction: str = "holm",
                     budget: str = "passes", left_out: list[str] = (), family: str = "table") -> None:
    """Every run as mean ± ci95, its collaboration gain over the reference runs (when
    ``experiment.reference`` is set), and its paired difference from ``reference`` over the
    same seeds with its p adjusted over ``family`` (``report.correction_family``: the table's
    comparisons, or that metric's: :mod:`pfl_core.study.compare`); an adjusted p below 0.05 is
    marked *, and the line under the table names the correction and its family."""
    ref = next((r for r in results if r.name == reference), results[0])
    n = len(ref.runs)
    title = "same seed, same partition" if n == 1 else f"{n} seeds, mean ± 95% interval"
    print(f"\n== comparison ({title}) ==", file=out)
    keys = [k for k in COMPARED if any(k in r.summary for r in results)]
    gain_keys = [k for k in GAINS if any(k in r.summary for r in results)]
    diff_keys = keys if n > 1 else []
    differences = comparisons(results, ref, diff_keys, correction, family)
    budgets = budget_columns(results, budget)
    header = ["run", *keys, "comm_up_bytes", *budgets, *gain_keys, *[f"Δ{k} vs {ref.name}" for k in diff_keys]]
    rows = []
    for r in results:
        rows.append([
            r.name,
            *[_pm(r.summary[k]) if k in r.summary else "-" for k in keys],
            human_bytes(r.summary["comm_up_bytes"].mean) if "comm_up_bytes" in r.summary else "-",
            *[f"{r.summary[k].mean:g}" if k in r.summary else "-" for k in budgets],
            *[_interval(r.summary[k]) if k in r.summary else "-" for k in gain_keys],
            *[_interval(differences[(r.name, k)]) if (r.name, k) in differences else "-" for k in diff_keys],
        ])
    print_table(header, rows, out)
    if n > 1:
        print(f"(Δ: paired difference over the same seeds with its 95% interval and p; "
              f"{family_note(differences, correction, family)})", file=out)
    if gain_keys:
        print("(gain_vs_best_reference: acc_mean - max(reference runs) per seed, paired; gain_vs_local likewise)",
              file=out)
    if len({tuple(r.seeds) for r in results}) > 1:
        print("note: runs finished on different seed sets; differences use the seeds both have", file=out)
    for line in left_out:
        print(f"left out: {line}", file=out)
    check_budgets(results, budget)


def left_out_line(name: str, seed, message: str) -> str:
    """Under a comparison, for a point that diverged on one of its seeds (pfl-run, pfl results)."""
    where = f" on seed {seed}" if seed is not None else ""
    return f"{name} diverged{where} ({' '.join(message.split())[:200]})"


def _interval(d: Summary) -> str:
    if d.n < 2:
        return f"{d.mean:+.4f}"
    p = "" if math.isnan(d.p_adjusted) else f" p={_p(d.p_adjusted)}"
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{p}{' *' if d.significant else ''}"


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"
