"""pFedHN: Shamsian, Navon, Fetaya and Chechik, "Personalized Federated Learning using
Hypernetworks", ICML 2021 (arXiv:2103.04628), Algorithm 1, and its pFedHN-PC variant.

A hypernetwork h(.; phi) on the server maps a learned embedding v_i of each client to that
client's model weights theta_i = h(v_i; phi). The client trains theta_i for a few local steps
and returns the change Delta theta_i; the server updates phi and v_i by the chain rule with
Delta theta_i standing in for the client loss's gradient. Only theta_i and Delta theta_i
travel: the hypernetwork never leaves the server.

    server: phi^0 (embeddings v_1..v_N, an MLP, one linear head per tensor of theta)   (setup)
    each round t, S_t = the round's participants:
        each i in S_t: theta_i = h(v_i; phi_t)                                     (on_broadcast)
        client i: theta~_i <- training.local_epochs epochs of SGD from theta_i     (on_receive,
                  (Alg. 1's K local steps, eta = training.lr)                      local_train)
                  Delta theta_i = theta~_i - theta_i                               (client_upload)
        server, for each received Delta theta_i in participant order:              (server_aggregate)
            g_i = (grad_phi theta_i)^T (-Delta theta_i)   at phi_t, i.e. the chain
                  rule d<h(v_i; phi), -Delta theta_i>/d(phi, v_i): v_i gets (grad_{v_i} theta_i)^T
                  (-Delta theta_i), phi's other tensors theirs (Alg. 1's two update lines)
            (phi, v) <- one optimiser step with g_i (SGD, momentum, weight decay, the
                  gradient's norm clipped to max_grad_norm: the authors' optimiser)
    evaluation: client i is scored with theta_i = h(v_i; phi) of the current phi, without
    local steps (the authors' ``evaluate``, which loads hnet(node_id) and predicts).

What was read: the paper's abstract and the caption of its Figure 1 ("the client performs
several local optimization steps to obtain theta~_i and sends back the update direction Delta
theta_i = theta~_i - theta_i"). The paper's full text (Algorithm 1's listing, its equations)
could not be read from this machine: Alg. 1's shape used above (K local steps at eta, the
hypernetwork's learning rate alpha, one update line for phi and one for v_i) is as recalled,
and every detail follows the authors' code, read in full: github.com/AvivSham/pFedHN,
``experiments/pfedhn/trainer.py`` and ``models.py`` (pFedHN), ``experiments/pfedhn_pc/trainer.py``
(pFedHN-PC). Also read (not copied): FL-bench's ``src/server/pfedhn.py`` (KarhouTam/FL-bench at
06e658b), which differs from the authors in its embedding size (int((1 + N) / 4)) and in its
pFedHN-PC (the hypernetwork still produces the classifier, whose Delta theta is zeroed, so its
heads only decay). PFLlib (TsingZ0/PFLlib at d832e76) has no pFedHN.

The sign. The authors' code passes theta_i - theta~_i = -Delta theta_i as the gradient of the
hypernetwork's outputs to a *descent* step of its optimiser (``torch.autograd.grad(weights,
hnet.parameters(), grad_outputs=inner_state - final_state)``), so the step moves theta_i towards
theta~_i: -Delta theta_i is a surrogate of the client loss's gradient at theta_i. That is what
runs here; the upload is the paper's Delta theta_i = theta~_i - theta_i (Figure 1).

Defaults (the authors' pFedHN trainer): ``alpha = 0.01`` (their ``--lr``; 0.05 in their pFedHN-PC
trainer), SGD with ``momentum = 0.9`` and ``weight_decay = 1e-3`` on every hypernetwork tensor,
the embeddings included; ``embed_lr`` none = alpha; ``max_grad_norm = 50``; ``hidden_dim = 100``;
``hidden_layers = 3`` (the MLP is Linear(embed_dim, hidden) then 3 x [ReLU, Linear(hidden,
hidden)]); ``embed_dim`` none = int(1 + N / 4), N = partition.num_clients. Initial phi: torch's
default initialisation (embeddings N(0, 1), as nn.Embedding), drawn under its own seed
(experiment.seed, "pfedhn:init").

Decisions and deviations:

- Several clients per round. Alg. 1 (and the authors' code) samples one client per step; pfl's
  round has every participant train from the same phi_t (so a process or Ray executor can run
  them at once). The server then takes one optimiser step per received upload, in participant
  order, each with the chain rule evaluated at phi_t, the phi that produced that theta_i (the
  exact derivative of what the client received); the steps are applied one after another, so a
  later client's step lands on a phi already moved by the earlier ones (a staleness of at most
  |S_t| - 1 steps, as in asynchronous SGD). One participant per round (``experiment.participation
  = 1 / partition.num_clients``) is Alg. 1 exactly. FL-bench instead trains a round's clients one
  after another, each from the phi its predecessors left. ``client_weighting`` is not used: each
  step has weight 1, as each of Alg. 1's steps. The staleness costs accuracy when many clients
  take part at once: on ``specs/pfedhn.toml`` (20 clients, 200 client visits, seed 0) pFedHN
  scored 0.73 with all 20 in every round, 0.945 with 5 a round and 0.93 with one (Alg. 1), and
  collapsed with all 20 at alpha = 0.03. Keep a round's participants few, or lower alpha.
- Local steps: Alg. 1's K steps are ``training.local_epochs`` epochs of the configured optimiser
  (the authors: 50 mini-batches of SGD, lr 5e-3, momentum 0.9, weight decay 5e-5, each step's
  gradient norm clipped to 50; that clip is not applied here).
- Generic targets. The authors' hypernetwork is written for their LeNet-style CNN; here it has
  one linear head per parameter tensor of whatever model the spec names (FL-bench does the
  same). Buffers (BatchNorm statistics) are not produced: each client keeps its own, starting
  from the initial ones (FL-bench also keeps them local; the authors' models have none).
- The embedding table has a row for every client. Weight decay and momentum act on the whole
  table at every step, so a client's v_i also shrinks while others train (the authors' optimiser
  does the same).
- pFedHN-PC (``personal_classifier = true``): the hypernetwork produces everything but the
  classifier (the last parameterised layer); each client keeps its own classifier, trained
  jointly with the produced weights in the local steps with the same optimiser (the authors'
  pFedHN-PC), and scored with it. Delta theta_i covers the produced part only.
- Lost uploads (``dropout`` add-on): the hypernetwork takes no step for a lost upload. Nothing in
  the client's state mirrors the server's, so nothing is staged: the buffers and the personal
  classifier are the client's own and keep the round's training (docs/writing-a-plugin.md,
  "Client state and lost uploads").
- Bytes: theta_i down, Delta theta_i up (the produced tensors only; the model's size, whatever
  the hypernetwork's).
- Cold start: a newcomer has no trained embedding; it receives h(v_bar; phi), v_bar the mean of
  the training clients' embeddings, and trains ``experiment.coldstart_epochs`` epochs from it
  (the core default). The paper's novel-client experiment (as recalled, not read here: a new
  embedding learned with phi frozen, over rounds of communication) is not run: a cold-start
  client gets one broadcast.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from attrs import define, field

from pfl_core.api import (
    HyperNetwork,
    KeepsOwnEntries,
    SpecError,
    at_least,
    between,
    derive_seed,
    finite,
    greater_than,
    head_keys,
    hookimpl,
    hypernetwork_size,
    learning_rate,
    model_key,
    parameterised_layers,
    per_run,
    probe_num_layers,
    produce,
    refuse_if_larger_than_memory,
    spec_archs,
)

EMBEDDINGS = "embeddings.weight"  # the table of client embeddings v_1..v_N in phi


@define
class PFedHNParams:
    alpha: float = field(default=0.01, validator=learning_rate, metadata={
        "doc": "alpha, the hypernetwork's learning rate (Alg. 1); the authors' pFedHN default (their "
               "pFedHN-PC trainer uses 0.05)"})
    embed_lr: Optional[float] = field(default=None, validator=learning_rate, metadata={
        "doc": "learning rate of the client embeddings v_i; none: alpha (the authors' code)"})
    momentum: float = field(default=0.9, validator=between(0, 1, high_open=True), metadata={
        "doc": "momentum of the hypernetwork's SGD (the authors' 0.9)"})
    weight_decay: float = field(default=1e-3, validator=[finite, at_least(0)], metadata={
        "doc": "weight decay of the hypernetwork's SGD, embeddings included (the authors' 1e-3)"})
    max_grad_norm: Optional[float] = field(default=50.0, validator=[finite, greater_than(0)], metadata={
        "doc": "each step's hypernetwork gradient is clipped to this total norm (the authors' 50); "
               "none: not clipped"})
    embed_dim: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "length of a client embedding v_i; none: int(1 + N / 4), N = partition.num_clients "
               "(the authors')"})
    hidden_dim: int = field(default=100, validator=at_least(1), metadata={
        "doc": "width of the hypernetwork's MLP (the authors' 100)"})
    hidden_layers: int = field(default=3, validator=at_least(0), metadata={
        "doc": "hidden Linear(hidden_dim, hidden_dim) layers after the MLP's first (the authors' 3)"})
    personal_classifier: bool = field(default=False, metadata={
        "doc": "pFedHN-PC: the hypernetwork produces all but the classifier (the last layer), which each "
               "client keeps and trains"})


def hypergradient(hypernetwork: HyperNetwork, phi: dict[str, torch.Tensor], client_id: int,
                  delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(grad_phi theta_i)^T (-Delta theta_i) at ``phi``, for every tensor of phi (the embedding
    table's gradient is non-zero in row ``client_id`` only): the chain rule with -Delta theta_i
    standing in for the client loss's gradient at theta_i = h(v_i; phi)."""
    leaves = {k: t.detach().requires_grad_(True) for k, t in phi.items()}
    theta = produce(hypernetwork, leaves, leaves[EMBEDDINGS][client_id])
    names = list(theta)
    grads = torch.autograd.grad([theta[n] for n in names], list(leaves.values()),
                                grad_outputs=[-delta[n].to(theta[n].device, theta[n].dtype) for n in names])
    return dict(zip(leaves, grads))


class PFedHN(KeepsOwnEntries):
    """pFedHN (Shamsian et al. 2021): a server-side hypernetwork produces each client's model from
    its embedding; clients train it and return the change, which updates the hypernetwork and the
    embedding by the chain rule. Each client is scored with its produced model (see the module doc)."""

    name = "pfedhn"
    Params = PFedHNParams

    # -- what the hypernetwork produces (a function of the spec and the model: each side computes it)

    def kept_keys(self, ctx, arch: str) -> list[str]:
        return self.split(ctx, arch)[1]

    def split(self, ctx, arch: str) -> tuple[dict[str, tuple], list[str]]:
        """({produced parameter: shape}, the state-dict keys the client keeps: buffers and, for
        pFedHN-PC, the classifier)."""
        return per_run(ctx, self, f"split:{arch}", lambda: self._split(ctx, arch))

    def _split(self, ctx, arch: str):
        model = ctx.models.working(arch)
        kept = set(head_keys(model)) if self.params.personal_classifier else set()
        produced = {name: tuple(p.shape) for name, p in model.named_parameters() if name not in kept}
        return produced, [k for k in model.state_dict() if k not in produced]

    def embed_dim(self, num_clients: int) -> int:
        return self.params.embed_dim if self.params.embed_dim is not None else int(1 + num_clients / 4)

    def hypernetwork(self, ctx) -> HyperNetwork:
        """The hypernetwork's structure (on torch's meta device: phi itself is in ctx.server)."""
        return per_run(ctx, self, "hypernetwork", lambda: self._build(ctx, torch.device("meta")))

    def _build(self, ctx, device) -> HyperNetwork:
        produced, _ = self.split(ctx, ctx.models.arch_of(0))
        p = self.params
        with device:
            return HyperNetwork(ctx.num_clients, self.embed_dim(ctx.num_clients), p.hidden_dim, p.hidden_layers,
                                produced)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        archs = spec_archs(spec)
        if len(archs) > 1:
            raise SpecError(model_key(spec), f"pfedhn's hypernetwork produces the weights of one architecture, so "
                                             f"every client needs the same one; got {', '.join(sorted(archs))}")
        if self.params.personal_classifier:
            self.check_classifier(archs[0], probe_num_layers(spec, archs[0]))

    def check_classifier(self, arch: str, num_layers: Optional[int]) -> None:
        if num_layers is not None and num_layers < 2:
            raise SpecError(f"{self.spec_path}.params.personal_classifier",
                            f"pFedHN-PC keeps the classifier on the client and produces the rest, but {arch} has "
                            f"{num_layers} parameterised layer; use a model with a hidden layer")

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        if self.params.personal_classifier:  # the real model (check_spec could only guess its input)
            self.check_classifier(arch, len(parameterised_layers(ctx.models.working(arch))))
        produced, _ = self.split(ctx, arch)
        self.check_memory(ctx, produced)
        ctx.resolved_value("embed_dim", self.embed_dim(ctx.num_clients))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.spec.experiment.seed, "pfedhn:init"))
            hypernetwork = self._build(ctx, torch.device("cpu"))
        ctx.server["hn"] = {k: t.detach().to(ctx.device) for k, t in hypernetwork.state_dict().items()}
        ctx.server["hn_momentum"] = {}  # SGD's momentum buffers, from the first step on

    def check_memory(self, ctx, produced: dict[str, tuple]) -> None:
        """A hypernetwork larger than this machine's memory is refused before it is allocated (the
        server holds about four copies: phi_t, the stepped phi, momentum, a gradient)."""
        p = self.params
        size = hypernetwork_size(ctx.num_clients, self.embed_dim(ctx.num_clients), p.hidden_dim, p.hidden_layers,
                                 sum(math.prod(s) for s in produced.values()))
        refuse_if_larger_than_memory(size, p.hidden_dim, f"{self.spec_path}.params.hidden_dim")

    def produced_for(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        """theta_i = h(v_i; phi); a cold-start client's v is the training clients' mean embedding."""
        phi = ctx.server["hn"]
        table = phi[EMBEDDINGS]
        v = table[ctx.training_clients].mean(0) if client_id in ctx.coldstart_clients else table[client_id]
        with torch.no_grad():
            return produce(self.hypernetwork(ctx), phi, v)

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"weights": self.produced_for(ctx, client_id)}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        # phi_t produced this round's theta_i, and on_broadcast keeps reading it while the
        # executor hands out the remaining clients: it stays as it is until every upload is in.
        phi_t = ctx.server["hn"]
        phi = {k: t.clone().requires_grad_(True) for k, t in phi_t.items()}
        optimizer = self.optimizer(phi, ctx.server["hn_momentum"])
        steps = 0
        for client_id, message in uploads:
            grads = hypergradient(self.hypernetwork(ctx), phi_t, client_id, message["delta"])
            for name, p in phi.items():
                p.grad = grads[name]
            if self.params.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(phi.values()), self.params.max_grad_norm)
            optimizer.step()
            steps += 1
        if steps:  # nobody's upload arrived: phi stays
            ctx.server["hn"] = {k: p.detach() for k, p in phi.items()}
            ctx.server["hn_momentum"] = {k: optimizer.state[p]["momentum_buffer"] for k, p in phi.items()
                                         if optimizer.state[p].get("momentum_buffer") is not None}
        return True

    def optimizer(self, phi: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor]) -> torch.optim.SGD:
        """The authors' hypernetwork optimiser: SGD, the embeddings at ``embed_lr``; its momentum
        buffers carried over from the previous rounds."""
        p = self.params
        embed_lr = p.alpha if p.embed_lr is None else p.embed_lr
        groups = [{"params": [t for k, t in phi.items() if k != EMBEDDINGS]},
                  {"params": [phi[EMBEDDINGS]], "lr": embed_lr}]
        optimizer = torch.optim.SGD(groups, lr=p.alpha, momentum=p.momentum, weight_decay=p.weight_decay)
        for name, buffer in momentum.items():
            optimizer.state[phi[name]]["momentum_buffer"] = buffer.clone()
        return optimizer

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": self.produced_for(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def client_upload(self, ctx, client):
        state, theta = client.model.state_dict(), client.scratch["received"]
        return {"delta": {k: state[k].detach() - theta[k] for k in theta}}  # Delta theta_i = theta~_i - theta_i


__all__ = ["HyperNetwork", "PFedHN", "PFedHNParams", "hypergradient", "produce"]
