"""pfl's messages as Flower records (docs/deployment.md, "Wire format").

A task's or a result's tensors and numpy arrays travel in an ``ArrayRecord`` (numpy format: never
pickled), their nesting and plain values as JSON in a ``ConfigRecord``; a value that is none of
tensor, array, number, string, bool, None, list, tuple, dict (str or int keys) or a few pfl value
classes (``VALUE_CLASSES``) is pickled into a ``pickle/N`` entry of the ``ConfigRecord``. A node's
error travels as its class's name and message (``error_fields``, ``raise_error``), never pickled.
flwr is imported only inside functions (``flower()``)."""

from __future__ import annotations

import collections
import json
import pickle

import attrs
import numpy as np
import torch

from pfl_core import errors as pfl_errors
from pfl_core.errors import PflError
from pfl_core.execution.process import _pickled, _worker_error
from pfl_core.payload import Packed
from pfl_core.registry.budget import WorkCounter
from pfl_core.runtime.client import ClientTask, run_client
from pfl_core.runtime.evaluation import EvaluationTask, Score, evaluate_client

FLOWER_MISSING = "Flower is not installed (optional extra: pip install -e '.[flower]')"
RECORD = "pfl"  # the ConfigRecord every pfl message carries, both ways
ARRAYS = "pfl-arrays"  # the ArrayRecord of a message's tensors and arrays
CALLS = {run_client: ("train", ClientTask), evaluate_client: ("evaluate", EvaluationTask)}  # what a node runs
VALUE_CLASSES = {cls.__name__: cls for cls in (Score, WorkCounter, Packed)}  # rebuilt field by field


def flower():
    """flwr's ``app``, ``serverapp`` and ``clientapp`` modules, or one line naming the extra."""
    try:
        from flwr import app, clientapp, serverapp
    except ImportError:
        raise PflError(FLOWER_MISSING) from None
    return app, serverapp, clientapp


class _Packer:
    """A value as (JSON skeleton, arrays, pickles): tensors and numpy arrays go to ``arrays``
    (one entry per distinct object), the nesting and plain values to the skeleton, anything
    else to ``pickles``."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.pickles: dict[str, bytes] = {}
        self._seen: dict[int, str] = {}  # id of a tensor or array already packed -> its name

    def _array(self, value, array: np.ndarray) -> str:
        name = self._seen.get(id(value))
        if name is None:
            name = self._seen[id(value)] = f"a{len(self.arrays)}"
            self.arrays[name] = array
        return name

    def pack(self, value):
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter) \
                and value.layout == torch.strided and value.dtype != torch.bfloat16 and not value.is_quantized:
            entry = {"tensor": self._array(value, value.detach().to("cpu").resolve_conj().resolve_neg().numpy())}
            if value.device.type != "cpu":
                entry["device"] = str(value.device)
            if value.requires_grad:
                entry["grad"] = True
            if type(value) is torch.nn.Parameter:
                entry["parameter"] = True
            return entry
        if isinstance(value, np.ndarray) and type(value) is np.ndarray and value.dtype != object:
            return {"ndarray": self._array(value, value)}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return {"scalar": self._array(value, np.asarray(value))}
        if value is None or type(value) in (bool, int, float, str):
            return value
        if type(value) in (dict, collections.OrderedDict) and all(
                type(k) in (str, int) for k in value):
            kind = "dict" if type(value) is dict else "odict"
            return {kind: [[k, self.pack(v)] for k, v in value.items()]}
        if type(value) in (list, tuple):
            return {type(value).__name__: [self.pack(v) for v in value]}
        if type(value) in VALUE_CLASSES.values() and VALUE_CLASSES[type(value).__name__] is type(value):
            return {"value": type(value).__name__,
                    "fields": [[f.name, self.pack(getattr(value, f.name))] for f in attrs.fields(type(value))]}
        name = f"pickle/{len(self.pickles)}"
        self.pickles[name] = _pickled(value)
        return {"pickle": name}


def _unpack(skeleton, arrays: dict, pickles: dict, tensors: dict | None = None):
    """The value ``_Packer.pack`` took apart (``tensors``: those made so far, by array name:
    a tensor packed twice comes back as one object)."""
    if not isinstance(skeleton, dict):
        return skeleton
    tensors = {} if tensors is None else tensors
    (kind, body), *rest = skeleton.items()
    if kind == "tensor":
        if body in tensors:
            return tensors[body]
        tensors[body] = tensor = _tensor(arrays[body], dict(rest))
        return tensor
    if kind == "ndarray":
        return arrays[body]
    if kind == "scalar":
        return arrays[body][()]
    if kind in ("dict", "odict"):
        items = ((k, _unpack(v, arrays, pickles, tensors)) for k, v in body)
        return dict(items) if kind == "dict" else collections.OrderedDict(items)
    if kind == "list":
        return [_unpack(v, arrays, pickles, tensors) for v in body]
    if kind == "tuple":
        return tuple(_unpack(v, arrays, pickles, tensors) for v in body)
    if kind == "value":
        fields = dict(rest)["fields"]
        return VALUE_CLASSES[body](**{name: _unpack(v, arrays, pickles, tensors) for name, v in fields})
    if kind == "pickle":
        return pickle.loads(pickles[body])
    raise PflError(f"flower: a message holds an unknown entry {kind!r} (pfl versions differ between server and node?)")


def _tensor(array: np.ndarray, extra: dict) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if "device" in extra:
        tensor = tensor.to(extra["device"])
    if extra.get("parameter"):
        return torch.nn.Parameter(tensor, requires_grad=bool(extra.get("grad")))
    return tensor.requires_grad_(True) if extra.get("grad") else tensor


def to_content(fields: dict, body=None):
    """A message's ``RecordDict``: ``fields`` (plain values and bytes) and ``body`` packed into
    the ``ConfigRecord`` (its skeleton as JSON, its pickles), its arrays into the ``ArrayRecord``."""
    app = flower()[0]
    config = dict(fields)
    records = {}
    if body is not None:
        packer = _Packer()
        config["body"] = json.dumps(packer.pack(body))
        config.update(packer.pickles)
        if packer.arrays:
            records[ARRAYS] = app.ArrayRecord({name: app.Array(array) for name, array in packer.arrays.items()})
    return app.RecordDict({RECORD: app.ConfigRecord(config), **records})


def from_content(content) -> tuple[dict, object]:
    """(fields, body) of a message ``to_content`` made."""
    config = dict(content[RECORD])
    if "body" not in config:
        return config, None
    arrays = {}
    if ARRAYS in content.array_records:
        arrays = {name: array.numpy() for name, array in content[ARRAYS].items()}
    pickles = {name: config.pop(name) for name in list(config) if name.startswith("pickle/")}
    return config, _unpack(json.loads(config.pop("body")), arrays, pickles)


def content_bytes(content) -> int:
    """The bytes of a message's records, as Flower counts them."""
    return sum(record.count_bytes() for record in content.values())


def error_fields(exc: BaseException) -> dict:
    """An exception as the fields a node sends back: its class's module and name, the pfl
    error class it derives from, its message (rebuilt by ``raise_error``, never unpickled)."""
    base = next((c for c in type(exc).__mro__ if c.__module__ == PflError.__module__ and issubclass(c, Exception)),
                Exception)
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ still ends the run with its class's name
        message = "(its message could not be made)"
    return {"error-module": type(exc).__module__, "error-class": type(exc).__qualname__,
            "error-base": base.__name__, "error": message}


def raise_error(fields: dict, prefix: str = "") -> None:
    """The exception a node's client side raised, raised here as a stand-in of its class (its
    name, its message after ``prefix``, the pfl error class it derived from)."""
    if "error" in fields:
        base = getattr(pfl_errors, fields["error-base"], Exception)
        base = base if isinstance(base, type) and issubclass(base, Exception) else Exception
        raise _worker_error(fields["error-module"], fields["error-class"], base, prefix + fields["error"])
