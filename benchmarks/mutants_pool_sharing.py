#!/usr/bin/env python
"""Hand-written mutants of the code that lets tuning trials share their data and their process
pool (issue 21): each mutant is applied to the working tree, the pool-sharing tests run, and
the file is restored. A script, not a test; run from the repository root:

    OMP_NUM_THREADS=1 python benchmarks/mutants_pool_sharing.py

(mutmut's own mutants of these files are mostly operator swaps the fingerprint cannot tell
apart from each other; these are the bugs a reviewer would fear: a version counter ignored, a
changed copy handed out again, a worker left on the previous trial's run.)
"""
import shutil
import subprocess
import sys
from pathlib import Path

MUTANTS = [
 ("pfl_core/data/cache.py", "out.append((id(part), part._version, part.data_ptr(), tuple(part.shape)))", "out.append((id(part), part.data_ptr(), tuple(part.shape)))"),
 ("pfl_core/data/cache.py", "out.append((id(part), _plain(part)))  # its length", "out.append((id(part), ()))  # its length"),
 ("pfl_core/data/cache.py", "if idle is not None and data_fingerprint(idle[0]) == idle[1]:", "if idle is not None:"),
 ("pfl_core/data/cache.py", "        self._out[id(data)] = (key, fingerprint)\n", "        self._out[id(data)] = (key, data_fingerprint(data))\n        self._out.pop(id(data))\n"),
 ("pfl_core/data/cache.py", "            self._idle[handed[0]] = (data, handed[1])", "            pass"),
 ("pfl_core/data/cache.py", "            if isinstance(child, (*_STRUCTURE, ClientData, PublicData)):", "            if isinstance(child, (*_STRUCTURE, ClientData)):"),
 ("pfl_core/execution/process.py", "            update = self._update if split is not None and len(self._current) < self.workers else None", "            update = self._update if split is not None and len(self._current) < 1 else None"),
 ("pfl_core/execution/process.py", "                    self._current.add(slot)  # maps", "                    pass  # maps"),
 ("pfl_core/execution/process.py", "    if call is not None and generation != _pool_generation:", "    if call is None and generation != _pool_generation:"),
 ("pfl_core/execution/process.py", "                or data_fingerprint(constant[\"data\"]) != self._run_pool_fingerprint):", "                ):"),
 ("pfl_core/execution/planner.py", "        kept = self._kept.pop((name, workers, threads, retries), None) if name == \"process\" else None", "        kept = None"),
 ("pfl_core/study/tune.py", "or DIVERGED in t.user_attrs]", "]"),
]
tests = ["tests/test_pool_reuse.py", "tests/test_tune.py::test_a_diverged_trial_fails_alone_and_counts_in_the_budget"]
BACKUP = ".mutant_backup"
killed = 0
for i, (path, old, new) in enumerate(MUTANTS):
    src = Path(path).read_text()
    assert src.count(old) == 1, (i, old)
    shutil.copy(path, BACKUP)
    Path(path).write_text(src.replace(old, new))
    try:
        r = subprocess.run([".venv/bin/python", "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider", *tests],
                           capture_output=True, text=True, check=False, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    finally:
        shutil.copy(BACKUP, path)
    status = "killed" if r.returncode != 0 else "SURVIVED"
    killed += r.returncode != 0
    print(i, status, path, new.strip()[:80], flush=True)
print(f"{killed}/{len(MUTANTS)} killed")
sys.exit(0)
