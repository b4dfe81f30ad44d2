"""COSMOS: model-agnostic personalized FL with clustered server models and
pseudo-label-only communication (seeds/cosmos.txt, Sections 4.1-4.2; METHODS.md).

Round 1, pre-training and clustering (PTC):
    1. each client trains E0 = ``pretrain_epochs`` epochs on D_i, sends f_i(U)
    2. d(i, j) = mean_{x in U} ||f_i(x) - f_j(x)||_1                    (in [0, 2])
       greedy clustering (Alg. 1): repeatedly take the unassigned client with the most
       unassigned neighbours within B0, make it and them a cluster; K is an outcome.
       ``b0 = "auto"``: grow B0 over the sorted pairwise distances until K <= max_clusters.
    3. per cluster k: h_k (``server_arch``, default VGG-16) minimises Eq. (1)
       sum_x KL(f_bar_k(x) || h_k(x)) + lambda * sum_{x' in S(x)} KL(h_k(x) || h_k(x'))
       with f_bar_k the members' mean prediction and S(x) ``num_augment`` copies of x in its
       transformation ball (random crop/flip for images, plus Gaussian noise of std
       ``noise_std``); h_k(x) in the consistency term is a fixed target (no gradient).
    4. clients distil from h_pi(i)(U) with the same loss form, w_i(x) = 1 (Eq. 2).
Later rounds (IFFT): local fine-tune on D_i -> send f_i(U) -> server fine-tunes the
persistent h_k on the new cluster means (``server_finetune_epochs``) -> clients distil.

Clusters are fixed after round 1; K is logged as the metric ``num_clusters`` and the
assignment as ``cosmos/clusters.csv``. Evaluation reports the client models (``acc_*``)
and, for each client, its cluster's server model (``server_acc_*``): the paper's
personalisation risk. Server training runs through ``ctx.executor.map``, one job per
cluster, like client work.

Decisions where the paper is silent (documented, parameters): server models train with
Adam (``server_lr`` 1e-3) and batch ``distill_batch_size``, over every sample of U in
every epoch (no ``drop_last``: the server is not a small client); clients distil with the
run's optimiser and ``training.drop_last``; E0 = 5, then ``finetune_epochs`` (default
``training.local_epochs``) per later round; 5 server epochs in round 1 and 1 per later
round. Eq. (1)'s sum over U is a per-batch mean (a learning-rate scale). Every client must
take part in round 1 (``experiment.participation = 1``): clusters are formed once, from the
round-1 uploads, and a client missing then would never have a server model.

Devices: augmentations (crop offset, flip mask, noise) are drawn on a seeded CPU generator
and moved to the data's device, so CPU runs are bit-identical to before and CUDA runs draw
the same augmentations (see ``pfl_core.methods.codistill``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from attrs import define, field

from pfl_core.api import (
    DTYPES,
    MODEL,
    CodistillParams,
    FieldError,
    PublicPredictionMethod,
    SpecError,
    at_least,
    clone_state,
    described,
    distill,
    finite,
    hookimpl,
    kl_to_target,
    learning_rate,
    load_state,
    mean_l1_distances,
    precision_autocast,
    predict,
    resolve_plugin,
)


@described('a number > 0, or "auto"')
def positive_or_auto(_instance, attribute, value):
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0) or value != value:
        raise FieldError(attribute.name, f'must be a number > 0 or "auto", got {value!r}')


@define
class CosmosParams(CodistillParams):
    b0: Any = field(default="auto", validator=positive_or_auto, metadata={
        "doc": 'B0, the neighbourhood radius of the greedy clustering (distances are in [0, 2]); "auto": '
               "the smallest B0 that gives at most max_clusters clusters"})
    max_clusters: int = field(default=5, validator=at_least(1),
                              metadata={"doc": 'the most clusters b0 = "auto" allows'})
    server_arch: str = field(default="vgg16", metadata={
        "doc": "model plugin of every cluster's server model h_k (its parameters: model.params if it is "
               "model.name, else model.arch_params.<arch>)"})
    server_epochs: int = field(default=5, validator=at_least(0),
                               metadata={"doc": "server model epochs on U in round 1"})
    server_finetune_epochs: int = field(default=1, validator=at_least(0),
                                        metadata={"doc": "server model epochs on U in every later round"})
    server_lr: float = field(default=1e-3, validator=learning_rate,
                             metadata={"doc": "the server models' Adam step size"})
    lam: float = field(default=5.0, validator=[finite, at_least(0)],
                       metadata={"doc": "lambda, weight of the consistency term of Eq. (1) and (2)"})
    num_augment: int = field(default=2, validator=at_least(0), metadata={
        "doc": "|S(x)|: augmented copies of each x in the consistency term; 0 switches the term off"})
    noise_std: float = field(default=0.05, validator=[finite, at_least(0)],
                             metadata={"doc": "std of the Gaussian noise the augmentation adds"})


# -- clustering (Alg. 1) ---------------------------------------------------------------


def greedy_clusters(distances: np.ndarray, b0: float) -> list[list[int]]:
    """Greedy B0-neighbourhood clustering; ties go to the lowest client index."""
    remaining = list(range(len(distances)))
    clusters = []
    while remaining:
        neighbours = {i: [j for j in remaining if j != i and distances[i, j] <= b0] for i in remaining}
        centre = max(remaining, key=lambda i: (len(neighbours[i]), -i))
        cluster = sorted([centre, *neighbours[centre]])
        clusters.append(cluster)
        remaining = [i for i in remaining if i not in cluster]
    return clusters


def auto_clusters(distances: np.ndarray, max_clusters: int) -> tuple[float, list[list[int]]]:
    """The smallest B0 among 0 and the pairwise distances giving at most max_clusters."""
    candidates = np.unique(np.concatenate([[0.0], distances[np.triu_indices(len(distances), 1)]]))
    for b0 in candidates:
        clusters = greedy_clusters(distances, float(b0))
        if len(clusters) <= max_clusters:
            return float(b0), clusters
    return float(candidates[-1]), greedy_clusters(distances, float(candidates[-1]))


# -- the transformation ball -------------------------------------------------------------


def augment(x: torch.Tensor, generator: torch.Generator, noise_std: float) -> torch.Tensor:
    """A random point of x's transformation ball: crop (pad 2) and flip for images, noise.

    ``generator`` is a CPU generator; the flip mask and the noise are drawn on the CPU and
    moved to ``x``'s device (same numbers on every device)."""
    if x.dim() == 4:
        n, _, h, w = x.shape
        padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="replicate")
        dy, dx = (int(v) for v in torch.randint(0, 5, (2,), generator=generator))
        x = padded[:, :, dy : dy + h, dx : dx + w]
        flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x + noise_std * torch.randn(x.shape, generator=generator).to(x.device)


def consistency_term(params: CosmosParams, generator: torch.Generator):
    """lambda * sum_{x' in S(x)} KL(h(x) || h(x')), h(x) held fixed."""

    def term(model, xb, logits):
        if params.lam == 0 or params.num_augment == 0:
            return 0.0
        anchor = torch.softmax(logits.detach() / params.temperature, dim=1)
        total = 0.0
        for _ in range(params.num_augment):
            total = total + kl_to_target(model(augment(xb, generator, params.noise_std)), anchor, params.temperature)
        return params.lam * total

    return term


def eq1_distill(model, optimizer, x, targets, params: CosmosParams, *, epochs: int, order: torch.Generator,
                augment: torch.Generator, drop_last: bool = False, counter=None, take_batch=None):
    """Minimise Eq. (1) (server, targets f_bar_k) or Eq. (2) (client, targets h_pi(i)) over U:
    per batch, KL(target || model) + lambda * sum_{x' in S(x)} KL(model(x) || model(x')).
    ``order`` draws the batch order, ``augment`` the transformation ball (may be the same)."""
    return distill(model, optimizer, x, targets, epochs=epochs, batch_size=params.distill_batch_size,
                   temperature=params.temperature, generator=order, extra_term=consistency_term(params, augment),
                   drop_last=drop_last, counter=counter, take_batch=take_batch)


class Cosmos(PublicPredictionMethod):
    name = "cosmos"
    Params = CosmosParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        resolve_plugin(MODEL, self.params.server_arch, f"{self.spec_path}.params.server_arch")
        if spec.experiment.participation < 1:
            raise SpecError("experiment.participation",
                            f"{self.name} clusters every client once, on the round-1 uploads: "
                            f"needs participation = 1, got {spec.experiment.participation}")

    def server_archs(self, spec):
        return {self.params.server_arch: f"{self.spec_path}.params.server_arch"}

    @hookimpl
    def setup(self, ctx):
        # Builds the server architecture's plugin under its own key, so errors name it.
        ctx.models.plugin(self.params.server_arch, f"{self.spec_path}.params.server_arch")
        ctx.server["targets"] = {}

    def client_distill(self, ctx, client, model, targets):
        """Eq. (2): the client's model on U against h_pi(i)(U), w_i(x) = 1."""
        p = self.params
        return eq1_distill(model, client.optimizer(), ctx.data.public.x, targets, p, epochs=p.distill_epochs,
                           order=client.generator("distill"), augment=client.generator("augment"),
                           drop_last=ctx.spec.training.drop_last, counter=lambda n: client.count_work(public=n),
                           take_batch=lambda: client.take_batch("public"))

    # -- server ---------------------------------------------------------------------

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        predictions = self.collect_predictions(uploads)
        if "clusters" not in ctx.server:  # round 1: cluster once, on the pre-trained models
            ctx.server["clusters"] = self.cluster(ctx, predictions)
        clusters = ctx.server["clusters"]
        epochs = self.params.server_epochs if "cluster_models" not in ctx.server else self.params.server_finetune_epochs
        models = ctx.server.setdefault("cluster_models", {})
        jobs = [(k, members) for k, members in enumerate(clusters) if any(i in predictions for i in members)]
        for k, state, pseudo in ctx.executor.map(lambda job: self.train_server_model(ctx, *job, predictions, epochs), jobs):
            models[k] = state
            for i in clusters[k]:  # h_k(U), sent to every member next round
                ctx.server["targets"][i] = pseudo.to(DTYPES[self.params.label_dtype])
        ctx.log({"num_clusters": len(clusters)})
        return True

    def cluster(self, ctx, predictions: dict[int, torch.Tensor]) -> list[list[int]]:
        ids = sorted(predictions)
        distances = mean_l1_distances(torch.stack([predictions[i] for i in ids])).numpy()
        if self.params.b0 == "auto":
            b0, local_clusters = auto_clusters(distances, self.params.max_clusters)
        else:
            b0, local_clusters = float(self.params.b0), greedy_clusters(distances, float(self.params.b0))
        clusters = [[ids[j] for j in c] for c in local_clusters]
        ctx.server["b0"] = b0
        ctx.resolved_value("num_clusters", len(clusters))
        ctx.resolved_value("b0", b0)
        rows = "client,cluster\n" + "".join(f"{i},{k}\n" for k, c in enumerate(clusters) for i in c)
        ctx.tracker.log_text(rows, "cosmos/clusters.csv")
        ctx.tracker.log_text(f"b0 = {b0}\n", "cosmos/b0.txt")
        return clusters

    def train_server_model(self, ctx, k: int, members: list[int], predictions, epochs: int):
        """Eq. (1) for cluster k: returns (k, h_k's weights, h_k(U))."""
        p = self.params
        arch = p.server_arch
        model = ctx.models.working(arch, slot="server")
        state = ctx.server["cluster_models"].get(k)
        load_state(model, state if state is not None else ctx.models.initial_state(arch))
        targets = torch.stack([predictions[i] for i in members if i in predictions]).mean(dim=0)
        generator = ctx.generator(f"server_cluster_{k}")  # batch order and augmentations
        with precision_autocast(ctx.spec.training, ctx.device):  # the server's training, as the clients'
            eq1_distill(model, torch.optim.Adam(model.parameters(), lr=p.server_lr), ctx.data.public.x, targets, p,
                        epochs=epochs, order=generator, augment=generator)
        return k, clone_state(model), predict(model, ctx.data.public.x, p.temperature)

    # -- evaluation -----------------------------------------------------------------

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        """h_pi(i), the weights of the client's cluster model, once there is one."""
        cluster_models = ctx.server.get("cluster_models", {})
        for k, members in enumerate(ctx.server.get("clusters", [])):
            if client_id in members and k in cluster_models:
                return {"cluster_model": cluster_models[k]}
        return {}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        models = super().personalized_models(ctx, client, message)
        if "cluster_model" in message:  # h_pi(i): the paper's personalisation risk
            server = ctx.models.working(self.params.server_arch, slot="server")
            models["server_"] = load_state(server, message["cluster_model"])
        return models
