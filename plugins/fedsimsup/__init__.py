"""FedSimSup: Li et al., "Federated learning by considering data Similarity across clients
assisted by a local Supervisor" (seeds/fedsimsup.txt), Algorithm 1; METHODS.md, FedSimSup.

Client i holds an inter-learning model theta_i (uploaded) and a supervisor s_i (never
leaves the client, any architecture). The prediction is the sum of the two logits (Eq. 3)
and the objective is the cross-entropy of that sum.

    setup: every client sends its label-proportion vector p_i once; the server computes
           s_ij = cos(p_i, p_j) and keeps one theta_i per client             (Sec. 3.3)
    each round t: N(t) = max(1, round(r n)) clients, K = |N(t)|             (engine: select_clients)
      participant i: theta_i^{t,0} <- server's theta_i                     (Alg. 1 line 7)
        tau_s epochs of SGD on s_i, theta_i frozen                          (Eq. 11)
        tau_theta epochs of SGD on theta_i, s_i frozen                      (Eq. 12)
        upload theta_i; keep s_i
      server: participants: theta_i <- their upload, unchanged              (Eq. 6)
        non-participant i:
          theta_i <- (1 - a_i) theta_i + a_i sum_{j in N(t)} s_ij / sum_j s_ij theta_j   (Eq. 7)
          a_i = lambda_i beta_t                                             (Eq. 8)
          lambda_i = sum_{j in N} m_j / (sum_{j in N} m_j + K m_i)           (Eq. 9)
          beta_t = 1 if t < C T^gamma else (C T^gamma / t)^2                (Eq. 10)

Decisions where paper and METHODS.md are silent:

- r is the core's ``experiment.participation`` (seeded per round); its spec default is 1.0,
  with which nobody is ever mixed and FedSimSup is local training of the summed model. The
  paper's r = 0.1 is set in the specs.
- tau_s = tau_theta = 1 by default: the paper's training details (appendix 7.3) are not in
  the seed text. Each phase is a full pass over the client's data, so a round costs
  tau_s + tau_theta private epochs (``local_work``); a comparison at equal work gives the
  baselines that many epochs per round (the specs do). ``training.local_epochs`` is not
  used. Both phases use ``training.lr`` and ``training.optimizer`` with a fresh optimiser.
- Default supervisor: ``lenet5`` with ``width = 0.4``: 9,722 parameters against the
  inter-learning LeNet-5's 62,006 on 3x32x32 / 10 classes, a ratio of 0.157 (about 1/6.4;
  width 0.41 gives 0.180). Widths are rounded per layer, so 1/6 exactly is not reachable.
- TCL: ``supervisor_pool`` lists architectures; each client draws one with a seeded RNG
  (seed, "supervisor_arch", client). pfl's zoo has no transformer, so TCL here mixes what
  the zoo has (e.g. lenet5, cnn4, mlp).
- Every supervisor of one architecture starts from the same seeded weights
  (seed, "init:supervisor:<arch>"), like the inter-learning models.
- If sum_j s_ij = 0 (no shared labels with any participant) the weights fall back to data
  sizes m_j / sum m_j. ``weighting = "data_size"`` always uses those ("direct model average as
  in FedAvg", the paper's Fig. 3 ablation); ``"uniform"`` uses 1/K.
- Label proportions (train split) are read by the server in ``setup``, as the paper collects
  them "at the beginning of the entire task". The engine only counts bytes that go through a
  participant's upload, so each client's vector is attached to (and counted in) its first
  upload; a client that never participates has its vector used but never counted.
- Evaluation: client i is scored with the server's current theta_i (the one it would receive
  next, mixed if it sat out) plus its own supervisor.
- Cold start (``experiment.coldstart_clients``; the paper has no newcomer protocol, this
  follows its mixing rule). The newcomer n sends its label-proportion vector p_n once (its
  bytes are added to the upload count), and the server answers with
      theta_n = sum_j s_nj theta_j / sum_j s_nj,   s_nj = cos(p_n, p_j)          (Eq. 7 with a_n = 1)
  over the stored inter-learning models of every training client j (with ``weighting``
  applied as in Eq. 7: all s_nj = 0 falls back to data sizes m_j / sum m). Other newcomers'
  models never enter the mix. The newcomer's supervisor starts from the seeded initial
  supervisor weights. It then trains ``experiment.coldstart_epochs`` epochs in the order of
  the usual local update: tau_s supervisor epochs (theta frozen), tau_theta inter-learning
  epochs (s frozen), repeated, cut off after ``coldstart_epochs`` epochs in all, so a
  newcomer gets the same number of passes over its data as every other method's newcomer
  (with tau_s = tau_theta = 1 and ``coldstart_epochs = 1`` only the supervisor trains; 0
  scores the starting model, the mix plus a fresh supervisor).
- Budget (``local_work``): tau_s + tau_theta private epochs per round; each epoch is one pass
  over the client's train split, whichever part of the summed model it trains.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from attrs import define, field
from torch import nn

from pfl_core.api import (
    MODEL,
    LocalWork,
    Plugin,
    at_least,
    between,
    clone_state,
    derive_seed,
    finite,
    greater_than,
    hookimpl,
    instantiate,
    load_state,
    nbytes,
    numpy_rng,
    one_of,
    require_single_architecture,
    weighted_average,
)

SUPERVISOR_WIDTH = 0.4  # LeNet-5 at width 0.4: 9,722 / 62,006 = 0.157 of the inter-learning model


@define
class FedSimSupParams:
    tau_s: int = field(default=1, validator=at_least(0), metadata={
        "doc": "supervisor epochs a round, theta_i frozen (Eq. 11); training.local_epochs is not used"})
    tau_theta: int = field(default=1, validator=at_least(0), metadata={
        "doc": "then inter-learning epochs, the supervisor frozen (Eq. 12)"})
    C: float = field(default=40.0, validator=[finite, greater_than(0)], metadata={
        "doc": "C of beta_t = 1 if t < C T^gamma else (C T^gamma / t)^2 (Eq. 10)"})
    gamma: float = field(default=3 / 7, validator=[finite, between(0, 1, low_open=True)],
                         metadata={"doc": "gamma of Eq. 10"})
    weighting: str = field(default="similarity", validator=one_of("similarity", "data_size", "uniform"),
                           metadata={"doc": "weights of the participants' models in a non-participant's mix "
                                            "(Eq. 7): label-proportion cosine similarity, m_j / sum m, or 1/K"})
    supervisor: str = field(default="lenet5", metadata={
        "doc": "every client's supervisor architecture (a model plugin)"})
    supervisor_pool: list[str] = field(factory=list, metadata={
        "doc": "TCL: if not empty, each client draws its supervisor's architecture from these (seeded)"})
    supervisor_arch_params: dict[str, dict[str, Any]] = field(
        factory=lambda: {"lenet5": {"width": SUPERVISOR_WIDTH}}, metadata={
            "doc": "the supervisor architectures' parameters, by name (a table given replaces the default)"})


# -- the paper's equations, as plain functions ------------------------------------------


def label_proportions(counts) -> np.ndarray:
    """p_i = |D_i^c| / |D_i| per class c (rows of ``counts``; an empty row stays 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1)


def cosine_similarity(proportions: np.ndarray) -> np.ndarray:
    """s_ij = <p_i, p_j> / (|p_i| |p_j|) for the rows of ``proportions`` (Sec. 3.3)."""
    p = np.asarray(proportions, dtype=np.float64)
    norms = np.linalg.norm(p, axis=1)
    norms[norms == 0] = 1.0
    unit = p / norms[:, None]
    return unit @ unit.T


def beta_schedule(t: int, T: int, C: float, gamma: float) -> float:
    """beta_t = 1 if t < C T^gamma else (C T^gamma / t)^2 (Eq. 10)."""
    boundary = C * T**gamma
    return 1.0 if t < boundary else (boundary / t) ** 2


def lambdas(sizes, participants, clients) -> dict[int, float]:
    """lambda_i = sum_{j in N} m_j / (sum_{j in N} m_j + K m_i) for each i in ``clients`` (Eq. 9)."""
    total = float(sum(sizes[j] for j in participants))
    k = len(participants)
    return {i: total / (total + k * float(sizes[i])) for i in clients}


def mixing_weights(i, participants, similarity, sizes, weighting="similarity") -> dict[int, float]:
    """The weights of the participants' models in non-participant i's mix (Eq. 7)."""
    if weighting == "uniform":
        return {j: 1.0 / len(participants) for j in participants}
    if weighting == "similarity":
        total = float(sum(similarity[i][j] for j in participants))
        if total > 0:
            return {j: float(similarity[i][j]) / total for j in participants}
    total = float(sum(sizes[j] for j in participants))  # data_size, or no similar participant
    return {j: float(sizes[j]) / total for j in participants}


def mix_non_participants(thetas, participants, similarity, sizes, beta, weighting="similarity"):
    """Eq. 7 in place on ``thetas`` ({client: state}); participants are left as they are.

    Returns {client: a_i} for the mixed clients."""
    if not participants:
        return {}
    others = [i for i in thetas if i not in set(participants)]
    lam = lambdas(sizes, participants, others)
    alphas = {}
    for i in others:
        a = lam[i] * beta
        w = mixing_weights(i, participants, similarity, sizes, weighting)
        new = {}
        for key, own in thetas[i].items():
            if not own.is_floating_point():
                new[key] = own
                continue
            mix = sum(w[j] * thetas[j][key] for j in participants)
            new[key] = (1 - a) * own + a * mix
        thetas[i] = new
        alphas[i] = a
    return alphas


def coldstart_schedule(tau_s: int, tau_theta: int, epochs: int) -> list[tuple[str, int]]:
    """The first ``epochs`` epochs of the local update repeated (tau_s on "s", then tau_theta
    on "theta", then again), as [(part, consecutive epochs), ...]."""
    cycle = ["s"] * tau_s + ["theta"] * tau_theta
    if not cycle:
        return []
    plan: list[tuple[str, int]] = []
    for e in range(epochs):
        part = cycle[e % len(cycle)]
        if plan and plan[-1][0] == part:
            plan[-1] = (part, plan[-1][1] + 1)
        else:
            plan.append((part, 1))
    return plan


# -- the summed model ----------------------------------------------------------------------


class Summed(nn.Module):
    """logits(theta, x) + logits(s, x) (Eq. 3)."""

    def __init__(self, inter: nn.Module, supervisor: nn.Module):
        super().__init__()
        self.inter = inter
        self.supervisor = supervisor

    def forward(self, x):
        return self.inter(x) + self.supervisor(x)


def supervisor_arch(ctx, client_id: int) -> str:
    pool = ctx.params.supervisor_pool
    if not pool:
        return ctx.params.supervisor
    rng = numpy_rng(ctx.spec.experiment.seed, "supervisor_arch", 0, client_id)
    return pool[int(rng.integers(len(pool)))]


def supervisor_plugin(params, arch: str, spec_path: str):
    key = f"{spec_path}.params.supervisor"
    if params.supervisor_pool:
        key = f"{spec_path}.params.supervisor_pool[{params.supervisor_pool.index(arch)}]"
    plugin = instantiate(MODEL, arch, params.supervisor_arch_params.get(arch, {}), key,
                         f"{spec_path}.params.supervisor_arch_params.{arch}")
    plugin.name_path = key
    return plugin


def build_supervisor(ctx, arch: str, spec_path: str) -> nn.Module:
    """A supervisor of ``arch`` with the run's seeded initial supervisor weights."""
    plugin = supervisor_plugin(ctx.params, arch, spec_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(ctx.spec.experiment.seed, f"init:supervisor:{arch}"))
        return plugin.build(ctx.models.input_shape, ctx.num_classes).to(ctx.device)


class FedSimSup(Plugin):
    name = "fedsimsup"
    Params = FedSimSupParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(self.params.tau_s + self.params.tau_theta))  # Eq. 11 + Eq. 12 epochs

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)  # Eq. 7 averages inter-learning models
        for arch in self.params.supervisor_pool or [self.params.supervisor]:
            supervisor_plugin(self.params, arch, self.spec_path)  # unknown name: SpecError at its key

    @hookimpl
    def setup(self, ctx):
        clients = ctx.training_clients
        arch = ctx.models.arch_of(clients[0])
        m = {i: ctx.data.clients[i].num_train for i in clients}
        proportions = label_proportions(
            np.stack([ctx.data.clients[i].label_counts("train", ctx.num_classes) for i in clients]))
        sim = cosine_similarity(proportions)
        ctx.server["theta"] = {i: clone_state(ctx.models.initial_state(arch)) for i in clients}
        ctx.server["similarity"] = {i: {j: float(sim[a, b]) for b, j in enumerate(clients)}
                                    for a, i in enumerate(clients)}
        ctx.server["sizes"] = m
        ctx.server["proportions"] = {i: proportions[a] for a, i in enumerate(clients)}
        for a in {supervisor_arch(ctx, i) for i in clients}:
            build_supervisor(ctx, a, self.spec_path)  # fails early if it cannot take this data

    def _supervisor(self, ctx, client) -> nn.Module:
        module = build_supervisor(ctx, supervisor_arch(ctx, client.id), self.spec_path)
        if "supervisor" in client.state:
            load_state(module, client.state["supervisor"])
        return module

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        if client_id in ctx.server["theta"]:
            return {"theta": ctx.server["theta"][client_id]}  # Alg. 1 line 7
        # A cold-start client first sends p_n (once, counted up like a training client's first
        # upload; the server reads it from the data as setup does p_j), then gets its similarity mix.
        p_new = torch.as_tensor(own_proportions(ctx, ctx.data.clients[client_id]), dtype=torch.float32)
        ctx.comm_up += nbytes({"label_proportions": p_new})
        ctx.server.setdefault("newcomer_proportions", {})[client_id] = p_new.double().numpy()
        return {"theta": newcomer_theta(ctx, client_id)}

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["theta"])
        client.scratch["supervisor"] = self._supervisor(ctx, client)  # s_i^{t,0} <- s_i^{t-1,tau_s}
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = local_update(client, [("s", self.params.tau_s), ("theta", self.params.tau_theta)])
        client.state["supervisor"] = clone_state(client.scratch["supervisor"])  # kept locally, never uploaded
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        upload = {"theta": client.model.state_dict()}
        if not client.state.get("proportions_sent"):  # p_j once, in the client's first upload
            upload["label_proportions"] = torch.as_tensor(own_proportions(ctx, client.data), dtype=torch.float32)
            client.state["proportions_sent"] = True
        return upload

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        thetas = ctx.server["theta"]
        participants = []
        for j, message in uploads:
            thetas[j] = clone_state(message["theta"])  # Eq. 6: kept as uploaded
            participants.append(j)  # its p_j (first upload only) equals setup's, computed from the data
        p = self.params
        beta = beta_schedule(ctx.round, ctx.spec.experiment.rounds, p.C, p.gamma)
        alphas = mix_non_participants(thetas, participants, ctx.server["similarity"], ctx.server["sizes"],
                                      beta, p.weighting)
        ctx.log(beta=beta)
        if alphas:
            ctx.log(alpha_mean=float(np.mean(list(alphas.values()))))
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"theta": ctx.server["theta"][client_id]}  # theta_i as the server holds it (Eq. 6-7)

    @hookimpl
    def personalized_models(self, ctx, client, message):
        load_state(client.model, message["theta"])
        return {"": Summed(client.model, self._supervisor(ctx, client))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        """A newcomer: its similarity mix (``message``, after it sent p_n: ``on_broadcast``), then
        training (module docstring)."""
        self.on_receive(ctx, client, message)  # no stored supervisor: the seeded initial one
        p = self.params
        local_update(client, coldstart_schedule(p.tau_s, p.tau_theta, ctx.spec.experiment.coldstart_epochs))
        return {"": Summed(client.model, client.scratch["supervisor"])}


def own_proportions(ctx, data) -> np.ndarray:
    """p_i from one client's own train split (what it uploads once)."""
    return label_proportions(data.label_counts("train", ctx.num_classes))


def local_update(client, phases) -> dict:
    """LocalUpdate of Alg. 1 on the working theta and ``client.scratch["supervisor"]``:
    for each (part, epochs) in ``phases``, SGD on that part of the summed model with the other
    part frozen (Eq. 11 for "s", Eq. 12 for "theta")."""
    theta, sup = client.model, client.scratch["supervisor"]
    model = Summed(theta, sup)
    metrics = {}
    for part, epochs in phases:
        if not epochs:
            continue
        trained, frozen = (sup, theta) if part == "s" else (theta, sup)
        frozen.requires_grad_(False)
        try:
            metrics = client.train(model=model, epochs=epochs, optimizer=client.optimizer(params=trained.parameters()))
        finally:
            frozen.requires_grad_(True)
    return metrics


def newcomer_theta(ctx, client_id: int) -> dict:
    """theta_n = sum_j w_nj theta_j over every training client's stored theta_j, with the Eq. 7
    weights of ``mixing_weights`` (s_nj normalised; data sizes if all s_nj are 0)."""
    stored = ctx.server["theta"]
    clients = list(stored)
    p_new = ctx.server["newcomer_proportions"][client_id]
    sim = cosine_similarity(np.stack([p_new, *(ctx.server["proportions"][j] for j in clients)]))[0, 1:]
    row = {client_id: {j: float(s) for j, s in zip(clients, sim)}}
    w = mixing_weights(client_id, clients, row, ctx.server["sizes"], ctx.params.weighting)
    return weighted_average((w[j], stored[j]) for j in clients)


__all__ = ["FedSimSup", "FedSimSupParams", "beta_schedule", "coldstart_schedule", "cosine_similarity",
           "label_proportions", "lambdas", "local_update", "mix_non_participants", "mixing_weights",
           "newcomer_theta", "Summed"]
