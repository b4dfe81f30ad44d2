"""FD (federated distillation): Jeong, Oh, Kim, Park, Bennis and Kim, "Communication-Efficient
On-Device Machine Learning: Federated Distillation and Augmentation under Non-IID Private Data",
NeurIPS 2018 workshop (arXiv:1811.11479), Algorithm 1 (FD; FAug, the paper's data augmentation
by a server-side generator, is not part of this plugin).

No weights travel: every client keeps its own model (of its own architecture, if the spec gives
clients different ones) and shares, for each label, the average of the logit vectors its model
produced on that label's samples while it trained. Each client then distils, on its own samples,
towards the other clients' average logit vector for the sample's label:

    client i, round t, with its model w_i and the teachers F^_{i,l} it received:
        for each mini-batch (x, y) of training.local_epochs epochs:                    (local_train)
            z = F(w_i; x)
            (F1) loss = CE(z, y) + lam * CE(softmax(F^_{i,y}), z)   (per sample; no term
                 for a label without a teacher: every label in round 1)                 (local_objective)
            (F2) accumulate z per label: S_{i,l} += z, n_{i,l} += 1  (the batch's logits as trained)
        (F3) upload F-_{i,l} = S_{i,l} / n_{i,l} for every label l it saw               (client_upload)
    server: (F4) for each client j and label l, the teacher is the mean of the delivered
            F-_{k,l}, k != j, over the clients k that reported l this round              (server_aggregate,
            (exclude_own = false: over all of them, j included)                           on_broadcast)
    evaluation: every client is scored with its own model                               (personalized_models)

(F1)-(F4) label the steps here: we could read only the paper's abstract and a summary of it (per
label, "global-average logits" F^^{(i)}_{k,l} for device i assembled from the devices' local
averages F-^{(i)}_{k,l}, and a cross-entropy distillation regulariser), not Algorithm 1 itself, so
its line numbers are not cited; the steps above are that description made concrete. The reference
implementation read (not copied) is PFLlib's (github:TsingZ0/PFLlib at d832e76,
``system/flcore/clients/clientfd.py``, ``servers/serverfd.py``); FL-bench (at 06e658b) has no FD.

Decisions and deviations:

- **A client's own logits are left out of its teacher** (``exclude_own = true``, the default): the
  per-device F^^{(i)} of the paper's notation, so a client is not pulled towards itself. PFLlib
  sends every client one average that includes its own report (``exclude_own = false`` gives
  that).
- **The teacher is a distribution**: the regulariser is the cross-entropy between softmax(F^) and
  the model's softmax(z), i.e. the KL divergence plus the teacher's (constant) entropy. PFLlib
  passes the raw averaged logits to ``nn.CrossEntropyLoss`` as if they were probabilities (they
  are neither non-negative nor normalised), and, for a label without a teacher, distils the
  sample towards its own detached output (a non-zero term); here such a sample has no term.
- **The regulariser is averaged over the whole batch** (samples without a teacher add 0), so lam
  weighs each sample the same whatever the share of its batch with a teacher.
- **Which reports a teacher averages**: the uploads delivered in the last round that delivered
  any (with full participation, all clients' reports of the previous round, as in the paper). A
  label nobody reported that round has no teacher. The mean is unweighted over the reporting
  clients, as in the paper's average over devices and in PFLlib (a client's sample count for the
  label does not weigh it). A round in which no upload arrives keeps the teachers as they were.
- **The logits averaged in (F2)** are those of the training forward passes themselves (train
  mode, the model changing from step to step, every epoch), as in the paper's and PFLlib's
  loops; they are not recomputed after training.
- ``lam = 1``: PFLlib's default (``--lamda 1.0``); lam = 0 is Local bit for bit (tested).
- Budget (``local_work``): training.local_epochs private epochs per round, the default. Bytes:
  up, per client a [classes x classes] float32 matrix of averages and a [classes] mask of the
  labels it saw; down, one such matrix and mask per client (none in round 1).
- Cold start: the newcomer receives the teacher averaged over all the last reports (it has none
  of its own), trains a model from the seeded initial weights for ``experiment.coldstart_epochs``
  epochs on (F1), and is scored on it.

Client state: the personal model (``client.state["weights"]``), kept whether or not the round's
upload arrives (the client did train; the lost-upload rule's default). The server mirrors no
client state, so nothing is staged: a lost upload only leaves its report out of (F4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import Plugin, at_least, clone_state, finite, hookimpl, load_personal


@define
class FDParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "lambda, the weight of the distillation regulariser (F1); 0 is Local. Default: PFLlib's (the "
               "paper's symbol could not be checked)"})
    exclude_own: bool = field(default=True, metadata={
        "doc": "leave a client's own report out of its teacher (F4): the paper's per-device average; false: "
               "one average over all reports, PFLlib's"})


def label_logit_sums(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(F2) for one batch: (per-label sums of the logit rows [classes, classes], per-label counts
    [classes]); a one-hot matrix product, deterministic on every device."""
    one_hot = F.one_hot(y, num_classes).to(logits.dtype)
    return one_hot.T @ logits.detach(), one_hot.sum(0)


def teachers(reports: dict, client_id, exclude_own: bool):
    """(F4): (per-label mean of the reported averages [classes, classes], which labels have one
    [classes] bool) over ``reports`` {client: (averages, seen)}, without ``client_id``'s own
    report when ``exclude_own``; None when there is no report to average."""
    others = [report for reporter, report in sorted(reports.items()) if not (exclude_own and reporter == client_id)]
    if not others:
        return None
    sums = sum(averages * seen[:, None] for averages, seen in others)
    counts = sum(seen.to(sums.dtype) for _, seen in others)
    return sums / counts.clamp_min(1)[:, None], counts > 0


def distillation_term(logits: torch.Tensor, y: torch.Tensor, teacher: torch.Tensor, has_teacher: torch.Tensor):
    """(F1)'s regulariser, summed over the samples whose label has a teacher and divided by the
    batch size: CE(softmax(F^_y), z) per sample."""
    rows = has_teacher[y]
    if not bool(rows.any()):
        return logits.new_zeros(())
    target = F.softmax(teacher[y[rows]], dim=1)
    return F.cross_entropy(logits[rows], target, reduction="sum") / len(y)


class FD(Plugin):
    """FD (Jeong et al. 2018): every client keeps its own model and shares per-label average logits;
    it distils towards the other clients' average logit of each sample's label (F1-F4). Each client
    is scored on its own model."""

    name = "fd"
    Params = FDParams

    @hookimpl
    def setup(self, ctx):
        ctx.server["reports"] = {}  # {client: (averages, seen)} of the last round with a delivered upload

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        found = teachers(ctx.server["reports"], client_id, self.params.exclude_own)
        return {} if found is None else {"teacher": found[0], "has_teacher": found[1]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        if "teacher" in message:
            client.scratch["teacher"] = (message["teacher"], message["has_teacher"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        sums = torch.zeros(ctx.num_classes, ctx.num_classes, device=ctx.device)
        counts = torch.zeros(ctx.num_classes, device=ctx.device)

        def recorded(model, x, y, logits):  # (F2) beside the loss of every term (F1, any add-on's)
            batch_sums, batch_counts = label_logit_sums(logits, y, ctx.num_classes)
            sums.add_(batch_sums)
            counts.add_(batch_counts)
            return client.objective(model, x, y, logits)

        metrics = client.train(loss_fn=recorded)
        client.state["weights"] = clone_state(client.model)
        client.scratch["report"] = (sums / counts.clamp_min(1)[:, None], counts > 0)
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lam * (F1)'s regulariser; the core adds the cross-entropy."""
        if "teacher" not in client.scratch or model is not client.model:
            return None
        teacher, has_teacher = client.scratch["teacher"]
        return self.params.lam * distillation_term(logits, y, teacher, has_teacher)

    @hookimpl
    def client_upload(self, ctx, client):
        averages, seen = client.scratch["report"]  # (F3)
        return {"averages": averages, "seen": seen}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        # on_broadcast reads the reports: replace them only once every upload is in. (A round whose
        # uploads are all lost never gets here: the engine keeps the server state, so the teachers.)
        ctx.server["reports"] = {client_id: (m["averages"], m["seen"]) for client_id, m in uploads}
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}


__all__ = ["FD", "FDParams", "distillation_term", "label_logit_sums", "teachers"]
