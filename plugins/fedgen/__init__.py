"""FedGen: Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021 (Algorithm 1).

FedAvg whose server also learns a lightweight generator G_w(z | y) of representations: z lives
where the classifier reads (the input of the model's last layer, a Linear h(z; theta^p)). The
generator is fitted to the ensemble of the clients' classifiers and broadcast with the global
model; clients use it as an inductive bias, learning their classifier on generated features
of every label the federation holds. Each round t, with S_t the participants:

    server: sends w^t, and from round 2 on G_w and the label prior p-hat(y)    (on_broadcast)
    client k: w <- w^t; E epochs of SGD on, per mini-batch (x, y) of B samples,
        CE(f(x; w), y)                                                       (local data)
        + alpha_t * (1/B) sum_b CE(h(z-hat_b; theta^p), y-hat_b),
              y-hat_b ~ p-hat(y), z-hat_b ~ G_w(. | y-hat_b)                                 (F4)
        + beta_t * KL(softmax(h(z_b)) || softmax(f(x_b; w))),  z_b ~ G_w(. | y_b)            (F5)
        alpha_t = alpha * decay^(t-1), beta_t = beta * decay^(t-1)           (from round 2 on)
      uploads w_k and its label counts n_k^y                                  (client_upload)
    server:                                                               (server_aggregate)
        w^{t+1} = sum_k n_k/n w_k                                                             (F1)
        alpha_k^y = n_k^y / sum_j n_j^y,  p-hat(y) = sum_k n_k^y / sum_k n_k                  (F2)
        generator_steps steps of Adam on w (the clients' classifiers theta^p_k frozen):       (F3)
            min_w E_{y ~ p-hat} E_{eps ~ N(0, I)} CE(sum_k alpha_k^y h(G_w(eps, y); theta^p_k), y)
                  + eta * exp(-mean_{b,b'} ||eps_b - eps_b'||^2_mean * ||z_b - z_b'||_1,mean)
    evaluation: the global model w^t (FedGen is a global-model method), for every client

(F1)-(F5) label the steps in this docstring. Where the paper (ICML 2021) has them: (F1) is
Algorithm 1 line 13 (the model average); (F2)'s p-hat(y) is the unnumbered estimate of Section
3.1, updated from the clients' label counters (Algorithm 1 lines 8 and 13); (F3) is Eq. 4, the
generator's knowledge-extraction objective (Algorithm 1 line 14); (F4) is the second term of
Eq. 5, the clients' objective (Algorithm 1 lines 7-9); (F5) is not in the paper. The paper
leaves several details to its code (github.com/zhuangdizhu/FedGen, ``serverpFedGen.py`` and
``userpFedGen.py``); we follow it there and say so, and note where PFLlib's FedGen differs:

- (F1) weights the models by n_k / n, as the official code's ``aggregate_parameters`` does;
  Algorithm 1 line 13 writes the plain mean 1/|A| sum_k theta_k. They agree when the
  participants' training splits are equal.
- (F2) pools the participants' counts, p-hat(y) = sum_k n_k^y / sum_k n_k; Section 3.1 writes
  p-hat(y) proportional to sum_k E_{x ~ D_k}[1(c*(x) = y)], a sum of each user's label
  frequencies, which weighs every user alike. They agree when the training splits are equal.
- (F3) is Eq. 4 with per-label weights on the teachers' logits: Eq. 4 averages the K
  teachers' logits uniformly, (1/K) sum_k g(z; theta^p_k); the weights alpha_k^y of (F2) come
  from the official code's label weights (a label only client k holds is taught by client k
  alone). The official code adds the teachers' per-sample cross-entropies weighted by
  alpha_k^y; PFLlib (``servergen.py``) weights the logits by the clients' shares of all
  samples, not per label. Algorithm 1 line 14 writes one gradient step on w per round; here
  ``generator_steps`` Adam steps, as the official code. The diversity term (eta) is the
  official code's (its ``DiversityLoss``, l1 between features, squared l2 between noises): the
  paper's Section 6.1 only says that a diversity loss (Mao et al., 2019) also trains the
  generator, and Eq. 4 has none; PFLlib has none. The teachers are this round's uploads; y is
  drawn from p-hat(y) of this round's uploads (the official code draws uniformly among the
  labels held; PFLlib in proportion to all clients' counts).
- (F5) is the official code's "latent" term; the paper's client objective (Eq. 5) has (F4)
  only, which ``beta = 0`` gives. Eq. 5 weighs (F4) by 1 in every round: alpha, and the decay
  of alpha_t and beta_t by ``decay`` per round, are the official code's (``exp_lr_scheduler``;
  its floor of 1e-4 is not kept: it only matters after ~450 rounds for a start of 1, ~570 for
  the default 10). Algorithm 1 broadcasts the generator from the first round; the official
  code, as here, adds the generator terms from the second round on.
  (F4)'s labels are drawn from the broadcast p-hat(y) (the official code draws them uniformly
  over every label of the data set, PFLlib in proportion to all clients' counts). Both terms use
  generated batches of ``training.batch_size`` (the official code's ``gen_batch_size`` equals its
  batch size).
- Noise eps ~ N(0, I), as the paper writes; both codes draw U[0, 1) despite their comment
  "sampling from Gaussian". The generator is the official code's: [eps, one-hot(y)] -> Linear ->
  BatchNorm -> ReLU -> Linear(K); it trains in train mode on the server and generates in eval
  mode (running statistics) on the clients. Adam with weight decay 1e-2 (the official code's),
  its moments kept across rounds; the official code also decays its learning rate by 0.98 a
  round, which we do not.
- Defaults: ``alpha = beta = 10`` and ``generator_lr = 3e-4`` (the official MNIST configuration),
  ``noise_dim = 32``, ``hidden = 256`` (its MNIST generator), ``generator_steps = 50`` (its
  ``ensemble_epochs``, 10 x 5 teacher iterations), ``eta = 1``.
- Bytes: down w, and from round 2 the generator's state (its parameters and BatchNorm buffers)
  and p-hat (C floats); up w and the C label counts (8 bytes each). The server's generator
  training is not communication. Budget: ``training.local_epochs`` private epochs a round.
- Clients keep nothing between rounds. Cold start: the newcomer receives w, G_w and p-hat and
  trains ``experiment.coldstart_epochs`` epochs with (F4)-(F5) at the last round's weights.
- The classifier must be an ``nn.Linear`` (G_w generates its input); another last layer is
  refused at the model's key before any data is loaded.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    WeightAveraging,
    at_least,
    between,
    classifier,
    finite,
    head_keys,
    hookimpl,
    learning_rate,
    load_state,
    precision_autocast,
)
from pfl_plugins.feddbe import FedDBE

GENERATOR_WEIGHT_DECAY = 1e-2  # the official code's Adam weight decay for the generator


@define
class FedGenParams:
    alpha: float = field(default=10.0, validator=[finite, at_least(0)], metadata={
        "doc": "alpha (F4): weight of the cross-entropy of the client's classifier on generated features "
               "(the official MNIST configuration)"})
    beta: float = field(default=10.0, validator=[finite, at_least(0)], metadata={
        "doc": "beta (F5): weight of the KL term between the classifier on generated features of the batch's "
               "labels and the model on the batch (the official code's; 0: the paper's objective)"})
    decay: float = field(default=0.98, validator=[finite, between(0, 1, low_open=True)], metadata={
        "doc": "alpha and beta are multiplied by decay^(t-1) in round t (the official code's schedule)"})
    noise_dim: int = field(default=32, validator=at_least(1), metadata={
        "doc": "size of the generator's noise eps ~ N(0, I)"})
    hidden: int = field(default=256, validator=at_least(1), metadata={
        "doc": "the generator's hidden width: [eps, one-hot(y)] -> hidden -> BatchNorm -> ReLU -> K"})
    generator_lr: float = field(default=3e-4, validator=learning_rate, metadata={
        "doc": "the generator's Adam learning rate (F3)"})
    generator_steps: int = field(default=50, validator=at_least(0), metadata={
        "doc": "Adam steps on the generator each round, on the server (F3); each a batch of "
               "training.batch_size labels"})
    eta: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the generator's diversity term (F3; the official code's)"})


class Generator(nn.Module):
    """G_w(z | y): [eps, one-hot(y)] -> Linear(hidden) -> BatchNorm -> ReLU -> Linear(K)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, feature_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.fc1 = nn.Linear(noise_dim + num_classes, hidden)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, feature_dim)

    def forward(self, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        h = torch.cat([eps, F.one_hot(y, self.num_classes).to(eps.dtype)], dim=1)
        return self.fc2(F.relu(self.bn1(self.fc1(h))))


def diversity_loss(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """exp(-mean over pairs (b, b') of d_eps(b, b') * d_z(b, b')), d_eps the mean squared
    difference of the noises, d_z the mean absolute difference of the features (F3)."""
    d_eps = (eps[:, None, :] - eps[None, :, :]).pow(2).mean(2)
    d_z = (z[:, None, :] - z[None, :, :]).abs().mean(2)
    return torch.exp(-(d_eps * d_z).mean())


def label_weights(counts: torch.Tensor) -> torch.Tensor:
    """(F2): alpha[y, k] = n_k^y / sum_j n_j^y from ``counts`` (teachers x classes); 0 for a label
    nobody holds."""
    counts = counts.double()
    totals = counts.sum(0)
    return (counts / totals.clamp(min=1)).T


def ensemble_logits(z: torch.Tensor, y: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor]],
                    alpha: torch.Tensor) -> torch.Tensor:
    """(F3)'s teacher: sum_k alpha[y_b, k] h(z_b; theta^p_k), each head a (weight, bias) pair."""
    out = 0
    for k, (weight, bias) in enumerate(heads):
        out = out + alpha[y, k].to(z.dtype)[:, None] * F.linear(z, weight, bias)
    return out


def decayed(value: float, decay: float, round: int) -> float:
    """alpha_t (or beta_t) = value * decay^(t-1)."""
    return value * decay ** (round - 1)


class FedGen(WeightAveraging):
    """FedAvg plus a server-side generator of representations, fitted to the ensemble of the
    clients' classifiers (weighted per label by the clients' label counts) and broadcast; clients
    add the cross-entropy of their classifier on generated features. Evaluated: the global
    model."""

    name = "fedgen"
    Params = FedGenParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture: the model is averaged
        FedDBE.check_linear_classifier(spec, self.name)

    def build_generator(self, ctx, feature_dim: int) -> Generator:
        p = self.params
        return Generator(p.noise_dim, ctx.num_classes, p.hidden, feature_dim).to(ctx.device)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # w^0
        dim = FedDBE.representation_dim(ctx, self.name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed_for("fedgen_init"))
            generator = self.build_generator(ctx, dim)
        ctx.server["generator"] = {k: v.detach().clone() for k, v in generator.state_dict().items()}
        ctx.server["generator_optimizer"] = None  # Adam's state, kept across rounds
        ctx.server["label_prior"] = None  # p-hat(y): none until the generator was first trained

    # -- server -------------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {"weights": ctx.server["global"]}
        if ctx.server["label_prior"] is not None:
            message["generator"] = ctx.server["generator"]
            message["label_prior"] = ctx.server["label_prior"]
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        heads, counts = [], []

        def keeping_heads():
            for i, message in uploads:
                w_key, b_key = self.classifier_keys(ctx)
                state = message["weights"]
                heads.append((state[w_key].detach().clone(), state[b_key].detach().clone()))  # theta^p_k
                counts.append(message["counts"])
                yield i, message

        super().server_aggregate(ctx, keeping_heads(), weights)  # (F1)
        if heads:
            self.train_generator(ctx, heads, torch.stack(counts))
        return True

    def classifier_keys(self, ctx) -> tuple[str, str]:
        """The state-dict keys of the classifier's weight and bias."""
        keys = head_keys(ctx.models.working(ctx.models.arch_of(ctx.training_clients[0])))
        return next(k for k in keys if k.endswith("weight")), next(k for k in keys if k.endswith("bias"))

    def train_generator(self, ctx, heads, counts: torch.Tensor) -> None:
        """(F2)-(F3): ``generator_steps`` Adam steps on G_w against the frozen ``heads``."""
        p = self.params
        alpha = label_weights(counts)
        prior = counts.sum(0).double()
        prior = (prior / prior.sum()).float()
        dim = heads[0][0].shape[1]
        generator = self.build_generator(ctx, dim)
        generator.load_state_dict(ctx.server["generator"])
        generator.train()
        optimizer = torch.optim.Adam(generator.parameters(), lr=p.generator_lr, weight_decay=GENERATOR_WEIGHT_DECAY)
        if ctx.server["generator_optimizer"] is not None:  # Adam's moments from the last round
            optimizer.load_state_dict(copy.deepcopy(ctx.server["generator_optimizer"]))
        draws = ctx.generator("fedgen")
        batch = max(ctx.spec.training.batch_size, 2)  # BatchNorm in train mode needs 2 samples
        losses = []
        for _ in range(p.generator_steps):
            y = torch.multinomial(prior, batch, replacement=True, generator=draws)
            eps = torch.randn(batch, p.noise_dim, generator=draws)
            with precision_autocast(ctx.spec.training, ctx.device):  # the server's training, as the clients'
                z = generator(y, eps)
                loss = F.cross_entropy(ensemble_logits(z, y, heads, alpha), y)
                if p.eta:
                    loss = loss + p.eta * diversity_loss(eps, z)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        ctx.server["generator"] = {k: v.detach().clone() for k, v in generator.state_dict().items()}
        ctx.server["generator_optimizer"] = optimizer.state_dict()  # its moments, copied when loaded
        ctx.server["label_prior"] = prior
        if losses:
            ctx.log(fedgen_generator_loss=sum(losses) / len(losses))

    # -- client -------------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["weights"])
        if "generator" in message:
            with torch.random.fork_rng(devices=[]):  # the module's own initial draws are overwritten
                generator = self.build_generator(ctx, classifier(client.model).in_features)
            generator.load_state_dict(message["generator"])
            generator.eval().requires_grad_(False)
            client.scratch["generator"] = generator
            client.scratch["label_prior"] = message["label_prior"]
            client.scratch["draws"] = client.generator("fedgen")
        return True

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """alpha_t (F4) + beta_t (F5), once the client holds a generator."""
        generator = client.scratch.get("generator")
        if generator is None or model is not client.model:
            return None
        p, draws, head = self.params, client.scratch["draws"], classifier(model)
        alpha_t, beta_t = decayed(p.alpha, p.decay, ctx.round), decayed(p.beta, p.decay, ctx.round)
        term = logits.new_zeros(())
        if alpha_t:
            batch = ctx.spec.training.batch_size
            y_hat = torch.multinomial(client.scratch["label_prior"], batch, replacement=True, generator=draws)
            z_hat = generator(y_hat, torch.randn(batch, p.noise_dim, generator=draws))
            term = term + alpha_t * F.cross_entropy(head(z_hat), y_hat)  # (F4)
        if beta_t:
            z = generator(y, torch.randn(len(y), p.noise_dim, generator=draws))
            target = F.softmax(head(z), dim=1).detach()
            term = term + beta_t * F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")  # (F5)
        return term

    @hookimpl
    def client_upload(self, ctx, client):
        counts = torch.bincount(client.data.train_y, minlength=ctx.num_classes)
        return {"weights": client.model.state_dict(), "counts": counts}


__all__ = [
    "GENERATOR_WEIGHT_DECAY",
    "FedGen",
    "FedGenParams",
    "Generator",
    "decayed",
    "diversity_loss",
    "ensemble_logits",
    "label_weights",
]
