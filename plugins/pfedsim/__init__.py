"""pFedSim: Tan, Zhou, Liu, Wang and Yu, "pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning", 2023 (arXiv:2305.15706).

The model is a feature extractor phi (every state-dict entry outside the classifier) and a
classifier h (the last parameterised layer). After FedAvg warm-up rounds each client keeps its
classifier, and its feature extractor is the mix of the clients' extractors weighted by how
alike their classifiers are. As run here, with P = ``warmup_rounds`` and lam = ``self_similarity``:

    rounds 1..P (warm-up): FedAvg on the whole model (plugins/fedavg)                  (phase 1)
    rounds t > P (personalisation), the server keeps for every training client j phi_j, the
        extractor of its last delivered upload (the warm-up's final one before that), and the
        similarity s_ij of clients i and j (0 until both deliver in the same round):  (phase 2)
        s_ij = max(0, (1 / C) sum_c cos(H_i[c], H_j[c]))   H: the classifier's weight, one row
               per class c; set for every pair of the round's delivered uploads   (server_aggregate)
        v_ij = -log(1 - s_ij) for j != i, v_ii = -log(1 - lam);
        phi_bar_i = sum_j v_ij phi_j / sum_j v_ij, or phi_i while every v_ij (j != i) is 0
                                                                                 (on_broadcast)
        client i: phi_bar_i with its own classifier (the warm-up's until it has trained one);
        training.local_epochs of the configured optimiser on the whole model; it keeps the
        trained model and uploads its extractor and H_i                      (local_train, upload)
    evaluation: rounds <= P FedAvg's global model; after, client i's last trained model (its
        extractor trained from phi_bar_i and its classifier), as the reference scores it; a
        client that has not trained since the warm-up is scored with the warm-up's model.

What was read: the paper's abstract only (its method section and equations could not be read
from this machine, so the step labels above are this docstring's, not the paper's). The steps
follow FL-bench, whose maintainer is the paper's first author: ``src/server/pfedsim.py`` and the
FedAvg it builds on (``src/server/fedavg.py``, ``src/client/fedavg.py``) of KarhouTam/FL-bench at
06e658bca5af6ce732e25bb7c0f8be321e14a85e (Oct 2025), read in full, not copied. PFLlib
(TsingZ0/PFLlib) has no pFedSim.

Defaults: ``warmup_rounds = none``: half of experiment.rounds, rounded down (FL-bench's
``warmup_round = 0.5``); ``self_similarity = 0.9999`` (FL-bench's fixed value: v_ii = 9.21, so a
client's own extractor outweighs any other's unless several are alike).

Deviations and decisions:

- Similarity cap. s_ij is capped at lam, so no other client weighs more than the client itself;
  FL-bench leaves it uncapped, and two identical classifiers (s = 1) give it an infinite weight.
- What is the classifier: the model's last parameterised layer (FL-bench: the module named
  ``classifier``); its weight, flattened to one row per output, gives H. Its bias stays personal
  but is not compared (FL-bench compares the weight only).
- Buffers (BatchNorm's running statistics) of the extractor are mixed with its weights, as
  FedAvg averages them in the warm-up (its integer entries are the client's own phi_i's);
  FL-bench mixes parameters only (with its default ``buffers = global`` a client takes the
  buffers its worker's model holds).
- Where the classifier lives: FL-bench's server stores every client's whole model. Here the
  client keeps its trained model (``client.state["model"]``) and the server keeps phi_j and s,
  so a client receives phi_bar_i (and the warm-up's classifier until the server has received
  one of its personal uploads) and uploads phi_i and H_i.
- Lost uploads (``dropout``) and non-finite skips: the client trained, so it keeps its model
  (its classifier, and the model it is scored with); the server's phi_i and every s_ij of i stay
  as they were, and s is set only between delivered uploads. Nothing mirrors the server on the
  client, so nothing is staged (docs/writing-a-plugin.md, "Client state and lost uploads").
- client_weighting is used in the warm-up rounds only (FedAvg's n_k / n); the personalisation
  weights are the similarities alone, as in FL-bench.
- Cold start: a newcomer receives the warm-up's model (it has no classifier to compare) and
  fine-tunes it ``experiment.coldstart_epochs`` (the core default). FL-bench has no
  novel-client procedure.
- Only one architecture (the extractors are mixed entry by entry).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    SpecError,
    WeightAveraging,
    at_least,
    between,
    classifier,
    head_keys,
    hookimpl,
    load_state,
    per_run,
    weighted_average,
)


@define
class PFedSimParams:
    warmup_rounds: int | None = field(default=None, validator=at_least(0), metadata={
        "doc": "P: FedAvg rounds before the personalisation starts in round P + 1; none: experiment.rounds // 2 "
               "(FL-bench's warmup_round = 0.5). Less than experiment.rounds"})
    self_similarity: float = field(default=0.9999, validator=between(0, 1, low_open=True, high_open=True), metadata={
        "doc": "lam: the similarity a client has with itself, giving its own extractor the weight -log(1 - lam) "
               "in its mix; the others' similarities are capped at it (FL-bench's fixed 0.9999)"})


# -- the similarities and the weights ------------------------------------------------------------


def classifier_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """s = max(0, mean over output rows c of cos(a[c], b[c])) of two classifier weights."""
    rows_a, rows_b = a.double().flatten(1), b.double().flatten(1)
    return max(0.0, float(F.cosine_similarity(rows_a, rows_b, dim=1).mean()))


def mixing_weights(similarity_row: torch.Tensor, own: int, self_similarity: float) -> torch.Tensor | None:
    """Client ``own``'s normalised weights v_ij / sum_j v_ij, v = -log(1 - s), from its row of the
    similarity matrix (s capped at lam, s_ii = lam); None while no other client is similar."""
    s = similarity_row.double().clamp(0.0, self_similarity)
    s[own] = 0.0
    if not bool((s > 0).any()):
        return None
    s[own] = self_similarity
    v = -torch.log1p(-s)
    return v / v.sum()


def no_warmup_left(spec_path: str, rounds: int) -> SpecError:
    return SpecError(f"{spec_path}.params.warmup_rounds",
                     f"must be less than experiment.rounds ({rounds}): pFedSim personalises from round "
                     f"warmup_rounds + 1 on")


class PFedSim(WeightAveraging):
    """pFedSim (Tan et al. 2023): FedAvg warm-up, then each client's feature extractor is the
    mix of the clients' extractors weighted by -log(1 - s), s the cosine similarity of their
    classifiers; the classifier stays with the client (see the module doc)."""

    name = "pfedsim"
    Params = PFedSimParams

    def warmup_rounds(self, spec) -> int:
        p = self.params.warmup_rounds
        return spec.experiment.rounds // 2 if p is None else p

    def personalising(self, ctx) -> bool:
        return ctx.round > self.warmup_rounds(ctx.spec)

    def split(self, ctx, arch: str) -> tuple[list[str], list[str], str]:
        """(extractor keys, classifier keys, the classifier weight's key) of ``arch``, once per run."""
        def compute():
            model = ctx.models.working(arch)
            head = head_keys(model)
            weight = classifier(model).weight
            weight_key = next(name for name, p in model.named_parameters() if p is weight)
            return [k for k in model.state_dict() if k not in head], head, weight_key
        return per_run(ctx, self, f"split:{arch}", compute)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        if self.warmup_rounds(spec) >= spec.experiment.rounds:
            raise no_warmup_left(self.spec_path, spec.experiment.rounds)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        ctx.server["extractors"] = {}  # phi_j: the extractor of client j's last delivered personal upload
        n = len(ctx.training_clients)
        ctx.server["similarity"] = torch.zeros(n, n, dtype=torch.float64)  # s, rows in training_clients order
        ctx.resolved_value("warmup_rounds", self.warmup_rounds(ctx.spec))

    def warmup_part(self, ctx, keys) -> dict[str, torch.Tensor]:
        return {k: ctx.server["global"][k] for k in keys}

    def personal_extractor(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        """phi_bar_i: the similarity mix of every phi_j, or phi_i itself while no one is similar
        (a newcomer: the warm-up's extractor)."""
        extractor_keys, _, _ = self.split(ctx, ctx.models.arch_of(0))
        warmup = self.warmup_part(ctx, extractor_keys)
        clients = list(ctx.training_clients)
        if client_id not in clients:
            return warmup
        own = clients.index(client_id)
        extractors = ctx.server["extractors"]
        weights = mixing_weights(ctx.server["similarity"][own], own, self.params.self_similarity)
        if weights is None:
            return extractors.get(client_id, warmup)
        order = [own] + [col for col in range(len(clients)) if col != own and weights[col] > 0]  # own first:
        # weighted_average takes the integer entries (num_batches_tracked) from the first state
        return weighted_average((float(weights[col]), extractors.get(clients[col], warmup)) for col in order)

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        if not self.personalising(ctx):
            return super().on_broadcast(ctx, client_id)
        _, head, _ = self.split(ctx, ctx.models.arch_of(0))
        message = {"extractor": self.personal_extractor(ctx, client_id)}
        if client_id not in ctx.server["extractors"]:  # the client may not have a classifier yet
            message["classifier"] = self.warmup_part(ctx, head)
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        if not self.personalising(ctx):
            return super().server_aggregate(ctx, uploads, weights)
        # on_broadcast reads phi_j and s while the executor hands out the remaining clients:
        # both stay as they are until every upload is in.
        extractors, classifiers = {}, {}
        for client_id, message in uploads:
            extractors[client_id] = {k: v.detach().clone() for k, v in message["extractor"].items()}
            classifiers[client_id] = message["classifier"].detach().clone()
        clients = list(ctx.training_clients)
        similarity = ctx.server["similarity"].clone()
        arrived = [i for i in classifiers if i in clients]
        pairs = []
        for n, i in enumerate(arrived):
            for j in arrived[n + 1:]:
                s = classifier_similarity(classifiers[i], classifiers[j])
                similarity[clients.index(i), clients.index(j)] = similarity[clients.index(j), clients.index(i)] = s
                pairs.append(s)
        ctx.server["extractors"] = {**ctx.server["extractors"], **extractors}
        ctx.server["similarity"] = similarity
        if pairs:
            ctx.log(pfedsim_similarity=sum(pairs) / len(pairs))
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        if self.personalising(ctx) and client_id in ctx.server["extractors"]:
            return {}  # the client scores the model it trained last
        return {"weights": ctx.server["global"]}  # FedAvg's, frozen at the end of the warm-up

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        if "weights" in message:  # a warm-up round
            return super().on_receive(ctx, client, message)
        _, head, _ = self.split(ctx, client.arch)
        load_state(client.model, message["extractor"])
        own = client.state.get("model")
        load_state(client.model, {k: own[k] for k in head} if own is not None else message["classifier"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()  # the whole model, as in the warm-up
        if self.personalising(ctx):
            client.state["model"] = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        if not self.personalising(ctx):
            return super().client_upload(ctx, client)
        extractor_keys, _, weight_key = self.split(ctx, client.arch)
        state = client.model.state_dict()
        return {"extractor": {k: state[k] for k in extractor_keys}, "classifier": state[weight_key]}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        own = client.state.get("model")
        return {"": load_state(client.model, own if own is not None else message["weights"])}


__all__ = ["PFedSim", "PFedSimParams", "classifier_similarity", "mixing_weights"]
