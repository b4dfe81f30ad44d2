"""pfl_core/state/stateio.py: nested state round-trips exactly, and damaged files are detected."""

import math

import numpy as np
import pytest
import torch

from pfl_core.state import stateio


def sample_state():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "weights": {"fc.weight": base, "fc.bias": base[0]},  # a view sharing storage
        3: [1, 2.5, None, True, "text", (4, "five")],
        "hist": np.array([[1, 2], [3, 4]], dtype=np.int64),
        "scalar": np.float32(0.25),
        "nan": float("nan"),
        "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 5),
    }


def test_round_trip_keeps_types_keys_and_values(tmp_path):
    path = tmp_path / "state.safetensors"
    stateio.save(path, sample_state())
    back = stateio.load(path)
    assert set(back) == {"weights", 3, "hist", "scalar", "nan", "flags", "empty"}  # int key stays int
    assert torch.equal(back["weights"]["fc.weight"], sample_state()["weights"]["fc.weight"])
    assert torch.equal(back["weights"]["fc.bias"], torch.tensor([0.0, 1, 2, 3]))
    assert back[3] == [1, 2.5, None, True, "text", (4, "five")]
    assert isinstance(back["hist"], np.ndarray) and back["hist"].dtype == np.int64
    assert back["hist"].tolist() == [[1, 2], [3, 4]]
    assert back["scalar"] == 0.25 and math.isnan(back["nan"])
    assert back["flags"].dtype == torch.bool and back["empty"].shape == (0, 5)


def test_saved_tensors_are_copies(tmp_path):
    state = {"w": torch.ones(3)}
    data = stateio.dumps(state)
    state["w"] += 1  # changing the live state after saving does not change the file
    assert torch.equal(stateio.loads(data)["w"], torch.ones(3))


@pytest.mark.parametrize("damage", ["truncate", "flip_tensor_byte", "flip_header_byte", "empty"])
def test_damaged_files_are_detected(damage):
    data = bytearray(stateio.dumps({"w": torch.arange(100, dtype=torch.float32), "n": 3}))
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip_tensor_byte":
        data[-5] ^= 0xFF
    elif damage == "flip_header_byte":
        data[40] ^= 0x01
    else:
        data = bytearray()
    expected = {"truncate": "not a readable safetensors file", "flip_tensor_byte": "checksum mismatch",
                "flip_header_byte": "not a readable safetensors file|checksum mismatch|not a pfl state",
                "empty": "not a readable safetensors file"}[damage]
    with pytest.raises(stateio.CorruptStateError, match=expected):
        stateio.loads(bytes(data))


def test_an_unknown_skeleton_entry_is_named():
    from safetensors.torch import save
    data = save({}, metadata={"format": stateio.FORMAT, "skeleton": '{"__set__": []}',
                              "sha256": stateio._digest('{"__set__": []}', {})})
    with pytest.raises(stateio.CorruptStateError, match=r"unknown entry \['__set__'\] in the state skeleton"):
        stateio.loads(data)


def test_plain_safetensors_file_is_not_taken_for_a_state():
    from safetensors.torch import save
    with pytest.raises(stateio.CorruptStateError, match="not a pfl state"):
        stateio.loads(save({"w": torch.ones(2)}))


def test_unsafe_values_are_refused():
    with pytest.raises(TypeError, match="object arrays"):
        stateio.dumps({"a": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="cannot save"):
        stateio.dumps({"f": lambda: 1})


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    stateio.save(path, {"round": 1})
    monkeypatch.setattr(stateio.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        stateio.save(path, {"round": 2})
    assert stateio.load(path) == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left behind
