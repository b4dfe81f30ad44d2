"""What a divergence line names: the settings of the run that scale a client's update."""

from __future__ import annotations

import attrs

from pfl_core.registry import Plugin
from pfl_core.spec import Spec


def update_settings(spec: Spec, plugins: list[Plugin]) -> list[str]:
    """``key (now value)`` for every setting of this run that scales a client's update, the
    candidates a divergence names (issue 33: a huge weight_decay or FedProx mu was blamed on lr):
    ``training.lr``; ``training.momentum`` (sgd) and ``training.weight_decay`` where not 0; and
    each method's and add-on's float parameters given a value other than their default (mu,
    a server or personal step size, ...), which enter its local objective or its steps. A
    default is the method's tested setting, so a parameter left at it is not a suspect."""
    training = spec.training
    out = [f"training.lr (now {training.lr})"]
    if training.momentum and training.optimizer == "sgd":
        out.append(f"training.momentum (now {training.momentum})")
    if training.weight_decay:
        out.append(f"training.weight_decay (now {training.weight_decay})")
    for plugin in plugins:
        if not attrs.has(type(plugin.params)):
            continue
        for field in attrs.fields(type(plugin.params)):
            value = getattr(plugin.params, field.name)
            if isinstance(value, float) and value != field.default:
                out.append(f"{plugin.spec_path}.params.{field.name} (now {value})")
    return out


def lower_advice(spec: Spec, plugins: list[Plugin]) -> str:
    """What a divergence line tells the user to lower: the one setting, or every candidate."""
    settings = update_settings(spec, plugins)
    if len(settings) == 1:
        return f"lower {settings[0]}"
    return f"lower whichever of {', '.join(settings[:-1])} and {settings[-1]} is too large"
