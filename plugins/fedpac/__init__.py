"""FedPAC: Xu, Tong and Huang, "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration", ICLR 2023, Algorithm 1.

The model is a feature extractor f_theta (the body, shared) and a linear classifier phi_i (the
head: the last parameterised layer, personal). z = f_theta(x) is the classifier's input.
Each round t, with S_t the participants:

    server: sends theta^t, the global class centroids c^t, and to client i its combined
            classifier phi-hat_i from the last round it took part in, if any     (on_broadcast)
    client i:
        theta <- theta^t; phi_i <- phi-hat_i (its own phi_i, or the initial head)  (on_receive)
        feature statistics with theta^t, before training (classifier collaboration, Sec. 4.3):
            p_i(k) = n_ik / n_i,  mu_ik = mean of z over class k,  h_i(k) = p_i(k) mu_ik     (P1)
            v_i = (1/n_i) sum_k p_i(k) (E_i[||z||^2 | k] - p_i(k) ||mu_ik||^2)            (P2)
        head_epochs epochs of SGD on phi_i, theta fixed (cross-entropy)       (local_train)
        body_epochs epochs of SGD on theta, phi_i fixed, on
            CE + lam * mean over samples and dimensions of (f_theta(x) - c_y)^2            (P3)
            (feature alignment, Sec. 4.2; only samples whose class has a global centroid)
        local centroids with the updated theta_i: c_ik = mean of z over class k          (P4)
        uploads theta_i, phi_i, {c_ik, n_ik}, (v_i, h_i)                      (client_upload)
    server:                                                               (server_aggregate)
        theta^{t+1} = sum_i n_i / n theta_i
        c_k^{t+1} = sum_i n_ik c_ik / sum_i n_ik                                            (P5)
        for each i in S_t: alpha_i = argmin over the simplex of                             (P6)
            sum_j alpha_j^2 v_j + sum_k || sum_j alpha_j (h_i(k) - h_j(k)) ||^2   (j in S_t)
        phi-hat_i = sum_j alpha_ij phi_j                                                     (P7)
    evaluation: theta (global) + phi-hat_i (else phi_i, else the initial head)

(P1)-(P7) label the steps in this docstring; the paper's Sections 4.2-4.3 and Algorithm 1 are
the source, but we could not check its equation numbers, so the labels are ours. (P6) is the
paper's quadratic program: the estimated test loss of the combined classifier, a variance term
(v_j: how noisy client j's classifier is, small for large n_j) plus a bias term (how far
client j's class-conditional feature statistics are from client i's).

Defaults and decisions:

- ``lam = 1.0``: the alignment weight of the authors' released code (``--lam 1.0``). (P3) is
  the mean over samples *and feature dimensions* (the authors' MSE), i.e. the paper's squared
  distance divided by d, the scaling ``lam = 1`` was set for. Samples whose class has no
  global centroid (none in round 1) get no alignment term.
- ``head_epochs = 1``, ``body_epochs = None`` (= ``training.local_epochs``): the authors run
  one classifier epoch, then the local epochs on the feature extractor. Budget
  (``local_work``): head_epochs + body_epochs private epochs per round.
- ``head_lr_scale = 10``: the classifier's step size is 10 x ``training.lr``, the paper's
  ratio (0.1 for the classifier, 0.01 for the extractor). The optimiser is the spec's.
- ``collaborate = True``: the classifier collaboration (P1, P2, P6, P7). ``False`` is the
  paper's ablation without it (each client keeps its own phi_i, alpha_i one-hot); then nothing
  for the QP is computed or sent. With ``lam = 0`` and ``collaborate = False`` (and
  ``head_lr_scale = 1``) FedPAC is FedRep with one head epoch (tested bit for bit): the
  FedPer family's shared body, personal head trained first.
- (P6) is solved with ``scipy.optimize.minimize`` (SLSQP) on the matrix diag(v) + G, G_jj' =
  sum_k <h_i(k) - h_j(k), h_i(k) - h_j'(k)> (positive semi-definite), scaled by its mean
  diagonal; the result is clipped at 0 and renormalised. Ties (a flat objective) keep the
  uniform starting point. The combination runs over this round's participants, as the paper's.
- The combined head reaches client i with its next broadcast (counted then); the evaluation
  after the round reads it from the server, as if delivered at once (the paper sends it at
  the end of the round). Global centroids of classes nobody reported this round are kept.
- ``alpha_ii`` is logged per client as ``fedpac_self_weight`` (``results/client_series.csv``;
  its mean, min and max over clients as metrics).
- Cold start: the newcomer receives theta and the centroids, starts from the initial head and
  trains ``experiment.coldstart_epochs`` epochs of plain local training (the core default).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from attrs import define, field
from scipy.optimize import minimize

from pfl_core.api import (
    LocalWork,
    SpecError,
    aggregate_prototypes,
    at_least,
    capture_embedding,
    clone_state,
    embeddings,
    finite,
    greater_than,
    head_keys,
    hookimpl,
    layer_keys,
    load_state,
    local_prototypes,
    model_key,
    only_training,
    probe_num_layers,
    spec_archs,
    weighted_average,
)
from pfl_plugins.fedper import FedPer
from pfl_plugins.fedproto import FedProto


@define
class FedPACParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the alignment term (P3), an MSE over samples and feature dimensions"})
    head_epochs: int = field(default=1, validator=at_least(0), metadata={
        "doc": "classifier epochs a round, body fixed, first"})
    body_epochs: Optional[int] = field(default=None, validator=at_least(0), metadata={
        "doc": "then the feature extractor's epochs, head fixed; none: training.local_epochs"})
    head_lr_scale: float = field(default=10.0, validator=[finite, greater_than(0)], metadata={
        "doc": "the classifier's step size is this times training.lr (the paper's 0.1 against 0.01)"})
    collaborate: bool = field(default=True, metadata={
        "doc": "classifier collaboration (P6, P7); false: the paper's ablation (every client keeps its "
               "own head, nothing is sent for the QP)"})

    @property
    def head_layers(self) -> int:
        return 1  # the paper's linear classifier: the last parameterised layer (FedPer's setup)


def feature_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[float, torch.Tensor]:
    """(v_i, h_i) of (P1)-(P2) from the features ``z`` and labels ``y`` of one client."""
    z = z.double()
    n = len(y)
    h = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
    v = 0.0
    for k in y.unique().tolist():
        zk = z[y == k]
        p = len(zk) / n
        mu = zk.mean(0)
        h[k] = p * mu
        v += p * float(zk.pow(2).sum(1).mean()) - p * p * float(mu.pow(2).sum())
    return v / n, h


def combination_weights(v, h, i: int) -> np.ndarray:
    """(P6): alpha_i over the clients j (rows of ``h``; ``v`` their variance terms)."""
    v = np.asarray(v, dtype=np.float64)
    m = len(v)
    if m == 1:
        return np.ones(1)
    hs = torch.as_tensor(h, dtype=torch.float64)
    d = (hs[i][None] - hs).reshape(m, -1).numpy()
    p = np.diag(v) + d @ d.T
    p = p / max(float(np.mean(np.diag(p))), 1e-300)
    start = np.full(m, 1.0 / m)
    result = minimize(lambda a: a @ p @ a, start, jac=lambda a: 2 * p @ a, method="SLSQP",
                      bounds=[(0.0, 1.0)] * m,
                      constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(m)}],
                      options={"ftol": 1e-15, "maxiter": 500})
    alpha = np.clip(result.x, 0.0, None)
    return alpha / alpha.sum()


def combine(alpha, heads: list[dict]) -> dict:
    """(P7): sum_j alpha_j phi_j per head key."""
    return {k: sum(float(a) * head[k] for a, head in zip(alpha, heads)) for k in heads[0]}


class ClassifierSplit(FedPer):
    """FedPer's body/head bookkeeping with the head fixed to the last layer, the classifier
    (FedPAC, FedAS, pFedFDA). A model with a single parameterised layer has no feature
    extractor: refused at the key that names it (``model.name``, or ``model.pool`` /
    ``model.clients``), before any data is loaded when the model can be probed."""

    def _no_extractor(self, spec, arch: str, layers: int) -> SpecError:
        return SpecError(model_key(spec), f"{self.name} needs a feature extractor before the classifier, "
                                          f"but {arch} has {layers} parameterised layer(s)")

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):
            layers = probe_num_layers(spec, arch)
            if layers is not None and layers < 2:
                raise self._no_extractor(spec, arch, layers)

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(ctx.training_clients[0])
        layers = len(layer_keys(ctx.models.working(arch)))
        if layers < 2:
            raise self._no_extractor(ctx.spec, arch, layers)
        super().setup(ctx)


class FedPAC(ClassifierSplit):
    """FedPAC (Xu et al. 2023): shared feature extractor (body), personal linear classifier
    (head); a client trains its head, then its body on ``CE + lam * MSE(f(x), c_y)`` towards the
    global class centroids; the server averages bodies, merges centroids, and gives each
    participant a combination of the participants' heads with weights from a quadratic program
    (its own weight logged per client as ``fedpac_self_weight``). Budget:
    ``head_epochs + body_epochs``."""

    name = "fedpac"
    Params = FedPACParams

    def body_epochs(self, spec) -> int:
        epochs = self.params.body_epochs
        return spec.training.local_epochs if epochs is None else epochs

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(self.params.head_epochs + self.body_epochs(spec)))

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # body/head keys, theta^0
        ctx.server["centroids"], ctx.server["heads"] = {}, {}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        """The global theta and, for a client that took part in a collaboration, its phi-hat_i."""
        message = {"body": ctx.server["body"]}
        if client_id in ctx.server["heads"]:
            message["head"] = ctx.server["heads"][client_id]
        return message

    @hookimpl
    def personalized_models(self, ctx, client, message):
        """The global theta with phi-hat_i (else the client's phi_i, else the initial head)."""
        model = self.load_personal(ctx, client, message["body"])
        return {"": load_state(model, message["head"]) if "head" in message else model}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {"body": ctx.server["body"], "centroids": ctx.server["centroids"]}
        if client_id in ctx.server["heads"]:
            message["head"] = ctx.server["heads"][client_id]
        return message

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = client.model
        head = message.get("head") or client.state.get("head")
        if head is None:
            initial = ctx.models.initial_state(client.arch)
            head = {k: initial[k] for k in head_keys(model)}
        load_state(model, head)
        load_state(model, message["body"])
        client.scratch["centroids"] = message["centroids"]
        return True

    @hookimpl
    def local_train(self, ctx, client):
        model, data = client.model, client.data
        if self.params.collaborate:  # (P1)-(P2) with the received theta^t
            client.scratch["stats"] = feature_statistics(embeddings(model, data.train_x), data.train_y,
                                                         ctx.num_classes)
        head, body = set(self.head_keys(ctx)), set(self.body_keys(ctx))  # FedPer's split
        metrics = {}
        if self.params.head_epochs:
            with only_training(model, head) as params:
                lr = self.params.head_lr_scale * ctx.spec.training.lr
                metrics = client.train(epochs=self.params.head_epochs, optimizer=client.optimizer(params, lr=lr))
        epochs = self.body_epochs(ctx.spec)
        if epochs:
            client.scratch["global"] = client.scratch["centroids"]  # switches (P3) on
            try:
                with capture_embedding(model, client.scratch), only_training(model, body) as params:
                    metrics = client.train(epochs=epochs, optimizer=client.optimizer(params))
            finally:
                del client.scratch["global"]
        self.keep_head(ctx, client)
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(P3)'s alignment term, FedProto's regulariser with the global centroids (body epochs only)."""
        if not self.params.lam or "global" not in client.scratch:
            return None
        return FedProto.local_objective(self, ctx=ctx, client=client, model=model, x=x, y=y, logits=logits)

    @hookimpl
    def client_upload(self, ctx, client):
        model, data = client.model, client.data
        centroids, counts = local_prototypes(model, data.train_x, data.train_y, ctx.num_classes)  # (P4)
        message = {**super().client_upload(ctx, client), "centroids": centroids, "counts": counts}
        if self.params.collaborate:
            state = model.state_dict()
            v, h = client.scratch["stats"]
            message.update(head={k: state[k] for k in self.head_keys(ctx)}, v=v, h=h.float())
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        reports, collab = [], []  # collab: (client id, phi_j copy, v_j, h_j)

        def bodies():
            for i, message in uploads:
                reports.append((message["centroids"], message["counts"]))
                if "head" in message:
                    collab.append((i, clone_state(message["head"]), message["v"], message["h"]))
                yield weights[i], message["body"]

        averaged = weighted_average(bodies())
        if averaged is not None:
            ctx.server["body"] = averaged
        ctx.server["centroids"] = {**ctx.server["centroids"], **aggregate_prototypes(reports)}  # (P5)
        if collab:
            v = [c[2] for c in collab]
            h = torch.stack([c[3] for c in collab])
            heads = [c[1] for c in collab]
            for a, (i, *_rest) in enumerate(collab):
                alpha = combination_weights(v, h, a)  # (P6)
                ctx.server["heads"][i] = combine(alpha, heads)  # (P7)
                ctx.log_client(i, fedpac_self_weight=float(alpha[a]))
        return True


__all__ = ["ClassifierSplit", "FedPAC", "FedPACParams", "combination_weights", "combine", "embeddings",
           "feature_statistics", "head_keys"]
