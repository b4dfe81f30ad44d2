"""FedCAC: Wu, Liu, Niu, Zhu and Tang, "Bold but Cautious: Unlocking the Potential of Personalized
Federated Learning through Cautiously Aggressive Collaboration", ICCV 2023 (arXiv:2309.11103).

What was read: the paper's abstract only (its method section, equations and algorithm box could
not be read from this machine), so the step labels (S1)-(S5) below are ours, and every detail
follows the two reference implementations, read in full (not copied): the authors' own code in
Fling (github.com/FLAIR-Community/Fling, ``fling/component/client/fedcac_client.py`` at
15409a1041f1572d2d365e6213c1561426039874, ``fling/component/group/fedcac_group.py`` at
14d18bf91d64d0eebf57d1a3788fd576af319577, ``argzoo/cifar10/cifar10_fedcac_resnet_config.py``) and
PFLlib (github.com/TsingZ0/PFLlib at d832e76f6a23b833038949ec1e4fdefe63a4d350,
``system/flcore/clients/clientcac.py`` and ``system/flcore/servers/servercac.py``). FL-bench has
no FedCAC.

Each client i has a critical mask m_i (which of its parameters are sensitive to its own data)
and a customised global model u_i; the server keeps the global model w. Client i starts a
round from

    w_i = m_i * u_i + (1 - m_i) * w                                                  (on_broadcast)

(the plain w before its first upload arrives), and then:

    (S1) local training: training.local_epochs epochs of the configured optimiser from w_i,
         giving w_i'                                                                   (local_train)
    (S2) sensitivity s = |(w_i' - w_i) * w_i'| entry by entry; in each parameter tensor of n
         entries the k = int(tau n) largest are critical: m_i = s >= s_(k), the k-th largest
         (ties included); k = 0 selects none. When s_(k) <= 1e-10 (most of the tensor did not
         move) the critical entries are those with s > 1e-20. The client uploads w_i' and m_i
         (one bit per entry).                                                        (client_upload)
    server, over the round's arrived uploads A (at least two):                     (server_aggregate)
    (S3) overlap o_ij = 1 - |m_i - m_j|_1 / (2 |m_i|_1) for i != j in A (not symmetric);
         o_ij = 0 when m_i is empty
    (S4) threshold T_t = mean(o) + t / beta * (max(o) - mean(o)), t = the round (1, 2, ...),
         mean and max over the ordered pairs; client i's collaborators C_i = {i} + {j : o_ij >= T_t}.
         As t grows T_t rises to max(o) (reached at t = beta) and beyond: critical parameters are
         shared widely at first, then only with the most similar clients, then not at all.
         When every mask has the same size (exactly k entries per tensor, no ties) o is
         symmetric, and with two arrivals mean = max: the two always share.
    (S5) u_i = (1 / |C_i|) sum_{j in C_i} w_j' (uniform), and m_i stored, for every i in A;
         w = sum_{j in A} p_j w_j', p_j = client_weighting's weights (train sizes, renormalised
         over the arrivals). With one arrival, u_i = w_i'.

What is evaluated: client i on w_i of the current w, u_i and m_i (the model it would start its
next round from, the model both references test), with its own BatchNorm statistics, without
local steps. Cold-start clients (held out) have no mask: they receive w and fine-tune it
(experiment.coldstart_epochs, the core default).

Defaults: ``tau = 0.5`` and ``beta = 100`` (Fling's CIFAR-10 config: 300 rounds there). With
fewer rounds than beta the threshold stays below the largest overlap throughout; beta = rounds
lets it reach it at the last round. ``tau = 0`` selects no critical parameter: every client
starts from w, which is then FedAvg's model bit for bit (for a model without buffers).

Decisions and deviations:

- The round schedule (S4) is Fling's, the authors': round t uses t / beta from the first
  aggregation on. PFLlib skips the customisation after its first round and then loads the
  untrained initial weights (its ``customized_model`` placeholder) into every critical entry;
  that is not followed.
- Partial participation (PFLlib's; Fling trains every client every round): overlaps, the
  threshold and the customised models are computed over the round's arrived uploads only. A
  client that does not take part keeps its last m_i and u_i, and its non-critical entries follow
  the current w.
- Where the mask lives: both references keep m_i on the client and send it w and u_i (two
  models down). Here the upload carries m_i and the server keeps it beside u_i, so the server
  sends the merged w_i (one model down) and m_i and u_i always come from the same delivered
  round. A lost upload (``dropout`` add-on) changes nothing on the server (m_i, u_i and w stay);
  the client keeps its BatchNorm statistics (its own), so nothing is staged
  (docs/writing-a-plugin.md, "Client state and lost uploads").
- A parameter tensor that did not move at all (every s = 0): the references select all of it
  (threshold 0, s >= 0); here none (nothing in it is sensitive). An empty mask gets overlap 0
  with everyone (the references divide by zero).
- Buffers (BatchNorm's running statistics) are not aggregated: each client keeps its own, from
  the initial ones, as in both references (they assign parameters only).
- Only one architecture (the mask and the averages are entry by entry).
- Bytes: w_i down; w_i' and m_i (1 bit per parameter) up. The server holds w, and u_i and m_i
  for every client that has uploaded.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    KeepsOwnEntries,
    Packed,
    at_least,
    between,
    hookimpl,
    per_run,
    require_single_architecture,
    weighted_average,
)

ZERO_SENSITIVITY = 1e-10  # a k-th largest sensitivity at or below this counts as "did not move" (S2)
NONZERO_SENSITIVITY = 1e-20  # ... and then the critical entries are those above this


@define
class FedCACParams:
    tau: float = field(default=0.5, validator=between(0, 1), metadata={
        "doc": "fraction of each parameter tensor's entries, by sensitivity |(w' - w) * w'|, that are the "
               "client's critical parameters (S2); 0 selects none (FedAvg). Default: Fling's 0.5"})
    beta: int = field(default=100, validator=at_least(1), metadata={
        "doc": "rounds over which the collaboration threshold rises from the mean overlap to the largest, "
               "T_t = mean + t / beta (max - mean) (S4); past it the critical parameters stay local. "
               "Default: Fling's CIFAR-10 100"})


def critical_mask(start: torch.Tensor, trained: torch.Tensor, tau: float) -> torch.Tensor:
    """(S2) for one parameter tensor: the bool mask of its critical entries."""
    sensitivity = ((trained - start) * trained).abs().flatten()
    k = int(tau * sensitivity.numel())
    if k == 0:
        return torch.zeros_like(trained, dtype=torch.bool)
    kth = torch.topk(sensitivity, k).values[-1]
    if kth > ZERO_SENSITIVITY:
        chosen = sensitivity >= kth
    else:  # most entries did not move: every entry that did
        chosen = sensitivity > NONZERO_SENSITIVITY
    return chosen.view_as(trained)


def overlap_rates(masks: list[dict[str, torch.Tensor]]) -> list[list[float | None]]:
    """(S3) o[a][b] = 1 - |m_a - m_b|_1 / (2 |m_a|_1) for a != b (None on the diagonal); 0 for an
    empty m_a. Counts are exact integers."""
    flat = [torch.cat([m.flatten() for m in mask.values()]) for mask in masks]
    sizes = [int(m.sum()) for m in flat]
    rates: list[list[float | None]] = []
    for a, mine in enumerate(flat):
        row = []
        for b, other in enumerate(flat):
            if a == b:
                row.append(None)
            elif sizes[a] == 0:
                row.append(0.0)
            else:
                row.append(1.0 - int((mine != other).sum()) / (2 * sizes[a]))
        rates.append(row)
    return rates


def collaborators(rates: list[list[float | None]], round: int, beta: int) -> tuple[list[list[int]], float | None]:
    """(S4) each client's collaborators (itself first, then the others in order) and T_t (None
    for a single client, whose only collaborator is itself)."""
    n = len(rates)
    if n < 2:
        return [[a] for a in range(n)], None
    pairs = [rates[a][b] for a in range(n) for b in range(n) if a != b]
    mean, largest = sum(pairs) / len(pairs), max(pairs)
    threshold = mean + round / beta * (largest - mean)
    return [[a] + [b for b in range(n) if b != a and rates[a][b] >= threshold] for a in range(n)], threshold


def start_model(global_weights, customized, mask):
    """w_i = m_i * u_i + (1 - m_i) * w, entry by entry; w itself for a client without a mask."""
    if mask is None:
        return global_weights
    return {k: torch.where(mask[k], customized[k], w) for k, w in global_weights.items()}


class FedCAC(KeepsOwnEntries):
    """FedCAC (Wu et al. 2023): each client's most sensitive parameters (its critical ones) come
    from the mean of the clients whose critical parameters overlap its own, the rest from the
    global model; the overlap threshold rises over the rounds (see the module doc)."""

    name = "fedcac"
    Params = FedCACParams

    def kept_keys(self, ctx, arch: str) -> list[str]:
        """The state-dict keys each client keeps for itself (buffers)."""
        def compute():
            model = ctx.models.working(arch)
            params = {n for n, _ in model.named_parameters()}
            return [k for k in model.state_dict() if k not in params]
        return per_run(ctx, self, f"kept:{arch}", compute)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        initial = ctx.models.initial_state(arch)
        names = [n for n, _ in ctx.models.working(arch).named_parameters()]
        ctx.server["global"] = {n: initial[n].detach().clone().to(ctx.device) for n in names}
        ctx.server["customized"] = {}  # u_i, from client i's first arrived upload on
        ctx.server["critical"] = {}  # m_i, likewise

    def model_for(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        return start_model(ctx.server["global"], ctx.server["customized"].get(client_id),
                           ctx.server["critical"].get(client_id))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"weights": self.model_for(ctx, client_id)}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        ids, trained, masks = [], [], []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            ids.append(client_id)
            trained.append({k: v.detach().clone().to(ctx.device) for k, v in message["weights"].items()})
            masks.append({k: m.value.to(ctx.device) for k, m in message["critical"].items()})
        if not ids:  # nobody's upload arrived: everything stays
            return True
        groups, threshold = collaborators(overlap_rates(masks), ctx.round, self.params.beta)
        customized, critical = dict(ctx.server["customized"]), dict(ctx.server["critical"])
        for a, group in enumerate(groups):
            customized[ids[a]] = {k: sum(trained[b][k] for b in group) / len(group) for k in trained[a]}
            critical[ids[a]] = masks[a]
        ctx.server["global"] = weighted_average((weights[i], state) for i, state in zip(ids, trained))
        ctx.server["customized"], ctx.server["critical"] = customized, critical
        ctx.log(fedcac_collaborators=sum(len(g) - 1 for g in groups) / len(groups))
        if threshold is not None:
            ctx.log(fedcac_threshold=threshold)
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": self.model_for(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def client_upload(self, ctx, client):
        start, tau = client.scratch["received"], self.params.tau
        params = {n: p.detach() for n, p in client.model.named_parameters()}
        critical = {n: Packed(critical_mask(start[n].to(p.device), p, tau), 1) for n, p in params.items()}
        return {"weights": params, "critical": critical}


__all__ = ["FedCAC", "FedCACParams", "collaborators", "critical_mask", "overlap_rates", "start_model"]
