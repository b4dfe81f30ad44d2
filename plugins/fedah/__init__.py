"""FedAH: Zhou, He, Zhai, Gao, Chen, Qin, Zhang and Guo, "FedAH: Aggregated Head for Personalized
Federated Learning", 2024 (arXiv:2412.01295).

What was read: the paper's abstract and third-party summaries of its method (the local learning
process in four steps below); its equations could not be read from this machine, so the step
labels (S1)-(S5) are ours. The details follow FL-bench (github.com/KarhouTam/FL-bench at
06e658bca5af6ce732e25bb7c0f8be321e14a85e, ``src/client/fedah.py`` and ``src/server/fedah.py``),
read in full, not copied. PFLlib has no FedAH (the authors' repository, heyuepeng/FedAH, was not
read).

The model is a feature extractor (the body) and a head (the last ``head_layers`` parameterised
layers). The server averages the whole model, as FedAvg; each client keeps its own head h_i and
element-wise aggregation weights W_i (same shapes as the head's parameters, all ones at first).
With theta = (phi, h) the global model received in round t:

    (S1) Aggregated Head: phi <- the global body (its buffers included);
         h-hat_i = h_i + (h - h_i) (.) W_i                                             (on_receive)
    (S2) W_i learning (FedALA's Eq. 5 applied to the head): for ``weight_epochs`` epochs over the
         client's training data, per mini-batch
             W_i <- clip_[0,1]( W_i - eta grad_{h-hat} L(phi, h-hat_i) (.) (h - h_i) ),
         h-hat_i recomputed from the new W_i; skipped while the client has no head of its own
         (its first round: h-hat_i = h, and h - h_i would be 0)                       (on_receive)
    (S3) head training: ``head_epochs`` epochs of the configured optimiser on h-hat_i, the body
         frozen; the result is the client's new head h_i                               (local_train)
    (S4) body training: training.local_epochs epochs on phi, the head frozen           (local_train)
    (S5) upload (phi_i, h_i); the server averages them weighted by client_weighting (train sizes:
         FL-bench's FedAvg weighting)                                (client_upload, server_aggregate)

What is evaluated: client i on (S1) with the current global model, its h_i and the W_i it holds
(the model it would start its next round from, before its next W-learning step); a client with
no head yet (never trained) is scored with the global model. Cold-start clients receive the
global model and fine-tune it (experiment.coldstart_epochs, the core default).

Defaults: ``eta = 1.0``, ``weight_epochs = head_epochs = 1`` (FL-bench's ``eta`` and
``plocal_epochs``, which it uses for both S2 and S3), ``head_layers = 1`` (FL-bench's
``classifier``).

Decisions and deviations:

- FL-bench's clients share one client object: its W and "local head" are the last client's, not
  the client's own (the local head it mixes is whatever head the worker trained last). Here W_i
  and h_i are each client's own, as the paper describes.
- S3 and S4 train only the part they name (the other part frozen, a fresh optimiser over that
  part, as FedRep here); FL-bench zeroes the frozen part's gradients under one optimiser over the
  whole model, so momentum and weight decay still move it.
- FL-bench learns W even when h_i equals h (a zero gradient: W does not move); here S2 is skipped
  then. FL-bench skips batches of one sample; here the spec's ``training.drop_last`` applies.
- W-learning (S2) is plain SGD at ``eta`` followed by clipping (FL-bench's), its loss the client's
  objective (the cross-entropy plus any add-on's term); BatchNorm statistics updated while W
  learns are dropped (the head's buffers, if any, stay the client's own h_i's, the body's are the
  global model's as in FL-bench's ``base.load_state_dict``).
- Lost uploads (``dropout`` add-on): h_i and W_i are the client's own, never summed by the
  server, so the client keeps them (docs/writing-a-plugin.md, "Client state and lost uploads");
  nothing is staged.
- Budget (``local_work``): weight_epochs + head_epochs + training.local_epochs private epochs per
  round (the first round skips S2). W-learning steps draw on a straggler's batch budget first.
- Bytes: FedAvg's (theta down, theta_i up); W_i never leaves the client.
- Logged per client: ``ah_weight_mean`` (the mean of W_i after S2).
"""

from __future__ import annotations

import torch
from attrs import define, field
from torch import nn

from pfl_core.api import (
    ClippedSGD,
    LearnedMix,
    LocalWork,
    SpecError,
    at_least,
    elementwise_mix,
    finite,
    greater_than,
    hookimpl,
    load_state,
    per_run,
    probe_num_layers,
    spec_archs,
    split_at,
)
from pfl_plugins.fedavg import FedAvg


@define
class FedAHParams:
    eta: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "learning rate of the head's aggregation weights W (S2); FL-bench's default"})
    weight_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs of W learning over the client's training data each round (S2); 0 keeps W at its "
               "start (all ones: the global head)"})
    head_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "epochs training the aggregated head, body frozen (S3)"})
    head_layers: int = field(default=1, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the head (1: the classifier)"})


def aggregate_head(global_: dict, head: dict, weights: dict) -> dict:
    """(S1): the global model with each head parameter replaced by h_i + (h - h_i) (.) W_i; the
    head's other entries (buffers) are the client's own h_i's."""
    return elementwise_mix({**global_, **head}, head, global_, weights)


ClippedWeightSGD = ClippedSGD  # (S2)'s optimiser: plain gradient steps on W, each clipped to [0, 1]


class AggregatedHead(LearnedMix):
    """The client's model at (S1) as a module whose only parameters are W: the global body and
    h_i + (h - h_i) (.) W, so autograd gives grad_W = grad_h-hat (.) (h - h_i), (S2)'s gradient."""

    def __init__(self, model: nn.Module, global_: dict, head: dict, weights: dict):
        super().__init__(model, head, global_, weights, fixed={**global_, **head})


class FedAH(FedAvg):
    """FedAH (Zhou et al. 2024): FedAvg whose clients start each round from the global body and an
    element-wise, learned mix of their own head and the global head, then train the head (body
    frozen) and the body (head frozen). Each client is scored with that mix. FedAvg's bytes."""

    name = "fedah"
    Params = FedAHParams

    def local_work(self, spec) -> LocalWork:
        p = self.params
        return LocalWork(float(p.weight_epochs + p.head_epochs + spec.training.local_epochs))

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):
            layers = probe_num_layers(spec, arch)
            if layers is not None and self.params.head_layers >= layers:
                raise SpecError(f"{self.spec_path}.params.head_layers",
                                f"is {self.params.head_layers}, but {arch} has {layers} parameterised layer(s): "
                                f"the head must leave at least one body layer")

    def split(self, ctx) -> tuple[list[str], list[str]]:
        """(body keys, head keys) in state_dict order; the head is the last head_layers layers."""
        def compute():
            model = ctx.models.working(ctx.models.arch_of(0))  # one architecture (FedAvg's check_spec)
            _, head = split_at(model, -self.params.head_layers)
            keys = list(model.state_dict())
            return [k for k in keys if k not in head], [k for k in keys if k in head]
        return per_run(ctx, self, "body_head", compute)

    def head_parameters(self, ctx, client) -> list[str]:
        head = set(self.split(ctx)[1])
        return [name for name, _ in client.model.named_parameters() if name in head]

    def aggregated(self, ctx, client, global_: dict):
        """(S1) in the client's working model with the W_i it holds (the global model if it has no
        head of its own yet)."""
        head = client.state.get("head")
        if head is None:
            return load_state(client.model, global_)
        return load_state(client.model, aggregate_head(global_, head, client.state["W"]))

    def learn_weights(self, ctx, client, global_: dict) -> dict:
        """(S2): ``weight_epochs`` epochs of clipped SGD on W_i; the learned W_i."""
        module = AggregatedHead(client.model, global_, client.state["head"], client.state["W"])
        optimizer = ClippedWeightSGD(module.parameters(), lr=self.params.eta)
        if self.params.weight_epochs:
            client.train(model=module, epochs=self.params.weight_epochs, optimizer=optimizer, work="private")
        return module.weights()

    @hookimpl
    def on_receive(self, ctx, client, message):
        global_ = message["weights"]
        if "head" in client.state:
            client.state["W"] = self.learn_weights(ctx, client, global_)
            client.log(ah_weight_mean=float(torch.cat([w.flatten() for w in client.state["W"].values()]).mean()))
        self.aggregated(ctx, client, global_)
        return True

    def train_part(self, ctx, client, part: str, epochs: int):
        """SGD on the head or the body, the other part frozen."""
        head = set(self.split(ctx)[1])
        named = list(client.model.named_parameters())
        trained = [p for k, p in named if (k in head) == (part == "head")]
        frozen = [p for k, p in named if (k in head) != (part == "head")]
        for p in frozen:
            p.requires_grad_(False)
        try:
            return client.train(epochs=epochs, optimizer=client.optimizer(params=trained))
        finally:
            for p in frozen:
                p.requires_grad_(True)

    @hookimpl
    def local_train(self, ctx, client):
        metrics = {}
        if self.params.head_epochs:
            metrics = self.train_part(ctx, client, "head", self.params.head_epochs)  # (S3)
        state = client.model.state_dict()
        client.state["head"] = {k: state[k].detach().clone() for k in self.split(ctx)[1]}  # h_i
        if "W" not in client.state:
            client.state["W"] = {k: torch.ones_like(state[k]) for k in self.head_parameters(ctx, client)}
        if ctx.spec.training.local_epochs:
            metrics = self.train_part(ctx, client, "body", ctx.spec.training.local_epochs)  # (S4)
        return metrics

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.aggregated(ctx, client, message["weights"])}


__all__ = ["AggregatedHead", "ClippedWeightSGD", "FedAH", "FedAHParams", "aggregate_head"]
