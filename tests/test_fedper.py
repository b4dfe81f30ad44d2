"""FedPer: shared base averaged like FedAvg, personal head never leaves the client."""

import pytest
import torch

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from tiny import run_tiny, tiny_raw

FAST = {"experiment.rounds": 2}


def test_fedper_shares_the_body_and_keeps_heads_personal():
    result, engine = run_tiny(**FAST, **{"algorithm.name": "fedper"})
    ctx = engine.ctx
    assert ctx.server["head_keys"] == ["fc2.weight", "fc2.bias"]  # mlp [16]: fc1 body, fc2 head
    assert set(ctx.server["body"]) == {"fc1.weight", "fc1.bias"}
    heads = [ctx.store[i]["head"]["fc2.weight"] for i in range(4)]
    assert not torch.equal(heads[0], heads[1])
    body_bytes = sum(v.numel() * v.element_size() for v in ctx.server["body"].values())
    assert result.final["comm_up_bytes"] == 2 * 4 * body_bytes  # only the body goes up


def test_fedper_with_every_layer_but_none_shared_is_rejected():
    with pytest.raises(SpecError) as info:
        run_tiny(**FAST, **{"algorithm.name": "fedper", "algorithm.params.head_layers": 2})
    assert info.value.path == "algorithm.params.head_layers"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedper", "algorithm.params.head_layers": 0}))
    assert info.value.path == "algorithm.params.head_layers"


def test_fedper_body_equals_fedavg_of_participants_bodies():
    # One round, body of FedPer == FedAvg's global restricted to the body (same init, same data,
    # same joint training: heads start from the same initial weights in round 1).
    _, per = run_tiny(**{"experiment.rounds": 1, "algorithm.name": "fedper"})
    _, avg = run_tiny(**{"experiment.rounds": 1})
    for key, value in per.ctx.server["body"].items():
        assert torch.equal(value, avg.ctx.server["global"][key]), key
