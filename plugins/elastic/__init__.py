"""Elastic aggregation: Chen, Hu, Tan, Wei and Wu, "Elastic Aggregation for Federated Optimization",
CVPR 2023.

FedAvg whose server scales each parameter's averaged update by how sensitive the model's output is
to that parameter: updates to sensitive parameters are damped (the server model drifts less towards
any one client), updates to insensitive ones are boosted (explored further). Steps as labelled here:

    (S1) client k, on receiving w_t, before training: for each mini-batch x of its train split (in
         order, batches of training.batch_size, the model in eval mode),
             g = | d/dw mean_{x in batch} ||f(x; w_t)||_2^2 |          (element-wise, every parameter)
             Omega_k <- mu * Omega_k + (1 - mu) * g
         Omega_k starts at 0 and carries over the client's visits (the moving average is "online")
    (S2) client k trains training.local_epochs epochs from w_t (FedAvg's local SGD) to w_k, and
         uploads w_k and Omega_k
    (S3) server, with p_k the aggregation weights (n_k / n by default), element-wise:
             Omega = sum_k p_k Omega_k,  Omega_max = max_k Omega_k,  zeta = 1 + tau - Omega / Omega_max
             w_{t+1} = w_t - zeta * sum_k p_k (w_t - w_k)
         (computed as w_avg + (zeta - 1) * (w_avg - w_t), w_avg = sum_k p_k w_k, so zeta = 1 is
         FedAvg's w_avg bit for bit). zeta lies in [tau, 1 + tau]; tau = 0 freezes a parameter
         on which every client is equally (and maximally) sensitive.
    evaluation: every client is scored with the global model w_t (FedAvg's).

Reading: we could read only the paper's abstract (the sensitivity is "how much the overall
prediction function output changes when each parameter is changed", measured "in an unsupervised
and online manner"), not its full text, so its equation numbers are not cited; the steps above
follow the abstract and FL-bench (``src/client/elastic.py``, ``src/server/elastic.py`` at commit
06e658bca5af6ce732e25bb7c0f8be321e14a85e, read, not copied). (S1)'s squared output norm is the
Memory-Aware-Synapses form of "output sensitivity" the abstract describes; not checked against
the paper's equation.

Deviations from FL-bench:

- **What the sensitivity measures.** FL-bench takes the gradient of the *loss* (supervised), and
  one number per parameter *tensor* (its squared gradient norm), so every weight of a layer is
  scaled alike; here the gradient of the output's squared norm (unsupervised, as the abstract
  says) and one number per parameter *element* ("each parameter").
- **Gradients per batch.** FL-bench never zeroes the gradients between its sensitivity batches,
  so batch b's "gradient" is the sum of the first b batches'; here each batch's own gradient.
- **Data.** FL-bench holds out ``sample_ratio`` (30%) of each client's train split for (S1) and
  trains on the other 70%; here (S1) reads the whole train split and training uses all of it.
- **Zero sensitivities.** FL-bench sets a tensor's sensitivity to 1 when its gradient norm is
  exactly 0 and divides 0/0 into NaN when every client's is 0; here a parameter no participant's
  output depends on (Omega_max = 0) gets zeta = 1 + tau (the limit of an insensitive parameter).
- **Buffers** (BatchNorm's running statistics) have no sensitivity: they take FedAvg's average.
- **Aggregation weights** are the core's ``client_weighting`` (n_k / n by default, FL-bench's too).
- **Defaults** tau = 0.5 and mu = 0.95 are FL-bench's.

Cost: (S1) is one extra forward and backward pass over the train split per round (not counted as
local work, like FedAS's Fisher pass), and the upload doubles (Omega_k is the model's size).

Lost uploads (``dropout``): Omega_k is the client's own running estimate of its data's
sensitivity, which the server never accumulates (it uses only this round's uploads), so the
client keeps the round's update in ``client.state`` whether or not its upload arrives; a
newcomer (``experiment.coldstart_clients``) fine-tunes the global model as FedAvg's do.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import WeightAveraging, at_least, between, finite, hookimpl, weighted_average


@define
class ElasticParams:
    tau: float = field(default=0.5, validator=[finite, at_least(0)], metadata={
        "doc": "tau of zeta = 1 + tau - Omega / Omega_max (S3): zeta lies in [tau, 1 + tau]. Default: FL-bench's"})
    mu: float = field(default=0.95, validator=between(0, 1, high_open=True), metadata={
        "doc": "damping of the sensitivity's moving average Omega <- mu Omega + (1 - mu) |g| (S1). "
               "Default: FL-bench's"})


def output_sensitivity(model, x, batch_size: int, mu: float, previous=None) -> dict[str, torch.Tensor]:
    """(S1): the moving average over ``x``'s mini-batches (in order) of |d/dw mean ||f(x)||^2|,
    one tensor per trainable parameter, continuing ``previous`` (zeros if None); in eval mode."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    omega = {name: (previous[name].clone() if previous is not None else torch.zeros_like(p.detach()))
             for name, p in named}
    was_training = model.training
    model.eval()  # BatchNorm's statistics are read, not updated: a measurement, not a training step
    try:
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            squared_norm = logits.pow(2).sum(dim=1).mean()
            grads = torch.autograd.grad(squared_norm, [p for _, p in named], allow_unused=True)
            for (name, _), grad in zip(named, grads):
                omega[name].mul_(mu)
                if grad is not None:  # a parameter the output does not use adds nothing
                    omega[name].add_(grad.abs(), alpha=1 - mu)
    finally:
        model.train(was_training)
    return omega


def elastic_coefficients(weighted: torch.Tensor, maximum: torch.Tensor, tau: float) -> torch.Tensor:
    """(S3): zeta = 1 + tau - Omega / Omega_max, with Omega / Omega_max taken as 0 where Omega_max = 0."""
    ratio = torch.where(maximum > 0, weighted / torch.where(maximum > 0, maximum, 1), 0)
    return 1 + tau - ratio


class Elastic(WeightAveraging):
    """Elastic aggregation (Chen et al. 2023): FedAvg whose clients also upload the moving average
    of their model output's sensitivity to each parameter, and whose server scales each
    parameter's averaged update by zeta = 1 + tau - Omega / Omega_max; each client is scored with
    the global model. Upload: twice FedAvg's."""

    name = "elastic"
    Params = ElasticParams

    @hookimpl
    def local_train(self, ctx, client):
        client.state["sensitivity"] = output_sensitivity(
            client.model, client.data.train_x, ctx.spec.training.batch_size, self.params.mu,
            client.state.get("sensitivity"))
        return client.train()

    @hookimpl
    def client_upload(self, ctx, client):
        return {"weights": client.model.state_dict(), "sensitivity": client.state["sensitivity"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        weighted: dict[str, torch.Tensor] = {}  # sum_k p_k Omega_k
        maximum: dict[str, torch.Tensor] = {}  # max_k Omega_k

        def pairs():  # streams: an upload is valid only until the next client runs
            for i, message in uploads:
                for key, omega in message["sensitivity"].items():
                    if key in weighted:
                        weighted[key].add_(omega, alpha=weights[i])
                        torch.maximum(maximum[key], omega, out=maximum[key])
                    else:
                        weighted[key] = omega * weights[i]
                        maximum[key] = omega.clone()
                yield weights[i], message["weights"]

        averaged = weighted_average(pairs())
        if averaged is None:  # nobody took part: keep the global model
            return True
        previous = ctx.server["global"]
        updated = {}
        for key, value in averaged.items():
            if key not in weighted:  # a buffer: FedAvg's average
                updated[key] = value
                continue
            zeta = elastic_coefficients(weighted[key], maximum[key], self.params.tau)
            updated[key] = value + (zeta - 1) * (value - previous[key])
        ctx.server["global"] = updated
        return True


__all__ = ["Elastic", "ElasticParams", "elastic_coefficients", "output_sensitivity"]
