"""pFedLA: Ma, Zhang, Guo and Xu, "Layer-wised Model Aggregation for Personalized Federated
Learning", CVPR 2022 (arXiv:2205.03993), and its HeurpFedLA variant.

The server keeps a model theta_j for every training client j and, for every client i, a
dedicated hypernetwork HN_i(v_i; phi_i) (an embedding v_i and an MLP) whose output is the
aggregation weight matrix alpha_i, one row per layer l and one column per client j. Client i
receives the layer-wise mix theta_bar_i^l = sum_j alpha_i^{l,j} theta_j^l, trains it, and
returns the change; the server adds the change to theta_i and trains HN_i by the chain rule
through the mix.

    server: theta_j = theta^0 for every training client j; phi_i (v_i, MLP, heads) for each i
    each round t, S_t = the round's participants:
        each i in S_t: alpha_i = ReLU(HN_i(v_i; phi_i)), each row normalised to sum 1 (a row
                  of zeros: client i's own one-hot)                                  (on_broadcast,
                  theta_bar_i^l = sum_j alpha_i^{l,j} theta_j^l                       Fig. 2 step 4)
        client i: theta~_i <- training.local_epochs epochs of the configured optimiser
                  from theta_bar_i; Delta theta_i = theta~_i - theta_bar_i            (local_train,
                                                                                      client_upload,
                                                                                      steps 1-2)
        server, for each received Delta theta_i (all at the round's theta_j):        (server_aggregate)
            g_i = (grad_{phi_i, v_i} theta_bar_i)^T (-Delta theta_i)                   (step 3)
            (phi_i, v_i) <- (phi_i, v_i) - hn_lr * SGD-with-momentum(g_i)
            theta_i <- theta_i + Delta theta_i
    HeurpFedLA (heuristic_k = K > 0): in alpha_i the K layers with the largest self-weight
    alpha_i^{l,i} (before normalising) are replaced by client i's own one-hot, taking no
    gradient: those layers are client i's own theta_i^l.
    evaluation: client i is scored with theta_bar_i of the current theta_j and phi_i (the model
    the server would send it next), with its own BatchNorm statistics, without local steps.

What was read: the paper's abstract and the caption of its Figure 2 (the five steps: local
training; upload of Delta theta_i; the server updates alpha_i through HN_i(v_i; psi_i) from
Delta theta_i; weighted aggregation into the personalised theta_bar_i; download). The paper's
full text (its equations and Algorithm 1) could not be read from this machine, so the step
labels above are the figure's, and every detail follows FL-bench, read in full (not copied):
``src/server/pfedla.py`` and ``src/client/fedavg.py`` of KarhouTam/FL-bench at 06e658b (Oct
2025), and the same files at 89dc572 (Apr 2024) for the older, layer-keyed version. PFLlib
(TsingZ0/PFLlib) has no pFedLA.

Defaults (FL-bench's): ``hn_lr = 5e-3``, ``momentum = 0``, ``embed_dim = 100``, ``hidden_dim =
100``, ``heuristic_k = 0`` (pFedLA; K > 0 is HeurpFedLA). HN_i: v_i (embed_dim), then three
[Linear, ReLU] of width hidden_dim, then per layer l a Linear(hidden_dim, N) head, N the number
of training clients, initialised U(0, 1) with zero bias so every alpha starts positive; v_i
is N(0, 1) (nn.Embedding's). Every client's phi_i starts as the same draw (FL-bench deep-copies
one hypernetwork), its v_i its own row of one embedding table; drawn under their own seed
(experiment.seed, "pfedla:init").

Decisions and deviations:

- The sign of the hypernetwork step. The gradient fed back is -Delta theta_i (theta_bar_i
  minus the trained model: the client loss's gradient surrogate), with a descent step, so the
  step moves theta_bar_i towards what the client trained: it raises the weight of the clients
  j whose theta_j^l - theta_bar_i^l points along Delta theta_i^l. This is the convention of
  pFedHN's authors (plugins/pfedhn) and of FL-bench's own pFedHN. FL-bench's pFedLA feeds back
  +Delta theta_i (``-diff`` with ``diff = global - trained``) to the same descent step, at both
  commits read, which moves theta_bar_i away from the trained model; that sign is not followed.
  On ``specs/pfedla.toml`` (seed 0) this sign scored 0.824, 0.945 and 0.969 at hn_lr = 5e-3,
  0.05 and 0.5; FL-bench's scored 0.631, 0.094 and 0.0.
- Layers are the model's parameterised layers (a module's weight and bias share one row of
  alpha_i), as in the paper's "layer" and FL-bench at 89dc572; FL-bench at 06e658b gives every
  parameter tensor its own row (weight and bias mixed separately).
- theta_i <- theta_i + Delta theta_i (FL-bench at 06e658b): theta_i accumulates client i's own
  changes from theta^0. FL-bench at 89dc572 instead set theta_i to the trained model
  theta_bar_i + Delta theta_i.
- Several clients per round. FL-bench trains a round's clients one after another (it refuses
  its parallel mode), each aggregating the theta_j its predecessors already changed. Here every
  participant's theta_bar_i uses the round's theta_j and the server applies every update after
  the round (so a process or Ray executor can run them at once). Each client has its own
  hypernetwork, so no step is stale: g_i is the exact derivative of what client i received.
- Momentum buffers are per client (FL-bench has one optimiser whose buffers all clients'
  hypernetworks share; it is off by default there and here).
- Columns: alpha_i has one column per training client. Cold-start clients (held out) are not
  mixed in, have no hypernetwork, and receive the uniform mean of the training clients'
  theta_j (FedAvg's mix with equal weights); they train ``experiment.coldstart_epochs`` from it
  (the core default). The paper has no novel-client procedure for pFedLA.
- Buffers (BatchNorm statistics) are not aggregated: each client keeps its own, from the
  initial ones (FL-bench's default ``buffers = "local"``). ``client_weighting`` is not used:
  each client's update touches only its own hypernetwork and theta_i.
- Lost uploads (``dropout`` add-on): theta_i and phi_i take no step. Nothing on the client
  mirrors the server, so nothing is staged; the buffers are the client's own and keep the
  round's training (docs/writing-a-plugin.md, "Client state and lost uploads").
- Bytes: theta_bar_i down, Delta theta_i up (the model's parameters). The server holds N
  models and N hypernetworks (each about 2 hidden_dim^2 + (embed_dim + L N) hidden_dim numbers).
"""

from __future__ import annotations

import torch
from attrs import define, field
from torch import nn
from torch.func import functional_call

from pfl_core.api import (
    KeepsOwnEntries,
    SpecError,
    at_least,
    between,
    derive_seed,
    hookimpl,
    layer_keys,
    learning_rate,
    parameterised_layers,
    per_run,
    probe_num_layers,
    require_single_architecture,
    spec_archs,
)

EMBEDDING = "embedding"  # v_i in phi_i


@define
class PFedLAParams:
    hn_lr: float = field(default=5e-3, validator=learning_rate, metadata={
        "doc": "learning rate of each client's hypernetwork HN_i and embedding v_i (FL-bench's 5e-3)"})
    momentum: float = field(default=0.0, validator=between(0, 1, high_open=True), metadata={
        "doc": "momentum of the hypernetworks' SGD, one buffer per client (FL-bench's 0)"})
    embed_dim: int = field(default=100, validator=at_least(1), metadata={
        "doc": "length of a client embedding v_i (FL-bench's 100)"})
    hidden_dim: int = field(default=100, validator=at_least(1), metadata={
        "doc": "width of the hypernetwork's three hidden layers (FL-bench's 100)"})
    heuristic_k: int = field(default=0, validator=at_least(0), metadata={
        "doc": "HeurpFedLA's K: the K layers with the largest self-weight are the client's own; 0: pFedLA; "
               "at most the model's number of layers"})


class LayerWeights(nn.Module):
    """HN_i(v; phi): three [Linear, ReLU] on the embedding v, then one Linear(hidden, N) head per
    layer, each through a ReLU: the unnormalised aggregation weights, L x N (FL-bench's)."""

    def __init__(self, embed_dim: int, hidden_dim: int, num_layers: int, num_clients: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.zeros(embed_dim))
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.ReLU(), nn.Linear(hidden_dim, hidden_dim), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(hidden_dim, num_clients) for _ in range(num_layers))

    def forward(self) -> torch.Tensor:
        features = self.mlp(self.embedding)
        return torch.stack([torch.relu(head(features)) for head in self.heads])


def layer_weights(hypernetwork: LayerWeights, phi: dict[str, torch.Tensor]) -> torch.Tensor:
    """The L x N unnormalised alpha_i = HN_i(v_i; phi_i), phi_i given as a state dict."""
    return functional_call(hypernetwork, phi, ())


def mixing_weights(raw: torch.Tensor, own: int, heuristic_k: int = 0) -> torch.Tensor:
    """Each row of ``raw`` normalised to sum 1, a row of zeros replaced by the one-hot of column
    ``own``; with ``heuristic_k`` = K > 0 (HeurpFedLA) the K rows of largest raw[l, own] are
    that one-hot too, without gradient."""
    one_hot = torch.zeros(raw.shape[1], dtype=raw.dtype, device=raw.device)
    one_hot[own] = 1.0
    own_layers = set()
    if heuristic_k:
        own_layers = set(torch.topk(raw[:, own].detach(), heuristic_k).indices.tolist())
    rows = []
    for l, row in enumerate(raw):
        if l in own_layers or not bool(row.sum() > 0):
            rows.append(one_hot)
        else:
            rows.append(row / row.sum())
    return torch.stack(rows)


def mix(alpha: torch.Tensor, models: list[dict[str, torch.Tensor]], layers: list[list[str]]) -> dict[str, torch.Tensor]:
    """theta_bar^l = sum_j alpha[l, j] theta_j^l for each layer's parameter keys."""
    out = {}
    for l, keys in enumerate(layers):
        for key in keys:
            stacked = torch.stack([m[key] for m in models])
            out[key] = torch.tensordot(alpha[l].to(stacked.dtype), stacked, dims=1)
    return out


class PFedLA(KeepsOwnEntries):
    """pFedLA (Ma et al. 2022): a hypernetwork per client on the server produces layer-wise weights
    that mix all clients' models into that client's model; the clients' changes train the
    hypernetworks by the chain rule. Each client is scored with its mix (see the module doc)."""

    name = "pfedla"
    Params = PFedLAParams

    # -- what is mixed (a function of the spec and the model: each side computes it) -----------

    def layers(self, ctx, arch: str) -> list[list[str]]:
        """The parameter keys of each parameterised layer (buffers excluded)."""
        return per_run(ctx, self, f"layers:{arch}", lambda: self._layers(ctx, arch))

    def _layers(self, ctx, arch: str):
        model = ctx.models.working(arch)
        names = {n for n, _ in model.named_parameters()}
        return [[k for k in keys if k in names] for keys in layer_keys(model)[:len(parameterised_layers(model))]]

    def kept_keys(self, ctx, arch: str) -> list[str]:
        """The state-dict keys each client keeps for itself (buffers)."""
        mixed = {k for keys in self.layers(ctx, arch) for k in keys}
        return [k for k in ctx.models.working(arch).state_dict() if k not in mixed]

    def hypernetwork(self, ctx) -> LayerWeights:
        """HN's structure (on torch's meta device: every phi_i is in ctx.server)."""
        return per_run(ctx, self, "hypernetwork", lambda: self._build(ctx, torch.device("meta")))

    def _build(self, ctx, device) -> LayerWeights:
        p = self.params
        with device:
            return LayerWeights(p.embed_dim, p.hidden_dim, len(self.layers(ctx, ctx.models.arch_of(0))),
                                len(ctx.training_clients))

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)
        self.check_k(probe_num_layers(spec, spec_archs(spec)[0]))

    def check_k(self, num_layers) -> None:
        k = self.params.heuristic_k
        if num_layers is not None and k > num_layers:
            raise SpecError(f"{self.spec_path}.params.heuristic_k",
                            f"HeurpFedLA keeps the client's own weights in {k} layers, but the model has "
                            f"{num_layers}; use at most {num_layers}")

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        self.check_k(len(self.layers(ctx, arch)))  # the real model (check_spec could only guess its input)
        initial = ctx.models.initial_state(arch)
        mixed = [k for keys in self.layers(ctx, arch) for k in keys]
        clients = list(ctx.training_clients)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.spec.experiment.seed, "pfedla:init"))
            table = nn.Embedding(len(clients), self.params.embed_dim).weight.detach()
            hypernetwork = self._build(ctx, torch.device("cpu"))
            for head in hypernetwork.heads:  # FL-bench: every weight starts positive
                nn.init.uniform_(head.weight)
                nn.init.zeros_(head.bias)
        shared = {k: t.detach() for k, t in hypernetwork.state_dict().items() if k != EMBEDDING}
        ctx.server["hn"] = {i: {EMBEDDING: table[col].clone().to(ctx.device),
                                **{k: t.clone().to(ctx.device) for k, t in shared.items()}}
                            for col, i in enumerate(clients)}
        ctx.server["hn_momentum"] = {}  # per client, from its first step on (momentum > 0)
        ctx.server["models"] = {i: {k: initial[k].detach().clone().to(ctx.device) for k in mixed} for i in clients}

    def column(self, ctx, client_id: int) -> int:
        return list(ctx.training_clients).index(client_id)

    def mixed_for(self, ctx, client_id: int, phi=None) -> dict[str, torch.Tensor]:
        """theta_bar_i from the stored theta_j (differentiable in ``phi`` when it requires grad); a
        cold-start client gets their uniform mean."""
        arch = ctx.models.arch_of(client_id)
        layers, models = self.layers(ctx, arch), [ctx.server["models"][j] for j in ctx.training_clients]
        if client_id not in ctx.server["hn"]:
            uniform = torch.full((len(layers), len(models)), 1.0 / len(models), device=ctx.device)
            return mix(uniform, models, layers)
        phi = ctx.server["hn"][client_id] if phi is None else phi
        raw = layer_weights(self.hypernetwork(ctx), phi)
        alpha = mixing_weights(raw, self.column(ctx, client_id), self.params.heuristic_k)
        return mix(alpha, models, layers)

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        with torch.no_grad():
            return {"weights": self.mixed_for(ctx, client_id)}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        # on_broadcast reads theta_j and phi_i while the executor hands out the remaining clients:
        # both stay as they are until every upload is in.
        stepped_hn, stepped_models, momentum = {}, {}, dict(ctx.server["hn_momentum"])
        for client_id, message in uploads:
            delta = message["delta"]
            grads = self.hypergradient(ctx, client_id, delta)
            stepped_hn[client_id], buffers = self.sgd_step(ctx.server["hn"][client_id], grads,
                                                           momentum.get(client_id))
            if buffers is not None:
                momentum[client_id] = buffers
            own = ctx.server["models"][client_id]
            stepped_models[client_id] = {k: own[k] + delta[k].to(own[k].device, own[k].dtype) for k in own}
        if stepped_hn:  # nobody's upload arrived: everything stays
            ctx.server["hn"] = {**ctx.server["hn"], **stepped_hn}
            ctx.server["models"] = {**ctx.server["models"], **stepped_models}
            ctx.server["hn_momentum"] = momentum
        return True

    def hypergradient(self, ctx, client_id: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """d<theta_bar_i(phi_i), -Delta theta_i>/d phi_i at the stored phi_i and theta_j."""
        leaves = {k: t.detach().requires_grad_(True) for k, t in ctx.server["hn"][client_id].items()}
        with torch.enable_grad():
            theta = self.mixed_for(ctx, client_id, leaves)
            names = list(theta)
            if not any(theta[n].requires_grad for n in names):  # every row a one-hot: nothing to learn
                return {k: torch.zeros_like(t) for k, t in leaves.items()}
            grads = torch.autograd.grad([theta[n] for n in names], list(leaves.values()), allow_unused=True,
                                        grad_outputs=[-delta[n].to(theta[n].device, theta[n].dtype) for n in names])
        return {k: torch.zeros_like(t) if g is None else g for (k, t), g in zip(leaves.items(), grads)}

    def sgd_step(self, phi, grads, buffers):
        """torch.optim.SGD's update (no dampening, no weight decay), written out: (phi', buffers')."""
        m, lr = self.params.momentum, self.params.hn_lr
        if not m:
            return {k: t - lr * grads[k] for k, t in phi.items()}, None
        buffers = {k: grads[k].clone() if buffers is None else m * buffers[k] + grads[k] for k in phi}
        return {k: t - lr * buffers[k] for k, t in phi.items()}, buffers

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        with torch.no_grad():
            return {"weights": self.mixed_for(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def client_upload(self, ctx, client):
        state, theta_bar = client.model.state_dict(), client.scratch["received"]
        return {"delta": {k: state[k].detach() - theta_bar[k] for k in theta_bar}}  # theta~_i - theta_bar_i


__all__ = ["LayerWeights", "PFedLA", "PFedLAParams", "layer_weights", "mix", "mixing_weights"]
