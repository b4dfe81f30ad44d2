"""CFL, Clustered Federated Learning: Sattler, Müller and Samek, "Clustered Federated Learning:
Model-Agnostic Distributed Multitask Optimization Under Privacy Constraints", IEEE TNNLS 32(8),
2021 (arXiv:1910.01991).

FedAvg within each cluster of clients. The federation starts as one cluster; once FedAvg in a
cluster has reached a stationary point of the cluster's joint objective while some of its
clients are still far from a stationary point of their own, the server splits the cluster in
two by the cosine similarity of the clients' weight updates, and each part goes on with FedAvg
from the parent's model, splitting again when the same happens (recursive bi-partitioning).
With Delta theta_i = theta_i - theta_c the update of client i of cluster c in this round and
w_i its weight within c (its share of the cluster's training samples, or 1/|c|):

    stationary:  ||sum_{i in c} w_i Delta theta_i|| < eps1     (the cluster's mean update is small)
    divergent:   max_{i in c} ||Delta theta_i||     > eps2     (some client's own update is not)
    similarity:  alpha_{i,j} = <Delta theta_i, Delta theta_j> / (||Delta theta_i|| ||Delta theta_j||)
    Alg. 1 (optimal bipartition): c_1, c_2 = argmin_{c_1 u c_2 = c} max_{i in c_1, j in c_2} alpha_{i,j},
           the bipartition whose most similar cross pair is least similar; alpha_max^cross is
           that maximum

    server: C = {all training clients}, theta_c = the seeded initial weights        (setup)
    each round t, each participant i in cluster c: theta_i <- theta_c                 (on_broadcast)
        training.local_epochs epochs of SGD; upload theta_i                         (local_train, client_upload)
    for each cluster c (in order), on the round's updates Delta theta_i = theta_i - theta_c:
        if t > warmup_rounds, |c| >= min_split_size, every member of c delivered, stationary
        and divergent: split c into (c_1, c_2) (bipartition), each starting from theta_c
    for each cluster c' of the new partition:                                      (server_aggregate)
        theta_c' = sum_{i in c'} w_i theta_i (= theta_c + sum w_i Delta theta_i, FedAvg's step)
    evaluation: client i is scored with the model of the cluster it is in now.

We could not read the paper's text here (no copy was reachable): the steps above follow its
abstract, the summary of its algorithm in the issue's brief (FedAvg within clusters; split when
the mean update norm is below eps1 while the largest is above eps2; Alg. 1, the optimal
bipartition by cosine similarity; recursion), and the authors' code
(github.com/felisat/clustered-federated-learning at 23a1c38: ``fl_devices.py`` and the notebook
``clustered_federated_learning.ipynb``), with FL-bench's ``src/server/cfl.py`` (06e658b) as a
second reading (read, not copied). Equation numbers are left out for that reason.

Defaults and decisions:

- ``eps1 = 0.4``, ``eps2 = 1.6``, ``warmup_rounds = 20`` (no split before round 21) and
  ``min_split_size = 3``: the authors' notebook (``EPS_1``, ``EPS_2``, ``c_round > 20``,
  ``len(idc) > 2``) and FL-bench's defaults. eps1 and eps2 are on the scale of a round's
  updates, which the learning rate, the local epochs and the model set: read the logged
  ``cfl_mean_update_norm`` and ``cfl_update_norm`` of a run to place them.
- ``bipartition = "complete"``: complete-linkage agglomerative clustering of the similarities
  into 2 clusters, as the authors' code and FL-bench do (sklearn's
  ``AgglomerativeClustering(linkage="complete")`` on -alpha; here scipy's linkage on 1 - alpha,
  the same merges: a monotone change of the distances). ``"optimal"`` is Alg. 1's optimal
  bipartition, computed exactly by single linkage into 2 clusters (the cut of the largest edge
  of a minimum spanning tree of 1 - alpha maximises the smallest cross-cluster dissimilarity).
  The two differ when the clusters are not well separated (tested on a hand case).
- ``weighting = "samples"``: a cluster's aggregate, and the mean update of the stationarity
  test, weigh each member by the run's ``client_weighting`` (FedAvg's share of the training
  samples) renormalised over the cluster's members that delivered; CFL is then FedAvg, bit for
  bit, until its first split (tested). The authors' code and FL-bench average uniformly:
  ``weighting = "uniform"``.
- Similarities and norms are computed over the model's parameters (not its buffers, as the
  authors' ``named_parameters()``), in float64; the aggregate averages every floating-point
  entry of the state (BatchNorm statistics too, as FedAvg here), integer entries are the first
  member's. The client uploads theta_i, as FedAvg: the server holds theta_c and forms
  Delta theta_i itself (the same information and bytes as uploading Delta theta_i; add-ons
  that change an upload's ``weights`` work unchanged).
- Splits are decided on this round's updates, before the round's aggregation, and each part is
  then aggregated from its own members' updates (the authors' order). A split replaces its
  cluster in the list by the part holding the lowest client id, then the other.
- Client ids, not positions: the authors' code and FL-bench split a cluster by the positions of
  its members in the sub-matrix of similarities (``np.argwhere(labels == k)``) and keep those
  positions as the new clusters' client ids, which is right only for a cluster whose members
  are 0..m-1 (the first split); every later split would regroup the wrong clients. Here the
  positions are mapped back to the members' ids (tested on a second-level split).
- Partial participation and lost uploads: the stationarity test and the norms use the members
  whose upload arrived; a cluster is split only in a round in which every member delivered (the
  similarity matrix needs all of them; the paper's experiments and the authors' code have every
  client in every round; FL-bench fills a missing client's similarities with 0). A cluster none
  of whose members delivered keeps its model. With ``experiment.participation < 1`` a large
  cluster rarely has all its members in one round, so it rarely splits: CFL is meant for
  ``participation = 1``. CFL keeps no client state, so a lost upload stages nothing (the
  lost-upload rule holds trivially: the server only ever adds up the updates it received).
- The authors' clients keep their SGD momentum across rounds and decay the learning rate by
  0.99 a round; here local training is the spec's ``training`` section, as for every method.
  The authors' notebook also caches every cluster model before a split and finally picks, per
  client, the cached model best on its validation data: a post-hoc comparison, not done here.
- Logged per round: ``num_clusters`` (after the round's splits) and ``cfl_splits`` (clusters
  split this round); per client (``client_series``): ``cfl_update_norm`` ||Delta theta_i|| and
  ``cfl_mean_update_norm``, its cluster's ||sum w_i Delta theta_i||, the two numbers eps2 and
  eps1 are compared with. At the end, the artifacts ``cfl/clusters.csv`` (client, cluster) and
  ``cfl/splits.csv`` (round, the two parts, alpha_max^cross of each split).
- Bytes: FedAvg's (the cluster's model down, the client's model up).
- Cold start: the paper says CFL handles a client population that changes over time; we could
  not read how it places a newcomer. Here the newcomer receives every cluster's model (bytes:
  one model per cluster), takes the one with the lowest loss on its own training data (IFCA's
  rule) and trains ``experiment.coldstart_epochs`` epochs from it.
"""

from __future__ import annotations

import numpy as np
import torch
from attrs import define, field
from scipy.cluster.hierarchy import linkage, to_tree
from scipy.spatial.distance import squareform

from pfl_core.api import (
    at_least,
    clone_state,
    finite,
    greater_than,
    hookimpl,
    load_state,
    one_of,
    per_run,
    score,
    weighted_average,
)
from pfl_plugins.fedavg import FedAvg


@define
class CFLParams:
    eps1: float = field(default=0.4, validator=[finite, greater_than(0)], metadata={
        "doc": "a cluster is at a stationary point when the norm of its members' mean update is below this "
               "(the authors' code and FL-bench)"})
    eps2: float = field(default=1.6, validator=[finite, at_least(0)], metadata={
        "doc": "a cluster at a stationary point splits only if some member's own update norm is above this "
               "(the authors' code and FL-bench)"})
    warmup_rounds: int = field(default=20, validator=at_least(0), metadata={
        "doc": "no cluster splits in rounds 1..warmup_rounds (the authors' code: c_round > 20)"})
    min_split_size: int = field(default=3, validator=at_least(2), metadata={
        "doc": "the fewest members a cluster needs to be split (the authors' code: more than 2)"})
    bipartition: str = field(default="complete", validator=one_of("complete", "optimal"), metadata={
        "doc": 'complete-linkage clustering of the cosine similarities into 2 parts (the authors\' code, FL-bench); '
               '"optimal": Alg. 1, the split whose most similar cross pair is least similar (single linkage)'})
    weighting: str = field(default="samples", validator=one_of("samples", "uniform"), metadata={
        "doc": "each member's weight in its cluster's aggregate and mean update: the run's client weighting "
               '(training samples) renormalised over the cluster; "uniform": 1/m (the authors\' code, FL-bench)'})


# -- the paper's steps, as plain functions --------------------------------------------------------


def flat_update(state: dict, reference: dict, names) -> torch.Tensor:
    """Delta theta = state - reference over the parameters ``names``, flattened, in float64."""
    return torch.cat([(state[n].detach().double() - reference[n].detach().double()).reshape(-1) for n in names])


def cosine_similarities(updates: torch.Tensor) -> np.ndarray:
    """alpha_{i,j} for the rows of ``updates``; a zero update is similar to nothing (alpha = 0)."""
    norms = updates.norm(dim=1)
    products = torch.outer(norms, norms).clamp_min(1e-12)  # the authors' + 1e-12 in the denominator
    return (updates @ updates.T / products).cpu().numpy()


def bipartition(similarities: np.ndarray, method: str) -> tuple[list[int], list[int]]:
    """Two parts (positions into ``similarities``, each sorted, the one holding 0 first):
    ``"complete"``: complete-linkage agglomerative clustering of 1 - alpha stopped at 2 clusters;
    ``"optimal"``: Alg. 1's bipartition, max over splits of min_{i in c1, j in c2} (1 - alpha_{i,j}),
    which single linkage stopped at 2 clusters finds exactly."""
    distances = np.clip(1.0 - (similarities + similarities.T) / 2.0, 0.0, None)
    np.fill_diagonal(distances, 0.0)
    tree = to_tree(linkage(squareform(distances, checks=False), method="single" if method == "optimal" else method))
    # the last merge joins the two parts (cutting by merge count, not by height: ties at the top
    # cannot leave a single cluster)
    parts = sorted([sorted(tree.get_left().pre_order()), sorted(tree.get_right().pre_order())])
    return parts[0], parts[1]


def max_cross_similarity(similarities: np.ndarray, first, second) -> float:
    """alpha_max^cross: the largest similarity between a member of ``first`` and one of ``second``."""
    return float(similarities[np.ix_(first, second)].max())


def within_cluster(weights: dict, members, uniform: bool) -> dict:
    """Each member's weight in its cluster: ``weights`` renormalised over ``members`` (or 1/m)."""
    if uniform:
        return {i: 1.0 / len(members) for i in members}
    total = sum(weights[i] for i in members)
    return {i: weights[i] / total for i in members}


# -- the plugin ------------------------------------------------------------------------------------


class CFL(FedAvg):
    """CFL (Sattler et al. 2021): FedAvg within clusters; a cluster whose mean update is below eps1
    while some member's update is above eps2 splits in two by the cosine similarity of the
    updates, recursively. Each client is scored with its cluster's model. FedAvg's bytes."""

    name = "cfl"
    Params = CFLParams

    @hookimpl
    def setup(self, ctx):
        ctx.server["clusters"] = [sorted(ctx.training_clients)]
        ctx.server["cluster_models"] = [clone_state(ctx.models.initial_state(ctx.models.arch_of(0)))]
        ctx.server["splits"] = []  # one row per split: the round, the two parts, alpha_max^cross

    def cluster_of(self, ctx, client_id: int) -> int | None:
        for k, members in enumerate(ctx.server["clusters"]):
            if client_id in members:
                return k
        return None

    def parameter_names(self, ctx) -> list[str]:
        arch = ctx.models.arch_of(0)
        return per_run(ctx, self, f"parameters:{arch}", lambda: [n for n, _ in ctx.models.working(arch).named_parameters()])

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        k = self.cluster_of(ctx, client_id)
        if k is None:  # a cold-start client: it picks its cluster itself (on_receive)
            return {"cluster_models": list(ctx.server["cluster_models"])}
        return {"weights": ctx.server["cluster_models"][k]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        if "cluster_models" in message:
            losses = []
            with torch.no_grad():
                for state in message["cluster_models"]:
                    losses.append(score(load_state(client.model, state), client.data.train_x, client.data.train_y).loss_sum)
            load_state(client.model, message["cluster_models"][int(np.argmin(losses))])
        else:
            load_state(client.model, message["weights"])
        return True

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        p = self.params
        received = {i: clone_state(message["weights"]) for i, message in uploads}  # kept past the next client
        names = self.parameter_names(ctx)
        clusters, models = [], []
        splits = 0
        for members, reference in zip(ctx.server["clusters"], ctx.server["cluster_models"]):
            arrived = [i for i in members if i in received]
            if not arrived:
                clusters.append(members)
                models.append(reference)
                continue
            updates = torch.stack([flat_update(received[i], reference, names) for i in arrived])
            member_weights = within_cluster(weights, arrived, p.weighting == "uniform")
            weight_vector = torch.tensor([member_weights[i] for i in arrived], dtype=torch.float64, device=updates.device)
            mean_norm = float((weight_vector @ updates).norm())  # the stationarity test's ||sum_i w_i Delta theta_i||
            norms = updates.norm(dim=1)
            for i, norm in zip(arrived, norms.tolist()):
                ctx.log_client(i, cfl_update_norm=norm, cfl_mean_update_norm=mean_norm)
            parts = [members]
            if (ctx.round > p.warmup_rounds and len(members) >= p.min_split_size and len(arrived) == len(members)
                    and mean_norm < p.eps1 and float(norms.max()) > p.eps2):
                similarities = cosine_similarities(updates)
                first, second = bipartition(similarities, p.bipartition)
                parts = [[members[j] for j in first], [members[j] for j in second]]  # positions -> client ids
                ctx.server["splits"].append({"round": ctx.round, "first": parts[0], "second": parts[1],
                                             "max_cross_similarity": max_cross_similarity(similarities, first, second)})
                splits += 1
            for part in parts:
                delivered = [i for i in part if i in received]
                part_weights = within_cluster(weights, delivered, p.weighting == "uniform")
                clusters.append(part)
                models.append(weighted_average((part_weights[i], received[i]) for i in delivered))
        ctx.server["clusters"], ctx.server["cluster_models"] = clusters, models
        ctx.log(num_clusters=float(len(clusters)), cfl_splits=float(splits))
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": ctx.server["cluster_models"][self.cluster_of(ctx, client_id)]}

    @hookimpl
    def on_finish(self, ctx):
        rows = "".join(f"{i},{k}\n" for k, members in enumerate(ctx.server["clusters"]) for i in members)
        ctx.tracker.log_text("client,cluster\n" + rows, "cfl/clusters.csv")
        splits = "".join(f"{s['round']},{' '.join(map(str, s['first']))},{' '.join(map(str, s['second']))},"
                         f"{s['max_cross_similarity']}\n" for s in ctx.server["splits"])
        ctx.tracker.log_text("round,first,second,max_cross_similarity\n" + splits, "cfl/splits.csv")


__all__ = ["CFL", "CFLParams", "bipartition", "cosine_similarities", "flat_update", "max_cross_similarity",
           "within_cluster"]
