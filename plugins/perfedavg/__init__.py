"""Per-FedAvg: Fallah, Mokhtari and Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1 with its two
efficient approximations, Per-FedAvg (FO) and Per-FedAvg (HF).

The server learns a meta-model w that each user adapts with one step of gradient descent on its
own loss (the MAML problem of Section 3):

    (1)  min_w F(w) = sum_i p_i f_i(w - alpha grad f_i(w))

Algorithm 1, as run here:

    server: w^0 = the seeded initial weights
    each round k, each participant i, from w_{k+1,0}^i = w_k:                      (on_receive)
        for t = 1 .. tau (mini-batches D, D' (and D'') of training.local_epochs epochs):  (local_train)
            (2)  w_tilde = w_{t-1} - alpha grad f_i(w_{t-1}; D)                       (the adaptation step)
            (3)  FO: w_t = w_{t-1} - beta grad f_i(w_tilde; D')
                 HF: w_t = w_{t-1} - beta (grad f_i(w_tilde; D') - alpha d_t),
                     d_t = [grad f_i(w_{t-1} + delta g; D'') - grad f_i(w_{t-1} - delta g; D'')] / (2 delta),
                     g = grad f_i(w_tilde; D')   (a Hessian-vector product by central differences)
        upload w_{k+1,tau}^i                                                      (client_upload)
    w_{k+1} = sum_i n_i / n w_{k+1,tau}^i                                          (server_aggregate: FedAvg's)
    evaluation: client i's adapted model, ``eval_steps`` steps of (2) on its own training
    mini-batches from w_k (Section 5: "one step of local stochastic gradient descent")  (personalized_models)

(Equation labels are this docstring's; (2) and (3) are the local update of Algorithm 1.)

Defaults and decisions:

- ``alpha = 0.01`` (adaptation step), ``beta = 0.001`` (meta step), ``delta = 0.001`` (HF): the
  step sizes of Section 5's MNIST and CIFAR-10 experiments. training.lr is not used: beta is the
  step of the meta-model (to compare at FedAvg's step, set beta = training.lr). The meta step
  is taken by the configured optimiser (momentum, weight decay) at beta; (2) is a plain
  gradient step.
- ``variant = "fo"``: Per-FedAvg (FO), whose cost per sample equals FedAvg's; ``"hf"`` is the
  Hessian-free variant (two extra gradients on D'' per step).
- ``eval_steps = 1``: the paper's one adaptation step at test time; 0 evaluates the meta-model
  itself (tested bit for bit). The adaptation batches come in a seeded order per client and
  evaluation round (``client.generator("adapt")``), batch size training.batch_size.
- Batches: each epoch's shuffled mini-batches are taken in consecutive groups (D, D') for FO,
  (D, D', D'') for HF; a group that the epoch cannot fill is left out, as ``drop_last`` leaves
  out a partial batch (a client with fewer batches than a group reuses its batches cyclically,
  so it still takes one step). One synchronisation per round: tau = the steps of
  training.local_epochs epochs.
- Aggregation is FedAvg's n_i-weighted mean (Algorithm 1 writes the plain mean over the
  sampled users; equal for equal client sizes).
- Budget (``local_work``): FO, training.local_epochs private epochs per round (an epoch is one
  pass over the client's data, a left-out group counted like a dropped remainder); HF, 4/3 as
  much (D'' goes through two passes; measured exactly, so it differs from the declared 4/3 by
  the left-out groups).
- Bytes: FedAvg's.
- Cold start: the newcomer adapts the final meta-model with ``eval_steps`` steps of (2), the
  paper's premise for new users (``experiment.coldstart_epochs`` is not used).
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    at_least,
    batch_order,
    batch_starts,
    finite,
    greater_than,
    hookimpl,
    load_state,
    mean_training_loss,
    one_of,
)
from pfl_plugins.fedavg import FedAvg


@define
class PerFedAvgParams:
    alpha: float = field(default=0.01, validator=[finite, at_least(0)], metadata={
        "doc": "adaptation (inner) step size, in training and before evaluation"})
    beta: float = field(default=0.001, validator=[finite, greater_than(0)], metadata={
        "doc": "meta (outer) step size, taken by the configured optimiser; training.lr is not used"})
    variant: str = field(default="fo", validator=one_of("fo", "hf"), metadata={
        "doc": "first order, or Hessian-free (a central-difference Hessian-vector product)"})
    delta: float = field(default=0.001, validator=[finite, greater_than(0)],
                         metadata={"doc": "HF's difference step"})
    eval_steps: int = field(default=1, validator=at_least(0), metadata={
        "doc": "adaptation steps before evaluation and for cold-start clients; 0 evaluates the meta-model"})


def gradient(model, x, y, loss_fn):
    """(loss, grad f(theta; (x, y))) at the model's current parameters (no .grad written)."""
    params = list(model.parameters())
    loss = loss_fn(model, x, y, model(x))
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def set_parameters(model, values) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)


def adaptation_step(model, alpha: float, x, y, loss_fn) -> torch.Tensor:
    """(2): theta <- theta - alpha grad f(theta; (x, y)), in place; returns f before the step."""
    loss, grads = gradient(model, x, y, loss_fn)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(alpha * g)
    return loss


def meta_step(model, outer, alpha: float, batch, batch2, loss_fn, hessian_batch=None, delta: float = 0.001):
    """One local step t of Algorithm 1, (2) then (3), on the model's parameters (w_{t-1}).

    ``batch``, ``batch2``, ``hessian_batch``: (x, y) for D, D', D'' (HF when given). The meta
    gradient is handed to ``outer`` (an optimiser over ``model.parameters()``, step size beta).
    Returns f(w_{t-1}; D)."""
    w = [p.detach().clone() for p in model.parameters()]
    loss = adaptation_step(model, alpha, *batch, loss_fn)  # model holds w_tilde
    _, g = gradient(model, *batch2, loss_fn)  # grad f(w_tilde; D')
    if hessian_batch is not None:
        set_parameters(model, [wi + delta * gi for wi, gi in zip(w, g)])
        _, plus = gradient(model, *hessian_batch, loss_fn)
        set_parameters(model, [wi - delta * gi for wi, gi in zip(w, g)])
        _, minus = gradient(model, *hessian_batch, loss_fn)
        g = [gi - alpha * (a - b) / (2 * delta) for gi, a, b in zip(g, plus, minus)]
    set_parameters(model, w)
    for p, gi in zip(model.parameters(), g):
        p.grad = gi
    outer.step()
    return loss


class PerFedAvg(FedAvg):
    """Per-FedAvg (Fallah et al. 2020): MAML steps on the client (first-order or Hessian-free);
    before evaluation, and for a cold-start client, the model adapts ``eval_steps`` steps on the
    client's training batches. FedAvg's bytes. Budget: ``training.local_epochs`` (FO), 4/3 of it
    (HF)."""

    name = "perfedavg"
    Params = PerFedAvgParams

    def local_work(self, spec) -> LocalWork:
        per_epoch = 4.0 / 3.0 if self.params.variant == "hf" else 1.0
        return LocalWork(per_epoch * spec.training.local_epochs)

    def batches(self, client, generator) -> list[torch.Tensor]:
        """One epoch's mini-batches (index tensors) of the client's train split, in a seeded order."""
        training = client.ctx.spec.training
        order = batch_order(client.num_train, generator, training.shuffle)
        return [order[s:s + training.batch_size]
                for s in batch_starts(client.num_train, training.batch_size, training.drop_last)]

    def local_update(self, ctx, client) -> dict:
        model, p = client.model, self.params
        x, y = client.data.train_x, client.data.train_y
        hf = p.variant == "hf"
        group = 3 if hf else 2
        outer = client.optimizer(lr=p.beta)
        generator = client.generator("train")
        model.train()
        losses = []
        for _ in range(ctx.spec.training.local_epochs):
            batches = self.batches(client, generator)
            extra, seen = 0, 0
            for s in range(max(1, len(batches) // group)):
                d, d1, *d2 = (batches[(s * group + j) % len(batches)] for j in range(group))
                # a straggler's budget counts the step's group of mini-batches, each asked for
                if not all(client.take_batch() for _ in range(group)):
                    break
                hessian = (x[d2[0]], y[d2[0]]) if hf else None
                losses.append(meta_step(model, outer, p.alpha, (x[d], y[d]), (x[d1], y[d1]), client.objective,
                                        hessian_batch=hessian, delta=p.delta))
                extra += len(d2[0]) if hf else 0
                seen += len(d) + len(d1) + (len(d2[0]) if hf else 0)
            else:
                client.count_work(private=client.num_train + extra)  # one pass, plus D'''s second in HF
                continue
            client.count_work(private=seen)  # the budget ran out: the samples of the steps taken
            break
        return mean_training_loss(losses)

    def adapt(self, ctx, client, meta: dict):
        """The personalised model: ``eval_steps`` steps of (2) from the meta-model ``meta`` in the
        working model, on the client's training mini-batches (seeded order per evaluation round)."""
        model = load_state(client.model, meta)
        if self.params.eval_steps:
            batches = self.batches(client, client.generator("adapt"))
            model.train()
            for s in range(self.params.eval_steps):
                idx = batches[s % len(batches)]
                adaptation_step(model, self.params.alpha, client.data.train_x[idx], client.data.train_y[idx],
                                client.objective)
            client.count_work(private_steps=self.params.eval_steps)  # evaluation-time: budget.finetune_steps
        return model

    @hookimpl
    def local_train(self, ctx, client):
        return self.local_update(ctx, client)

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.adapt(ctx, client, message["weights"])}  # the global meta-model

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        return {"": self.adapt(ctx, client, message["weights"])}  # its broadcast: the meta-model


__all__ = ["PerFedAvg", "PerFedAvgParams", "adaptation_step", "meta_step"]
