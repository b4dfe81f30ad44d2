"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.

FedAvg whose clients minimise h_k(w; w_t) = F_k(w) + mu/2 ||w - w_t||^2 (their Eq. 2), w_t
the global model received this round. Everything else is FedAvg.

Default mu = 0.01: the paper tunes mu per dataset over {0.001, 0.01, 0.1, 1}; 0.01 is the
middle of that grid (never 0, which would be FedAvg).
"""

from __future__ import annotations

from attrs import define, field

from pfl_core.api import AnchoredAveraging, at_least, finite, hookimpl, proximal_term


@define
class FedProxParams:
    mu: float = field(default=0.01, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the proximal term mu/2 ||w - w_t||^2; 0 is FedAvg. Default: the middle of the "
               "paper's grid 0.001, 0.01, 0.1, 1"})


class FedProx(AnchoredAveraging):
    """FedAvg whose clients add ``mu/2 * ||w - w_t||^2`` to their loss (Li et al. 2020), w_t the
    global model received this round."""

    name = "fedprox"
    Params = FedProxParams

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """The proximal term mu/2 ||w - w_t||^2, added to the core's cross-entropy."""
        return proximal_term(model, client.scratch["w_t"], self.params.mu)
