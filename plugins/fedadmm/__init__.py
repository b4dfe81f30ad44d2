"""FedADMM: Gong, Li and Freris, "FedADMM: A Robust Federated Deep Learning Framework with
Adaptivity to System Heterogeneity", ICDE 2022 (arXiv:2204.03529); the inexact-ADMM view of
Zhou and Li, "Federated learning via inexact ADMM".

Only the abstract of the paper could be read here, not its algorithm box or equations: the steps
below are the consensus ADMM the abstract describes (dual variables, augmented Lagrangian,
variable local work), checked against the reference implementation of FL-bench
(github.com/KarhouTam/FL-bench at commit 06e658bca5af6ce732e25bb7c0f8be321e14a85e,
src/client/fedadmm.py and src/server/fedadmm.py). The step labels (A1)-(A4) are ours.

Each client i keeps a dual variable y_i and its last augmented model s_i = w_i + y_i / rho; the
server keeps theta. With w_i^0 = theta^0 and y_i^0 = 0, so s_i^0 = theta^0:

    server: theta^0 = the seeded initial weights                                      (setup)
    each round k, each participant i, given theta^k:                          (on_broadcast)
      (A1) w_i^{k+1} ~ argmin_w f_i(w) + <y_i^k, w - theta^k> + rho/2 ||w - theta^k||^2
           (training.local_epochs epochs of the configured optimiser; the two terms are a
            local_objective, their gradient y_i^k + rho (w - theta^k))   (on_receive, local_objective)
      (A2) y_i^{k+1} = y_i^k + rho (w_i^{k+1} - theta^k)                             (client_upload)
      (A3) Delta_i = s_i^{k+1} - s_i^k, s_i^{k+1} = w_i^{k+1} + y_i^{k+1} / rho: sent instead
           of the weights (the same size); y_i and s_i kept only if it arrives (client.staged)
      (A4) theta^{k+1} = theta^k + eta * sum_{i in S_k} p_i Delta_i                 (server_aggregate)
           weighting = "all": p_i = 1/m, m the training clients. At eta = 1 this is ADMM's
             consensus step theta = (1/m) sum_{i=1..m} (w_i + y_i / rho) over every client,
             the ones not in S_k contributing their last s_i (the brief's "the server
             aggregates w_i + y_i / rho"); theta stays that mean after every round.
           weighting = "participants": p_i = n_i / n over the uploads that arrived (FL-bench's
             weighted mean of the participants' updates).

What is evaluated: every client on theta^k, the server model (FedADMM trains one global model;
y_i and s_i only steer training and aggregation).

Deviations:

- From FL-bench: its Delta uses the received theta^k as "previous model", so its Delta is
  (w - theta^k) + (y^{k+1} - y^k) / rho = 2 (w - theta^k): the dual never enters the server
  step, which becomes FedAvg's with a doubled step. Here Delta is the change of the client's own
  s_i, so the server model is the mean of w_i + y_i / rho (A4). FL-bench's default p_i is the
  participants' sample weighting (``weighting = "participants"`` here); ADMM's 1/m is the default.
- FL-bench draws each client's local epochs uniformly in 1..E (system heterogeneity) unless
  ``fixed = 1``; here the epochs are ``training.local_epochs``, and variable work is the
  ``stragglers`` add-on's (any method's). FL-bench's schedule eta -> eta_2 after a target round
  is not offered (one eta).
- The dual, the penalty and Delta exist for the model's parameters only; buffers (BatchNorm's
  statistics) are uploaded as values and averaged with the participants' n_i / n, as FedAvg.
- A lost upload (``dropout``): the client trained (its work counts), but y_i and s_i stay as they
  were, because the server never added its Delta_i: theta stays the mean of the s_i.
- A cold-start client (``experiment.coldstart_clients``) fine-tunes theta with the plain loss,
  as FedAvg's newcomers: it has no dual and its visit is not a round.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import WeightAveraging, finite, greater_than, hookimpl, one_of, proximal_term


@define
class FedADMMParams:
    rho: float = field(default=0.01, validator=[finite, greater_than(0)], metadata={
        "doc": "penalty rho of the augmented Lagrangian <y_i, w - theta> + rho/2 ||w - theta||^2 (A1) and the "
               "dual step y_i += rho (w_i - theta) (A2). Default: FL-bench's 0.01"})
    eta: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "server step size eta of theta += eta sum_i p_i Delta_i (A4); 1 is ADMM's consensus step"})
    weighting: str = field(default="all", validator=one_of("all", "participants"), metadata={
        "doc": 'p_i of (A4): "all" is 1/m over the m training clients (theta = mean of every client\'s '
               'w_i + y_i/rho at eta = 1), "participants" is n_i / n over the uploads that arrived (FL-bench)'})


class FedADMM(WeightAveraging):
    """FedADMM (Gong et al. 2022): clients minimise their loss plus <y_i, w - theta> +
    rho/2 ||w - theta||^2, step their dual y_i, and send the change of w_i + y_i / rho, which the
    server adds to theta."""

    name = "fedadmm"
    Params = FedADMMParams

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # w <- theta^k
        if client.id not in ctx.participants:  # a cold-start client: plain fine-tuning
            return True
        theta = message["weights"]
        names = [n for n, _ in client.model.named_parameters()]
        dual = client.state.get("dual") or {n: torch.zeros_like(theta[n]) for n in names}
        # s_i^0 = w_i^0 + 0 = theta^0: the seeded initial weights every client starts from
        augmented = client.state.get("augmented") or {
            n: ctx.models.initial_state(client.arch)[n].clone() for n in names}
        client.scratch["fedadmm"] = {"theta": theta, "anchor": [theta[n] for n in names], "dual": dual,
                                     "augmented": augmented}
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(A1): <y_i, w - theta> + rho/2 ||w - theta||^2, added to the core's cross-entropy."""
        own = client.scratch.get("fedadmm")
        if own is None or model is not client.model:
            return None  # no term
        theta, dual = own["theta"], own["dual"]
        linear = sum((dual[n] * (p - theta[n])).sum() for n, p in model.named_parameters())
        return linear + proximal_term(model, own["anchor"], self.params.rho)

    @hookimpl
    def client_upload(self, ctx, client):
        """(A2) and (A3): the new dual and augmented model, kept once the upload arrives; send Delta_i."""
        own = client.scratch["fedadmm"]
        theta, dual, augmented, rho = own["theta"], own["dual"], own["augmented"], self.params.rho
        params = dict(client.model.named_parameters())
        new_dual = {n: dual[n] + rho * (p.detach() - theta[n]) for n, p in params.items()}
        new_augmented = {n: p.detach() + new_dual[n] / rho for n, p in params.items()}
        client.staged["dual"] = new_dual
        client.staged["augmented"] = new_augmented
        state = client.model.state_dict()
        return {"delta": {n: new_augmented[n] - augmented[n] for n in params},
                "buffers": {k: v for k, v in state.items() if k not in params}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(A4): theta^{k+1} = theta^k + eta sum_i p_i Delta_i; buffers: the arrivals' n_i / n mean."""
        theta = ctx.server["global"]
        step: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        arrived = 0.0  # the weights of the uploads that arrived, to normalise over them
        for i, message in uploads:  # one upload at a time: each is valid until the next client runs
            p = 1.0 if self.params.weighting == "all" else weights[i]
            for name, delta in message["delta"].items():
                step[name] = step[name] + p * delta if name in step else p * delta
            for name, value in message["buffers"].items():
                if not value.is_floating_point():  # num_batches_tracked: the first arrival's, as FedAvg
                    buffers.setdefault(name, value.clone())
                else:
                    buffers[name] = buffers[name] + weights[i] * value if name in buffers else weights[i] * value
            arrived += weights[i]
        if not step:  # nobody's upload arrived: theta stays
            return True
        norm = len(ctx.training_clients) if self.params.weighting == "all" else arrived
        eta = self.params.eta
        new = {}
        for key, value in theta.items():
            if key in step:
                new[key] = value + eta / norm * step[key]
            elif key in buffers:
                new[key] = buffers[key] / arrived if buffers[key].is_floating_point() else buffers[key]
            else:
                new[key] = value
        ctx.server["global"] = new
        return True


__all__ = ["FedADMM", "FedADMMParams"]
