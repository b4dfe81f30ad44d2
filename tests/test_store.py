"""The client store: bounded cache, spill to disk, checkpoints (pfl_core/state/store.py)."""

import gc
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import dry_run_error
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import PflError, SpecError
from pfl_core.state import store as store_module
from pfl_core.state.store import ClientStore

SUP = {"algorithm.params.supervisor": "mlp", "algorithm.params.supervisor_arch_params": {"mlp": {"hidden": [4]}}}


def rich_state() -> dict:
    """Every kind of value a plugin keeps, nested."""
    generator = torch.Generator().manual_seed(0)
    return {
        "weights": {"fc.weight": torch.randn(3, 4, generator=generator), "fc.bias": torch.randn(3, dtype=torch.float64,
                                                                                             generator=generator)},
        "counts": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(2, 2, generator=generator).to(torch.bfloat16),
        "history": [(1, 0.25), (2, 0.5)],
        "by_id": {3: [1.5, None], 7: "seven"},
        "proportions": np.array([0.1, 0.9], dtype=np.float32),
        "alpha": 0.1 + 0.2,
        "visits": 3,
        "warm": True,
        "nothing": None,
        "nan": float("nan"),
    }


def assert_identical(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def spilled_files(store: ClientStore) -> set[str]:
    folder = store.spill_folder
    return set() if folder is None else {p.name for p in folder.glob("*.safetensors")}


# -- the cache ---------------------------------------------------------------------------


def test_round_trip_through_spill_is_exact():
    store = ClientStore(3, cache_clients=1)
    store[0].update(rich_state())
    store[1]  # evicts client 0: written to its spill file
    assert store.in_memory == [1] and spilled_files(store) == {"0.safetensors"}
    assert_identical(store[0], rich_state())


def test_least_recently_used_is_evicted_first():
    store = ClientStore(6, cache_clients=3)
    for client_id in (0, 1, 2):
        store[client_id]["id"] = client_id
    store[0]  # 0 is now the most recent: 1 is the least recently used
    store[3]
    assert store.in_memory == [2, 0, 3]
    store[2]
    store[4]
    assert store.in_memory == [3, 2, 4]  # 0 went next, not 2 (touched again)
    assert [store[i]["id"] for i in (0, 1, 2)] == [0, 1, 2]


def test_a_state_in_use_is_never_evicted_and_no_write_to_it_is_lost():
    store = ClientStore(5, cache_clients=1)
    held = store[0]  # as a Client holds client.state during its round
    held["before"] = torch.ones(2)
    for other in (1, 2, 3):
        store[other]["x"] = other
    assert 0 in store.in_memory  # pinned while held
    held["after"] = 7  # written after the others were touched
    del held
    store[4]  # now it may go
    assert 0 not in store.in_memory
    state = store[0]
    assert torch.equal(state["before"], torch.ones(2)) and state["after"] == 7
    assert [store[i]["x"] for i in (1, 2, 3)] == [1, 2, 3]


def test_an_unchanged_state_is_not_written_again_but_every_change_is():
    store = ClientStore(2, cache_clients=1)
    store[0]["w"] = {"a": torch.zeros(3)}
    store[1]
    assert store.writes == 1
    store[0]  # read (as evaluation does), not changed
    store[1]
    assert store.writes == 1
    store[0]["w"]["a"].add_(1)  # in place: torch's version counter
    store[1]
    assert store.writes == 2 and torch.equal(store[0]["w"]["a"], torch.ones(3))
    store[0]["w"]["a"] = torch.ones(3)  # an equal tensor, but another object: written (cheap to be safe)
    store[1]
    assert store.writes == 3
    store[0]["w"] = {"a": store[0]["w"]["a"]}  # a rebuilt dict of the same tensor: the same state
    store[1]
    assert store.writes == 3
    store[0]["n"] = 1
    store[1]
    store[0]["n"] = 2  # a plain value changed
    store[1]
    assert store.writes == 5 and store[0]["n"] == 2


def test_numpy_arrays_are_always_written_back():
    """numpy arrays change in place without a trace, so a state holding one is written."""
    store = ClientStore(2, cache_clients=1)
    store[0]["p"] = np.zeros(3)
    store[1]
    store[0]["p"][1] = 5.0
    store[1]
    assert store[0]["p"].tolist() == [0.0, 5.0, 0.0]


def test_empty_states_cost_nothing_on_disk():
    store = ClientStore(10, cache_clients=1)
    for client_id in range(10):
        store[client_id]
    assert store.spill_folder is None and store.writes == 0
    store[3]["w"] = torch.ones(1)
    store[4]
    assert spilled_files(store) == {"3.safetensors"}
    store[3].clear()  # a state emptied: its file goes too
    store[4]
    assert spilled_files(store) == set() and store[3] == {}


def test_replace_updates_the_live_dict():
    store = ClientStore(3, cache_clients=1)
    held = store[0]
    held["old"] = 1
    store.replace(0, {"new": torch.ones(2)})
    assert held == {"new": held["new"]} and torch.equal(held["new"], torch.ones(2))
    del held
    store.replace(2, {"w": torch.zeros(2)})  # not in memory: set, then spilled like any state
    store[1]
    assert torch.equal(store[2]["w"], torch.zeros(2)) and torch.equal(store[0]["new"], torch.ones(2))


def test_automatic_cache_is_bounded_by_bytes(monkeypatch):
    monkeypatch.setattr(store_module, "AUTO_CACHE_BYTES", 3 * 400)  # three states of 100 float32
    store = ClientStore(10)
    assert store.cache_clients == store_module.AUTO_CACHE_CLIENTS
    for client_id in range(10):
        store[client_id]["w"] = torch.full((100,), float(client_id))
    store[0]  # the last one handed out is measured at the next access
    assert len(store.in_memory) == 3
    assert all(torch.equal(store[i]["w"], torch.full((100,), float(i))) for i in range(10))


def test_after_close_the_spill_folder_is_gone_and_states_in_memory_stay():
    store = ClientStore(3, cache_clients=1)
    store[0]["w"] = torch.ones(1)
    store[1]["w"] = torch.zeros(1)
    folder = store.spill_folder
    assert folder.is_dir()
    store.close()
    assert not folder.exists()
    assert torch.equal(store[1]["w"], torch.zeros(1))
    with pytest.raises(PflError, match="client 0's state was spilled"):
        store[0]


SPILLING_OWNER = """
import os, signal, sys, torch
from pfl_core.state.store import ClientStore
store = ClientStore(2, cache_clients=1, spill_dir=sys.argv[1])
store[0]["w"] = torch.ones(1)
store[1]  # client 0 spilled: the spill folder exists
print(store.spill_folder, flush=True)
{ending}
"""


@pytest.mark.skipif(store_module.fcntl is None, reason="needs fcntl (flock): not on Windows")
def test_a_killed_runs_spill_folder_is_removed_by_the_next_store_and_a_live_runs_kept(tmp_path):
    killed = subprocess.run([sys.executable, "-c", SPILLING_OWNER.format(ending="os.kill(os.getpid(), signal.SIGKILL)"),
                             str(tmp_path)], capture_output=True, text=True, timeout=300)
    abandoned = Path(killed.stdout.strip())
    assert killed.returncode == -9 and abandoned.is_dir()  # SIGKILL: no finalizer ran
    live = subprocess.Popen([sys.executable, "-c", SPILLING_OWNER.format(ending="sys.stdin.read()"), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    live_folder = Path(live.stdout.readline().strip())
    older = tmp_path / "pfl-state-older"  # no lock file (an older pfl, or one being made): not ours to judge
    older.mkdir()
    store = ClientStore(2, cache_clients=1, spill_dir=tmp_path)
    store[0]["w"] = torch.ones(1)
    store[1]
    assert not abandoned.exists()
    assert live_folder.is_dir() and older.is_dir() and store.spill_folder.is_dir()
    live.communicate("", timeout=300)
    assert live.returncode == 0 and not live_folder.exists()  # its owner removed it on the way out
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pfl-state-older"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_copy_of_the_store_going_away_leaves_the_spill_folder():
    """A process executor's forked workers hold copies of the run context and its store."""
    store = ClientStore(2, cache_clients=1)
    store[0]["w"] = torch.ones(1)
    store[1]
    pid = os.fork()
    if pid == 0:  # the worker: its copy of the store is collected, then it exits
        del store
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    assert store.spill_folder.is_dir() and torch.equal(store[0]["w"], torch.ones(1))
    store.close()


@pytest.mark.gpu
def test_spilled_tensors_come_back_on_the_stores_device():
    store = ClientStore(2, cache_clients=1, device="cuda")
    store[0]["w"] = torch.arange(4.0, device="cuda")
    store[1]
    assert 0 not in store.in_memory
    assert store[0]["w"].device.type == "cuda" and torch.equal(store[0]["w"].cpu(), torch.arange(4.0))


def test_bad_client_ids_are_key_errors():
    store = ClientStore(3)
    for bad in (3, -1, "0"):
        with pytest.raises(KeyError):
            store[bad]
    assert list(store) == [0, 1, 2] and len(store) == 3


# -- checkpoints -------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    store = ClientStore(6, cache_clients=2)
    for client_id in (0, 2, 3, 5):  # 1 and 4 keep empty states
        store[client_id].update(rich_state(), id=client_id)
    store.save(tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").glob("*.safetensors")} == {f"{i}.safetensors" for i in (0, 2, 3, 5)}
    restored = ClientStore(6, cache_clients=2)
    restored[1]["stale"] = 1  # replaced by the load
    restored.load(tmp_path / "ckpt")
    assert restored.in_memory == []  # nothing read until asked for
    for client_id in range(6):
        expected = {**rich_state(), "id": client_id} if client_id in (0, 2, 3, 5) else {}
        assert_identical(restored[client_id], expected, f"client {client_id}")


def test_a_checkpoint_is_not_changed_by_the_run_that_goes_on(tmp_path):
    """Spill and checkpoint files share storage (hard links): a later spill must write a new
    file, never into the checkpoint's."""
    store = ClientStore(2, cache_clients=1)
    store[0]["w"] = torch.zeros(2)
    store[1]
    store.save(tmp_path)
    store[0]["w"].add_(1)
    store[1]  # rewrites 0's spill file
    store.save(tmp_path / "later")
    first, later = ClientStore(2, cache_clients=1), ClientStore(2, cache_clients=1)
    first.load(tmp_path)
    later.load(tmp_path / "later")
    assert torch.equal(first[0]["w"], torch.zeros(2)) and torch.equal(later[0]["w"], torch.ones(2))
    first[0]["w"].add_(5)  # and a resumed run does not change the checkpoint it came from
    first[1]
    again = ClientStore(2, cache_clients=1)
    again.load(tmp_path)
    assert torch.equal(again[0]["w"], torch.zeros(2))


def test_saving_again_drops_states_emptied_since(tmp_path):
    store = ClientStore(3, cache_clients=3)
    store[0]["w"] = torch.ones(1)
    store[1]["w"] = torch.ones(1)
    store.save(tmp_path)
    store[1].clear()
    store.save(tmp_path)
    restored = ClientStore(3)
    restored.load(tmp_path)
    assert restored[1] == {} and torch.equal(restored[0]["w"], torch.ones(1))


def test_load_refuses_another_number_of_clients_or_a_missing_file(tmp_path):
    store = ClientStore(3)
    store[0]["w"] = torch.ones(1)
    store.save(tmp_path)
    with pytest.raises(PflError, match="of 3 clients, this run has 4"):
        ClientStore(4).load(tmp_path)
    (tmp_path / "0.safetensors").unlink()
    with pytest.raises(PflError, match="missing"):
        ClientStore(3).load(tmp_path)


# -- runs --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["local", "fedrep", "ditto", "fedsimsup"])
def test_a_tiny_cache_gives_bit_identical_results(method):
    """Every state is spilled and read back between uses (cache_clients = 1 with 4 clients)."""
    extra = {"algorithm.name": method, "experiment.rounds": 2, **(SUP if method == "fedsimsup" else {})}
    in_memory, _ = run_tiny(**extra)
    spilled, engine = run_tiny(**extra, **{"state.cache_clients": 1})
    store = engine.ctx.store
    assert store.writes > 0 and store.reads > 0  # the run really went through the spill folder
    assert not store.spill_folder.exists()  # removed at the end of the run
    timing = {"round_seconds", "eval_seconds"}
    assert {k: v for k, v in in_memory.final.items() if k not in timing} == {
        k: v for k, v in spilled.final.items() if k not in timing}
    assert [{k: v for k, v in h.items() if k not in timing} for h in in_memory.history] == [
        {k: v for k, v in h.items() if k not in timing} for h in spilled.history]
    assert in_memory.client_rows == spilled.client_rows


def test_the_spec_section(tmp_path, capsys):
    spec = resolve(tiny_raw(**{"state.cache_clients": 2, "state.spill_dir": str(tmp_path)})).spec
    assert (spec.state.cache_clients, spec.state.spill_dir) == (2, str(tmp_path))
    assert resolve(tiny_raw()).spec.state.cache_clients == 0  # automatic
    for bad in (-1, 1.5, "2"):
        with pytest.raises(SpecError) as info:
            resolve(tiny_raw(**{"state.cache_clients": bad}))
        assert info.value.path == "state.cache_clients"
    assert "state.cache_clients" in dry_run_error(tmp_path, capsys, tiny_raw(**{"state.cache_clients": -3}))


def test_spill_dir_is_where_the_spill_folder_is_made(tmp_path):
    _, engine = run_tiny(**{"algorithm.name": "local", "experiment.rounds": 1, "state.cache_clients": 1,
                            "state.spill_dir": str(tmp_path / "spill")})
    folder = engine.ctx.store.spill_folder
    assert folder.parent == tmp_path / "spill" and not folder.exists()
    assert (tmp_path / "spill").is_dir()  # the user's folder stays
