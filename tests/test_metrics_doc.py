"""docs/metrics.md's "On the command line" shows what ``pfl-run`` prints: every ``console`` block
there is run (in-process) and its output compared with the block line by line, and the
``text`` block with the progress bar's states, as shapes: the same words, column names and
units, with any numbers and run times. A column renamed, added or dropped in the code or in
the doc fails here until the other follows."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from pfl_core.cli import run_main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
HEADING = "### On the command line"

SECONDS = re.compile(r"\b\d+ h \d+ min\b|\b\d+ min \d+ s\b|(?<![\w.])\d+(?:\.\d+)? s\b")  # human_seconds
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")
BAR = re.compile(r"\|[^|]*\|")  # tqdm's bar: its width follows the terminal


def section(text: str) -> str:
    start = text.index(HEADING)
    end = re.compile(r"^#{1,3} ", re.MULTILINE).search(text, start + len(HEADING))
    return text[start:end.start() if end else len(text)]


def blocks(text: str, kind: str) -> list[list[str]]:
    """The lines of every fenced block of ``kind`` (```console, ```text) in ``text``."""
    return [body.split("\n") for body in re.findall(rf"^```{kind}\n(.*?)\n```$", text, flags=re.MULTILINE | re.DOTALL)]


def shape(line: str) -> str:
    """A line with its numbers and times replaced, its spacing collapsed: what the doc promises
    of a line, not the values one run happens to give (nor where a column's text starts)."""
    line = SECONDS.sub("<time>", line)
    line = line.replace("p<", "p=")  # p<0.001
    line = re.sub(r"(p=[\d.]+) \*(?= |$)", r"\1", line)  # significance depends on the numbers
    line = NUMBER.sub("N", line)
    return " ".join(line.split())


def trim(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` (shapes, ``...`` = any lines) against ``actual`` (shapes), whole."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def first_difference(expected: list[str], actual: list[str]) -> str:
    """A readable pointer to where the doc and the output part (for the failure message)."""
    i = j = 0
    while i < len(expected) and j < len(actual):
        if expected[i] == "...":
            if i + 1 == len(expected):
                return "the doc's block ends with '...' yet does not match"
            target = expected[i + 1]
            hits = [k for k in range(j, len(actual)) if actual[k] == target]
            if not hits:
                return f"doc line after '...' not in the output: {target!r}"
            i, j = i + 1, hits[0]
            continue
        if expected[i] != actual[j]:
            return f"doc:    {expected[i]!r}\noutput: {actual[j]!r}"
        i, j = i + 1, j + 1
    if i < len(expected):
        return f"the output ends before the doc's line {expected[i]!r}"
    return f"the output goes on after the doc's block: {actual[j]!r}"


def run_command(command: str, where: Path) -> tuple[int, str, str]:
    """``pfl-run ARGS`` in-process, in ``where``; a spec path relative to the repository root
    (as the doc writes it) is made absolute."""
    words = shlex.split(command)
    assert words[0] == "pfl-run", f"docs/metrics.md: a console block runs {words[0]!r}, not pfl-run"
    args = [str(ROOT / w) if w.endswith(".toml") and (ROOT / w).is_file() else w for w in words[1:]]
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_main(args)
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def doc() -> str:
    return section(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def ran(doc, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Every console block's command -> (exit code, stdout, stderr), each run once."""
    results = {}
    for block in blocks(doc, "console"):
        assert block[0].startswith("$ "), f"a console block starts with '$ COMMAND': {block[0]!r}"
        command = block[0][2:]
        results[command] = run_command(command, tmp_path_factory.mktemp("run"))
    return results


def test_the_section_shows_every_kind_of_output(doc):
    commands = [block[0] for block in blocks(doc, "console")]
    assert any("--clients" in c for c in commands), "the per-client table is shown"
    assert any("experiment.seeds" in c for c in commands), "a comparison over seeds is shown"
    assert any("--no-sweep" not in c and "seeds" not in c for c in commands), "a sweep's comparison is shown"
    assert len(blocks(doc, "text")) == 1, "the progress bar is shown"


def test_console_blocks_match_the_output(doc, ran):
    for block in blocks(doc, "console"):
        command = block[0][2:]
        code, out, err = ran[command]
        assert code == 0, f"{command} exited with {code}: {err[-2000:]}"
        expected = [line if line == "..." else shape(line) for line in trim(block[1:])]
        actual = [shape(line) for line in trim(out.split("\n"))]
        assert matches(expected, actual), (
            f"docs/metrics.md ({HEADING!r}): the output of `{command}` differs from the doc\n"
            f"{first_difference(expected, actual)}\n--- output ---\n{out}")


def test_progress_bar_matches_the_output(doc, ran):
    (block,) = blocks(doc, "text")
    states = {shape(BAR.sub("|bar|", s)) for _, _, err in ran.values() for s in re.split(r"[\r\n]+", err)}
    for line in trim(block):
        assert shape(BAR.sub("|bar|", line)) in states, (
            f"docs/metrics.md: the progress bar line {line!r} is not a state the bar showed; its states:\n"
            + "\n".join(sorted(s for s in states if "rounds" in s)))


def test_bytes_and_times_are_in_the_units_the_doc_names(doc, ran):
    """The run lines' byte counts are in the units the "Bytes" paragraph lists (powers of 1000),
    and no block shows another unit."""
    paragraph = re.search(r"\*\*Bytes\*\*(.*?)\n\n", doc, re.DOTALL).group(1)
    units = set(re.findall(r"`(?:\d+ )?(B|kB|MB|GB|TB)`", paragraph))
    assert units == {"B", "kB", "MB", "GB", "TB"}, paragraph
    assert "powers of 1000" in paragraph
    for _, out, _ in ran.values():
        for amount, unit in re.findall(r"\b(?:up|down) ([\d.]+) (\w+)", out):
            assert unit in units, f"{amount} {unit}"


def test_coldstart_column_and_line_are_as_described(doc, tmp_path):
    """The per-client table's prose: with cold-start clients, a last column and a line under the
    table, as the doc names them; the run line's ``cold-start`` field."""
    column = re.search(r"a last column `(\w+)`", doc).group(1)
    described = re.search(r"`(-- cold-start clients: [^`]*)`", doc).group(1)
    field = re.search(r"cold-start clients `(cold-start) <coldstart_acc_mean>`", doc).group(1)
    code, out, err = run_command("pfl-run specs/quickstart.toml --no-tracking --no-sweep --clients "
                                 "--set experiment.rounds=2 --set experiment.coldstart_clients=2", tmp_path)
    assert code == 0, err
    lines = out.split("\n")
    header = next(line.split() for line in lines if line.split()[:1] == ["client"])
    assert header[-1] == column
    assert header[:4] == ["client", "arch", "num_train", "num_test"]
    rows = [line.split() for line in lines if line.split()[-1:] in (["True"], ["False"])]
    assert [r[-1] for r in rows] == ["False"] * 18 + ["True"] * 2, "cold-start rows come last"
    pattern = re.escape(described).replace(r"\.\.\.", r"[\d.]+")
    assert any(re.fullmatch(pattern, line) for line in lines), out
    run_line = next(line for line in lines if line.startswith("-- fedavg:"))
    assert re.search(rf"  {field} [\d.]+  up ", run_line), run_line
