"""FedRep: Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021, Algorithm 1.

The model is a shared representation phi (the body) followed by a personal head h_i (the
last ``head_layers`` parameterised layers, default the classifier). Each round t:

    server: sends phi^t to the participants I^t
    client i: h_i <- tau_h epochs of SGD on h_i, phi^t frozen        (Alg. 1, head update)
              phi_i <- tau_phi epochs of SGD on phi, h_i frozen       (Alg. 1, body update)
              uploads phi_i; keeps h_i
    server: phi^{t+1} = sum_{i in I^t} w_i phi_i                      (Alg. 1, averaging)

Decisions:

- ``average = "samples"`` (default): w_i = n_i / sum_{I^t} n_j, the participants' shares of
  the training samples, as FedAvg and FedPer weight. Alg. 1 prints the plain mean
  1/|I^t| sum phi_i, available as ``average = "uniform"``; the two coincide when clients
  hold equal amounts of data.
- Defaults as in the paper's experiments: 10 epochs for the head, 1 for the representation
  (``body_epochs``; 0 would freeze the body). A spec that compares methods at equal local
  work sets them so that head_epochs + body_epochs equals the others' epochs per round.
- Budget (``local_work``): head_epochs + body_epochs private epochs per round; an epoch is one
  pass over the client's train split, whichever part of the model it trains.
- Cold start: the newcomer receives the final phi, starts from the seeded initial head and
  trains only its head for ``experiment.coldstart_epochs`` epochs, phi frozen (FedRep's
  premise: the representation is shared, only the head is personal).

Everything else (state, messages, evaluation: global body + own head) is FedPer's
(plugins/fedper).
"""

from __future__ import annotations

from attrs import define, field

from pfl_core.api import LocalWork, at_least, hookimpl, one_of
from pfl_plugins.fedper import FedPer


@define
class FedRepParams:
    head_layers: int = field(default=1, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the personal head (1: the "
               "classifier)"})
    head_epochs: int = field(default=10, validator=at_least(0),
                             metadata={"doc": "tau_h: head epochs a round, body frozen, first"})
    body_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "tau_phi: then body epochs, head frozen; 0 freezes the body"})
    average: str = field(default="samples", validator=one_of("samples", "uniform"), metadata={
        "doc": "body average weighted by the participants' training samples, or the plain mean of Alg. 1"})


class FedRep(FedPer):
    name = "fedrep"
    Params = FedRepParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(self.params.head_epochs + self.params.body_epochs))

    @hookimpl
    def client_weighting(self, ctx, participants):
        if self.params.average == "uniform":
            return {i: 1.0 / len(participants) for i in participants}
        return None  # the core default: shares of the participants' training samples

    def train_parts(self, ctx, client, phases):
        """For each ("head" | "body", epochs): SGD on that part, the other part frozen."""
        model = client.model
        head_keys = set(self.head_keys(ctx))
        parts = {"head": [p for k, p in model.named_parameters() if k in head_keys],
                 "body": [p for k, p in model.named_parameters() if k not in head_keys]}
        metrics = {}
        for part, epochs in phases:
            if not epochs:
                continue
            frozen = parts["body" if part == "head" else "head"]
            for p in frozen:
                p.requires_grad_(False)
            try:
                metrics = client.train(epochs=epochs, optimizer=client.optimizer(params=parts[part]))
            finally:
                for p in frozen:
                    p.requires_grad_(True)
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train_parts(ctx, client, [("head", self.params.head_epochs),   # head first
                                                 ("body", self.params.body_epochs)])  # then the body
        self.keep_head(ctx, client)
        return metrics

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # final phi + the seeded initial head
        self.train_parts(ctx, client, [("head", ctx.spec.experiment.coldstart_epochs)])
        return {"": client.model}


__all__ = ["FedRep", "FedRepParams"]
