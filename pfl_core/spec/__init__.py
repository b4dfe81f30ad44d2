"""The experiment spec: its schema, validators, TOML reading and writing, overrides and sweeps.

- :mod:`~pfl_core.spec.validators`: field validators and the limits no spec may exceed;
- :mod:`~pfl_core.spec.schema`: one attrs class per TOML section, :class:`Spec` the whole file;
- :mod:`~pfl_core.spec.convert`: strict structuring (cattrs), errors with their key path;
- :mod:`~pfl_core.spec.tomlio`: reading a spec file or a ``--set`` value, writing TOML;
- :mod:`~pfl_core.spec.overrides`: ``--set``/``--sweep`` and the expansion of ``[sweep]``.

Everything is re-exported here, so ``from pfl_core.spec import at_least, Spec`` keeps working.
"""

from pfl_core.spec.convert import RENAMED_KEYS, converter, join_path, make_converter, shown, structure, unstructure
from pfl_core.spec.overrides import POINTS, apply_overrides, expand_sweep, set_dotted, split_key, swept_axes_replaced
from pfl_core.spec.schema import (
    CheckpointSection,
    DataSection,
    EvaluationSection,
    ExecutorSection,
    ExperimentSection,
    ModelSection,
    PartitionSection,
    PluginRef,
    PublicSection,
    Spec,
    StateSection,
    TrackingSection,
    TrainingSection,
)
from pfl_core.spec.tomlio import check_nesting, dump_toml, load_toml, parse_value, tomllib
from pfl_core.spec.validators import (
    FLOAT_MAX,
    INT_MAX,
    INT_MIN,
    MAX_CLIENTS,
    MAX_NESTING,
    MAX_SPEC_BYTES,
    MAX_SWEEP_POINTS,
    FieldError,
    at_least,
    at_most,
    between,
    choices_text,
    describe_int,
    described,
    finite,
    greater_than,
    learning_rate,
    one_of,
)

__all__ = [
    "FLOAT_MAX", "CheckpointSection", "DataSection", "EvaluationSection", "ExecutorSection", "ExperimentSection", "FieldError",
    "INT_MAX", "INT_MIN", "MAX_CLIENTS", "MAX_NESTING", "MAX_SPEC_BYTES", "MAX_SWEEP_POINTS", "ModelSection",
    "POINTS", "PartitionSection", "PluginRef", "PublicSection", "RENAMED_KEYS", "Spec", "StateSection",
    "TrackingSection", "TrainingSection", "apply_overrides", "at_least", "at_most", "between", "check_nesting",
    "choices_text", "converter", "describe_int", "described", "dump_toml", "expand_sweep", "finite",
    "greater_than", "join_path", "learning_rate", "load_toml", "make_converter", "one_of", "parse_value",
    "set_dotted", "shown", "split_key", "structure", "swept_axes_replaced", "tomllib", "unstructure",
]
