"""FedRep: head first with the body frozen, then the body with the head frozen; uniform average."""

import pytest
import torch

from pfl_core.context import clone_state
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from tiny import tiny_raw


def prepared(**overrides):
    engine = Engine(resolve(tiny_raw(**{"algorithm.name": "fedrep", "algorithm.params.head_epochs": 2,
                                        **overrides})), progress=False)
    ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def test_head_only_training_leaves_the_body_alone():
    engine, ctx = prepared(**{"algorithm.params.body_epochs": 0})
    body = clone_state(ctx.server["body"])
    engine.run_round(ctx, 1)
    for key, value in body.items():  # no body epochs: the averaged body is the broadcast one
        assert torch.allclose(ctx.server["body"][key], value, atol=1e-6), key
    initial = ctx.models.initial_state("mlp")["fc2.weight"]
    assert all(not torch.equal(ctx.store[i]["head"]["fc2.weight"], initial) for i in range(4))


def test_body_is_the_uniform_average_of_the_uploaded_bodies():
    engine, ctx = prepared(**{"experiment.participation": 0.5, "partition.scheme": "dirichlet",
                              "partition.params": {"alpha": 1.0}})
    original = ctx.hooks.client_upload

    uploads = []

    def spy(**kw):
        message = original(**kw)
        uploads.append({k: v.clone() for k, v in message["body"].items()})
        return message
    ctx.hooks.client_upload = spy  # record what each participant sends
    engine.run_round(ctx, 1)
    assert len(uploads) == 2
    sizes = [ctx.data.clients[i].num_train for i in ctx.participants]
    assert sizes[0] != sizes[1]  # so a data-size average would differ
    for key, value in ctx.server["body"].items():
        assert torch.allclose(value, (uploads[0][key] + uploads[1][key]) / 2, atol=1e-6), key


def test_bad_epochs_name_the_key():
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{"algorithm.name": "fedrep", "algorithm.params.head_epochs": -1}))
    assert info.value.path == "algorithm.params.head_epochs"


def test_defaults_are_the_papers():
    from plugins.fedrep import FedRep
    p = FedRep().params
    assert (p.head_epochs, p.body_epochs, p.head_layers) == (10, 1, 1)
