"""Command line: ``pfl-run SPEC`` runs an experiment; ``pfl plugins [NAME]`` lists plugins (or
documents one); ``pfl results [STUDY]`` lists the studies of an MLflow store (or prints,
exports and draws one); ``pfl docs`` generates the built-in plugins' parameter reference.

Every error a user can cause ends as one line on stderr and exit code 2, never a traceback.
Exit code 3: the runs finished, but their MLflow tracking server was unreachable at the end;
what it missed is in local journals (one line names each), sent by ``pfl replay JOURNAL``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from pfl_core.errors import Interrupted, PflError, defer_interrupt, note_signal

EXIT_USAGE = 2
EXIT_TRACKING_PENDING = 3  # finished; the tracking server missed some of it (kept in journals)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _run_parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Run the experiment a TOML spec describes.")
    parser.add_argument("spec", nargs="?", help="path to the experiment's TOML spec (optional with --resume)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field by its dotted key (TOML value syntax); repeatable")
    parser.add_argument("--sweep", dest="sweeps", action="append", default=[], metavar="KEY=V1,V2",
                        help="add (or replace) a sweep axis: the values, comma-separated or a TOML list; repeatable")
    parser.add_argument("--no-sweep", action="store_true", help="run only the base spec, without its [sweep]")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the spec and the data partition, build every client model once, "
                             "print the resolved spec; train and log nothing")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (overrides tracking.uri)")
    parser.add_argument("--no-tracking", action="store_true", help="do not log to MLflow (tracking.enabled = false)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="also write the results into DIR (new): table.csv (the printed table), comparison.csv, differences.csv, per-client "
                             "CSVs and the spec as run; with or without tracking")
    parser.add_argument("--overwrite", action="store_true", help="let --out replace the results in an existing DIR")
    parser.add_argument("--clients", action="store_true", help="also print each run's per-client table")
    parser.add_argument("--yes", action="store_true",
                        help="run a study of more than 100 runs (sweep points x seeds, references) without asking")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar, no loading line, no locations: only the run summaries and the comparison")
    parser.add_argument("--resume", metavar="PATH_OR_RUN_ID", default=None, nargs="?", const=RESUME_STUDY,
                        help="continue a run from its last good checkpoint (a checkpoint folder, or the MLflow run "
                             "id, in the same MLflow run); with SPEC, the spec must be the run's. SPEC --resume "
                             "(no value): continue the spec's stopped study, keeping its finished tuning trials "
                             "and final runs")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an internal error")
    parser.add_argument("--version", action="version", version=versions_line(prog))
    return parser


REPORT_TO = "please report it, with the command and the spec, to the pfl maintainers"


RESUME_STUDY = "\0study"  # `--resume` given without a value


def run_main(argv: Sequence[str] | None = None, prog: str = "pfl-run") -> int:
    parser = _run_parser(prog)
    args = parser.parse_args(argv)
    if args.resume not in (None, RESUME_STUDY) and args.spec is None and args.resume.endswith(".toml"):
        args.spec, args.resume = args.resume, RESUME_STUDY  # `pfl-run --resume SPEC.toml`: the same
    resume_study = args.resume == RESUME_STUDY
    if resume_study:
        if args.spec is None:
            parser.error("--resume without a run continues a spec's stopped study: give the spec (pfl-run SPEC --resume)")
        args.resume = None
    if args.resume is None and args.spec is None:
        parser.error("the following arguments are required: spec")
    if args.resume is not None:
        clash = [flag for flag, given in (("--dry-run", args.dry_run), ("--sweep", args.sweeps), ("--yes", args.yes),
                                          ("--no-sweep", args.no_sweep), ("--out", args.out),
                                          ("--no-tracking", args.no_tracking)) if given]
        if clash:
            parser.error(f"--resume continues one run as it was started; it does not take {', '.join(clash)}")
    previous = _catch_signals()
    from pfl_core.tracking.journal import UNSENT

    unsent_before = len(UNSENT)
    try:
        from pfl_core.study import resume_run, run_spec_file

        if args.resume is not None:
            results = resume_run(args.resume, args.spec, args.overrides, tracking_uri=args.tracking_uri,
                                 quiet=args.quiet, clients=args.clients)
        else:
            results = run_spec_file(args.spec, args.overrides, dry_run=args.dry_run, tracking_uri=args.tracking_uri,
                                    no_tracking=args.no_tracking, quiet=args.quiet, sweeps=args.sweeps,
                                    no_sweep=args.no_sweep, out_dir=args.out, overwrite=args.overwrite,
                                    clients=args.clients, yes=args.yes, resume=resume_study)
    except PflError as exc:
        print(f"{prog}: error: {escape_newlines(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        print(f"{prog}: {interrupted_line(exc)}", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except Exception as exc:  # last resort: one line, the traceback only when asked for
        if args.debug:
            raise
        print(f"{prog}: internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]} "
              f"(run again with --debug for the traceback; {REPORT_TO})", file=sys.stderr)
        return 1
    finally:
        _restore_signals(previous)
    errors = [e for point in results for run in point.runs for e in run.errors]
    for error in errors:  # the runs finished and were logged; a late step did not
        print(f"{prog}: error: {escape_newlines(error)}", file=sys.stderr)
    if errors:
        return 1
    return _tracking_pending(prog, UNSENT[unsent_before:])


def escape_newlines(message) -> str:
    """An error message as one line: a newline or carriage return a user's value brought in (a
    key, a path, a name) is shown escaped, as Python writes it in a string."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def _tracking_pending(prog: str, journals: list) -> int:
    """Exit 3 when runs of this call ended with their tracking server away (each said where its
    journal is); with several, one command that sends them all."""
    import shlex

    from pfl_core.tracking.journal import Journal

    waiting = [str(f) for f in dict.fromkeys(journals) if Journal(f).pending()]
    if not waiting:
        return 0
    if len(waiting) > 1:
        print(f"{prog}: {len(waiting)} runs' tracking waits in local journals; when the server is back, send "
              f"them all with: pfl replay {' '.join(shlex.quote(w) for w in waiting)}", file=sys.stderr)
    return EXIT_TRACKING_PENDING


def _stop(signum, frame):
    """SIGINT / SIGTERM: stop where the run is (the runs are ended KILLED on the way out); a
    second signal during that clean-up is ignored, so nothing is left half-written."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    note_signal(signum)  # if the exception below is dropped, the engine raises it between rounds
    if defer_interrupt(signum):  # in the middle of a tracking store call: raised when it is done
        return
    raise Interrupted(signum)


def _catch_signals() -> dict | None:
    note_signal(None)
    try:
        return {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave Python's defaults
        return None


def _restore_signals(previous: dict | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def interrupted_line(exc: BaseException) -> str:
    """Where an interrupted run stopped and where its results are, in one line."""
    name = signal.Signals(getattr(exc, "signum", signal.SIGINT)).name
    where = []
    round, rounds = getattr(exc, "round", None), getattr(exc, "rounds", None)
    if round is None:
        text = f"interrupted ({name}) before training started"
    else:
        logged = f"rounds 1..{round - 1} were logged" if round > 1 else "no round was logged"
        text = f"interrupted ({name}) at round {round} of {rounds} of run {exc.run_name!r} ({logged})"
        if exc.run_id:
            where.append(f"MLflow run {exc.run_id} (status KILLED) at {exc.tracking_uri}")
    out_dir = getattr(exc, "out_dir", None)
    if out_dir:
        where.append(f"the runs that finished in {out_dir}/ (marked INCOMPLETE)")
    line = f"{text}; results: {', '.join(where)}" if where else f"{text}; nothing of it was tracked"
    study = getattr(exc, "study_resume", None)  # a study of several runs: the command that completes it
    if study:
        return f"{line}; {study}"
    resume = getattr(exc, "resume", None)
    return f"{line}; continue it with: {resume}" if resume else line


def plugins_main(name: str | None = None) -> int:
    from pfl_core import registry

    if name is not None:
        return plugin_detail(name)

    rows = []
    for plugin, entry in sorted(registry.discovered().items()):
        try:
            cls = registry.plugin_class(plugin)
        except PflError as exc:
            rows.append((plugin, "broken", entry.distribution, entry.version, str(exc)))
            continue
        hooks = registry.implemented_hooks(cls)
        provides = ", ".join(hooks) if hooks else {"dataset": "load", "model": "build",
                                                   "partitioner": "split"}.get(cls.kind, "")
        rows.append((plugin, cls.kind, entry.distribution, entry.version, provides))
    order = {kind: i for i, kind in enumerate(registry.KINDS)}
    rows.sort(key=lambda r: (order.get(r[1], 99), r[0]))
    from pfl_core.registry.docgen import listing_lines

    print("\n".join(listing_lines(("name", "kind", "package", "version", "hooks"), rows)))
    return 0


def plugin_detail(name: str) -> int:
    """``pfl plugins NAME``: the docstring, the parameters (type, default, constraint, meaning;
    the same text ``pfl docs`` renders) and the hooks of one plugin."""
    import inspect
    import textwrap

    from pfl_core import registry
    from pfl_core.errors import did_you_mean
    from pfl_core.registry import docgen

    found = registry.discovered()
    if name not in found:
        print(f"pfl plugins: error: unknown plugin '{name}'{did_you_mean(name, found)}; "
              f"'pfl plugins' lists them all", file=sys.stderr)
        return EXIT_USAGE
    entry = found[name]
    cls = registry.plugin_class(name)  # a broken plugin: PflError, one line
    prefix = {kind: key for kind, _, key in docgen.SECTIONS}.get(cls.kind, f"{cls.kind}.params")
    aliases = sorted(n for n in found if n != name and _same_class(registry, n, cls))
    print(f"{name}  ({cls.kind}, {cls.__module__}:{cls.__qualname__}, package {entry.distribution} "
          f"{entry.version})")
    if aliases:
        print(f"also registered as: {', '.join(aliases)}")
    doc = cls.__dict__.get("__doc__") or sys.modules[cls.__module__].__doc__ or ""
    if doc.strip():
        print()
        print(textwrap.indent(inspect.cleandoc(doc), "  "))
    params = docgen.param_docs(cls, prefix)
    print()
    if not params:
        print("parameters: none")
    else:
        print(f"parameters ({prefix}):")
        for p in params:
            default = p.default.replace("`", "")
            print(f"  {p.key.rsplit('.', 1)[-1]}: {p.type} = {default}"
                  + (f"  [{docgen.markdown_text(p.constraint).replace('`', '')}]" if p.constraint else ""))
            if p.doc:
                print(textwrap.fill(docgen.markdown_text(p.doc).replace("`", ""), 92,
                                    initial_indent="      ", subsequent_indent="      "))
    hooks = registry.implemented_hooks(cls)
    provides = {"dataset": "load", "model": "build", "partitioner": "split"}.get(cls.kind)
    print()
    if hooks:
        print(f"hooks: {', '.join(hooks)}")
    elif provides:
        print(f"hooks: none ({cls.kind} plugins implement {provides}())")
    else:
        print("hooks: none")
    return 0


def _same_class(registry, name: str, cls: type) -> bool:
    try:
        return registry.plugin_class(name) is cls
    except PflError:
        return False


def docs_main(write: str | None, check: str | None) -> int:
    from pfl_core.registry import docgen

    generated = docgen.generate()
    if write is None and check is None:
        sys.stdout.write(generated)
        return 0
    if check is not None:
        if docgen.is_current(check, generated):
            return 0
        print(f"pfl docs: {check} is not current; run: pfl docs --write {check}", file=sys.stderr)
        return 1
    changed = docgen.write(write, generated)
    print(f"pfl docs: {write} {'updated' if changed else 'already current'}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="pfl", description="Personalized federated learning as plugins.")
    parser.add_argument("--version", action="version", version=versions_line("pfl"))
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list installed plugins, their versions and hooks; "
                                             "with NAME, one plugin's documentation")
    plugins.add_argument("name", nargs="?", metavar="NAME",
                         help="show this plugin's docstring, parameters (type, default, constraint) and hooks")
    sub.add_parser("run", help="run a spec (same as pfl-run)", add_help=False)
    from pfl_core.cli import new_plugin

    new_plugin.add_parser(sub)  # pfl new plugin NAME
    replay = sub.add_parser("replay", help="send what runs could not log while their MLflow tracking server "
                                           "was away (their journals) to the server")
    replay.add_argument("journals", nargs="+", metavar="JOURNAL",
                        help="a journal folder, or a folder holding journals (a run's checkpoint folder, pfl-journal/)")
    replay.add_argument("--tracking-uri", default=None,
                        help="send to this MLflow store instead of the one the journal was written for")
    results = sub.add_parser("results", help="list the studies an MLflow store holds; with STUDY, print its "
                                             "comparison table (or export it, or draw its curves)")
    results.add_argument("study", nargs="?", metavar="STUDY",
                         help='a study id (or a prefix of one), an experiment name prefix (its newest study), or "last"')
    results.add_argument("--tracking-uri", default=None,
                         help="the MLflow store to read (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    results.add_argument("--format", dest="fmt", choices=["table", "markdown", "latex", "csv"], default="table",
                         help="table: as pfl-run printed it; markdown, latex (mean ± ci, best in bold), csv")
    results.add_argument("--plot", metavar="PNG", default=None,
                         help="also draw each method's mean curve over seeds with its 95%% band into this file")
    results.add_argument("--metric", default="acc_mean", help="the metric --plot draws (default acc_mean)")
    results.add_argument("--paired", metavar="A,B", default=None,
                         help="instead of the table: per point, metric A against metric B of the same runs, "
                              "paired by seed (e.g. lambda_corrupted_mean,lambda_clean_mean), in --format (table: Markdown)")
    docs = sub.add_parser("docs", help="print the built-in plugins' parameter reference (Markdown), or "
                                       "write it into a file's generated region")
    target = docs.add_mutually_exclusive_group()
    target.add_argument("--write", metavar="FILE", help="replace the generated region of FILE "
                                                          "(docs/spec-reference.md)")
    target.add_argument("--check", metavar="FILE", help="exit 1 if FILE's generated region is not current")
    if argv[:1] == ["run"]:
        return run_main(argv[1:], prog="pfl run")
    if not argv:  # `pfl` alone: what it can do, not an argparse error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        if args.command == "plugins":
            return plugins_main(args.name)
        if args.command == "docs":
            return docs_main(args.write, args.check)
        if args.command == "new":
            return new_plugin.new_main(args.name, args.dir)
        if args.command == "results":
            from pfl_core.study.stored import results_main

            if args.plot is not None and args.study is None:
                parser.error("--plot draws one study: give STUDY (or \"last\")")
            paired = None
            if args.paired is not None:
                paired = tuple(m.strip() for m in args.paired.split(","))
                if len(paired) != 2 or not all(paired) or paired[0] == paired[1]:
                    raise PflError(f"--paired: give two different metrics as A,B (got {args.paired!r})")
                if args.study is None:
                    raise PflError("--paired compares within one study: give STUDY (or \"last\")")
            return results_main(args.study, args.tracking_uri, args.fmt, args.plot, args.metric, sys.stdout, paired)
        if args.command == "replay":
            from pfl_core.tracking.journal import replay_main

            return replay_main(args.journals, args.tracking_uri)
    except BrokenPipeError:  # `pfl plugins | head`
        sys.stderr.close()
        return 0
    except PflError as exc:
        print(f"pfl {args.command}: error: {escape_newlines(exc)}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


def versions_line(prog: str) -> str:
    """``pfl-run 0.2.0 (torch 2.14.1, torchvision 0.29.1, mlflow 3.17.2, Python 3.11.7)``: what a
    bug report needs, read from the installed distributions' metadata (nothing imported)."""
    import platform

    from pfl_core._version import __version__, installed_version

    others = ", ".join(f"{name} {installed_version(name) or 'not installed'}"
                       for name in ("torch", "torchvision", "mlflow"))
    return f"{prog} {__version__} ({others}, Python {platform.python_version()})"


def _entry(fn) -> None:
    sys.exit(fn())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
