"""CCVR: Luo, Chen, Hu, Zhang, Liang and Feng, "No Fear of Heterogeneity: Classifier Calibration
for Federated Learning with Non-IID Data", NeurIPS 2021 (arXiv:2106.05001).

FedAvg, then Classifier Calibration with Virtual Representations: the clients describe how the
global model's features (the classifier's input) of each class are distributed, by their mean
and covariance; the server pools them into one Gaussian per class, draws virtual features from
that mixture and re-trains only the classifier on them. The raw features never travel.

    server: w^0 = the seeded initial weights                                  (setup: FedAvg's)
    each round t, each participant k, given w^t:                              (on_broadcast)
        (S1) z = the classifier's input under w^t, eval mode, for every training sample;
             for each class c it holds, N_{c,k} samples:
             mu_{c,k} = mean of z,  Sigma_{c,k} = sum (z - mu_{c,k})(z - mu_{c,k})^T / (N_{c,k} - 1)
             (the zero matrix when N_{c,k} = 1: its weight in (S2) is 0)        (on_receive)
        training.local_epochs epochs of cross-entropy from w^t; upload w_k and
        {c: (N_{c,k}, mu_{c,k}, Sigma_{c,k})}                                   (client_upload)
    server:
        w^{t+1} <- sum_k n_k / n * w_k                                          (FedAvg's average)
        (S2) N_c = sum_k N_{c,k};  mu_c = sum_k N_{c,k} / N_c * mu_{c,k}
             Sigma_c = sum_k (N_{c,k} - 1) / (N_c - 1) * Sigma_{c,k}
                     + sum_k N_{c,k} / (N_c - 1) * mu_{c,k} mu_{c,k}^T - N_c / (N_c - 1) * mu_c mu_c^T
             (the mean and unbiased covariance of the union of the clients' features of class c)
        (S3) G_c = sample_per_class draws from N(mu_c, Sigma_c), every class with N_c >= 2
        (S4) the classifier of w^t <- server_epochs epochs of mini-batch SGD (server_lr, batch
             server_batch_size, shuffled) on cross-entropy over the pairs (G_c, c); the feature
             extractor stays w^t's                                              (server_aggregate)
    evaluation: every client is scored with the latest calibrated model, w^t's extractor with
    the classifier of (S4); before the first calibration (or while none arrived), w^t itself.

Steps (S1)-(S4) are labelled here, not by the paper's equation numbers: we could read the paper's
abstract and introduction (the arXiv source's first section), not its method section, so the
numbers are not cited. (S2) is the pooled mean and covariance the abstract's "approximated
gaussian mixture model" needs (tested: it equals the union's sample covariance); FL-bench
computes the same pooling. Read, not copied: FL-bench (github:KarhouTam/FL-bench at 06e658b,
``src/server/ccvr.py``, ``src/client/ccvr.py``). PFLlib (TsingZ0/PFLlib at d832e76) has no CCVR.

Which model is calibrated, and the one-round lag. The paper calibrates once, after training, with
one extra collection of statistics of the final global model. Here every round's broadcast w^t
doubles as that collection: the participants send the statistics of w^t's features with their
trained weights, and the server calibrates w^t's classifier. So each round's evaluation scores
the calibrated w^t, not w^{t+1}: with ``experiment.rounds = R`` the final model has R - 1
aggregations behind it, FedAvg's R. The calibration never feeds back into training (the next
broadcast is FedAvg's w^{t+1}), as in the paper and FL-bench.

Decisions and deviations:

- FL-bench calibrates at each test, from every training client (an extra pass over all of them)
  and on w^{t+1}; here from the round's participants and on w^t (no extra communication). With
  full participation the statistics are every client's.
- FL-bench's clients send the biased covariance (``correction=0``) while its server pools them
  with the unbiased (N - 1) weights of (S2); here the clients send the unbiased Sigma_{c,k}, so
  (S2) is exactly the union's covariance.
- Sampling: ``numpy``'s multivariate normal in FL-bench (unseeded); here z = mu_c + V sqrt(L) e,
  e ~ N(0, I) from the server's seeded generator ("ccvr:virtual", per round) and V, L the
  eigen-decomposition of Sigma_c with negative round-off eigenvalues set to 0 (ReLU features
  make Sigma_c singular, so a Cholesky factor does not exist). A class with N_c < 2 has no
  covariance and gets no virtual features (FL-bench skips it too).
- Defaults (FL-bench's): ``sample_per_class = 200``, one epoch (``server_epochs = 1``) of plain SGD
  at the clients' learning rate (``server_lr`` none = training.lr) in mini-batches of the
  clients' batch size (``server_batch_size`` none = training.batch_size), shuffled by the
  server's seeded generator ("ccvr:calibration", per round).
- The classifier is the model's last parameterised layer, its input flattened (pfl's
  ``classifier``; FL-bench's ``model.classifier``); BatchNorm running statistics of the extractor
  are w^t's, untouched.
- Lost uploads (``dropout`` add-on): the lost participant's weights and statistics are both left
  out. Clients keep no state, so nothing is staged.
- Bytes up: FedAvg's weights plus, per class held, a count, a d-vector and a d x d matrix
  (d the classifier's input size; 84 for LeNet-5, 512 for a ResNet-18).
- Cold start: the newcomer receives FedAvg's final w (the core default: on_receive, then
  ``experiment.coldstart_epochs`` epochs) and is scored on its trained model.
"""

from __future__ import annotations

import copy

import torch
from attrs import define, field

from pfl_core.api import (
    WeightAveraging,
    at_least,
    classifier,
    cross_entropy_loss,
    embeddings,
    head_keys,
    hookimpl,
    learning_rate,
    run_epochs,
)


@define
class CCVRParams:
    sample_per_class: int = field(default=200, validator=at_least(1), metadata={
        "doc": "virtual features drawn per class, M_c of step (S3) (FL-bench's 200)"})
    server_lr: float | None = field(default=None, validator=learning_rate, metadata={
        "doc": "learning rate of the classifier's calibration, step (S4); none: training.lr (FL-bench's)"})
    server_epochs: int = field(default=1, validator=at_least(1), metadata={
        "doc": "passes over the virtual features in step (S4) (FL-bench's one)"})
    server_batch_size: int | None = field(default=None, validator=at_least(1), metadata={
        "doc": "mini-batch of step (S4); none: training.batch_size (FL-bench's)"})


@torch.no_grad()
def class_statistics(model, x, y, num_classes) -> dict:
    """Step (S1): {"counts", "means", "covariances"}, each {class: ...} over the classes in ``y``;
    the unbiased covariance (zeros for a class seen once)."""
    z = embeddings(model, x).double()
    counts, means, covariances = {}, {}, {}
    for c in range(num_classes):
        rows = z[y == c]
        if len(rows) == 0:
            continue
        counts[c] = len(rows)
        means[c] = rows.mean(0).float()
        covariances[c] = (torch.cov(rows.T, correction=1) if len(rows) > 1
                          else torch.zeros(z.shape[1], z.shape[1], dtype=z.dtype, device=z.device)).float()
    return {"counts": counts, "means": means, "covariances": covariances}


def pool_statistics(reports) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Step (S2): {class: (mu_c, Sigma_c)} in float64 from the clients' (S1) reports, every class
    with N_c >= 2."""
    by_class: dict[int, list] = {}
    for report in reports:
        for c, n in report["counts"].items():
            by_class.setdefault(c, []).append((n, report["means"][c].double(), report["covariances"][c].double()))
    pooled = {}
    for c in sorted(by_class):
        total = sum(n for n, _, _ in by_class[c])
        if total < 2:
            continue
        mean = sum(n / total * mu for n, mu, _ in by_class[c])
        cov = sum((n - 1) / (total - 1) * sigma + n / (total - 1) * torch.outer(mu, mu)
                  for n, mu, sigma in by_class[c])
        pooled[c] = (mean, cov - total / (total - 1) * torch.outer(mean, mean))
    return pooled


def virtual_representations(pooled, per_class: int, generator: torch.Generator):
    """Step (S3): (features, labels), ``per_class`` draws from N(mu_c, Sigma_c) for each pooled
    class, classes ascending; Sigma_c's square root from its eigen-decomposition (it may be
    singular), negative round-off eigenvalues set to 0."""
    features, labels = [], []
    for c in sorted(pooled):
        mean, cov = pooled[c]
        eigenvalues, eigenvectors = torch.linalg.eigh((cov + cov.T) / 2)
        root = eigenvectors * eigenvalues.clamp(min=0).sqrt()
        noise = torch.randn(per_class, len(mean), generator=generator, dtype=torch.float64).to(mean.device)
        features.append(mean + noise @ root.T)
        labels.append(torch.full((per_class,), c, dtype=torch.long, device=mean.device))
    return torch.cat(features).float(), torch.cat(labels)


class CCVR(WeightAveraging):
    """CCVR (Luo et al. 2021): FedAvg whose server re-trains the global model's classifier on
    virtual features drawn from the clients' pooled per-class Gaussians; every client is scored
    with the calibrated model."""

    name = "ccvr"
    Params = CCVRParams

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        super().on_receive(ctx, client, message)
        data = client.data
        client.scratch["statistics"] = class_statistics(client.model, data.train_x, data.train_y, ctx.num_classes)
        return True

    @hookimpl
    def client_upload(self, ctx, client):
        return {**super().client_upload(ctx, client), "statistics": client.scratch["statistics"]}

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        broadcast = ctx.server["global"]  # w^t, the model the statistics describe
        reports = []

        def keeping_statistics(stream):
            for client_id, message in stream:  # each upload is valid only until the next one
                statistics = message["statistics"]
                reports.append({part: {c: v.clone() if torch.is_tensor(v) else v for c, v in values.items()}
                                for part, values in statistics.items()})
                yield client_id, message

        super().server_aggregate(ctx, keeping_statistics(uploads), weights)
        pooled = pool_statistics(reports)
        if pooled:  # none arrived, or no class seen twice: the previous calibrated model stays
            ctx.server["calibrated"] = self.calibrate(ctx, broadcast, pooled)
        return True

    def calibrate(self, ctx, state, pooled) -> dict[str, torch.Tensor]:
        """Steps (S3)-(S4): ``state`` with its classifier re-trained on virtual features."""
        p, training = self.params, ctx.spec.training
        x, y = virtual_representations(pooled, p.sample_per_class, ctx.generator("ccvr:virtual"))
        model = copy.deepcopy(ctx.models.working(ctx.models.arch_of(0)))
        model.load_state_dict(state)
        head = classifier(model).to(ctx.device)
        x, y = x.to(ctx.device), y.to(ctx.device)
        optimizer = torch.optim.SGD(head.parameters(), lr=p.server_lr or training.lr)
        batch = p.server_batch_size or training.batch_size
        generator = ctx.generator("ccvr:calibration")
        with torch.enable_grad():
            run_epochs(head, optimizer, x, y, epochs=p.server_epochs, batch_size=batch, loss_fn=cross_entropy_loss,
                       generator=generator)
        calibrated = {k: t.detach().clone() for k, t in state.items()}
        trained = model.state_dict()
        for key in head_keys(model):
            calibrated[key] = trained[key].detach().clone()
        return calibrated

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": ctx.server.get("calibrated", ctx.server["global"])}


__all__ = ["CCVR", "CCVRParams", "class_statistics", "pool_statistics", "virtual_representations"]
