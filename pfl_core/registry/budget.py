"""Local work per client, declared by each method and measured by the engine.

A comparison is only fair when every method gets the same local computation. Each algorithm
declares what it does per round (:class:`LocalWork`, from ``Plugin.local_work``); the resolved
spec shows the totals as a ``[budget]`` table, and the engine measures what really ran
(samples processed over the client's private train split and over the public set) and logs
the cumulative mean per training client as ``budget.private_epochs`` and
``budget.public_epochs`` after every round; in the other unit, optimiser steps summed over a
client's models, as ``budget.private_steps`` and ``budget.public_steps``, and the steps of
fine-tuning at evaluation time (FedBABU's head, Per-FedAvg's adaptation) as
``budget.finetune_steps``.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class LocalWork:
    """Epochs of local training one participating client does.

    ``*_per_round`` happen in every round the client takes part in; ``pretrain_*`` once, in
    its first round (warm-up or pre-training before the first upload).
    """

    private_epochs_per_round: float
    public_epochs_per_round: float = 0.0
    pretrain_private_epochs: float = 0.0
    pretrain_public_epochs: float = 0.0

    def table(self, rounds: int) -> dict[str, float]:
        """The resolved spec's ``[budget]`` table: totals for a client that takes part in all
        ``rounds`` rounds, and the per-round parts they are made of."""
        return {
            "private_epochs": self.pretrain_private_epochs + rounds * self.private_epochs_per_round,
            "public_epochs": self.pretrain_public_epochs + rounds * self.public_epochs_per_round,
            "private_epochs_per_round": self.private_epochs_per_round,
            "public_epochs_per_round": self.public_epochs_per_round,
            "pretrain_private_epochs": self.pretrain_private_epochs,
            "pretrain_public_epochs": self.pretrain_public_epochs,
        }


@attrs.define
class WorkCounter:
    """Samples one client processed this round (forward + backward passes), and the optimiser
    steps it took on them, summed over all its models (``report.budget = "steps"``)."""

    private: int = 0
    public: int = 0
    private_steps: int = 0
    public_steps: int = 0

    @property
    def steps(self) -> int:
        return self.private_steps + self.public_steps
