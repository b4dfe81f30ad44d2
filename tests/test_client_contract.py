"""Issue 11: the client-side contract. Client hooks (on_receive, local_train, local_objective,
adjust_gradients, client_upload, personalized_models, coldstart_personalize) see their message, the client's own
state and read-only run data, never the server's state, other clients' state, the tracker or
the byte counters: an executor may run them in another process or machine.

Every built-in method runs 2 rounds (with a cold-start client); client hooks get a ``ClientView``,
so any other attribute a client hook reads or writes on ``ctx`` raises; the hooks are also
checked to have received a ``ClientView``, so a call site that hands them the run context
itself is caught too."""

from __future__ import annotations

import math

import pytest
from harness import NEEDS, builtin_algorithms
from tiny import tiny_raw

from pfl_core import hookimpl, registry
from pfl_core.engine import Engine, resolve
from pfl_core.runtime.context import ClientContractError, ClientView

CLIENT_HOOKS = ("on_receive", "local_train", "local_objective", "adjust_gradients", "client_upload",
                "personalized_models", "coldstart_personalize")
COLD = {"experiment.rounds": 2, "experiment.coldstart_clients": 1, "experiment.coldstart_epochs": 1,
        "data.params.num_devices": 5, "partition.num_clients": 5}
SEQUENTIAL = {"executor.name": "sequential"}  # the spy sees every call in this process


class SeesOnlyAView:
    """Records what ``ctx`` each client hook got (tryfirst: before any answer ends the call)."""

    def __init__(self):
        self.contexts: dict[str, set[type]] = {hook: set() for hook in CLIENT_HOOKS}

    def _saw(self, hook, ctx):
        self.contexts[hook].add(type(ctx))

    @hookimpl(tryfirst=True)
    def on_receive(self, ctx, client, message):
        self._saw("on_receive", ctx)

    @hookimpl(tryfirst=True)
    def local_train(self, ctx, client):
        self._saw("local_train", ctx)

    @hookimpl(tryfirst=True)
    def local_objective(self, ctx, client, model, x, y, logits):
        self._saw("local_objective", ctx)

    @hookimpl(tryfirst=True)
    def adjust_gradients(self, ctx, client, model, optimizer):
        self._saw("adjust_gradients", ctx)

    @hookimpl(tryfirst=True)
    def client_upload(self, ctx, client):
        self._saw("client_upload", ctx)

    @hookimpl(tryfirst=True)
    def personalized_models(self, ctx, client, message):
        self._saw("personalized_models", ctx)

    @hookimpl(tryfirst=True)
    def coldstart_personalize(self, ctx, client, message):
        self._saw("coldstart_personalize", ctx)


@pytest.mark.parametrize("name", builtin_algorithms())
def test_client_hooks_touch_nothing_of_the_server(monkeypatch, name):
    spy = SeesOnlyAView()
    make = registry.make_plugin_manager

    def make_with_spy(plugins):  # the run's plugin manager also holds the spy
        manager = make(plugins)
        manager.register(spy)
        return manager

    monkeypatch.setattr(registry, "make_plugin_manager", make_with_spy)
    raw = tiny_raw(**{"algorithm.name": name, **COLD, **SEQUENTIAL, **NEEDS.get(name, {})})
    result = Engine(resolve(raw), progress=False).run()
    assert not result.errors, result.errors  # a cold-start failure is reported, not raised
    assert math.isfinite(result.final["acc_mean"]) and math.isfinite(result.final["coldstart_acc_mean"])
    for hook in CLIENT_HOOKS:  # never the run context itself
        assert spy.contexts[hook] <= {ClientView}, (hook, spy.contexts[hook])
    for hook in ("on_receive", "personalized_models", "coldstart_personalize"):  # every method calls these
        assert spy.contexts[hook] == {ClientView}, hook  # (Centralized trains no client in a round)


def test_a_client_hook_reading_the_server_state_is_refused(monkeypatch):
    """The check itself: a method whose client reads ``ctx.server`` fails the run, naming the
    attribute and where the client gets it from instead."""
    from pfl_plugins.fedavg import FedAvg

    def peeking_on_receive(self, ctx, client, message):
        ctx.server["global"]  # what the message already carries
        return True

    monkeypatch.setattr(FedAvg, "on_receive", hookimpl(peeking_on_receive))
    with pytest.raises(ClientContractError, match=r"ctx\.server.*message"):
        Engine(resolve(tiny_raw(**{"experiment.rounds": 1, **SEQUENTIAL})), progress=False).run()
