"""GPFL: Zhang et al., "GPFL: Simultaneously Learning Global and Personalized Feature
Information for Personalized Federated Learning", ICCV 2023.

The model is a feature extractor phi (the body) and a linear classifier (the personalized head
psi, the last layer). GPFL adds two modules the server averages, a Conditional Valve (CoV, its
parameters V) and a Global Category Embedding layer (GCE): a table E (the paper's C) of one
K-vector e_c per class, C classes (the paper's U). f = phi(x) is the classifier's input, a_i the
client's class proportions (over its training split). Equation and line numbers are those of the
ICCV 2023 paper (Section 3.2 and its Algorithm 1):

    g = (1/C) sum_c e_c                              (Eq. (5); e_c from the frozen copy of E)
    a_i,c = the share of class c in client i's data  (Eq. (6))
    p_i = sum_c a_i,c e_c                            (Eq. (7), see below: no 1/C here)
    CoV(f, c) = ReLU(f * (gamma(c) + 1) + beta(c)),  gamma, beta: Linear -> ReLU -> LayerNorm
                                                     (Eqs. (3)-(4))
    f^G = CoV(f, g) (global feature),  f^P = CoV(f, p_i) (personalized feature)
    output = head_i(f^P)

Each round t (Algorithm 1):

    server: sends phi, the CoV and the GCE (E)                                     (line 4)
    client i: phi, CoV, E <- the received ones; a frozen copy E^t of E; head_i its own (the
        initial head before its first round); g, p_i from E^t (Eqs. (5), (7))      (lines 6-8)
        training.local_epochs epochs of SGD on (phi, head_i, CoV, E) together      (lines 9-13)
        on L_i (Eq. (11)):
            CE(head_i(f^P), y)                   (L^P, Eq. (10))
            + CE(cos(f^G, e_1..C), y)            (L^alg, angle-level guidance: cosine logits, Eq. (8))
            + lam * || f^G_B - E^t[y_B] ||_2    (L^mlg, magnitude-level guidance, Eq. (9): here
                                                 the batch's Frobenius norm, E^t frozen)
            + mu / 2 (||CoV||^2 + ||E||^2)      (the mu terms of Eq. (11), see below)
        uploads phi_i, CoV_i, E_i; keeps head_i                                    (line 14)
    server: n_i-weighted averages of phi, CoV and E                                (lines 15-18)
    evaluation: the received phi and CoV with the client's own head_i and p_i from the received E:
        head_i(CoV(phi(x), p_i)) (the personalized route only, as the paper evaluates)

Where the paper leaves a detail to the code, or prints something else, we follow PFLlib
(``clientgpfl.py`` / ``servergpfl.py``, by the paper's first author) and say so:

- Eq. (7) prints p_i = (1/C) sum_c a_i,c e_c; PFLlib (and this plugin) leave out the 1/C, so
  p_i here is C times the printed one (g, Eq. (5), does divide by C in both).
- Eq. (8) is PFLlib's GCE loss: the cross-entropy of the cosine similarities (no scale) between
  f^G and every class embedding. Eq. (9) is a per-sample ||f^G - e_y||_2 in the paper; we use
  PFLlib's ``torch.norm(f^G - e_y, 2)`` over the whole batch (not squared, not averaged), with E
  frozen at the received table.
- Eq. (11) prints the regularisers as mu ||V||_2 + mu ||E||_2 (norms, not squared). PFLlib gives
  the CoV and the GCE their own SGD with ``weight_decay = mu``, whose gradient is that of
  mu/2 ||.||^2; we add mu/2 ||.||^2, so with plain SGD the step is PFLlib's.
- The CoV and the GCE are trained by the same optimiser as the model (``training.*``: its
  learning rate, momentum and weight decay; Algorithm 1 lines 9-13 update all four together);
  PFLlib gives each of them a plain SGD of the same learning rate with ``weight_decay = mu`` (no
  momentum), and the model a plain SGD. So with ``training.momentum`` or
  ``training.weight_decay`` set (or ``optimizer = "adam"``), the CoV and E carry them too, the
  decay on top of mu/2 ||.||^2; with the defaults (``"sgd"``, both 0) every step is PFLlib's.
- Eqs. (5)-(7) from the received E, as Algorithm 1 lines 7-8 (copy the received table, then
  compute g and p_i); PFLlib computes g and p_i from the client's local table before it is
  overwritten by the new global one (one round stale for a participant).
- ``lam = 0.01``, ``mu = 0.1``: the authors' run script for 4-layer CNNs and 3-layer MLPs.
- The initial CoV and E are their own seeded draws (E ~ N(0, 1), nn.Embedding's), every client's
  initial head the seeded initial classifier.
- Bytes: down phi, CoV (4 K^2 + 8 K floats), E (C K floats); up the same. Budget:
  ``training.local_epochs`` private epochs a round. The classifier must be an ``nn.Linear``; a
  model without a feature extractor (one layer) or another last layer is refused at the model's
  key before any data is loaded.
- Cold start: the newcomer receives phi, CoV and E, starts from the initial head and trains
  ``experiment.coldstart_epochs`` epochs on Eq. (11); it is scored as a training client.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import at_least, classifier, finite, hookimpl, rewrite_classifier_input
from pfl_plugins.feddbe import FedDBE
from pfl_plugins.fedpac import ClassifierSplit


@define
class GPFLParams:
    lam: float = field(default=0.01, validator=[finite, at_least(0)], metadata={
        "doc": "lambda of Eq. (11): weight of the magnitude-level guidance, Eq. (9) (the authors' run script "
               "for CNNs and MLPs)"})
    mu: float = field(default=0.1, validator=[finite, at_least(0)], metadata={
        "doc": "mu of Eq. (11): L2 regularisation of the CoV's and the GCE's parameters (PFLlib's weight decay on "
               "them)"})

    @property
    def head_layers(self) -> int:
        return 1  # the personalized head is the classifier (FedPer's split)


class ConditionalValve(nn.Module):
    """Eqs. (3)-(4): CoV(f, c) = ReLU(f * (gamma(c) + 1) + beta(c))."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.relu(f * (self.gamma(c) + 1) + self.beta(c))


class GlobalModules(nn.Module):
    """What GPFL shares besides phi: the CoV and the GCE (a C x K embedding table)."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.cov = ConditionalValve(dim)
        self.gce = nn.Embedding(num_classes, dim)


def conditional_inputs(table: torch.Tensor, proportions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. (5), (7): (g, p_i) = (the mean class embedding, the embeddings weighted by the class
    proportions; without Eq. (7)'s 1/C, as PFLlib)."""
    table = table.detach()
    return table.mean(0), proportions.to(table.dtype) @ table


def angle_level_loss(f_global: torch.Tensor, table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. (8): cross-entropy of the cosine similarities between f^G and every class embedding."""
    return F.cross_entropy(F.normalize(f_global, dim=1) @ F.normalize(table, dim=1).T, y)


def magnitude_level_loss(f_global: torch.Tensor, frozen_table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. (9), as PFLlib computes it: ||f^G - e_y||_2 over the whole batch (the Frobenius norm)."""
    return torch.norm(f_global - frozen_table[y].detach())


class Valve(rewrite_classifier_input):
    """While inside: the classifier reads f^P = CoV(f, p_i) instead of f; ``store["emb"]`` is f."""

    def __init__(self, model, cov, personal_input, store=None):
        super().__init__(model, store)
        self.cov, self.personal = cov, personal_input

    def rewrite(self, f):
        return self.cov(f, self.personal)


class GPFLModel(nn.Module):
    """A client's evaluated model: head_i(CoV(phi(x), p_i))."""

    def __init__(self, model, cov, personal_input):
        super().__init__()
        self.model, self.cov, self.personal = model, cov, personal_input

    def forward(self, x):
        with Valve(self.model, self.cov, self.personal):
            return self.model(x)


class GPFL(ClassifierSplit):
    """GPFL (Zhang et al. 2023): a conditional valve turns the features into a global and a
    personalized feature, guided by global category embeddings (angle and magnitude); the
    feature extractor, the valve and the embeddings are averaged, the head stays on the client.
    Evaluated: the global extractor and valve with the client's own head and conditional input."""

    name = "gpfl"
    Params = GPFLParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture, with a feature extractor
        FedDBE.check_linear_classifier(spec, self.name)

    def build_modules(self, ctx, dim: int) -> GlobalModules:
        return GlobalModules(dim, ctx.num_classes).to(ctx.device)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # phi^0 (the body keys)
        dim = FedDBE.representation_dim(ctx, self.name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed_for("gpfl_init"))
            ctx.server["modules"] = {k: v.detach().clone() for k, v in self.build_modules(ctx, dim).state_dict().items()}

    # -- server -------------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"body": ctx.server["body"], "modules": ctx.server["modules"]}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.on_broadcast(ctx, client_id)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        sums = {}

        def modules_too():
            for i, message in uploads:
                for k, v in message["modules"].items():
                    sums[k] = sums.get(k, 0) + weights[i] * v.detach()
                yield i, message

        super().server_aggregate(ctx, modules_too(), weights)  # phi: FedPer's n_i-weighted mean
        if sums:  # nobody took part: unchanged
            ctx.server["modules"] = sums
        return True

    # -- client -------------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = self.load_personal(ctx, client, message["body"])  # phi + head_i
        modules = self.build_modules(ctx, classifier(model).in_features)
        modules.load_state_dict(message["modules"])
        counts = torch.bincount(client.data.train_y, minlength=ctx.num_classes)
        generic, personal = conditional_inputs(modules.gce.weight, counts / counts.sum())  # Eqs. (5)-(7)
        client.scratch.update(modules=modules, generic=generic, personal=personal,
                              frozen_table=modules.gce.weight.detach().clone())
        return True

    def train(self, ctx, client, epochs=None):
        model, modules = client.model, client.scratch["modules"]
        with Valve(model, modules.cov, client.scratch["personal"], client.scratch):
            return client.train(epochs=epochs, optimizer=client.optimizer(params=[*model.parameters(),
                                                                                   *modules.parameters()]))

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(ctx, client)
        self.keep_head(ctx, client)  # head_i stays here
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """Eq. (8) + lam Eq. (9) + the mu terms of Eq. (11) (as mu/2 ||.||^2) on the global feature
        f^G = CoV(f, g); the core adds Eq. (10)."""
        if "emb" not in client.scratch or model is not client.model:
            return None
        modules = client.scratch["modules"]
        f_global = modules.cov(client.scratch["emb"].flatten(1), client.scratch["generic"])
        loss = angle_level_loss(f_global, modules.gce.weight, y)
        if self.params.lam:
            loss = loss + self.params.lam * magnitude_level_loss(f_global, client.scratch["frozen_table"], y)
        if self.params.mu:
            loss = loss + self.params.mu / 2 * sum(p.pow(2).sum() for p in modules.parameters())
        return loss

    @hookimpl
    def client_upload(self, ctx, client):
        state = client.model.state_dict()
        return {"body": {k: state[k] for k in self.body_keys(ctx)}, "modules": client.scratch["modules"].state_dict()}

    # -- evaluation and cold start ------------------------------------------------------------

    def scored(self, client):
        return {"": GPFLModel(client.model, client.scratch["modules"].cov, client.scratch["personal"])}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        return self.scored(client)

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # phi, CoV, E and the initial head
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return self.scored(client)


__all__ = [
    "GPFL",
    "ConditionalValve",
    "GPFLModel",
    "GPFLParams",
    "GlobalModules",
    "Valve",
    "angle_level_loss",
    "conditional_inputs",
    "magnitude_level_loss",
]
