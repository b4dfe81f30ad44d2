"""FedGC: Niu and Deng, "Federated Learning for Face Recognition with Gradient Correction", AAAI 2022
(arXiv:2112.07246).

What was read: the paper's abstract and introduction only (its method section, equations and
algorithm box could not be read from this machine), so the step labels (G1)-(G4) below are ours
and every detail follows PFLlib's implementation, read in full (not copied): github.com/TsingZ0/PFLlib
at d832e76f6a23b833038949ec1e4fdefe63a4d350, ``system/flcore/servers/servergc.py`` and
``system/flcore/clients/clientgc.py`` (last changed in b9565b0c5f5c17ae0dd89e9f158c3dc219eac852).
FL-bench has no FedGC.

The paper's setting is face recognition with identity-disjoint clients: each client owns the
class embeddings (classifier rows) of its identities and never shares them; the shared backbone
is averaged, and the server corrects the class embeddings with a softmax-like regulariser that
pushes the embeddings of different clients' classes apart (the cross-client negatives that local
softmax training cannot see). With C_k the classes in client k's training split and W_k its
classifier rows (W_{k,c} for c in C_k):

    (G1) local training: client k trains the backbone theta and its rows W_{k,c}, c in C_k, for
         training.local_epochs epochs of the configured optimiser on the cross-entropy of the
         logits of its own classes only (the softmax over C_k: a class it lacks is no
         negative)                                                         (task_loss, local_train)
         and uploads theta_k and its rows W_{k,c}, c in C_k, with C_k (1 bit per class)  (client_upload)
    (G2) server: theta = sum_k p_k theta_k over the round's arrived uploads (p_k =
         client_weighting's weights, train sizes by default); each arrived client's rows replace
         the server's copy of them                                                (server_aggregate)
    (G3) per class c held by some client the server knows, the anchor e_c = the mean of W_{k,c}
         over the holders of c (a constant: no gradient flows through it), and the regulariser

            Reg = sum_k sum_{c in C_k} -log( exp(e_c . e_c) /
                                            (exp(e_c . e_c) + sum_{j : c not in C_j} sum_{l in C_j} exp(W_{j,l} . e_c)) )

         i.e. each class term is counted once per holder; a class every known client holds has
         no negatives and contributes 0                                      (correction_loss)
    (G4) one plain gradient step on every known client's rows:
         W_{j,l} <- W_{j,l} - lam * training.lr * dReg/dW_{j,l}                  (correct_rows)
         The gradient reaches only rows of clients that lack c, in the direction of +e_c, so the
         step moves them away from the anchor (it decreases W_{j,l} . e_c).

How it maps to label skew (PFLlib's use, and the setting here): classes are shared by several
clients, so each client still keeps its own row for each class it holds (rows of one class are
never averaged across clients); the anchor of a shared class is the mean of its holders' rows,
and its negatives are all the rows of the clients that do not hold it. Rows of other holders of c
(of c or of any of their classes) are neither pulled towards nor pushed from e_c. Under
identity-disjoint clients (the paper's case) every class has one holder and e_c is that client's
own row, so (G3) is the paper's cross-client term.

What is evaluated: client k with the current theta, its rows as the server holds them after
(G4) (the model it starts its next round from, what PFLlib tests), its own BatchNorm statistics,
and the logits of the classes outside C_k set to -inf (its classifier has rows for C_k only),
without local steps. A test sample of a class the client never trained on is therefore always
wrong, with loss inf; the stratified split keeps every test class in the training split, so that
happens only with data given as fixed splits. A client the server has no rows from yet (it has
not delivered an upload) is evaluated with the initial classifier rows.

Deviations, from PFLlib (the paper's own details could not be read):

- **Which clients the regulariser sees.** PFLlib's server reads every client's classes and
  initial rows at start-up; here the server knows a client's classes and rows from its first
  delivered upload on (the server never reads client data), so (G3) and (G4) run over the
  clients that have delivered at least one upload.
- **The classifier's bias.** PFLlib replaces the head by a bias-free linear layer; pfl's models
  keep their classifier's bias. Each client's bias entries of its classes travel and are kept
  with its rows (they train in (G1)) but are not part of Reg: the class embeddings are the
  weight rows.
- **Rows of classes a client lacks.** PFLlib's client classifier has no such rows; here the
  model keeps its full classifier, and the rows of the classes outside C_k are masked out of the
  softmax in (G1) and evaluation, never uploaded, and stay at the seeded initial values on the
  server. The logits of the client's own classes are PFLlib's exactly.
- **Numerics.** -log(exp(a) / (exp(a) + sum exp(s))) is computed as logsumexp(a, s) - a (PFLlib
  exponentiates directly, which overflows to inf/nan once e_c . e_c passes about 88 in float32).
- **PFLlib's evaluation** maps a test label the client lacks to its local class 0 (counted right
  when class 0's row wins); here such a sample counts wrong (see above).
- ``lam = 1.0``: PFLlib's default (``-lam``); its server step is lam * the local learning rate.
- One architecture (the backbone average is entry by entry); the model's last parameterised
  layer must be a linear classifier whose output is the model's logits (checked in ``setup``).
- Budget: training.local_epochs private epochs per round (FedAvg's). Bytes: theta and the
  client's full classifier down (the rows of other classes are the initial ones); theta, the
  rows (and bias entries) of C_k and C_k as 1 bit per class up. The server holds theta and,
  per client that has uploaded, a classifier and its class set.
- Lost uploads (``dropout``): the server keeps the client's previous rows and classes (the
  client's training of its rows is lost with the upload, as in PFLlib), and the client keeps its
  BatchNorm statistics (its own); nothing is staged (docs/writing-a-plugin.md, "Client state
  and lost uploads").
- Cold start (held-out clients): the final theta and the initial classifier rows, fine-tuned for
  experiment.coldstart_epochs epochs on (G1)'s loss (the core default), evaluated like the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    KeepsOwnEntries,
    Packed,
    SpecError,
    at_least,
    classifier,
    classifier_gives_the_logits,
    finite,
    head_keys,
    hookimpl,
    model_key,
    per_run,
    require_single_architecture,
    weighted_average,
)


@define
class FedGCParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "server step size of the class-embedding correction (G4) as a multiple of training.lr "
               "(eta_s = lam * training.lr); 0: no correction. Default: PFLlib's 1.0"})


def linear_classifier_gives_the_logits(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``model``'s last parameterised layer is a linear layer whose output is the model's output."""
    return isinstance(classifier(model), nn.Linear) and classifier_gives_the_logits(model, x)


def own_classes(client) -> torch.Tensor:
    """C_k as a bool mask over the dataset's classes: the classes of the client's training split."""
    return torch.as_tensor(client.data.label_counts() > 0)


def own_class_logits(logits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """The logits with those of the classes outside ``classes`` set to -inf (out of the softmax)."""
    return logits.masked_fill(~classes.to(logits.device), float("-inf"))


class OwnClassesOnly(nn.Module):
    """A client's evaluated model: the model's logits restricted to the client's classes."""

    def __init__(self, model: nn.Module, classes: torch.Tensor):
        super().__init__()
        self.model, self.classes = model, classes

    def forward(self, x):
        return own_class_logits(self.model(x), self.classes)


def correction_loss(rows: dict[int, torch.Tensor], classes: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """(G3) Reg over the clients in ``rows`` (client id -> its [C, d] weight rows; only the rows of
    its ``classes`` count), differentiable in ``rows``; None when no class has a negative."""
    ids = sorted(rows)
    total = None
    for c in range(len(classes[ids[0]])):
        holders = [k for k in ids if classes[k][c]]
        lacking = [j for j in ids if not classes[j][c]]
        if not holders or not lacking:  # nobody's class, or no negatives: log(1) = 0
            continue
        anchor = torch.stack([rows[k][c].detach() for k in holders]).mean(0)
        positive = (anchor @ anchor).reshape(1)
        negatives = torch.cat([rows[j][classes[j]] @ anchor for j in lacking])
        term = len(holders) * (torch.logsumexp(torch.cat([positive, negatives]), 0) - positive[0])
        total = term if total is None else total + term
    return total


def correct_rows(rows: dict[int, torch.Tensor], classes: dict[int, torch.Tensor],
                 step: float) -> tuple[dict[int, torch.Tensor], float]:
    """(G4) one gradient step of size ``step`` on Reg; returns the new rows and Reg before it."""
    ids = sorted(rows)
    leaves = {k: rows[k].detach().clone().requires_grad_(True) for k in ids}
    with torch.enable_grad():
        loss = correction_loss(leaves, classes)
        if loss is None:
            return {k: rows[k].detach().clone() for k in ids}, 0.0
        grads = torch.autograd.grad(loss, [leaves[k] for k in ids], allow_unused=True)
    new = {}
    for k, grad in zip(ids, grads):
        new[k] = leaves[k].detach() if grad is None else leaves[k].detach() - step * grad
    return new, float(loss.detach())


class FedGC(KeepsOwnEntries):
    """FedGC (Niu and Deng 2022): a shared backbone averaged by the server; each client's classifier
    rows for its own classes trained locally on its own classes' softmax and corrected on the server
    by a regulariser that pushes them away from the classes of other clients (see the module doc)."""

    name = "fedgc"
    Params = FedGCParams

    def kept_keys(self, ctx, arch: str) -> list[str]:
        """The state-dict keys each client keeps for itself (buffers)."""
        def compute():
            model = ctx.models.working(arch)
            params = {n for n, _ in model.named_parameters()}
            return [k for k in model.state_dict() if k not in params]
        return per_run(ctx, self, f"kept:{arch}", compute)

    def classifier_keys(self, ctx, arch: str) -> tuple[str, list[str]]:
        """(the classifier's weight key, all its keys: weight and bias)."""
        def compute():
            model = ctx.models.working(arch)
            keys = head_keys(model)
            return next(k for k in keys if k.endswith("weight")), keys
        return per_run(ctx, self, f"head:{arch}", compute)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        model = ctx.models.working(arch)
        probe = ctx.data.clients[ctx.training_clients[0]].train_x[:2]
        if not linear_classifier_gives_the_logits(model, probe):
            raise SpecError(model_key(ctx.spec), f"fedgc's class embeddings are the rows of a linear classifier "
                                                 f"whose output is the model's logits; {arch}'s last layer is not one")
        initial = ctx.models.initial_state(arch)
        names = [n for n, _ in model.named_parameters()]
        _, head = self.classifier_keys(ctx, arch)
        ctx.server["global"] = {n: initial[n].detach().clone().to(ctx.device) for n in names if n not in head}
        ctx.server["heads"] = {}  # client id -> its classifier (weight and bias), from its first upload on
        ctx.server["classes"] = {}  # client id -> C_k, likewise

    def head_for(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        stored = ctx.server["heads"].get(client_id)
        if stored is not None:
            return stored
        arch = ctx.models.arch_of(client_id)
        initial = ctx.models.initial_state(arch)
        return {k: initial[k].to(ctx.device) for k in self.classifier_keys(ctx, arch)[1]}

    def model_for(self, ctx, client_id: int) -> dict[str, torch.Tensor]:
        return {**ctx.server["global"], **self.head_for(ctx, client_id)}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"weights": self.model_for(ctx, client_id)}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        arch = ctx.models.arch_of(0)
        weight_key, _ = self.classifier_keys(ctx, arch)
        heads, classes = dict(ctx.server["heads"]), dict(ctx.server["classes"])
        backbones = []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            mask = message["classes"].value.to(ctx.device).bool()
            head = {k: v.detach().clone() for k, v in self.head_for(ctx, client_id).items()}
            for k, own_rows in message["rows"].items():
                head[k][mask] = own_rows.detach().to(ctx.device)
            heads[client_id], classes[client_id] = head, mask
            backbones.append((weights[client_id],
                              {k: v.detach().clone().to(ctx.device) for k, v in message["weights"].items()}))
        if not backbones:  # nobody's upload arrived: everything stays
            return True
        ctx.server["global"] = weighted_average(backbones)  # (G2)
        step = self.params.lam * ctx.spec.training.lr
        corrected, reg = correct_rows({k: h[weight_key] for k, h in heads.items()}, classes, step)  # (G3), (G4)
        for k, rows in corrected.items():
            heads[k] = {**heads[k], weight_key: rows}
        ctx.server["heads"], ctx.server["classes"] = heads, classes
        ctx.log(fedgc_reg=reg)
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": self.model_for(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def task_loss(self, ctx, client, logits, y):
        return F.cross_entropy(own_class_logits(logits, own_classes(client)), y)  # (G1)

    @hookimpl
    def client_upload(self, ctx, client):
        mask = own_classes(client)
        _, head = self.classifier_keys(ctx, client.arch)
        params = {n: p.detach() for n, p in client.model.named_parameters()}
        return {"weights": {n: p for n, p in params.items() if n not in head},
                "rows": {k: params[k][mask.to(params[k].device)] for k in head},
                "classes": Packed(mask, 1)}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": OwnClassesOnly(self.load_received(ctx, client, message), own_classes(client))}


__all__ = ["FedGC", "FedGCParams", "OwnClassesOnly", "linear_classifier_gives_the_logits", "correct_rows", "correction_loss",
           "own_class_logits", "own_classes"]
