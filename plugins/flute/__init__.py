"""FLUTE: Liu, Shen and Yang, "Federated Representation Learning in the Under-Parameterized
Regime", ICML 2024 (arXiv:2406.04596).

What was read: the paper's abstract and summaries of it only (its algorithm box and the section
extending FLUTE beyond linear models could not be read from this machine), so the step labels
(C1)-(C2), (S1)-(S2) below are ours, and the losses, their order and the server step follow
FL-bench's implementation of the paper's general (non-linear) version, read in full, not copied:
github.com/KarhouTam/FL-bench at 06e658bca5af6ce732e25bb7c0f8be321e14a85e,
``src/client/flute.py`` and ``src/server/flute.py`` (on top of its FedPer, ``src/client/fedper.py``).
PFLlib has no FLUTE.

The model is a shared body phi (the representation) and a personal head, the classifier
(weight W_i of shape C x d, its bias b_i). u_i in {0, 1}^C marks the classes in client i's
training split. The neural-collapse regulariser of a head is

    NC(W, u) = || W W^T / ||W W^T||_F  -  (I_C - 1 1^T / C) * (u u^T) / sqrt(C - 1) ||_F

(``*`` entry by entry): it pulls the normalised Gram matrix of the rows of the classes the client
holds towards a simplex equiangular tight frame over those classes, and the other rows towards
orthogonality. Each round t, with E = training.local_epochs and R = ``rep_epochs``:

    server: sends phi^t and each participant's head weight W_i (after its last server step)
    client i, from phi^t and its own head:
    (C1) epochs 1 .. E - R: SGD on the head only (phi frozen) on
             CE + lam1 NC(W_i, u_i) + lam2 ||W_i||_F^2
    (C2) epochs E - R + 1 .. E: SGD on phi and the head together on
             CE + lam1 NC(W_i, u_i) + lam2 ||W_i||_F^2 + lam3 ||H||_F^2
         H the batch's features (the classifier's input), summed over the batch;
         uploads phi_i, W_i and u_i (one bit per class)
    server, over the round's arrived uploads A:
    (S1) phi^{t+1} = sum_{i in A} n_i phi_i / sum_{i in A} n_i  (FedAvg on the body)
    (S2) one gradient step on the heads of sum_{i in A} NC(W_i, u_i) / |A|:
             W_i <- W_i - server_lr / |A| * grad NC(W_i, u_i), kept for client i's next round

What is evaluated: client i on phi^t with its own head, W_i after the server step (S2) of its
last delivered upload, i.e. the model it starts its next round from (FL-bench tests this model
before local training). A client's buffers (BatchNorm's running statistics in the body) are
averaged with the body, as FedPer's.

Defaults: FL-bench's (lam1 = 0.25, lam2 = 0.0025, lam3 = 0.0005, rep_epochs = 1,
server_lr = 0.5 for its ``nc2_lr``); its ``gamma1`` and ``gamma2`` are parsed but never used there
and are not parameters here. lam1 = lam2 = lam3 = server_lr = 0 with rep_epochs = E is FedPer
(head_layers = 1) bit for bit.

Decisions and deviations:

- The server step (S2) is FL-bench's: the paper's summary describes a server step that
  optimises the representation and all heads together; FL-bench (and this plugin) averages the
  body and steps the heads on the NC term only.
- A client's first head is the seeded initial classifier (FedPer's convention, and the paper's
  data-independent random initialisation). FL-bench averages the classifiers into its global
  model as well, so a client's first round starts from the average of the earlier participants'
  classifiers; only then does it keep its own.
- (C1) -> (C2): FL-bench keeps one optimiser and zeroes the body's gradients in the head-only
  epochs; here each phase gets the configured optimiser afresh over the part it trains (the
  same steps for plain SGD; momentum and Adam state restart at the phase boundary). Every other
  ``local_objective`` term (an add-on's) and ``task_loss`` still apply. Each phase is one
  ``client.train`` call, which draws the round's seeded batch order afresh: the first joint
  epoch visits the batches in the order of the first head-only epoch (FL-bench's loader
  reshuffles every epoch).
- The head is the classifier only (FL-bench's FedPer head); there is no ``head_layers``.
- Lost uploads (docs/writing-a-plugin.md, "Client state and lost uploads"): a head's round is
  local training followed by the server's step (S2), so the head advances only with a delivered
  upload (``client.staged``): after a lost upload the client starts its next round from the head
  it started the lost one with, and the server's heads stay as they were.
- The server step runs over the arrived uploads (FL-bench: the selected clients, which all
  arrive there); |A| counts the arrivals.
- Cold-start clients (held out) never upload, so have no server head: they receive phi and
  fine-tune it with the seeded initial head (experiment.coldstart_epochs, the core default).
- Only one architecture (the body is averaged), and the classifier must be a linear layer
  (a 2-D weight, C rows).
- Bytes: phi and W_i down; phi, W_i and u_i (1 bit per class) up. The server holds phi and
  W_i for every client whose upload has arrived.
"""

from __future__ import annotations

import math

import torch
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    Packed,
    SpecError,
    at_least,
    capture_embedding,
    classifier,
    finite,
    head_keys,
    hookimpl,
    load_state,
    parameterised_layers,
    per_run,
    weighted_average,
)
from pfl_plugins.fedper import FedPer


@define
class FluteParams:
    lam1: float = field(default=0.25, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the neural-collapse term NC(W_i, u_i) in the local loss (C1, C2). Default: "
               "FL-bench's lamda1"})
    lam2: float = field(default=0.0025, validator=[finite, at_least(0)], metadata={
        "doc": "weight of ||W_i||_F^2, the head weight's squared norm, in the local loss (C1, C2). Default: "
               "FL-bench's lamda2"})
    lam3: float = field(default=0.0005, validator=[finite, at_least(0)], metadata={
        "doc": "weight of ||H||_F^2, the batch's features (the classifier's input) summed over the batch, in "
               "the joint epochs (C2). Default: FL-bench's lamda3"})
    rep_epochs: int = field(default=1, validator=at_least(1), metadata={
        "doc": "the last rep_epochs of the training.local_epochs epochs train the body and the head together "
               "(C2); the epochs before train the head alone (C1); at most training.local_epochs. Default: "
               "FL-bench's rep_round"})
    server_lr: float = field(default=0.5, validator=[finite, at_least(0)], metadata={
        "doc": "step size of the server's gradient step on the heads' mean NC term (S2); 0 skips it. "
               "Default: FL-bench's nc2_lr"})


def simplex_target(labels: torch.Tensor) -> torch.Tensor:
    """(I - 1 1^T / C) * (u u^T) / sqrt(C - 1) for the 0/1 class indicator u (length C)."""
    c = labels.numel()
    u = labels.to(torch.float32).reshape(c, 1)
    centred = torch.eye(c) - torch.full((c, c), 1.0 / c)
    return centred * (u @ u.T) / math.sqrt(c - 1)


def collapse_distance(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """NC(W, u) = || W W^T / ||W W^T||_F - target ||_F (a differentiable scalar)."""
    gram = weight @ weight.T
    return torch.linalg.matrix_norm(gram / torch.linalg.matrix_norm(gram) - target.to(weight))


def server_head_step(weight: torch.Tensor, labels: torch.Tensor, step: float) -> torch.Tensor:
    """(S2) for one head: W - step * grad_W NC(W, u), step = server_lr / |A|."""
    w = weight.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(collapse_distance(w, simplex_target(labels)), w)
    return (w - step * grad).detach()


class Flute(FedPer):
    """FLUTE (Liu et al. 2024): a shared body and personal classifiers trained with a
    neural-collapse regulariser, which the server also steps on (see the module doc)."""

    name = "flute"
    Params = FluteParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(spec.training.local_epochs))  # C1 + C2: training.local_epochs epochs

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        if self.params.rep_epochs > spec.training.local_epochs:
            raise SpecError(f"{self.spec_path}.params.rep_epochs",
                            f"must not exceed training.local_epochs ({spec.training.local_epochs}), "
                            f"got {self.params.rep_epochs}")

    def split(self, ctx) -> tuple[list[str], list[str]]:
        """(body keys, head keys): the head is the classifier (FL-bench's FedPer head)."""
        def compute():
            model = ctx.models.working(ctx.models.arch_of(0))
            if len(parameterised_layers(model)) < 2:
                raise SpecError("model.name", "flute needs a body before the classifier: the model has one "
                                              "parameterised layer")
            head = set(head_keys(model))
            keys = list(model.state_dict())
            return [k for k in keys if k not in head], [k for k in keys if k in head]
        return per_run(ctx, self, "body_head", compute)

    def weight_key(self, ctx) -> str:
        """The state-dict key of the classifier's weight W (C x d)."""
        def compute():
            model = ctx.models.working(ctx.models.arch_of(0))
            weight = classifier(model).weight
            if weight.dim() != 2:
                raise SpecError("model.name", f"flute needs a linear classifier (a 2-D weight), got a "
                                              f"{weight.dim()}-D one")
            return next(k for k, p in model.named_parameters() if p is weight)
        return per_run(ctx, self, "weight_key", compute)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        self.weight_key(ctx)  # a model the regulariser cannot take fails here
        ctx.server["heads"] = {}  # W_i after (S2), from client i's first arrived upload on

    def head_message(self, ctx, client_id) -> dict:
        message = {"body": ctx.server["body"]}
        if client_id in ctx.server["heads"]:
            message["head_weight"] = ctx.server["heads"][client_id]
        return message

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return self.head_message(ctx, client_id)

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.head_message(ctx, client_id)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        bodies, heads = [], []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            bodies.append((weights[client_id], {k: v.detach().clone() for k, v in message["body"].items()}))
            heads.append((client_id, message["head_weight"].detach().clone(), message["labels"].value.clone()))
        if not heads:  # nobody's upload arrived: everything stays
            return True
        ctx.server["body"] = weighted_average(iter(bodies))  # (S1)
        step = self.params.server_lr / len(heads)  # (S2): the mean over the arrivals
        stepped = dict(ctx.server["heads"])
        for client_id, weight, labels in heads:
            stepped[client_id] = server_head_step(weight, labels, step) if step else weight
        ctx.server["heads"] = stepped
        return True

    # -- client side ---------------------------------------------------------------------------

    def load_personal(self, ctx, client, body, head_weight=None):
        """``body`` + the client's own head, whose weight is the server's W_i once it has one."""
        model = super().load_personal(ctx, client, body)
        if head_weight is not None:
            load_state(model, {self.weight_key(ctx): head_weight})
        return model

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_personal(ctx, client, message["body"], message.get("head_weight"))
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_personal(ctx, client, message["body"], message.get("head_weight"))}

    def class_indicator(self, ctx, client) -> torch.Tensor:
        """u_i: True for the classes in the client's training split."""
        return torch.as_tensor(client.data.label_counts() > 0)

    @hookimpl
    def local_train(self, ctx, client):
        p = self.params
        model = client.model
        weight = dict(model.named_parameters())[self.weight_key(ctx)]
        target = simplex_target(self.class_indicator(ctx, client)).to(weight.device)
        store = {}

        def loss(with_features):
            def batch_loss(m, x, y, logits):
                total = client.objective(m, x, y, logits)
                total = total + p.lam1 * collapse_distance(weight, target) + p.lam2 * weight.pow(2).sum()
                if with_features:
                    total = total + p.lam3 * store["emb"].pow(2).sum()
                return total
            return batch_loss

        head_keys = set(self.head_keys(ctx))
        head = [q for k, q in model.named_parameters() if k in head_keys]
        body = [q for k, q in model.named_parameters() if k not in head_keys]
        head_only = ctx.spec.training.local_epochs - p.rep_epochs
        metrics = {}
        with capture_embedding(model, store):
            if head_only:  # (C1): the body frozen
                for q in body:
                    q.requires_grad_(False)
                try:
                    metrics = client.train(epochs=head_only, optimizer=client.optimizer(params=head),
                                           loss_fn=loss(False))
                finally:
                    for q in body:
                        q.requires_grad_(True)
            metrics = client.train(epochs=p.rep_epochs, loss_fn=loss(True))  # (C2): everything
        state = model.state_dict()
        # the head advances with the delivered upload only (the server steps its weight, S2)
        client.staged["head"] = {k: state[k].detach().clone() for k in self.head_keys(ctx)}
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        state = client.model.state_dict()
        return {"body": {k: state[k] for k in self.body_keys(ctx)},
                "head_weight": state[self.weight_key(ctx)],
                "labels": Packed(self.class_indicator(ctx, client), 1)}


__all__ = ["Flute", "FluteParams", "collapse_distance", "server_head_step", "simplex_target"]
