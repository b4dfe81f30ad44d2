"""``pfl new plugin NAME``: a plugin package to start from, written into ``pfl-NAME/``.

The package is complete and installable: ``pyproject.toml`` declares the plugin in the ``pfl``
entry-point group (where :mod:`pfl_core.registry` discovers plugins), ``pfl_NAME/__init__.py``
holds a parameter class and an algorithm with one documented hook, ``spec.toml`` a small offline
experiment and ``tests/test_NAME.py`` its tests. Nothing that exists is overwritten: an existing
folder is refused and nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path

from pfl_core.errors import PflError

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{distribution}"
version = "0.1.0"
description = "{cls}: a pfl plugin."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["pfl"]

# The entry-point group "pfl" is where pfl finds plugins: the name on the left is what a spec
# writes in algorithm.name (keep it equal to the class's `name`), the value is module:Class.
[project.entry-points."pfl"]
{name} = "{module}:{cls}"

[tool.setuptools]
packages = ["{module}"]
'''

MODULE = '''\
"""{cls}: FedAvg whose clients train on a label-smoothed cross-entropy, as a pfl plugin.

A start: rename what you like (keep the entry point in pyproject.toml in step with ``name``),
replace the hook with your method's. pfl's docs/writing-a-plugin.md walks through the hooks;
their contracts are in docs/architecture.md ("The hooks").
"""

import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import WeightAveraging, between, hookimpl


@define
class {cls}Params:
    # Each field is a key of the spec's [algorithm.params], validated when the spec is read.
    smoothing: float = field(default=0.1, validator=between(0, 1, high_open=True),
                             metadata={{"doc": "label smoothing of the clients' cross-entropy (0: FedAvg)"}})


class {cls}(WeightAveraging):
    """FedAvg (broadcast, local training, weighted average: WeightAveraging's hooks) whose
    clients train on a label-smoothed cross-entropy."""

    name = "{name}"  # what a spec writes in algorithm.name: the entry point's name
    Params = {cls}Params

    @hookimpl
    def task_loss(self, ctx, client, logits, y):
        """One mini-batch's task loss in local training, in place of the cross-entropy; every
        other plugin's loss term (an add-on's, FedProx's) is still added to it. A client-side
        hook: use the client and read-only run data (ctx.spec, ctx.num_classes), never
        ctx.server. Returning None would leave the batch to the plain cross-entropy."""
        return F.cross_entropy(logits, y, label_smoothing=self.params.smoothing)
'''

SPEC = '''\
# {name} on FedProx's Synthetic(1, 1) data: offline, no dataset files, seconds on a laptop.
#
#   pfl-run spec.toml --no-tracking
#   pfl-run spec.toml --no-tracking --sweep algorithm.params.smoothing=0.0,0.1

[experiment]
name = "{name}-synthetic"
seed = 0
rounds = 5

[data]
name = "synthetic"
params = {{ num_devices = 8, samples_per_device = 100, dim = 20 }}

[partition]
scheme = "domain"          # one client per generating device
num_clients = 8

[model]
name = "mlp"
params = {{ hidden = [16] }}

[algorithm]
name = "{name}"

[algorithm.params]
smoothing = 0.1

[training]
local_epochs = 1
batch_size = 10
lr = 0.05
'''

TEST = '''\
"""Tests of {name}. Run them after `pip install -e .` (pfl finds the plugin by its entry point):
`pytest tests`."""

from pathlib import Path

import pytest
import torch

from pfl_core.api import Engine, SpecError, resolve

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SPEC = Path(__file__).resolve().parents[1] / "spec.toml"


def spec(rounds=1, **params):
    """spec.toml for ``rounds`` rounds, untracked; ``params`` replace [algorithm.params]."""
    raw = tomllib.loads(SPEC.read_text())
    raw["experiment"]["rounds"] = rounds
    if params:
        raw["algorithm"]["params"] = params
    raw["tracking"] = {{"enabled": False, "progress": False}}
    return raw


def final_weights(raw):
    engine = Engine(resolve(raw), progress=False)
    engine.run()
    return engine.ctx.server["global"]


def test_the_spec_runs():
    result = Engine(resolve(spec()), progress=False).run()
    assert 0.0 <= result.final["acc_mean"] <= 1.0


def test_no_smoothing_is_fedavg_exactly():
    raw = spec(smoothing=0.0)
    mine = final_weights(raw)
    raw["algorithm"] = {{"name": "fedavg"}}
    fedavg = final_weights(raw)
    for key, value in fedavg.items():
        assert torch.equal(mine[key], value), key
    smoothed = final_weights(spec(smoothing=0.5))
    assert any(not torch.equal(smoothed[k], v) for k, v in fedavg.items())


def test_parameters_are_checked_with_their_key():
    with pytest.raises(SpecError, match=r"^algorithm\\.params\\.smoothing: must be in \\[0, 1\\)"):
        resolve(spec(smoothing=1.0))
'''

README = '''\
# {distribution}

`{name}`, a pfl plugin made with `pfl new plugin {name}`: FedAvg whose
clients train on a label-smoothed cross-entropy (the `task_loss` hook). Replace it with your
method; pfl's docs/writing-a-plugin.md walks through the hooks.

```bash
pip install -e .                          # pfl finds the plugin through its entry point
pfl plugins {name}                        # its parameters and hooks
pfl-run spec.toml --no-tracking           # a small offline experiment
pytest tests                              # its tests
```

Files: `pyproject.toml` (the `[project.entry-points."pfl"]` table names the plugin),
`{module}/__init__.py` (the parameters and the plugin), `spec.toml`, `tests/test_{name}.py`.
'''


def class_name(name: str) -> str:
    """``my_method`` -> ``MyMethod``."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise PflError(f"NAME: {name!r} is not a plugin name: lower-case letters, digits and underscores, "
                       f"starting with a letter (e.g. fedmine)")
    from pfl_core import registry

    taken = registry.discovered().get(name)
    if taken is not None:  # two plugins of one name: the first one found wins
        raise PflError(f"NAME: {name!r} is already a plugin (package {taken.distribution} {taken.version}); "
                       f"choose another name")


def package_files(name: str) -> dict[str, str]:
    """The package's files, ``{relative path: text}``."""
    values = {"name": name, "cls": class_name(name), "module": f"pfl_{name}",
              "distribution": f"pfl-{name.replace('_', '-')}"}
    return {
        "pyproject.toml": PYPROJECT.format(**values),
        f"{values['module']}/__init__.py": MODULE.format(**values),
        "spec.toml": SPEC.format(**values),
        f"tests/test_{name}.py": TEST.format(**values),
        "README.md": README.format(**values),
    }


def new_plugin(name: str, parent: str | Path = ".") -> Path:
    """Write the package ``pfl-NAME`` into ``parent``; refuse (PflError, nothing written) when
    the name is not one or is taken, or the folder exists."""
    check_name(name)
    parent = Path(parent)
    if not parent.is_dir():
        raise PflError(f"--dir: {parent} is not a folder")
    target = parent / f"pfl-{name.replace('_', '-')}"
    try:
        target.mkdir()  # exclusive: never into something that exists
    except FileExistsError:
        raise PflError(f"{target} already exists; nothing was written (choose another NAME, or --dir)") from None
    for relative, text in package_files(name).items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target


def add_parser(sub) -> None:
    """``pfl new plugin NAME [--dir DIR]`` on the ``pfl`` command's subparsers."""
    new = sub.add_parser("new", help="start a plugin package from a template: pfl new plugin NAME")
    new.add_argument("what", choices=["plugin"], help="what to create (a plugin package)")
    new.add_argument("name", metavar="NAME", help="the plugin's name, as a spec writes it (e.g. fedmine)")
    new.add_argument("--dir", default=".", help="the folder to create pfl-NAME/ in (default: here)")


def new_main(name: str, parent: str) -> int:
    target = new_plugin(name, parent)
    files = ", ".join(package_files(name))
    print(f"pfl new: wrote {target}/ ({files})")
    print(f"next: pip install -e {target}; pfl plugins {name}; pfl-run {target}/spec.toml --no-tracking")
    return 0
