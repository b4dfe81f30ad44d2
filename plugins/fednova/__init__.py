"""FedNova: Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020: normalised averaging (Section 5).

    server: x_0 initialised
    each round t: S sampled; x_t sent to each i in S                    (select_clients, on_broadcast)
      client i:  tau_i local steps from x_t, ending at x_i             (on_receive, local_train)
                 x_i - x_t = Delta_i = -eta G_i a_i                    Sec. 4.1 (G_i: the tau_i gradients)
                 ||a_i||_1 = tau_i                                     plain SGD (Sec. 4.1)
                 ||a_i||_1 = sum_{k=1..tau_i} (1 - rho^k) / (1 - rho)  momentum rho (Sec. 4.1)
                 send x_i and ||a_i||_1                                (client_upload)
      server:    d_i = (x_t - x_i) / ||a_i||_1  (= eta G_i a_i / ||a_i||_1)   Sec. 4.1 (server_aggregate)
                 tau_eff = sum_i p_i ||a_i||_1                          Eq. 6
                 x_{t+1} = x_t - eta_g * tau_eff * sum_i p_i d_i        Eq. 4 with w_i = p_i (Sec. 5)

Where the paper has them: Section 4.1 defines Delta_i = -eta G_i a_i, d_i = G_i a_i / ||a_i||_1
and ||a_i||_1 for each local solver in the text (no equation numbers; the momentum case is
"Momentum SGD as Local Solver", its derivation in the Appendix); Eq. 4 is the general update
x^(t+1,0) - x^(t,0) = -tau_eff sum_i w_i eta d_i; Eq. 6 rewrites FedAvg in that form, with
tau_eff = sum_i p_i ||a_i||_1 and w_i = p_i ||a_i||_1 / tau_eff; Section 5 sets w_i = p_i in
Eq. 4 (FedNova). Eq. 7 is FedProx's tau_eff and w_i, not used here.

``eta`` is ``training.lr``, ``rho`` ``training.momentum``, ``eta_g`` ``server_lr`` (1 in the
paper), ``p_i`` ``client_weighting``'s weights (each participant's share of the participants'
training samples, as FedAvg here). tau_i is the number of optimiser steps client i really took
this round (``client.steps``), not the configured ``training.local_epochs``: under the
``stragglers`` add-on, or with clients of unequal sizes, the tau_i differ, and that is the case
FedNova is for. FedAvg moves x by sum_i p_i (x_i - x_t), which weights client i's gradients by
p_i ||a_i||_1, so the global model drifts towards the clients that took more steps (the
objective inconsistency); FedNova weights every client's normalised update d_i by p_i alone and
moves tau_eff steps along their mean. With equal tau_i, plain SGD and ``server_lr = 1`` it is
FedAvg (up to float rounding: tau_eff * mean(d_i) = mean(x_t - x_i)). What is evaluated: every
client on the global model x_t, as FedAvg (FedNova is not a personalised method).

Momentum (``training.momentum`` rho > 0) is supported with the paper's momentum normaliser:
torch's SGD keeps v_k = rho v_{k-1} + g_k from v_0 = 0 (no dampening; the optimiser is reset
for every client visit, as the authors' code zeroes its buffer after each round) and steps
x <- x - eta v_k, so after tau steps gradient j (of 1..tau) has weighed
(1 - rho^{tau-j+1}) / (1 - rho): a_i = [1 - rho^{tau_i}, ..., 1 - rho] / (1 - rho), and
||a_i||_1 is the sum above (Section 4.1 writes it in closed form,
[tau_i - rho (1 - rho^{tau_i}) / (1 - rho)] / (1 - rho), the same number).
``training.weight_decay`` is part of each g_k (torch adds it to the gradient before the
momentum, as the authors' code does). Adam (``training.optimizer =
"adam"``) is refused: its steps are not the gradients times fixed coefficients, so there is no
a_i to normalise by.

Deviations from the paper, and what the authors' code (github.com/JYWa/FedNova,
``distoptim/FedNova.py``) and other implementations do:

- Who divides: the paper's client sends d_i; here it sends x_i and the number ||a_i||_1, and
  the server, which holds x_t, forms d_i. The same d_i and the same bytes up as FedAvg's
  upload plus one number; the client keeps no copy of x_t (pfl's ``batched`` executor does
  not carry a client's ``scratch`` from ``on_receive`` to ``client_upload``). The authors'
  code accumulates each worker's lr-scaled steps, scales them by p_i tau_eff / ||a_i||_1
  and sums them with an all-reduce: the same update.
- d_i includes the learning rate eta (the paper's eta d_i), so the server needs no eta.
- ``p_i`` are renormalised over the round's participants (and over the uploads that arrive
  under ``dropout``), where the paper writes p_i = n_i / n over all clients; the two agree
  when every client takes part, as in the authors' experiments. So tau_eff is the
  participants' weighted mean of ||a_i||_1.
- tau_eff = sum_i p_i ||a_i||_1 (its value in Eq. 6) also under momentum; Section 5 writes
  FedNova with plain SGD, tau_eff = sum_i p_i tau_i, and leaves tau_eff free for other local
  solvers. The authors' code does the same as here (it uses sum_i p_i tau_i only for the
  proximal solver). With plain SGD the two are one number.
- ``server_lr`` (eta_g) is not in the paper (its eta_g is 1); the authors' code has an
  optional server ("global") momentum (``gmf``), which is not implemented here.
- FedNova-Prox (the proximal local solver, a_i = [(1 - eta mu)^{tau_i - 1}, ..., 1]) is not
  implemented: the local objective is the plain loss.
- Only the model's parameters are normalised; buffers (BatchNorm statistics) are averaged as
  FedAvg averages them, without ``server_lr``. A parameter that gets no gradient in a step
  still counts that step in tau_i (the step count is the client's, not the parameter's).
- A client that took no step (tau_i = 0: no training batch) gives d_i = 0 and adds nothing to
  tau_eff; the authors' code would divide by zero.
- Flower's FedNova baseline (adap/flower, ``baselines/fednova``) passes the scales
  p_i tau_eff / ||a_i||_1 to Flower's weighted ``aggregate``, which, as we read it, divides by
  their sum, so its step length is not tau_eff; here the update is the paper's, as in the
  authors' code.
- A cold-start client (``experiment.coldstart_clients``) fine-tunes the final x as FedAvg's
  newcomers do; its visit is not a round and uploads nothing.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import SpecError, WeightAveraging, hookimpl, learning_rate, weighted_average


@define
class FedNovaParams:
    server_lr: float = field(default=1.0, validator=learning_rate, metadata={
        "doc": "eta_g, the server's step size: x_{t+1} = x_t - eta_g * tau_eff * sum_i p_i d_i (Eq. 4 with "
               "w_i = p_i, Section 5); 1 is "
               "the paper's FedNova, and with equal local steps FedAvg's aggregate"})


def normaliser(steps: int, momentum: float) -> float:
    """||a_i||_1 after ``steps`` local steps: sum over k = 1..steps of (1 - rho^k) / (1 - rho),
    term k the weight the k-th last gradient carries in the model change (the paper's Section 4.1,
    "Momentum SGD as Local Solver"; derivation in its Appendix); with rho = 0 every term is 1 and
    the sum is ``steps`` exactly (Section 4.1, plain SGD)."""
    total, weight = 0.0, 0.0
    for _ in range(steps):
        weight = momentum * weight + 1.0  # (1 - rho^k) / (1 - rho): 1, 1 + rho, 1 + rho + rho^2, ...
        total += weight
    return total


class FedNova(WeightAveraging):
    """FedNova (Wang et al. 2020): each client's model change is divided by ||a_i||_1 (its local
    steps, or their momentum-weighted count); the server moves the global model
    tau_eff = sum_i p_i ||a_i||_1 steps along the weighted mean of those normalised updates."""

    name = "fednova"
    Params = FedNovaParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        if spec.training.optimizer != "sgd":
            raise SpecError("training.optimizer", f"fednova normalises by ||a_i||_1, the weights SGD's steps give "
                            f"the local gradients (Section 4.1); got {spec.training.optimizer!r}, use \"sgd\"")

    @hookimpl
    def client_upload(self, ctx, client):
        """x_i (its parameters, and its buffers apart) and ||a_i||_1 from the steps this client
        really took (Section 4.1); the server forms d_i."""
        state, params = client.model.state_dict(), dict(client.model.named_parameters())
        return {"weights": {k: v for k, v in state.items() if k in params},
                "buffers": {k: v for k, v in state.items() if k not in params},
                "a_norm": normaliser(client.steps, ctx.spec.training.momentum)}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """d_i = (x_t - x_i) / ||a_i||_1 (Section 4.1); tau_eff = sum_i p_i ||a_i||_1 (Eq. 6);
        x_{t+1} = x_t - eta_g tau_eff sum_i p_i d_i (Eq. 4 with w_i = p_i, Section 5)."""
        x = ctx.server["global"]
        tau_eff, normalised = 0.0, set()

        def updates():  # one upload at a time: d_i (and the buffers) into the mean, ||a_i||_1 into tau_eff
            nonlocal tau_eff
            for i, message in uploads:
                a_norm = message["a_norm"]
                tau_eff += weights[i] * a_norm
                if a_norm:
                    d = {k: (x[k] - y) / a_norm for k, y in message["weights"].items()}
                else:  # no step taken: the client did not move, d_i = 0 and it adds nothing to tau_eff
                    d = {k: torch.zeros_like(y) for k, y in message["weights"].items()}
                normalised.update(d)
                yield weights[i], {**d, **message["buffers"]}

        mean = weighted_average(updates())
        if mean is None:  # nobody took part: x stays
            return True
        step = self.params.server_lr * tau_eff
        ctx.server["global"] = {k: x[k] - step * v if k in normalised else v for k, v in mean.items()}
        return True


__all__ = ["FedNova", "FedNovaParams", "normaliser"]
