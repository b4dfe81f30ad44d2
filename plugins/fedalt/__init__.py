"""FedAlt: Pillutla et al., "Federated Learning with Partial Model Personalization", ICML 2022
(Algorithm 1 with alternating updates).

Shared parameters u (the base, layers 1..k), personal parameters v_i (the head, the last
``head_layers`` layers k+1..L; default: the middle, k = L // 2).

    each round t, each participant i:
        receive u_t; v_i kept on the client (seeded initial weights before its first round)
        v_i <- personal_epochs epochs of SGD on v with u = u_t fixed       (personal first)
        u_i <- tau epochs of SGD on u with v = v_i fixed                  (then shared)
        upload u_i
    u_{t+1} <- sum_i n_i/n u_i

tau is ``training.local_epochs``; ``personal_epochs`` defaults to 1 (the paper runs one
local epoch for each part). Its local work per round (``local_work``, for equal-budget
comparisons) is therefore ``personal_epochs + tau`` epochs over the client's data.
Cold-start clients (never trained) personalise as in the paper's evaluation of new clients:
the personal part is *reconstructed* by training v alone for ``experiment.coldstart_epochs``
with the final u fixed.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field

from pfl_core.api import LocalWork, PartialModel, at_least, hookimpl, only_training


@define
class FedAltParams:
    head_layers: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the personal head (the rest "
               "is the shared base); none: the middle (L - L // 2, base L // 2). Both parts non-empty "
               "(checked against the model)"})
    personal_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs on the personal part a round, shared part fixed, before training.local_epochs "
               "epochs on the shared part"})


class FedAlt(PartialModel):
    name = "fedalt"
    Params = FedAltParams
    shared_part = "base"

    def local_work(self, spec):
        """Both phases are private training: personal_epochs + tau epochs per round."""
        return LocalWork(float(self.params.personal_epochs + spec.training.local_epochs))

    def train_part(self, ctx, client, keys, epochs):
        with only_training(client.model, set(keys)) as params:
            return client.train(epochs=epochs, optimizer=client.optimizer(params=params))

    @hookimpl
    def local_train(self, ctx, client):
        self.train_part(ctx, client, self.personal_keys(ctx, client.arch), self.params.personal_epochs)
        metrics = self.train_part(ctx, client, self.shared_keys(ctx, client.arch), ctx.spec.training.local_epochs)
        self.keep_personal(ctx, client)
        return metrics

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.train_part(ctx, client, self.personal_keys(ctx, client.arch), ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}
