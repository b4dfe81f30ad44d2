"""Run state on disk, safe to load: nested plain values and tensors in one safetensors file.

Client states, server states and checkpoints are nested dicts/lists of tensors, numpy arrays,
numbers, strings, booleans and None. ``save`` writes the tensors as safetensors and the
nesting as JSON in the file's metadata, so loading never unpickles anything (a file handed
to a user cannot run code). A SHA-256 over the skeleton and every tensor's bytes is stored
beside them: a truncated or corrupted file is detected on load (``CorruptStateError``).
Writes are atomic (a temporary file in the same folder, fsync, then rename), so a crash
mid-write leaves the previous file intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "pfl-state/1"


class CorruptStateError(Exception):
    """The file is not a complete pfl state file (truncated, altered, or another format)."""


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of ``value``; tensors and arrays go to ``tensors`` under new names."""
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        # clone: safetensors refuses tensors that share storage (views of one buffer)
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("object arrays cannot be saved safely")
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value)).clone()
        return {"__ndarray__": name}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"dict keys must be str or int, not {type(key).__name__}")
            items.append([key, _encode(item, tensors)])
        return {"__dict__": items}
    if isinstance(value, (list, tuple)):
        return {"__tuple__" if isinstance(value, tuple) else "__list__": [_encode(v, tensors) for v in value]}
    raise TypeError(f"cannot save a {type(value).__name__} in a state file")


def _decode(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__ndarray__" in skeleton:
            return tensors[skeleton["__ndarray__"]].numpy()
        if "__dict__" in skeleton:
            return {key: _decode(item, tensors) for key, item in skeleton["__dict__"]}
        if "__list__" in skeleton:
            return [_decode(v, tensors) for v in skeleton["__list__"]]
        if "__tuple__" in skeleton:
            return tuple(_decode(v, tensors) for v in skeleton["__tuple__"])
        raise CorruptStateError(f"unknown entry {sorted(skeleton)} in the state skeleton")
    return skeleton


def _digest(skeleton: str, tensors: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256(skeleton.encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        sha.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return sha.hexdigest()


def dumps(value: Any) -> bytes:
    """``value`` as the bytes of a safetensors file (see the module docstring)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(value, tensors))
    metadata = {"format": FORMAT, "skeleton": skeleton, "sha256": _digest(skeleton, tensors)}
    return save(tensors, metadata=metadata)


def loads(data: bytes) -> Any:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
    except (SafetensorError, ValueError, OverflowError, json.JSONDecodeError) as exc:
        raise CorruptStateError(f"not a readable safetensors file ({' '.join(str(exc).split())[:120]})") from None
    if metadata.get("format") != FORMAT or "skeleton" not in metadata:
        raise CorruptStateError("not a pfl state file (no pfl skeleton in its metadata)")
    if _digest(metadata["skeleton"], tensors) != metadata.get("sha256"):
        raise CorruptStateError("checksum mismatch: the file was altered or is incomplete")
    return _decode(json.loads(metadata["skeleton"]), tensors)


def write_atomic(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """A new file replacing ``path`` (a new inode: a hard link to the old file keeps it), so a
    reader sees the old file or the new one; ``durable``: fsync before the rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` to ``path`` atomically and durably."""
    write_atomic(path, dumps(value))


def load(path: str | os.PathLike) -> Any:
    """The value ``save`` wrote; ``CorruptStateError`` if the file is truncated or altered."""
    return loads(Path(path).read_bytes())
