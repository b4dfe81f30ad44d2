"""FedPer: shared base averaged like FedAvg, personal head never leaves the client."""

import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.evaluation import evaluated_models

FAST = {"experiment.rounds": 2}


def test_fedper_shares_the_body_and_keeps_heads_personal():
    result, engine = run_tiny(**FAST, **{"algorithm.name": "fedper"})
    ctx = engine.ctx
    assert engine.resolved.algorithm.head_keys(ctx) == ["fc2.weight", "fc2.bias"]  # mlp [16]: fc1 body, fc2 head
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


BODY, HEAD = {"fc1.weight", "fc1.bias"}, {"fc2.weight", "fc2.bias"}


def prepared(**overrides):
    from pfl_core.engine import Engine
    engine = Engine(resolve(tiny_raw(**{"algorithm.name": "fedper", **overrides})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def test_fedper_trains_body_and_head_jointly_for_local_epochs():
    from pfl_core.runtime.context import clone_state
    engine, ctx = prepared(**{"training.local_epochs": 2})
    ctx.round = 1
    client = ctx.client(1)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=1))
    calls, train = [], client.train

    def spy(**kw):
        before = clone_state(client.model)
        out = train(**kw)
        calls.append({k for k, v in client.model.state_dict().items() if not torch.equal(v, before[k])})
        return out
    client.train = spy
    ctx.hooks.local_train(ctx=ctx, client=client)
    assert calls == [BODY | HEAD]  # one joint pass: no freezing, no phases
    assert all(torch.equal(ctx.store[1]["head"][k], client.model.state_dict()[k]) for k in HEAD)


def test_fedper_body_is_sample_weighted_and_heads_stay_home():
    engine, ctx = prepared(**{"experiment.participation": 0.5, "partition.scheme": "dirichlet",
                              "partition.params": {"alpha": 1.0}})
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: {n: v.clone() for n, v in part.items()} for k, part in message.items()}
        return message
    ctx.hooks.client_upload = spy
    engine.run_round(ctx, 1)
    a, b = ctx.participants
    assert all(set(m) == {"body"} and set(m["body"]) == BODY for m in uploads.values())
    na, nb = ctx.data.clients[a].num_train, ctx.data.clients[b].num_train
    assert na != nb
    for key, value in ctx.server["body"].items():
        assert torch.allclose(value, (na * uploads[a]["body"][key] + nb * uploads[b]["body"][key]) / (na + nb),
                              atol=1e-6), key
    # evaluated: the global body with the client's own head (the initial head if it never trained)
    sat_out = next(i for i in range(4) if i not in ctx.participants)
    initial = ctx.models.initial_state("mlp")
    for i, head in ((a, ctx.store[a]["head"]), (sat_out, initial)):
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert all(torch.equal(state[k], ctx.server["body"][k]) for k in BODY)
        assert all(torch.equal(state[k], head[k]) for k in HEAD)


def test_fedper_budget_and_coldstart_run():
    result, engine = run_tiny(**{"algorithm.name": "fedper", "experiment.rounds": 2, "training.local_epochs": 2,
                                 "training.drop_last": False, "experiment.coldstart_clients": 1})
    assert engine.resolved.as_dict["budget"]["private_epochs_per_round"] == 2
    assert result.final["budget.private_epochs"] == pytest.approx(4)
    assert not result.errors and "coldstart_acc_mean" in result.final
