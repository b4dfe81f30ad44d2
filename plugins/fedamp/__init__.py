"""FedAMP: Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, "Personalized Cross-Silo Federated
Learning on Non-IID Data", AAAI 2021 (arXiv:2007.03797), Algorithm 1 (federated attentive
message passing), with its heuristic for deep networks (HeurFedAMP) as the default.

Every client i keeps a personalized model w_i. The server keeps the latest w_j of every client
and builds, for each participant, a *personalized cloud model* u_i, an attention-weighted
combination of the clients' models in which similar models weigh more:

            U^k = W^{k-1} - alpha_k grad A(W^{k-1}): a gradient step on the attention term
            lambda sum_{i<j} A(||w_i - w_j||^2) of the objective, which per client reads
    Eq. 5   u_i^k = xi_{i,1} w_1^{k-1} + ... + xi_{i,m} w_m^{k-1}, with the weights
            xi_{i,j} = alpha_k A'(||w_i^{k-1} - w_j^{k-1}||^2) (j != i),  xi_{i,i} = 1 - sum_{j != i} xi_{i,j}
            and the negative exponential A(x) = 1 - exp(-x / sigma), A'(x) = exp(-x / sigma) / sigma
            (``attention = "distance"``)
    HeurFedAMP (``attention = "cosine"``, the default): xi_{i,i} is a hyperparameter and
            xi_{i,j} = (1 - xi_{i,i}) exp(sigma cos(w_i, w_j)) / sum_{h != i} exp(sigma cos(w_i, w_h))
    Eq. 6   w_i^k = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i^k||^2     (the client's update)

    server: w_j^0 = the seeded initial weights                                      (setup)
    each round k, for each participant i: u_i^k from Eq. 5 over the stored models   (on_round_start)
        sends u_i^k                                                                (on_broadcast)
        client: w <- u_i^k; training.local_epochs epochs of SGD on
                F_i(w) + lambda / (2 alpha_k) ||w - u_i^k||^2 (Eq. 6)  (on_receive, local_train)
                keeps and uploads w_i^k                                            (client_upload)
        server stores w_i^k                                                        (server_aggregate)
    evaluation: client i's own w_i (the seeded initial weights before it ever trained)

Equation numbers are the AAAI paper's as PFLlib's author cites them (github.com/TsingZ0/PFLlib
issues 4 and 15): Eq. 5, the cloud model with its weights (xi_{i,i} = 1 - sum_{j != i} xi_{i,j}),
and Eq. 6, the client's proximal objective. The message-passing step U^k and HeurFedAMP's rule
are left unnumbered: we could not read the paper's text to check their numbers.

Defaults and decisions:

- ``attention = "cosine"`` (HeurFedAMP, the paper's variant for deep networks, where
  ||w_i - w_j||^2 is so large that exp(-x / sigma) vanishes and Eq. 5 leaves every u_i = w_i);
  ``"distance"`` is Eq. 5 as written. Similarities and distances are over the model's
  parameters (buffers excluded), in float64.
- Cosine: ``alpha_k = 1.0``, ``lam = 1.0`` (the client's proximal weight lambda / alpha_k = 1),
  ``sigma = 1.0``: PFLlib's defaults (``alphaK``, ``lamda``, ``sigma``). alpha_k is constant over
  the rounds, as in PFLlib (the paper allows a schedule). ``xi = 0.1``: xi_{i,i} of the PFLlib
  HeurFedAMP example runs (``-xi 0.1``). With ``xi = 1`` every u_i = w_i and, with ``lam = 0``,
  FedAMP is Local bit for bit (tested).
- Distance: PFLlib's alpha_k = sigma = 1 take the weights off the simplex. A'(x) =
  exp(-x / sigma) / sigma is at most 1 / sigma, reached when two models are close, so
  sum_{j != i} xi_{i,j} can reach alpha_k (N - 1) / sigma and xi_{i,i} 2 - N (-18 at 20
  clients). In round 2 of ``specs/personalized_aggregation.toml`` with ``attention =
  "distance"`` (every model one round from the same start) xi_{i,i} is negative for all 20
  clients, down to -6.8: u_i extrapolates away from the other models. So the variant's
  default ``alpha_k`` is sigma / N (N the training clients): then sum_{j != i} xi_{i,j} <=
  (N - 1) / N and xi_{i,i} >= 1 / N whatever the distances (a newcomer's >= 0), and u_i is a
  convex combination of the models. Its default ``lam`` is alpha_k, so the proximal weight
  lambda / alpha_k stays 1, as with PFLlib's defaults (Eq. 6 couples the two: a smaller
  alpha_k alone would pull every client N times harder towards u_i). A round in which some
  participant's xi_{i,i} is negative (possible once alpha_k > sigma / (N - 1)) prints one
  ``pfl: warning:`` line, once per run.
- The client starts its local update from u_i^k (the proximal point's centre; the paper states
  only the argmin of Eq. 6). PFLlib starts from w_i^{k-1} and adds lambda / (2 alpha_k) ||w - u||
  (a norm, not its square, and of detached tensors, so it adds no gradient) to the loss; we use
  the square of Eq. 6.
- Which models enter Eq. 5: those of the clients that have uploaded at least once (the paper's
  cross-silo setting has every client in every round; with ``experiment.participation < 1`` a
  client that never trained contributes nothing, rather than the initial weights). w_i itself is
  the client's last upload, or the initial weights before its first. If no other client has
  uploaded yet (round 1), u_i = w_i. Uploads of a round are stored after the round's aggregation,
  so every u_i of a round is built from the models of earlier rounds (the paper's W^{k-1}).
- u_i mixes every floating-point state entry (BatchNorm statistics too) with the same xi_{i,j};
  integer entries (``num_batches_tracked``) are w_i's. In the distance variant xi_{i,i} can be
  negative when alpha_k / sigma is large: Eq. 5 as written, not clipped (but warned, above).
- xi_{i,i} is logged per client as ``fedamp_self_weight``.
- Bytes: u_i down, w_i up (one model each way).
- Cold start: the newcomer receives u_n built as for a participant with w_n = the initial weights,
  and trains ``experiment.coldstart_epochs`` epochs on Eq. 6 from it.
"""

from __future__ import annotations

import math

import torch
from attrs import define, field

from attrs import evolve

from pfl_core.api import (
    Plugin,
    at_least,
    between,
    clone_state,
    finite,
    greater_than,
    hookimpl,
    load_personal,
    load_state,
    one_of,
    per_run,
    proximal_term,
    require_single_architecture,
    warning_line,
)


@define
class FedAMPParams:
    attention: str = field(default="cosine", validator=one_of("cosine", "distance"), metadata={
        "doc": 'xi_{i,j} from exp(sigma cos(w_i, w_j)) with xi_{i,i} = xi (HeurFedAMP, for deep networks); '
               '"distance": the weights of Eq. 5, alpha_k A\'(||w_i - w_j||^2) with A(x) = 1 - exp(-x / sigma)'})
    alpha_k: float | None = field(default=None, validator=[finite, greater_than(0)], metadata={
        "doc": "alpha_k: the message-passing step size (Eq. 5) and the proximal weight's denominator lambda / "
               "(2 alpha_k) (Eq. 6); constant over rounds. Unset: 1.0 for cosine (PFLlib's); sigma / N for distance, "
               "N the training clients, which keeps every xi_{i,i} >= 1/N (PFLlib's 1.0 lets it reach 2 - N)"})
    lam: float | None = field(default=None, validator=[finite, at_least(0)], metadata={
        "doc": "lambda of Eq. 6's proximal term lambda / (2 alpha_k) ||w - u_i||^2. Unset: 1.0 for cosine (PFLlib's); "
               "alpha_k for distance, so lambda / alpha_k = 1 as with PFLlib's defaults"})
    sigma: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "sigma: the scale of exp(sigma cos) (cosine) or of A(x) = 1 - exp(-x / sigma) (distance); "
               "PFLlib's default"})
    xi: float = field(default=0.1, validator=[finite, between(0, 1)], metadata={
        "doc": "xi_{i,i}, the weight of the client's own model in u_i (cosine attention only); PFLlib's "
               "HeurFedAMP runs"})


def with_defaults(params: FedAMPParams, num_clients: int) -> FedAMPParams:
    """``params`` with an unset alpha_k and lam filled in: cosine 1.0 and 1.0 (PFLlib's);
    distance alpha_k = sigma / N, the largest constant step that keeps every xi_{i,i} of Eq. 5
    >= 1/N (A' <= 1 / sigma), and lam = alpha_k (the proximal weight lambda / alpha_k = 1)."""
    alpha_k = params.alpha_k
    if alpha_k is None:
        alpha_k = 1.0 if params.attention == "cosine" else params.sigma / num_clients
    lam = params.lam
    if lam is None:
        lam = 1.0 if params.attention == "cosine" else alpha_k
    return evolve(params, alpha_k=alpha_k, lam=lam)


# -- the paper's equations, as plain functions ---------------------------------------------------


def flat(state: dict, names) -> torch.Tensor:
    return torch.cat([state[n].detach().reshape(-1).double() for n in names])


def attention_weights(i, models: dict, own: dict, names, params: FedAMPParams) -> dict:
    """Eq. 5's weights (or HeurFedAMP's rule): ``{j: xi_{i,j}}`` for client i, whose model is ``own``,
    over the other clients' ``models`` (``{j: state}``, i's own entry ignored), i included.
    ``names``: the parameter keys the similarity or distance is computed over; ``params`` with
    alpha_k set (``with_defaults``)."""
    others = [j for j in sorted(models) if j != i]
    if not others:
        return {i: 1.0}
    w_i = flat(own, names)
    if params.attention == "cosine":
        scores = {j: math.exp(params.sigma * float(torch.nn.functional.cosine_similarity(
            w_i, flat(models[j], names), dim=0))) for j in others}
        total = sum(scores.values())
        xi = {j: (1 - params.xi) * scores[j] / total for j in others}
        xi[i] = params.xi
        return xi
    xi = {}
    for j in others:
        distance = float((w_i - flat(models[j], names)).pow(2).sum())  # ||w_i - w_j||^2
        xi[j] = params.alpha_k * math.exp(-distance / params.sigma) / params.sigma  # alpha_k A'(.)
    xi[i] = 1 - sum(xi.values())
    return xi


def cloud_model(xi: dict, models: dict, own: dict, i) -> dict:
    """Eq. 5: u_i = sum_j xi_{i,j} w_j (w_i = ``own``); integer entries are w_i's."""
    out = {}
    for key, value in own.items():
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        total = xi[i] * value
        for j in sorted(xi):
            if j != i:
                total = total + xi[j] * models[j][key]
        out[key] = total
    return out


# -- the plugin ---------------------------------------------------------------------------------


class FedAMP(Plugin):
    """FedAMP (Huang et al. 2021): the server builds for each participant a personalized cloud
    model u_i, the attention-weighted sum of all clients' models (similar models weigh more);
    the client trains its own model from u_i with a proximal term towards it; each client is
    scored with its own model. One model down, one up."""

    name = "fedamp"
    Params = FedAMPParams

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        ctx.server["models"] = {}  # w_j: the last upload of every client that has uploaded

    def settings(self, ctx) -> FedAMPParams:
        """The parameters with the variant's defaults filled in (N: the training clients)."""
        if self.params.alpha_k is not None and self.params.lam is not None:
            return self.params  # nothing left to fill in
        return per_run(ctx, self, "settings", lambda: with_defaults(self.params, len(ctx.training_clients)))

    def parameter_names(self, ctx, arch: str) -> list[str]:
        return per_run(ctx, self, f"names:{arch}", lambda: [n for n, _ in ctx.models.build(arch).named_parameters()])

    def cloud_model_for(self, ctx, client_id) -> tuple[dict, float]:
        """Eq. 5 for one client over the stored models (server side): (u_i, xi_{i,i})."""
        models, arch = ctx.server["models"], ctx.models.arch_of(client_id)
        own = models.get(client_id) or ctx.models.initial_state(arch)
        xi = attention_weights(client_id, models, own, self.parameter_names(ctx, arch), self.settings(ctx))
        return cloud_model(xi, models, own, client_id), xi[client_id]

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        cloud = {i: self.cloud_model_for(ctx, i) for i in participants}
        ctx.server["u"] = {i: u for i, (u, _) in cloud.items()}  # this round's cloud models, until aggregation
        for i, (_, self_weight) in cloud.items():
            ctx.log_client(i, fedamp_self_weight=self_weight)
        negative = [w for _, w in cloud.values() if w < 0]
        if negative:
            self.warn_outside_the_simplex(ctx, round, len(negative), min(negative))

    def warn_outside_the_simplex(self, ctx, round, count: int, lowest: float) -> None:
        """Once per run: a negative xi_{i,i} makes u_i extrapolate instead of averaging."""
        warned = per_run(ctx, self, "simplex_warned", list)
        if warned:
            return
        warned.append(round)
        p, n = self.settings(ctx), len(ctx.training_clients)
        warning_line(f"fedamp: in round {round} the cloud model's own weight xi_ii (Eq. 5) is negative for {count} "
                     f"client(s), down to {lowest:.3g}: the weights leave the simplex and u_i extrapolates away from "
                     f"the other clients' models (alpha_k = {p.alpha_k:g}, sigma = {p.sigma:g}, {n} clients); "
                     f"algorithm.params.alpha_k <= sigma / (N - 1) = {p.sigma / max(n - 1, 1):.3g} keeps them inside "
                     f"(unset, it is sigma / N)")

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        u = ctx.server.get("u", {}).get(client_id)
        return {"u": u if u is not None else self.cloud_model_for(ctx, client_id)[0]}  # a newcomer's

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["u"])  # start from u_i^k
        client.scratch["u"] = [p.detach().clone() for p in client.model.parameters()]
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """Eq. 6's lambda / (2 alpha_k) ||w - u_i||^2 (None outside a visit: no term)."""
        anchor = client.scratch.get("u")
        if anchor is None:
            return None
        settings = self.settings(ctx)
        return proximal_term(model, anchor, settings.lam / settings.alpha_k)

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)  # w_i^k, the client's personalized model
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": client.model.state_dict()}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        received = {i: clone_state(message["weights"]) for i, message in uploads}
        ctx.server["models"].update(received)  # after the round: every u_i of a round used W^{k-1}
        ctx.server.pop("u", None)  # the round's cloud models are not kept
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}


__all__ = ["FedAMP", "FedAMPParams", "attention_weights", "cloud_model", "with_defaults"]
