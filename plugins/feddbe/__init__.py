"""FedDBE: Zhang et al., "Eliminating Domain Bias for Federated Learning in Representation
Space", NeurIPS 2023 (FedAvg + DBE, the Domain Bias Eliminator).

The model is a feature extractor f (the body) and a linear classifier h (the last layer); z^g =
f(x) is the classifier's input, the representation. DBE adds two things to FedAvg:

- PRBM (personalized representation bias memory): a vector z-bar^p_i of the representation's
  size per client, trained with the model and never sent; the classifier reads
  z_i = z^g + z-bar^p_i instead of z^g.
- MR (mean regularisation): a term pulling the client's mean representation z-bar^g_i towards
  a consensual global mean z-bar^g that the server collects once.

    initialization period (the first round whose uploads reach the server)             (D0)
        client i: receives w^t; plain local training (cross-entropy only: no PRBM, no MR);
                  uploads w_i and its mean representation over its training split
                  z-bar^g_i = mean over x in D_i of f(x; w_i)
        server:   w^{t+1} = sum_i n_i/n w_i (FedAvg);
                  z-bar^g = sum_i n_i z-bar^g_i / sum_i n_i, fixed from then on              (D1)
    every later round t
        server: sends w^t and z-bar^g
        client i: w <- w^t; E epochs of SGD on (w, z-bar^p_i) with, per mini-batch B,
            logits = h(f(x) + z-bar^p_i)                                                    (D4)
            r_B = (1 - m) r_{B-1} + m mean_{x in B} f(x)  (r of the first batch: its mean)  (D2)
            L = CE(logits, y) + kappa * (1/K) sum_k 1/2 (r_B,k - z-bar^g_k)^2               (D3)
          keeps z-bar^p_i; uploads w_i only
        server: w^{t+1} = sum_i n_i/n w_i
    evaluation: the global model with the client's own bias, h(f(x; w^t) + z-bar^p_i) (the
        paper's personalized accuracy); beside it, prefixed ``global_``, the global model alone
        (the paper's generalization accuracy)

(D0)-(D4) label the steps in this docstring; the paper's Section 4 (PRBM, MR) and its
appendix are the source, but we could not check its equation numbers here, so the labels are
ours. Where the paper leaves a detail to the code we follow the authors' code (PFLlib's
``clientdbe.py``/``serverdbe.py``, identical to github.com/TsingZ0/DBE), and say so:

- (D3) is PFLlib's ``mean(0.5 * (r - z-bar^g)^2)``: a mean over the K dimensions with the 1/2.
  ``kappa = 50`` and ``momentum = 1`` are the authors' run script (``-klw 50 -mo 1``; the
  argument default of ``mo`` is 0.1).
- (D2): the running mean carries the gradient of the current batch only (PFLlib detaches the
  previous value after each step). PFLlib restarts r from zeros every round, so with m < 1 its
  first running means are shrunk towards 0; we start r at the first batch's mean instead
  (the same when m = 1, the default).
- (D0)/(D1): PFLlib's initialization period is an extra pass before round 1 in which *every*
  client trains its local epochs without DBE, and that training is then thrown away (only
  the running means are kept: with m = 1, the mean of each client's last mini-batch). Here it
  is the first round itself, a plain FedAvg round whose training is kept; the global mean is the
  n_i-weighted mean of the participants' exact means over their training splits (eval mode),
  so with partial participation it comes from that round's participants only. Until some upload
  with a mean arrives (a round whose uploads are all lost), rounds stay in the initialization
  period.
- The bias is trained by the same optimiser as the model (``training.*``: its learning rate,
  momentum and weight decay); PFLlib gives it a plain SGD of the same learning rate.
- z-bar^g is sent with every broadcast (K floats, counted); PFLlib hands it to each client once.
  Up: the model (and the K floats of the mean in the initialization period).
- ``prbm = false`` is the ablation without the bias (MR only); with ``kappa = 0`` too it is FedAvg
  bit for bit (tested).
- The classifier must be an ``nn.Linear`` (z^g is its input); another last layer is refused at the
  model's key before any data is loaded. Budget: ``training.local_epochs`` private epochs a round.
- Cold start: the newcomer receives w and z-bar^g, starts from a zero bias and trains
  ``experiment.coldstart_epochs`` epochs with (D2)-(D4) (plain training if the server has no
  global mean yet); it is scored as a training client.
"""

from __future__ import annotations

import torch
from attrs import define, field
from torch import nn

from pfl_core.api import (
    SpecError,
    WeightAveraging,
    at_least,
    between,
    classifier,
    embeddings,
    finite,
    hookimpl,
    load_state,
    model_key,
    probe_model,
    rewrite_classifier_input,
    spec_archs,
)


@define
class FedDBEParams:
    kappa: float = field(default=50.0, validator=[finite, at_least(0)], metadata={
        "doc": "kappa (D3): weight of the mean regularisation (MR); 0 switches it off. Default: the "
               "authors' run script"})
    momentum: float = field(default=1.0, validator=[finite, between(0, 1, low_open=True)], metadata={
        "doc": "m (D2): weight of the current mini-batch in the running mean representation; 1 uses the "
               "batch mean alone (the authors' run script)"})
    prbm: bool = field(default=True, metadata={
        "doc": "the personal representation bias (PRBM, D4); false: the ablation with MR only (with "
               "kappa = 0: FedAvg)"})


# -- the classifier and the representation it reads ----------------------------------------------


def linear_classifier(spec, arch: str, model: nn.Module, method: str) -> nn.Linear:
    """``model``'s last layer, whose input is the representation: refused unless an ``nn.Linear``
    (FedDBE, FedGen, FedCP, GPFL)."""
    layer = classifier(model)
    if not isinstance(layer, nn.Linear):
        raise SpecError(model_key(spec), f"{method} needs a model whose last layer is a Linear classifier; "
                                         f"{arch}'s is a {type(layer).__name__}")
    return layer


def check_linear_classifier(spec, method: str) -> None:
    """``linear_classifier`` on every architecture of ``spec`` that can be built before any data
    is loaded (so ``--dry-run`` reports it); the real model is checked again at set-up."""
    for arch in spec_archs(spec):
        model = probe_model(spec, arch)
        if model is not None:
            linear_classifier(spec, arch, model, method)


def representation_dim(ctx, method: str) -> int:
    """K, the size of the representation: the classifier's input features (checked at set-up)."""
    arch = ctx.models.arch_of(ctx.training_clients[0])
    return linear_classifier(ctx.spec, arch, ctx.models.working(arch), method).in_features


class RepresentationBias(rewrite_classifier_input):
    """While inside: every forward of ``model`` records the classifier's input z^g in
    ``store["emb"]`` and feeds the classifier z^g + ``bias`` (D4); ``bias`` None adds nothing."""

    def __init__(self, model: nn.Module, bias, store: dict):
        super().__init__(model, store)
        self.bias = bias

    def rewrite(self, z):
        return None if self.bias is None else z + self.bias


class WithBias(nn.Module):
    """h(f(x) + z-bar^p_i): ``model`` scored with a client's representation bias."""

    def __init__(self, model: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.model, self.bias = model, bias

    def forward(self, x):
        with RepresentationBias(self.model, self.bias, {}):
            return self.model(x)


def running_mean(previous, batch_mean: torch.Tensor, momentum: float) -> torch.Tensor:
    """(D2): (1 - m) r_{B-1} + m mean_B, r_{B-1} without its gradient; the first batch's mean
    when there is no r_{B-1}."""
    if previous is None:
        return batch_mean
    return (1 - momentum) * previous.detach() + momentum * batch_mean


def mean_regulariser(local_mean: torch.Tensor, global_mean: torch.Tensor) -> torch.Tensor:
    """(D3) without kappa: (1/K) sum_k 1/2 (r_k - z-bar^g_k)^2."""
    return (0.5 * (local_mean - global_mean) ** 2).mean()


class FedDBE(WeightAveraging):
    """FedAvg + DBE (Zhang et al. 2023): a personal bias vector added to the representation
    (kept on the client) and a regulariser pulling the mean representation to a global mean
    collected once; evaluated as the global model with the client's bias (``global_``: without)."""

    name = "feddbe"
    Params = FedDBEParams
    # shared with FedGen, FedCP and GPFL, which take only plugin classes from here
    linear_classifier = staticmethod(linear_classifier)
    check_linear_classifier = staticmethod(check_linear_classifier)
    representation_dim = staticmethod(representation_dim)

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture: the model is averaged
        check_linear_classifier(spec, self.name)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # w^0
        representation_dim(ctx, self.name)  # a classifier that is no Linear fails here
        ctx.server["global_mean"] = None  # until the initialization period (D0)

    # -- server -------------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {"weights": ctx.server["global"]}
        if ctx.server["global_mean"] is not None:
            message["global_mean"] = ctx.server["global_mean"]
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        means = []

        def keeping_means():
            for i, message in uploads:
                if "mean" in message:
                    means.append((weights[i], message["mean"].detach().clone()))
                yield i, message

        super().server_aggregate(ctx, keeping_means(), weights)  # FedAvg: w^{t+1}
        if ctx.server["global_mean"] is None and means:  # (D1), once; the weights sum to 1 over the arrivals
            ctx.server["global_mean"] = sum(w * m for w, m in means)
        return True

    # -- client -------------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["weights"])
        client.scratch["global_mean"] = message.get("global_mean")
        return True

    def bias_of(self, ctx, client) -> torch.Tensor:
        """z-bar^p_i: the client's bias (zeros before it first trains with DBE)."""
        bias = client.state.get("bias")
        if bias is None:
            bias = torch.zeros(classifier(client.model).in_features, device=ctx.device)
        return bias

    def train(self, ctx, client, epochs=None):
        """The client's local training: (D0) without a global mean, else (D2)-(D4)."""
        if client.scratch.get("global_mean") is None:  # (D0): plain training, then the local mean
            metrics = client.train(epochs=epochs)
            client.scratch["local_mean"] = embeddings(client.model, client.data.train_x).mean(0)
            return metrics
        model = client.model
        bias = None
        optimizer = None  # the working model's own
        if self.params.prbm:
            bias = self.bias_of(ctx, client).detach().clone().requires_grad_(True)
            optimizer = client.optimizer(params=[*model.parameters(), bias])
        client.scratch["running"] = None
        with RepresentationBias(model, bias, client.scratch):
            metrics = client.train(epochs=epochs, optimizer=optimizer)
        if bias is not None:
            client.state["bias"] = bias.detach().clone()  # PRBM: kept, never sent
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        return self.train(ctx, client)

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """kappa times (D3) of the running mean (D2) of this batch's representations."""
        global_mean = client.scratch.get("global_mean")
        if global_mean is None or not self.params.kappa or "emb" not in client.scratch or model is not client.model:
            return None
        batch_mean = client.scratch["emb"].flatten(1).mean(0)
        r = running_mean(client.scratch.get("running"), batch_mean, self.params.momentum)
        client.scratch["running"] = r
        return self.params.kappa * mean_regulariser(r, global_mean)

    @hookimpl
    def client_upload(self, ctx, client):
        message = {"weights": client.model.state_dict()}  # the bias stays here
        if "local_mean" in client.scratch:
            message["mean"] = client.scratch["local_mean"]  # (D0)
        return message

    # -- evaluation and cold start ------------------------------------------------------------

    def scored(self, ctx, client, model):
        return {"": WithBias(model, self.bias_of(ctx, client)), "global_": model}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return self.scored(ctx, client, load_state(client.model, message["weights"]))

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # w and z-bar^g
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return self.scored(ctx, client, client.model)


__all__ = ["FedDBE", "FedDBEParams", "RepresentationBias", "WithBias", "check_linear_classifier",
           "linear_classifier", "mean_regulariser", "representation_dim", "running_mean"]
