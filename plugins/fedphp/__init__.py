"""FedPHP: Li, Zhan, Shao, Li and Song, "FedPHP: Federated Personalization with Inherited
Private Models", ECML PKDD 2021, Algorithm 1.

FedAvg trains the shared model; every client k also keeps a personalized historical model
(hPM) w-bar_k, a moving average of the local models it trained in the rounds it took part in.
The hPM is the client's personalized model, and its knowledge is transferred back into each
new local update. Each round t:

    server: sends w^t to the participants S_t                          (on_broadcast)
    client k in S_t:
        w <- w^t                                                       (on_receive)
        E epochs of SGD on                                              (local_train)
            L(w) = (1 - lam) CE(g(x; w), y) + lam R(w, w-bar_k)                       (T1)
          R = MMD^2 between the features f(x; w) and f(x; w-bar_k) of the batch     (T2)
              (``transfer = "mmd"``), or the distillation cross-entropy
              -sum_c softmax(g(x; w-bar_k) / T)_c log softmax(g(x; w))_c         (T3)
              (``transfer = "kd"``); the hPM is a fixed teacher (no gradient)
        mu_k = mu_max * min(c_k / max(floor(C * T_rounds), 1), 1)                  (T4)
              c_k: the number of earlier rounds k took part in; C * T_rounds: the
              number of rounds a client takes part in on average
        w-bar_k <- mu_k w-bar_k + (1 - mu_k) w                                     (T5)
        uploads w (FedAvg's upload; the hPM never leaves the client)     (client_upload)
    server: w^{t+1} = sum_k n_k / n w_k (FedAvg)                       (server_aggregate)
    evaluation: client k's hPM w-bar_k                                  (personalized_models)

(T1)-(T5) label the steps in this docstring; the paper's Section 3 gives them as the hPM
update and the transfer loss, without numbers we could check, so the labels are ours.

Defaults and decisions:

- ``transfer = "mmd"``, ``lam = 0.1``: the authors' released hyper-parameter grid for FedPHP
  is (KD, 0.05), (MMD, 0.1), (MMD, 0.05); MMD is the transfer of two of its three points and
  the paper's main variant, and of its two MMD weights we take 0.1, the one that transfers
  more (0.05 is a grid point too). ``lam = 0`` is FedAvg's local update exactly (tested bit
  for bit); ``lam = 1`` would drop the labels, so ``lam`` must lie in [0, 1).
- ``mu_max = 0.9`` and the linear schedule (T4): the authors' code (the hPM keeps at most 90%
  of itself; a client's first update replaces the initial hPM entirely, mu = 0).
- MMD (T2): the multi-kernel Gaussian MMD of domain adaptation, the biased estimate
  mean k(a, a') + mean k(b, b') - 2 mean k(a, b) with k(u, v) = sum_q exp(-||u - v||^2 / s_q),
  s_q = s * kernel_mul^(q - kernels // 2), q = 0 .. kernels - 1, s the mean squared distance
  between distinct rows of the pooled batch (a constant, no gradient); ``kernels = 5``,
  ``kernel_mul = 2`` as in the authors' code. Features f(x) are the input of the model's last
  parameterised layer (its classifier), as in FedProto (plugins/fedproto).
- KD (T3): the teacher's probabilities are softened by ``temperature = 4`` and the student's
  are not, as in the authors' code (a cross-entropy to soft targets).
- The hPM starts at the run's seeded initial weights (w^0) and is evaluated for a client that
  never trained. Non-float state entries (BatchNorm's counter) are the local model's.
- The hPM is run in eval mode as the teacher.
- Budget: ``training.local_epochs`` private epochs per round (the core default); bytes are
  FedAvg's.
- Cold start: the newcomer receives the final w, trains ``experiment.coldstart_epochs`` epochs
  with the transfer term towards its initial hPM (w^0) and keeps the result as its hPM
  (mu = 0 in its first update); that hPM is scored.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import at_least, between, capture_embedding, finite, greater_than, hookimpl, load_state, one_of
from pfl_plugins.fedavg import FedAvg


@define
class FedPHPParams:
    lam: float = field(default=0.1, validator=[finite, between(0, 1, high_open=True)], metadata={
        "doc": "weight of the transfer term (T1); 0 is FedAvg's local update"})
    transfer: str = field(default="mmd", validator=one_of("mmd", "kd"), metadata={
        "doc": "R in (T1): the MMD between the batch's features (the classifier's input) under w and "
               "under the hPM, or distillation from the hPM's softened predictions"})
    mu_max: float = field(default=0.9, validator=[finite, between(0, 1, high_open=True)], metadata={
        "doc": "largest moving-average weight (T4): mu = mu_max * min(c / max(floor(participation * "
               "rounds), 1), 1), c = the client's earlier rounds of taking part"})
    temperature: float = field(default=4.0, validator=[finite, greater_than(0)], metadata={
        "doc": "KD only (T3): softening of the hPM's predictions (the student's are not softened)"})
    kernels: int = field(default=5, validator=at_least(1), metadata={
        "doc": "MMD only (T2): Gaussian kernels, at widths s * kernel_mul^(q - kernels // 2), s = the "
               "batch's mean pairwise squared distance"})
    kernel_mul: float = field(default=2.0, validator=[finite, greater_than(0)], metadata={
        "doc": "MMD only (T2): ratio between neighbouring kernel widths"})


def mmd(a: torch.Tensor, b: torch.Tensor, kernels: int = 5, kernel_mul: float = 2.0) -> torch.Tensor:
    """(T2): the biased multi-kernel Gaussian MMD^2 between the rows of ``a`` and of ``b``."""
    pooled = torch.cat([a, b])
    sq = pooled.pow(2).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2 * pooled @ pooled.T).clamp_min(0)  # ||u - v||^2, smooth at 0
    n = len(pooled)
    scale = (d2.detach().sum() / max(n * n - n, 1)).clamp_min(1e-12)
    k = sum(torch.exp(-d2 / (scale * kernel_mul ** (q - kernels // 2))) for q in range(kernels))
    na = len(a)
    return k[:na, :na].mean() + k[na:, na:].mean() - 2 * k[:na, na:].mean()


def distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(T3): -sum_c softmax(teacher / T)_c log softmax(student)_c, averaged over the batch."""
    soft = F.softmax(teacher_logits / temperature, dim=1)
    return -(soft * F.log_softmax(student_logits, dim=1)).sum(1).mean()


def moving_average(history: dict, current: dict, mu: float) -> dict:
    """(T5): mu * history + (1 - mu) * current per float entry; other entries from ``current``."""
    return {k: (mu * history[k] + (1 - mu) * v).detach().clone() if v.is_floating_point() else v.detach().clone()
            for k, v in current.items()}


def inheritance(visits: int, mu_max: float, participation: float, rounds: int) -> float:
    """(T4): mu_k after ``visits`` earlier rounds of taking part."""
    expected = max(math.floor(participation * rounds), 1)
    return mu_max * min(visits / expected, 1.0)


class FedPHP(FedAvg):
    """FedPHP (Li et al. 2021): FedAvg plus a personalised historical model (hPM) per client, the
    moving average ``hPM <- mu * hPM + (1 - mu) * w`` of the models it trained; local training
    minimises ``(1 - lam) * CE + lam * R(w, hPM)``; the hPM is evaluated. FedAvg's bytes.
    Budget: ``training.local_epochs``."""

    name = "fedphp"
    Params = FedPHPParams

    def hpm(self, ctx, client) -> dict:
        """w-bar_k (the seeded initial weights before the client's first update)."""
        return client.state.get("hpm") or ctx.models.initial_state(client.arch)

    def train(self, ctx, client, epochs=None) -> dict:
        """E epochs of SGD on (T1), then the hPM update (T4)-(T5)."""
        if self.params.lam > 0:  # the teacher: the hPM in a module of its own, fixed
            teacher = load_state(ctx.models.working(client.arch, slot="fedphp_hpm"), self.hpm(ctx, client))
            client.scratch["teacher"] = teacher.eval()
        with capture_embedding(client.model, client.scratch):
            metrics = client.train(epochs=epochs)
        spec = ctx.spec.experiment
        visits = client.state.get("visits", 0)
        mu = inheritance(visits, self.params.mu_max, spec.participation, spec.rounds)
        client.state["hpm"] = moving_average(self.hpm(ctx, client), client.model.state_dict(), mu)
        client.state["visits"] = visits + 1
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        return self.train(ctx, client)

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lam * (R - CE): added to the core's CE, the batch loss is (T1)."""
        teacher = client.scratch.get("teacher")
        if teacher is None:
            return None
        store = {}
        with torch.no_grad(), capture_embedding(teacher, store):
            teacher_logits = teacher(x)
        if self.params.transfer == "mmd":
            transfer = mmd(client.scratch["emb"].flatten(1), store["emb"].flatten(1),
                           self.params.kernels, self.params.kernel_mul)
        else:
            transfer = distillation(logits, teacher_logits, self.params.temperature)
        return self.params.lam * (transfer - F.cross_entropy(logits, y))

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # the hPM is evaluated: nothing from the server

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_state(client.model, self.hpm(ctx, client))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": load_state(client.model, self.hpm(ctx, client))}


__all__ = ["FedPHP", "FedPHPParams", "distillation", "inheritance", "mmd", "moving_average"]
