"""FedMD: Li & Wang, "FedMD: Heterogenous Federated Learning via Model Distillation",
NeurIPS 2019 workshop, Algorithm 1.

Every client keeps its own model (any architecture); parameters are never sent::

    transfer learning: each model trains on the labelled public set D_0, then on its own
        private data                                           (round 1, before its upload)
    each round:
        communicate: each client computes class scores f_k(x) on an alignment set A_t of U
        aggregate:   server averages them, f~(x) = 1/m sum_k f_k(x)
        distribute:  f~ to every client
        digest:      each client trains its model to approach f~ on A_t
        revisit:     each client trains a few epochs on its private data

Mapping onto pfl rounds (one upload per round): round 1 = transfer learning + the first
upload of scores; round t >= 2 = receive the consensus of round t - 1, digest, revisit,
upload scores on A_t. The consensus of the last round is therefore never digested.

Decisions where the paper is silent:

- Transfer learning: ``transfer_epochs`` epochs on U with its labels, then
  ``private_epochs`` epochs on the private data ("to convergence" in the paper: raise them).
  Needs ``public.labelled = true`` (SpecError otherwise).
- Scores are logits; digest loss ``distill_loss`` = "l1" (mean absolute error on the logits,
  as in the authors' code) or "mse"; ``digest_epochs`` epochs with the configured optimiser
  and batch size; revisit = ``revisit_epochs`` epochs of plain local training.
- ``alignment_size`` None: A_t = all of U (no indices sent). Otherwise the server draws A_t
  each round (seeded) and sends its indices (ceil(log2 |U|) bits each) with the broadcast.
- Communication: logits float32, |A_t| x C x 4 bytes each way per client and round.
- Aggregation: the plain mean over the round's participants (as the paper).
- Budget (``local_work``): round 1 does ``transfer_epochs`` on U and ``private_epochs`` on
  D_i; every later round ``digest_epochs`` on A_t (|A_t| / |U| of a pass over U each) and
  ``revisit_epochs`` on D_i. Declared as the later rounds' work per round plus a first-round
  correction (may be negative), as pfl_core/methods/codistill.py does. With ``alignment_size`` and
  ``public.fraction`` (|U| unknown before the data) the public part is nan.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    Packed,
    Plugin,
    SpecError,
    at_least,
    bits_for_classes,
    clone_state,
    hookimpl,
    load_personal,
    one_of,
    predict_logits,
    require_public,
)


@define
class FedMDParams:
    transfer_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "transfer learning, round 1: epochs on U with its labels (needs public.labelled = true)"})
    private_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "transfer learning, round 1: then epochs on the private data"})
    digest_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs a round approaching the consensus scores on the alignment set"})
    revisit_epochs: int = field(default=1, validator=at_least(0),
                                metadata={"doc": "epochs a round on the private data, after digesting"})
    alignment_size: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "size of the alignment set A_t the server draws each round; none: all of U (no indices sent)"})
    distill_loss: str = field(default="l1", validator=one_of("l1", "mse"), metadata={
        "doc": "digest loss on the logits: mean absolute error (the authors' code) or squared error"})


class FedMD(Plugin):
    name = "fedmd"
    Params = FedMDParams

    @hookimpl
    def check_spec(self, spec):
        require_public(spec, self.name)
        if not spec.public.labelled:
            raise SpecError("public.labelled", "fedmd's transfer-learning step trains on U's labels: "
                                               "set public.labelled = true")
        if self.params.alignment_size is not None and spec.public.size is not None \
                and self.params.alignment_size > spec.public.size:
            raise SpecError(f"{self.spec_path}.params.alignment_size",
                            f"{self.params.alignment_size} exceeds public.size = {spec.public.size}")

    def local_work(self, spec) -> LocalWork:
        p = self.params
        if p.alignment_size is None:
            share = 1.0
        elif spec.public is not None and spec.public.size is not None:
            share = min(p.alignment_size / spec.public.size, 1.0)
        else:
            share = math.nan
        digest = p.digest_epochs * share
        return LocalWork(float(p.revisit_epochs), public_epochs_per_round=digest,
                         pretrain_private_epochs=float(p.private_epochs - p.revisit_epochs),
                         pretrain_public_epochs=p.transfer_epochs - digest)

    # -- server ------------------------------------------------------------------------

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        size, n = self.params.alignment_size, len(ctx.data.public)
        if size is None or size >= n:
            ctx.server["align_idx"] = None
        else:
            ctx.server["align_idx"] = torch.as_tensor(sorted(ctx.rng("fedmd_alignment").choice(n, size, replace=False)))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {}
        bits = bits_for_classes(len(ctx.data.public))
        if ctx.server.get("consensus") is not None:
            message["consensus"] = ctx.server["consensus"]
            if ctx.server.get("consensus_idx") is not None:
                message["consensus_idx"] = Packed(ctx.server["consensus_idx"], bits)
        if ctx.server.get("align_idx") is not None:
            message["align_idx"] = Packed(ctx.server["align_idx"], bits)
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        total, count = None, 0
        for _client_id, message in uploads:
            scores = message["scores"].double()
            total = scores.clone() if total is None else total + scores
            count += 1
        if count:
            ctx.server["consensus"] = (total / count).float()
            ctx.server["consensus_idx"] = ctx.server.get("align_idx")
            idx = ctx.server["consensus_idx"]
            true_y = ctx.data.public.true_y.cpu()
            true_y = true_y if idx is None else true_y[idx]
            ctx.log(consensus_acc=float((ctx.server["consensus"].argmax(1) == true_y).double().mean()))
        return True

    # -- client ------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        client.scratch["message"] = message
        return True

    def _distill(self, model, x, target, logits):
        if self.params.distill_loss == "mse":
            return F.mse_loss(logits, target)
        return F.l1_loss(logits, target)

    @hookimpl
    def local_train(self, ctx, client):
        p, public = self.params, ctx.data.public
        message = client.scratch["message"]
        metrics = {}
        if not client.state.get("transferred"):
            if p.transfer_epochs:
                client.train(epochs=p.transfer_epochs, x=public.x, y=public.y, loss_fn=cross_entropy)
            if p.private_epochs:
                metrics = client.train(epochs=p.private_epochs)
            client.state["transferred"] = True
        elif "consensus" in message:
            idx = message["consensus_idx"].value if "consensus_idx" in message else None
            x = public.x if idx is None else public.x[idx.to(public.x.device)]
            if p.digest_epochs:
                client.train(epochs=p.digest_epochs, x=x, y=message["consensus"].to(x.device), loss_fn=self._distill)
            if p.revisit_epochs:
                metrics = client.train(epochs=p.revisit_epochs)
        client.state["weights"] = clone_state(client.model)
        return metrics or {}

    @hookimpl
    def client_upload(self, ctx, client):
        message, public = client.scratch["message"], ctx.data.public
        x = public.x if "align_idx" not in message else public.x[message["align_idx"].value.to(public.x.device)]
        return {"scores": predict_logits(client.model, x, ctx.spec.evaluation.batch_size).float().cpu()}

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": load_personal(ctx, client)}


def cross_entropy(model, x, y, logits):
    return F.cross_entropy(logits, y)
