"""Federated data kept between runs (the trials of a tuning study): ``DataCache``, and the
fingerprint that tells whether a run changed the data it was handed (``data_fingerprint``);
the data a study's check built, handed to its first run (``hand_over``, ``take_handed_over``)."""

from __future__ import annotations

import copy
import hashlib
from typing import Union

import attrs
import numpy as np
import torch

from pfl_core.data.federated import ClientData, FederatedData, PublicData, build_federated_data

__all__ = ["DataCache", "data_fingerprint", "data_key", "data_parts", "drop_handed_over", "hand_over", "take_handed_over"]

_STRUCTURE = (torch.Tensor, np.ndarray, list, dict)


def data_parts(data: FederatedData) -> list:
    """Every container, tensor and index array of ``data``, in a fixed order (a worker holding
    a forked copy of ``data`` walks its copy in the same order)."""
    parts: list = []

    def walk(obj) -> None:
        parts.append(obj)
        if isinstance(obj, (FederatedData, ClientData, PublicData)):
            children = [getattr(obj, field.name) for field in attrs.fields(type(obj))]
        elif isinstance(obj, (list, dict)):
            children = list(obj.values()) if isinstance(obj, dict) else obj
        else:
            return
        for child in children:
            if isinstance(child, (*_STRUCTURE, ClientData, PublicData)):
                walk(child)

    walk(data)
    return parts


def _plain(values) -> tuple:
    return tuple(v for v in values if isinstance(v, (int, float, str, tuple, type(None))))


def data_fingerprint(data: FederatedData) -> tuple:
    """What changes when anything changes ``data`` in place or replaces a part of it: every
    part's identity; a tensor's version counter (torch bumps it at every in-place change of the
    tensor or of a view of it), storage and shape; an index array's bytes; the scalar fields and
    list items (a container's length shows in the parts walked). Writes that bypass the version
    counter (through ``tensor.data`` or a numpy view of a tensor) are not seen: data is
    read-only to plugins (docs/architecture.md)."""
    out: list = []
    for part in data_parts(data):
        if isinstance(part, torch.Tensor):
            out.append((id(part), part._version, part.data_ptr(), tuple(part.shape)))
        elif isinstance(part, np.ndarray):
            out.append((id(part), part.shape, hashlib.blake2b(np.ascontiguousarray(part).view(np.uint8)).digest()))
        elif isinstance(part, dict):
            out.append((id(part), tuple(part), _plain(part.values())))
        elif isinstance(part, list):
            out.append((id(part), _plain(part)))  # its length: the parts walked
        else:  # FederatedData, ClientData, PublicData
            out.append((id(part), _plain(getattr(part, f.name) for f in attrs.fields(type(part)))))
    return tuple(out)


def data_key(spec, device: str | torch.device = "cpu") -> str:
    """What :func:`build_federated_data` builds from: two specs with the same key build equal data."""
    from pfl_core.spec import unstructure

    return repr([unstructure(spec.data), unstructure(spec.partition), unstructure(spec.public),
                 spec.experiment.seed, str(device)])


# One data set at most: what a study's check built for the run that starts next (a 200 MB npz
# took 3.7 s to build, twice). Taken once, by whichever run asks first; a run of other data drops it.
_handed_over: dict[str, FederatedData] = {}


def hand_over(spec, data: FederatedData, device: str | torch.device = "cpu") -> None:
    """Keep ``data`` (built from ``spec``, not used since) for the next :func:`take_handed_over`."""
    _handed_over.clear()
    _handed_over[data_key(spec, device)] = data


def take_handed_over(spec, device: str | torch.device = "cpu") -> FederatedData | None:
    """The data :func:`hand_over` kept if it was built from what ``spec`` builds, else None; either
    way nothing is kept after (the next run builds its own)."""
    data = _handed_over.pop(data_key(spec, device), None)
    _handed_over.clear()
    return data


def drop_handed_over() -> None:
    """Forget what :func:`hand_over` kept (a study that ended before its first run took it)."""
    _handed_over.clear()


class DataCache:
    """Federated data built once per (data, partition, public set, seed, device) and handed out
    to the trials of a tuning study, which differ in training settings only: they pay the
    loading and partitioning once. A run hands its data back (``release``); the next run of the
    same data gets that same object when nothing changed it (``data_fingerprint``), so a process
    pool forked with it can serve the next trial; else a fresh deep copy of the first build, so
    a trial that changed its data (a plugin flipping labels) cannot reach the next one."""

    def __init__(self):
        self._built: dict[str, FederatedData] = {}
        self._idle: dict[str, tuple[FederatedData, tuple]] = {}  # handed back, with its fingerprint as handed out
        self._out: dict[int, tuple[str, tuple]] = {}  # id of a copy in use -> (key, fingerprint as handed out)

    def get(self, spec, device: Union[str, torch.device] = "cpu") -> FederatedData:
        key = data_key(spec, device)
        if key not in self._built:
            self._built[key] = build_federated_data(spec, device=device)
        idle = self._idle.pop(key, None)
        if idle is not None and data_fingerprint(idle[0]) == idle[1]:
            data, fingerprint = idle
        else:
            data = copy.deepcopy(self._built[key])
            fingerprint = data_fingerprint(data)
        self._out[id(data)] = (key, fingerprint)
        return data

    def release(self, data: FederatedData) -> None:
        """``data`` (from ``get``) is no longer in use: the next ``get`` of its key may hand it
        out again if it is unchanged."""
        handed = self._out.pop(id(data), None)
        if handed is not None:
            self._idle[handed[0]] = (data, handed[1])
