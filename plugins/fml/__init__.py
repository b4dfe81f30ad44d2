"""FML: Shen, Zhang, Jia, Zhang, Huang, Zhou, Kuang, Wu and Wu, "Federated Mutual Learning", 2020
(arXiv:2006.16765).

Each client k keeps a personal ("local") model L_k that never leaves it, beside a meme model M_k,
its fork of the global model. The two learn from the client's data and from each other by deep
mutual learning (Zhang et al., CVPR 2018); the meme models are averaged into the global model as
in FedAvg. The paper's method section could not be read here (only its abstract and summaries);
the steps below follow those and PFLlib (github:TsingZ0/PFLlib at d832e76f, clientfml.py /
serverfml.py); FL-bench has no FML. Equation labels are this docstring's:

    per mini-batch (x, y), z_L = L_k(x), z_M = M_k(x), p = softmax(z):
    (1) personal  alpha CE(z_L, y) + (1 - alpha) KL(p_M || p_L)
    (2) meme      beta  CE(z_M, y) + (1 - beta)  KL(p_L || p_M)
        (in each loss the other model's p is a constant; one optimiser step per batch moves
         both models: the gradient of (1) + (2) w.r.t. each is its own loss's)

    client k in round t, given the global model w^t:                         (on_receive)
        M_k <- w^t;  L_k <- its own (the seeded initial weights at first)
        training.local_epochs epochs of (1) + (2)                             (local_train)
        upload M_k                                                           (client_upload)
    server: w^{t+1} = sum_k w_k M_k  (FedAvg: w_k = n_k / n by default)      (server_aggregate)
    evaluation: each client's personal model L_k (never-trained clients: the seeded initial weights)

Defaults and decisions:

- ``alpha = beta = 0.5``: both models weigh their data and their peer equally. PFLlib's
  defaults (alpha = 1, beta = 0) are generic arguments of its main.py shared with other
  methods; at alpha = 1 the personal model ignores the meme (Local's model) and at beta = 0
  the meme never sees a label. Both extremes are here bit for bit: ``alpha = 1`` trains the
  personal models as Local does and ``beta = 1`` the global model as FedAvg does (tested).
- ``weighting = "samples"``: FedAvg's n_k / n, the aggregation FML builds on; ``"uniform"``
  is PFLlib's 1/|S|.
- The cross-entropy is ``client.objective`` (a ``task_loss`` plugin's loss and add-on terms
  apply to both models); ``train_loss`` is the mean over batches of (1) + (2).
- The peer's prediction is detached in each KL (deep mutual learning: each network learns from
  the other's current prediction). PFLlib backpropagates (1) and (2) through both models, so
  each KL also pulls the peer towards the learner; it clips gradients at norm 10 (not here).
  KL is per sample, averaged over the batch (``batchmean``); PFLlib's KLDivLoss averages over
  batch x classes, which scales the KL terms down by the number of classes. No temperature.
- Both models step together, on the same batch (PFLlib's order); deep mutual learning's
  paper updates the two networks in turn, recomputing predictions in between.
- Both models have the client's architecture (``model.name``); the paper allows a personal
  architecture of the client's choice, which this plugin does not offer.
- One optimiser (``training``'s settings) for both models; PFLlib uses plain SGD for each.
- Budget (``local_work``): 2 x training.local_epochs private epochs; the steps count twice.
- Bytes: FedAvg's (w^t down, M_k up); the personal model never leaves.
- Lost uploads (``dropout``): the personal model is the client's and keeps the round's
  training; the meme's upload is simply not averaged (nothing else to stage).
- Cold start: the newcomer receives the final w, trains its fresh personal model with the meme by
  (1) + (2) for ``experiment.coldstart_epochs`` epochs, and is scored with its personal model.
"""

from __future__ import annotations

import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    MutualPair,
    WeightAveraging,
    between,
    clone_state,
    finite,
    hookimpl,
    load_state,
    one_of,
)


@define
class FMLParams:
    alpha: float = field(default=0.5, validator=[finite, between(0, 1)], metadata={
        "doc": "alpha of (1): the personal model's cross-entropy weight, 1 - alpha its KL to the meme "
               "(1: Local's personal models)"})
    beta: float = field(default=0.5, validator=[finite, between(0, 1)], metadata={
        "doc": "beta of (2): the meme model's cross-entropy weight, 1 - beta its KL to the personal model "
               "(1: FedAvg's global model)"})
    weighting: str = field(default="samples", validator=one_of("samples", "uniform"), metadata={
        "doc": 'the meme models\' average: n_k / n (FedAvg\'s) or "uniform", 1/|S| (PFLlib\'s)'})


def kl_to_peer(logits, peer_logits):
    """KL(softmax(peer) || softmax(logits)), the peer a constant, averaged over the batch."""
    return F.kl_div(F.log_softmax(logits, dim=1), F.softmax(peer_logits.detach(), dim=1), reduction="batchmean")


def fml_losses(ce_personal, ce_meme, z_personal, z_meme, alpha: float, beta: float):
    """(1) and (2) from the two task losses and the two models' logits."""
    personal = alpha * ce_personal + (1 - alpha) * kl_to_peer(z_personal, z_meme)
    meme = beta * ce_meme + (1 - beta) * kl_to_peer(z_meme, z_personal)
    return personal, meme


class FML(WeightAveraging):
    """FML (Shen et al. 2020): a personal model per client, never sent and evaluated, beside the
    meme model (FedAvg's global model); both trained by deep mutual learning with weights alpha
    and beta. FedAvg's bytes. Budget: 2 x ``training.local_epochs``."""

    name = "fml"
    Params = FMLParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(2.0 * spec.training.local_epochs)

    @hookimpl
    def client_weighting(self, ctx, participants):
        if self.params.weighting == "uniform":
            return {i: 1.0 / len(participants) for i in participants}
        return None  # the core's n_k / n

    def personal(self, ctx, client) -> dict:
        return client.state.get("personal") or ctx.models.initial_state(client.arch)

    def mutual_update(self, ctx, client, epochs: int) -> dict:
        """(1) + (2) for ``epochs`` epochs from the meme in the working model; L_k kept in client.state."""
        personal = ctx.models.working(client.arch, slot="fml_personal")
        load_state(personal, self.personal(ctx, client))
        pair = MutualPair(personal, client.model)
        alpha, beta = self.params.alpha, self.params.beta

        def loss(model, x, y, personal_logits):
            meme_logits = model.seen["mentee_logits"]
            ce_personal = client.objective(model.mentor, x, y, personal_logits)
            ce_meme = client.objective(model.mentee, x, y, meme_logits)
            return sum(fml_losses(ce_personal, ce_meme, personal_logits, meme_logits, alpha, beta))

        before, steps_before = client.work.private, client.work.private_steps
        metrics = client.train(pair, epochs=epochs, optimizer=client.optimizer(params=pair.parameters()), loss_fn=loss)
        # the second model's passes and steps over the same batches
        client.count_work(private=client.work.private - before, private_steps=client.work.private_steps - steps_before)
        client.state["personal"] = clone_state(personal)
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        return self.mutual_update(ctx, client, ctx.spec.training.local_epochs)

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # the personal model is evaluated: nothing from the server

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_state(client.model, self.personal(ctx, client))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.mutual_update(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return self.personalized_models(ctx, client, {})


__all__ = ["FML", "FMLParams", "fml_losses", "kl_to_peer"]
