"""pFedMe: Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, Algorithm 1.

The bi-level problem (Section 3): the server minimises F(w) = sum_i p_i F_i(w) over the Moreau
envelopes of the clients' losses,

    (1)  F_i(w) = min_theta { f_i(theta) + lambda/2 ||theta - w||^2 },   theta_hat_i(w) its argmin,
         so grad F_i(w) = lambda (w - theta_hat_i(w)),

and theta_hat_i is client i's personalised model. Algorithm 1, as run here:

    server: w^0 = the seeded initial weights
    each round t, each participant i, from w_{i,0} = w^t:                       (on_receive)
        for r = 0 .. R-1 (every mini-batch D_i of training.local_epochs epochs):  (local_train)
            (2)  theta <- w_{i,r}; K steps of the configured optimiser at ``personal_lr`` on
                 h_i(theta; w_{i,r}, D_i) = f_i(theta; D_i) + lambda/2 ||theta - w_{i,r}||^2
                 (the approximate theta_hat_i(w_{i,r}) of Alg. 1's inner problem)
            (3)  w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta_hat_i(w_{i,r}))   (eta = training.lr)
        theta_i <- the last theta_hat_i (the personalised model, kept); upload w_{i,R}   (client_upload)
    (4)  w^{t+1} = (1 - beta) w^t + beta sum_i p_i w_{i,R},  p_i = n_i / n          (server_aggregate)
    evaluation: client i's theta_i                                                (personalized_models)

(Equation labels are this docstring's; (2)-(4) are the lines of the paper's Algorithm 1.)

Defaults (Section 5, the comparison runs "with the same parameters" on MNIST, reproduced by the
authors' published commands) and decisions:

- ``lam = 15``, ``k = 5`` (K), ``beta = 1``: Section 5's MNIST settings (its tuned table also
  uses beta = 2 and lambda in {15, 20, 30}); beta = 1 is plain averaging, so pFedMe's server is
  FedAvg's. beta = 0 is refused: w^{t+1} = w^t, the global model would never move (a widely used
  reference library ships that default).
- ``personal_lr = 0.09``: the personal learning rate of Section 5's non-convex (DNN) MNIST runs
  (0.1 for its convex ones); the zoo's models are non-convex. The paper's eta is 0.005 with
  batches |D| = 20 and R = 20 local rounds: set ``training.lr = 0.005``, ``training.batch_size =
  20`` to match; here R is every mini-batch of ``training.local_epochs`` epochs.
- The inner solver starts each local round at theta = w_{i,r}, the centre of the proximal
  problem whose solution Alg. 1 writes theta_hat_i(w_{i,r}); its optimiser state is reset each
  local round. With K = 1 and personal_lr = 1/lambda, (2)-(3) is exactly a gradient step of
  size eta on f_i, so pFedMe is then FedAvg (tested up to rounding).
- Aggregation weights p_i = n_i / n (FedAvg's); Alg. 1 averages uniformly over the S sampled
  clients; the two coincide for equal client sizes.
- BatchNorm statistics are not parameters of (1): the local model w_i takes the running
  statistics accumulated by the inner solver's forward passes.
- Budget (``local_work``): K x training.local_epochs private epochs per round (each mini-batch
  goes through K forward/backward passes).
- Bytes: FedAvg's (w down, w_{i,R} up); theta_i never leaves the client.
- A client that never took part is evaluated with the current global model.
- Cold start: the newcomer runs the local update (2)-(3) from the final w for
  ``experiment.coldstart_epochs`` epochs and is scored with its theta.
"""

from __future__ import annotations

import math

import torch
from attrs import define, field

from pfl_core.api import (
    FieldError,
    LocalWork,
    at_least,
    batch_order,
    batch_starts,
    clone_state,
    described,
    finite,
    greater_than,
    hookimpl,
    learning_rate,
    load_state,
    mean_training_loss,
    proximal_term,
    reset_optimizer,
)
from pfl_plugins.fedavg import FedAvg


@described("> 0")
def _moves_the_global_model(_instance, attribute, value):
    if value is not None and math.isfinite(value) and value <= 0:
        raise FieldError(attribute.name, f"must be > 0, got {value!r}: with beta = {value!r} the server step "
                                         f"(1 - beta) w + beta * average never moves w towards the clients "
                                         f"(1 is plain averaging; the paper also uses 2)")


@define
class PFedMeParams:
    lam: float = field(default=15.0, validator=[finite, greater_than(0)],
                       metadata={"doc": "lambda of the Moreau envelope (the paper's MNIST setting)"})
    k: int = field(default=5, validator=at_least(1), metadata={"doc": "K, inner steps per local step"})
    personal_lr: float = field(default=0.09, validator=learning_rate, metadata={
        "doc": "step size of the inner steps (the configured optimiser at this rate)"})
    beta: float = field(default=1.0, validator=[finite, _moves_the_global_model], metadata={
        "doc": "server step (1 - beta) w + beta * average; 1 is plain averaging (the paper also uses 2)"})


def moreau_step(model, w: list, x, y, *, k: int, inner, loss_fn, eta_lambda: float) -> torch.Tensor:
    """One local round r: (2) theta <- w, ``k`` steps of ``inner`` (an optimiser over
    ``model.parameters()``) on ``loss_fn`` (which adds lambda/2 ||theta - w||^2); then
    (3) w <- w - eta lambda (w - theta), in place. ``model`` ends holding theta. Returns
    f_i(w_{i,r}; D), the loss of the first inner step (where theta = w)."""
    params = list(model.parameters())
    with torch.no_grad():
        for p, anchor in zip(params, w):
            p.copy_(anchor)
    reset_optimizer(inner)
    first = None
    for _ in range(k):
        inner.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y, model(x))
        loss.backward()
        inner.step()
        first = loss.detach() if first is None else first
    with torch.no_grad():
        for anchor, theta in zip(w, params):
            anchor.sub_(eta_lambda * (anchor - theta))
    return first


def server_step(previous: dict, averaged: dict, beta: float) -> dict:
    """(4): (1 - beta) w^t + beta * average (floating-point entries; others from the average).
    beta = 1 returns the average itself (FedAvg)."""
    if beta == 1.0 or averaged is previous:
        return averaged
    return {k: (1 - beta) * previous[k] + beta * v if v.is_floating_point() else v for k, v in averaged.items()}


class PFedMe(FedAvg):
    """pFedMe (Dinh et al. 2020): every local step solves the Moreau-envelope problem around the
    local w with ``k`` inner steps, giving the personal model theta_i (evaluated); the local step
    size is ``training.lr``; server step ``(1 - beta) w + beta * average``. FedAvg's bytes.
    Budget: ``k * training.local_epochs``."""

    name = "pfedme"
    Params = PFedMeParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(self.params.k * spec.training.local_epochs))

    def local_update(self, ctx, client, epochs: int) -> dict:
        """R local rounds of (2)-(3) from the working model's weights (w^t); keeps theta_i in
        client.state and leaves w_{i,R} in the working model."""
        model, training = client.model, ctx.spec.training
        w = [p.detach().clone() for p in model.parameters()]  # w_{i,0} = w^t
        inner = client.optimizer(lr=self.params.personal_lr)
        eta_lambda = training.lr * self.params.lam
        x_all, y_all, n = client.data.train_x, client.data.train_y, client.num_train
        generator = client.generator("train")
        model.train()
        client.scratch["anchor"] = w  # switches the proximal term on (local_objective)
        losses = []
        try:
            for _ in range(epochs):
                order = batch_order(n, generator, training.shuffle)
                seen = 0
                for start in batch_starts(n, training.batch_size, training.drop_last):
                    if not client.take_batch():  # a straggler's batch budget is spent
                        break
                    idx = order[start:start + training.batch_size]
                    seen += len(idx)
                    losses.append(moreau_step(model, w, x_all[idx], y_all[idx], k=self.params.k, inner=inner,
                                              loss_fn=client.objective, eta_lambda=eta_lambda))
                    # steps on this batch: take_batch counted w's update (3); these are theta's k (2)
                    client.count_work(private_steps=self.params.k)
                else:
                    seen = n  # a whole epoch counts n samples, its dropped remainder included
                client.count_work(private=self.params.k * seen)
                if seen < n:
                    break
        finally:
            del client.scratch["anchor"]
        client.state["personal"] = clone_state(model)  # theta_i (the last theta_hat)
        with torch.no_grad():
            for p, value in zip(model.parameters(), w):
                p.copy_(value)  # the working model now holds w_{i,R}: FedAvg's upload sends it
        return mean_training_loss(losses)

    @hookimpl
    def local_train(self, ctx, client):
        return self.local_update(ctx, client, ctx.spec.training.local_epochs)

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lambda/2 ||theta - w_{i,r}||^2, during the inner steps (2) only."""
        anchor = client.scratch.get("anchor")
        return None if anchor is None else proximal_term(model, anchor, self.params.lam)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        previous = ctx.server["global"]
        super().server_aggregate(ctx, uploads, weights)  # FedAvg: the n_i-weighted average
        ctx.server["global"] = server_step(previous, ctx.server["global"], self.params.beta)
        return True

    @hookimpl
    def personalized_models(self, ctx, client, message):
        # theta_i; a client that never trained has none and is evaluated on the global w
        return {"": load_state(client.model, client.state.get("personal") or message["weights"])}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.local_update(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": load_state(client.model, client.state["personal"])}


__all__ = ["PFedMe", "PFedMeParams", "moreau_step", "server_step"]
