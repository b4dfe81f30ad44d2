"""FedSR: Nguyen, Torr and Lim, "FedSR: A Simple and Effective Domain Generalization Method for
Federated Learning", NeurIPS 2022.

Only the paper's abstract could be read here, not its equations: the steps below follow the
abstract (an L2-norm regulariser on the representation and a conditional mutual information
regulariser I(x; z | y), bounded through a learned class-conditional prior r(z|y)) and the
authors' code (github.com/atuannguyen/FedSR at commit 39569314287fede6d608fa850999a6ed725911e9,
src/methods/FedSR.py and base.py), checked against FL-bench (github.com/KarhouTam/FL-bench at
commit 06e658bca5af6ce732e25bb7c0f8be321e14a85e, src/client/fedsr.py, src/server/fedsr.py);
PFLlib has no FedSR. The step labels (S1)-(S5) are ours.

The registry's models end in a classifier (the last parameterised layer, an ``nn.Linear``) that
reads a K-vector h(x), the feature extractor's output. FedSR makes the representation
probabilistic with a layer the plugin adds in front of the classifier, the encoder, a
``Linear(K, 2K)`` whose output is split into a mean and a scale (the authors' backbone ends in a
``Linear(., 2 z_dim)`` in the same way; FL-bench adds the same ``map_layer``):

    (S1) [mu(x), s(x)] = encoder(h(x)),  sigma(x) = softplus(s(x))
         z ~ p(z|x) = N(mu(x), diag sigma(x)^2), drawn as z = mu + sigma * eps, eps ~ N(0, I)
         (reparameterised: the gradient flows into mu and sigma); logits = classifier(z)
    (S2) L2R = mean over the batch of ||z||_2            (the sampled z, its norm, not squared)
    (S3) CMI = mean over the batch of sum_k KL( N(c mu_k, |c| sigma_k) || N(r_mu[y]_k, r_sigma[y]_k) )
         with the prior r(z|y) = N(r_mu[y], diag softplus(rho[y])^2): r_mu (C x K, zeros at the start),
         rho (C x K, ones), and a learned scalar c (one at the start), trained with the model;
         KL(N(a, s) || N(b, t)) = log(t / s) + (s^2 + (a - b)^2) / (2 t^2) - 1/2
    (S4) client i, each round: receives w (model and encoder), training.local_epochs epochs of the
         configured optimiser on CE(logits, y) + alpha_l2r * L2R + alpha_cmi * CMI over the model,
         the encoder and the prior; uploads the model and the encoder (and the prior when
         ``prior = "shared"``)                                        (local_train, local_objective)
    (S5) server: w = sum_i n_i / n w_i over the uploads that arrived, for the model, the encoder
         (and the shared prior): FedAvg                                           (server_aggregate)

What is evaluated: every client on the global model and encoder with the mean representation,
classifier(mu(x)): no sampling, so a client's score does not depend on a draw.

Deviations:

- From the authors' code: at test time it averages the softmax of 20 sampled z per input; FL-bench
  samples one z. Here the mean representation is scored (above).
- The prior: the authors average only the backbone and the classifier, so r_mu, rho and c stay on
  each client, never sent (``prior = "local"``, the default: kept in the client's state, also when
  its upload is lost, since the server never adds it up). FL-bench's model holds them as
  parameters and averages them with the rest (``prior = "shared"``: sent, averaged n_i-weighted).
- (S3) scales sigma by |c| where the authors write c sigma: the same for c > 0 (c starts at 1), and
  the exact KL of c z when a step takes c below 0 (the authors' log(c sigma) is then NaN).
- FL-bench passes the features through a ReLU before its map layer (ours reads the classifier's
  input as the model computes it: after the model's own activation) and another ReLU on the
  mean and the scale, so its mu is never negative; the authors' code and this plugin have no
  ReLU on mu.
- The authors train E = 5 random mini-batches a round with SGD (momentum 0.9, weight decay
  5e-4) whose state persists across rounds; here the training is the spec's (``training.*``, one
  optimiser over the model, the encoder and the prior, reset every round as for every method).
- Defaults alpha_l2r = 0.01 and alpha_cmi = 5e-4 are the authors' and FL-bench's.
- The encoder's initial weights are one seeded draw (nn.Linear's initialisation), the same for
  every client. A model with a single layer has the input itself as h. Bytes: the encoder,
  2K^2 + 2K floats, both ways beside the model (with ``prior = "shared"``, also 2CK + 1).
- Cold start: the newcomer receives the model and the encoder (the initial prior with
  ``prior = "local"``), trains ``experiment.coldstart_epochs`` epochs on (S4)'s loss and is
  scored with its mean representation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn
from torch.distributions import Normal, kl_divergence

from pfl_core.api import (
    WeightAveraging,
    at_least,
    classifier,
    finite,
    hookimpl,
    load_state,
    one_of,
    rewrite_classifier_input,
)
from pfl_plugins.feddbe import FedDBE


@define
class FedSRParams:
    alpha_l2r: float = field(default=0.01, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the L2 regulariser mean ||z||_2 on the sampled representation (S2); 0 switches it "
               "off. Default: the authors' (L2R_coeff)"})
    alpha_cmi: float = field(default=5e-4, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the conditional mutual information regulariser, KL(p(z|x) || r(z|y)) (S3); 0 "
               "switches it off. Default: the authors' (CMI_coeff)"})
    prior: str = field(default="local", validator=one_of("local", "shared"), metadata={
        "doc": 'the prior r(z|y) (S3): "local" stays on each client, never sent (the authors\' code); '
               '"shared" is sent and averaged with the model (FL-bench)'})


class Encoder(nn.Module):
    """(S1): h -> (mu, sigma), a Linear(K, 2K) split in two halves, sigma through softplus."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, scale = self.linear(h).split(self.dim, dim=1)
        return mu, F.softplus(scale)


class Prior(nn.Module):
    """r(z|y) = N(mu[y], softplus(rho[y])) and the scale c of (S3), at the authors' start values."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(num_classes, dim))
        self.rho = nn.Parameter(torch.ones(num_classes, dim))
        self.c = nn.Parameter(torch.ones([]))


def l2_regulariser(z: torch.Tensor) -> torch.Tensor:
    """(S2): the batch's mean of ||z||_2."""
    return z.norm(dim=1).mean()


def cmi_regulariser(mu: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor, prior: Prior) -> torch.Tensor:
    """(S3): the batch's mean of sum_k KL(N(c mu, |c| sigma) || r(z|y))."""
    c = prior.c
    posterior = Normal(c * mu, c.abs() * sigma)
    return kl_divergence(posterior, Normal(prior.mu[y], F.softplus(prior.rho)[y])).sum(1).mean()


class Reparameterised(rewrite_classifier_input):
    """While inside: the classifier reads z instead of h (S1): a draw mu + sigma * eps while the
    model trains and ``noise`` (a torch.Generator) is given, else the mean mu. ``store`` holds
    "z", "mu" and "sigma" of the last forward."""

    def __init__(self, model: nn.Module, encoder: Encoder, noise: torch.Generator | None = None,
                 store: dict | None = None):
        super().__init__(model, store)
        self.encoder, self.noise = encoder, noise

    def rewrite(self, h):
        mu, sigma = self.encoder(h.flatten(1))
        if self.noise is not None and self.layer.training:
            eps = torch.randn(mu.shape, generator=self.noise).to(device=mu.device, dtype=mu.dtype)
            z = mu + sigma * eps
        else:
            z = mu
        self.store.update(z=z, mu=mu, sigma=sigma)
        return z

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for key in ("z", "mu", "sigma"):
            self.store.pop(key, None)


class MeanRepresentation(nn.Module):
    """A client's evaluated model: classifier(mu(x)) with the model and its encoder."""

    def __init__(self, model: nn.Module, encoder: Encoder):
        super().__init__()
        self.model, self.encoder = model, encoder

    def forward(self, x):
        with Reparameterised(self.model, self.encoder):
            return self.model(x)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class FedSR(WeightAveraging):
    """FedSR (Nguyen et al. 2022): FedAvg on a probabilistic representation z ~ N(mu(x), sigma(x))
    (an encoder the plugin adds before the classifier) trained with an L2 regulariser on z and a
    KL term to a learned class-conditional prior r(z|y); evaluated on the mean representation."""

    name = "fedsr"
    Params = FedSRParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture: the model is averaged
        FedDBE.check_linear_classifier(spec, self.name)

    def build_encoder(self, ctx, dim: int) -> Encoder:
        return Encoder(dim).to(ctx.device)

    def build_prior(self, ctx, dim: int) -> Prior:
        return Prior(ctx.num_classes, dim).to(ctx.device)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # w^0
        dim = FedDBE.representation_dim(ctx, self.name)
        with torch.random.fork_rng(devices=[]):  # the encoder's draw leaves the run's RNG alone
            torch.manual_seed(ctx.seed_for("fedsr_init"))
            ctx.server["encoder"] = state_of(self.build_encoder(ctx, dim))
        if self.params.prior == "shared":
            ctx.server["prior"] = state_of(self.build_prior(ctx, dim))

    # -- server -------------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {"weights": ctx.server["global"], "encoder": ctx.server["encoder"]}
        if self.params.prior == "shared":
            message["prior"] = ctx.server["prior"]
        return message

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": ctx.server["global"], "encoder": ctx.server["encoder"]}  # the prior is not scored

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(S5): FedAvg of the model; the same n_i / n means of the encoder (and a shared prior)."""
        sums: dict[str, dict[str, torch.Tensor]] = {}

        def with_modules():
            for i, message in uploads:
                for part in ("encoder", "prior"):
                    for k, v in message.get(part, {}).items():
                        own = sums.setdefault(part, {})
                        own[k] = own[k] + weights[i] * v.detach() if k in own else weights[i] * v.detach()
                yield i, message

        super().server_aggregate(ctx, with_modules(), weights)
        ctx.server.update(sums)  # nobody's upload arrived: nothing summed, the server keeps its own
        return True

    # -- client -------------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = load_state(client.model, message["weights"])
        dim = classifier(model).in_features
        encoder = self.build_encoder(ctx, dim)
        encoder.load_state_dict(message["encoder"])
        prior = self.build_prior(ctx, dim)
        own_prior = message.get("prior") if self.params.prior == "shared" else client.state.get("prior")
        if own_prior is not None:  # else the initial prior: a first visit with a local prior
            prior.load_state_dict(own_prior)
        client.scratch.update(encoder=encoder, prior=prior)
        return True

    def train(self, ctx, client, epochs=None):
        """(S4): the model, the encoder and the prior trained together on a sampled z."""
        model, encoder, prior = client.model, client.scratch["encoder"], client.scratch["prior"]
        optimizer = client.optimizer(params=[*model.parameters(), *encoder.parameters(), *prior.parameters()])
        with Reparameterised(model, encoder, noise=client.generator("fedsr"), store=client.scratch):
            metrics = client.train(epochs=epochs, optimizer=optimizer)
        if self.params.prior == "local":
            client.state["prior"] = state_of(prior)  # the client's own: kept whether or not its upload arrives
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        return self.train(ctx, client)

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """alpha_l2r (S2) + alpha_cmi (S3) of this batch's z; the core adds the cross-entropy."""
        if "z" not in client.scratch or model is not client.model:
            return None
        terms = []
        if self.params.alpha_l2r:
            terms.append(self.params.alpha_l2r * l2_regulariser(client.scratch["z"]))
        if self.params.alpha_cmi:
            terms.append(self.params.alpha_cmi * cmi_regulariser(client.scratch["mu"], client.scratch["sigma"], y,
                                                                 client.scratch["prior"]))
        return sum(terms) if terms else None

    @hookimpl
    def client_upload(self, ctx, client):
        message = {"weights": client.model.state_dict(), "encoder": client.scratch["encoder"].state_dict()}
        if self.params.prior == "shared":
            message["prior"] = client.scratch["prior"].state_dict()
        return message

    # -- evaluation and cold start ------------------------------------------------------------

    @hookimpl
    def personalized_models(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        return {"": MeanRepresentation(client.model, client.scratch["encoder"])}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # the model, the encoder, the prior
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": MeanRepresentation(client.model, client.scratch["encoder"])}


__all__ = ["Encoder", "FedSR", "FedSRParams", "MeanRepresentation", "Prior", "Reparameterised",
           "cmi_regulariser", "l2_regulariser"]
