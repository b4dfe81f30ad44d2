"""FedDyn: Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021, Algorithm 1 (FedDyn).

    server: theta^0; h^0 = 0; every device k: g_k = grad L_k(theta_k^0) = 0
    each round t: P_t sampled; theta^{t-1} sent to each k in P_t     (select_clients, on_broadcast)
      device k:  theta_k^t = argmin  L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2
                   (local_train: the configured epochs of local training on it; the quadratic
                    term is a local_objective, the linear term's gradient -g_k is added to every
                    step's gradient by adjust_gradients)
                 g_k <- g_k - alpha (theta_k^t - theta^{t-1})          (client_upload; the
                   first-order condition of the argmin; client.staged: kept if it arrives)
                 send theta_k^t
      server:    h^t = h^{t-1} - alpha/m * sum_{k in P_t} (theta_k^t - theta^{t-1})
                 theta^t = sum_k w_k theta_k^t - h^t / alpha             (server_aggregate;
                   w_k = 1/|P_t|: Algorithm 1's (1/|P_t|) sum_{k in P_t} theta_k^t)

m is the number of training clients. What is evaluated: every client on the server model
theta^t, the model the server holds and sends next round (FedDyn is not a personalised
method); g_k and h only steer training.

Deviations from the paper, and what the authors' code (github.com/alpemreacar/FedDyn) does:

- "argmin" is ``training.local_epochs`` epochs of the configured optimiser, as in the paper's
  experiments (SGD epochs); so g_k is the first-order condition's value, not the exact
  gradient at theta_k^t.
- The model average: ``weighting = "uniform"`` (the default) is Algorithm 1's server step,
  theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - h^t / alpha, w_k = 1/|P_t| (the devices whose
  upload arrived, with ``dropout``), as the authors' code, PFLlib's and FL-bench's FedDyn.
  ``"samples"``: w_k = n_k / n over the participants (FedAvg's weights); the two agree when the
  clients' train splits are equal. h stays the paper's 1/m sum whatever the weighting, so
  h = (1/m) sum_k g_k after every round.
- The authors' code scales alpha per device by the inverse of its relative data size
  (alpha_k = alpha / (n_k m / n)) for unbalanced data, clips gradient norms at 10, and reports
  the mean of the devices' latest models (all devices, and the active ones), not theta^t (the
  paper's appendix on experimental details states the clipping, for every method, and the
  all-device average, as a reporting choice that leaves the algorithm unchanged).
  Here alpha is one number for every device (Algorithm 1), there is no clipping, and theta^t
  is evaluated: it is what Algorithm 1 computes as the server model.
- h and the correction -h/alpha exist for the model's parameters only; buffers (BatchNorm
  statistics) are averaged as FedAvg averages them.
- A lost upload (the ``dropout`` add-on): the device trained (its work counts), but g_k stays
  as it was, because the server never added its theta_k^t - theta^{t-1} to h
  (``client.staged``): for the algorithm's state the device was not in P_t, as Algorithm 1
  treats inactive devices, and h = (1/m) sum_k g_k still holds.
- A cold-start client (``experiment.coldstart_clients``) fine-tunes the final theta with the
  plain loss, as FedAvg's newcomers do: it has no g_k, and its visit is not a round.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    WeightAveraging,
    add_to_gradients,
    finite,
    greater_than,
    hookimpl,
    one_of,
    proximal_term,
    weighted_average,
)


@define
class FedDynParams:
    alpha: float = field(default=0.01, validator=[finite, greater_than(0)], metadata={
        "doc": "alpha of the dynamic regulariser (Algorithm 1): weight of alpha/2 ||theta - theta^{t-1}||^2 and "
               "of the state updates; the server model is the mean minus h/alpha. Default: the value the authors' "
               "code uses for CIFAR-10 and for its synthetic data"})
    weighting: str = field(default="uniform", validator=one_of("uniform", "samples"), metadata={
        "doc": 'the model average\'s w_k: 1/|P_t| (Algorithm 1, the authors\' code) or "samples", n_k / n over the '
               "participants (FedAvg's); h's average is 1/m either way"})


class FedDyn(WeightAveraging):
    """FedDyn (Acar et al. 2021): each device minimises its loss minus <g_k, theta> plus
    alpha/2 ||theta - theta^{t-1}||^2 and updates g_k; the server corrects the mean by h/alpha."""

    name = "feddyn"
    Params = FedDynParams

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # theta^0: the seeded initial weights
        model = ctx.models.working(ctx.models.arch_of(0))
        ctx.server["h"] = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}

    @hookimpl
    def client_weighting(self, ctx, participants):
        """Algorithm 1's 1/|P_t| (``weighting = "uniform"``), else the core's n_k / n."""
        if self.params.weighting == "uniform":
            return {i: 1.0 / len(participants) for i in participants}
        return None

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)  # theta <- theta^{t-1}
        if client.id not in ctx.participants:  # a cold-start client: plain fine-tuning
            return True
        theta = message["weights"]  # the broadcast stays as it is while this client runs
        names = [n for n, _ in client.model.named_parameters()]
        g = client.state.get("grad") or {n: torch.zeros_like(theta[n]) for n in names}
        client.scratch["feddyn"] = {"theta": theta, "anchor": [theta[n] for n in names], "grad": g}
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """The quadratic term alpha/2 ||theta - theta^{t-1}||^2, added to the core's cross-entropy."""
        own = client.scratch.get("feddyn")
        if own is None or model is not client.model:
            return None  # no term
        return proximal_term(model, own["anchor"], self.params.alpha)

    @hookimpl
    def adjust_gradients(self, ctx, client, model, optimizer):
        """The linear term -<g_k, theta>: its gradient -g_k, added to every step's gradient."""
        own = client.scratch.get("feddyn")
        if own is None or model is not client.model:
            return
        add_to_gradients(model, own["grad"], scale=-1.0)

    @hookimpl
    def client_upload(self, ctx, client):
        """g_k <- g_k - alpha (theta_k^t - theta^{t-1}), kept once the upload arrives; send theta_k^t."""
        own = client.scratch["feddyn"]
        theta, grad, alpha = own["theta"], own["grad"], self.params.alpha
        client.staged["grad"] = {n: grad[n] - alpha * (p.detach() - theta[n])
                                 for n, p in client.model.named_parameters()}
        return {"weights": client.model.state_dict()}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """h^t = h^{t-1} - alpha/m sum_k (theta_k^t - theta^{t-1}); theta^t = mean - h^t / alpha."""
        theta, h = ctx.server["global"], ctx.server["h"]
        drift: dict[str, torch.Tensor] = {}

        def models():  # one upload at a time: into the average and into the drift sum
            for i, message in uploads:
                received = message["weights"]
                for name in h:
                    step = received[name] - theta[name]
                    drift[name] = drift[name] + step if name in drift else step
                yield weights[i], received

        mean = weighted_average(models())
        if mean is None:  # nobody took part: theta and h stay
            return True
        alpha, m = self.params.alpha, len(ctx.training_clients)
        h = {name: h[name] - alpha / m * drift[name] for name in h}
        ctx.server["h"] = h
        ctx.server["global"] = {k: v - h[k] / alpha if k in h else v for k, v in mean.items()}
        return True


__all__ = ["FedDyn", "FedDynParams"]
