"""FedMosaic: personalized federated co-training with adaptive lambda and expertise-weighted
consensus (seeds/fedmosaic.txt, Algorithm 1; equations as resolved in METHODS.md).

Every client keeps its own model h_i (any architecture: ``model.clients`` / ``model.pool``);
parameters are never sent. One pfl round is one communication period of Alg. 1 (lines 2-13
for every client, then the server's lines 14-18)::

    client i (on_receive, local_train):
        h_i <- its personal weights (client.state);  P <- (U, L_{t-1}) from the broadcast
        repeat b = comm_period local steps:
            l_priv   = CE(h_i, private batch)                              (line 3)
            l_pseudo = CE(h_i, public batch labelled by P)                 (line 4)
            lambda_i = exp(-(l_pseudo - l_priv) / (l_priv + eps))  [no gradient]  (line 5)
            h_i <- SGD step on l_priv + lambda_i * l_pseudo                (lines 6-7)
        (before any consensus exists: l_priv only)
    client i (client_upload):                                              (lines 9-11)
        L_i[j] = argmax h_i(x_j) for every x_j in U   -> class indices, ceil(log2 C) bits each
        E_i[j] = expertise of that prediction         -> quantised to expertise_bits (8) bits
    server (server_aggregate):                                             (lines 15-17)
        S = sum_i diag(E_i) onehot(L_i);  L_t[j] = argmax_c S[j, c]  (ties: lowest class index)
    server (on_broadcast): L_t to every client, ceil(log2 C) bits per example   (line 18)

Expertise (``expertise``):

- ``"W"`` (class frequency, the default for label skew): E_i[j] = share of client i's
  training labels equal to its predicted class for x_j, plus eps. Range [0, 1].
- ``"U"`` (uncertainty): E_i[j] = log C - H(softmax h_i(x_j)), plus eps. Range [0, log C].
- ``"uniform"``: every vote weighs 1 (plain majority vote, FedCT); nothing is sent for it.

lambda (``lambda_mode``): ``"batch"`` (default, Alg. 1: per step, from that step's two batch
losses) or ``"round"`` (once per round, from the full private training set and the full
pseudo-labelled U, as plotted in the paper's Appendix B). ``fixed_lambda`` replaces the
adaptive weight by a constant (FedCT).

Decisions where the paper and METHODS.md are silent (also in
docs/reproductions.md):

- ``comm_period`` None (default) = ``training.local_epochs`` epochs of the client's private
  data, i.e. ceil(n_i / batch_size) * local_epochs steps. ``experiment.rounds`` is then the
  number of communications (T / b in the paper's notation).
- Public batches have ``public_batch_size`` examples (default ``training.batch_size``) and
  cycle through a seeded permutation of U (``client.generator("public")``), reshuffled at
  each wrap.
- l_priv is ``client.objective`` (the core's cross-entropy plus any add-on's
  ``local_objective`` term); l_pseudo is plain cross-entropy on the consensus labels.
- In ``"round"`` mode the two full-set losses are measured in eval mode, before the round's
  first step, under ``torch.no_grad``.
- Quantisation: E is clipped to its known range [0, c] (c = 1 for "W", log C for "U"; no
  scale needs sending) and sent as round(E / c * (2^bits - 1)). The server dequantises and
  adds eps, so every vote keeps a positive weight, as the paper's E in (0, inf)^|U| requires.
- The lambda logged per client and round (``lambda/<id>``) is the mean of the round's
  per-step lambdas in "batch" mode, the round's lambda in "round" mode; it is not logged
  before the first consensus exists (round 1). ``consensus_acc`` (the consensus's accuracy
  on U's true labels, analysis only) is logged every round. The plot of lambda by round for
  all clients is logged at the end as ``fedmosaic/lambda_by_round.png`` (+ ``.csv``).
- Personalized model: the client's own h_i.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core import Plugin, SpecError, hookimpl
from pfl_core.context import clone_state
from pfl_core.evaluation import score
from pfl_core.payload import Packed, bits_for_classes
from pfl_core.spec import at_least, between, finite, greater_than, one_of
from pfl_core.training import batch_order
from plugins.codistill import predict_logits, require_public
from plugins.local import load_personal

EXPERTISE_MODES = ("W", "U", "uniform")


@define
class FedMosaicParams:
    lambda_mode: str = field(default="batch", validator=one_of("batch", "round"))
    # None: the adaptive lambda of Alg. 1; a number: lambda fixed at it (FedCT: 1).
    fixed_lambda: Optional[float] = field(default=None, validator=[finite, at_least(0)])
    expertise: str = field(default="W", validator=one_of(*EXPERTISE_MODES))
    # Local steps between communications (Alg. 1's b); None: training.local_epochs epochs.
    comm_period: Optional[int] = field(default=None, validator=at_least(1))
    public_batch_size: Optional[int] = field(default=None, validator=at_least(1))
    expertise_bits: int = field(default=8, validator=between(1, 16))
    eps: float = field(default=1e-6, validator=[finite, greater_than(0)])


# ---------------------------------------------------------------------------
# The equations, as plain functions (unit-tested on hand-computed examples).


def adaptive_lambda(l_priv: float | torch.Tensor, l_pseudo: float | torch.Tensor, eps: float = 1e-6):
    """lambda = exp(-(l_pseudo - l_priv) / (l_priv + eps)): in (0, e]; ~1 when the two losses
    agree, -> 0 when the consensus conflicts (l_pseudo >> l_priv), > 1 when it is easier."""
    if isinstance(l_priv, torch.Tensor) or isinstance(l_pseudo, torch.Tensor):
        l_priv, l_pseudo = torch.as_tensor(l_priv).detach(), torch.as_tensor(l_pseudo).detach()
        return torch.exp(-(l_pseudo - l_priv) / (l_priv + eps))
    return math.exp(-(l_pseudo - l_priv) / (l_priv + eps))


def expertise_bound(mode: str, num_classes: int) -> float:
    """The known range [0, c] of an expertise score: c = 1 ("W"), log C ("U")."""
    return 1.0 if mode == "W" else math.log(num_classes)


def expertise_scores(mode: str, logits: torch.Tensor, label_counts, eps: float) -> torch.Tensor:
    """E_i over U from the client's logits on U (float64).

    "W": share of the client's training labels equal to the predicted class, plus eps.
    "U": log C - H(softmax(logits)), plus eps.
    """
    logits = logits.detach().double()
    num_classes = logits.shape[1]
    if mode == "W":
        counts = torch.as_tensor(np.asarray(label_counts), dtype=torch.float64)
        share = counts / counts.sum().clamp_min(1)
        return share[logits.argmax(dim=1)] + eps
    if mode == "U":
        logp = F.log_softmax(logits, dim=1)
        entropy = -(logp.exp() * logp).sum(dim=1)
        return (math.log(num_classes) - entropy).clamp_min(0) + eps
    raise ValueError(f"unknown expertise mode {mode!r}")


def quantise(values: torch.Tensor, bound: float, bits: int) -> torch.Tensor:
    """Codes round(clip(v, 0, bound) / bound * (2^bits - 1)) as the smallest integer dtype."""
    levels = (1 << bits) - 1
    codes = torch.round((values.double() / bound).clamp(0, 1) * levels)
    return codes.to(torch.uint8 if bits <= 8 else torch.int32)


def dequantise(codes: torch.Tensor, bound: float, bits: int) -> torch.Tensor:
    return codes.double() / ((1 << bits) - 1) * bound


def label_dtype(num_classes: int) -> torch.dtype:
    return torch.uint8 if num_classes <= 256 else torch.int32


def consensus(votes, num_public: int, num_classes: int) -> torch.Tensor:
    """L[j] = argmax_c S[j, c], S = sum_i diag(E_i) onehot(L_i); ties go to the lowest class.

    ``votes`` iterates over (labels L_i, weights E_i or None for a weight of 1). Streams:
    holds only S (|U| x C).
    """
    scores = torch.zeros(num_public, num_classes, dtype=torch.float64)
    rows = torch.arange(num_public)
    for labels, weights in votes:
        w = torch.ones(num_public, dtype=torch.float64) if weights is None else weights.double()
        scores[rows, labels.long()] += w
    # argmax returns the first maximal index: the lowest class wins a tie (made explicit).
    best = scores.max(dim=1, keepdim=True).values
    return (scores == best).to(torch.uint8).argmax(dim=1)


# ---------------------------------------------------------------------------


def mean_loss(model, x, y, batch_size: int) -> float:
    return score(model, x, y, batch_size).loss if len(y) else 0.0


class FedMosaic(Plugin):
    name = "fedmosaic"
    Params = FedMosaicParams

    # -- spec --------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_public(spec, self.name)

    # -- server ------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        labels = ctx.server.get("consensus")
        if labels is None:  # round 1: no consensus yet, nothing to send
            return {}
        return {"consensus": Packed(labels, bits_for_classes(ctx.num_classes))}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        p = self.params
        mode = p.expertise
        bound = expertise_bound(mode, ctx.num_classes) if mode != "uniform" else 1.0

        def votes():
            for _client_id, message in uploads:
                labels = message["labels"].value
                expertise = None
                if mode != "uniform":
                    expertise = dequantise(message["expertise"].value, bound, p.expertise_bits) + p.eps
                yield labels, expertise

        public = ctx.data.public
        labels = consensus(votes(), len(public), ctx.num_classes)
        if ctx.participants:
            ctx.server["consensus"] = labels.to(label_dtype(ctx.num_classes))
            ctx.log(consensus_acc=float((labels == public.true_y.cpu()).double().mean()))
        return True

    # -- client ------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        if "consensus" in message:
            client.scratch["pseudo_y"] = message["consensus"].value.long().to(ctx.device)
        return True

    def _lambda(self, l_priv, l_pseudo):
        if self.params.fixed_lambda is not None:
            return torch.tensor(float(self.params.fixed_lambda))
        return adaptive_lambda(l_priv, l_pseudo, self.params.eps)

    @hookimpl
    def local_train(self, ctx, client):
        p, training = self.params, ctx.spec.training
        model = client.model
        optimizer = client.optimizer()
        x, y = client.data.train_x, client.data.train_y
        n, batch = len(y), training.batch_size
        steps = p.comm_period or math.ceil(n / batch) * training.local_epochs
        pseudo_y = client.scratch.get("pseudo_y")
        public_x = ctx.data.public.x
        public_batch = p.public_batch_size or batch

        round_lambda = None
        if pseudo_y is not None and p.lambda_mode == "round":
            l_priv_full = mean_loss(model, x, y, ctx.spec.evaluation.batch_size)
            l_pseudo_full = mean_loss(model, public_x, pseudo_y, ctx.spec.evaluation.batch_size)
            round_lambda = self._lambda(l_priv_full, l_pseudo_full)

        gen_priv, gen_pub = client.generator("train"), client.generator("public")
        order, pos = batch_order(n, gen_priv, training.shuffle), 0
        pub_order, pub_pos = torch.randperm(len(public_x), generator=gen_pub), 0
        model.train()
        total, lambdas = torch.zeros((), dtype=torch.float64), []
        for _ in range(steps):
            if pos >= n:
                order, pos = batch_order(n, gen_priv, training.shuffle), 0
            idx, pos = order[pos : pos + batch], pos + batch
            xb, yb = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            l_priv = client.objective(model, xb, yb, logits)
            loss = l_priv
            if pseudo_y is not None:
                if pub_pos >= len(public_x):
                    pub_order, pub_pos = torch.randperm(len(public_x), generator=gen_pub), 0
                pidx, pub_pos = pub_order[pub_pos : pub_pos + public_batch], pub_pos + public_batch
                l_pseudo = F.cross_entropy(model(public_x[pidx]), pseudo_y[pidx])
                lam = round_lambda if round_lambda is not None else self._lambda(l_priv.detach(), l_pseudo.detach())
                lambdas.append(float(lam))
                loss = l_priv + lam * l_pseudo
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        client.state["weights"] = clone_state(model)
        if lambdas:
            mean_lambda = float(np.mean(lambdas))
            ctx.log({f"lambda/{client.id}": mean_lambda})
            client.state.setdefault("lambda_history", []).append((ctx.round, mean_lambda))
        return {"train_loss": float(total) / steps} if steps else {}

    @hookimpl
    def client_upload(self, ctx, client):
        p = self.params
        logits = predict_logits(client.model, ctx.data.public.x, ctx.spec.evaluation.batch_size).cpu()
        labels = logits.argmax(dim=1).to(label_dtype(ctx.num_classes))
        upload = {"labels": Packed(labels, bits_for_classes(ctx.num_classes))}
        if p.expertise != "uniform":
            counts = client.data.label_counts("train", ctx.num_classes)
            scores = expertise_scores(p.expertise, logits, counts, p.eps)
            codes = quantise(scores, expertise_bound(p.expertise, ctx.num_classes), p.expertise_bits)
            upload["expertise"] = Packed(codes, p.expertise_bits)
        return upload

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": load_personal(ctx, client)}

    # -- artifacts ---------------------------------------------------------------------

    @hookimpl
    def on_finish(self, ctx):
        histories = {i: ctx.store[i].get("lambda_history", []) for i in ctx.training_clients}
        if not any(histories.values()):
            return None
        from pfl_core import plots

        fig, ax = plots.plt.subplots(figsize=(7, 4))
        for i, points in histories.items():
            if points:
                rounds, values = zip(*points)
                ax.plot(rounds, values, marker="o", markersize=2, linewidth=1, label=f"client {i}")
        ax.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
        ax.set_xlabel("round")
        ax.set_ylabel("lambda")
        ax.set_title(f"{self.name}: lambda by round ({self.params.lambda_mode} mode)")
        ax.grid(alpha=0.3)
        if len(histories) <= 20:
            ax.legend(fontsize=6, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
        fig.tight_layout()
        ctx.tracker.log_figure(fig, f"{self.name}/lambda_by_round.png")
        plots.close(fig)
        lines = ["client,round,lambda"] + [f"{i},{r},{v:.6g}" for i, pts in histories.items() for r, v in pts]
        ctx.tracker.log_text("\n".join(lines) + "\n", f"{self.name}/lambda_by_round.csv")
        return None
