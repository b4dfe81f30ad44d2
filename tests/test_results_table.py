"""One table model (``pfl_core.study.report``) behind the terminal, Markdown, LaTeX and CSV:
the same columns in each, the CSV unrounded; a starred p never reads as 0.050 (issue 35,
items 4, 5 and 10)."""

from __future__ import annotations

import csv
import io
import math

import pytest

from pfl_core.engine import RunResult
from pfl_core.study import stats
from pfl_core.study.points import PointResult
from pfl_core.study.report import (
    Column,
    ResultsTable,
    comparison_table,
    difference_text,
    p_text,
    print_results_table,
    table_csv_text,
    table_latex,
    table_markdown,
)


@pytest.mark.parametrize("p, text", [
    (0.0495, "p=0.0495"),  # below 0.05: "0.050" would read as not significant
    (0.05, "p=0.050"),  # not below 0.05: unstarred
    (0.0501, "p=0.050"),  # above: 0.050 is on its side
    (0.04999, "p=0.04999"),  # as many digits as it takes
    (0.049512345, "p=0.0495"),  # and no more
    (0.00099, "p<0.001"),
    (0.001, "p=0.001"),
    (0.5, "p=0.500"),
    (1.0, "p=1.000"),
])
def test_p_prints_on_its_side_of_the_threshold(p, text):
    assert p_text(p) == text


def _difference(p_adjusted: float) -> stats.Summary:
    return stats.Summary(0.02, 0.01, 0.01, 3, p=p_adjusted / 2, p_adjusted=p_adjusted)


def test_a_starred_p_reads_below_005_in_every_format():
    """The issue's "p=0.050 *" (adjusted p 0.0495) and its neighbours, in all four formats."""
    diffs = (_difference(0.0495), _difference(0.05), _difference(0.00099))
    table = ResultsTable("t", (Column("run", "run", "text", ("a", "b", "c")),
                               Column("Δacc_mean vs ref", "delta_acc_mean", "difference", diffs)))
    out = io.StringIO()
    print_results_table(table, out)
    rows = out.getvalue().splitlines()[3:6]
    assert rows[0].endswith("+0.0200 [+0.0100, +0.0300] p=0.0495 *")
    assert rows[1].endswith("+0.0200 [+0.0100, +0.0300] p=0.050")  # 0.05 is not below 0.05: no star
    assert rows[2].endswith("+0.0200 [+0.0100, +0.0300] p<0.001 *")
    md = table_markdown(table).splitlines()
    assert md[2] == "| a | +0.0200 [+0.0100, +0.0300] p=0.0495 * |" and md[4].endswith("p<0.001 * |")
    tex = table_latex(table).splitlines()
    assert tex[4] == r"a & $+0.0200$ [+0.0100, +0.0300], $p=0.0495$$^*$ \\"
    assert tex[5].endswith(r"$p=0.050$ \\") and tex[6].endswith(r"$p<0.001$$^*$ \\")
    rows = list(csv.DictReader(io.StringIO(table_csv_text(table))))
    assert [float(r["delta_acc_mean_p_adjusted"]) for r in rows] == [0.0495, 0.05, 0.00099]  # unrounded
    assert difference_text(stats.Summary(0.02, math.nan, math.nan, 1)) == "+0.0200"  # one seed: no test


def _point(name: str, accs: list[float], rounds: list[int | None], steps: float) -> PointResult:
    runs = [RunResult(history=[{"round": r}] if r is not None else [], client_rows=[],
                      final={"acc_mean": a, "comm_up_bytes": 1234.0, "budget.private_epochs": 2.0,
                             "budget.private_steps": steps})
            for a, r in zip(accs, rounds)]
    keys = runs[0].final
    return PointResult(name, list(range(len(accs))), runs,
                       {k: stats.summarize([run.final[k] for run in runs]) for k in keys})


def test_every_format_has_the_same_columns_rounds_and_budgets():
    """A hand-built study: ref, a (+0.01 on every seed: p 0), b (rounds 4 and 5 on its seeds),
    c (a run without a known round)."""
    points = [_point("ref", [0.50, 0.60, 0.70], [5, 5, 5], 16.0), _point("a", [0.51, 0.61, 0.71], [5, 5, 5], 16.0),
              _point("b", [0.40, 0.70, 0.55], [4, 5, 5], 8.25), _point("c", [0.5, 0.6, 0.7], [5, None, 5], 16.0)]
    table = comparison_table(points, "ref", "holm", "table")
    headers = ["run", "seeds", "rounds", "acc_mean", "comm_up_bytes", "budget.private_epochs",
               "budget.private_steps", "Δacc_mean vs ref"]
    assert [c.header for c in table.columns] == headers
    out = io.StringIO()
    print_results_table(table, out)
    lines = out.getvalue().splitlines()
    assert lines[1] == "== comparison (3 seeds, mean ± 95% interval) =="
    assert lines[2].split() == [*headers[:-1], "Δacc_mean", "vs", "ref"]
    cells = {line.split()[0]: line.split() for line in lines[3:7]}
    assert cells["a"][1:3] == ["3", "5"] and cells["b"][2] == "4-5" and cells["c"][2] == "-"
    assert cells["a"][6:9] == ["1.2", "kB", "2"] and cells["b"][9] == "8.25"
    assert " ".join(cells["a"][10:]) == "+0.0100 [+0.0100, +0.0100] p<0.001 *"
    md = table_markdown(table).splitlines()
    assert md[0] == "| " + " | ".join(headers) + " |"
    assert md[3] == ("| a | 3 | 5 | **0.6100 ± 0.2484** | 1.2 kB | 2 | 16 | +0.0100 [+0.0100, +0.0100] p<0.001 * |")
    assert md[4].startswith("| b | 3 | 4-5 | ")
    tex = table_latex(table)
    assert (r"run & seeds & rounds & acc\_mean & comm\_up\_bytes & budget.private\_epochs & budget.private\_steps & "
            r"$\Delta$ acc\_mean vs ref \\") in tex
    assert r"a & 3 & 5 & $\textbf{0.6100} \pm 0.2484$ & 1.2 kB & 2 & 16 & $+0.0100$ [+0.0100, +0.0100], " \
           r"$p<0.001$$^*$ \\" in tex
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(table_csv_text(table)))}
    assert list(rows["a"]) == ["run", "seeds", "rounds", "acc_mean", "acc_mean_ci95", "comm_up_bytes",
                               "budget.private_epochs", "budget.private_steps", "delta_acc_mean",
                               "delta_acc_mean_low", "delta_acc_mean_high", "delta_acc_mean_p",
                               "delta_acc_mean_p_adjusted"]
    assert rows["a"]["acc_mean"] == repr(points[1].summary["acc_mean"].mean)  # unrounded
    assert (rows["b"]["rounds"], rows["c"]["rounds"], rows["a"]["comm_up_bytes"]) == ("4-5", "", "1234.0")
    assert rows["ref"]["delta_acc_mean"] == "" and float(rows["a"]["delta_acc_mean_p"]) == 0.0
