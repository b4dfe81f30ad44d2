"""FedMTL: Smith, Chiang, Sanjabi and Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017
(MOCHA), as PFLlib's FedMTL trains it: one model per client, coupled by a task-relationship
regulariser, trained in the primal with SGD.

Only the paper's abstract and introduction could be read here (its Eq. 1, the examples of Omega and
Algorithm 1 could not): the objective below is the one the paper is known for and PFLlib's code
builds, checked against PFLlib (github.com/TsingZ0/PFLlib at commit
d832e76f6a23b833038949ec1e4fdefe63a4d350, system/flcore/clients/clientmtl.py and
system/flcore/servers/servermtl.py). The step labels (M1)-(M4) are ours.

With W = [w_1 ... w_m] the m training clients' flattened models (one column each):

    (Eq. 1)  min_W  sum_t F_t(w_t) + lam * tr(W Omega W^T)
    Omega = (I - 1 1^T / m)^2 = I - 1 1^T / m (the mean-regularised MTL relationship, the centring
    matrix, idempotent), so tr(W Omega W^T) = sum_t ||w_t - mean_s w_s||^2.

Client i's part of tr(W Omega W^T), with the other columns fixed, is
Omega_ii ||w_i||^2 + 2 <w_i, v_i> + const, v_i = sum_{t != i} Omega_it w_t. So one model-sized
tensor travels down, never the other clients' models:

    server: W^0 = the seeded initial weights in every column                          (setup)
    each round, each participant i:
      (M1) v_i = sum_{t != i} Omega_it w_t over the server's columns: each client's last
           delivered model, the initial weights before its first        (on_broadcast: Omega_ii, v_i)
      (M2) w_i <- training.local_epochs epochs of the configured optimiser on
           F_i(w) + lam (Omega_ii ||w||^2 + 2 <w, v_i>), from the client's own w_i
           (the gradient 2 lam (Omega_ii w + v_i) = 2 lam (w - mean_t w_t))  (on_receive, local_objective)
      (M3) w_i kept in client.state (the client's own model); sent up whole       (client_upload)
      (M4) column i of W <- the delivered w_i (parameters only)                   (server_aggregate)
    Omega: fixed (the paper's mean-regularised example; MOCHA's Omega-step for a learned Omega is
    not offered).

What is evaluated: each client's own w_i (the initial weights if it never trained).

Deviations:

- From MOCHA: MOCHA solves the W-step in the dual (CoCoA-style local quadratic subproblems solved
  approximately by SDCA, theta-inexact per node, for convex losses) and alternates it with a
  central Omega-step. Here the W-step is the primal, trained with the configured optimiser
  (PFLlib's choice), which makes it apply to neural networks; there is no duality gap, no
  sigma' aggregation parameter and no Omega-step (Omega is the fixed mean-regularised matrix).
  The paper's lambda_2 ||W||_F^2 is the optimiser's weight decay (training.weight_decay).
- Each client sees the other columns as they were at the broadcast (frozen for the round), and W
  changes only when an upload is delivered: a lost upload (``dropout``) leaves column i at the
  client's last delivered model while the client keeps the model it trained (its own state, as
  MOCHA's dropped nodes leave their column unchanged). Non-participants keep their columns too.
- From PFLlib (which reads the same objective): (a) its Omega is built from a matrix of ones,
  not the identity, so it is the constant (1 - 1/m)^2 everywhere; (b) its W comes from
  ``state_dict()``, whose tensors are detached, so the regulariser adds no gradient at all and
  PFLlib's FedMTL trains each client alone (Local); (c) its W holds only this round's
  participants and includes buffers; (d) its regulariser is ||W||_F^2 + c^2 ||W 1||^2 scaled by
  10^-(digits of the model size + 1), its ``lamba`` being unused. Here the term has a gradient
  (tested), W holds every training client's parameters, and lam is a parameter.
- Buffers (BatchNorm's statistics) are each client's own and not regularised.
- A cold-start client (``experiment.coldstart_clients``) has no column: it fine-tunes the
  initial weights with the plain loss (no other model reaches it).
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    Plugin,
    at_least,
    clone_state,
    finite,
    hookimpl,
    load_personal,
    per_run,
    require_single_architecture,
)


@define
class FedMTLParams:
    lam: float = field(default=0.05, validator=[finite, at_least(0)], metadata={
        "doc": "lambda of lam * tr(W Omega W^T) (Eq. 1), Omega = I - 1 1^T / m; its gradient for client i is "
               "2 lam (w_i - the mean of all m columns), a pull towards the clients' mean model; 0 trains each "
               "client alone (Local). Default: ours (PFLlib's term has no gradient)"})


def relationship(m: int) -> torch.Tensor:
    """Omega = (I - 1 1^T / m)^2 for m clients (the mean-regularised relationship)."""
    centring = torch.eye(m) - torch.ones(m, m) / m
    return centring @ centring


def pull_for(i_index: int, omega: torch.Tensor, columns: list[dict]) -> dict:
    """v_i = sum_{t != i} Omega_it w_t (M1), per parameter name."""
    names = columns[0].keys()
    return {n: sum(omega[i_index, t].item() * col[n] for t, col in enumerate(columns) if t != i_index)
            for n in names}


class FedMTL(Plugin):
    """FedMTL (Smith et al. 2017, PFLlib's primal variant): each client trains its own model on its
    loss plus lam * tr(W Omega W^T) over every client's model, Omega the mean-regularised
    relationship; the server sends each participant only Omega_ii and sum_{t != i} Omega_it w_t."""

    name = "fedmtl"
    Params = FedMTLParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        ctx.server["columns"] = {}  # client id -> its last delivered parameters (a column of W)

    def parameter_names(self, ctx, arch: str) -> list[str]:
        return per_run(ctx, self, f"names:{arch}", lambda: [n for n, _ in ctx.models.build(arch).named_parameters()])

    def column(self, ctx, client_id) -> dict:
        stored = ctx.server["columns"].get(client_id)
        if stored is not None:
            return stored
        init = ctx.models.initial_state(ctx.models.arch_of(client_id))
        return {n: init[n] for n in self.parameter_names(ctx, ctx.models.arch_of(client_id))}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        clients = list(ctx.training_clients)
        if client_id not in clients:  # a cold-start client: no column, no coupling
            return {}
        omega = per_run(ctx, self, "omega", lambda: relationship(len(clients)))
        index = clients.index(client_id)
        columns = [self.column(ctx, t) for t in clients]
        return {"self_weight": omega[index, index].item(), "pull": pull_for(index, omega, columns)}

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)  # the client's own w_i (initial weights before its first visit)
        if "pull" in message:
            client.scratch["fedmtl"] = (message["self_weight"], message["pull"])
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(M2): lam (Omega_ii ||w||^2 + 2 <w, v_i>) + const, client i's part of lam tr(W Omega W^T)."""
        own = client.scratch.get("fedmtl")
        if own is None or model is not client.model:
            return None  # no term
        self_weight, pull = own
        if self_weight <= 0:  # a single client: Omega = 0, no coupling
            return None
        # the square completed, Omega_ii ||w + v_i / Omega_ii||^2: the same gradient, never negative
        # (the logged training loss stays a loss); for this Omega, (1 - 1/m) ||w - mean of the others||^2
        return self.params.lam * self_weight * sum(
            ((p + pull[n] / self_weight) ** 2).sum() for n, p in model.named_parameters())

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)  # (M3) the client's own model, kept even if lost
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": {n: p.detach() for n, p in client.model.named_parameters()}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(M4): the delivered models replace their columns, after the round (every v_i used W^{k-1})."""
        received = {i: clone_state(message["weights"]) for i, message in uploads}
        ctx.server["columns"].update(received)
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}


__all__ = ["FedMTL", "FedMTLParams", "pull_for", "relationship"]
