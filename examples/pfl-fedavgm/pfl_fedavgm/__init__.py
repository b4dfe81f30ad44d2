"""FedAvgM: Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", 2019 (FedAvg with server momentum).

    each round t: clients run FedAvg's ClientUpdate from w_t; the server averages
        w_avg <- sum_k n_k / n * w_{t+1}^k                     (FedAvg's aggregate)
        v     <- beta * v + (w_t - w_avg)                      (server momentum)
        w_{t+1} <- w_t - server_lr * v

With beta = 0 and server_lr = 1 this is FedAvg, bit for bit. Everything but the server
update is inherited from FedAvg, and the momentum buffer v lives in ``ctx.server`` (server
state is engine-owned; the plugin object keeps nothing between rounds).

pfl's own FedAvgM (``algorithm.name = "fedavgm"``, plugins/fedopt, beside FedAdagrad, FedAdam
and FedYogi) is the same method; this package is the tutorial of docs/writing-a-plugin.md and
registers it as ``fedavgm_example``.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import WeightAveraging, between, finite, greater_than, hookimpl

__version__ = "0.1.0"


@define
class FedAvgMParams:
    beta: float = field(default=0.9, validator=between(0, 1, high_open=True))  # server momentum
    server_lr: float = field(default=1.0, validator=[finite, greater_than(0)])  # server step size


class FedAvgM(WeightAveraging):
    name = "fedavgm_example"
    Params = FedAvgMParams

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        w_t = ctx.server["global"]
        super().server_aggregate(ctx, uploads, weights)  # FedAvg: ctx.server["global"] <- w_avg
        w_avg = ctx.server["global"]
        if w_avg is w_t:  # nobody took part: FedAvg kept w_t, and so do we
            return True
        beta, lr = self.params.beta, self.params.server_lr
        v = ctx.server.get("momentum") or {k: torch.zeros_like(t) for k, t in w_t.items() if t.is_floating_point()}
        w_next = {}
        for key, avg in w_avg.items():
            if not avg.is_floating_point():  # e.g. BatchNorm's num_batches_tracked: FedAvg's value
                w_next[key] = avg
                continue
            delta = w_t[key] - avg  # the pseudo-gradient w_t - w_avg
            v[key] = beta * v[key] + delta
            # w_t - lr * v, written as w_avg - (lr * v - delta) (equal, since delta = w_t - w_avg)
            # so that beta = 0, lr = 1 gives w_avg exactly rather than w_t - (w_t - w_avg).
            w_next[key] = avg - (lr * v[key] - delta)
        ctx.server["momentum"] = v
        ctx.server["global"] = w_next
        return True
