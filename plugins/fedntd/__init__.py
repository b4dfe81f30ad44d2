"""FedNTD: Lee, Jeong, Shin, Bae and Yun, "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning", NeurIPS 2022 (arXiv:2106.03097).

FedAvg whose clients, while they train, keep the global model's view of the classes a sample does
*not* belong to. For a sample (x, y), z = f(x; w) the logits of the model being trained and
z^g = f(x; w^t) those of the global model received this round, the not-true softened
probabilities drop the true class y from the softmax:

    (N1)  q~_c(z) = exp(z_c / tau) / sum_{c' != y} exp(z_{c'} / tau),      c != y
    (N2)  L_NTD = tau^2 * sum_{c != y} q~_c(z^g) * log( q~_c(z^g) / q~_c(z) )   (a KL divergence)
    (N3)  L = CE(z, y) + beta * L_NTD                                          (the local objective)

averaged over the mini-batch. The true class's logit gets no distillation gradient at all (it is
not in (N1)), so the cross-entropy alone fits the client's labels, while the global model's
ranking of the other classes, which local training on a skewed label distribution forgets, is
kept.

    server: w^0 = the seeded initial weights                                (setup)
    each round t, each participant k, given w^t:                            (on_broadcast, on_receive)
        w_k <- w^t;  the frozen teacher f(.; w^t)
        training.local_epochs epochs of SGD on (N3)                         (local_objective adds beta * L_NTD)
        upload w_k
    w^{t+1} <- sum_k n_k / n * w_k                                          (server_aggregate: FedAvg's)
    evaluation: every client is scored with the global model w^t            (personalized_models: FedAvg's)

(N1)-(N3) label the equations here: we could read the paper's abstract and introduction (the
arXiv HTML), not its Section 4, so its equation numbers are not cited. The loss is the one the
abstract and Fig. 5 describe (the true class's logit ignored in the softmax) and the authors' code
implements (github:Lee-Gihun/FedNTD at be00ee5, ``algorithms/fedntd/criterion.py``: a KL with
``batchmean`` reduction, times tau^2), which PFLlib re-implements (github:TsingZ0/PFLlib at
d832e76, ``system/flcore/clients/clientntd.py``, ``servers/serverntd.py``). FL-bench (at 06e658b)
has no FedNTD. Read, not copied.

Decisions and deviations:

- **Defaults** beta = 1, tau = 1: the authors' ``config/fedntd.json`` (their loss class's own
  defaults are tau = 3, beta = 1). PFLlib's command line defaults beta to 0 (its shared ``-bt``
  flag), which would make its FedNTD plain FedAvg unless set; beta = 0 here is FedAvg bit for bit
  (tested).
- **The teacher's logits are computed in eval mode, without gradients** (PFLlib puts its copy in
  eval mode; the authors' copy keeps the mode the model was in, which differs only for models
  with BatchNorm or dropout).
- **Aggregation** is FedAvg's, weighted by training samples, as the authors' server does
  (``BaseServer._aggregation``: weights n_k / n). PFLlib's FedNTD server overrides it with a
  uniform 1 / ``num_join_clients``, which ignores the sample counts and, when uploads are
  dropped (its ``client_drop_rate``), sums to less than one (the global weights shrink).
- **Two classes**: the not-true distribution of (N1) has a single class, so L_NTD is 0 and FedNTD
  is FedAvg; the paper's datasets have 10 or more classes.
- The authors' optimiser state (momentum) is carried from the server each round and their
  learning rate decays by 0.99 a round; here the client's optimiser is pfl's (``training.*``),
  the same for every method of a comparison.
- Cold start: the newcomer receives the final w, trains ``experiment.coldstart_epochs`` epochs on
  (N3) with that w as its teacher (the core default, FedAvg's) and is scored on its trained model.
- Budget (``local_work``): FedAvg's; the teacher's forward pass per batch is not counted as
  work. Bytes: FedAvg's (the teacher is the broadcast model itself: nothing else travels).

No client state: the teacher arrives with each round's broadcast, so a lost upload (``dropout``)
loses nothing but that round's contribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import at_least, finite, greater_than, hookimpl, load_state, predict_logits
from pfl_plugins.fedavg import FedAvg

TEACHER = "fedntd_global"  # the model bank slot holding this round's global model, frozen


@define
class FedNTDParams:
    beta: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "beta, the weight of the not-true distillation loss (N3); 0 is FedAvg. Default: the authors' "
               "config"})
    tau: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "tau, the softmax temperature of (N1); L_NTD is scaled by tau^2 (N2). Default: the authors' "
               "config"})


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row of ``logits`` without its true class's column: [batch, classes - 1], order kept."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(len(y), device=logits.device), y] = False
    return logits[keep].view(len(y), logits.shape[1] - 1)


def not_true_distillation(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor,
                          tau: float) -> torch.Tensor:
    """(N2) averaged over the batch: tau^2 KL(q~(z^g) || q~(z)) over the not-true classes (N1); no
    gradient reaches ``teacher_logits``."""
    student = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    teacher = F.softmax(not_true_logits(teacher_logits.detach(), y) / tau, dim=1)
    return tau ** 2 * F.kl_div(student, teacher, reduction="batchmean")


class FedNTD(FedAvg):
    """FedNTD (Lee et al. 2022): FedAvg whose clients add beta * tau^2 KL over the not-true classes,
    from this round's global model to the local one (N1-N3); evaluated on the global model."""

    name = "fedntd"
    Params = FedNTDParams

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        with torch.random.fork_rng(devices=[]):  # build the frozen teacher's module now, drawing nothing
            ctx.models.working(ctx.models.arch_of(0), slot=TEACHER).requires_grad_(False)

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # w_k <- w^t
        load_state(ctx.models.working(client.arch, slot=TEACHER), message["weights"])
        client.scratch["fedntd"] = True  # switches L_NTD on for this visit (local_objective)
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """beta * L_NTD (N2-N3) of this batch; the core adds the cross-entropy."""
        if not client.scratch.get("fedntd") or model is not client.model:
            return None
        teacher_logits = predict_logits(ctx.models.working(client.arch, slot=TEACHER), x)
        return self.params.beta * not_true_distillation(logits, teacher_logits, y, self.params.tau)


__all__ = ["FedNTD", "FedNTDParams", "not_true_distillation", "not_true_logits"]
