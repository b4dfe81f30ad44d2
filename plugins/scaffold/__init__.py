"""SCAFFOLD: Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020, Algorithm 1 with option II control variates.

    server: x, c = 0; every client: c_i = 0
    each round: S sampled; (x, c) sent to each i in S                 (select_clients, on_broadcast)
      client i:  y_i <- x                                            (on_receive)
                 K steps: y_i <- y_i - eta_l (g_i(y_i) - c_i + c)    Eq. 3 (adjust_gradients)
                 c_i+ <- c_i - c + (x - y_i) / (K eta_l)             Eq. 4, option II (client_upload)
                 send (y_i, c_i+ - c_i); c_i <- c_i+                 (client.staged: kept if it arrives)
      server:    x <- x + eta_g * sum_i w_i (y_i - x)                Eq. 5, x (server_aggregate;
                                                                     w_i = 1/|S|: Alg. 1's average)
                 c <- c + 1/N * sum_i (c_i+ - c_i)                   Eq. 5, c

``eta_l`` is ``training.lr``, ``eta_g`` is ``server_lr``, N the training clients, K the local
optimiser steps client i took this round (``client.steps``). What is evaluated: every client on
the global model x, as FedAvg (SCAFFOLD is not a personalised method); ``c`` and the ``c_i``
only steer training.

Deviations from the paper, and what the reference implementations do:

- The model average: ``weighting = "uniform"`` (the default) is Algorithm 1's server step,
  (Delta y, Delta c) <- 1/|S| sum_{i in S} (Delta y_i, Delta c_i), x <- x + eta_g Delta y: every
  participant's w_i = 1/|S| (the participants whose upload arrived, with ``dropout``), as
  FL-bench's SCAFFOLD. ``"samples"``: w_i = n_i / n over the participants (FedAvg's weights),
  as NIID-Bench's (Li et al., ICDE 2022) and PFLlib's SCAFFOLD (``serverscaffold.py`` weights
  the Delta y_i by train samples); the two agree when the clients' train splits are equal. With
  ``"samples"``, c = c_i = 0 and ``server_lr = 1`` SCAFFOLD is exactly FedAvg (its first round
  is FedAvg's bit for bit), so a comparison with FedAvg changes only the control variates.
  ``c`` is averaged over all N clients as in Eq. 5 (NIID-Bench and PFLlib too), whatever the
  weighting, which keeps c = (1/N) sum_i c_i.
- K is the number of steps the client really took this round (NIID-Bench counts them the same
  way), not a constant: a straggler (``stragglers`` add-on) or ``training.drop_last`` changes
  it, and (x - y_i) / (K eta_l) is the mean corrected gradient only over the steps taken. The
  FedDyn authors' SCAFFOLD fixes K to a configured number of mini-batches.
- Option II assumes plain SGD steps of size eta_l: ``training.optimizer`` must be "sgd" and
  ``training.momentum`` 0 (with momentum the model moves ~1/(1 - momentum) times further and
  c_i would be scaled so). ``training.weight_decay`` is allowed: it is part of g_i, so the
  c_i include it. The correction is added to the gradient before the optimiser step (Eq. 3 as
  written); NIID-Bench subtracts eta_l (c - c_i) from the weights after the step, the same
  update for plain SGD.
- Control variates exist for the model's parameters only; buffers (BatchNorm statistics) are
  averaged as FedAvg averages them, without ``server_lr`` (NIID-Bench corrects every
  state-dict entry). A parameter that gets no gradient in a step is not stepped.
- A lost upload (the ``dropout`` add-on): the client trained (its work counts), but its c_i
  stays as it was, because the server never added its c_i+ - c_i to c (``client.staged``).
  So c = (1/N) sum_i c_i after every round, as in the paper, where a client that is not
  heard from keeps its c_i.
- Option I (c_i+ = g_i(x), an extra pass over the client's data at x) is not implemented;
  the paper calls option II the cheaper one, and it needs nothing but the model change.
- A cold-start client (``experiment.coldstart_clients``) fine-tunes the final x with plain
  SGD, as FedAvg's newcomers do: it has no c_i, and its visit is not a round.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    SpecError,
    WeightAveraging,
    add_to_gradients,
    hookimpl,
    learning_rate,
    one_of,
    weighted_average,
)


@define
class ScaffoldParams:
    server_lr: float = field(default=1.0, validator=learning_rate, metadata={
        "doc": "eta_g, the global step size of Eq. 5: x <- x + eta_g * (weighted mean of y_i - x); 1 "
               "takes the mean (FedAvg's server step), as NIID-Bench's SCAFFOLD always does"})
    weighting: str = field(default="uniform", validator=one_of("uniform", "samples"), metadata={
        "doc": 'the model average\'s w_i in Eq. 5: 1/|S| (Algorithm 1, FL-bench) or "samples", n_i / n over the '
               "participants (FedAvg's, NIID-Bench's and PFLlib's); c's average is 1/N either way"})


def check_plain_sgd(training, method: str) -> None:
    """Option II divides the model change by K * lr: only plain SGD steps have that size."""
    why = f"{method}'s option II control variates (Eq. 4) divide the model change by K * training.lr, the mean "
    if training.optimizer != "sgd":
        raise SpecError("training.optimizer", why + f"corrected gradient only for SGD steps; got "
                        f"{training.optimizer!r}, use \"sgd\"")
    if training.momentum:
        raise SpecError("training.momentum", why + f"corrected gradient only without momentum; got "
                        f"{training.momentum}, set it to 0")


class Scaffold(WeightAveraging):
    """SCAFFOLD (Karimireddy et al. 2020), option II: local steps corrected by c - c_i, the
    control variates updated from the model change, the server's x and c from the uploads."""

    name = "scaffold"
    Params = ScaffoldParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        check_plain_sgd(spec.training, self.name)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # x: the seeded initial weights
        model = ctx.models.working(ctx.models.arch_of(0))
        ctx.server["c"] = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}

    @hookimpl
    def client_weighting(self, ctx, participants):
        """Algorithm 1's 1/|S| (``weighting = "uniform"``), else the core's n_i / n."""
        if self.params.weighting == "uniform":
            return {i: 1.0 / len(participants) for i in participants}
        return None

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"weights": ctx.server["global"], "c": ctx.server["c"]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # y_i <- x
        if client.id not in ctx.participants:  # a cold-start client: plain fine-tuning
            return True
        c = message["c"]
        c_i = client.state.get("c_i") or {n: torch.zeros_like(t) for n, t in c.items()}
        client.scratch["scaffold"] = {
            "x": message["weights"],  # the broadcast stays as it is while this client runs
            "c": c,
            "c_i": c_i,
            "correction": {n: c[n] - c_i[n] for n in c},  # Eq. 3: g_i(y_i) - c_i + c
        }
        return True

    @hookimpl
    def adjust_gradients(self, ctx, client, model, optimizer):
        """Eq. 3: each local step descends along g_i(y_i) - c_i + c."""
        own = client.scratch.get("scaffold")
        if own is None or model is not client.model:
            return
        add_to_gradients(model, own["correction"])

    @hookimpl
    def client_upload(self, ctx, client):
        """Eq. 4, option II: c_i+ = c_i - c + (x - y_i) / (K eta_l); c_i <- c_i+ once it arrives."""
        own = client.scratch["scaffold"]
        x, c, c_i = own["x"], own["c"], own["c_i"]
        steps, lr = client.steps, ctx.spec.training.lr
        y = dict(client.model.named_parameters())
        if steps:
            c_plus = {n: c_i[n] - c[n] + (x[n] - y[n].detach()) / (steps * lr) for n in c}
        else:  # no step taken: nothing learnt about the client's gradient
            c_plus = c_i
        client.staged["c_i"] = c_plus
        return {"weights": client.model.state_dict(), "delta_c": {n: c_plus[n] - c_i[n] for n in c}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """Eq. 5: x <- x + eta_g (sum_i w_i y_i - x); c <- c + 1/N sum_i delta c_i."""
        x, c = ctx.server["global"], ctx.server["c"]
        delta_c: dict[str, torch.Tensor] = {}

        def models():  # one upload at a time: the model into the average, delta c into its sum
            for i, message in uploads:
                for name, d in message["delta_c"].items():
                    delta_c[name] = delta_c[name] + d if name in delta_c else d.clone()
                yield weights[i], message["weights"]

        mean_y = weighted_average(models())
        if mean_y is None:  # nobody took part: x and c stay
            return True
        eta_g = self.params.server_lr
        # x + eta_g (mean_y - x), written so that eta_g = 1 is mean_y bit for bit (FedAvg's aggregate)
        ctx.server["global"] = {k: v + (eta_g - 1) * (v - x[k]) if k in c else v for k, v in mean_y.items()}
        n = len(ctx.training_clients)
        ctx.server["c"] = {name: c[name] + delta_c[name] / n for name in c}
        return True


__all__ = ["Scaffold", "ScaffoldParams", "check_plain_sgd"]
