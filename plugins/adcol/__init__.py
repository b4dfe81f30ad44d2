"""ADCOL: Li, He and Song, "Adversarial Collaborative Learning on Non-IID Features", ICML 2023.

What was read: the paper's abstract and introduction (its method section, equations and algorithm
box could not be read from this machine), so the step labels (A1)-(A4) below are ours, and the
losses follow the reference implementation of FL-bench (github.com/KarhouTam/FL-bench at commit
06e658bca5af6ce732e25bb7c0f8be321e14a85e, ``src/client/adcol.py`` and ``src/server/adcol.py``),
read in full (not copied). PFLlib has no ADCOL.

Instead of averaging models, ADCOL trains adversarially: every client i keeps its own model, an
encoder z = G_i(x) (everything before the classifier, the last ``nn.Linear``) and a predictor
P_i (the classifier); the server keeps a discriminator D that maps a representation z to N logits,
one per training client (N = the number of training clients, the client's index its position in
``ctx.training_clients``). Only D (down) and representations (up) travel:

    (A1) the server sends D_t (its parameters and its BatchNorm statistics)          (on_broadcast)
    (A2) client i trains G_i and P_i (D frozen, in eval mode; the gradient flows through D into
         G_i) for training.local_epochs epochs of the configured optimiser on
             CE(P_i(G_i(x)), y) + mu * KL(u || softmax(D_t(G_i(x)))),    u = (1/N, ..., 1/N),
         the KL averaged over the batch, i.e. mu * (-log N - mean_k log softmax(D_t(z))_k):
         each client pushes its representations towards "could be anyone's"   (local_objective)
    (A3) client i uploads Z_i = G_i(x) for every training sample, computed after (A2) with the
         trained model in eval mode                                                (client_upload)
    (A4) the server trains D on the round's arrived representations, each labelled with its
         client's index: dis_epochs epochs of plain SGD (lr dis_lr, no momentum) on the
         cross-entropy, over mini-batches of training.batch_size drawn in a seeded shuffled
         order; the result is D_{t+1}                                            (server_aggregate)

D is FL-bench's: Linear(K, H) - BatchNorm - ReLU - Linear(H, H) - BatchNorm - ReLU - Linear(H, N),
no biases, H = ``hidden`` (512), its initial weights one seeded draw. In round 1 clients train
against the untrained D_0 (as in FL-bench).

What is evaluated: each client on its own model G_i, P_i (the one it trained last; the seeded
initial weights before its first round). D is not part of it. With mu = 0 ADCOL is Local (every
client trains alone) bit for bit.

Decisions and deviations:

- From FL-bench: it keeps FedAvg's model averaging under the adversarial term (its ADCOL server
  subclasses FedAvg and aggregates the uploaded models) and evaluates the averaged model; the
  paper's point is to replace the averaging ("instead of adopting the widely used model-averaging
  scheme"), so here nothing but representations and D travel and each client keeps its model.
- From FL-bench: it uploads the representations of the last local epoch's mini-batches as they
  were computed during training (train mode, each before that batch's step); here they are
  recomputed once after training in eval mode, so D learns the representations the client holds
  now (a deterministic upload of exactly one row per training sample).
- FL-bench's encoder output goes through a ReLU before its classifier while its discriminator
  reads it before the ReLU; here both read the classifier's input as the model computes it.
- A mini-batch of one sample (of a client in A2, of the server in A4) is skipped by FL-bench
  because of D's BatchNorm; here A2 keeps it (D is in eval mode there, which is well defined),
  A4 skips it (BatchNorm cannot train on one sample).
- Partial participation and lost uploads (``dropout``): D trains on the round's arrived
  representations only (FL-bench's, which trains on the round's participants). A client whose
  upload is lost keeps its trained model (the client's own; nothing staged: the server adds
  nothing up, docs/writing-a-plugin.md "Client state and lost uploads"); D stays when nothing
  arrives.
- Cold start (``experiment.coldstart_clients``): the newcomer has no model of its own, so it
  trains the seeded initial model for ``experiment.coldstart_epochs`` epochs with (A2)'s loss
  against the final D (it is not one of D's N classes; the uniform target does not need it).
- Only one architecture (D reads one representation size).
- Bytes: D's state down (3 weight matrices and the BatchNorm parameters and statistics); n_i x K
  floats up.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    Plugin,
    at_least,
    capture_embedding,
    clone_state,
    derive_seed,
    embeddings,
    finite,
    greater_than,
    hookimpl,
    load_personal,
    require_single_architecture,
)
from pfl_plugins.feddbe import FedDBE


@define
class ADCOLParams:
    mu: float = field(default=0.5, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the adversarial term KL(uniform || softmax(D(z))) in the clients' loss (A2); 0 is "
               "Local. Default: FL-bench's 0.5"})
    dis_lr: float = field(default=0.01, validator=[finite, greater_than(0)], metadata={
        "doc": "learning rate of the server's plain SGD on the discriminator (A4). Default: FL-bench's 0.01"})
    dis_epochs: int = field(default=3, validator=at_least(1), metadata={
        "doc": "epochs of discriminator training over the round's arrived representations (A4). Default: "
               "FL-bench's 3 (it recommends more for a large mu)"})
    hidden: int = field(default=512, validator=at_least(1), metadata={
        "doc": "width H of the discriminator's two hidden layers. Default: FL-bench's 512"})


class Discriminator(nn.Module):
    """D: a representation z (K) -> one logit per training client (N), FL-bench's shape."""

    def __init__(self, dim: int, hidden: int, num_clients: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, num_clients, bias=False))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.layers(z)


def kl_from_uniform(logits: torch.Tensor) -> torch.Tensor:
    """(A2)'s term: the batch mean of KL(u || softmax(logits)) with u uniform over the N columns,
    = -log N - mean_k log softmax(logits)_k."""
    log_p = F.log_softmax(logits, dim=1)
    return -math.log(logits.shape[1]) - log_p.mean(dim=1).mean()


def train_discriminator(discriminator: Discriminator, z: torch.Tensor, owner: torch.Tensor, *, epochs: int,
                        lr: float, batch_size: int, generator: torch.Generator) -> float:
    """(A4): ``epochs`` epochs of plain SGD on CE(D(z), owner) over shuffled mini-batches (one of a
    single sample is skipped: BatchNorm cannot train on it); returns the mean batch loss."""
    discriminator.train()
    optimizer = torch.optim.SGD(discriminator.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(owner), generator=generator).to(z.device)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            if len(batch) < 2:
                continue
            loss = F.cross_entropy(discriminator(z[batch]), owner[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    discriminator.eval()
    return sum(losses) / len(losses) if losses else float("nan")


@torch.no_grad()
def discriminator_accuracy(discriminator: Discriminator, z: torch.Tensor, owner: torch.Tensor) -> float:
    """The share of representations D attributes to their own client (eval mode)."""
    discriminator.eval()
    return float((discriminator(z).argmax(1) == owner).float().mean())


class ADCOL(Plugin):
    """ADCOL (Li et al. 2023): no model averaging; the server trains a discriminator to tell which
    client a representation came from, and each client trains its own model with cross-entropy
    plus mu * KL(uniform || D(z)), so that its representations look like everyone's."""

    name = "adcol"
    Params = ADCOLParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)
        FedDBE.check_linear_classifier(spec, self.name)

    def build(self, ctx, state: dict[str, torch.Tensor] | None = None) -> Discriminator:
        """D on ``ctx.device``: the seeded initial draw (server set-up), or holding ``state`` (whose
        first layer is K x H and last N x H). The draw leaves the run's RNG alone."""
        if state is None:
            dim, num_clients = FedDBE.representation_dim(ctx, self.name), len(ctx.training_clients)
        else:
            dim, num_clients = state["layers.0.weight"].shape[1], state["layers.6.weight"].shape[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.spec.experiment.seed, "adcol:discriminator"))
            discriminator = Discriminator(dim, self.params.hidden, num_clients).to(ctx.device)
        if state is not None:
            discriminator.load_state_dict(state)
        return discriminator

    def received(self, ctx, state: dict[str, torch.Tensor]) -> Discriminator:
        """D_t from its state, frozen, in eval mode (A2)."""
        discriminator = self.build(ctx, state)
        discriminator.eval()
        discriminator.requires_grad_(False)
        return discriminator

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        ctx.server["discriminator"] = clone_state(self.build(ctx))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"discriminator": ctx.server["discriminator"]}  # (A1)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(A4): D_t -> D_{t+1} on the arrived representations, labelled by their client's index."""
        index = {client_id: k for k, client_id in enumerate(ctx.training_clients)}
        rows, owners = [], []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            z = message["representations"].detach().clone().to(ctx.device)
            rows.append(z)
            owners.append(torch.full((len(z),), index[client_id], dtype=torch.long, device=ctx.device))
        if not rows:  # nobody's upload arrived: D stays
            return True
        z, owner = torch.cat(rows), torch.cat(owners)
        discriminator = self.build(ctx, ctx.server["discriminator"])
        before = discriminator_accuracy(discriminator, z, owner)
        loss = train_discriminator(discriminator, z, owner, epochs=self.params.dis_epochs, lr=self.params.dis_lr,
                                   batch_size=ctx.spec.training.batch_size,
                                   generator=ctx.generator("adcol:discriminator"))
        ctx.log(adcol_discriminator_acc_before=before, adcol_discriminator_loss=loss,
                adcol_discriminator_acc=discriminator_accuracy(discriminator, z, owner))
        ctx.server["discriminator"] = clone_state(discriminator)
        return True

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        client.scratch["discriminator"] = self.received(ctx, message["discriminator"])
        return True

    def train(self, ctx, client, epochs=None):
        """(A2): the configured training of the client's own model, its classifier input captured
        for the adversarial term."""
        with capture_embedding(client.model, client.scratch):
            metrics = client.train(epochs=epochs)
        client.scratch.pop("emb", None)
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(ctx, client)
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(A2): mu * KL(u || softmax(D_t(z))), z the classifier's input of this batch."""
        discriminator = client.scratch.get("discriminator")
        if self.params.mu == 0 or discriminator is None or model is not client.model or "emb" not in client.scratch:
            return None
        return self.params.mu * kl_from_uniform(discriminator(client.scratch["emb"].flatten(1)))

    @hookimpl
    def client_upload(self, ctx, client):
        """(A3): one representation per training sample, from the trained model in eval mode."""
        return {"representations": embeddings(client.model, client.data.train_x)}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # the seeded initial model and the final D
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}


__all__ = ["ADCOL", "ADCOLParams", "Discriminator", "discriminator_accuracy", "kl_from_uniform",
           "train_discriminator"]
