"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous
Clients", AAAI 2022, Algorithm 1.

Every client keeps its whole model; only class prototypes travel. The embedding f_i(x) is the
input of the model's last parameterised layer (the classifier), captured with a forward hook.

    server: global prototypes C-bar^(j) for every class j some client has reported   (Eq. 6)
    client i: E epochs minimising
        L = CE(logits, y) + lambda * MSE(f_i(x), C-bar^(y))                          (Eq. 4-5)
        (the regulariser only for labels y that have a global prototype; none in round 1)
      local prototypes C_i^(j) = mean of f_i(x) over its training samples of class j  (Eq. 3)
      uploads {j: C_i^(j)} and the class counts |D_ij|
    server: C-bar^(j) = sum_{i in N_j} |D_ij| C_i^(j) / sum_{i in N_j} |D_ij|         (Eq. 6)
    inference: the class whose global prototype is nearest to f_i(x)                (Sec. 4)

Decisions: lambda = 1 (the official code's default ``ld``); MSE is the mean over embedding
dimensions (the official code's ``nn.MSELoss``). Eq. 6 weights a client's prototype by its
share of the class's samples; we use exactly that, normalised over the clients reporting the
class this round (the printed equation has an extra 1/|N_j|, which would shrink prototypes of
classes many clients hold). Global prototypes of classes nobody reported this round are
kept from earlier rounds. A class with no global prototype gets logit -1e9 at inference
(never predicted unless no class has one, in which case the model's own classifier is used).
Evaluation reports the nearest-prototype prediction as the personalized model (``acc_*``)
and the client's own classifier beside it (``local_acc_*``).
Cold start: the newcomer receives the final global prototypes, starts from the seeded
initial weights and trains ``experiment.coldstart_epochs`` epochs with the same objective
(Eq. 4-5, the prototype regulariser included); it is scored like a training client.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    Plugin,
    aggregate_prototypes,
    at_least,
    capture_embedding,
    clone_state,
    finite,
    hookimpl,
    load_state,
    local_prototypes,
)

NO_PROTOTYPE = -1e9


@define
class FedProtoParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "lambda (Eq. 5), weight of the MSE between embeddings and their class's global prototype "
               "(the official code's default)"})


class NearestPrototype(nn.Module):
    """logits_c = -||f(x) - C-bar^(c)||^2 (classes without a prototype: -1e9)."""

    def __init__(self, model, prototypes, num_classes):
        super().__init__()
        self.model, self.prototypes, self.num_classes = model, prototypes, num_classes

    def forward(self, x):
        store = {}
        with capture_embedding(self.model, store):
            logits = self.model(x)
        if not self.prototypes:
            return logits
        emb = store["emb"].flatten(1)
        classes = sorted(self.prototypes)
        table = torch.stack([self.prototypes[c] for c in classes])
        scores = -torch.cdist(emb, table).pow(2)  # float32 under bf16 autocast too (cdist runs in float32)
        out = torch.full((len(x), self.num_classes), NO_PROTOTYPE, dtype=scores.dtype)
        out[:, classes] = scores
        return out


class FedProto(Plugin):
    name = "fedproto"
    Params = FedProtoParams

    @hookimpl
    def setup(self, ctx):
        ctx.server["prototypes"] = {}

    def load_personal(self, ctx, client):
        return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"prototypes": ctx.server["prototypes"]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_personal(ctx, client)
        client.scratch["global"] = message["prototypes"]
        return True

    def train(self, client, epochs=None):
        """``epochs`` (default training.local_epochs) of SGD on CE + the prototype term."""
        with capture_embedding(client.model, client.scratch):
            return client.train(epochs=epochs)

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(client)
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lambda * MSE(f(x), C-bar^(y)) over the samples whose label has a global prototype."""
        protos = client.scratch.get("global")
        if not protos or "emb" not in client.scratch:
            return None
        emb = client.scratch["emb"].flatten(1)
        known = [i for i, c in enumerate(y.tolist()) if c in protos]
        if not known:
            return None
        target = torch.stack([protos[int(y[i])] for i in known])
        return self.params.lam * F.mse_loss(emb[known], target)

    @hookimpl
    def client_upload(self, ctx, client):
        protos, counts = local_prototypes(client.model, client.data.train_x, client.data.train_y, ctx.num_classes)
        return {"prototypes": protos, "counts": counts}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        new = aggregate_prototypes((m["prototypes"], m["counts"]) for _, m in uploads)
        ctx.server["prototypes"] = {**ctx.server["prototypes"], **new}
        return True

    def scored(self, ctx, model, prototypes):
        return {"": NearestPrototype(model, prototypes, ctx.num_classes), "local_": model}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"prototypes": ctx.server["prototypes"]}  # the global prototypes, for the nearest one

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return self.scored(ctx, self.load_personal(ctx, client), message["prototypes"])

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # initial weights + global prototypes
        self.train(client, ctx.spec.experiment.coldstart_epochs)
        return self.scored(ctx, client.model, message["prototypes"])


__all__ = ["FedProto", "FedProtoParams", "aggregate_prototypes", "local_prototypes"]
