"""COMET: clustered knowledge co-distillation (Cho et al., 2023), the model-agnostic baseline
of COSMOS (METHODS.md): every round the server runs k-means with a fixed K on the clients'
soft predictions on U, and each client distils from its cluster's mean prediction. The
server trains no model ("passive server").

Round t: client distils from last round's cluster mean (none in round 1) -> trains on D_i
(round 1: pretrain_epochs) -> sends f_i(U) -> server: k-means (K = ``num_clusters``, seeded
k-means++ then Lloyd iterations) on the flattened predictions -> targets = cluster means
(the plain mean of the members' predictions, as COSMOS's f_bar_k).

Pre-training, fine-tuning, distillation, bytes and the budget are those of
``pfl_core.methods.codistill`` (E0 = ``pretrain_epochs`` in the client's first round). k-means runs on
the CPU (numpy, seeded with the round's ``ctx.rng("kmeans")``); the predictions are copied
there with ``.cpu()``, the cluster means stay on the run's device.
"""

from __future__ import annotations

import numpy as np
import torch
from attrs import define, field

from pfl_core.api import DTYPES, CodistillParams, PublicPredictionMethod, at_least, hookimpl


@define
class CometParams(CodistillParams):
    num_clusters: int = field(default=2, validator=at_least(1), metadata={
        "doc": "K of the server's k-means on the clients' predictions (at most the number of uploads)"})
    kmeans_iterations: int = field(default=50, validator=at_least(1), metadata={
        "doc": "Lloyd iterations after the seeded k-means++ initialisation"})


def kmeans(points: np.ndarray, k: int, rng: np.random.Generator, iterations: int = 50) -> np.ndarray:
    """Cluster labels of ``points`` (n x d): k-means++ seeding, then Lloyd's iterations."""
    n = len(points)
    k = min(k, n)
    centres = [points[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min([((points - c) ** 2).sum(axis=1) for c in centres], axis=0)
        probs = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
        centres.append(points[rng.choice(n, p=probs)])
    centres = np.stack(centres)
    labels = np.zeros(n, dtype=int)
    for _ in range(iterations):
        distances = ((points[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
        new = distances.argmin(axis=1)
        if _ > 0 and np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            if np.any(labels == j):
                centres[j] = points[labels == j].mean(axis=0)
    return labels


class Comet(PublicPredictionMethod):
    name = "comet"
    Params = CometParams

    @hookimpl
    def setup(self, ctx):
        ctx.server["targets"] = {}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        predictions = self.collect_predictions(uploads)
        ids = sorted(predictions)
        flat = torch.stack([predictions[i].flatten() for i in ids]).double().cpu().numpy()
        labels = kmeans(flat, self.params.num_clusters, ctx.rng("kmeans"), self.params.kmeans_iterations)
        for cluster in np.unique(labels):
            members = [ids[j] for j in np.flatnonzero(labels == cluster)]
            mean = torch.stack([predictions[i] for i in members]).mean(dim=0).to(DTYPES[self.params.label_dtype])
            for i in members:
                ctx.server["targets"][i] = mean
        ctx.log({"num_clusters": len(np.unique(labels))})
        return True
