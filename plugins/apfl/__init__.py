"""APFL: Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", 2020
(arXiv:2003.13461), Algorithm 1 with the adaptive mixing weight.

Every client i keeps a local model v_i and a mixing weight alpha_i in [0, 1] beside its copy w_i
of the global model; its personalised model is the mixture (Section 3)

    (1)  v_bar_i = alpha_i v_i + (1 - alpha_i) w

Algorithm 1 (one round = the tau local steps between two synchronisations), as run here:

    server: w^0 = the seeded initial weights; v_i^0 = the same weights; alpha_i^0 = ``alpha``
    each round, each participant i, from w_i = w (the received global model):   (on_receive)
        for each mini-batch xi of training.local_epochs epochs:                   (local_train)
            (2)  w_i     <- w_i     - eta grad f_i(w_i; xi)
            (3)  v_i     <- v_i     - eta grad_v f_i(v_bar_i; xi)  = v_i - eta alpha_i grad f_i(v_bar_i; xi)
            (4)  alpha_i <- P_[0,1]( alpha_i - eta_alpha grad_alpha f_i(v_bar_i; xi) ),
                 grad_alpha f_i(v_bar_i; xi) = < v_i - w_i , grad f_i(v_bar_i; xi) >
            (all three gradients at the iterates before the step, on the same mini-batch)
        upload w_i                                                                (client_upload)
    w <- sum_i n_i / n w_i                                                        (server_aggregate: FedAvg's)
    evaluation: (1) with the current global w, the client's v_i and alpha_i       (personalized_models)

(Equation labels are this docstring's; (2)-(4) are the update lines of the paper's
Algorithm 1 and the gradient of its adaptive-alpha step, here derived by autograd.)

Defaults and decisions:

- ``adaptive = true``: alpha_i is learned by (4) (the adaptive APFL of the issue); ``adaptive =
  false`` keeps alpha_i = ``alpha`` fixed, the paper's other variant. ``alpha = 1`` fixed is
  Local (v_i trains alone) and ``alpha = 0`` fixed is FedAvg (the evaluated mixture is w); both
  bit for bit, tested.
- ``alpha = 0.5``: the initial (or fixed) mixing weight. The paper reports fixed alpha over
  {0.25, 0.5, 0.75} and adaptive alpha; 0.5 is the middle of that grid (no prior for the
  local or the global model) and the value of the authors' published APFL example command.
- ``alpha_lr = None`` means training.lr: Algorithm 1 uses the one step size eta_t for w, v and
  alpha. After each step alpha is projected onto [0, 1] (the paper constrains alpha_i to
  [0, 1]).
- One synchronisation per round: tau = the local steps of training.local_epochs epochs.
- Aggregation is FedAvg's n_i-weighted mean (Algorithm 1 writes the plain mean over the
  sampled clients; the two coincide for equal client sizes), so alpha = 0 is FedAvg bit for bit.
- (2) is exactly FedAvg's local update (the shared loop, the configured optimiser); (3) uses
  the configured optimiser at training.lr on v_i, fresh each visit like every client's.
  BatchNorm statistics of the mixture are v_i's (kept with v_i); add-on loss terms see the
  working model (w_i) in both losses.
- Budget (``local_work``): 2 x training.local_epochs private epochs per round: every sample
  goes through a forward/backward pass of w_i and one of v_bar_i.
- Bytes: FedAvg's (w down, w_i up); v_i and alpha_i never leave the client.
- A client that never took part is evaluated with (1) from v_i^0 and alpha_i^0.
- Cold start: the newcomer runs one local update (2)-(4) from the final w, v^0, alpha^0 for
  ``experiment.coldstart_epochs`` epochs and is scored with its mixture (1).
"""

from __future__ import annotations

from typing import Optional

import torch
from attrs import define, field
from torch.func import functional_call

from pfl_core.api import LocalWork, between, finite, hookimpl, learning_rate, load_state
from pfl_plugins.fedavg import FedAvg


@define
class APFLParams:
    alpha: float = field(default=0.5, validator=[finite, between(0, 1)], metadata={
        "doc": "every client's initial alpha_i (the fixed one with adaptive = false); the middle of the "
               "paper's grid 0.25, 0.5, 0.75"})
    adaptive: bool = field(default=True, metadata={
        "doc": "learn alpha_i by a gradient step per batch, projected onto [0, 1]; false: fixed "
               "(1 is Local, 0 FedAvg)"})
    alpha_lr: Optional[float] = field(default=None, validator=learning_rate, metadata={
        "doc": "step size of alpha's gradient step; none: training.lr (the paper uses one step size "
               "for w, v and alpha)"})


def mixture(alpha, v: dict, w: dict) -> dict:
    """(1): alpha v + (1 - alpha) w for every tensor of ``v`` (parameters)."""
    return {k: alpha * v[k] + (1 - alpha) * w[k] for k in v}


def mixture_gradients(model, v: dict, buffers: dict, w: dict, alpha, x, y, loss_fn, *, with_alpha: bool):
    """f_i(v_bar; (x, y)) and its gradients w.r.t. v (3) and, ``with_alpha``, alpha (4).

    ``v`` and ``w``: parameter name -> tensor (``v`` requires grad, ``w`` is a constant);
    ``buffers``: the mixture's BatchNorm statistics (updated in place in training mode);
    ``alpha``: a 0-dim tensor (requiring grad ``with_alpha``). ``loss_fn(model, x, y, logits)``.
    Returns (loss, [grad v], grad alpha or None)."""
    logits = functional_call(model, {**mixture(alpha, v, w), **buffers}, (x,))
    loss = loss_fn(model, x, y, logits)
    inputs = [*v.values(), *([alpha] if with_alpha else [])]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    return loss, grads[: len(v)], (grads[-1] if with_alpha else None)


def alpha_step(alpha: float, grad_alpha: float, lr: float) -> float:
    """(4): alpha - lr * grad_alpha, projected onto [0, 1]."""
    return min(1.0, max(0.0, alpha - lr * grad_alpha))


class APFL(FedAvg):
    """APFL (Deng et al. 2020): a local model v_i beside the global w; the evaluated model is the
    mixture ``alpha_i v_i + (1 - alpha_i) w``, alpha_i learned per client (logged per client
    as ``alpha``). FedAvg's bytes. Budget: ``2 * training.local_epochs`` (a pass of w and
    one of the mixture per sample)."""

    name = "apfl"
    Params = APFLParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(2.0 * spec.training.local_epochs)

    def personal(self, ctx, client) -> tuple[dict, float]:
        """(v_i as a state dict, alpha_i): the seeded initial weights and ``alpha`` before any training."""
        v = client.state.get("v") or ctx.models.initial_state(client.arch)
        return v, float(client.state.get("alpha", self.params.alpha))

    def local_update(self, ctx, client, epochs: int) -> dict:
        """(2)-(4) on every mini-batch of ``epochs`` epochs; w_i is the working model."""
        model = client.model
        v_state, alpha0 = self.personal(ctx, client)
        names = [n for n, _ in model.named_parameters()]
        v = {n: v_state[n].detach().clone().requires_grad_(True) for n in names}
        buffers = {k: t.detach().clone() for k, t in v_state.items() if k not in v}
        adaptive = self.params.adaptive
        alpha = torch.tensor(alpha0, requires_grad=adaptive)  # a 0-dim tensor: autograd's input for (4)
        alpha_lr = ctx.spec.training.lr if self.params.alpha_lr is None else self.params.alpha_lr
        v_optimizer = client.optimizer(params=list(v.values()))

        def loss_and_personal_step(model, x, y, logits):
            # (3) and (4) at the iterates before this step (w_i not yet updated), same batch
            w = {n: p.detach() for n, p in model.named_parameters()}
            _, grad_v, grad_alpha = mixture_gradients(model, v, buffers, w, alpha, x, y, client.objective,
                                                      with_alpha=adaptive)
            for p, g in zip(v.values(), grad_v):
                p.grad = g
            v_optimizer.step()
            if adaptive:
                with torch.no_grad():
                    alpha.fill_(alpha_step(float(alpha), float(grad_alpha), alpha_lr))
            return client.objective(model, x, y, logits)  # (2): the loss of w_i, stepped by the loop

        before, steps_before = client.work.private, client.work.private_steps
        metrics = client.train(epochs=epochs, loss_fn=loss_and_personal_step)
        # v_bar_i's passes and steps: the same samples again, one step of v per step of w
        client.count_work(private=client.work.private - before, private_steps=client.work.private_steps - steps_before)
        client.state["v"] = {k: (v[k] if k in v else buffers[k]).detach() for k in v_state}
        client.state["alpha"] = float(alpha.detach())
        client.log(alpha=client.state["alpha"])
        return metrics

    def personalised_model(self, ctx, client, w: dict):
        """(1) in the client's working model: alpha_i v_i + (1 - alpha_i) w, v_i's buffers."""
        v, alpha = self.personal(ctx, client)
        model = client.model
        names = [n for n, _ in model.named_parameters()]
        mixed = mixture(alpha, {n: v[n] for n in names}, {n: w[n] for n in names})
        return load_state(model, {**v, **mixed})

    @hookimpl
    def local_train(self, ctx, client):
        return self.local_update(ctx, client, ctx.spec.training.local_epochs)

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.personalised_model(ctx, client, message["weights"])}  # the global w

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.local_update(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": self.personalised_model(ctx, client, message["weights"])}


__all__ = ["APFL", "APFLParams", "alpha_step", "mixture", "mixture_gradients"]
