"""FedOpt: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (FedAdagrad,
FedAdam, FedYogi), and FedAvgM: Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification", 2019 (server momentum).

The clients are FedAvg's (E epochs of the configured local optimiser from the broadcast x_t, the
trained weights uploaded); only the server step differs. Algorithm 2, as run here:

    server: x_0 = the seeded initial weights, m_{-1} = 0, v_{-1} = tau^2
    each round t: S the round's participants                        (engine: select_clients)
        each i in S: x_i^t <- ClientUpdate(i, x_t)                 (FedAvg: broadcast, local_train, upload)
        Delta_t = sum_i p_i (x_i^t - x_t)                          (the pseudo-gradient; p_i below)
        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t                  (Alg. 2, first moment)
        v_t = v_{t-1} + Delta_t^2                                  (FedAdagrad)
        v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                (FedAdam)
        v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)   (FedYogi)
        x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)                (Alg. 2, server update)

FedAvgM is the same server with SGD with (heavy-ball) momentum in place of the adaptive step,
Hsu et al.'s ``v <- beta v + (x_t - x_avg); x_{t+1} <- x_t - eta v`` written with m = -v:

        m_t = beta1 m_{t-1} + Delta_t,   x_{t+1} = x_t + eta m_t   (FedAvgM; beta1 = 0, eta = 1 is FedAvg)

(all operations element-wise, per parameter tensor). Every client is evaluated on the global
model x_t, as in FedAvg.

Decisions:

- The pseudo-gradient is the FedAvg-weighted mean, p_i = n_i / sum_S n_j (the participants'
  shares of the training samples, as FedAvg weights them; Flower's FedOpt strategies start
  from the same weighted average).
  Algorithm 2 prints the plain mean 1/|S| sum_i; the two coincide when clients hold equal
  amounts of data. Written as Delta_t = x_avg - x_t, with x_avg FedAvg's weighted average.
- No bias correction of m_t and v_t: Algorithm 2 has none (unlike Adam's own, and unlike some
  reference implementations, e.g. recent versions of Flower's FedAdam). v_{-1} = tau^2, the smallest value
  Algorithm 2 allows (v_{-1} >= tau^2); m_{-1} = 0.
- The server step applies to the model's parameters only. Floating-point buffers (BatchNorm's
  running mean and variance) take FedAvg's average: Adam's step on a running variance could
  make it negative. Integer buffers (num_batches_tracked) take the first upload's value, as in
  FedAvg.
- The new weights are written x_avg + (eta u_t - Delta_t) (u_t: m_t, or m_t / (sqrt(v_t) +
  tau)), equal to x_t + eta u_t; so FedAvgM with beta1 = 0, eta = 1 is FedAvg bit for bit.
- Defaults. FedAdam and FedYogi: beta1 = 0.9, beta2 = 0.99 (the paper's experiments), tau =
  1e-3 (a middle value of the powers of ten the paper tunes tau over), eta = 0.1 (the middle,
  on a log scale, of the paper's server learning-rate grid 10^-3 ... 10^1; the paper tunes eta
  per task). FedAdagrad: the same eta and tau, beta1 = 0: Adagrad keeps no first moment
  (Duchi et al.); Algorithm 2's momentum form is available with beta1 > 0. FedAvgM: beta1 = 0.9 and eta = 1 (Hsu et al.'s server momentum
  and plain step).
- Nobody took part in a round (every upload lost): the server state, m and v included, stays.

The example package ``examples/pfl-fedavgm`` (the tutorial of docs/writing-a-plugin.md) is
the same FedAvgM as a third-party plugin, registered as ``fedavgm_example``;
tests/test_third_party_plugin.py checks that the two agree.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from attrs import define, field

from pfl_core.api import between, finite, greater_than, hookimpl, learning_rate, per_run, weighted_average
from pfl_plugins.fedavg import FedAvg

ETA_DOC = ("eta, the server learning rate of Algorithm 2's update x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau). "
           "Default: the middle of the paper's grid 10^-3 ... 10^1 (log scale)")
TAU_DOC = ("tau, the adaptivity (Algorithm 2): added to sqrt(v_t); v_{-1} = tau^2. Default: a middle value of "
           "the powers of ten the paper tunes it over")
BETA1_DOC = "beta1, the first-moment decay: m_t = beta1 m_{t-1} + (1 - beta1) Delta_t (Algorithm 2)"


def _beta1(default: float, doc: str = BETA1_DOC):
    return field(default=default, validator=between(0, 1, high_open=True), metadata={"doc": doc})


def _beta2(doc: str):
    return field(default=0.99, validator=between(0, 1, high_open=True), metadata={"doc": doc})


def _server_lr(default: float, doc: str = ETA_DOC):
    return field(default=default, validator=learning_rate, metadata={"doc": doc})


def _tau():
    return field(default=1e-3, validator=[finite, greater_than(0)], metadata={"doc": TAU_DOC})


@define
class FedAdagradParams:
    server_lr: float = _server_lr(0.1)
    beta1: float = _beta1(0.0, BETA1_DOC + ". Default 0: Adagrad keeps no first moment")
    tau: float = _tau()


@define
class FedAdamParams:
    server_lr: float = _server_lr(0.1)
    beta1: float = _beta1(0.9)
    beta2: float = _beta2("beta2, the second-moment decay: v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2 (Algorithm 2)")
    tau: float = _tau()


@define
class FedYogiParams:
    server_lr: float = _server_lr(0.1)
    beta1: float = _beta1(0.9)
    beta2: float = _beta2("beta2 of Yogi's additive second moment: v_t = v_{t-1} - (1 - beta2) Delta_t^2 "
                          "sign(v_{t-1} - Delta_t^2) (Algorithm 2)")
    tau: float = _tau()


@define
class FedAvgMParams:
    server_lr: float = _server_lr(1.0, "eta, the server step x_{t+1} = x_t + eta m_t; with beta1 = 0, 1 is FedAvg. "
                                       "Default: Hsu et al.'s plain step")
    beta1: float = _beta1(0.9, "beta, the server momentum: m_t = beta m_{t-1} + Delta_t (Hsu et al.; FedOpt's "
                               "beta1, undamped); 0 is FedAvg's server")


def second_moment(rule: str, v: torch.Tensor, delta_sq: torch.Tensor, beta2) -> torch.Tensor:
    """v_t from v_{t-1} and Delta_t^2 (Algorithm 2)."""
    if rule == "adagrad":
        return v + delta_sq
    if rule == "adam":
        return beta2 * v + (1 - beta2) * delta_sq
    if rule == "yogi":
        return v - (1 - beta2) * delta_sq * torch.sign(v - delta_sq)
    raise ValueError(f"unknown server rule {rule!r}")


def server_step(rule: str, x_t: torch.Tensor, x_avg: torch.Tensor, m: torch.Tensor, v, *, server_lr: float,
                beta1: float, beta2=None, tau=None):
    """One server step for one tensor: (x_{t+1}, m_t, v_t) from x_t, FedAvg's average x_avg and
    (m_{t-1}, v_{t-1}); ``rule`` is "adagrad", "adam", "yogi" or "sgdm" (FedAvgM: no v)."""
    delta = x_avg - x_t                                        # Delta_t
    if rule == "sgdm":
        m = beta1 * m + delta                                  # FedAvgM's momentum
        direction = m
    else:
        m = beta1 * m + (1 - beta1) * delta                    # first moment
        v = second_moment(rule, v, delta * delta, beta2)       # second moment
        direction = m / (v.sqrt() + tau)
    return x_avg + (server_lr * direction - delta), m, v       # = x_t + eta * direction


class FedOpt(FedAvg):
    """FedAvg's clients; the server treats the mean update as a pseudo-gradient and applies an
    optimiser to it (``rule``, set by each subclass)."""

    rule: ClassVar[str] = ""

    def parameter_keys(self, ctx) -> list[str]:
        """The state-dict keys the server optimiser steps: the model's parameters (not its buffers)."""
        arch = ctx.models.arch_of(0)  # one architecture (FedAvg's check_spec)
        return per_run(ctx, self, "parameter_keys",
                       lambda: [name for name, _ in ctx.models.working(arch).named_parameters()])

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # x_0: the seeded initial weights
        glob = ctx.server["global"]
        keys = self.parameter_keys(ctx)
        ctx.server["m"] = {k: torch.zeros_like(glob[k]) for k in keys}  # m_{-1} = 0
        if self.rule != "sgdm":
            tau = self.params.tau
            ctx.server["v"] = {k: torch.full_like(glob[k], tau * tau) for k in keys}  # v_{-1} = tau^2

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        x_avg = weighted_average((weights[i], message["weights"]) for i, message in uploads)
        if x_avg is None:  # nobody took part: x_t, m and v stay
            return True
        x_t, m, v = ctx.server["global"], ctx.server["m"], ctx.server.get("v")
        p = self.params
        x_next = dict(x_avg)  # buffers: FedAvg's average
        for key in m:
            x_next[key], m[key], new_v = server_step(
                self.rule, x_t[key], x_avg[key], m[key], None if v is None else v[key], server_lr=p.server_lr,
                beta1=p.beta1, beta2=getattr(p, "beta2", None), tau=getattr(p, "tau", None))
            if v is not None:
                v[key] = new_v
        ctx.server["global"] = x_next
        return True


class FedAdagrad(FedOpt):
    """FedAdagrad (Reddi et al. 2021, Alg. 2): Adagrad on the server over the mean client update,
    v_t = v_{t-1} + Delta_t^2; FedAvg's clients, evaluated on the global model."""

    name = "fedadagrad"
    Params = FedAdagradParams
    rule = "adagrad"


class FedAdam(FedOpt):
    """FedAdam (Reddi et al. 2021, Alg. 2): Adam (no bias correction) on the server over the mean
    client update; FedAvg's clients, evaluated on the global model."""

    name = "fedadam"
    Params = FedAdamParams
    rule = "adam"


class FedYogi(FedOpt):
    """FedYogi (Reddi et al. 2021, Alg. 2): Yogi's additive second moment on the server over the
    mean client update; FedAvg's clients, evaluated on the global model."""

    name = "fedyogi"
    Params = FedYogiParams
    rule = "yogi"


class FedAvgM(FedOpt):
    """FedAvgM (Hsu et al. 2019): server momentum over the mean client update, m_t = beta1 m_{t-1}
    + Delta_t, x_{t+1} = x_t + eta m_t; FedAvg's clients, evaluated on the global model."""

    name = "fedavgm"
    Params = FedAvgMParams
    rule = "sgdm"


__all__ = ["FedAdagrad", "FedAdagradParams", "FedAdam", "FedAdamParams", "FedAvgM", "FedAvgMParams", "FedOpt",
           "FedYogi", "FedYogiParams", "second_moment", "server_step"]
