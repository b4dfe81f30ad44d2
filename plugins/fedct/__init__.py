"""FedCT: federated co-training (Abourayya et al., AAAI 2025), the base of FedMosaic.

Clients share hard predictions on the public unlabeled set U; the server's consensus is a
plain majority vote (ties: lowest class index); each client trains on
CE(private batch) + lambda * CE(public batch, consensus labels) with lambda fixed.

Implemented as a configuration of FedMosaic (one code path): ``expertise = "uniform"`` (no
expertise is sent; up = |U| ceil(log2 C) bits per client and round) and
``lam = lambda`` (default 1); ``comm_period`` and ``public_passes`` as FedMosaic's.
``tests/test_fedmosaic.py`` checks that FedCT gives bit-identical personal weights to FedMosaic with ``lam = 1, expertise = "uniform"``
(and the same ``warmup_epochs``).

``warmup_epochs`` (private-only epochs before the first upload, FedMosaic's warm-up) defaults
to 0: FedCT as published has none. Set it to FedMosaic's value to compare the two on the same
budget.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field

from pfl_core.api import at_least, finite, greater_than
from pfl_plugins.fedmosaic import FedMosaic


@define
class FedCTParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)],
                       metadata={"doc": "lambda, the fixed weight of the pseudo-label loss"})
    comm_period: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "local steps between communications; none: training.local_epochs epochs (as FedMosaic)"})
    public_passes: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "passes over U per local epoch of co-training (as FedMosaic)"})
    warmup_epochs: int = field(default=0, validator=at_least(0), metadata={
        "doc": "private-only epochs before the first upload; 0 as published (set FedMosaic's value to "
               "compare the two on the same budget)"})

    # What FedMosaic reads, fixed for FedCT (not spec keys).
    @property
    def expertise(self) -> str:
        return "uniform"

    @property
    def lambda_mode(self) -> str:
        return "batch"

    @property
    def expertise_bits(self) -> int:
        return 8

    @property
    def eps(self) -> float:
        return 1e-6


class FedCT(FedMosaic):
    name = "fedct"
    Params = FedCTParams
