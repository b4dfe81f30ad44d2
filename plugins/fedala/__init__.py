"""FedALA: Zhang, Hua, Wang, Song, Xue, Ma and Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023 (arXiv:2212.01197), Algorithm 1.

FedAvg whose clients do not overwrite their local model with the global one: each client
aggregates the two *element-wise*, with weights W_i it learns on its own data (Adaptive Local
Aggregation, ALA). With Theta^{t-1} the global model received in round t and Theta_i^{t-1} the
client's local model from its previous round:

    Eq. 4   Theta-hat_i^t = Theta_i^{t-1} + (Theta^{t-1} - Theta_i^{t-1}) (.) [1^{|Theta| - p}; W_i^p]
            (the lower layers' parameters take the global model; only the p higher layers mix,
            element-wise; every buffer stays the local model's, see below)
    Eq. 5   W_i^p <- W_i^p - eta grad_{W_i^p} L(Theta-hat_i^t, D_i^{s,t}; Theta^{t-1})
            = W - eta grad_{Theta-hat} L (.) (Theta^{t-1} - Theta_i^{t-1}), each step followed by
            the paper's weight clipping of every element to [0, 1]; one step per mini-batch of
            D_i^{s,t}, a random s% of the client's training data

    server: Theta^0 = the seeded initial weights                                   (setup)
    each round t, each participant i, given Theta^{t-1}:                           (on_broadcast)
        Algorithm 1, lines 6-16 (ALA):                                             (on_receive)
            first round of i: Theta-hat_i^t = Theta^{t-1} (no local model yet: FedAvg's start)
            else: W_i^p starts at 1 (first time) or at the W_i^p it kept; Eq. 5 on D_i^{s,t}:
                  the first time until converged (the start phase), one epoch afterwards;
                  Theta-hat_i^t from Eq. 4 with the learned W_i^p
        Theta_i^t <- training.local_epochs epochs of SGD from Theta-hat_i^t          (local_train)
        upload Theta_i^t; keep Theta_i^t and W_i^p                                 (client_upload)
    Theta^t = sum_i n_i / n Theta_i^t (FedAvg's aggregation)                       (server_aggregate)
    evaluation: client i is scored with Eq. 4 on the current global model, its local model and
    the W_i^p it holds (what it would start its next round with, without the W-learning step);
    a client with no local model yet is scored with the global model.

Eq. 4 (ALA on the p higher layers) and Eq. 5 (the weight learning) are the paper's numbers as
its first author uses them (github.com/TsingZ0/FedALA issues 5 and 17: Eq. 6 of Section 3.3 is
derived from Eq. 4 and 5, W's change giving Theta-hat's through Eq. 4); the authors' README maps
the ALA module to lines 6-16 of Algorithm 1.

Defaults and decisions (the authors' code: github.com/TsingZ0/FedALA, ``utils/ALA.py``, the same
module as PFLlib's; read, not copied):

- ``eta = 1.0``, ``s = 80``: the authors' defaults (their ``main.py``, and PFLlib's).
- ``p = 1`` counts *layers* (pfl's parameterised layers, from the output), as the paper's p
  does. The authors' ``layer_idx`` counts parameter tensors (weight and bias separately); their
  default ``layer_idx = 2`` is one layer with a bias, i.e. p = 1 here.
- The start phase follows the authors' code: W learns epoch after epoch until the standard
  deviation (numpy's, ddof 0) of the last ``num_pre_loss`` recorded losses is below
  ``threshold`` and more than ``num_pre_loss`` losses were recorded (``threshold = 0.1``,
  ``num_pre_loss = 10``: their defaults). Deviations: the recorded loss is the epoch's mean
  mini-batch loss (the authors record the last batch's), and ``max_start_epochs`` caps the phase
  (the authors loop until convergence and warn it can get stuck). The start phase happens in the
  client's first round *with a local model* (its second participation), as in the authors' code,
  where ALA is skipped while the local model equals the global one.
- D_i^{s,t}: ``max(1, int(s/100 n_i))`` samples drawn without replacement with the client's
  seeded ``client.rng("fedala")``, batched as ``training.batch_size`` in the spec's shuffle and
  drop_last (the authors take a contiguous slice at a random offset of their pre-shuffled data,
  unshuffled, keeping the last partial batch: ``drop_last=False`` in their current ``ALA.py``,
  the first release dropped it). The loss L is the client's objective (the cross-entropy plus
  any add-on's term) on Theta-hat.
- W_i^p covers the parameters of the p higher layers. Buffers (BatchNorm statistics), of the
  lower and of the higher layers alike, stay the local model's, as in the authors' ``ALA.py``,
  which copies and mixes ``parameters()`` only, so a client's running statistics are its own
  (FedAvg's server still averages them, and a client with no local model yet starts from the
  global model's). Only W is trained by Eq. 5 (plain SGD at ``eta``, no momentum, as the
  authors'); the model's batch statistics are not changed by it.
- Budget (``local_work``): training.local_epochs + s/100 private epochs per round (one pass of
  W-learning over s% of the data); a client's start phase costs more, its first round less; the
  measured ``budget.private_epochs`` counts what ran. W-learning steps are training steps: they
  draw on a straggler's batch budget (``stragglers`` add-on) before the local training does.
- Bytes: FedAvg's (Theta down, Theta_i up); W_i never leaves the client.
- Logged per client: ``ala_epochs`` (W-learning epochs this round) and ``ala_weight_mean`` (the
  mean of W_i^p).
- Cold start: the newcomer has no local model, so it starts from the global model (Eq. 4 is not
  applied) and trains ``experiment.coldstart_epochs`` epochs (the core default).
"""

from __future__ import annotations

import numpy as np
import torch
from attrs import define, field
from torch import nn

from pfl_core.api import (
    ClippedSGD,
    LearnedMix,
    LocalWork,
    SpecError,
    at_least,
    between,
    clone_state,
    elementwise_mix,
    finite,
    greater_than,
    hookimpl,
    layer_keys,
    load_state,
    per_run,
    probe_num_layers,
    spec_archs,
)
from pfl_plugins.fedavg import FedAvg


@define
class FedALAParams:
    eta: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "learning rate of the aggregation weights W (Eq. 5); the authors' default"})
    s: int = field(default=80, validator=between(1, 100), metadata={
        "doc": "percent of the client's training data W learns on each round (D_i^{s,t}); the authors' default"})
    p: int = field(default=1, validator=at_least(1), metadata={
        "doc": "the higher layers that ALA mixes (Eq. 4), counted from the output; the lower layers take the "
               "global model"})
    threshold: float = field(default=0.1, validator=[finite, greater_than(0)], metadata={
        "doc": "the start phase ends when the standard deviation of the last num_pre_loss epoch losses is "
               "below this (the authors' code)"})
    num_pre_loss: int = field(default=10, validator=at_least(1), metadata={
        "doc": "how many recorded epoch losses the start phase's convergence test looks at (the authors' code)"})
    max_start_epochs: int = field(default=100, validator=at_least(1), metadata={
        "doc": "a cap on the start phase's epochs (not in the paper: its code loops until convergence)"})


# -- the paper's equations, as plain functions ---------------------------------------------------


def ala_split(model: nn.Module, p: int) -> tuple[list[str], list[str]]:
    """(lower parameter keys, higher parameter keys): the *parameters* of the layers below the p
    higher layers (Eq. 4's 1s: the global model's) and those of the p higher layers (their W).
    Buffers are in neither: they stay the local model's (the authors' ``parameters()``)."""
    layers = layer_keys(model)
    parameters = {name for name, _ in model.named_parameters()}
    cut = max(len(layers) - p, 0)
    lower = [key for layer in layers[:cut] for key in layer if key in parameters]
    higher = [key for layer in layers[cut:] for key in layer if key in parameters]
    return lower, higher


def local_aggregation(local: dict, global_: dict, weights: dict, lower) -> dict:
    """Eq. 4: Theta-hat = local + (global - local) (.) W on the keys of ``weights``, the global
    model on the ``lower`` keys, the local model elsewhere (every buffer)."""
    return elementwise_mix({**local, **{key: global_[key] for key in lower}}, local, global_, weights)


class Aggregated(LearnedMix):
    """Theta-hat(W) of Eq. 4 as a module whose only parameters are W, so autograd gives Eq. 5's
    gradient; the rest of Eq. 4 (lower layers' parameters: global; buffers: local) is fixed.
    ``ClippedSGD`` is Eq. 5's step with the paper's weight clipping."""

    def __init__(self, model: nn.Module, local: dict, global_: dict, weights: dict, lower):
        super().__init__(model, local, global_, weights, fixed=local_aggregation(local, global_, {}, lower))


def converged(losses: list[float], threshold: float, num_pre_loss: int) -> bool:
    """The start phase's stopping rule (the authors' code): more than ``num_pre_loss`` losses and
    the standard deviation of the last ``num_pre_loss`` below ``threshold``."""
    return len(losses) > num_pre_loss and float(np.std(losses[-num_pre_loss:])) < threshold


# -- the plugin ---------------------------------------------------------------------------------


class FedALA(FedAvg):
    """FedALA (Zhang et al. 2023): FedAvg whose clients start each round from an element-wise,
    learned aggregation of their local model and the global model on the p higher layers (the
    lower layers' parameters take the global model, every buffer stays local); W learned until
    converged the first time, one epoch a round afterwards. Each client is scored with that
    aggregation. FedAvg's bytes. Budget: ``training.local_epochs + s/100`` (plus the start
    phase)."""

    name = "fedala"
    Params = FedALAParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(spec.training.local_epochs + self.params.s / 100))

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):
            layers = probe_num_layers(spec, arch)
            if layers is not None and self.params.p > layers:
                raise SpecError(f"{self.spec_path}.params.p", f"is {self.params.p}, but {arch} has {layers} "
                                                              f"parameterised layer(s): p must be in 1..{layers}")

    def split(self, ctx, client):
        return per_run(ctx, self, f"split:{client.arch}", lambda: ala_split(client.model, self.params.p))

    def sample(self, ctx, client):
        """D_i^{s,t}: a seeded random s% of the client's training data (at least one sample)."""
        n = client.num_train
        m = max(1, int(self.params.s / 100 * n))
        index = np.sort(client.rng("fedala").choice(n, size=m, replace=False))
        index = torch.as_tensor(index, dtype=torch.long)
        return client.data.train_x[index], client.data.train_y[index]

    def learn_weights(self, ctx, client, local: dict, global_: dict, weights: dict, start: bool) -> dict:
        """Eq. 5 on D_i^{s,t}: until converged (``start``) or for one epoch; the learned W."""
        lower, _ = self.split(ctx, client)
        module = Aggregated(client.model, local, global_, weights, lower)
        optimizer = ClippedSGD(module.parameters(), lr=self.params.eta)
        x, y = self.sample(ctx, client)
        losses = []
        for _ in range(self.params.max_start_epochs if start else 1):
            metrics = client.train(model=module, epochs=1, optimizer=optimizer, x=x, y=y, work="private")
            if "train_loss" not in metrics:  # no step ran: the round's batch budget is spent
                break
            losses.append(metrics["train_loss"])
            if converged(losses, self.params.threshold, self.params.num_pre_loss):
                break
        client.log(ala_epochs=len(losses))
        return module.weights()

    def initial_weights(self, ctx, client) -> dict:
        """W_i^p before any learning: all ones (Theta-hat = the global model)."""
        _, higher = self.split(ctx, client)
        state = client.model.state_dict()
        return {k: torch.ones_like(state[k]) for k in higher}

    def aggregated(self, ctx, client, global_: dict):
        """Eq. 4 with the W the client holds, in its working model (the global model if the
        client has no local model yet)."""
        local = client.state.get("weights")
        if local is None:
            return load_state(client.model, global_)
        lower, _ = self.split(ctx, client)
        weights = client.state.get("W") or self.initial_weights(ctx, client)
        return load_state(client.model, local_aggregation(local, global_, weights, lower))

    @hookimpl
    def on_receive(self, ctx, client, message):
        global_, local = message["weights"], client.state.get("weights")
        if local is not None:  # lines 6-16 of Algorithm 1
            start = "W" not in client.state
            weights = client.state.get("W") or self.initial_weights(ctx, client)
            client.state["W"] = self.learn_weights(ctx, client, local, global_, weights, start)
            client.log(ala_weight_mean=float(torch.cat([w.flatten() for w in client.state["W"].values()]).mean()))
        self.aggregated(ctx, client, global_)
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)  # Theta_i^t, the next round's local model
        return metrics

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.aggregated(ctx, client, message["weights"])}


__all__ = ["Aggregated", "ClippedSGD", "FedALA", "FedALAParams", "ala_split", "converged", "local_aggregation"]
