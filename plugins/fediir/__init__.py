"""FedIIR: Guo, Guo, Cao, Wu and Chang, "Out-of-Distribution Generalization of Federated Learning
via Implicit Invariant Relationships", ICML 2023.

What was read: the paper's abstract only (its method section, equations and algorithm box could
not be read from this machine; the authors' repository, github.com/YamingGuo98/FedIIR, holds a
README and no code), so the step labels (I1)-(I4) below are ours. The abstract: the prediction
disagreement between clients measures how far the model is from an invariant relationship, and
FedIIR reduces it implicitly by aligning the clients' gradients. Every detail follows the
reference implementation of FL-bench (github.com/KarhouTam/FL-bench at commit
06e658bca5af6ce732e25bb7c0f8be321e14a85e, ``src/client/fediir.py`` and ``src/server/fediir.py``),
read in full, not copied.

The classifier c is the model's last parameterised layer; g_i(w) = grad_c R_i(w) is the gradient
of client i's task loss R_i (mean cross-entropy over its train split, or an add-on's
``task_loss``) with respect to the classifier's parameters only. The server keeps the global
model w and an exponential moving average g_bar of the clients' classifier gradients, the zero
vector before any upload arrives (FL-bench's start). Each round t:

    (I1) the server sends w^t and g_bar^t to each participant                         (on_broadcast)
    (I2) client i loads w^t and computes g_i(w^t) over its whole train split (batches of
         training.batch_size, each weighted by its size: the full-split mean), in training
         mode; the model is reloaded afterwards, so BatchNorm statistics are unchanged  (on_receive)
    (I3) local training: training.local_epochs epochs of the configured optimiser on
             R_i(w) + penalty * || grad_c R_i(w; batch) - g_bar^t ||^2
         per batch, the inner gradient taken with create_graph, so the penalty's own gradient
         flows through it (a double backward)                                       (local_objective)
         upload: the trained weights w_i^{t+1} and g_i(w^t)                           (client_upload)
    (I4) w^{t+1} = sum_i p_i w_i^{t+1} (FedAvg, p_i = client_weighting's train sizes, over the
         uploads that arrived);
         g_bar^{t+1} = ema * g_bar^t + (1 - ema) * sum_i p_i g_i(w^t)                (server_aggregate)

What is evaluated: every client on w^t, the global model (FedIIR trains one model for clients
inside and outside the federation). Cold-start clients (``experiment.coldstart_clients``, the
paper's non-participating clients) receive w and fine-tune it with the plain loss, as FedAvg's.

Deviations:

- Timing of g_bar (from FL-bench): FL-bench collects every participant's g_i(w^t) in an extra
  exchange before round t's training and trains round t against an average that includes them;
  pfl's round has one broadcast and one upload, so g_i(w^t) travels with round t's upload and
  first steers round t + 1: the target is one round older. In round 1 the target is the zero
  vector (the average before any gradient), so the penalty is penalty * ||g_i||^2 there.
- FL-bench's ``calculate_grad_mean`` returns the blended average without storing it, so its
  average stays zero and each round's target is (1 - ema) times that round's mean (0.05 times at
  the default ema): the moving average never accumulates. Here it is stored and accumulates
  (I4), as its ``ema`` parameter states.
- FL-bench runs the whole gradient exchange again for each client it packages (once per
  participant per round); here each participant computes its g_i once. FL-bench averages
  per-batch gradients over the total number of batches (partial last batches count as whole
  ones) and skips batches of one sample; here g_i is the exact full-split mean and the
  server weights it by p_i (train sizes).
- FL-bench computes features with ``model.base`` and applies a ReLU before ``model.classifier``
  (its model family); here the classifier is the last parameterised layer of any pfl model,
  read with the model's own forward.
- A lost upload (``dropout``): neither the weights nor g_i reach the server, so g_bar is
  updated from the arrivals only; when nothing arrives w and g_bar stay. The client keeps no
  state of its own (nothing is staged).
- The gradient pass (I2) is counted as one pass over the private data: the declared budget is
  training.local_epochs + 1 private epochs a round (``budget.private_epochs`` measures it too;
  it takes no optimiser step, so ``budget.private_steps`` is FedAvg's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import LocalWork, WeightAveraging, at_least, between, classifier, finite, hookimpl


@define
class FedIIRParams:
    penalty: float = field(default=1e-3, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the gradient-alignment penalty ||grad_classifier R_i - g_bar||^2 (I3); 0 is FedAvg "
               "bit for bit. Default: FL-bench's 1e-3"})
    ema: float = field(default=0.95, validator=between(0, 1, high_open=True), metadata={
        "doc": "decay of the server's moving average g_bar = ema * g_bar + (1 - ema) * mean_i g_i (I4); 0 keeps "
               "only the last round's mean. Default: FL-bench's 0.95"})


def classifier_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters of the model's last parameterised layer, by their names in ``model``."""
    head = {id(p) for p in classifier(model).parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in head}


def task_loss(ctx, client, logits, y) -> torch.Tensor:
    """The task term the client trains on: an add-on's ``task_loss`` when one answers, else cross-entropy."""
    answer = ctx.hooks.task_loss(ctx=ctx, client=client, logits=logits, y=y)
    return F.cross_entropy(logits, y) if answer is None else answer


def mean_classifier_gradient(ctx, client, model) -> dict[str, torch.Tensor]:
    """(I2): g_i(w) = grad_c R_i(w) over the client's whole train split, in batches weighted by size."""
    head = classifier_parameters(model)
    x, y = client.data.train_x, client.data.train_y
    total = {name: torch.zeros_like(p) for name, p in head.items()}
    size, n = ctx.spec.training.batch_size, len(y)
    model.train()
    for start in range(0, n, size):
        xb, yb = x[start:start + size], y[start:start + size]
        grads = torch.autograd.grad(task_loss(ctx, client, model(xb), yb), list(head.values()))
        for name, grad in zip(head, grads):
            total[name] += grad * (len(yb) / n)
    client.count_work(private=n)
    return total


class FedIIR(WeightAveraging):
    """FedIIR (Guo et al. 2023): FedAvg whose clients also penalise the distance between their
    classifier gradient and the server's moving average of the clients' classifier gradients.
    Budget: ``training.local_epochs`` + 1 (the gradient pass)."""

    name = "fediir"
    Params = FedIIRParams

    def local_work(self, spec) -> LocalWork:
        """training.local_epochs, plus the gradient pass (I2): one more pass when the penalty is on."""
        return LocalWork(float(spec.training.local_epochs) + (1.0 if self.params.penalty > 0 else 0.0))

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        """(I1): w^t, and g_bar^t once some gradient has arrived (before that it is zero)."""
        message = {"weights": ctx.server["global"]}
        if "gradient_average" in ctx.server and client_id in ctx.participants:
            message["gradient_average"] = ctx.server["gradient_average"]
        return message

    @hookimpl
    def on_receive(self, ctx, client, message):
        """(I2): load w^t, compute g_i(w^t), reload w^t (the pass may move BatchNorm statistics)."""
        super().on_receive(ctx, client, message)
        if client.id not in ctx.participants or self.params.penalty == 0:
            return True  # a cold-start client, or plain FedAvg: no penalty, no gradient pass
        gradient = mean_classifier_gradient(ctx, client, client.model)
        super().on_receive(ctx, client, message)
        average = message.get("gradient_average") or {name: torch.zeros_like(g) for name, g in gradient.items()}
        client.scratch["fediir"] = {"gradient": gradient, "average": average}
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(I3): penalty * ||grad_c R_i(w; batch) - g_bar||^2, differentiable through the gradient."""
        own = client.scratch.get("fediir")
        if own is None or model is not client.model:
            return None  # no term
        head = classifier_parameters(model)
        grads = torch.autograd.grad(task_loss(ctx, client, logits, y), list(head.values()), create_graph=True)
        average = own["average"]
        distance = sum(((grad - average[name]) ** 2).sum() for name, grad in zip(head, grads))
        return self.params.penalty * distance

    @hookimpl
    def client_upload(self, ctx, client):
        upload = {"weights": client.model.state_dict()}
        own = client.scratch.get("fediir")
        if own is not None:
            upload["gradient"] = own["gradient"]
        return upload

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(I4): FedAvg of the weights; g_bar <- ema g_bar + (1 - ema) sum_i p_i g_i over the arrivals."""
        mean: dict[str, torch.Tensor] = {}

        def tapped():
            for i, message in uploads:  # each upload is valid until the next client runs: summed now
                for name, grad in message.get("gradient", {}).items():
                    mean[name] = mean[name] + weights[i] * grad if name in mean else weights[i] * grad
                yield i, message

        super().server_aggregate(ctx, tapped(), weights)
        if mean:
            decay = self.params.ema
            old = ctx.server.get("gradient_average") or {name: torch.zeros_like(g) for name, g in mean.items()}
            ctx.server["gradient_average"] = {name: decay * old[name] + (1 - decay) * mean[name] for name in mean}
        return True


__all__ = ["FedIIR", "FedIIRParams"]
