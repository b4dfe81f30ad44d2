"""Every built-in method through the in-process Flower grid (tests/test_flower.py's LoopbackGrid)
against pfl's sequential loop on tests/tiny.py's 3-client spec, 3 rounds: one line per method,
"identical", "DIFFERENT" or the one-line refusal (docs/deployment.md, "Which methods run").

    python scripts/flower_every_method.py [NAME ...]      # needs the flower extra
"""
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from flwr.supercore.task_identity import TaskIdentity

for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
    setattr(TaskIdentity, name, value)
import test_flower as tf
from harness import NEEDS, builtin_algorithms

from pfl_core.engine import Engine, resolve
from pfl_core.spec import set_dotted

names = sys.argv[1:] or builtin_algorithms()
for name in names:
    raw = tf.three_client_raw(name)
    for k, v in NEEDS.get(name, {}).items():
        set_dotted(raw, k, v)
    try:
        ref = Engine(resolve(raw), progress=False).run()
        with tempfile.TemporaryDirectory() as d:
            grid = tf.grid_of(0, 1, 2)
            for cfg in grid.node_configs.values():
                cfg["state-dir"] = str(pathlib.Path(d) / "nodes")
            got = tf.run_on_loopback(raw, grid, pathlib.Path(d))
        same = tf.comparable(got.history) == tf.comparable(ref.history)
        print(f"{name}\t{'identical' if same else 'DIFFERENT'}", flush=True)
    except Exception as exc:  # noqa: BLE001 - any failure is this method's line
        print(f"{name}\tERROR {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", flush=True)
