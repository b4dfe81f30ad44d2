"""FedAS: Yang, Huang and Ye, "FedAS: Bridging Inconsistency in Personalized Federated
Learning", CVPR 2024.

The model is shared parameters theta (the body) and personalized parameters phi_i (the
classifier: the last parameterised layer). Each client keeps its whole local model
(theta_i, phi_i) between rounds. Each round t, with S_t the participants:

    server: sends theta^t                                                      (on_broadcast)
    client i in S_t:
        federated parameter alignment (intra-client consistency, Sec. 3.2):
            p_ic = mean of f(x; theta_i) over its samples of class c, with its
                   previous local model (the seeded initial model before its first round)  (A1)
            theta <- theta^t, then align_epochs epochs of SGD (step align_lr) on theta alone:
                   L_align = sum_{c in batch} mean over the batch's class-c samples and
                             dimensions of (f(x; theta) - p_ic)^2                            (A2)
        local training: E epochs of SGD on (theta, phi_i) with cross-entropy     (local_train)
        Fisher information of the trained model on its data (Sec. 3.3):
            F_i = sum over mini-batches b of || grad_w (1/|b|) sum_{(x,y) in b}
                  -log p(y | x; w) ||^2, w = every parameter (``fisher = "all"``)             (A3)
              (the trace of the empirical Fisher information matrix, batch-gradient estimate)
        uploads theta_i and F_i; keeps (theta_i, phi_i)                        (client_upload)
    server: client synchronisation (inter-client consistency, Sec. 3.3):
        theta^{t+1} = sum_{i in S_t} F_i / (sum_{j in S_t} F_j) theta_i                      (A4)
    evaluation: client i's local model (theta_i, phi_i) as it left its last round

(A1)-(A4) label the steps in this docstring; the paper's Sections 3.2-3.3 are the source, but we
could not check its equation numbers, so the labels are ours.

Defaults and decisions:

- ``align_epochs = 1``, ``align_lr = 0.01``: the authors' implementation aligns for one epoch of
  plain SGD at 0.01 (its batches are 16 samples; here ``training.batch_size``). (A2) sums, over
  the classes in the batch, a mean squared error over that class's samples and the feature
  dimensions, as the authors' implementation does. In a client's first round its "previous
  model" is the seeded initial model, as in the authors' implementation (the alignment then
  pulls theta^t towards the initial features; ``align_epochs = 0`` switches it off).
- (A3) follows the authors' implementation: the squared norm of each mini-batch's mean
  gradient, summed over the batches (so it grows with the amount of data), in eval mode, over
  all parameters; ``fisher = "body"`` restricts it to theta. Batches of ``training.batch_size``
  in data order, the last partial one included. The Fisher pass updates nothing and is not
  counted as a training epoch.
- ``weighting = "fisher"`` (A4); ``"samples"`` uses the core's n_i / n instead (the paper's
  ablation without client synchronisation). With ``align_epochs = 0`` and ``"samples"`` FedAS is
  FedPer (tested bit for bit): shared body, personal head, trained jointly. If every F_i is 0,
  theta keeps its previous value.
- Budget (``local_work``): training.local_epochs + align_epochs private epochs per round.
- Bytes: theta down; theta_i and F_i (8 bytes) up.
- Features f(x; theta) are the classifier's input; ``F_i / sum_j F_j`` is logged per client as
  ``fedas_weight`` (``results/client_series.csv``; its mean, min and max over clients as metrics).
- Cold start: the newcomer receives theta, keeps the initial head and trains
  ``experiment.coldstart_epochs`` epochs of plain local training (the core default).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    at_least,
    capture_embedding,
    clone_state,
    hookimpl,
    learning_rate,
    load_state,
    local_prototypes,
    one_of,
    only_training,
    weighted_average,
)
from pfl_plugins.fedpac import ClassifierSplit


@define
class FedASParams:
    align_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs of parameter alignment (A2) a round, before training; 0 switches it off"})
    align_lr: float = field(default=0.01, validator=learning_rate,
                            metadata={"doc": "alignment step size (A2), plain SGD"})
    fisher: str = field(default="all", validator=one_of("all", "body"), metadata={
        "doc": "the parameters whose Fisher trace weights the average (A3)"})
    weighting: str = field(default="fisher", validator=one_of("fisher", "samples"), metadata={
        "doc": 'the body average\'s weights (A4); "samples": n_i / n, the ablation without synchronisation'})

    @property
    def head_layers(self) -> int:
        return 1  # the personalized part: the classifier (FedPer's setup)


def alignment_loss(prototypes: dict, store: dict):
    """(A2) as a ``loss_fn`` for ``Client.train``; the features are ``store["emb"]``."""
    def loss(model, x, y, logits):
        z = store["emb"].flatten(1)
        total = z.sum() * 0.0
        for c in y.unique().tolist():
            if c in prototypes:
                total = total + F.mse_loss(z[y == c], prototypes[c].expand_as(z[y == c]))
        return total
    return loss


def fisher_trace(model, x, y, batch_size: int, names=None) -> float:
    """(A3): sum over mini-batches of ||grad of the batch's mean NLL||^2 over the parameters
    ``names`` (all if None), in eval mode."""
    params = [p for n, p in model.named_parameters() if names is None or n in names]
    was = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(y), batch_size):
        nll = F.cross_entropy(model(x[start:start + batch_size]), y[start:start + batch_size])
        grads = torch.autograd.grad(nll, params)
        total += float(sum(g.pow(2).sum() for g in grads))
    model.train(was)
    return total


class FedAS(ClassifierSplit):
    """FedAS (Yang et al. 2024): each client keeps its whole model; the received global body is
    first aligned to the class prototypes of the client's previous model, then the model trains
    on CE; the server averages bodies weighted by each client's Fisher-information trace (share
    logged per client as ``fedas_weight``); the client's own model is evaluated. Budget:
    ``training.local_epochs + align_epochs``."""

    name = "fedas"
    Params = FedASParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(spec.training.local_epochs + self.params.align_epochs))

    def load_local(self, ctx, client):
        """The client's whole local model (the seeded initial model before its first round)."""
        return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = self.load_local(ctx, client)
        if self.params.align_epochs:  # (A1) with the previous local model
            client.scratch["prototypes"], _ = local_prototypes(model, client.data.train_x, client.data.train_y,
                                                               ctx.num_classes)
        load_state(model, message["body"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        model = client.model
        body = set(self.body_keys(ctx))  # FedPer's split
        if self.params.align_epochs:  # (A2): theta^t alone
            store = {}
            with capture_embedding(model, store), only_training(model, body) as params:
                client.train(epochs=self.params.align_epochs,
                             optimizer=client.optimizer(params, lr=self.params.align_lr),
                             loss_fn=alignment_loss(client.scratch["prototypes"], store))
        metrics = client.train()  # E epochs on (theta, phi_i)
        client.state["weights"] = clone_state(model)
        if self.params.weighting == "fisher":  # (A3)
            names = None if self.params.fisher == "all" else body
            client.scratch["fisher"] = fisher_trace(model, client.data.train_x, client.data.train_y,
                                                    ctx.spec.training.batch_size, names)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        message = super().client_upload(ctx, client)  # FedPer's: the body
        if self.params.weighting == "fisher":
            message["fisher"] = client.scratch["fisher"]
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        if self.params.weighting == "samples":
            return super().server_aggregate(ctx, uploads, weights)
        traces = {}

        def pairs():
            for i, message in uploads:
                traces[i] = float(message["fisher"])
                yield traces[i], message["body"]

        total = weighted_average(pairs())  # sum_i F_i theta_i
        norm = sum(traces.values())
        if total is None or not (norm > 0 and math.isfinite(norm)):
            return True  # nobody took part, or no information: theta unchanged
        ctx.server["body"] = {k: v / norm if v.is_floating_point() else v for k, v in total.items()}  # (A4)
        for i, f in traces.items():
            ctx.log_client(i, fedas_weight=f / norm)
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # the client's own model: nothing from the server

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_local(ctx, client)}


__all__ = ["FedAS", "FedASParams", "alignment_loss", "fisher_trace"]
