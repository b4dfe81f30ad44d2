"""Ditto: Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1.

Each client k keeps a personal model v_k beside the global model w, and solves (their Eq. 2)

    min_{v_k} h_k(v_k; w*) = F_k(v_k) + lambda/2 ||v_k - w*||^2,   w* = argmin_w G(F_1(w), ..., F_K(w))

with G the FedAvg objective. Algorithm 1, as run here:

    server: w^0 = the seeded initial weights; v_k^0 = the same weights for every k
    each round t: S_t = the round's participants                           (engine: select_clients)
        each k in S_t, given w^t:                                           (on_broadcast, on_receive)
            w_k^t <- the global solver's local update of w^t: FedAvg's       (local_train, 1st part)
                     training.local_epochs epochs of SGD on F_k
            v_k <- personal_epochs epochs of SGD on F_k(v_k) + lambda/2 ||v_k - w^t||^2,
                   i.e. v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))   (local_train, 2nd part)
            send w_k^t (the global model's update only; v_k never leaves)    (client_upload)
        w^{t+1} <- sum_k n_k / n w_k^t                                      (server_aggregate: FedAvg's)
    evaluation: client k's personal model v_k                               (personalized_models)

Defaults and decisions:

- ``lam = 1.0``: the value of the authors' released example runs of Section 5's benchmarks
  (Fashion-MNIST and Vehicle, without attacks and with 50% adversaries, "lambda=1"); the paper
  tunes lambda per dataset from a small grid (Section 5 and its appendix) and 1 is the value
  its authors chose to publish. Never 0 by default: ``lam = 0`` is Local (personal models
  trained alone; tested bit for bit), which a widely used reference library ships as default.
- ``personal_epochs = None`` means ``training.local_epochs``: Algorithm 1 runs "s local
  iterations" on v_k after the global solver's local update and leaves s free; equal work for
  the two models is the neutral choice (the authors' examples use 2 personal iterations).
- The global solver is FedAvg exactly (``plugins/fedavg``: n_k-weighted mean of the uploaded
  models). Algorithm 1 writes the server step as a plain mean of the updates over S_t; the two
  coincide when clients hold equal amounts of data. FedAvg's local update runs first, so with
  no dropout the global model is FedAvg's bit for bit (tested).
- ``lam = 0`` gives Local's personal models bit for bit (tested): the personal update uses the
  client's own batch order (the same seeded stream as Local's) and optimiser. With dropout the
  equality is only in distribution: Ditto's personal update draws its dropout masks after the
  global update has drawn its own, Local's first.
- The proximal anchor is w^t, the global model received this round (Alg. 1), not w_k^t.
- Budget (``local_work``): training.local_epochs + personal_epochs private epochs per round
  (two models are trained on the client's data).
- Bytes: exactly FedAvg's (w^t down, w_k^t up); the personal model is never sent.
- A client that never took part is evaluated with v_k^0 (the seeded initial weights).
- Cold start: the newcomer receives the final w and trains its personal model from it with
  the proximal objective for ``experiment.coldstart_epochs`` epochs.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field

from pfl_core.api import (
    AnchoredAveraging,
    LocalWork,
    at_least,
    clone_state,
    finite,
    hookimpl,
    load_state,
    proximal_term,
)


@define
class DittoParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "lambda of the personal objective; 0 trains the personal models alone (Local). "
               "Default: the authors' released runs"})
    personal_epochs: Optional[int] = field(default=None, validator=at_least(0), metadata={
        "doc": "epochs of the personal update a round, after the global model's local update; "
               "none: training.local_epochs (the global solver's epochs)"})


class Ditto(AnchoredAveraging):
    """Ditto (Li et al. 2021): FedAvg's global model w plus a personal model v per client, trained
    after the global update on ``f_i(v) + lam/2 * ||v - w||^2``; v is evaluated and never sent
    (FedAvg's bytes). Budget: ``training.local_epochs + personal_epochs`` a round."""

    name = "ditto"
    Params = DittoParams

    def personal_epochs(self, spec) -> int:
        epochs = self.params.personal_epochs
        return spec.training.local_epochs if epochs is None else epochs

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(spec.training.local_epochs + self.personal_epochs(spec)))

    def load_personal(self, ctx, client):
        """v_k in the client's working model (v_k^0 = the seeded initial weights)."""
        return load_state(client.model, client.state.get("personal") or ctx.models.initial_state(client.arch))

    def train_personal(self, ctx, client, anchor, epochs: int) -> dict:
        """v_k <- ``epochs`` epochs of SGD on F_k(v) + lambda/2 ||v - anchor||^2; stored in client.state."""
        self.load_personal(ctx, client)
        client.scratch["anchor"] = anchor  # switches the proximal term on (local_objective)
        try:
            metrics = client.train(epochs=epochs)
        finally:
            del client.scratch["anchor"]
        client.state["personal"] = clone_state(client.model)
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()  # the global solver: FedAvg's local update of w^t
        client.scratch["upload"] = clone_state(client.model)  # w_k^t, kept while v_k trains
        self.train_personal(ctx, client, client.scratch["w_t"], self.personal_epochs(ctx.spec))
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lambda/2 ||v - w^t||^2, during the personal update only (None otherwise: no term)."""
        anchor = client.scratch.get("anchor")
        if anchor is None:
            return None
        return proximal_term(model, anchor, self.params.lam)

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": client.scratch["upload"]}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # v_k is evaluated: nothing from the server

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_personal(ctx, client)}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        client.state["personal"] = clone_state(client.model)  # v starts at the final w
        self.train_personal(ctx, client, client.scratch["w_t"], ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}


__all__ = ["Ditto", "DittoParams"]
