"""Simulated client faults: add-ons that compose with every method (``[[addons]]``).

Dropout (``dropout``): each selected client fails to return its upload with probability
  ``p``. It fails *after* it trained: its work is counted (``budget.*``) and its own state
  keeps what the round did, only the upload never reaches the server. The server aggregates
  what arrived, the weights renormalised over the arrivals; a round where nothing arrived
  keeps the previous server state (``server_aggregate`` is not called). A lost upload was
  never received, so its bytes are not counted in ``comm_up_bytes``. The draw for client i in
  round t is ``numpy_rng(experiment.seed, "dropout", t, i).random() < p``, independent of who
  else was selected. Implemented with the server-side hook ``upload_lost``; logged per round
  as ``dropped_clients``. A client skipped for a non-finite update
  (``training.on_nonfinite = "skip_client"``) is counted there, not here.

Stragglers (``stragglers``): each selected client is a straggler with probability
  ``fraction`` and then runs only part of its local work, as FedProx's paper simulates
  systems heterogeneity (stragglers do fewer local steps than the rest). A straggler's round
  has a budget of mini-batch steps drawn uniformly from 1 .. full - 1 (1 when full is 1),
  where full is the batches of ``training.local_epochs`` epochs over its train split at
  ``training.batch_size`` (the configured local work). The budget is a compute limit for the
  whole round: it counts every step of every training loop of the client (private or
  public data, warm-up, fine-tuning phases), so a method that trains more per round than
  the configured epochs is cut at the same number of steps. ``budget.*`` measures what ran.
  Both draws come from ``client.rng("stragglers")`` (seed, "stragglers", round, client).

  The client decides (a hook wrapper on ``on_receive``, before any plugin's own
  ``on_receive``, so a distillation step there is limited too): it only sets
  ``client.batch_limit``, its own per-round value, and never touches ``ctx.server``. The
  server logs the round's count as ``stragglers`` from ``on_round_start`` by making the
  same seeded draw for each participant (a number, not a message: nothing is sent).
  Server-side training (Centralized's pooled training, COSMOS's server models) is not a
  client's work and is not limited.
"""

from __future__ import annotations

import numpy as np
from attrs import define, field

from pfl_core.api import ADDON, Plugin, batch_starts, between, hookimpl, numpy_rng


def upload_is_lost(seed: int, round: int, client_id: int, p: float) -> bool:
    """The seeded dropout draw for one client in one round."""
    return bool(numpy_rng(seed, "dropout", round, client_id).random() < p)


def is_straggler(rng: np.random.Generator, fraction: float) -> bool:
    """The first draw of a client's ``stragglers`` generator: does it straggle this round?"""
    return bool(rng.random() < fraction)


def straggler_budget(rng: np.random.Generator, fraction: float, full_batches: int) -> int | None:
    """None for a client that does all its work; for a straggler, its batch budget: uniform
    in 1 .. full_batches - 1 (fewer than the full work when that is possible, never zero)."""
    if not is_straggler(rng, fraction):
        return None
    return int(rng.integers(1, max(full_batches - 1, 1), endpoint=True))


def full_batches(num_train: int, training) -> int:
    """Mini-batch steps of ``training.local_epochs`` epochs over ``num_train`` samples."""
    return training.local_epochs * len(batch_starts(num_train, training.batch_size, training.drop_last))


@define
class DropoutParams:
    p: float = field(default=0.1, validator=between(0, 1), metadata={
        "doc": "probability that a selected client's upload is lost (after it trained); 0: none, 1: all"})


class Dropout(Plugin):
    """Each selected client's upload is lost with probability ``p`` after it trained; the
    server aggregates the arrivals (weights renormalised), keeps its state when none arrives,
    and logs ``dropped_clients``."""

    name = "dropout"
    kind = ADDON
    Params = DropoutParams

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        ctx.log(dropped_clients=0.0)

    @hookimpl
    def upload_lost(self, ctx, client_id):
        lost = upload_is_lost(ctx.spec.experiment.seed, ctx.round, client_id, self.params.p)
        if lost:
            ctx.round_metrics["dropped_clients"] += 1.0
        return lost


@define
class StragglersParams:
    fraction: float = field(default=0.5, validator=between(0, 1), metadata={
        "doc": "probability that a selected client straggles this round (runs 1 .. full - 1 of its "
               "local_epochs' batches)"})


class Stragglers(Plugin):
    """A ``fraction`` of the selected clients (each with that probability, seeded per round and
    client) run only a random number of mini-batch steps, fewer than their configured local
    epochs (FedProx's systems heterogeneity); logs ``stragglers``."""

    name = "stragglers"
    kind = ADDON
    Params = StragglersParams

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        seed = ctx.spec.experiment.seed
        count = sum(is_straggler(numpy_rng(seed, "stragglers", round, i), self.params.fraction)
                    for i in participants)
        ctx.log(stragglers=float(count))

    @hookimpl(wrapper=True)
    def on_receive(self, ctx, client, message):
        # Only a participant's round visit: a cold-start client's on_receive is not a round.
        if client.id in ctx.participants:
            client.batch_limit = straggler_budget(client.rng("stragglers"), self.params.fraction,
                                                  full_batches(client.num_train, ctx.spec.training))
        return (yield)


__all__ = ["Dropout", "DropoutParams", "Stragglers", "StragglersParams", "full_batches", "is_straggler",
           "straggler_budget", "upload_is_lost"]
