"""FedFed: Yang, Zhang, Zheng, Tian, Peng, Liu and Han, "FedFed: Feature Distillation against Data
Heterogeneity in Federated Learning", NeurIPS 2023 (arXiv:2310.05077).

Only the paper's abstract could be read here, not its algorithm box or equations: the steps below
follow the abstract (split each input into a performance-sensitive part, shared with noise, and a
performance-robust part, kept local; clients then train on local plus shared data) and the
reference implementation of FL-bench (github.com/KarhouTam/FL-bench at commit
06e658bca5af6ce732e25bb7c0f8be321e14a85e, src/client/fedfed.py and src/server/fedfed.py). The
step labels (F1)-(F6) are ours.

A run of R rounds has three phases (D = ``distill_rounds``):

    rounds 1..D, feature distillation, each participant i given the global classifier w and
    the global generator g (a small VAE: x -> robust part x_r = decoder(z), z ~ N(mu(x), var(x))):
      (F1) per mini-batch, mixup: lam ~ Beta(alpha, alpha), x_m = lam x + (1 - lam) x[perm];
           step w on lam CE(f(x_m), y) + (1 - lam) CE(f(x_m), y[perm])
      (F2) per mini-batch, step g on  re * MSE(x_r, x) + kl * KL(N(mu, var) || N(0, I))
      (F3) per mini-batch, the sensitive part s = x - x_r and two noisy copies
           s_1 = s + N(0, sigma_1^2), s_2 = s + N(0, sigma_2^2); step w and g together on
           re * MSE + kl * KL + ce * CE(f([s_1; s_2]), [y; y]) + x_ce * CE(f(x), y)
      (F4) upload w and g; the server averages both weighted by n_i / n (FedAvg)
    round D + 1, sharing (every training client takes part, whatever experiment.participation):
      (F5) each client computes s = x - x_r with the global g in evaluation mode (z = mu) over
           its train split and uploads s_1, s_2 and the labels; the server concatenates the
           arrivals into the global shared set P (2 n samples); no model trains this round
    rounds D + 2..R, FedAvg on local plus shared data:
      (F6) each round a participant gets w and ceil(shared_ratio * n_i) samples of P drawn
           uniformly without replacement (capped at |P|), and trains w (training.local_epochs
           epochs of the configured optimiser) on its train split plus that draw; the server
           averages w by n_i / n

What is evaluated: every client on the global classifier w (FedFed trains one global model; the
generator g is a tool of the distillation phase and is never evaluated). The classifier trained
in rounds 1..D+1 carries into the FedAvg phase (as FL-bench's).

Privacy: ``noise_std1`` and ``noise_std2`` (sigma_1, sigma_2) are the standard deviations of the
Gaussian noise added to the shared features (the paper's differential-privacy protection). No
privacy accounting is done: no clipping bounds the sensitivity of s, so the noise gives no
formal (epsilon, delta) guarantee, and no epsilon is logged (pfl's privacy add-ons,
``gaussian_expertise`` and ``label_mechanism``, perturb other payloads and do not apply here).

Deviations:

- The generator is a small fully connected VAE on the flattened input (``vae_hidden`` units,
  ``vae_latent`` latent dimensions, no BatchNorm, no output sigmoid), so it fits any input shape
  and runs on a CPU; FL-bench's (after the authors') is a convolutional residual beta-VAE with
  BatchNorm (its BatchNorm statistics kept per client) and a sigmoid output for images in [0, 1].
- KL is averaged over the batch and the latent dimensions; FL-bench divides the summed KL by
  batch_size * 3 * feature_length (3 being image channels).
- FL-bench trains the generator for 15 rounds and may use Laplace noise; here D is a parameter
  (default 2, CPU-small) and the noise is Gaussian with mean 0 (FL-bench's default).
- The classifier's optimiser in (F1) and (F3) is pfl's configured one, reset every round as
  FedAvg's; the generator's AdamW state (``vae_lr``, ``vae_weight_decay``) is the client's own
  and kept across its distillation rounds (as FL-bench). Batches of one sample are skipped in
  (F1)-(F3), as FL-bench.
- The sharing round is a round of its own (it counts in experiment.rounds and is evaluated,
  on the model of round D); FL-bench runs it before its FL rounds. Its uploads can be lost
  (``dropout``): a lost upload's features are missing from P, nothing else changes.
- (F6): FL-bench sends P to every client once and the client draws from it each round; here
  P stays on the server, which sends each participant its draw every round (the draw's bytes
  counted down each round, not P once). The draws have the same law; the run's state and its
  checkpoints hold one copy of P instead of one per client.
- (F6): FL-bench means to add n_i random shared samples to each client's set each round, but
  its index arithmetic adds the shared indices to the client's own (element-wise) instead of
  appending them, so its clients train on shifted own-data indices and never on the shared
  set. Here the draw is appended as intended; ``shared_ratio`` scales its size (1 = FL-bench's
  intent). The shared samples count as private work (the budget's private samples).
- Budget (``local_work``): each distillation round is 3 x ``vae_local_epochs`` private epochs
  (three passes over the split), the sharing round none (one forward pass, not counted), each
  FedAvg round ``training.local_epochs`` epochs over n_i + ceil(shared_ratio n_i) samples, all
  counted as private (the shared samples too); declared as the mean per round of a client in
  every round.
- A cold-start client (``experiment.coldstart_clients``) fine-tunes w on its own data (the
  default), without P.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    LocalWork,
    WeightAveraging,
    at_least,
    batch_order,
    batch_starts,
    clone_state,
    finite,
    greater_than,
    hookimpl,
    learning_rate,
    load_state,
    mean_training_loss,
    torch_generator,
    warning_line,
    weighted_average,
)


@define
class FedFedParams:
    distill_rounds: int = field(default=2, validator=at_least(1), metadata={
        "doc": "D: rounds 1..D train the generator (F1-F4), round D + 1 shares the features (F5), FedAvg on "
               "local + shared data follows (F6); fewer than D + 2 experiment.rounds is warned about. FL-bench: 15"})
    vae_local_epochs: int = field(default=1, validator=at_least(1), metadata={
        "doc": "epochs of the three passes (F1)-(F3) per distillation round (FL-bench's VAE_train_local_epoch)"})
    vae_lr: float = field(default=1e-3, validator=learning_rate, metadata={
        "doc": "AdamW learning rate of the generator (FL-bench's VAE_lr)"})
    vae_weight_decay: float = field(default=1e-6, validator=[finite, at_least(0)], metadata={
        "doc": "AdamW weight decay of the generator (FL-bench's VAE_weight_decay)"})
    vae_hidden: int = field(default=64, validator=at_least(1), metadata={
        "doc": "hidden units of the generator's encoder and decoder (one layer each)"})
    vae_latent: int = field(default=16, validator=at_least(1), metadata={
        "doc": "latent dimensions of the generator"})
    mixup_alpha: float = field(default=2.0, validator=[finite, at_least(0)], metadata={
        "doc": "alpha of the mixup weight lam ~ Beta(alpha, alpha) in (F1); 0: no mixup (lam = 1)"})
    noise_std1: float = field(default=0.15, validator=[finite, at_least(0)], metadata={
        "doc": "sigma_1, std of the Gaussian noise of the first shared copy s_1 (F3, F5); no formal DP accounting"})
    noise_std2: float = field(default=0.25, validator=[finite, at_least(0)], metadata={
        "doc": "sigma_2, std of the Gaussian noise of the second shared copy s_2 (F3, F5)"})
    rec_weight: float = field(default=5.0, validator=[finite, at_least(0)], metadata={
        "doc": "re: weight of the reconstruction MSE(x_r, x) (F2, F3)"})
    kl_weight: float = field(default=0.005, validator=[finite, at_least(0)], metadata={
        "doc": "kl: weight of the KL term (F2, F3)"})
    sensitive_ce_weight: float = field(default=2.0, validator=[finite, at_least(0)], metadata={
        "doc": "ce: weight of the cross-entropy on the noisy sensitive features (F3)"})
    x_ce_weight: float = field(default=0.4, validator=[finite, at_least(0)], metadata={
        "doc": "x_ce: weight of the cross-entropy on the raw inputs (F3)"})
    shared_ratio: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "(F6): each FedAvg round a client adds ceil(shared_ratio * n_i) shared samples (capped at the "
               "shared set's size) to its n_i own ones"})


class FeatureVAE(nn.Module):
    """The generator: encoder x -> (mu, logvar), decoder z -> the robust part x_r (x's shape)."""

    def __init__(self, input_shape, hidden: int, latent: int):
        super().__init__()
        self.input_shape = tuple(input_shape)
        width = math.prod(self.input_shape)
        self.encoder = nn.Sequential(nn.Linear(width, hidden), nn.ReLU())
        self.fc_mu = nn.Linear(hidden, latent)
        self.fc_logvar = nn.Linear(hidden, latent)
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, width))

    def forward(self, x, generator: torch.Generator | None = None):
        """(x_r, mu, logvar); z is sampled in training mode (with ``generator``), z = mu otherwise."""
        h = self.encoder(x.flatten(start_dim=1))
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = mu
        if self.training:
            z = mu + torch.exp(0.5 * logvar) * torch.randn(mu.shape, generator=generator).to(mu.device)
        return self.decoder(z).view(x.shape), mu, logvar


def kl_to_standard_normal(mu, logvar):
    """KL(N(mu, exp(logvar)) || N(0, I)), averaged over the batch and the latent dimensions."""
    return -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())


def noisy_copies(sensitive, std1: float, std2: float, generator: torch.Generator):
    """s_1 = s + N(0, std1^2), s_2 = s + N(0, std2^2): the two shared copies (F3, F5)."""
    first = sensitive + std1 * torch.randn(sensitive.shape, generator=generator).to(sensitive.device)
    second = sensitive + std2 * torch.randn(sensitive.shape, generator=generator).to(sensitive.device)
    return first, second


class FedFed(WeightAveraging):
    """FedFed (Yang et al. 2023): train a generator that splits each input into a robust part and a
    performance-sensitive part, pool the sensitive parts (with Gaussian noise) from every client,
    then FedAvg with each client training on its own data plus a draw of the pool."""

    name = "fedfed"
    Params = FedFedParams

    def phase(self, round: int) -> str:
        distill = self.params.distill_rounds
        return "distill" if round <= distill else "share" if round == distill + 1 else "fedavg"

    def vae(self, ctx) -> FeatureVAE:
        p = self.params
        return FeatureVAE(ctx.models.input_shape, p.vae_hidden, p.vae_latent)

    def local_work(self, spec) -> LocalWork:
        """3 passes x vae_local_epochs in each distillation round, none in the sharing round, then
        local_epochs over n_i + ceil(shared_ratio n_i) samples (a pool that large assumed): the
        total of a client taking part in every round, spread evenly over the rounds."""
        p, rounds = self.params, spec.experiment.rounds
        distill = min(p.distill_rounds, rounds)
        fedavg = max(rounds - p.distill_rounds - 1, 0)
        total = distill * 3 * p.vae_local_epochs + fedavg * spec.training.local_epochs * (1 + p.shared_ratio)
        return LocalWork(total / rounds)

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        needed = self.params.distill_rounds + 2
        if spec.experiment.rounds < needed:  # a warning: short runs (smoke tests) stay possible
            warning_line(f"fedfed: algorithm.params.distill_rounds = {self.params.distill_rounds} leaves no FedAvg "
                         f"round on the shared features: experiment.rounds = {spec.experiment.rounds} < "
                         f"distill_rounds + 2 = {needed} (D rounds of distillation, one of sharing, then FedAvg)")

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        with torch.random.fork_rng(devices=[]):  # seeded initial generator, the global RNG untouched
            torch.manual_seed(ctx.seed_for("fedfed-vae"))
            ctx.server["vae"] = clone_state(self.vae(ctx))
        ctx.server["shared_x"] = torch.zeros(0, *ctx.models.input_shape)
        ctx.server["shared_y"] = torch.zeros(0, dtype=torch.long)

    @hookimpl
    def select_clients(self, ctx, round):
        if self.phase(round) == "share":  # (F5): every training client contributes to P
            return list(ctx.training_clients)
        return None

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        phase = self.phase(ctx.round)
        if phase == "distill":
            return {"weights": ctx.server["global"], "vae": ctx.server["vae"]}
        if phase == "share":
            return {"vae": ctx.server["vae"]}
        message = {"weights": ctx.server["global"]}
        pool_y = ctx.server["shared_y"]
        if client_id in ctx.participants and len(pool_y):  # (F6): this round's draw of P
            own = ctx.data.clients[client_id].num_train  # n_i, known to the server as FedAvg's weights
            drawn = min(len(pool_y), math.ceil(self.params.shared_ratio * own))
            draw_generator = torch_generator(ctx.spec.experiment.seed, "fedfed-draw", ctx.round, client_id)
            index = torch.randperm(len(pool_y), generator=draw_generator)[:drawn]
            message["shared_x"], message["shared_y"] = ctx.server["shared_x"][index], pool_y[index]
        return message

    @hookimpl
    def on_receive(self, ctx, client, message):
        if "weights" in message:
            load_state(client.model, message["weights"])
        if "vae" in message:
            client.scratch["fedfed_vae"] = message["vae"]
        if "shared_x" in message:
            client.scratch["fedfed_draw"] = (message["shared_x"], message["shared_y"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        if client.id not in ctx.participants:
            return None  # a cold-start client: the default fine-tuning
        phase = self.phase(ctx.round)
        if phase == "distill":
            return self.distill(ctx, client)
        if phase == "share":
            client.scratch["fedfed_shared"] = self.sensitive_features(ctx, client)
            return {}
        return self.train_with_shared(client)

    def distill(self, ctx, client) -> dict:
        """(F1)-(F3) for ``vae_local_epochs`` epochs; the generator ends in client.scratch."""
        p, training = self.params, ctx.spec.training
        model = client.model
        vae = load_state(self.vae(ctx), client.scratch["fedfed_vae"]).to(next(model.parameters()).device)
        vae_optimizer = torch.optim.AdamW(vae.parameters(), lr=p.vae_lr, weight_decay=p.vae_weight_decay)
        if "vae_optimizer" in client.state:
            vae_optimizer.load_state_dict(client.state["vae_optimizer"])
        optimizer = client.optimizer()
        x_all, y_all = client.data.train_x, client.data.train_y
        n = len(y_all)
        orders, mixing, noise = client.generator("fedfed-batches"), client.rng("fedfed-mixup"), \
            client.generator("fedfed-noise")
        model.train()
        losses = []

        def batches():
            """One epoch's mini-batches; its samples counted as work (a straggler's: those it ran)."""
            order, ran = batch_order(n, orders, training.shuffle), 0
            for start in batch_starts(n, training.batch_size, training.drop_last):
                index = order[start:start + training.batch_size]
                if len(index) > 1:  # a batch of one is skipped, as FL-bench (BatchNorm needs two)
                    if not client.take_batch():
                        client.count_work(private=ran)
                        return
                    yield x_all[index], y_all[index]
                ran += len(index)
            client.count_work(private=n)  # a whole epoch, its dropped remainder included (as run_epochs)

        def step(optimizers, loss):
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            for opt in optimizers:
                opt.step()

        for _ in range(p.vae_local_epochs):
            vae.eval()
            for x, y in batches():  # (F1) mixup on the classifier
                lam = float(mixing.beta(p.mixup_alpha, p.mixup_alpha)) if p.mixup_alpha > 0 else 1.0
                perm = torch.randperm(len(y), generator=orders)
                logits = model(lam * x + (1 - lam) * x[perm])
                step([optimizer], lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm]))
            vae.train()
            for x, _ in batches():  # (F2) the generator alone
                robust, mu, logvar = vae(x, noise)
                step([vae_optimizer], p.rec_weight * F.mse_loss(robust, x) + p.kl_weight * kl_to_standard_normal(mu, logvar))
            for x, y in batches():  # (F3) generator and classifier on the noisy sensitive part
                robust, mu, logvar = vae(x, noise)
                first, second = noisy_copies(x - robust, p.noise_std1, p.noise_std2, noise)
                logits = model(torch.cat([first, second, x]))
                b = len(y)
                loss = (p.rec_weight * F.mse_loss(robust, x) + p.kl_weight * kl_to_standard_normal(mu, logvar)
                        + p.sensitive_ce_weight * F.cross_entropy(logits[:2 * b], y.repeat(2))
                        + p.x_ce_weight * F.cross_entropy(logits[2 * b:], y))
                step([vae_optimizer, optimizer], loss)
                losses.append(loss.detach())
        client.scratch["fedfed_vae"] = {k: v.detach().clone() for k, v in vae.state_dict().items()}
        client.state["vae_optimizer"] = vae_optimizer.state_dict()  # the client's own, kept as FL-bench
        return mean_training_loss(losses)

    @torch.no_grad()
    def sensitive_features(self, ctx, client):
        """(F5): s = x - x_r with the global generator (z = mu), and its two noisy copies."""
        p = self.params
        x, y = client.data.train_x, client.data.train_y
        vae = load_state(self.vae(ctx), client.scratch["fedfed_vae"]).to(x.device).eval()
        robust, _, _ = vae(x)
        first, second = noisy_copies(x - robust, p.noise_std1, p.noise_std2, client.generator("fedfed-share"))
        return torch.cat([first, second]), torch.cat([y, y])

    def train_with_shared(self, client) -> dict:
        """(F6): train on the client's split plus the draw of P it received."""
        x, y = client.data.train_x, client.data.train_y
        if "fedfed_draw" in client.scratch:
            shared_x, shared_y = client.scratch["fedfed_draw"]
            x = torch.cat([x, shared_x.to(x.device, x.dtype)])
            y = torch.cat([y, shared_y.to(y.device)])
        return client.train(x=x, y=y, work="private")

    @hookimpl
    def client_upload(self, ctx, client):
        phase = self.phase(ctx.round)
        if client.id in ctx.participants and phase == "share":
            shared_x, shared_y = client.scratch["fedfed_shared"]
            return {"shared_x": shared_x, "shared_y": shared_y}
        upload = {"weights": client.model.state_dict()}
        if client.id in ctx.participants and phase == "distill":
            upload["vae"] = client.scratch["fedfed_vae"]
        return upload

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        phase = self.phase(ctx.round)
        if phase == "share":  # (F5): P = the arrivals' features, in participant order
            arrived = [(m["shared_x"].clone(), m["shared_y"].clone()) for _, m in uploads]
            if arrived:
                ctx.server["shared_x"] = torch.cat([x for x, _ in arrived])
                ctx.server["shared_y"] = torch.cat([y for _, y in arrived])
            return True
        if phase == "fedavg":
            return super().server_aggregate(ctx, uploads, weights)
        # (F4): FedAvg of both; copies, as an upload is valid only until the next client runs
        pairs = [(weights[i], clone_state(m["weights"]), clone_state(m["vae"])) for i, m in uploads]
        if pairs:
            ctx.server["global"] = weighted_average((w, s) for w, s, _ in pairs)
            ctx.server["vae"] = weighted_average((w, v) for w, _, v in pairs)
        return True


__all__ = ["FeatureVAE", "FedFed", "FedFedParams", "kl_to_standard_normal", "noisy_copies"]
