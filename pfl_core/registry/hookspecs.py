"""The hooks a method implements. Each docstring is the hook's contract.

A round, as the engine runs it (see docs/architecture.md)::

    participants = select_clients(ctx, round)
    on_round_start(ctx, round, participants)
    weights      = client_weighting(ctx, participants)
    for each participant i (through the executor, lazily):
        message = on_broadcast(ctx, client_id=i)           # bytes counted down
        on_receive(ctx, client, message)                   # client merges it
        local_train(ctx, client)                           # batches call local_objective (the
                                                           # core's term asks task_loss), and
                                                           # adjust_gradients before each step
        upload  = client_upload(ctx, client)               # bytes counted up
        upload_lost(ctx, client_id=i)                      # only if implemented: True drops it
    server_aggregate(ctx, uploads, weights)                # uploads: iterator of (i, upload)
    on_round_end(ctx, round)
    every evaluation.every rounds, for every client:
        message = evaluation_message(ctx, client_id=i)     # server side, not counted
        personalized_models(ctx, client, message)          # client side

``ctx`` is the :class:`pfl_core.runtime.context.RunContext`; ``client`` a
:class:`pfl_core.runtime.context.Client`. Server state lives in ``ctx.server`` and per-client state
in ``client.state`` (engine-owned stores): plugins keep no state of their own between rounds,
so a round can run elsewhere and a run can be checkpointed.

Client-side hooks (``on_receive``, ``local_train``, ``local_objective``, ``task_loss``, ``adjust_gradients``,
``client_upload``, ``personalized_models``, ``coldstart_personalize``) may use only their message, the client's
own state (``client.*``) and read-only run data (``ctx.spec``, ``ctx.params``, ``ctx.data``,
``ctx.models``, ``ctx.round`` ...); never ``ctx.server``, ``ctx.store``, ``ctx.tracker`` or
``ctx.comm_*``: an executor may run them in another process or machine (see "The client-side
contract" in docs/architecture.md).

Hooks marked *firstresult* take the first non-None answer: the method's, since the core
defaults are registered first and pluggy calls later registrations first. Use pluggy hook
wrappers (``@hookimpl(wrapper=True)``) to wrap another plugin's answer (noise on uploads,
flipped labels, compression).
"""

from __future__ import annotations

import pluggy

PROJECT = "pfl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Hooks:
    @hookspec
    def check_spec(self, spec):
        """Validate what this plugin needs from the spec (a public set, a model family...)
        before any data is loaded. Raise :class:`pfl_core.errors.SpecError` naming the key."""

    @hookspec
    def setup(self, ctx):
        """Once, before round 1: initialise ``ctx.server`` and any client state."""

    @hookspec(firstresult=True)
    def select_clients(self, ctx, round):
        """The ids of this round's participants (default: ``experiment.participation`` of all
        training clients, drawn with the round's seeded RNG)."""

    @hookspec
    def on_round_start(self, ctx, round, participants):
        """Server-side work before clients train (e.g. pick this round's mix factors)."""

    @hookspec(firstresult=True)
    def client_weighting(self, ctx, participants):
        """Aggregation weights: ``{client_id: weight}`` summing to 1 (default: train sizes)."""

    @hookspec(firstresult=True)
    def on_broadcast(self, ctx, client_id):
        """Server side: the message (a dict of named payloads) sent to one client this round.
        Its bytes are counted as downstream communication. Default: an empty message."""

    @hookspec(firstresult=True)
    def on_receive(self, ctx, client, message):
        """Client side: merge the broadcast into the client's state and working model
        (copy weights, mix layers, store consensus labels...)."""

    @hookspec(firstresult=True)
    def local_train(self, ctx, client):
        """The client's local update. Default: ``training.local_epochs`` epochs of the
        configured optimiser on the client's train split, each batch's loss the sum of all
        ``local_objective`` terms. Return a dict of metrics (``train_loss`` is averaged over
        participants and logged as ``train_loss_mean``), possibly empty, never None: None
        means "not handled" to pluggy, and the default would train the client again."""

    @hookspec
    def local_objective(self, ctx, client, model, x, y, logits):
        """One term of the loss for one batch; the engine sums every plugin's term. The core
        contributes the task loss (``task_loss``'s answer, by default cross-entropy(logits, y));
        FedProx adds its proximal term."""

    @hookspec(firstresult=True)
    def task_loss(self, ctx, client, logits, y):
        """Client side: the task loss of one batch, a scalar tensor (the mean over the batch),
        in place of the core's cross-entropy(logits, y); every ``local_objective`` term of the
        method and the add-ons is still added to it. ``logits`` are the model's outputs for the
        batch (``[batch, classes]``), ``y`` its labels. None defers to the next plugin, and
        when no plugin answers the core's cross-entropy applies (bit for bit as without the
        hook). The first non-None answer wins: the algorithm's, then the add-ons', last listed
        first. It replaces the core's term only: a method whose ``client.train(loss_fn=...)``
        computes a loss of its own does not call it. FedLC's calibrated cross-entropy is the
        example in docs/writing-a-plugin.md."""

    @hookspec
    def adjust_gradients(self, ctx, client, model, optimizer):
        """Client side, in every step of ``client.train`` (``run_epochs``), after ``backward()``
        and before ``optimizer.step()``: change ``p.grad`` of ``model``'s parameters in place
        (``model.named_parameters()``; a parameter that got no gradient has ``p.grad is None``).
        For gradient corrections that are not a loss term: SCAFFOLD's ``c - c_i``, FedDyn's
        linear term. Returns nothing; every implementation runs (algorithm first, then the
        add-ons, last listed first), each on the gradients the previous one left. ``model`` is
        the module being trained (usually ``client.model``; check it when your correction is
        for that model only), ``optimizer`` the optimiser about to step (its ``param_groups``
        hold the learning rate). Asked once per training call whether any plugin implements
        it, so it costs nothing otherwise; a training loop of a method's own gets the same
        call from ``client.gradient_adjuster(model, optimizer)``. While any plugin implements
        it, the ``batched`` executor trains clients one after another."""

    @hookspec(firstresult=True)
    def client_upload(self, ctx, client):
        """Client side: the message sent to the server (bytes counted upstream). It stays valid
        only until the next client runs: copy what you keep. ``client.steps`` is the number of
        optimiser steps the client took this round (what ``budget.private_steps`` and
        ``budget.public_steps`` add up). State the client must keep only if this upload
        arrives goes in ``client.staged`` (see ``upload_lost``). Default: an empty message."""

    @hookspec
    def upload_lost(self, ctx, client_id):
        """Server side, once per participant after it ran (trained and uploaded): return True
        when its upload never reaches the server (a simulated dropout). Any True drops it: the
        client's work and its ``client.state`` changes are kept (it did train), what it put in
        ``client.staged`` is dropped (state that must advance only with a received upload,
        e.g. SCAFFOLD's control variate), its upload is not
        aggregated and its bytes are not counted up (never received), and the other uploads'
        weights are renormalised over the arrivals; when nothing arrives ``server_aggregate``
        is not called and the server state stays as it was. Asked in participant order, in
        the server's process; answer from seeded draws (``ctx.seed_for``/``pfl_core.seeding``)
        so the same spec drops the same uploads. While any plugin implements this hook the
        round's uploads are collected before aggregation (copies, one per arrival) instead
        of streamed."""

    @hookspec(firstresult=True)
    def server_aggregate(self, ctx, uploads, weights):
        """Turn the round's uploads into the next server state. ``uploads`` is an iterator of
        ``(client_id, message)`` that runs each client as it is consumed, so a streaming
        aggregate holds one upload at a time. Unconsumed clients still run afterwards."""

    @hookspec
    def on_round_end(self, ctx, round):
        """After aggregation. May return a dict of extra metrics to log for this round."""

    @hookspec(firstresult=True)
    def evaluation_message(self, ctx, client_id):
        """Server side, before each client is evaluated: what the client needs from the server
        to build the model(s) it is evaluated with (e.g. the global weights), a dict like a
        broadcast. Not counted as communication (evaluation measures, it is not a round).
        Default: an empty message."""

    @hookspec(firstresult=True)
    def personalized_models(self, ctx, client, message):
        """Client side: the model(s) evaluated for this client, ``{metric_prefix: nn.Module}``;
        the prefix ``""`` is the client's personalized model, others (``"server_"``) are logged
        beside. ``message`` is ``evaluation_message``'s answer for this client."""

    @hookspec(firstresult=True)
    def coldstart_personalize(self, ctx, client, message):
        """Client side, after the last round, for each cold-start client (held out of training):
        build its personalized model(s) from ``message``, the server's broadcast to it (the
        engine calls ``on_broadcast`` for it first; its bytes counted down); same return shape
        as ``personalized_models``. Default: ``on_receive(message)``, then
        ``experiment.coldstart_epochs`` epochs of plain local training of ``client.model``."""

    @hookspec
    def on_finish(self, ctx):
        """After the last round (final fine-tuning, cold-start clients). May return metrics."""
