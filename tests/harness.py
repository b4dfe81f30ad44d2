"""Drive the engine round by round and recompute what a method should have done, independently.

Used by the baseline tests: a round is run by the engine, then the expected result is computed
here from the method's definition (start state, which parameters train, which loss, which
weights), with fresh modules that share nothing with the run's working model.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_cli import one_line_error, run_cli, write_spec
from tiny import tiny_raw
from torch import nn

from pfl_core import registry
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError


def prepared(**overrides):
    """An engine with its context prepared and ``setup`` run, before round 1: (engine, ctx)."""
    engine = Engine(resolve(tiny_raw(**overrides)), progress=False)
    ctx = engine.ctx = engine.prepare()
    ctx.hooks.setup(ctx=ctx)
    return engine, ctx


def shrink(ctx, sizes: dict[int, int]) -> None:
    """Keep only the first ``sizes[i]`` training samples of client i (unequal client sizes)."""
    for i, n in sizes.items():
        data = ctx.data.clients[i]
        data.train_x, data.train_y = data.train_x[:n], data.train_y[:n]


def cross_entropy(model, x, y, logits):
    return F.cross_entropy(logits, y)


def fresh_model(ctx, state, arch: str = "mlp"):
    """A new module (not the run's working one) holding ``state``."""
    model = ctx.models.build(arch)
    with torch.no_grad():
        own = model.state_dict()
        for key, value in state.items():
            own[key].copy_(value)
    return model


def train_reference(ctx, client_id, state, *, trainable=None, epochs=None, loss_fn=cross_entropy):
    """What ``client_id`` gets from ``state`` after plain local SGD in the current round.

    ``trainable``: the state-dict keys that train (default: all); the rest get no gradient.
    The batch order is the client's seeded one for ``ctx.round`` (``Client.generator``).
    """
    model = fresh_model(ctx, state)
    names = [n for n, _ in model.named_parameters()] if trainable is None else list(trainable)
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    params = [p for n, p in model.named_parameters() if n in names]
    client = ctx.client(client_id)
    optimizer = torch.optim.SGD(params, lr=ctx.spec.training.lr)
    client.train(model=model, epochs=epochs, optimizer=optimizer, loss_fn=loss_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mean_of(pairs, keys=None):
    """sum_i w_i * state_i[key], written out (not pfl_core.runtime.aggregate)."""
    pairs = list(pairs)
    keys = list(pairs[0][1]) if keys is None else keys
    return {k: sum(w * s[k].double() for w, s in pairs).float() for k in keys}


def assert_close(a, b, keys=None, atol=1e-6):
    for key in (a.keys() if keys is None else keys):
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=atol), key


def assert_same(a, b, keys=None):
    keys = list(a.keys() if keys is None else keys)
    for key in keys:
        assert torch.equal(a[key], b[key]), key


def far_apart(a, b, keys, atol=1e-4) -> bool:
    """Some entry of ``keys`` differs by more than ``atol`` (checks that a test can tell them apart)."""
    return any((a[k].float() - b[k].float()).abs().max() > atol for k in keys)


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def model_bytes(state, keys=None):
    keys = state.keys() if keys is None else keys
    return sum(state[k].numel() * state[k].element_size() for k in keys)


@contextlib.contextmanager
def recorded_training(monkeypatch):
    """Record every ``Client.train`` call: the model's state before and after, which
    parameters could train, and the epochs asked for."""
    from pfl_core.runtime.context import Client

    calls = []
    original = Client.train

    def spy(self, model=None, **kwargs):
        target = self.model if model is None else model
        before = state_of(target)
        trainable = {n for n, p in target.named_parameters() if p.requires_grad}
        out = original(self, model, **kwargs)
        calls.append({"client": self.id, "before": before, "after": state_of(target), "trainable": trainable,
                      "epochs": kwargs.get("epochs"), "model": target})
        return out

    monkeypatch.setattr(Client, "train", spy)
    yield calls


def linear(weight, bias):
    """nn.Linear(2, 1) set to ``weight`` (a row of 2) and ``bias`` (a list of 1): tiny hand cases."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight]))
        model.bias.copy_(torch.tensor(bias))
    return model


def refused_at_key(raw, key, value) -> None:
    """Resolving ``raw`` with ``algorithm.params.<key> = value`` raises a SpecError at that key."""
    path = f"algorithm.params.{key}"
    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{**raw, path: value}))
    assert info.value.path == path


def dry_run_error(tmp_path, capsys, raw) -> str:
    """``pfl <spec> --dry-run`` on ``raw`` exits 2 with one error line (no traceback): that line."""
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), "--dry-run")
    assert code == 2
    return one_line_error(err)


# -- every built-in method on tiny data ------------------------------------------------------

# What each built-in algorithm needs beyond tiny.TINY to run (a public set, a server model ...).
PUBLIC = {"public.size": 40}
NEEDS = {
    "fedmosaic": PUBLIC, "fedct": PUBLIC, "comet": PUBLIC, "perfed_ckt": PUBLIC, "cosmos": {**PUBLIC, "algorithm.params": {"server_arch": "mlp"}},
    "fedmd": {**PUBLIC, "public.labelled": True},
    "fedsimsup": {"algorithm.params": {"supervisor": "mlp", "supervisor_arch_params": {"mlp": {"hidden": [4]}}}},
    "fedbn": {"model.params": {"hidden": [16], "norm": "batch"}},
    "fedap": {"model.params": {"hidden": [16], "norm": "batch"}},
    # one distillation round, so a 3-round run also reaches the sharing round and FedAvg on the shared set
    "fedfed": {"algorithm.params": {"distill_rounds": 1}},
    "floco": {"algorithm.params": {"tau": 1, "endpoints": 3}},  # placed in round 1, subregions from round 2
    # a split from round 2 on, so the shared executor and checkpoint tests reach one (the
    # defaults never split a tiny run)
    "cfl": {"algorithm.params": {"warmup_rounds": 1, "eps1": 1e9, "eps2": 0.0}},
}


def builtin_algorithms():
    """The algorithms pfl itself ships (not third-party plugins installed beside it)."""
    return [name for name in registry.names_of_kind(registry.ALGORITHM)
            if registry.discovered()[name].distribution == "pfl"]


def random_images(tmp_path, algorithm: str) -> dict:
    """Overrides for a 2-round run of ``algorithm`` on 200 random 28x28 uint8 images (an npz in
    ``tmp_path``), LeNet-5 by default: for tests of models with a convolutional extractor."""
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=rng.integers(0, 256, (200, 28, 28), dtype=np.uint8), y_train=rng.integers(0, 10, 200))
    return {"data.name": "npz", "data.params": {"path": str(path)}, "partition.scheme": "iid",
            "model.name": "lenet5", "model.params": {}, "experiment.rounds": 2, "algorithm.name": algorithm}


def record_messages(ctx, hook: str) -> dict:
    """Wrap ``ctx.hooks.<hook>`` (``on_broadcast``, ``client_upload``, ...) so that each client's
    answer is kept, keyed by client id, its tensors copied (the run may change them in place
    later); the last answer per client wins. Returns that dict, filled as the run goes."""
    seen, original = {}, getattr(ctx.hooks, hook)

    def copied(value):
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        return value.detach().clone() if torch.is_tensor(value) else value

    def recording(**kw):
        message = original(**kw)
        seen[kw["client_id"] if "client_id" in kw else kw["client"].id] = copied(message)
        return message

    setattr(ctx.hooks, hook, recording)
    return seen
