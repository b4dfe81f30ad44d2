"""PeFLL: Scott, Zakerinia and Lampert, "PeFLL: Personalized Federated Learning by Learning to
Learn", ICLR 2024 (arXiv:2306.05515).

An embedding network E(.; phi) maps a client's data to a descriptor v_i; a hypernetwork
h(.; eta) maps the descriptor to that client's model theta_i = h(v_i; eta). The client trains
theta_i for a few local steps; -Delta theta_i = theta_i - theta~_i stands in for the client loss's
gradient at theta_i, and the chain rule carries it back through h to eta and through v_i to phi.
Both networks are learned jointly; a client never seen in training gets its model from one
forward pass of each (no local training).

    server: phi^0, eta^0 (seeded), Adam over (phi, eta)                              (setup)
    each round t, S_t = the round's participants:
        server -> i: phi_t, eta_t                                                   (on_broadcast)
        client i: (1) v_i = standardise(mean over a sample B_i of E((x, y); phi_t))  (on_receive)
                  (2) theta_i = h(v_i; eta_t)
                  (3) theta~_i <- training.local_epochs epochs from theta_i          (local_train)
                  (4) Delta theta_i = theta~_i - theta_i;                            (client_upload)
                      g_phi,i = (d theta_i / d phi)^T (-Delta theta_i)  (through v_i)
                  upload: Delta theta_i, v_i, g_phi,i
        server: g_eta,i = (d h(v_i; eta) / d eta)^T (-Delta theta_i) at eta_t       (server_aggregate)
                (phi, eta) <- one Adam step with the mean of (g_phi,i, g_eta,i) over the
                round's received uploads
    evaluation: client i is scored with h(v_i; eta) of the current (phi, eta), v_i from its own
    training data as in (1), without local steps (personalized_models; FL-bench's evaluation).
    cold start: the same, no local training (the paper's ready-to-use models for new clients).

Standardise: v <- (v - mean(v)) / std(v) over the descriptor's entries (FL-bench's step). A
standardised 2-vector is always +-(1, -1) / sqrt 2: one bit, and no gradient reaches phi; so
embed_dim >= 3, and its default is max(3, int(1 + N / 4)) (FL-bench's int(1 + N / 4) gives 2
below N = 8 clients). The descriptor's sample B_i: ``descriptor_batches`` mini-batches of
``training.batch_size`` examples of the client's train split, drawn without replacement by the
client's seeded generator for the round (FL-bench: the first batches of its shuffled loader).

What was read: the paper's abstract and the caption of its Figure 2 (descriptor v_i and model
theta_i are small; "the hypernetwork ... remains on the server"). Its full text (the algorithm
listing, its regularisers and equations) could not be read from this machine: the steps above
follow FL-bench, read in full (not copied): ``src/server/pefll.py`` and ``src/client/pefll.py`` of
KarhouTam/FL-bench at 06e658bca5af6ce732e25bb7c0f8be321e14a85e. PFLlib (TsingZ0/PFLlib) has no
PeFLL. Any regularisation the paper's objective adds to phi, eta or v is not applied (FL-bench
applies none).

Defaults (FL-bench's): Adam at ``lr = 2e-4`` over both networks; ``embed_dim`` none = max(3, int(1 +
N / 4)) (N = partition.num_clients); hypernetwork ``hidden_dim = 100``
with ``hidden_layers = 3`` (pFedHN's HyperNetwork from pfl_core.api without its table of client
embeddings: Linear(embed_dim, hidden), then 3 x [ReLU, Linear(hidden, hidden)], then one linear
head per parameter tensor of the model); ``descriptor_batches = 1``; ``embed_labels = true``. Initial phi
and eta: torch's default initialisation under their own seed (experiment.seed, "pefll:init").

Decisions and deviations:

- Where the backward pass runs. The paper (Figure 2) keeps the hypernetwork on the server and
  exchanges v_i, theta_i, Delta theta_i and the descriptor's gradient in two round trips. A pfl
  round has one broadcast and one upload, so, like FL-bench, the client receives eta_t with phi_t
  and runs (1)-(4) itself. Unlike FL-bench (which uploads eta's gradient, the hypernetwork's
  size), the upload is Delta theta_i, v_i and phi's gradient, and the server recomputes eta's
  gradient from v_i and Delta theta_i: the same numbers, a model-sized upload. The bytes down
  are phi + eta (the hypernetwork's size, about hidden_dim times the model's), not theta_i.
- The embedding network. FL-bench's is a LeNet-style CNN on images (resized to 32 x 32) with the
  one-hot label broadcast as extra channels. Here it is an MLP for any input: flatten(x)
  concatenated with onehot(y) (``embed_labels``), Linear(., embed_hidden), ReLU,
  Linear(embed_hidden, embed_hidden), ReLU, Linear(embed_hidden, embed_dim).
- Aggregation: the mean of the received clients' gradients, each weight 1 (FL-bench);
  ``client_weighting`` is not used. A lost upload (``dropout``) contributes nothing; when no
  upload arrives neither network moves and Adam's state stays.
- Local training is the configured optimiser (FL-bench clips each local step's gradient norm to
  50; not here) and leaves no state that mirrors the server: nothing is staged. Buffers
  (BatchNorm statistics) are not produced: each client keeps its own (KeepsOwnEntries), as
  FL-bench's local buffers; they keep the round's training whether or not the upload arrives.
- One architecture for every client (the hypernetwork produces one model's tensors).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn
from torch.func import functional_call

from pfl_core.api import (
    HyperNetwork,
    KeepsOwnEntries,
    SpecError,
    at_least,
    derive_seed,
    hookimpl,
    hypernetwork_size,
    learning_rate,
    model_key,
    per_run,
    produce,
    refuse_if_larger_than_memory,
    spec_archs,
)


@define
class PeFLLParams:
    lr: float = field(default=2e-4, validator=learning_rate, metadata={
        "doc": "learning rate of the server's Adam over the embedding network and the hypernetwork "
               "(FL-bench's hyper_embed_lr)"})
    embed_dim: Optional[int] = field(default=None, validator=at_least(3), metadata={
        "doc": "length of a client descriptor v_i (at least 3: a standardised 2-vector is always "
               "+-(1, -1) / sqrt 2, so nothing would reach the embedding network); none: max(3, int(1 + N / 4)), "
               "N = partition.num_clients (FL-bench's, floored)"})
    embed_hidden: int = field(default=100, validator=at_least(1), metadata={
        "doc": "width of the embedding network's two hidden layers"})
    embed_labels: bool = field(default=True, metadata={
        "doc": "the embedding network also sees each example's one-hot label (FL-bench's embed_y)"})
    descriptor_batches: int = field(default=1, validator=at_least(1), metadata={
        "doc": "mini-batches (training.batch_size examples each) of the train split averaged into the "
               "descriptor (FL-bench's embed_num_batches)"})
    hidden_dim: int = field(default=100, validator=at_least(1), metadata={
        "doc": "width of the hypernetwork's MLP (FL-bench's hyper_hidden_dim)"})
    hidden_layers: int = field(default=3, validator=at_least(0), metadata={
        "doc": "hidden Linear(hidden_dim, hidden_dim) layers after the hypernetwork's first (FL-bench's 3)"})


class EmbeddingNetwork(nn.Module):
    """E((x, y); phi): an MLP on the flattened input, with the one-hot label appended when
    ``num_classes`` is given; one row of the output per example."""

    def __init__(self, input_size: int, num_classes: Optional[int], hidden: int, embed_dim: int):
        super().__init__()
        self.num_classes = num_classes
        width = input_size + (num_classes or 0)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, embed_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = x.flatten(1).float()
        if self.num_classes is not None:
            features = torch.cat([features, F.one_hot(y.long(), self.num_classes).to(features.dtype)], dim=1)
        return self.mlp(features)


def standardise(v: torch.Tensor) -> torch.Tensor:
    return (v - v.mean()) / v.std()


def descriptor(embedding_net: nn.Module, phi: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1): v = standardise(mean over the examples of E((x, y); phi)), differentiable in phi."""
    return standardise(functional_call(embedding_net, phi, (x, y)).mean(0))


def hypernetwork_gradient(hypernetwork: nn.Module, eta: dict[str, torch.Tensor], v: torch.Tensor,
                          delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """g_eta = (d h(v; eta) / d eta)^T (-Delta theta) at ``eta``: the chain rule with -Delta theta
    standing in for the client loss's gradient at theta = h(v; eta)."""
    leaves = {k: t.detach().requires_grad_(True) for k, t in eta.items()}
    theta = produce(hypernetwork, leaves, v.detach())
    names = list(theta)
    grads = torch.autograd.grad([theta[n] for n in names], list(leaves.values()),
                                grad_outputs=[-delta[n].to(theta[n].device, theta[n].dtype) for n in names])
    return dict(zip(leaves, grads))


class PeFLL(KeepsOwnEntries):
    """PeFLL (Scott et al. 2024): an embedding network turns a client's data into a descriptor, a
    hypernetwork turns the descriptor into the client's model; both learn from the clients' local
    updates by the chain rule. Each client is scored with its produced model (see the module doc)."""

    name = "pefll"
    Params = PeFLLParams

    # -- the two networks' structure (a function of the spec and the model: each side computes it)

    def produced(self, ctx, arch: str) -> dict[str, tuple]:
        return per_run(ctx, self, f"produced:{arch}", lambda: {
            name: tuple(p.shape) for name, p in ctx.models.working(arch).named_parameters()})

    def kept_keys(self, ctx, arch: str) -> list[str]:
        produced = self.produced(ctx, arch)
        return [k for k in ctx.models.working(arch).state_dict() if k not in produced]

    def embed_dim(self, num_clients: int) -> int:
        return self.params.embed_dim if self.params.embed_dim is not None else max(3, int(1 + num_clients / 4))

    def networks(self, ctx) -> tuple[EmbeddingNetwork, HyperNetwork]:
        """The structures (on torch's meta device: phi and eta themselves travel as state dicts)."""
        return per_run(ctx, self, "networks", lambda: self._build(ctx, torch.device("meta")))

    def _build(self, ctx, device):
        p, models = self.params, ctx.models
        dim = self.embed_dim(ctx.num_clients)
        with device:
            embedding = EmbeddingNetwork(math.prod(models.input_shape), models.num_classes if p.embed_labels else None,
                                         p.embed_hidden, dim)
            hyper = HyperNetwork(0, dim, p.hidden_dim, p.hidden_layers, self.produced(ctx, models.arch_of(0)))
        return embedding, hyper

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        archs = spec_archs(spec)
        if len(archs) > 1:
            raise SpecError(model_key(spec), f"pefll's hypernetwork produces the weights of one architecture, so "
                                             f"every client needs the same one; got {', '.join(sorted(archs))}")

    @hookimpl
    def setup(self, ctx):
        self.check_memory(ctx)
        ctx.resolved_value("embed_dim", self.embed_dim(ctx.num_clients))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.spec.experiment.seed, "pefll:init"))
            embedding, hyper = self._build(ctx, torch.device("cpu"))
        ctx.server["phi"] = {k: t.detach().to(ctx.device) for k, t in embedding.state_dict().items()}
        ctx.server["eta"] = {k: t.detach().to(ctx.device) for k, t in hyper.state_dict().items()}
        ctx.server["adam"] = None  # Adam's state, from the first step on

    def check_memory(self, ctx) -> None:
        """A hypernetwork larger than this machine's memory is refused before it is allocated (the
        server holds about four copies: eta_t, the stepped eta, Adam's two moments)."""
        p = self.params
        produced = sum(math.prod(s) for s in self.produced(ctx, ctx.models.arch_of(0)).values())
        size = hypernetwork_size(0, self.embed_dim(ctx.num_clients), p.hidden_dim, p.hidden_layers, produced)
        refuse_if_larger_than_memory(size, p.hidden_dim, f"{self.spec_path}.params.hidden_dim")

    def networks_message(self, ctx) -> dict:
        return {"embedding_net": ctx.server["phi"], "hypernetwork": ctx.server["eta"]}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return self.networks_message(ctx)

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.networks_message(ctx)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        # phi_t and eta_t stay as they are until every upload is in: on_broadcast keeps reading
        # them while the executor hands out the remaining clients.
        phi_t, eta_t = ctx.server["phi"], ctx.server["eta"]
        _, hyper = self.networks(ctx)
        sums: dict[str, torch.Tensor] = {}
        arrivals = 0
        for _, message in uploads:
            g_eta = hypernetwork_gradient(hyper, eta_t, message["descriptor"], message["delta"])
            for name, grad in [*(("phi." + k, g) for k, g in message["embedding_grad"].items()),
                               *(("eta." + k, g) for k, g in g_eta.items())]:
                grad = grad.to(ctx.device)
                sums[name] = grad.clone() if name not in sums else sums[name] + grad
            arrivals += 1
        if not arrivals:  # nobody's upload arrived: both networks and Adam stay
            return True
        params = {**{"phi." + k: t.clone() for k, t in phi_t.items()}, **{"eta." + k: t.clone() for k, t in eta_t.items()}}
        tensors = list(params.values())
        optimizer = torch.optim.Adam(tensors, lr=self.params.lr)
        if ctx.server["adam"] is not None:
            optimizer.load_state_dict(ctx.server["adam"])
        for name, tensor in params.items():
            tensor.grad = sums[name] / arrivals
        optimizer.step()
        ctx.server["phi"] = {k: params["phi." + k].detach() for k in phi_t}
        ctx.server["eta"] = {k: params["eta." + k].detach() for k in eta_t}
        ctx.server["adam"] = optimizer.state_dict()
        return True

    # -- client side ---------------------------------------------------------------------------

    def descriptor_sample(self, ctx, client) -> tuple[torch.Tensor, torch.Tensor]:
        """B_i: descriptor_batches x training.batch_size examples of the train split, drawn without
        replacement by the client's seeded generator for this round (all of it when fewer)."""
        x, y = client.data.train_x, client.data.train_y
        size = self.params.descriptor_batches * ctx.spec.training.batch_size
        order = torch.randperm(len(y), generator=client.generator("pefll:descriptor"))[:size]
        return x[order.to(x.device)], y[order.to(y.device)]

    def produce_for(self, ctx, client, message, grad: bool = False):
        """(1), (2): (v_i, theta_i) from the received phi and eta; differentiable in phi if ``grad``."""
        embedding, hyper = self.networks(ctx)
        phi = {k: t.detach().requires_grad_(grad) for k, t in message["embedding_net"].items()}
        x, y = self.descriptor_sample(ctx, client)
        with torch.set_grad_enabled(grad):
            v = descriptor(embedding, phi, x, y)
            theta = produce(hyper, message["hypernetwork"], v)
        return phi, v, theta

    def load_produced(self, ctx, client, message) -> nn.Module:
        _, _, theta = self.produce_for(ctx, client, message)
        return self.load_received(ctx, client, {"weights": theta})

    @hookimpl
    def on_receive(self, ctx, client, message):
        _, _, theta = self.produce_for(ctx, client, message)
        self.load_received(ctx, client, {"weights": theta})
        client.scratch["received"] = theta
        client.scratch["networks"] = message
        return True

    @hookimpl
    def client_upload(self, ctx, client):
        state, received = client.model.state_dict(), client.scratch["received"]
        delta = {k: state[k].detach() - received[k] for k in received}  # (4) Delta theta_i = theta~_i - theta_i
        # theta_i recomputed with phi as a leaf: the same sample (the round's generator), the same numbers
        phi, v, theta = self.produce_for(ctx, client, client.scratch["networks"], grad=True)
        names = list(theta)
        grads = torch.autograd.grad([theta[n] for n in names], list(phi.values()),
                                    grad_outputs=[-delta[n] for n in names])
        return {"delta": delta, "descriptor": v.detach(), "embedding_grad": dict(zip(phi, grads))}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_produced(ctx, client, message)}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        return {"": self.load_produced(ctx, client, message)}  # ready to use: no local training


__all__ = ["EmbeddingNetwork", "PeFLL", "PeFLLParams", "descriptor",
           "hypernetwork_gradient", "standardise"]
