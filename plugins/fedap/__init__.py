"""FedAP: Lu, Wang, Chen, Qin, Xu, Dimitriadis and Qin, "Personalized Federated Learning with
Adaptive Batchnorm for Healthcare", IEEE Transactions on Big Data 2022 (arXiv:2112.00734).

A model with BatchNorm is pre-trained; each client then measures, on its own training data, the
mean and standard deviation of what enters every BatchNorm layer of that model; the distance
between two clients' statistics gives the weight of one client's model in the other's aggregate.
From then on client i receives the personalised aggregate sum_j w_ij theta_j of every client's
latest model theta_j, and its BatchNorm layers (affine parameters and running statistics) never
leave it. As run here, with P = ``pretrain_rounds``:

    rounds 1..P (pre-training): FedBN (plugins/fedbn): FedAvg of the non-BatchNorm layers, each
        client keeping its own BatchNorm layers                                        (step 1)
    round P + 1: every training client takes part, whatever experiment.participation says. Each
        receives the pre-trained model, and before training measures, for every BatchNorm layer l
        (in module order), the per-channel mean mu_i^l and standard deviation sigma_i^l of the
        layer's input over its training split, the model in eval mode (its own BatchNorm
        layers)                                                                (step 2, on_receive)
        d(i, j) = sum_l sqrt(||mu_i^l - mu_j^l||^2 + ||sigma_i^l - sigma_j^l||^2)    (step 3: the
                  2-Wasserstein distance of the diagonal Gaussians, summed over the layers)
        w_ij = (1 - lam) (1 / d(i, j)) / sum_{k != i} 1 / d(i, k) for j != i,  w_ii = lam
                  (lam = model_momentum; a client at distance 0 from i shares the (1 - lam) with
                  any other such client, the limit of 1 / d)                 (step 4, server_aggregate)
    every round t > P, each participant i:
        theta_bar_i = sum_j w_ij theta_j over the non-BatchNorm layers, theta_j the last model
                      client j uploaded (the pre-trained one before its first upload)  (on_broadcast)
        train theta_bar_i with its own BatchNorm layers (training.local_epochs); upload the
                      non-BatchNorm layers; the server keeps them as theta_i       (server_aggregate)
    evaluation: rounds <= P FedBN's (the shared layers with the client's BatchNorm layers); after,
        theta_bar_i of the current theta_j with the client's BatchNorm layers, no local steps (the
        model the server would send it next, as the authors' code scores it after aggregating).

What was read: the paper's abstract and introduction only (its method section and equations
could not be read from this machine, so the step labels above are this docstring's, not the
paper's). The steps follow the authors' code, read in full (not copied): ``alg/fedap.py``,
``alg/core/comm.py``, ``util/traineval.py`` and ``main.py`` of microsoft/PersonalizedFL at 441670e
(Jul 2023), and FL-bench's ``src/server/fedap.py`` and ``src/client/fedap.py``
(KarhouTam/FL-bench at 06e658b, Oct 2025; "modified from" the authors' code). PFLlib
(TsingZ0/PFLlib at d832e76) has no FedAP.

Defaults: ``model_momentum = 0.5`` (both references), ``pretrain_rounds = none``: half of
experiment.rounds, rounded down (FL-bench's ``warmup_round = 0.5``).

Deviations, and how the pre-training maps onto rounds:

- Pre-training. The authors' code trains one model centrally, before any federated round, for
  150 epochs on a 30% split of the pooled data, and then measures every client with that one
  model (its BatchNorm layers included). FL-bench
  runs it as its first ``warmup_round`` rounds, either chaining the clients one after another
  within a round on the first 30% of each client's data (FedAP, d-FedAP: the later rounds see
  the other 70%) or as FedBN rounds on all of it (its f-FedAP). Here it is f-FedAP's: P FedBN
  rounds on each client's whole training split, under experiment.participation; a chain of
  clients within a round cannot run under the process or Ray executors, and pooling data is not
  federated. As in FL-bench's f-FedAP, a client measures with its own BatchNorm layers (from
  the FedBN rounds), which shape the inputs of the layers after the first one. FL-bench trains
  one local epoch per pre-training round; here training.local_epochs.
- Measuring. FL-bench's clients measure outside any round (a forward pass); here the measuring
  pass is part of round P + 1, whose participants are therefore every training client (they also
  train in it, from the pre-trained model, which is what theta_bar_i is in that round: every
  theta_j is still the pre-trained one). The pass is a forward pass and is not counted as
  training work (budget.*); the statistics are counted as upload bytes. The variance is the
  population variance over the whole training split; the authors pool per-batch unbiased
  variances (FL-bench too). The inputs of BatchNorm1d layers (fully connected) count as the
  authors' code counts them; FL-bench reads only 4-D inputs, so it ignores them.
- Lost uploads (``dropout``) and skipped clients. A client measures once, on the pre-trained
  model, and keeps its statistics; while the server lacks them it asks again with every
  broadcast, and the client resends the ones it kept. theta_i only changes with a received
  upload. Until the server has i's statistics, row i weights the other training clients
  uniformly; a measured row weights only the measured clients (a distance to an unmeasured
  client is unknown); each row is (1 - lam) over the others and lam for itself either way; with
  a single training client it is 1 for itself. The matrix is recomputed when statistics arrive.
  Nothing mirrors the server on the client, so nothing is staged; the BatchNorm layers are the
  client's own and keep the round's training (docs/writing-a-plugin.md, lost uploads).
- d-FedAP (the last BatchNorm layer's statistics alone) is not offered. Two clients at distance
  0 share their weight exactly; the references give them 1e14 in place of 1 / 0 (the same limit).
- client_weighting is used in the pre-training rounds only (FedBN's n_k / n).
- Cold start: a newcomer receives the uniform mean of the training clients' theta_j (its
  distance to them is never measured), starts from the initial BatchNorm layers and fine-tunes
  ``experiment.coldstart_epochs`` (the core default). Neither reference has a novel-client
  procedure.
- Needs a model with BatchNorm: ``model.params.norm = "batch"`` on mlp, lenet5, cnn2, cnn4
  (``model.params.batch_norm = true`` on vgg16; resnet18 and mobilenet_v2 always have it);
  otherwise a spec error naming that key, before any data is loaded.
"""

from __future__ import annotations

import math

import torch
from attrs import define, field
from torch import nn

from pfl_core.api import (
    ModelBank,
    SpecError,
    at_least,
    between,
    hookimpl,
    model_key,
    probe_model,
    require_single_architecture,
    spec_archs,
)
from pfl_plugins.fedbn import FedBN


@define
class FedAPParams:
    model_momentum: float = field(default=0.5, validator=between(0, 1), metadata={
        "doc": "lam: the weight w_ii of a client's own model in its aggregate; the others share 1 - lam "
               "by inverse BatchNorm-statistics distance (the authors' and FL-bench's model_momentum, 0.5)"})
    pretrain_rounds: int | None = field(default=None, validator=at_least(0), metadata={
        "doc": "P: FedBN rounds before the clients measure their BatchNorm statistics in round P + 1; "
               "none: experiment.rounds // 2 (FL-bench's warmup_round = 0.5). Less than experiment.rounds"})


# -- the statistics and the weights ---------------------------------------------------------------


def batchnorm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every BatchNorm layer (FedBN's definition: any ``_BatchNorm``), in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batchnorm_input_statistics(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> dict:
    """{BatchNorm module name: {"mean": mu, "std": sigma}}, per channel, of what enters each
    BatchNorm layer of ``model`` over all of ``x``, in eval mode (population variance)."""
    layers = batchnorm_layers(model)
    sums: dict[str, list] = {name: [0, 0.0, 0.0] for name, _ in layers}  # count, sum, sum of squares

    def record(name):
        def hook(_module, inputs):
            z = inputs[0].detach().double()
            channels_last = z.transpose(0, 1).reshape(z.shape[1], -1)  # (C, N * spatial)
            acc = sums[name]
            acc[0] += channels_last.shape[1]
            acc[1] = acc[1] + channels_last.sum(dim=1)
            acc[2] = acc[2] + (channels_last ** 2).sum(dim=1)
        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                model(x[start:start + batch_size])
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    out = {}
    for name, (count, total, squares) in sums.items():
        mean = total / count
        var = (squares / count - mean ** 2).clamp_min(0)
        out[name] = {"mean": mean.float(), "std": var.sqrt().float()}
    return out


def statistics_distance(a: dict, b: dict) -> float:
    """d(a, b) = sum over layers of sqrt(||mu_a - mu_b||^2 + ||sigma_a - sigma_b||^2)."""
    total = 0.0
    for name in a:
        squared = ((a[name]["mean"].double() - b[name]["mean"].double()) ** 2).sum() + \
                  ((a[name]["std"].double() - b[name]["std"].double()) ** 2).sum()
        total += math.sqrt(float(squared))
    return total


def mixing_matrix(clients: list[int], statistics: dict, lam: float) -> torch.Tensor:
    """W (float64, rows and columns in ``clients`` order): w_ii = lam; the other (1 - lam) of row i
    by inverse distance over the other measured clients when i and some other client are measured
    (equal shares among clients at distance 0), else equally over all other clients."""
    n = len(clients)
    weights = torch.zeros(n, n, dtype=torch.float64)
    for row, i in enumerate(clients):
        others = [col for col, j in enumerate(clients) if j != i]
        if not others:
            weights[row, row] = 1.0
            continue
        measured = [col for col in others if clients[col] in statistics] if i in statistics else []
        if measured:
            distance = {col: statistics_distance(statistics[i], statistics[clients[col]]) for col in measured}
            nearest = [col for col in measured if distance[col] == 0]
            share = {col: 1.0 for col in nearest} if nearest else {col: 1.0 / distance[col] for col in measured}
        else:
            share = {col: 1.0 for col in others}
        total = sum(share.values())
        for col, s in share.items():
            weights[row, col] = (1 - lam) * s / total
        weights[row, row] = lam
    return weights


def no_batchnorm(spec, arch: str) -> SpecError:
    """The error for a model without BatchNorm, at the key that would add it."""
    fields = ModelBank(spec, input_shape=(), num_classes=0, device=torch.device("cpu")).plugin(arch).params
    option = next((name for name in ("norm", "batch_norm") if hasattr(fields, name)), None)
    if option is None:
        key = model_key(spec)
    else:
        key = f"model.params.{option}" if arch == spec.model.name else f"model.arch_params.{arch}.{option}"
    value = '"batch"' if option == "norm" else "true"
    fix = f"set {key} = {value}" if option else "use a model with BatchNorm (e.g. mlp with norm = \"batch\")"
    return SpecError(key, f"fedap weighs clients by their BatchNorm statistics, but '{arch}' has no BatchNorm "
                          f"layer; {fix}")


class FedAP(FedBN):
    """FedAP (Lu et al. 2022): FedBN pre-training, then each client measures its BatchNorm input
    statistics on the pre-trained model; the distances between them weight every client's
    personalised aggregate of all clients' models; BatchNorm layers stay local (see the module
    doc). Needs ``model.params.norm = "batch"`` (or another model with BatchNorm)."""

    name = "fedap"
    Params = FedAPParams

    def pretrain_rounds(self, spec) -> int:
        p = self.params.pretrain_rounds
        return spec.experiment.rounds // 2 if p is None else p

    def personalising(self, ctx) -> bool:
        return ctx.round > self.pretrain_rounds(ctx.spec)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)  # FedBN's BatchNorm check names model.name: not called
        for arch in spec_archs(spec):
            model = probe_model(spec, arch)
            if model is not None and not batchnorm_layers(model):
                raise no_batchnorm(spec, arch)
        if self.pretrain_rounds(spec) >= spec.experiment.rounds:
            raise SpecError(f"{self.spec_path}.params.pretrain_rounds",
                            f"must be less than experiment.rounds ({spec.experiment.rounds}): round "
                            f"pretrain_rounds + 1 measures the clients, and FedAP's aggregation follows it")

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        if not batchnorm_layers(ctx.models.working(arch)):  # a model check_spec could not build
            raise no_batchnorm(ctx.spec, arch)
        super().setup(ctx)
        ctx.server["models"] = {}  # theta_j: the last non-BatchNorm layers client j uploaded after pre-training
        ctx.server["statistics"] = {}  # client j's BatchNorm input statistics, once received
        ctx.resolved_value("pretrain_rounds", self.pretrain_rounds(ctx.spec))

    @hookimpl
    def select_clients(self, ctx, round):
        if round == self.pretrain_rounds(ctx.spec) + 1:  # every client measures on the pre-trained model
            return sorted(ctx.training_clients)
        return None  # the core's draw

    def personal_mix(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        """theta_bar_i = sum_j w_ij theta_j (a newcomer: the uniform mean of the theta_j)."""
        pretrained = self.shared_global(ctx, client_id)["weights"]
        if not ctx.server["models"]:  # every theta_j is still the pre-trained model
            return pretrained
        clients = list(ctx.training_clients)
        if client_id in clients:
            row = ctx.server["mixing"][clients.index(client_id)]
        else:
            row = torch.full((len(clients),), 1.0 / len(clients), dtype=torch.float64)
        models = [ctx.server["models"].get(j, pretrained) for j in clients]
        return {k: torch.tensordot(row.to(v.dtype), torch.stack([m[k] for m in models]), dims=1)
                if v.is_floating_point() else v for k, v in pretrained.items()}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        if not self.personalising(ctx):
            return self.shared_global(ctx, client_id)
        message = {"weights": self.personal_mix(ctx, client_id)}
        if client_id in ctx.training_clients and client_id not in ctx.server["statistics"]:
            message["measure"] = True
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        if not self.personalising(ctx):
            return super().server_aggregate(ctx, uploads, weights)
        # on_broadcast reads theta_j and W while the executor hands out the remaining clients:
        # both stay as they are until every upload is in.
        models, statistics = {}, {}
        for client_id, message in uploads:
            models[client_id] = {k: v.detach().clone() for k, v in message["weights"].items()}
            if "statistics" in message:
                statistics[client_id] = {name: {s: t.detach().clone() for s, t in layer.items()}
                                         for name, layer in message["statistics"].items()}
        ctx.server["models"] = {**ctx.server["models"], **models}
        if statistics or "mixing" not in ctx.server:
            ctx.server["statistics"] = {**ctx.server["statistics"], **statistics}
            ctx.server["mixing"] = mixing_matrix(list(ctx.training_clients), ctx.server["statistics"],
                                                 self.params.model_momentum)
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        if not self.personalising(ctx):
            return self.shared_global(ctx, client_id)
        return {"weights": self.personal_mix(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # the received layers with the client's own BatchNorm
        if message.get("measure"):  # measured once, on the pre-trained model; resent until received
            if "statistics" not in client.state:
                client.state["statistics"] = batchnorm_input_statistics(client.model, client.data.train_x)
            client.scratch["statistics"] = client.state["statistics"]
        return True

    @hookimpl
    def client_upload(self, ctx, client):
        upload = super().client_upload(ctx, client)
        if "statistics" in client.scratch:
            upload["statistics"] = client.scratch["statistics"]
        return upload


__all__ = ["FedAP", "FedAPParams", "batchnorm_input_statistics", "mixing_matrix", "statistics_distance"]
