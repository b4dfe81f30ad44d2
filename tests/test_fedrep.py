"""FedRep: head first with the body frozen, then the body with the head frozen; only the body
is sent and averaged with sample weights; the head never leaves; budget and cold start."""

import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core import seeding
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.runtime.context import clone_state
from pfl_core.runtime.evaluation import coldstart_models, evaluated_models
from pfl_core.runtime.training import make_optimizer, run_epochs

BODY, HEAD = {"fc1.weight", "fc1.bias"}, {"fc2.weight", "fc2.bias"}  # mlp [16]: fc1 body, fc2 head


def prepared(**overrides):
    engine = Engine(resolve(tiny_raw(**{"algorithm.name": "fedrep", "algorithm.params.head_epochs": 2,
                                        **overrides})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def spy_uploads(ctx):
    uploads, original = {}, ctx.hooks.client_upload

    def spy(**kw):
        message = original(**kw)
        uploads[kw["client"].id] = {k: {n: v.clone() for n, v in part.items()} for k, part in message.items()}
        return message
    ctx.hooks.client_upload = spy  # record what each participant sends
    return uploads


def test_head_first_with_the_body_frozen_then_the_body_with_the_head_frozen():
    engine, ctx = prepared(**{"algorithm.params.head_epochs": 2, "algorithm.params.body_epochs": 1})
    ctx.round = 1
    client = ctx.client(2)
    ctx.hooks.on_receive(ctx=ctx, client=client, message=ctx.hooks.on_broadcast(ctx=ctx, client_id=2))
    model, calls, train = client.model, [], client.train

    def spy(**kw):
        before = clone_state(model)
        for p in model.parameters():
            p.grad = None
        out = train(**kw)
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        graded = {k for k, p in model.named_parameters() if p.grad is not None}
        calls.append((kw["epochs"], changed, graded))
        return out
    client.train = spy
    ctx.hooks.local_train(ctx=ctx, client=client)
    # head epochs on the head only, then body epochs on the body only; the frozen part gets no gradient
    assert calls == [(2, HEAD, HEAD), (1, BODY, BODY)]
    assert all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(ctx.store[2]["head"][k], model.state_dict()[k]) for k in HEAD)


def test_local_update_equals_the_two_phase_loop_bit_for_bit():
    engine, ctx = prepared(**{"algorithm.params.head_epochs": 2, "algorithm.params.body_epochs": 1,
                              "experiment.rounds": 1})
    engine.run_round(ctx, 1)
    spec = ctx.spec
    bodies, sizes = [], [ctx.data.clients[i].num_train for i in range(4)]
    for i in range(4):
        model = ctx.models.build("mlp")
        data = ctx.data.clients[i]
        ce = lambda m, x, y, logits: torch.nn.functional.cross_entropy(logits, y)  # noqa: E731
        for names, epochs in ((HEAD, 2), (BODY, 1)):
            for n, p in model.named_parameters():
                p.requires_grad_(n in names)
            run_epochs(model, make_optimizer([p for n, p in model.named_parameters() if n in names], spec.training),
                       data.train_x, data.train_y, epochs=epochs, batch_size=spec.training.batch_size, loss_fn=ce,
                       generator=seeding.torch_generator(spec.experiment.seed, "train", 1, i),
                       drop_last=spec.training.drop_last)
        state = model.state_dict()
        for k in HEAD:
            assert torch.equal(ctx.store[i]["head"][k], state[k]), (i, k)
        bodies.append({k: state[k] for k in BODY})
    for k in BODY:  # full participation: the sample-weighted mean of the four trained bodies
        expected = sum(n * body[k] for n, body in zip(sizes, bodies)) / sum(sizes)
        assert torch.allclose(ctx.server["body"][k], expected, atol=1e-6), k


def test_only_the_body_goes_up_and_is_averaged_with_sample_weights():
    engine, ctx = prepared(**{"experiment.participation": 0.5, "partition.scheme": "dirichlet",
                              "partition.params": {"alpha": 1.0}})
    uploads = spy_uploads(ctx)
    up = ctx.comm_up
    engine.run_round(ctx, 1)
    assert len(uploads) == 2
    assert all(set(m) == {"body"} and set(m["body"]) == BODY for m in uploads.values())  # the head never leaves
    body_bytes = sum(v.numel() * v.element_size() for v in ctx.server["body"].values())
    assert ctx.comm_up - up == 2 * body_bytes
    a, b = ctx.participants
    na, nb = ctx.data.clients[a].num_train, ctx.data.clients[b].num_train
    assert na != nb  # so the uniform mean would differ
    for key, value in ctx.server["body"].items():
        expected = (na * uploads[a]["body"][key] + nb * uploads[b]["body"][key]) / (na + nb)
        assert torch.allclose(value, expected, atol=1e-6), key
        assert not torch.allclose(value, (uploads[a]["body"][key] + uploads[b]["body"][key]) / 2, atol=1e-6)


def test_uniform_average_option_is_algorithm_1s_plain_mean():
    engine, ctx = prepared(**{"experiment.participation": 0.5, "partition.scheme": "dirichlet",
                              "partition.params": {"alpha": 1.0}, "algorithm.params.average": "uniform"})
    uploads = spy_uploads(ctx)
    engine.run_round(ctx, 1)
    a, b = ctx.participants
    for key, value in ctx.server["body"].items():
        assert torch.allclose(value, (uploads[a]["body"][key] + uploads[b]["body"][key]) / 2, atol=1e-6), key


def test_head_only_training_leaves_the_body_alone():
    engine, ctx = prepared(**{"algorithm.params.body_epochs": 0})
    body = clone_state(ctx.server["body"])
    engine.run_round(ctx, 1)
    for key, value in body.items():  # no body epochs: the averaged body is the broadcast one
        assert torch.allclose(ctx.server["body"][key], value, atol=1e-6), key
    initial = ctx.models.initial_state("mlp")["fc2.weight"]
    assert all(not torch.equal(ctx.store[i]["head"]["fc2.weight"], initial) for i in range(4))


def test_evaluated_model_is_the_global_body_with_the_own_head():
    engine, ctx = prepared(**{"experiment.participation": 0.5})
    engine.run_round(ctx, 1)
    sat_out = next(i for i in range(4) if i not in ctx.participants)
    initial = ctx.models.initial_state("mlp")
    for i, head in ((ctx.participants[0], ctx.store[ctx.participants[0]]["head"]), (sat_out, initial)):
        state = evaluated_models(ctx, ctx.client(i))[""].state_dict()
        assert all(torch.equal(state[k], ctx.server["body"][k]) for k in BODY)
        assert all(torch.equal(state[k], head[k]) for k in HEAD)


def test_local_work_is_head_plus_body_epochs_and_matches_what_runs():
    raw = tiny_raw(**{"algorithm.name": "fedrep", "algorithm.params.head_epochs": 2,
                      "algorithm.params.body_epochs": 1, "experiment.rounds": 2, "training.drop_last": False})
    resolved = resolve(raw)
    assert resolved.as_dict["budget"]["private_epochs_per_round"] == 3
    result = Engine(resolved, progress=False).run()
    assert result.final["budget.private_epochs"] == pytest.approx(2 * 3)


def test_coldstart_trains_only_the_head_on_the_final_body():
    engine, ctx = prepared(**{"experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 2})
    engine.run_round(ctx, 1)
    (n,) = ctx.coldstart_clients
    models = coldstart_models(ctx, ctx.client(n))
    state = models[""].state_dict()
    assert all(torch.equal(state[k], ctx.server["body"][k]) for k in BODY)  # body frozen
    initial = ctx.models.initial_state("mlp")
    assert all(not torch.equal(state[k], initial[k]) for k in HEAD)  # the head learned from the initial one
    result, _ = run_tiny(**{"algorithm.name": "fedrep", "algorithm.params.head_epochs": 1, "experiment.rounds": 2,
                            "experiment.coldstart_clients": 1})
    assert not result.errors and "coldstart_acc_mean" in result.final


def test_bad_epochs_name_the_key():
    for key, value in (("algorithm.params.head_epochs", -1), ("algorithm.params.average", "median")):
        with pytest.raises(SpecError) as info:
            resolve(tiny_raw(**{"algorithm.name": "fedrep", key: value}))
        assert info.value.path == key


def test_defaults_are_the_papers():
    from pfl_plugins.fedrep import FedRep
    p = FedRep().params
    assert (p.head_epochs, p.body_epochs, p.head_layers, p.average) == (10, 1, 1, "samples")


def test_a_phase_with_zero_epochs_is_skipped_not_the_rest():
    initial = {k: v.clone() for k, v in Engine(resolve(tiny_raw()), progress=False).prepare()
               .models.initial_state("mlp").items()}
    engine, ctx = prepared(**{"algorithm.params.head_epochs": 0, "algorithm.params.body_epochs": 1})
    engine.run_round(ctx, 1)  # no head epochs: the body still trains, the heads stay initial
    assert not torch.allclose(ctx.server["body"]["fc1.weight"], initial["fc1.weight"], atol=1e-4)
    assert all(torch.equal(ctx.store[i]["head"][k], initial[k]) for i in range(4) for k in HEAD)
    engine, ctx = prepared(**{"algorithm.params.head_epochs": 0, "algorithm.params.body_epochs": 0})
    engine.run_round(ctx, 1)  # nothing to train: no fallback to another training pass
    assert all(torch.allclose(ctx.server["body"][k], initial[k], atol=1e-6) for k in BODY)
    assert all(torch.equal(ctx.store[i]["head"][k], initial[k]) for i in range(4) for k in HEAD)
