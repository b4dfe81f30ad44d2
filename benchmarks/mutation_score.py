#!/usr/bin/env python
"""Mutation score of the plugins and the core's aggregation, training loop and engine.

Mutants are mutmut's (its operators: numbers, strings, comparison and arithmetic operators,
and/or, keywords, arguments, assignments); this script only schedules them. For each target
file it lists every mutant, draws a seeded sample (``--sample N``; all of them by default),
and runs the target's own tests (``TESTS`` below, stopping at the first failure) against
each mutant in a private copy of the repository. A mutant is *killed* when a test fails or
the tests time out (3x the unmutated run, plus 10 s), and *survives* when every test passes.
"mutants" is how many mutmut makes of the file; "tested" how many ran (the sample).
The score is killed / tested with its 95% Clopper-Pearson interval (scipy), so a sampled score
says how far it can be from the full one. Survivors are listed with their line, before and
after, for review.

Why not ``mutmut run``: it starts a fresh interpreter per mutant (about 3 s of torch import
here, more than most of these test files take) and runs one mutant at a time. Here one worker
per ``--jobs`` imports torch once and forks a child per mutant, which imports the mutated
copy of the package.

    OMP_NUM_THREADS=1 python benchmarks/mutation_score.py                        # every target
    OMP_NUM_THREADS=1 python benchmarks/mutation_score.py plugins/ditto --sample 40 --jobs 2
    OMP_NUM_THREADS=1 python benchmarks/mutation_score.py --list                 # targets and their tests
    python benchmarks/mutation_score.py --report mutants.jsonl                   # the table of a --log

Not part of the test suite (CI does not run it). Exit status 0 when every target's unmutated
tests pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# target (file, or plugin folder) -> the tests that specify it (pytest arguments); every
# plugin's list ends with the registration-name and generated-docs tests (-x runs them only when the
# rest pass)
PARAMS_TEST = "tests/test_baseline_params.py"  # every parameter of the issue-10 baselines
SHARED_PARTIAL = ["tests/test_partial_baselines.py", "tests/test_pmixfed_baselines.py"]
TESTS: dict[str, list[str]] = {
    "pfl_core/runtime/aggregate.py": ["tests/test_aggregate.py", "tests/test_fedavg.py"],
    "pfl_core/runtime/training.py": ["tests/test_training.py", "tests/test_core_loop.py", "tests/test_client_api.py"],
    "pfl_core/engine/engine.py": ["tests/test_engine.py", "tests/test_core_loop.py", "tests/test_client_api.py"],
    # issue 23: the gradient hook, the step count and the staged state, as a client sees them
    "pfl_core/runtime/context.py": ["tests/test_client_api.py", "tests/test_training.py", "tests/test_core_loop.py"],
    "pfl_core/state/stateio.py": ["tests/test_stateio.py"],
    "pfl_core/models/zoo.py": ["tests/test_models.py"],
    # Issue 20's reliability code: the journal's file check, the float32 bound, the store's creation
    "pfl_core/tracking/journal.py": ["tests/test_tracking_outage.py::test_replay_refuses_a_journal_that_names_a_file_outside_it",
                                     "tests/test_tracking_outage.py::test_replay_sends_the_files_a_journal_wrote_itself"],
    "pfl_core/spec/convert.py": ["tests/test_numeric_keys.py", "tests/test_spec.py", "tests/test_bad_input.py"],
    # issue 21: the corrected statistics, the comparisons, the tuning's space and the steps budget
    "pfl_core/study/stats.py": [f"tests/test_seeds.py::{name}" for name in (
        "test_summary_matches_a_hand_computed_t_interval", "test_paired_difference_uses_the_pairs_not_the_two_means",
        "test_an_interval_that_contains_zero_is_not_marked", "test_the_paired_p_is_the_t_test_of_the_differences_by_hand",
        "test_holm_adjusts_by_hand", "test_a_difference_significant_alone_is_not_once_corrected_for_the_table",
        "test_comparison_marks_only_significant_differences", "test_the_edges_of_the_statistics")],
    "pfl_core/study/compare.py": [f"tests/test_seeds.py::{name}" for name in (
        "test_a_difference_significant_alone_is_not_once_corrected_for_the_table",
        "test_comparison_marks_only_significant_differences", "test_the_gains_are_a_family_each_over_the_runs",
        "test_the_points_parent_runs_hold_the_tables_differences_and_the_csv_agrees")],
    "pfl_core/study/stored.py": ["tests/test_results_cli.py"],
    "pfl_core/tracking/links.py": ["tests/test_terminal.py::test_sweep_shows_run_k_of_n_and_a_loading_line_and_ends_with_the_mlflow_location"],
    "pfl_core/study/tune.py": ["tests/test_tune.py::test_bad_tuning_input_is_one_line_naming_the_key_before_data_loads",
                               "tests/test_tune.py::test_the_tuning_seed_is_not_a_final_seed_and_the_trials_share_one_partition",
                               "tests/test_tune.py::test_tuning_finds_the_learning_rate_that_learns_and_runs_the_point_at_it",
                               "tests/test_tune.py::test_the_median_pruner_stops_trials_and_their_runs_say_so",
                               "tests/test_tune.py::test_a_killed_tuning_resumes_without_repeating_a_finished_trial",
                               "tests/test_tune.py::test_the_objective_the_header_and_where_the_storage_is",
                               "tests/test_tune.py::test_the_grid_sampler_tries_every_choice_once"],
    "pfl_core/study/report.py": ["tests/test_budget_steps.py", "tests/test_seeds.py"],
    "pfl_core/tracking/store_check.py": ["tests/test_interrupt.py::test_a_signal_while_a_store_is_created_leaves_no_store",
                                         "tests/test_interrupt.py::test_an_abandoned_temporary_store_is_removed",
                                         "tests/test_interrupt.py::test_a_temporary_store_of_a_live_process_is_kept_and_that_process_left_alone",
                                         "tests/test_interrupt.py::test_a_half_built_store_says_what_to_do",
                                         "tests/test_interrupt.py::test_runs_started_at_once_on_a_new_store_all_succeed"],
    "pfl_core/execution/process.py": [f"tests/test_executors.py::{name}" for name in (
        "test_items_and_results_pickle_tensors_exactly",
        "test_pickler_sends_a_repeated_tensor_once_and_only_its_own_bytes",
        "test_pickler_leaves_parameters_and_graph_tensors_to_torch",
        "test_auto_picks_the_pool_only_when_it_pays", "test_a_killed_worker_is_retried_and_the_result_is_unchanged",
        "test_a_worker_that_keeps_dying_stops_the_run_naming_client_and_round",
        "test_a_plugin_error_in_a_worker_reaches_the_server_as_itself",
        "test_process_pool_is_bit_identical_to_the_sequential_loop[fedavg]",
        "test_process_pool_is_bit_identical_to_the_sequential_loop[fedrep]",
        "test_process_pool_is_bit_identical_to_the_sequential_loop[cosmos]",
        "test_workers_die_with_a_killed_run")],
    "plugins/apfl": ["tests/test_apfl.py", PARAMS_TEST],
    "plugins/centralized": ["tests/test_centralized.py"],
    "pfl_core/methods/codistill.py": ["tests/test_cosmos.py", "tests/test_comet.py"],
    "plugins/comet": ["tests/test_comet.py", PARAMS_TEST],
    "plugins/corrupted_clients": ["tests/test_addons.py"],
    "plugins/cosmos": ["tests/test_cosmos.py"],
    "plugins/ditto": ["tests/test_ditto.py", PARAMS_TEST],
    "plugins/fedalt": SHARED_PARTIAL,
    "plugins/fedas": ["tests/test_fedas.py", PARAMS_TEST],
    "plugins/fedavg": ["tests/test_fedavg.py"],
    "plugins/fedbabu": SHARED_PARTIAL,
    "plugins/fedbn": ["tests/test_fedbn.py", PARAMS_TEST],
    "plugins/fedct": ["tests/test_fedmosaic.py"],
    "plugins/fedmd": ["tests/test_fedmd.py"],
    "plugins/fedmosaic": ["tests/test_fedmosaic.py"],
    "plugins/fedpac": ["tests/test_fedpac.py", PARAMS_TEST],
    "plugins/fedper": ["tests/test_fedper.py"],
    "plugins/fedphp": ["tests/test_fedphp.py", PARAMS_TEST],
    "plugins/fedproto": ["tests/test_fedproto.py"],
    "plugins/fedprox": ["tests/test_fedprox.py"],
    "plugins/fedrep": ["tests/test_fedrep.py"],
    "plugins/fedsim": SHARED_PARTIAL,
    "plugins/fedsimsup": ["tests/test_fedsimsup.py"],
    "plugins/lgfedavg": SHARED_PARTIAL,
    "plugins/local": ["tests/test_local.py"],
    "pfl_core/methods/partial.py": SHARED_PARTIAL,
    "plugins/perfedavg": ["tests/test_perfedavg.py", PARAMS_TEST],
    "plugins/pfedfda": ["tests/test_pfedfda.py", PARAMS_TEST],
    "plugins/pfedme": ["tests/test_pfedme.py", PARAMS_TEST],
    "plugins/pmixfed": ["tests/test_pmixfed.py", "tests/test_pmixfed_baselines.py"],
    "plugins/privacy": ["tests/test_privacy.py"],
    # issue 23: the gradient-correction methods
    "plugins/scaffold": ["tests/test_scaffold.py"],
    "plugins/feddyn": ["tests/test_feddyn.py"],
    "plugins/fednova": ["tests/test_fednova.py"],
    # issue 23: feature-level personalization
    "plugins/feddbe": ["tests/test_feddbe.py"],
    "plugins/fedgen": ["tests/test_fedgen.py"],
    "plugins/fedcp": ["tests/test_fedcp.py"],
    "plugins/gpfl": ["tests/test_gpfl.py"],
    # issue 23: the personalized-aggregation methods
    "plugins/fedala": ["tests/test_fedala.py"],
    "plugins/fedamp": ["tests/test_fedamp.py"],
    "plugins/fedfomo": ["tests/test_fedfomo.py"],
    "plugins/apple": ["tests/test_apple.py"],
    # issue 23: server optimisers, model-contrastive training, decoupled heads
    "plugins/fedopt": ["tests/test_fedopt.py"],
    "plugins/moon": ["tests/test_moon.py"],
    "plugins/fedrod": ["tests/test_fedrod.py"],
}
# issue 38: the methods of PFLlib and FL-bench, each against its own test file
ISSUE_38 = ("pfedhn", "fedem", "cfl", "knnper", "fedlc", "fedntd", "fd", "fedkd", "fml", "pfedla", "fedgh", "ccvr",
            "elastic", "fedadmm", "metafed", "fedap", "fedcac", "fedsr", "fedpcl", "fedmtl", "fedcross", "fedah", "pfedsim", "fedgc", "flute", "fediir", "pflda", "pefll", "floco", "adcol", "fedfed")
TESTS.update({f"plugins/{name}": [f"tests/test_{name}.py"] for name in ISSUE_38})
NAME_TEST = "tests/test_baselines.py::test_every_built_in_plugin_carries_its_entry_point_name"
DOCS_TEST = "tests/test_docs.py"  # a parameter's documented text, default and constraint
for _target, _tests in TESTS.items():
    if _target.startswith("plugins/"):
        TESTS[_target] = [*_tests, NAME_TEST, DOCS_TEST]
PYTEST_FLAGS = ["-x", "-q", "-p", "no:cacheprovider"]


def source_file(target: str) -> str:
    return f"{target}/__init__.py" if (ROOT / target).is_dir() else target


def list_mutants(path: str, source: str) -> list:
    """Every mutmut mutation of ``source`` (the text of ``path``), in file order."""
    from mutmut import ALL, Context, list_mutations

    return list_mutations(Context(source=source, filename=path, mutation_id=ALL))


def changes_what_runs(path: str, source: str, mutation_id) -> bool:
    """False for a mutant of type annotations alone (equivalent: the files postpone the
    evaluation of annotations) and for the few mutmut makes that do not parse."""
    mutated = executable_ast(mutated_source(path, source, mutation_id))
    return mutated is not None and mutated != executable_ast(source)


def function_lines(source: str, names: list[str]) -> set[int]:
    """The line numbers (1-based) of the functions and methods called one of ``names``."""
    return {line for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names
            for line in range(node.lineno, node.end_lineno + 1)}


def choose_mutants(path: str, source: str, sample: int, rng: random.Random,
                   functions: list[str] | None = None) -> tuple[list, int]:
    """(the mutants to test, in file order; how many mutmut makes). With ``sample`` > 0, a
    seeded random draw of that many among those that change what runs; else all of those.
    With ``functions``, only the mutants inside the functions of those names."""
    mutants = list_mutants(path, source)
    if functions:
        lines = function_lines(source, functions)
        mutants = [m for m in mutants if m.line_number + 1 in lines]  # mutmut counts lines from 0
    order = rng.sample(mutants, len(mutants)) if sample > 0 else mutants
    chosen = []
    for mutation_id in order:
        if sample > 0 and len(chosen) == sample:
            break
        if changes_what_runs(path, source, mutation_id):
            chosen.append(mutation_id)
    return sorted(chosen, key=mutants.index), len(mutants)


def executable_ast(source: str) -> str | None:
    """The syntax tree with annotations removed, as text: equal for annotation-only edits;
    None for a mutant that is not valid Python (mutmut makes a few; not counted)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return ast.dump(tree)


def mutated_source(path: str, source: str, mutation_id) -> str:
    from mutmut import Context, mutate

    return mutate(Context(source=source, filename=path, mutation_id=mutation_id))[0]


def copy_repository(into: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", ".git", ".venv", "mlruns", "*.db", "*.egg-info")
    for name in ("pfl_core", "plugins", "tests", "specs", "docs", "examples", "benchmarks"):  # tests read specs and docs
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, into / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, into / name)
    return into


SUBPROCESS_SITE = """\
import importlib.util, sys
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
_spec = importlib.util.spec_from_file_location("pfl_plugins", "{copy}/plugins/__init__.py",
                                               submodule_search_locations=["{copy}/plugins"])
_module = importlib.util.module_from_spec(_spec)
sys.modules["pfl_plugins"] = _module
_spec.loader.exec_module(_module)
"""


def run_tests_in_child(copy: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """Fork; the child imports the (possibly mutated) copy and runs ``tests``. Returns
    ("passed" | "failed" | "timeout", seconds)."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: nothing of pfl is imported yet, so the copy is what it imports
        try:
            sys.dont_write_bytecode = True  # a stale .pyc of another mutant must never load
            os.chdir(copy)
            sys.path.insert(0, str(copy))
            # a test's own subprocess (pfl-run in a child interpreter) imports the copy too: its
            # sitecustomize drops the editable install's finder, which would find the checkout
            site = copy / "_mutation_site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(SUBPROCESS_SITE.format(copy=str(copy)))
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(copy),
                                                                     os.environ.get("PYTHONPATH")]))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            # The copy's plugins/ folder as pfl_plugins (an editable install maps the checkout's)
            spec = importlib.util.spec_from_file_location("pfl_plugins", copy / "plugins" / "__init__.py",
                                                          submodule_search_locations=[str(copy / "plugins")])
            pfl_plugins = importlib.util.module_from_spec(spec)
            sys.modules["pfl_plugins"] = pfl_plugins
            spec.loader.exec_module(pfl_plugins)
            import pytest

            code = pytest.main([*tests, *PYTEST_FLAGS, "--rootdir", str(copy)])
            # the copy, not the checkout, was tested
            if not Path(pfl_plugins.__file__).resolve().is_relative_to(copy.resolve()):
                code = 99
        except BaseException:
            code = 98
        os._exit(int(code))
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - start
        time.sleep(0.05)
    if code in (98, 99):
        raise RuntimeError(f"the test child could not run the copy (exit {code})")
    return ("passed" if code == 0 else "failed"), time.perf_counter() - start


def worker(share: list[tuple[str, list[str], list]], sources: dict[str, str], results) -> None:
    """Run one share of (target, tests, mutants) in a private copy of the sources planned."""
    with tempfile.TemporaryDirectory(prefix="pfl-mut-") as tmp:
        copy = copy_repository(Path(tmp))
        for target, tests, mutants in share:
            path = source_file(target)
            (copy / path).write_text(sources[path])
            status, baseline = run_tests_in_child(copy, tests, timeout=1800) if mutants else ("passed", 0)
            for mutation_id in mutants:
                if status != "passed":
                    results.put((target, "baseline-failed", mutation_id, baseline))
                    continue
                (copy / path).write_text(mutated_source(path, sources[path], mutation_id))
                outcome, seconds = run_tests_in_child(copy, tests, timeout=3 * baseline + 10)
                results.put((target, outcome, mutation_id, seconds))
            (copy / path).write_text(sources[path])


def changed_line(path: str, source: str, mutation_id) -> tuple[int, str, str]:
    before = source.split("\n")
    after = mutated_source(path, source, mutation_id).split("\n")
    line = mutation_id.line_number
    return line + 1, before[line].strip(), after[line].strip() if line < len(after) else ""


def score_interval(killed: int, tested: int) -> tuple[float, float]:
    from scipy.stats import binomtest

    if tested == 0:
        return float("nan"), float("nan")
    ci = binomtest(killed, tested).proportion_ci(confidence_level=0.95, method="exact")
    return ci.low, ci.high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", help="plugin folders or core files (default: all)")
    parser.add_argument("--sample", type=int, default=0, help="mutants per target (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--log", type=Path, help="write every mutant's outcome here (JSON lines), as it comes")
    parser.add_argument("--report", type=Path, metavar="LOG", help="only summarise a --log of an earlier (or cut-off) run")
    parser.add_argument("--list", action="store_true", help="print the targets, their tests and mutant counts")
    parser.add_argument("--function", nargs="+", metavar="NAME",
                        help="only the mutants inside the functions (or methods) of these names, as for a change's review")
    args = parser.parse_args(argv)
    if args.report:
        return report_from_log(args.report)
    targets = [t.rstrip("/") for t in args.targets] or list(TESTS)
    unknown = [t for t in targets if t not in TESTS]
    if unknown:
        parser.error(f"no tests are mapped for {', '.join(unknown)} (see TESTS in this script)")

    rng = random.Random(args.seed)
    plan = []
    sources = {source_file(t): (ROOT / source_file(t)).read_text() for t in targets}  # edits during the run do not leak in
    if args.list:
        for target in targets:
            total = len(list_mutants(source_file(target), sources[source_file(target)]))
            print(f"{target:28s} {total:4d} mutants   {' '.join(TESTS[target])}")
        return 0
    for target in targets:
        chosen, total = choose_mutants(source_file(target), sources[source_file(target)], args.sample, rng,
                                       args.function)
        plan.append((target, TESTS[target], chosen, total))

    import multiprocessing as mp

    import torch

    torch.set_num_threads(1)  # before forking: one thread per child, and no thread pool to fork
    context = mp.get_context("fork")
    results = context.Queue()
    # round-robin mutants over the jobs, so every job gets a share of every target
    shares = [[(t, tests, chosen[j :: args.jobs]) for t, tests, chosen, _ in plan] for j in range(args.jobs)]
    processes = [context.Process(target=worker, args=(share, sources, results)) for share in shares]
    for process in processes:
        process.start()
    expected = sum(len(chosen) for _, _, chosen, _ in plan)
    log = open(args.log, "w") if args.log else None  # one JSON line per outcome: a cut-off run still reports
    write_line(log, {"plan": {t: {"mutants": total, "sampled": len(chosen)} for t, _, chosen, total in plan},
                     "sample": args.sample, "seed": args.seed})
    rows, received, start = [], 0, time.perf_counter()
    while received < expected:
        try:
            target, status, mutation_id, seconds = results.get(timeout=5)
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                break  # a worker died: report what came back
            continue
        received += 1
        row = {"target": target, "status": status, "seconds": round(seconds, 2)}
        if status == "passed":
            path = source_file(target)
            row["line"], row["before"], row["after"] = changed_line(path, sources[path], mutation_id)
        rows.append(row)
        write_line(log, row)
        print(f"\r{received}/{expected} mutants, {time.perf_counter() - start:.0f} s", end="", file=sys.stderr)
    for process in processes:
        process.join()
    print(file=sys.stderr)
    return summarise({t: total for t, _, _, total in plan}, rows)


def write_line(log, entry: dict) -> None:
    if log is not None:
        log.write(json.dumps(entry) + "\n")
        log.flush()


def summarise(totals: dict[str, int], rows: list[dict]) -> int:
    """Print the score table and the survivors; exit status 1 if a target's own tests failed."""
    print(f"{'target':28s} {'mutants':>7s} {'tested':>6s} {'killed':>6s} {'timeout':>7s} {'score':>6s}  95% interval")
    broken = False
    for target, total in totals.items():
        mine = [r for r in rows if r["target"] == target]
        if any(r["status"] == "baseline-failed" for r in mine):
            print(f"{target:28s} {total:7d}  the unmutated tests fail: no score")
            broken = True
            continue
        killed = sum(r["status"] != "passed" for r in mine)
        timeouts = sum(r["status"] == "timeout" for r in mine)
        low, high = score_interval(killed, len(mine))
        score = killed / len(mine) if mine else float("nan")
        print(f"{target:28s} {total:7d} {len(mine):6d} {killed:6d} {timeouts:7d} {score:6.1%}  [{low:.1%}, {high:.1%}]")
    tested = [r for r in rows if r["status"] != "baseline-failed"]
    killed = sum(r["status"] != "passed" for r in tested)
    low, high = score_interval(killed, len(tested))
    print(f"{'all':28s} {sum(totals.values()):7d} {len(tested):6d} {killed:6d} {'':7s} "
          f"{killed / max(1, len(tested)):6.1%}  [{low:.1%}, {high:.1%}]")
    for r in sorted((r for r in rows if r["status"] == "passed"), key=lambda r: (r["target"], r["line"])):
        print(f"  survived {source_file(r['target'])}:{r['line']}: {r['before']}  ->  {r['after']}")
    return 1 if broken else 0


def report_from_log(path: Path) -> int:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    totals = {t: entry["mutants"] for t, entry in lines[0]["plan"].items()}
    return summarise(totals, lines[1:])


if __name__ == "__main__":
    sys.exit(main())
