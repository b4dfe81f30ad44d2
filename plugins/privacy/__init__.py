"""Privacy add-ons for co-training uploads (FedMosaic paper, "Client-Level Privacy").

Both are pluggy hook wrappers around ``client_upload`` (``@hookimpl(wrapper=True)``): they
perturb what the algorithm uploads, whatever the algorithm, before the engine counts it and
the server sees it. Each logs its per-round epsilon, and both add it to ``eps_round``, the
summed per-round epsilon of the paper's (eps_L + eps_E, delta)-DP statement.

GaussianExpertise (``gaussian_expertise``): the Gaussian mechanism on the expertise vector.
  Each client adds N(0, sigma^2) to every E_i[j] (after dequantising the 8-bit codes), clips
  to the known range [0, c] and re-quantises (both post-processing). Reported per round:
      eps_E = c * sqrt(|U|) / sigma * sqrt(2 ln(1.25 / delta)),
  c = 1 for class-frequency ("W") and log C for entropy ("U") expertise (the L2 sensitivity of
  E_i is c sqrt(|U|)). Logged as ``eps_E``. Needs an algorithm that uploads "expertise"
  (fedmosaic with expertise W or U): checked at validation, naming the key.
  Note: the classical Gaussian-mechanism bound is proven for eps <= 1; larger values are
  reported by the same formula, as the paper does.

LabelMechanism (``label_mechanism``): k-ary randomised response on the hard labels (a
  documented substitute for the paper's XOR mechanism, whose sensitivity bound s* needs the
  stability analysis of Abourayya et al. 2025). Each label is kept with probability
  e^eps_label / (e^eps_label + C - 1) and otherwise replaced by one of the C - 1 other
  classes uniformly: eps_label-DP for one label. A change of one private training example
  can change up to ``sensitivity`` of the client's |U| predictions (None: all |U|, the worst
  case without a stability assumption), so by composition over the changed labels
      eps_L = sensitivity * eps_label        (per client and round).
  Logged as ``eps_L``.

  Refused (SpecError at ``addons[i].name``, at validation) when the algorithm also uploads
  expertise and no ``gaussian_expertise`` add-on noises it:

  - expertise "W": E_i[j] is the client's share of its *true* predicted class, so it is a
    function of the label being randomised. A client's shares differ between its classes
    (they tie only when two classes have exactly the same count), so the server maps E back
    to the label exactly (group U by E; within a group the randomised labels' majority is
    the true class, or read it off the client's shares); equal shares still narrow it to
    the classes with that share. The randomisation is undone.
  - expertise "U": E_i[j] = log C - H(softmax h_i(x_j)) does not name the class (the entropy
    is unchanged by permuting classes), so it does not undo the randomisation as directly.
    It is refused all the same: it is an un-noised function of the same private model, so
    the round's release (randomised labels, E) has no finite epsilon and ``eps_round`` would
    report a guarantee that does not hold; and it is side information on the label (how
    confident the model is tells which examples it predicts among its own classes).
  - no expertise (FedCT, expertise "uniform"): only the randomised labels leave the client;
    accepted.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from attrs import define, field

from pfl_core.api import (
    ADDON,
    ALGORITHM,
    Packed,
    Plugin,
    SpecError,
    at_least,
    between,
    dequantise,
    expertise_bound,
    finite,
    greater_than,
    hookimpl,
    instantiate,
    quantise,
)


def gaussian_epsilon(sigma: float, delta: float, num_public: int, bound: float) -> float:
    """eps_E = c sqrt(|U|) / sigma * sqrt(2 ln(1.25 / delta))."""
    return bound * math.sqrt(num_public) / sigma * math.sqrt(2 * math.log(1.25 / delta))


def keep_probability(eps_label: float, num_classes: int) -> float:
    """k-ary randomised response: P(report the true label) = e^eps / (e^eps + C - 1)."""
    return math.exp(eps_label) / (math.exp(eps_label) + num_classes - 1)


def randomised_response(labels: torch.Tensor, eps_label: float, num_classes: int, generator) -> torch.Tensor:
    keep = torch.rand(labels.shape, generator=generator, dtype=torch.float64) < keep_probability(eps_label, num_classes)
    # another class uniformly: shift by 1..C-1
    shift = torch.randint(1, num_classes, labels.shape, generator=generator)
    other = (labels.long() + shift) % num_classes
    return torch.where(keep, labels.long(), other).to(labels.dtype)


def uploaded_expertise(spec) -> Optional[str]:
    """The expertise mode ("W" or "U") the spec's algorithm uploads beside its labels, or None
    (FedCT, expertise "uniform", algorithms without expertise)."""
    algorithm = instantiate(ALGORITHM, spec.algorithm.name, spec.algorithm.params, "algorithm.name",
                            "algorithm.params")
    mode = getattr(algorithm.params, "expertise", None)
    return mode if mode in ("W", "U") else None


def _add_epsilon(ctx, name: str, value: float) -> None:
    ctx.round_metrics[name] = value
    ctx.round_metrics["eps_round"] = ctx.round_metrics.get("eps_round", 0.0) + value


@define
class GaussianExpertiseParams:
    sigma: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "std of the Gaussian noise added to every expertise value"})
    delta: float = field(default=1e-5, validator=between(0, 1, low_open=True, high_open=True),
                         metadata={"doc": "delta of the reported (eps_E, delta) guarantee"})


class GaussianExpertise(Plugin):
    """The Gaussian mechanism on uploaded expertise (FedMosaic's client-level privacy): each
    client adds N(0, sigma^2) to every expertise value, clips it to its range and re-quantises;
    logs ``eps_E``. Needs an algorithm that uploads expertise (``fedmosaic`` with expertise
    "W" or "U")."""

    name = "gaussian_expertise"
    kind = ADDON
    Params = GaussianExpertiseParams

    def _bound(self, ctx) -> float:
        return expertise_bound(ctx.params.expertise, ctx.num_classes)

    @hookimpl
    def check_spec(self, spec):
        if uploaded_expertise(spec) is None:
            raise SpecError(f"{self.spec_path}.name",
                            f"{self.name} perturbs expertise scores, but algorithm "
                            f"'{spec.algorithm.name}' uploads none (use fedmosaic with expertise W or U)")

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        if participants:
            p = self.params
            _add_epsilon(ctx, "eps_E", gaussian_epsilon(p.sigma, p.delta, len(ctx.data.public), self._bound(ctx)))

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        packed = upload["expertise"]
        bits, bound = packed.bits, self._bound(ctx)
        values = dequantise(packed.value, bound, bits)
        noise = torch.randn(values.shape, generator=client.generator("gaussian_expertise"), dtype=torch.float64)
        noisy = quantise(values + self.params.sigma * noise, bound, bits)
        return {**upload, "expertise": Packed(noisy, bits)}


@define
class LabelMechanismParams:
    eps_label: float = field(default=2.0, validator=[finite, greater_than(0)], metadata={
        "doc": "epsilon of the randomised response for one label"})
    sensitivity: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "labels one private example can change (the paper's s*); none: all of U (worst case). "
               "eps_L = sensitivity * eps_label"})


class LabelMechanism(Plugin):
    """k-ary randomised response on the uploaded hard labels (a documented substitute for the
    FedMosaic paper's XOR mechanism); logs ``eps_L = sensitivity * eps_label``. Refused when the
    algorithm also uploads expertise that no ``gaussian_expertise`` add-on noises."""

    name = "label_mechanism"
    kind = ADDON
    Params = LabelMechanismParams

    @hookimpl
    def check_spec(self, spec):
        if spec.public is None:
            raise SpecError("public", f"{self.name} perturbs labels on a public set: add a [public] table")
        expertise = uploaded_expertise(spec)
        if expertise is not None and not any(ref.name == GaussianExpertise.name for ref in spec.addons):
            why = ("the class share of the true predicted label, from which the server recovers it exactly"
                   if expertise == "W" else "an un-noised function of the same private model, so the "
                                            "round's release has no finite epsilon")
            raise SpecError(f"{self.spec_path}.name",
                            f"{self.name} randomises the labels, but '{spec.algorithm.name}' also uploads "
                            f"expertise '{expertise}' in the clear ({why}): add a gaussian_expertise add-on "
                            f"or use expertise = \"uniform\"")

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        if participants:
            p = self.params
            s = p.sensitivity if p.sensitivity is not None else len(ctx.data.public)
            _add_epsilon(ctx, "eps_L", s * p.eps_label)

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        packed = upload["labels"]
        noisy = randomised_response(packed.value, self.params.eps_label, ctx.num_classes,
                                    client.generator("label_mechanism"))
        return {**upload, "labels": Packed(noisy, packed.bits)}
