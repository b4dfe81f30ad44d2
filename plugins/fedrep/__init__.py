"""FedRep: Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021, Algorithm 1.

The model is a shared representation phi (the body) followed by a personal head h_i (the
last ``head_layers`` parameterised layers, default the classifier). Each round t:

    server: sends phi^t to the participants I^t
    client i: h_i <- tau_h epochs of SGD on h_i, phi^t frozen        (Alg. 1, head update)
              phi_i <- tau_phi epochs of SGD on phi, h_i frozen       (Alg. 1, body update)
              uploads phi_i; keeps h_i
    server: phi^{t+1} = 1/|I^t| sum_{i in I^t} phi_i                 (Alg. 1, uniform average)

Defaults as in the paper's experiments: 10 epochs for the head, 1 for the representation
(``body_epochs``; 0 would freeze the body). Everything else (state, messages, evaluation:
global body + own head) is FedPer's (plugins/fedper): the two differ in the local update and
in the server weights (FedRep averages uniformly, FedPer by data size).
"""

from __future__ import annotations

from attrs import define, field

from pfl_core import hookimpl
from pfl_core.spec import at_least
from plugins.fedper import FedPer


@define
class FedRepParams:
    head_layers: int = field(default=1, validator=at_least(1))
    head_epochs: int = field(default=10, validator=at_least(0))  # tau_h
    body_epochs: int = field(default=1, validator=at_least(0))  # tau_phi


class FedRep(FedPer):
    name = "fedrep"
    Params = FedRepParams

    @hookimpl
    def client_weighting(self, ctx, participants):
        return {i: 1.0 / len(participants) for i in participants}

    @hookimpl
    def local_train(self, ctx, client):
        model = client.model
        head_keys = set(ctx.server["head_keys"])
        head = [p for k, p in model.named_parameters() if k in head_keys]
        body = [p for k, p in model.named_parameters() if k not in head_keys]
        metrics = {}
        for params, frozen, epochs in ((head, body, self.params.head_epochs),   # head first
                                       (body, head, self.params.body_epochs)):  # then the body
            if not epochs:
                continue
            for p in frozen:
                p.requires_grad_(False)
            try:
                metrics = client.train(epochs=epochs, optimizer=client.optimizer(params=params))
            finally:
                for p in frozen:
                    p.requires_grad_(True)
        self.keep_head(ctx, client)
        return metrics


__all__ = ["FedRep", "FedRepParams"]
