"""FedFomo: Zhang, Sapra, Fidler, Yeung and Alvarez, "Personalized Federated Learning with First
Order Model Optimization", ICLR 2021 (arXiv:2012.08565), Algorithm 1.

There is no global model. Every client i keeps its own model theta_i and, each round, downloads
M other clients' latest models theta_n and moves towards those that lower its loss on its own
validation data, each in proportion to the loss it saves per unit of distance (a first-order
estimate of the best step towards theta_n):

    (F1)  w_n = (L_i(theta_i^{t-1}) - L_i(theta_n^t)) / ||theta_n^t - theta_i^{t-1}||
          L_i: client i's mean cross-entropy on its validation split
    (F2)  theta_i^t = theta_i^{t-1} + sum_n  max(w_n, 0) / sum_m max(w_m, 0)  (theta_n^t - theta_i^{t-1})
          (unchanged if no w_n is positive)
    (F3)  the server's affinity p_{i,n} <- p_{i,n} + w_n, for the n client i downloaded
    (F4)  epsilon-greedy downloads: for each of the M slots, with probability epsilon_t a model
          drawn at random among the others not yet chosen, else the next by p_{i,n};
          epsilon_t = max(0, epsilon - epsilon_decay (t - 1))

    each round t, each participant i:
        server: chooses M of the stored models of the other clients by (F4), sends them (on_broadcast)
        client: (F1), (F2) from its own theta_i^{t-1} (the seeded initial weights
                before its first round)                                                (on_receive)
                training.local_epochs epochs of SGD from theta_i^t; keeps theta_i^t    (local_train)
                uploads theta_i^t and its w_n                                          (client_upload)
        server: stores theta_i^t and adds w_n to p_{i,n} (F3)                      (server_aggregate)
    evaluation: client i's own theta_i (the seeded initial weights before it ever trained)

(F1)-(F4) label the steps in this docstring: (F1)-(F2) are the paper's weight and update
equations with their normalisation, and (F4) its epsilon-greedy choice; (F3) is how the server
keeps the affinities that (F4) ranks by. The labels are ours: we could not read the paper's text
to check its equation numbers.

Defaults and decisions:

- ``M = 5``: PFLlib's default (the authors' code, github.com/NVlabs/FedFomo, defaults to 8
  models, ``NUM_UPDATE_CLIENTS`` in ``federated/configs.py``, and its README runs use 4 and 9).
  Fewer are sent when fewer other clients have uploaded a model; none in round 1, when nobody
  has.
- ``epsilon = 0.3`` and ``epsilon_decay = 0.05`` (subtracted per round): the authors' values
  (their ``federated/configs.py`` and README runs; 0.001 before that, by its comment), so the
  exploration ends after round 6. The draws use ``numpy_rng(seed, "fedfomo", round, client)``; ties in
  p_{i,n} are broken at random, as theirs (read, not copied).
- L_i is the validation split's mean cross-entropy in eval mode (``partition.val_fraction``
  must be > 0: checked before data loads). The split is part of the client's data that it does
  not train on, as the paper's validation set. Note for tuning: ``[tune]`` scores on the same
  validation splits, which FedFomo has used to choose its weights, so its validation accuracy
  is optimistic; compare on the test split.
- ||.|| is the L2 norm over the model's parameters (buffers excluded), in float64, as in the
  paper (the authors' code divides by an L1 distance, PFLlib by the L2 norm plus 1e-5). A model
  identical to theta_i (distance 0) gets w_n = 0. Only the n client i *downloaded* enter (F2):
  the paper's update; theta_i^{t-1} is the client's model as it left its last round (PFLlib uses
  its model before training, and always downloads the client's own model too).
- (F2) moves every floating-point state entry (BatchNorm statistics too) with the same weights;
  integer entries (``num_batches_tracked``) stay theta_i's. (F3) adds the raw w_n, as PFLlib
  (the authors' code adds w_n / |sum_m w_m|, the weights normalised by their sum's magnitude).
- Models and affinities uploaded in a round are stored after that round's aggregation, so every
  download of round t is a model of an earlier round.
- Bytes: the M downloaded models down (counted: nbytes of the message), theta_i and the M
  floats w_n up. The validation passes are not training and are not counted as work.
- Logged per client: ``fomo_downloads`` (models received) and ``fomo_positive`` (how many had
  w_n > 0).
- Cold start: the newcomer (no affinities yet: all ties, so a random choice) downloads M models,
  applies (F1)-(F2) from the initial weights and trains ``experiment.coldstart_epochs`` epochs.
"""

from __future__ import annotations

import numpy as np
import torch
from attrs import define, field

from pfl_core.api import (
    Plugin,
    SpecError,
    at_least,
    between,
    clone_state,
    finite,
    hookimpl,
    load_personal,
    load_state,
    numpy_rng,
    per_run,
    require_single_architecture,
    score,
)


@define
class FedFomoParams:
    M: int = field(default=5, validator=at_least(0), metadata={
        "doc": "models each participant downloads a round (0: Local); PFLlib's default"})
    epsilon: float = field(default=0.3, validator=[finite, between(0, 1)], metadata={
        "doc": "epsilon of the epsilon-greedy choice of downloads in round 1 (the authors' code)"})
    epsilon_decay: float = field(default=0.05, validator=[finite, at_least(0)], metadata={
        "doc": "subtracted from epsilon every round: epsilon_t = max(0, epsilon - epsilon_decay (t - 1)) "
               "(the rule and the value of the authors' code)"})


# -- the paper's equations, as plain functions ---------------------------------------------------


def distance(a: dict, b: dict, names) -> float:
    """||a - b||, the L2 norm over the parameter keys ``names``, in float64."""
    return float(sum((a[n].double() - b[n].double()).pow(2).sum() for n in names)) ** 0.5


def fomo_weights(own_loss: float, losses: list[float], distances: list[float]) -> list[float]:
    """(F1): w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i|| (0 where the distance is 0)."""
    return [(own_loss - loss) / d if d > 0 else 0.0 for loss, d in zip(losses, distances)]


def normalised(weights: list[float]) -> list[float]:
    """max(w_n, 0) / sum_m max(w_m, 0) (all zero when no weight is positive)."""
    positive = [max(w, 0.0) for w in weights]
    total = sum(positive)
    return [w / total for w in positive] if total > 0 else positive


def fomo_update(own: dict, models: list[dict], weights: list[float]) -> dict:
    """(F2): theta_i + sum_n w_n (theta_n - theta_i), ``weights`` already normalised; integer
    entries stay theta_i's."""
    out = {}
    for key, value in own.items():
        if not value.is_floating_point():
            out[key] = value
            continue
        step = torch.zeros_like(value)
        for w, model in zip(weights, models):
            if w > 0:
                step = step + w * (model[key] - value)
        out[key] = value + step
    return out


def choose_downloads(candidates: list, affinity: dict, M: int, epsilon: float, rng: np.random.Generator) -> list:
    """(F4): M of ``candidates`` (all of them if there are no more), slot by slot: with probability
    ``epsilon`` the next of a random order, else the next by ``affinity`` (ties at random)."""
    if len(candidates) <= M:
        return list(candidates)
    ties = rng.random(len(candidates))
    by_affinity = [candidates[k] for k in np.lexsort((ties, [-affinity.get(c, 0.0) for c in candidates]))]
    at_random = [candidates[k] for k in rng.permutation(len(candidates))]
    chosen = []
    for _ in range(M):
        source = at_random if rng.random() < epsilon else by_affinity
        chosen.append(next(c for c in source if c not in chosen))
    return chosen


# -- the plugin ---------------------------------------------------------------------------------


class FedFomo(Plugin):
    """FedFomo (Zhang et al. 2021): each participant downloads M other clients' models (chosen
    epsilon-greedily by past usefulness), moves towards those that lower its validation loss,
    weighted by the loss saved per unit of distance, then trains; each client is scored with its
    own model. M models down, one model up."""

    name = "fedfomo"
    Params = FedFomoParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)
        if self.params.M > 0 and spec.partition.val_fraction == 0:
            raise SpecError("partition.val_fraction", "is 0, but fedfomo weighs the downloaded models by the loss "
                                                      "on each client's validation split: set it > 0 (or M = 0)")

    @hookimpl
    def setup(self, ctx):
        ctx.server["models"] = {}  # theta_n: the last upload of every client that has uploaded
        ctx.server["P"] = {}  # p_{i,n}: {i: {n: affinity}}

    def epsilon(self, round: int) -> float:
        return max(0.0, self.params.epsilon - self.params.epsilon_decay * (round - 1))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        models = ctx.server["models"]
        candidates = [n for n in sorted(models) if n != client_id]
        rng = numpy_rng(ctx.spec.experiment.seed, "fedfomo", ctx.round, client_id)
        chosen = choose_downloads(candidates, ctx.server["P"].get(client_id, {}), self.params.M,
                                  self.epsilon(ctx.round), rng)
        return {"models": {n: models[n] for n in chosen}}

    def parameter_names(self, ctx, client) -> list[str]:
        return per_run(ctx, self, f"names:{client.arch}", lambda: [n for n, _ in client.model.named_parameters()])

    def val_loss(self, ctx, client, state: dict) -> float:
        model = load_state(client.model, state)
        with torch.no_grad():
            return score(model, client.data.val_x, client.data.val_y, ctx.spec.evaluation.batch_size).loss

    @hookimpl
    def on_receive(self, ctx, client, message):
        own = clone_state(load_personal(ctx, client))  # theta_i^{t-1}
        received = message["models"]
        ids = sorted(received)
        weights = []
        if ids:
            names = self.parameter_names(ctx, client)
            own_loss = self.val_loss(ctx, client, own)
            losses = [self.val_loss(ctx, client, received[n]) for n in ids]
            weights = fomo_weights(own_loss, losses, [distance(received[n], own, names) for n in ids])  # (F1)
            own = fomo_update(own, [received[n] for n in ids], normalised(weights))  # (F2)
        load_state(client.model, own)
        client.scratch["fomo"] = dict(zip(ids, weights))
        client.log(fomo_downloads=len(ids), fomo_positive=sum(w > 0 for w in weights))
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)  # theta_i^t
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": client.model.state_dict(), "fomo": client.scratch["fomo"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        received = {i: (clone_state(message["weights"]), dict(message["fomo"])) for i, message in uploads}
        for i, (model, fomo) in received.items():  # after the round: downloads of round t are older models
            ctx.server["models"][i] = model
            row = ctx.server["P"].setdefault(i, {})
            for n, w in fomo.items():  # (F3)
                row[n] = row.get(n, 0.0) + float(w)
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}


__all__ = ["FedFomo", "FedFomoParams", "choose_downloads", "distance", "fomo_update", "fomo_weights", "normalised"]
