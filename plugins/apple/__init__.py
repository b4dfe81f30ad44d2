"""APPLE: Luo and Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", IJCAI 2022 (arXiv:2110.08394), Algorithm 1.

Every client j trains a *core model* theta_j and shares it. Client i keeps copies of the core
models of all N clients and a directed-relationship (DR) vector p_i = (p_i1, ..., p_iN); its
personalized model is their p_i-weighted sum, and it learns both its own core model and p_i on
its own data:

    Eq. 4      theta-hat_i = sum_j p_ij theta_j                         (the personalized model)
    Eq. 7      loss_i = F_i(theta-hat_i) + mu lambda(r) ||p_i - p_0||^2   (the regularised loss; the
               paper writes lambda(r) mu / 2, the authors' code drops the 1/2: we follow the code)
    App. A.1   lambda(r) = (cos(pi r / L) + 1) / 2  ("cosine")  or  0.001^(r / L)  ("exponential")
               for r < L, 0 afterwards: the loss scheduler, r the round counted from 0 (as the
               authors' code; Algorithm 1 counts rounds from 1)
    Eq. 5-6    per mini-batch:  theta_i <- theta_i - eta grad_{theta_i} loss_i   (= p_ii grad_{theta-hat} F_i)
                                p_i     <- p_i - eta_p grad_{p_i} loss_i,
               d loss_i / d p_ij = <grad_{theta-hat} F_i, theta_j> + 2 mu lambda(r) (p_ij - p_0j);
               the other clients' core models are fixed copies

    server: theta_j^0 = the seeded initial weights for every j                       (setup)
    each round r, each participant i:
        server: sends the core models that changed since i last received them     (on_broadcast)
        client: stores the copies (Algorithm 1, line 5)                             (on_receive)
                training.local_epochs epochs of Eq. 5-6 on Eq. 7, theta-hat_i from Eq. 4
                on its training split (lines 6-9)                                    (local_train)
                uploads its core model theta_i (line 10)                           (client_upload)
        server: stores theta_i                                                   (server_aggregate)
    evaluation: Eq. 4 with the client's p_i, its own core model and the copies it holds

Equation, appendix and line numbers are those of the arXiv version (2110.08394), whose text we
read. The authors' code (github.com/ljaiverson/pFL-APPLE, read, not copied) is the reference for
what the paper leaves open:

- p_0 = p_i's initial value = (n_1, ..., n_N) / n, FedAvg's weights (``prior = "samples"``, the
  authors' ``init_pss``): early on, with lambda(r) near 1, theta-hat_i stays near the global
  model; as lambda(r) decays, p_i is free to personalise. ``"uniform"`` uses 1 / N. p_i is not
  constrained to the simplex (neither is it in their code). N counts the training clients.
- ``mu = 0.1``, ``L = 0.1`` (L as a fraction of experiment.rounds: L_rounds = int(L rounds); their
  ``reg_last_round_over_total_round``), ``schedule = "exponential"``, ``p_lr = 0.001``: the
  authors' defaults. The regulariser is mu lambda(r) ||p_i - p_0||^2, without a 1/2, as their
  ``reg_loss``. With L_rounds = 0 (short runs) the regulariser is off.
- The core model's step is the spec's optimiser at training.lr on grad_{theta_i} = p_ii
  grad_{theta-hat}, the true gradient, as in the authors' code (PFLlib multiplies the step by N
  and replaces the inner product in Eq. 6's gradient by a mean of element-wise means); p_i uses
  the same optimiser kind (momentum included) at ``p_lr``, without weight decay.
- Downloads: the authors' client holds a copy of every core model and downloads all of them in
  each round (or, with limited bandwidth, M of them). Here the server sends participant i every
  other core model that changed since i last received it (full participation: every other core
  model, as theirs; a core model that never changed is the seeded initial weights, which every
  client builds itself, as their code notes). With ``num_downloads = M`` at most M are sent: the
  ones i never received first (in random order), then drawn without replacement with
  probabilities proportional to base^|p_ij|, base = max(1.5, (r M / N)): the authors' rule with
  their ``thresh = 1.5``, ``lamb = 1`` (the paper's Appendix A.2, Eq. 8-9, with r counted from
  0 as in their code); the client then also uploads p_i (N floats, counted) so the server can
  apply it. Their code never marks a model as received, so its "first the models
  never received" branch is all it ever runs; we keep the record.
- Uploads of a round are stored after that round's aggregation: every download of round r is a
  core model of an earlier round.
- BatchNorm statistics of theta-hat are the client's own core model's (updated while it trains);
  integer entries are its own too.
- Bytes: the core models sent (up to N - 1 per participant a round) down, theta_i (and p_i with
  ``num_downloads``) up. Each client stores up to N - 1 copies of core models.
- p_ii is logged per client as ``apple_self_weight``.
- Cold start: the newcomer downloads every training client's core model, starts from Eq. 4 with
  p_0 over the training clients and trains ``experiment.coldstart_epochs`` epochs of plain SGD
  on that model (the DR vector needs the newcomer's own core model, which it does not have).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from attrs import define, field
from torch import nn
from torch.func import functional_call

from pfl_core.api import (
    Plugin,
    at_least,
    between,
    clone_state,
    finite,
    hookimpl,
    learning_rate,
    load_state,
    numpy_rng,
    one_of,
    require_single_architecture,
)

EXPONENTIAL_FLOOR = 0.001  # lambda(L) of the exponential scheduler (the authors' epsilon)
DOWNLOAD_THRESHOLD = 1.5  # the smallest base of base^|p_ij| (the authors' thresh)


@define
class APPLEParams:
    p_lr: float = field(default=0.001, validator=learning_rate, metadata={
        "doc": "step size of the DR vector p_i (Eq. 6); the authors' default"})
    mu: float = field(default=0.1, validator=[finite, at_least(0)], metadata={
        "doc": "mu of the regulariser mu lambda(r) ||p_i - p_0||^2 (Eq. 7, without its 1/2, as the authors' "
               "code); the authors' default"})
    L: float = field(default=0.1, validator=[finite, between(0, 1, low_open=True)], metadata={
        "doc": "the loss scheduler's L (Appendix A.1) as a fraction of experiment.rounds: lambda(r) = 0 from round "
               "int(L rounds) on; the authors' default"})
    schedule: str = field(default="exponential", validator=one_of("exponential", "cosine"), metadata={
        "doc": "the loss scheduler's shape (Appendix A.1): 0.001^(r / L) or (cos(pi r / L) + 1) / 2; the authors' "
               "default"})
    prior: str = field(default="samples", validator=one_of("samples", "uniform"), metadata={
        "doc": "p_0, p_i's start and the regulariser's target: n_j / n (FedAvg's weights, the authors') or 1 / N"})
    num_downloads: int | None = field(default=None, validator=at_least(1), metadata={
        "doc": "at most this many core models sent to a participant a round (the paper's limited bandwidth); "
               "none: every core model that changed"})


# -- the paper's equations, as plain functions ---------------------------------------------------


def scheduler(r: int, rounds: int, params: APPLEParams) -> float:
    """Appendix A.1's loss scheduler lambda(r), r the round counted from 0."""
    horizon = int(rounds * params.L)
    if r >= horizon:
        return 0.0
    if params.schedule == "cosine":
        return (math.cos(math.pi * r / horizon) + 1) / 2
    return EXPONENTIAL_FLOOR ** (r / horizon)


def prior(sizes: list[int], kind: str) -> torch.Tensor:
    """p_0 over the training clients: n_j / n, or 1 / N."""
    if kind == "uniform":
        return torch.full((len(sizes),), 1.0 / len(sizes))
    counts = torch.tensor(sizes, dtype=torch.float64)
    return (counts / counts.sum()).float()


def personalized(p, cores: list[dict], names) -> dict:
    """Eq. 4: sum_j p_j cores[j][name] for each name (``p`` a tensor or a list of numbers)."""
    out = {}
    for name in names:
        total = None
        for j, core in enumerate(cores):
            term = p[j] * core[name]
            total = term if total is None else total + term
        out[name] = total
    return out


class Mixture(nn.Module):
    """Eq. 4 as a module whose parameters are the client's own core model and p_i: the forward
    pass runs the model with theta-hat_i = sum_j p_ij theta_j, so autograd gives the gradients
    of Eq. 5-6 (the other core models are constants)."""

    def __init__(self, model: nn.Module, cores: list[dict], own: int, p: torch.Tensor):
        super().__init__()
        self._model = [model]  # not a submodule
        self.names = [n for n, _ in model.named_parameters()]
        self.own = own
        self.core = nn.ParameterList([nn.Parameter(cores[own][n].detach().clone()) for n in self.names])
        self.p = nn.Parameter(p.detach().clone())
        self.cores = [{n: core[n].detach() for n in self.names} for core in cores]
        self.buffers_ = {k: v.detach().clone() for k, v in cores[own].items() if k not in self.names}

    def own_core(self) -> dict:
        return {n: w for n, w in zip(self.names, self.core)}

    def theta_hat(self) -> dict:
        cores = [self.own_core() if j == self.own else core for j, core in enumerate(self.cores)]
        return personalized(self.p, cores, self.names)

    def core_state(self) -> dict:
        return {**self.buffers_, **{n: w.detach().clone() for n, w in self.own_core().items()}}

    def forward(self, x):
        model = self._model[0]
        model.train(self.training)
        return functional_call(model, {**self.buffers_, **self.theta_hat()}, (x,))


def download_probabilities(magnitudes, r: int, M: int, N: int) -> np.ndarray:
    """The limited-bandwidth draw's probabilities (Appendix A.2, Eq. 9): proportional to
    base^|p_ij|, base = max(1.5, r M / N) (Eq. 8; the authors' rule with their thresh = 1.5,
    lamb = 1)."""
    odds = max(DOWNLOAD_THRESHOLD, r * M / N) ** np.asarray(magnitudes, dtype=np.float64)
    return odds / odds.sum()


def choose_downloads(changed: list, never: set, p: torch.Tensor | None, index: dict, M: int, r: int, N: int,
                     rng: np.random.Generator) -> list:
    """The limited-bandwidth choice: at most M of ``changed``; those in ``never`` (never received)
    first, in random order, then drawn without replacement with probabilities proportional to
    base^|p_ij|, base = max(1.5, r M / N)."""
    if len(changed) <= M:
        return list(changed)
    fresh = [j for j in changed if j in never]
    fresh = [fresh[k] for k in rng.permutation(len(fresh))][:M]
    rest = [j for j in changed if j not in fresh]
    need = M - len(fresh)
    if need <= 0:
        return sorted(fresh)
    magnitude = [abs(float(p[index[j]])) if p is not None else 0.0 for j in rest]
    drawn = rng.choice(len(rest), size=need, replace=False, p=download_probabilities(magnitude, r, M, N))
    return sorted(fresh + [rest[k] for k in drawn])


# -- the plugin ---------------------------------------------------------------------------------


class APPLE(Plugin):
    """APPLE (Luo and Wu 2022): every client trains a core model and a DR vector p_i; its
    personalized model is sum_j p_ij theta_j over copies of every client's core model, with a
    decaying pull of p_i towards FedAvg's weights; each client is scored with that model. Up to
    N - 1 core models down a round, one up."""

    name = "apple"
    Params = APPLEParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    # -- run constants, computed on either side ------------------------------------------------

    def clients(self, ctx) -> list[int]:
        return sorted(ctx.training_clients)

    def p0(self, ctx) -> torch.Tensor:
        return prior([ctx.data.clients[j].num_train for j in self.clients(ctx)], self.params.prior)

    # -- server ----------------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        initial = clone_state(ctx.models.initial_state(ctx.models.arch_of(0)))
        ctx.server["cores"] = {j: initial for j in self.clients(ctx)}
        ctx.server["version"] = {j: 0 for j in self.clients(ctx)}  # the round each core model last changed
        ctx.server["held"] = {}  # {i: {j: the version of theta_j that i holds}}
        ctx.server["p"] = {}  # p_i, uploaded with num_downloads

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        version = ctx.server["version"]
        held = ctx.server["held"].setdefault(client_id, {})
        changed = [j for j in sorted(version) if j != client_id and version[j] > held.get(j, 0)]
        M = self.params.num_downloads
        if M is not None and client_id in version:
            clients = self.clients(ctx)
            changed = choose_downloads(changed, {j for j in changed if j not in held}, ctx.server["p"].get(client_id),
                                       {j: k for k, j in enumerate(clients)}, M, ctx.round - 1, len(clients),
                                       numpy_rng(ctx.spec.experiment.seed, "apple", ctx.round, client_id))
        for j in changed:
            held[j] = version[j]
        return {"cores": {j: ctx.server["cores"][j] for j in changed}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        received = {i: (clone_state(message["core"]), message.get("p")) for i, message in uploads}
        for i, (core, p) in received.items():  # after the round: downloads of round r are older models
            ctx.server["cores"][i] = core
            ctx.server["version"][i] = ctx.round
            if p is not None:
                ctx.server["p"][i] = p.detach().clone()
        return True

    # -- client ----------------------------------------------------------------------------------

    def core_models(self, ctx, client) -> list[dict]:
        """theta_j for every training client j, as client i holds them (its own core model at
        its own place; the seeded initial weights for a model it never received)."""
        initial = ctx.models.initial_state(client.arch)
        copies = client.state.get("copies", {})
        own = client.state.get("core") or initial
        return [own if j == client.id else copies.get(j, initial) for j in self.clients(ctx)]

    def dr_vector(self, ctx, client) -> torch.Tensor:
        p = client.state.get("p")
        return self.p0(ctx) if p is None else p

    def personalized_model(self, ctx, client, cores: list[dict], p) -> nn.Module:
        """Eq. 4 in the working model; buffers and integer entries from the client's own core model."""
        names = [n for n, _ in client.model.named_parameters()]
        own = cores[self.clients(ctx).index(client.id)] if client.id in self.clients(ctx) else cores[0]
        return load_state(client.model, {**own, **personalized(p, cores, names)})

    @hookimpl
    def on_receive(self, ctx, client, message):
        if message["cores"]:
            client.state["copies"] = {**client.state.get("copies", {}), **message["cores"]}
        return True

    @hookimpl
    def local_train(self, ctx, client):
        cores, p0 = self.core_models(ctx, client), self.p0(ctx)
        module = Mixture(client.model, cores, self.clients(ctx).index(client.id), self.dr_vector(ctx, client))
        coefficient = self.params.mu * scheduler(ctx.round - 1, ctx.spec.experiment.rounds, self.params)

        def loss(model, x, y, logits):  # Eq. 7
            return client.objective(model, x, y, logits) + coefficient * (model.p - p0).pow(2).sum()

        optimizer = client.optimizer([{"params": list(module.core)},
                                      {"params": [module.p], "lr": self.params.p_lr, "weight_decay": 0.0}])
        metrics = client.train(model=module, optimizer=optimizer, loss_fn=loss)  # Eq. 5-6
        client.state["core"] = module.core_state()
        client.state["p"] = module.p.detach().clone()
        client.log(apple_self_weight=float(client.state["p"][module.own]))
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        message = {"core": client.state["core"]}
        if self.params.num_downloads is not None:
            message["p"] = client.state["p"]
        return message

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.personalized_model(ctx, client, self.core_models(ctx, client), self.dr_vector(ctx, client))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        initial = ctx.models.initial_state(client.arch)
        cores = [message["cores"].get(j, initial) for j in self.clients(ctx)]
        load_state(client.model, {**initial, **personalized(self.p0(ctx), cores,
                                                            [n for n, _ in client.model.named_parameters()])})
        client.train(epochs=ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}


__all__ = ["APPLE", "APPLEParams", "Mixture", "choose_downloads", "download_probabilities", "personalized", "prior",
           "scheduler"]
