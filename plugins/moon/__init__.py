"""MOON: Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021, Algorithm 1.

FedAvg whose clients add a model-contrastive term to their loss: the representation z of a
sample under the model being trained is pulled towards its representation z_glob under the
global model received this round and pushed away from z_prev, its representation under the
client's own previous local model. Algorithm 1, as run here:

    server: w^0 = the seeded initial weights
    each round t, each participant i, given w^t:                         (on_broadcast, on_receive)
        w_i <- w^t
        for each mini-batch (x, y) of training.local_epochs epochs:        (local_train)
            z = R_{w_i}(x),  z_glob = R_{w^t}(x),  z_prev = R_{w_i^{t-1}}(x)
            l_con = -log( exp(sim(z, z_glob)/tau) /
                          (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )   (Eq. 3)
            l = CE(F_{w_i}(x), y) + mu * l_con                                     (Eq. 4)
            w_i <- w_i - eta grad l
        w_i^t <- w_i (kept by the client: next time it takes part, z_prev comes from it)
        upload w_i
    w^{t+1} <- sum_i n_i / n w_i                                              (server_aggregate: FedAvg's)
    evaluation: every client on the global model w^t, as FedAvg             (personalized_models)

sim is the cosine similarity; l_con is averaged over the mini-batch, as its cross-entropy is.

Decisions and deviations:

- **The representation z is the input of the model's classifier** (its last parameterised
  layer), flattened: the output of the body the partial-model methods share (FedRep, FedPer,
  FedProto's embedding). The paper's networks put a projection head (a two-layer MLP, output
  dimension 256) between the base encoder and the output layer and contrast its output; pfl's
  zoo models have none, and adding layers would change the model every method of a comparison
  trains. Contrasting the body's output is what PFLlib does (``model.base(x)``). A model with
  a single parameterised layer (``mlp`` with ``hidden = []``) has no representation apart from
  its input (every model maps x to the same z, so l_con is the constant log 2): refused.
- **z_glob and z_prev are constants**, computed in eval mode (the authors' code puts the global
  and previous models in eval mode and trains only the local model).
- **w_i^{t-1} before a client's first round is the seeded initial model** (PFLlib's choice: the
  client's model as created). In round 1 it equals the global model, so z_prev = z_glob and
  l_con = log 2 with zero gradient: the authors' code has no negative in its first round
  either (its model pool is empty), which also leaves only the cross-entropy's gradient.
  One previous model per client (the authors' ``model_buffer_size = 1``, their default).
- **Defaults**: mu = 1 (the authors' code default, and the paper's choice for CIFAR-100 and
  Tiny-ImageNet; 5 for CIFAR-10), tau = 0.5 (the paper's temperature, all experiments).
  mu = 0 is FedAvg (tested bit for bit).
- Aggregation is FedAvg's n_i-weighted mean, as in Algorithm 1 (|D^i| / |D|).
- Budget (``local_work``): training.local_epochs private epochs per round (the two extra
  forward passes per batch are not counted as epochs).
- Cold start: the newcomer receives the final w, trains from it for
  ``experiment.coldstart_epochs`` epochs with the same objective (its w^{-1} the seeded
  initial model) and is scored on its trained model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    SpecError,
    at_least,
    capture_embedding,
    clone_state,
    embeddings,
    finite,
    greater_than,
    hookimpl,
    load_state,
    model_key,
    probe_num_layers,
    spec_archs,
)
from pfl_plugins.fedavg import FedAvg

GLOBAL, PREVIOUS = "moon_global", "moon_previous"  # the model bank slots of w^t and w_i^{t-1}


@define
class MOONParams:
    mu: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "mu, the weight of the model-contrastive loss (Eq. 4); 0 is FedAvg. Default: the authors' code "
               "(the paper uses 1 for CIFAR-100 and Tiny-ImageNet, 5 for CIFAR-10)"})
    tau: float = field(default=0.5, validator=[finite, greater_than(0)], metadata={
        "doc": "tau, the temperature of the contrastive loss (Eq. 3). Default: the paper's"})


def contrastive_loss(z, z_glob, z_prev, tau: float) -> torch.Tensor:
    """Eq. 3, averaged over the rows: -log(e^{s_g/tau} / (e^{s_g/tau} + e^{s_p/tau})) with s_g =
    cos(z, z_glob), s_p = cos(z, z_prev), computed as logsumexp(s_g/tau, s_p/tau) - s_g/tau."""
    positive = F.cosine_similarity(z, z_glob, dim=1) / tau
    negative = F.cosine_similarity(z, z_prev, dim=1) / tau
    return (torch.logsumexp(torch.stack([positive, negative], dim=1), dim=1) - positive).mean()


class MOON(FedAvg):
    """MOON (Li et al. 2021): FedAvg whose clients add mu * l_con (Eq. 3-4), pulling each sample's
    representation towards the global model's and away from the client's previous local model's;
    evaluated on the global model."""

    name = "moon"
    Params = MOONParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):
            if probe_num_layers(spec, arch) == 1:
                raise SpecError(model_key(spec), f"moon contrasts the representation the classifier reads, and {arch} "
                                                 f"has a single layer (its representation is the input itself); "
                                                 f"use a model with a hidden layer")

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        with torch.random.fork_rng(devices=[]):  # build the two frozen models now, drawing nothing
            for slot in (GLOBAL, PREVIOUS):
                ctx.models.working(ctx.models.arch_of(0), slot=slot).requires_grad_(False)

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # w_i <- w^t
        load_state(ctx.models.working(client.arch, slot=GLOBAL), message["weights"])
        previous = client.state.get("previous") or ctx.models.initial_state(client.arch)
        load_state(ctx.models.working(client.arch, slot=PREVIOUS), previous)
        client.scratch["moon"] = True  # switches l_con on (local_objective)
        return True

    def train(self, client, epochs=None) -> dict:
        """``epochs`` (default training.local_epochs) of SGD on Eq. 4, z captured from each forward."""
        with capture_embedding(client.model, client.scratch):
            return client.train(epochs=epochs)

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(client)
        client.state["previous"] = clone_state(client.model)  # w_i^t: the next z_prev
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """mu * l_con (Eq. 3-4) of this batch; the core adds the cross-entropy."""
        if not client.scratch.get("moon") or model is not client.model or "emb" not in client.scratch:
            return None
        z = client.scratch["emb"].flatten(1)
        z_glob = embeddings(ctx.models.working(client.arch, slot=GLOBAL), x)
        z_prev = embeddings(ctx.models.working(client.arch, slot=PREVIOUS), x)
        return self.params.mu * contrastive_loss(z, z_glob, z_prev, self.params.tau)

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # the final w; w^{-1}: the seeded initial model
        self.train(client, ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}


__all__ = ["MOON", "MOONParams", "contrastive_loss"]
