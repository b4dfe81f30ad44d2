"""What a study prints: each run's line, a point's summary over seeds, the per-client table,
the comparison table with paired differences, the dry run's report and where the results are."""

from __future__ import annotations

import math

import attrs

from pfl_core.engine import RunResult
from pfl_core.study.compare import COMPARED, GAINS, comparisons, family_note
from pfl_core.study.points import Point, PointResult, build_key, point_builds
from pfl_core.study.stats import ALPHA, Summary
from pfl_core.tracking.tables import table_csv
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
        lines.append(f"results: {out_dir}/ (table.csv, comparison.csv, differences.csv, runs/<run>/clients*.csv, spec.toml)")
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
            shown = data.clients if not data.on_demand else data.clients[:data.clients.PLANNING_CLIENTS]
            sizes = [c.num_train for c in shown]
            public = f", public set {len(data.public.indices)}" if data.public is not None else ""
            generated = f" (of the first {len(shown)}, each client's data generated on demand)" if data.on_demand else ""
            built[key] = (f"# ok: {len(data.clients)} clients, train sizes {min(sizes)}..{max(sizes)}{generated}, "
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
    """The comparison table (:func:`comparison_table`) as the terminal shows it, then a warning
    when the compared runs' budgets in ``budget`` (``report.budget``) differ."""
    print_results_table(comparison_table(results, reference, correction, family, left_out), out)
    check_budgets(results, budget)


def left_out_line(name: str, seed, message: str) -> str:
    """Under a comparison, for a point that diverged on one of its seeds (pfl-run, pfl results)."""
    where = f" on seed {seed}" if seed is not None else ""
    return f"{name} diverged{where} ({' '.join(message.split())[:200]})"


# -- one table model for the terminal, Markdown, LaTeX and CSV --------------------------------


@attrs.frozen
class Column:
    """One column of a results table: its header, one raw cell per row (None: no value), and
    its ``kind``, which says how every format writes a cell:

    ``text``, ``count``: as they are; ``number`` (a budget): ``%g``, exact in CSV; ``bytes``:
    for people (``16.2 kB``), exact in CSV; ``summary`` (a :class:`Summary` over seeds): mean ±
    95% interval, in CSV the mean and ``<csv_name>_ci95``; ``difference`` (a paired
    difference): ``mean [low, high] p=...``, ``*`` when the adjusted p < 0.05, in CSV the mean,
    ``_low``, ``_high``, ``_p`` and ``_p_adjusted``."""

    header: str  # as the terminal and Markdown show it (LaTeX: escaped)
    csv_name: str
    kind: str
    cells: tuple
    best: str = ""  # "max" or "min": Markdown and LaTeX set the best mean of a summary column in bold


@attrs.frozen
class ResultsTable:
    """A table every format renders from the same columns: :func:`print_results_table`,
    :func:`table_markdown`, :func:`table_latex`, :func:`table_csv_text`."""

    title: str
    columns: tuple[Column, ...]
    notes: tuple[str, ...] = ()  # under the table (LaTeX: as comments; CSV: none)

    @property
    def rows(self) -> int:
        return len(self.columns[0].cells) if self.columns else 0


def _lower_is_better(key: str) -> bool:
    return "loss" in key or "bytes" in key


def rounds_ran(result: PointResult) -> int | str | None:
    """The rounds a point's runs ran (each run's last evaluated round; the last round is always
    evaluated): one number, ``low-high`` where its seed runs differ, None where unknown."""
    rounds = [run.history[-1].get("round") if run.history else None for run in result.runs]
    if not rounds or None in rounds:
        return None
    return rounds[0] if min(rounds) == max(rounds) else f"{min(rounds)}-{max(rounds)}"


def comparison_table(results: list[PointResult], reference: str, correction: str = "holm", family: str = "table",
                     left_out: list[str] = ()) -> ResultsTable:
    """The comparison of a study's points: per point its seeds and rounds, ``mean ± ci95`` of
    the compared metrics, its upload, its local budget in both units (passes and optimiser
    steps, the entries any run used), its collaboration gains over the reference runs (when
    ``experiment.reference`` is set), and its paired difference from ``reference`` over the
    same seeds, p adjusted over ``family`` (``report.correction_family``:
    :mod:`pfl_core.study.compare`). The notes name the correction and its family."""
    ref = next((r for r in results if r.name == reference), results[0])
    n = len(ref.runs)
    keys = [k for k in COMPARED if any(k in r.summary for r in results)]
    gain_keys = [k for k in GAINS if any(k in r.summary for r in results)]
    diff_keys = keys if n > 1 else []
    differences = comparisons(results, ref, diff_keys, correction, family)
    budgets = [*budget_columns(results, "passes"), *budget_columns(results, "steps")]

    def summaries(key: str) -> tuple:
        return tuple(r.summary.get(key) for r in results)

    def means(key: str) -> tuple:
        return tuple(r.summary[key].mean if key in r.summary else None for r in results)

    columns = (
        Column("run", "run", "text", tuple(r.name for r in results)),
        Column("seeds", "seeds", "count", tuple(len(r.runs) for r in results)),
        Column("rounds", "rounds", "count", tuple(rounds_ran(r) for r in results)),
        *[Column(k, k, "summary", summaries(k), "min" if _lower_is_better(k) else "max") for k in keys],
        Column("comm_up_bytes", "comm_up_bytes", "bytes", means("comm_up_bytes")),
        *[Column(k, k, "number", means(k)) for k in budgets],
        *[Column(k, k, "difference", summaries(k)) for k in gain_keys],
        *[Column(f"Δ{k} vs {ref.name}", f"delta_{k}", "difference",
                 tuple(differences.get((r.name, k)) for r in results)) for k in diff_keys],
    )
    notes = []
    if n > 1:
        notes.append(f"(Δ: paired difference over the same seeds with its 95% interval and p; "
                     f"{family_note(differences, correction, family)})")
    if gain_keys:
        notes.append("(gain_vs_best_reference: acc_mean - max(reference runs) per seed, paired; "
                     "gain_vs_local likewise)")
    if len({tuple(r.seeds) for r in results}) > 1:
        notes.append("note: runs finished on different seed sets; differences use the seeds both have")
    notes += [f"left out: {line}" for line in left_out]
    title = "comparison (same seed, same partition)" if n == 1 else f"comparison ({n} seeds, mean ± 95% interval)"
    return ResultsTable(title, columns, tuple(notes))


def p_text(p: float) -> str:
    """An adjusted p as the tables write it: ``p<0.001``, else ``p=`` with 3 decimals, or as
    many more as it takes to stay on the value's side of 0.05 (0.0495: ``p=0.0495``, never a
    starred ``p=0.050``)."""
    if p < 0.001:
        return "p<0.001"
    for decimals in range(3, 18):
        text = f"{p:.{decimals}f}"
        if (float(text) < ALPHA) == (p < ALPHA):
            return f"p={text}"
    return f"p={p!r}"


def difference_text(d: Summary) -> str:
    """``+0.0200 [+0.0100, +0.0300] p=0.0123 *`` (one seed: the difference alone)."""
    if d.n < 2:
        return f"{d.mean:+.4f}"
    p = "" if math.isnan(d.p_adjusted) else f" {p_text(d.p_adjusted)}"
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{p}{' *' if d.significant else ''}"


def _text_cell(kind: str, value) -> str:
    """A cell as the terminal and Markdown write it."""
    if value is None:
        return "-"
    if kind == "summary":
        return _pm(value)
    if kind == "difference":
        return difference_text(value)
    if kind == "bytes":
        return human_bytes(value)
    if kind == "number":
        return f"{value:g}"
    return str(value)


def _best(column: Column) -> float | None:
    """The best mean of a summary column (None: not marked, or no finite mean)."""
    if not column.best:
        return None
    means = [s.mean for s in column.cells if s is not None and not math.isnan(s.mean)]
    if not means:
        return None
    return min(means) if column.best == "min" else max(means)


def print_results_table(table: ResultsTable, out) -> None:
    """The terminal's table: the title, the aligned columns, the notes."""
    print(f"\n== {table.title} ==", file=out)
    print_table([c.header for c in table.columns],
                [[_text_cell(c.kind, c.cells[i]) for c in table.columns] for i in range(table.rows)], out)
    for note in table.notes:
        print(note, file=out)


def table_markdown(table: ResultsTable) -> str:
    """A Markdown table of the terminal's cells, each column's best mean in bold, then the title
    and the notes."""
    lines = ["| " + " | ".join(_md(c.header) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    best = [_best(c) for c in table.columns]
    for i in range(table.rows):
        cells = []
        for column, top in zip(table.columns, best):
            text = _md(_text_cell(column.kind, column.cells[i]))
            value = column.cells[i]
            cells.append(f"**{text}**" if top is not None and value is not None and value.mean == top else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, *(f"\n{line}" for line in (table.title, *table.notes))]) + "\n"


def _md(text: str) -> str:
    return text.replace("|", r"\|")


def table_latex(table: ResultsTable) -> str:
    """A booktabs tabular of the same columns (the best mean of each metric in bold), the title
    and the notes as comments under it; needs ``\\usepackage{booktabs}``."""
    spec = "".join("l" if c.kind == "text" else "c" for c in table.columns)
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(_latex_header(c.header) for c in table.columns) + r" \\", r"\midrule"]
    best = [_best(c) for c in table.columns]
    for i in range(table.rows):
        lines.append(" & ".join(_latex_cell(c.kind, c.cells[i], top) for c, top in zip(table.columns, best)) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", *(f"% {line}" for line in (table.title, *table.notes))]
    return "\n".join(lines) + "\n"


def _latex_header(text: str) -> str:
    """``Δacc_mean vs local``: ``$\\Delta$ acc\\_mean vs local``; ``a - b``: ``a $-$ b``."""
    return _tex(text).replace("Δ", r"$\Delta$ ").replace(" - ", " $-$ ")


def _latex_cell(kind: str, value, best: float | None) -> str:
    if value is None:
        return "--"
    if kind == "summary":
        mean = f"{value.mean:.4f}"
        if best is not None and value.mean == best:
            mean = rf"\textbf{{{mean}}}"
        return f"${mean}$" if value.n < 2 else f"${mean} \\pm {value.ci95:.4f}$"
    if kind == "difference":
        return latex_difference(value)
    return _tex(_text_cell(kind, value))


def latex_difference(d: Summary) -> str:
    """``$+0.0200$ [+0.0100, +0.0300], $p=0.0123$$^*$``: :func:`difference_text` in LaTeX."""
    if d.n < 2:
        return f"${d.mean:+.4f}$"
    p = "" if math.isnan(d.p_adjusted) else f", ${p_text(d.p_adjusted)}$"
    return f"${d.mean:+.4f}$ [{d.low:+.4f}, {d.high:+.4f}]{p}" + ("$^*$" if d.significant else "")


def _tex(text: str) -> str:
    for char in ("\\", "&", "%", "$", "#", "_", "{", "}"):
        text = text.replace(char, "\\" + char if char != "\\" else r"\textbackslash{}")
    return text


CSV_PARTS = {"summary": ("", "_ci95"), "difference": ("", "_low", "_high", "_p", "_p_adjusted")}


def table_csv_text(table: ResultsTable) -> str:
    """The same columns, one unrounded number per CSV cell (a summary: its mean and
    ``_ci95``; a difference: its mean, ``_low``, ``_high``, ``_p``, ``_p_adjusted``; no value:
    empty); for a plotting or analysis script."""
    header = [c.csv_name + part for c in table.columns for part in CSV_PARTS.get(c.kind, ("",))]
    rows = [[cell for c in table.columns for cell in _csv_cells(c.kind, c.cells[i])] for i in range(table.rows)]
    return table_csv(header, rows, exact=True)


def _csv_cells(kind: str, value) -> list:
    parts = CSV_PARTS.get(kind, ("",))
    if value is None:
        return [""] * len(parts)
    if kind == "summary":
        return [_number(value.mean), _number(value.ci95)]
    if kind == "difference":
        return [_number(v) for v in (value.mean, value.low, value.high, value.p, value.p_adjusted)]
    return [_number(value) if isinstance(value, float) else value]


def _number(value: float):
    """A CSV number: nan (no interval, no test) is an empty cell."""
    return "" if math.isnan(value) else float(value)
