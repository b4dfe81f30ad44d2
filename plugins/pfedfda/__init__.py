"""pFedFDA: McLaughlin and Su, "Personalized Federated Learning via Feature Distribution
Adaptation", NeurIPS 2024, Algorithm 1.

The model is a feature extractor f_theta (the body, shared) and a generative classifier on its
features z = f_theta(x): class-conditional Gaussians N(mu_c, Sigma) with a shared covariance,
read as a linear layer (the model's last parameterised layer, never trained by SGD):

    logit_c(z) = z^T S^-1 mu_c - 1/2 mu_c^T S^-1 mu_c + log pi_c,
    S = (1 - eps) Sigma + eps tr(Sigma) / d I                                                (G1)

pi the client's own class frequencies. Each round t, with S_t the participants:

    server: sends theta^t and the global estimates (mu^t, Sigma^t)               (on_broadcast)
    client i:
        head <- (G1) with (mu^t, Sigma^t, pi_i), fixed; E epochs of SGD on theta   (local_train)
        local estimates from the features of its training split under theta_i:
            mu-hat_c = mean of z over class c (mu^t_c if class c has <= min_count samples)
            Sigma-hat = sum_n (z_n - mu-hat_{y_n})(z_n - mu-hat_{y_n})^T / (N - 1) + eps I  (G2)
        beta_i = argmin over [0, 1] of the k-fold cross-validated loss: for each fold f,   (G4)
            (G2) on the other folds, interpolated by (G3), cross-entropy of (G1) on fold f
        mu_i = beta_i mu-hat + (1 - beta_i) mu^t,  Sigma_i = beta_i Sigma-hat + (1 - beta_i) Sigma^t (G3)
        uploads theta_i, mu_i, Sigma_i                                          (client_upload)
    server: theta^{t+1}, mu^{t+1}, Sigma^{t+1} = the n_i-weighted means of the uploads   (G5)
    evaluation (local distribution adaptation, at test time): theta^{t+1} with the head (G1)
        built from (G2)-(G4) on the client's training features under theta^{t+1}, against
        (mu^{t+1}, Sigma^{t+1})                                           (personalized_models)

(G1)-(G5) label the steps in this docstring; the paper's Section 4 (generative classifier,
local-global interpolation) and Algorithm 1 are the source, but we could not check its equation
numbers, so the labels are ours.

Defaults and decisions:

- ``beta = "single"``: one beta_i for the means and the covariance (the paper's interpolation;
  its ablation finds one coefficient cost-effective). ``"separate"``: one for the means and one
  for the covariance (the authors' code's default; L-BFGS-B over [0, 1]^2 from (1/2, 1/2));
  ``"local"``: beta_i = 1, local estimates only (the ablation's no-interpolation variant). The
  single beta is found by bounded Brent search (``scipy.optimize.minimize_scalar``), the ends 0
  and 1 compared with its answer.
- ``folds = 2``, ``min_count = 2``, ``eps = 1e-4``: the authors' code (2-fold stratified cross
  validation; a class mean needs more than 2 samples; eps for (G1)'s shrinkage, (G2)'s ridge
  and the class priors, pi_c = (p_c + eps) / sum(p + eps)). Classes with fewer samples than
  folds are left out of the cross validation; if a fold is then empty, beta_i = 0 (the global
  estimates), as the authors' code falls back to. Folds are drawn per class with the client's
  seeded generator.
- (G2) uses the features after local training, one pass in eval mode (not counted as a training
  epoch); the authors' code collects them during training. Its ridge is eps I (their code adds
  a constant and the identity; we read that as a ridge and keep it small).
- (G5) averages the interpolated estimates (mu_i, Sigma_i), as the authors' code does.
- The initial global estimates are mu^0_c ~ N(0, I) (drawn with the server's seeded generator,
  the paper's random Gaussian initialisation) and Sigma^0 = I.
- The head must be an ``nn.Linear`` (the zoo's models end in one, except squeezenet's convolution);
  z is its input. Another last layer is refused at the model's key, before any data is loaded
  when the model can be probed (so ``--dry-run`` reports it), else at set-up.
- Budget: ``training.local_epochs`` private epochs per round (the core default). Bytes:
  theta + C x d means + d x d covariance each way.
- beta_i of the last local update is kept in ``client.state["beta"]``.
- Cold start: the newcomer adapts without training: the final theta with the head (G1)-(G4)
  fitted on its training features (the paper's evaluation of new clients).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from attrs import define, field
from scipy.optimize import minimize, minimize_scalar
from torch import nn

from pfl_core.api import (
    SpecError,
    at_least,
    between,
    embeddings,
    finite,
    head_keys,
    hookimpl,
    load_state,
    model_key,
    one_of,
    only_training,
    parameterised_layers,
    probe_model,
    spec_archs,
)
from pfl_plugins.fedpac import ClassifierSplit


@define
class PFedFDAParams:
    beta: str = field(default="single", validator=one_of("single", "separate", "local"), metadata={
        "doc": "(G4) one interpolation coefficient for the means and the covariance; one each (L-BFGS-B "
               "on [0, 1]^2); or beta = 1, local estimates only (the ablation)"})
    folds: int = field(default=2, validator=at_least(2),
                       metadata={"doc": "cross-validation folds for beta (G4)"})
    min_count: int = field(default=2, validator=at_least(0), metadata={
        "doc": "(G2) a class mean is estimated locally only from more samples than this; otherwise the "
               "global mean is kept"})
    eps: float = field(default=1e-4, validator=[finite, between(0, 1, low_open=True, high_open=True)], metadata={
        "doc": "shrinkage of the covariance towards its scaled trace, ridge and prior smoothing. "
               "specs/fedsimsup_table2.toml uses 0.1: with 1e-4 training diverged there"})

    @property
    def head_layers(self) -> int:
        return 1  # the generative classifier: the last layer (FedPer's setup)


def lda_head(means: torch.Tensor, cov: torch.Tensor, priors: torch.Tensor, eps: float):
    """(G1): (weight C x d, bias C) of the generative classifier."""
    means, cov = means.double(), cov.double()
    d = cov.shape[0]
    shrunk = (1 - eps) * cov + eps * torch.trace(cov) / d * torch.eye(d, dtype=cov.dtype)
    coefs = torch.linalg.solve(shrunk, means.T).T
    bias = -0.5 * (means * coefs).sum(1) + torch.log(priors.double())
    return coefs, bias


def lda_logits(z, means, cov, priors, eps):
    weight, bias = lda_head(means, cov, priors, eps)
    return z.double() @ weight.T + bias


def class_priors(y: torch.Tensor, num_classes: int, eps: float) -> torch.Tensor:
    p = torch.bincount(y, minlength=num_classes).double() / len(y) + eps
    return p / p.sum()


def local_estimates(z, y, global_means, min_count: int, eps: float):
    """(G2): (mu-hat C x d, Sigma-hat d x d) in float64."""
    z = z.double()
    means = global_means.double().clone()
    for c in y.unique().tolist():
        if int((y == c).sum()) > min_count:
            means[c] = z[y == c].mean(0)
    centred = z - means[y]
    d = z.shape[1]
    cov = centred.T @ centred / max(len(y) - 1, 1) + eps * torch.eye(d, dtype=z.dtype)
    return means, cov


def interpolate(local, glob, beta_means: float, beta_cov: float):
    """(G3): beta * local + (1 - beta) * global, for (means, covariance)."""
    (lm, lc), (gm, gc) = local, glob
    return beta_means * lm + (1 - beta_means) * gm.double(), beta_cov * lc + (1 - beta_cov) * gc.double()


def stratified_folds(y: torch.Tensor, folds: int, rng: np.random.Generator) -> np.ndarray:
    """A fold index per sample: each class's samples in a seeded random order dealt round-robin;
    -1 for classes with fewer samples than folds (left out)."""
    out = np.full(len(y), -1)
    labels = y.numpy()
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if len(idx) >= folds:
            out[rng.permutation(idx)] = np.arange(len(idx)) % folds
    return out


def cv_parts(z, y, assignment, global_means, min_count: int, eps: float) -> list:
    """Per fold f: ((G2) on the other folds, z of fold f, y of fold f)."""
    parts = []
    for f in range(int(assignment.max()) + 1):
        train = torch.as_tensor((assignment != f) & (assignment >= 0))
        held = torch.as_tensor(assignment == f)
        parts.append((local_estimates(z[train], y[train], global_means, min_count, eps), z[held], y[held]))
    return parts


def cv_loss(parts, glob, priors, betas, eps: float):
    """(G4)'s objective: the sum over folds of the mean held-out cross-entropy of (G1) with the
    estimates of the other folds interpolated by (G3); ``betas`` = (means, covariance), floats
    or tensors (differentiable)."""
    total = 0.0
    for local, z, y in parts:
        means, cov = interpolate(local, glob, betas[0], betas[-1])
        total = total + F.cross_entropy(lda_logits(z, means, cov, priors, eps), y)
    return total


def solve_beta(z, y, glob, priors, mode: str, folds: int, min_count: int, eps: float, rng) -> tuple[float, float]:
    """(G4): (beta for the means, beta for the covariance)."""
    if mode == "local":
        return 1.0, 1.0
    assignment = stratified_folds(y, folds, rng)
    if any(not (assignment == f).any() for f in range(folds)):
        return 0.0, 0.0  # no cross validation possible: the global estimates
    parts = cv_parts(z, y, assignment, glob[0], min_count, eps)
    if mode == "single":
        single = lambda b: float(cv_loss(parts, glob, priors, (b, b), eps))
        b = float(minimize_scalar(single, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-5}).x)
        b = min((b, 0.0, 1.0), key=single)  # the bounded search never tries the ends themselves
        return b, b

    def value_and_grad(b):
        betas = torch.tensor(b, dtype=torch.float64, requires_grad=True)
        loss = cv_loss(parts, glob, priors, betas, eps)
        loss.backward()
        return float(loss.detach()), betas.grad.numpy()

    result = minimize(value_and_grad, np.array([0.5, 0.5]), jac=True, method="L-BFGS-B",
                      bounds=[(0.0, 1.0), (0.0, 1.0)])
    return float(result.x[0]), float(result.x[1])


class PFedFDA(ClassifierSplit):
    """pFedFDA (McLaughlin and Su 2024): a generative classifier on the body's features (class
    means and one shared covariance, as the last linear layer); clients train the body under the
    head built from the global estimates, then upload their own estimates interpolated with the
    global ones by a cross-validated beta; evaluation refits the head on the client's training
    features. Body + means + covariance each way. Budget: ``training.local_epochs``."""

    name = "pfedfda"
    Params = PFedFDAParams

    def linear_head(self, spec, arch: str, model) -> nn.Linear:
        """The model's last layer, which (G1) writes: refused unless an ``nn.Linear``."""
        _, layer = parameterised_layers(model)[-1]
        if not isinstance(layer, nn.Linear):
            raise SpecError(model_key(spec), f"pfedfda needs a model whose last layer is a Linear classifier; "
                                             f"{arch}'s is a {type(layer).__name__}")
        return layer

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture, with a feature extractor
        for arch in spec_archs(spec):  # before any data is loaded, so --dry-run reports it
            model = probe_model(spec, arch)
            if model is not None:
                self.linear_head(spec, arch, model)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # body/head keys, theta^0
        arch = ctx.models.arch_of(ctx.training_clients[0])
        layer = self.linear_head(ctx.spec, arch, ctx.models.working(arch))
        gen = ctx.generator("pfedfda_init")
        ctx.server["means"] = torch.randn(ctx.num_classes, layer.in_features, generator=gen)
        ctx.server["cov"] = torch.eye(layer.in_features)

    def adapt(self, ctx, client, glob):
        """(G2)-(G4) on the client's training features under the current body: (means, cov, beta)."""
        p, data = self.params, client.data
        z, y = embeddings(client.model, data.train_x), data.train_y
        priors = class_priors(y, ctx.num_classes, p.eps)
        betas = solve_beta(z, y, glob, priors, p.beta, p.folds, p.min_count, p.eps, client.rng("pfedfda_folds"))
        local = local_estimates(z, y, glob[0], p.min_count, p.eps)
        means, cov = interpolate(local, glob, *betas)
        return means.float(), cov.float(), betas

    def set_head(self, ctx, client, means, cov):
        """(G1) into the model's last layer, with the client's class priors."""
        model = client.model
        weight, bias = lda_head(means, cov, class_priors(client.data.train_y, ctx.num_classes, self.params.eps),
                                self.params.eps)
        w_key, b_key = head_keys(model)
        return load_state(model, {w_key: weight.float(), b_key: bias.float()})

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"body": ctx.server["body"], "means": ctx.server["means"], "cov": ctx.server["cov"]}

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["body"])
        self.set_head(ctx, client, message["means"], message["cov"])  # fixed: the global generative head
        client.scratch["global"] = (message["means"], message["cov"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        model = client.model
        with only_training(model, set(self.body_keys(ctx))) as params:  # FedPer's split
            metrics = client.train(optimizer=client.optimizer(params))
        means, cov, betas = self.adapt(ctx, client, client.scratch["global"])
        client.scratch["estimates"] = (means, cov)
        client.state["beta"] = betas
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        means, cov = client.scratch["estimates"]
        return {**super().client_upload(ctx, client), "means": means, "cov": cov}  # FedPer's body

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        sums = {}

        def statistics_too():
            for i, message in uploads:
                for key in ("means", "cov"):
                    sums[key] = sums.get(key, 0) + weights[i] * message[key]
                yield i, message

        super().server_aggregate(ctx, statistics_too(), weights)  # theta: FedPer's n_i-weighted mean
        ctx.server.update(sums)  # (G5); nobody took part: unchanged
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.on_broadcast(ctx, client_id)  # theta and the global estimates

    @hookimpl
    def personalized_models(self, ctx, client, message):
        model = load_state(client.model, message["body"])
        means, cov, _ = self.adapt(ctx, client, (message["means"], message["cov"]))
        self.set_head(ctx, client, means, cov)
        return {"": model}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        return self.personalized_models(ctx, client, message)  # the broadcast: theta and the estimates


__all__ = ["PFedFDA", "PFedFDAParams", "class_priors", "cv_loss", "cv_parts", "interpolate", "lda_head",
           "local_estimates", "solve_beta", "stratified_folds"]
