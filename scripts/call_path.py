"""Follow one spec from the command line through pfl_core: which modules a run passes through,
and how often the path goes back into a module it had already left.

    python scripts/call_path.py specs/quickstart.toml --set experiment.rounds=2 --no-tracking

Runs ``pfl_core.cli.run_main`` on the arguments under ``sys.setprofile`` and records each call
that crosses from one pfl_core module into another (an *entry*). A *return to a module already
left* is an entry into a module that is not on the call stack but was entered before (the path
went down through it, came back up, and enters it again). Calls within a module, into plugins
or into other libraries, and everything that runs while a module is being imported, are not
counted (nor the import machinery of pfl_core._deprecated). ``--level package`` counts pfl_core's packages (``pfl_core.study``) instead of modules.

Prints the modules in the order first entered, the number of returns, and the modules entered
most often.
"""

from __future__ import annotations

import collections
import io
import sys
from contextlib import redirect_stderr, redirect_stdout


def module_of(frame, level: str) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if not (name == "pfl_core" or name.startswith("pfl_core.")) or name == "pfl_core._deprecated":
        return None
    return ".".join(name.split(".")[:2]) if level == "package" else name


def trace(argv: list[str], level: str = "module") -> tuple[list[str], collections.Counter, collections.Counter]:
    from pfl_core.cli import run_main

    entered: list[str] = []  # modules in the order first entered
    entries: collections.Counter = collections.Counter()
    returns: collections.Counter = collections.Counter()
    stack: list[str | None] = []
    importing = [0]  # depth of module bodies being executed (import time)

    def profile(frame, event, _arg):
        if event == "call":
            if frame.f_code.co_name == "<module>":
                importing[0] += 1
                stack.append(None)
                return
            module = module_of(frame, level) if not importing[0] else None
            caller = next((m for m in reversed(stack) if m is not None), None)
            if module is not None and module != caller:
                entries[module] += 1
                if module not in entered:
                    entered.append(module)
                elif module not in stack:
                    returns[module] += 1
            stack.append(module)
        elif event == "return" and stack:
            if frame.f_code.co_name == "<module>":
                importing[0] -= 1
            stack.pop()

    sys.setprofile(profile)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            run_main(argv)
    finally:
        sys.setprofile(None)
    return entered, entries, returns


def main() -> None:
    argv = sys.argv[1:]
    level = "module"
    if argv[:2] == ["--level", "package"]:
        level, argv = "package", argv[2:]
    entered, entries, returns = trace(argv, level)
    print(f"{level}s entered: {len(entered)}")
    print("  " + " -> ".join(m.removeprefix("pfl_core.") for m in entered))
    print(f"returns to a {level} already left: {sum(returns.values())}")
    print("entered most often: " + ", ".join(f"{m} {n}" for m, n in entries.most_common(6)))


if __name__ == "__main__":
    main()
