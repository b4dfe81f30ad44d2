"""Start-up stays light: a ``--dry-run`` of the quickstart imports none of the heavy optional
libraries (they cost seconds to import) and no plugin the spec does not name.

Checked in a fresh interpreter, since this test process has imported everything already.
Timing is left to ``benchmarks/startup.py``; here only what gets imported is asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[1] / "specs" / "quickstart.toml"

#: Imported lazily, only when a run needs them: tracking (mlflow), a figure (matplotlib), a
#: torchvision dataset or model (torchvision), repeat-seed statistics (scipy).
HEAVY = ("mlflow", "matplotlib", "torchvision", "scipy")

#: The quickstart's sweep names these algorithms; its data, partitioner and model are built in.
NAMED_PLUGINS = ("pfl_plugins.local", "pfl_plugins.fedavg", "pfl_plugins.centralized")

PROBE = f"""
import io, json, sys
from contextlib import redirect_stdout

def plugin_modules():
    return sorted(m for m in sys.modules if m.startswith("plugins."))

# What the named plugins import by themselves is allowed; anything beyond it means discovery
# (or the dry run) imported plugins the spec does not name.
import {", ".join(NAMED_PLUGINS)}
plugins_of_the_spec = plugin_modules()

from pfl_core.cli import run_main
printed = io.StringIO()
with redirect_stdout(printed):
    code = run_main(["--dry-run", {str(QUICKSTART)!r}])
print(json.dumps({{
    "code": code,
    "printed": printed.getvalue(),
    "heavy": sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r}),
    "plugins_of_the_spec": plugins_of_the_spec,
    "plugins_after": plugin_modules(),
}}))
"""


def test_quickstart_dry_run_imports_no_heavy_library_and_only_the_named_plugins(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd: a dry run must not write anything, but if it did, not into the repository
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    # The dry run really ran: it succeeded and printed the resolved spec of each sweep point.
    assert seen["code"] == 0, proc.stderr
    assert seen["printed"].count('name = "synthetic"') == 3, seen["printed"]
    assert seen["heavy"] == [], f"a --dry-run imported {seen['heavy']}"
    assert seen["plugins_after"] == seen["plugins_of_the_spec"]
