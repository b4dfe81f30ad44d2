"""FedCross: Hu, Zhou, Yue, Ling, Huang, Li, Liu, Lian and Chen, "FedCross: Towards Accurate
Federated Learning via Multi-Model Cross-Aggregation", ICDE 2024 (arXiv:2210.08285).

What was read: the paper's abstract and summaries only (its algorithm box and equations could not
be read from this machine), so the step labels (C1)-(C5) below are ours, and every detail follows
the reference implementation in PFLlib (github.com/TsingZ0/PFLlib at
d832e76f6a23b833038949ec1e4fdefe63a4d350, ``system/flcore/servers/servercross.py``,
``system/flcore/clients/clientcross.py`` and the defaults in ``system/main.py``), read in full,
not copied. FL-bench has no FedCross.

The server keeps K middleware models w_1..w_K (K = the round's participants; all equal to the
seeded initial weights w^0 at first) besides the global model w. Each round t = 1, 2, ...:

    (C1) dispatch: a seeded random permutation gives each participant one middleware model
         w_j; it trains w_j for training.local_epochs epochs (plain local training) and uploads
         the trained v_j                                     (on_round_start, on_broadcast, local_train)
    (C2) global model: w = sum_j p_j v_j over the arrived uploads, p_j = client_weighting's
         weights (train sizes, renormalised over the arrivals), as FedAvg and PFLlib
                                                                                     (server_aggregate)
    (C3) collaborator co(j) of each middleware model, by ``collaborator``:
           "lowest_similarity" (PFLlib's default): argmin_{k != j} cos(v_j, v_k);
           "highest_similarity": argmax_{k != j} cos(v_j, v_k);
           "in_order": co(j) = (j + ((t - 1) mod (K - 1)) + 1) mod K, a different partner each
             round (PFLlib's round counter starts at 0: t - 1 here);
         cos is the cosine similarity of the two models' parameters, flattened into one vector
    (C4) cross-aggregation: w_j <- alpha v_j + (1 - alpha) v_co(j), for every j at once
         (the v are this round's, before any mixing)
    (C5) the first ``fedavg_rounds`` rounds instead set every w_j <- w (FedAvg; PFLlib's
         ``first_stage_bound``, 0 by default: cross-aggregation from round 1)

What is evaluated: every client on the global model w of (C2), the paper's deployed model (its
abstract: "a global model for all the clients by federated averaging on the trained
middleware models"). PFLlib prints "Evaluate global model" but tests each client's own
``client.model``, which FedCross never overwrites with w: the middleware model that client last
trained (before cross-aggregation), or the untrained initial model for a client not yet
selected. That is not followed. Cold-start clients (held out of training) receive w and
fine-tune it (experiment.coldstart_epochs, the core default).

Decisions and deviations:

- Similarity (C3): PFLlib sums cosine similarities over chunks of two consecutive state-dict
  entries (about one per layer, the last chunk counted twice, buffers included); here it is one
  cosine over all parameters (buffers excluded), which is what "model similarity" names. Its
  "highest" rule can pick the model itself when every other similarity is negative (the
  diagonal is 0 there); here the model itself is never its collaborator. Ties go to the lowest
  index.
- K = 1 (one participant): nothing to cross with, w_1 <- v_1 (PFLlib divides by K - 1 = 0 in
  the in-order rule). If the number of participants changes between rounds (a custom
  select_clients), every middleware model restarts from w; with the core's sampling K is fixed.
- Buffers (BatchNorm's running statistics) are uploaded with the weights and cross-aggregated
  with the same alpha; integer entries (num_batches_tracked) are the model's own. PFLlib mixes
  only parameters, and its middleware models' buffers stay the initial ones.
- A lost upload (``dropout`` add-on): the server never saw v_j, so the dispatched w_j stands in
  for it in (C3) and (C4); it is not in the average (C2). When nothing arrives, w and the
  middleware models stay. Clients keep no state of their own, so nothing is staged
  (docs/writing-a-plugin.md, "Client state and lost uploads"). PFLlib assumes no drops.
- The paper's acceleration methods (propeller models, dynamic alpha) are not implemented.
- Only one architecture (middleware models are mixed entry by entry).
- Bytes: one model down and one up per participant, as FedAvg; the server holds K + 1 models.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import WeightAveraging, at_least, between, clone_state, hookimpl, one_of, per_run, weighted_average

STRATEGIES = ("lowest_similarity", "highest_similarity", "in_order")


@define
class FedCrossParams:
    alpha: float = field(default=0.99, validator=between(0, 1), metadata={
        "doc": "weight of a middleware model's own trained weights in the cross-aggregation "
               "w_j = alpha v_j + (1 - alpha) v_co(j) (C4); 1 never mixes. Default: PFLlib's 0.99"})
    collaborator: str = field(default="lowest_similarity", validator=one_of(*STRATEGIES), metadata={
        "doc": "how each middleware model's collaborator is chosen (C3): the least or most cosine-similar "
               "other model, or in_order (a partner shifting by one each round). Default: PFLlib's lowest"})
    fedavg_rounds: int = field(default=0, validator=at_least(0), metadata={
        "doc": "the first rounds in which every middleware model is reset to the global model instead of "
               "cross-aggregated (C5; PFLlib's first_stage_bound). Default: PFLlib's 0"})


def cosine_similarities(models: list[dict[str, torch.Tensor]], names: list[str]) -> torch.Tensor:
    """(C3) the K x K matrix of cosine similarities of the models' parameters ``names``, flattened."""
    flat = torch.stack([torch.cat([m[n].detach().double().flatten() for n in names]) for m in models])
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def collaborators(similarity: torch.Tensor, strategy: str, round: int) -> list[int]:
    """(C3) co(j) for each of the K models (round t counts from 1); [0] for K = 1."""
    count = similarity.shape[0]
    if count == 1:
        return [0]
    if strategy == "in_order":
        shift = (round - 1) % (count - 1) + 1
        return [(j + shift) % count for j in range(count)]
    chosen = []
    for j in range(count):
        others = [k for k in range(count) if k != j]
        row = [float(similarity[j, k]) for k in others]
        best = min(row) if strategy == "lowest_similarity" else max(row)
        chosen.append(others[row.index(best)])  # ties: the lowest index
    return chosen


def cross_aggregate(own: dict[str, torch.Tensor], partner: dict[str, torch.Tensor], alpha: float):
    """(C4) alpha * own + (1 - alpha) * partner for float entries; integer entries are own's."""
    return {k: alpha * v + (1 - alpha) * partner[k] if v.is_floating_point() else v.clone() for k, v in own.items()}


class FedCross(WeightAveraging):
    """FedCross (Hu et al. 2024): K middleware models, each trained by one participant a round and
    then mixed with a collaborator (alpha own + (1 - alpha) collaborator); every client is
    evaluated on the average of the trained models (see the module doc)."""

    name = "fedcross"
    Params = FedCrossParams

    def parameter_names(self, ctx) -> list[str]:
        arch = ctx.models.arch_of(0)
        return per_run(ctx, self, "parameters",
                       lambda: [n for n, _ in ctx.models.working(arch).named_parameters()])

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # w = w^0
        ctx.server["middleware"] = []  # w_1..w_K, made at the first round (K = its participants)

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        """(C1): K middleware models, one per participant, assigned by a seeded permutation."""
        count = len(participants)
        if len(ctx.server["middleware"]) != count:  # the first round, or K changed: restart from w
            ctx.server["middleware"] = [clone_state(ctx.server["global"]) for _ in range(count)]
        order = ctx.rng("fedcross-dispatch").permutation(count)
        ctx.server["dispatch"] = {int(i): int(j) for i, j in zip(participants, order)}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        if client_id in ctx.participants:
            return {"weights": ctx.server["middleware"][ctx.server["dispatch"][client_id]]}
        return {"weights": ctx.server["global"]}  # a cold-start client

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(C2)-(C5)."""
        middleware, dispatch = ctx.server["middleware"], ctx.server["dispatch"]
        trained = list(middleware)  # v_j; a lost upload's model stands as dispatched
        arrived = []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            j = dispatch[client_id]
            trained[j] = {k: v.detach().clone().to(ctx.device) for k, v in message["weights"].items()}
            arrived.append((weights[client_id], trained[j]))
        if not arrived:  # nothing arrived: w and the middleware models stay
            return True
        ctx.server["global"] = weighted_average(arrived)
        if ctx.round <= self.params.fedavg_rounds:  # (C5)
            ctx.server["middleware"] = [clone_state(ctx.server["global"]) for _ in trained]
            return True
        similarity = cosine_similarities(trained, self.parameter_names(ctx))
        partners = collaborators(similarity, self.params.collaborator, ctx.round)
        ctx.server["middleware"] = [cross_aggregate(v, trained[partners[j]], self.params.alpha)
                                    for j, v in enumerate(trained)]
        if len(trained) > 1:
            ctx.log(fedcross_collaborator_similarity=sum(float(similarity[j, k]) for j, k in enumerate(partners))
                    / len(partners))
        return True


__all__ = ["FedCross", "FedCrossParams", "collaborators", "cosine_similarities", "cross_aggregate"]
