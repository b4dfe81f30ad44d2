"""FedMosaic: personalized federated co-training with adaptive lambda and expertise-weighted
consensus (seeds/fedmosaic.txt, Algorithm 1; equations as resolved in METHODS.md).

Every client keeps its own model h_i (any architecture: ``model.clients`` / ``model.pool``);
parameters are never sent. One pfl round is one communication period of Alg. 1 (lines 2-13
for every client, then the server's lines 14-18)::

    client i (on_receive, local_train):
        h_i <- its personal weights (client.state);  P <- (U, L_{t-1}) from the broadcast
        first round of client i only: warmup_epochs epochs of l_priv steps   (warm-up)
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
        log consensus_acc, consensus_tie_share                            (diagnostics)
    server (on_broadcast): L_t to every client, ceil(log2 C) bits per example   (line 18)

Expertise (``expertise``):

- ``"W"`` (class frequency, the default for label skew): E_i[j] = share of client i's
  training labels equal to its predicted class for x_j, plus eps. Range [0, 1].
- ``"U"`` (uncertainty): E_i[j] = log C - H(softmax h_i(x_j)), plus eps. Range [0, log C].
- ``"uniform"``: every vote weighs 1 (plain majority vote, FedCT); nothing is sent for it.

lambda (``lambda_mode``): ``"batch"`` (default, Alg. 1: per step, from that step's two batch
losses) or ``"round"`` (once per round, from the full private training set and the full
pseudo-labelled U, as plotted in the paper's Appendix B). ``lam`` replaces the
adaptive weight by a constant (FedCT).

Decisions where the paper and METHODS.md are silent:

- ``comm_period`` None (default) = ``training.local_epochs`` epochs of the client's private
  data, i.e. (n_i // batch_size) * local_epochs steps (ceil with ``training.drop_last =
  false``); private batches follow ``client.train``'s order exactly (``private_batches``).
  ``experiment.rounds`` is then the number of communications (T / b in the paper's notation).
- Warm-up (``warmup_epochs``, not in the paper): in a client's first round its first
  ``warmup_epochs`` epochs are private-only steps (same optimiser, same batch stream), then
  the round's b steps as above; so its first upload comes from a model that has seen its
  data. Why: at our scale the first-round voters were incompetent (after ~15 steps three
  clients predicted one class on all of U), lambda fell to 0 for every client and FedMosaic
  became Local. Counted in the budget: ``local_work`` declares it as
  ``pretrain_private_epochs`` and every step is counted with ``client.count_work``, so Local
  can be given the same total private epochs. FedMosaic with ``warmup_epochs = w`` and one
  round equals Local with ``w + local_epochs`` epochs bit for bit (tested). Default
  ``WARMUP_EPOCHS``: see "Warm-up default" below.
- Public batches: each co-training step pairs its private batch with a public batch, and a
  local epoch's steps together make ``public_passes`` passes over U (default 1: an epoch
  covers D_i and P once each, as training on D_i u P does). The epoch's
  round(public_passes * |U|) public indices are the next ones of a stream of seeded
  permutations of U (``client.generator("public")``, a fresh one at each wrap), split over
  its steps as evenly as possible (``public_batches``); a step whose share is empty has no
  pseudo term. So public work is declarable before the data exists: public_passes *
  local_epochs passes of U per co-training round (``local_work``). Lower ``public_passes``
  where |U| is much larger than D_i and compute matters.
- l_priv is ``client.objective`` (the core's cross-entropy plus any add-on's
  ``local_objective`` term); l_pseudo is plain cross-entropy on the consensus labels.
- In ``"round"`` mode the two full-set losses are measured in eval mode, before the round's
  first co-training step (after any warm-up), under ``torch.no_grad``.
- Quantisation: E is clipped to its known range [0, c] (c = 1 for "W", log C for "U"; no
  scale needs sending) and sent as round(E / c * (2^bits - 1)). The server dequantises and
  adds eps, so every vote keeps a positive weight, as the paper's E in (0, inf)^|U| requires.
- The lambda logged per client and round (``lambda`` in ``results/client_series.csv``; its
  mean, min and max over clients as metrics) is the mean of the round's
  per-step lambdas in "batch" mode, the round's lambda in "round" mode; it is not logged
  before the first consensus exists (round 1). The plot of lambda by round for all clients is
  logged at the end as ``fedmosaic/lambda_by_round.png`` (+ ``.csv``). With the
  ``corrupted_clients`` add-on, ``lambda_corrupted_mean`` and ``lambda_clean_mean`` sum the
  clients' mean lambdas up per group (final metrics, summarised over seeds).
- Diagnostics logged every round, never read by the method: ``consensus_acc``, the accuracy
  of L_t against U's true labels (``ctx.data.public.true_y``: a simulation knows them even
  when ``public.labelled = false``; no client or training step sees them), and
  ``consensus_tie_share``, the share of U whose top score S[j, c] is reached by more than
  one class (the examples the tie rule decides).
- Ties: scores equal up to a relative 1e-9 (``TIE_RTOL``) are tied, so the lowest-class rule
  does not depend on the order the server summed the votes in (float rounding). Distinct
  quantised weights differ by far more.
- Personalized model: the client's own h_i.

Warm-up default (``WARMUP_EPOCHS = 1``), measured on specs/fedmosaic_fmnist_pathological.toml
(15 clients x 2 classes, ~460 train images each, U = 2,250, LeNet-5, SGD lr 0.05 momentum
0.9, batch 32), round 1 only (``--set experiment.rounds=1 --set algorithm.params.warmup_epochs=w``), seeds
0/1/2, the round-1 uploads' models scored against U's true labels under each vote rule::

    warmup  client acc on own test   clients predicting one class   consensus acc on U: W / U / uniform   uniform tie share
    0       0.55 0.59 0.50           10 11 15                       0.13 0.14 0.10 / 0.06 0.34 0.17 / 0.10 0.10 0.10   0.99 0.62 1.00
    1       0.70 0.80 0.75            5  2  2                       0.20 0.35 0.22 / 0.20 0.30 0.28 / 0.19 0.30 0.16   0.78 0.79 0.77
    2       0.71 0.63 0.78            5  6  3                       0.22 0.25 0.28 / 0.28 0.26 0.27 / 0.20 0.14 0.27   0.64 0.47 0.85
    3       0.67 0.66 0.84            6  6  1                       0.29 0.24 0.36 / 0.31 0.24 0.38 / 0.24 0.24 0.25   0.41 0.65 0.73
    5       0.69 0.66 0.77            6  7  2                       0.32 0.11 0.18 / 0.36 0.22 0.26 / 0.25 0.20 0.26   0.39 0.88 0.87

One epoch of warm-up gives most of what more epochs give (round-1 client accuracy 0.55 ->
0.75, one-class voters 10-15 -> 2-5, consensus 0.12 -> 0.26 under "W"); 2-5 epochs do not do
consistently better, so 1 is the default. No warm-up up to 5 epochs made the round-1
consensus competent here (best 0.38): even where the clients' own accuracy reached 0.90
(lr 0.01, warm-up 5, seed 1: no one-class voter, 90 % of holders of an example's class
predict it) the consensus scored 0.36 ("W"), 0.23 ("U"), 0.20 (uniform). Not measured:
why; the tie shares under "W" and "U" were ~0 (the weights differ), so the tie rule does
not explain it there. With FedCT's uniform vote 40-100 % of U was tied in round 1.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    Packed,
    Plugin,
    at_least,
    batch_order,
    batch_starts,
    between,
    bits_for_classes,
    clone_state,
    dequantise,
    expertise_bound,
    finite,
    greater_than,
    hookimpl,
    load_personal,
    one_of,
    plots,
    predict_logits,
    quantise,
    require_public,
    score,
)

EXPERTISE_MODES = ("W", "U", "uniform")
WARMUP_EPOCHS = 1  # measured default: see the module docstring, "Warm-up default"
TIE_RTOL = 1e-9  # scores this close (relative) count as tied: float rounding, not a vote


@define
class FedMosaicParams:
    lambda_mode: str = field(default="batch", validator=one_of("batch", "round"), metadata={
        "doc": "adaptive lambda per step from that step's two batch losses (Alg. 1), or once per round "
               "from the full private set and the full pseudo-labelled U"})
    lam: Optional[float] = field(default=None, validator=[finite, at_least(0)], metadata={
        "doc": "none: the adaptive lambda of Alg. 1; a number: lambda fixed at it (FedCT: 1)"})
    expertise: str = field(default="W", validator=one_of(*EXPERTISE_MODES), metadata={
        "doc": "vote weights: W, the client's share of training labels of the predicted class; U, "
               "log C minus the prediction's entropy; uniform, a plain majority vote (nothing sent)"})
    comm_period: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "local steps between communications (Alg. 1's b); none: training.local_epochs epochs"})
    public_passes: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "passes over U per local epoch of co-training (spread over the epoch's steps)"})
    expertise_bits: int = field(default=8, validator=between(1, 16),
                                metadata={"doc": "bits each uploaded expertise value is quantised to"})
    eps: float = field(default=1e-6, validator=[finite, greater_than(0)], metadata={
        "doc": "added to every vote weight (so each stays positive) and to lambda's denominator"})
    warmup_epochs: int = field(default=WARMUP_EPOCHS, validator=at_least(0), metadata={
        "doc": "epochs of private-only training in a client's first round, before its first upload "
               "(not in the paper; counted in the budget)"})


# ---------------------------------------------------------------------------
# The equations, as plain functions (unit-tested on hand-computed examples).


def adaptive_lambda(l_priv: float | torch.Tensor, l_pseudo: float | torch.Tensor, eps: float = 1e-6):
    """lambda = exp(-(l_pseudo - l_priv) / (l_priv + eps)): in (0, e]; ~1 when the two losses
    agree, -> 0 when the consensus conflicts (l_pseudo >> l_priv), > 1 when it is easier."""
    if isinstance(l_priv, torch.Tensor) or isinstance(l_pseudo, torch.Tensor):
        l_priv, l_pseudo = torch.as_tensor(l_priv).detach(), torch.as_tensor(l_pseudo).detach()
        return torch.exp(-(l_pseudo - l_priv) / (l_priv + eps))
    return math.exp(-(l_pseudo - l_priv) / (l_priv + eps))


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


def label_dtype(num_classes: int) -> torch.dtype:
    return torch.uint8 if num_classes <= 256 else torch.int32


def consensus_scores(votes, num_public: int, num_classes: int) -> torch.Tensor:
    """S = sum_i diag(E_i) onehot(L_i) (|U| x C, float64).

    ``votes`` iterates over (labels L_i, weights E_i or None for a weight of 1). Streams:
    holds only S.
    """
    scores = torch.zeros(num_public, num_classes, dtype=torch.float64)
    rows = torch.arange(num_public)
    for labels, weights in votes:
        w = torch.ones(num_public, dtype=torch.float64) if weights is None else weights.double()
        scores[rows, labels.long()] += w
    return scores


def top_classes(scores: torch.Tensor) -> torch.Tensor:
    """Per row, which classes reach the top score (equal up to ``TIE_RTOL`` relative:
    summing the same weights in another order may differ in the last bits)."""
    best = scores.max(dim=1, keepdim=True).values
    return scores >= best - TIE_RTOL * best.abs()


def consensus_labels(scores: torch.Tensor) -> torch.Tensor:
    """L[j] = argmax_c S[j, c]; ties go to the lowest class index."""
    return top_classes(scores).to(torch.uint8).argmax(dim=1)  # argmax: the first maximal index


def tie_share(scores: torch.Tensor) -> float:
    """Share of U whose top score is reached by more than one class."""
    return float((top_classes(scores).sum(dim=1) > 1).double().mean()) if len(scores) else 0.0


def consensus(votes, num_public: int, num_classes: int) -> torch.Tensor:
    """L[j] = argmax_c S[j, c], S = sum_i diag(E_i) onehot(L_i); ties go to the lowest class."""
    return consensus_labels(consensus_scores(votes, num_public, num_classes))


# ---------------------------------------------------------------------------


def mean_loss(model, x, y, batch_size: int) -> float:
    return score(model, x, y, batch_size).loss if len(y) else 0.0


def private_batches(n: int, batch_size: int, generator, shuffle: bool, drop_last: bool):
    """Index batches over the private set, epoch after epoch, in the order
    ``pfl_core.runtime.training.run_epochs`` uses (one ``batch_order`` per epoch, ``batch_starts``), so
    private-only steps are exactly ``client.train``'s. Endless; empty when there is no batch."""
    starts = batch_starts(n, batch_size, drop_last)
    while len(starts):
        order = batch_order(n, generator, shuffle)
        for start in starts:
            yield order[start : start + batch_size]


def public_batches(num_public: int, steps_per_epoch: int, per_epoch: int, generator):
    """Index batches over U, epoch after epoch: each epoch takes the next ``per_epoch``
    indices of a stream of permutations of U (a fresh one at each wrap) and splits them over
    its ``steps_per_epoch`` steps, sizes differing by at most one. Endless."""
    stream, pos = torch.randperm(num_public, generator=generator), 0
    while True:
        parts, need = [], per_epoch
        while need > 0:
            if pos >= num_public:
                stream, pos = torch.randperm(num_public, generator=generator), 0
            part = stream[pos : pos + need]
            parts.append(part)
            pos, need = pos + len(part), need - len(part)
        yield from torch.tensor_split(torch.cat(parts) if parts else stream[:0], steps_per_epoch)


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
        scores = consensus_scores(votes(), len(public), ctx.num_classes)
        if ctx.participants:
            labels = consensus_labels(scores)
            ctx.server["consensus"] = labels.to(label_dtype(ctx.num_classes))
            # Diagnostics only (a simulation knows U's labels; the method never reads them).
            ctx.log(consensus_acc=float((labels == public.true_y.cpu()).double().mean()),
                    consensus_tie_share=tie_share(scores))
        return True

    # -- client ------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_personal(ctx, client)
        if "consensus" in message:
            client.scratch["pseudo_y"] = message["consensus"].value.long().to(ctx.device)
        return True

    def _lambda(self, l_priv, l_pseudo):
        if self.params.lam is not None:
            return torch.tensor(float(self.params.lam))
        return adaptive_lambda(l_priv, l_pseudo, self.params.eps)

    def local_work(self, spec) -> LocalWork:
        """Per round: ``training.local_epochs`` private epochs and ``public_passes`` times as
        many passes over U; the first round adds ``warmup_epochs`` private epochs and has no
        consensus to train on (hence the negative public correction, as in
        pfl_core/methods/codistill.py). With ``comm_period`` (steps) the epochs depend on the partition:
        nan (the engine still measures them)."""
        p = self.params
        private = float(spec.training.local_epochs) if p.comm_period is None else math.nan
        public = private * p.public_passes
        return LocalWork(private, public_epochs_per_round=public,
                         pretrain_private_epochs=float(p.warmup_epochs), pretrain_public_epochs=-public)

    @hookimpl
    def local_train(self, ctx, client):
        p, training = self.params, ctx.spec.training
        model = client.model
        optimizer = client.optimizer()
        x, y = client.data.train_x, client.data.train_y
        batch = training.batch_size
        per_epoch = len(batch_starts(len(y), batch, training.drop_last))
        dropped = len(y) - min(len(y), per_epoch * batch)  # the remainder drop_last skips
        steps = (p.comm_period or per_epoch * training.local_epochs) if per_epoch else 0
        # Warm-up: the first steps of a client's first round are private-only (Alg. 1 with
        # no pseudo term), so its first upload comes from a model that has seen its data.
        warmup = 0 if client.state.get("warmed_up") else per_epoch * p.warmup_epochs
        client.state["warmed_up"] = True
        pseudo_y = client.scratch.get("pseudo_y")
        public_x = ctx.data.public.x
        private = private_batches(len(y), batch, client.generator("train"), training.shuffle, training.drop_last)
        public = public_batches(len(public_x), per_epoch, round(p.public_passes * len(public_x)),
                                client.generator("public"))
        model.train()
        round_lambda = None
        total, lambdas = torch.zeros((), dtype=torch.float64), []
        taken = 0
        for step in range(warmup + steps):
            if not client.take_batch():  # a straggler's batch budget is spent
                break
            taken += 1
            idx = next(private)
            xb, yb = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            l_priv = client.objective(model, xb, yb, logits)
            loss, public_seen = l_priv, 0
            pidx = next(public) if pseudo_y is not None and step >= warmup else ()
            if len(pidx):
                if p.lambda_mode == "round" and round_lambda is None:  # once, before co-training
                    round_lambda = self._round_lambda(ctx, model, x, y, public_x, pseudo_y)
                l_pseudo = F.cross_entropy(model(public_x[pidx]), pseudo_y[pidx])
                lam = round_lambda if round_lambda is not None else self._lambda(l_priv.detach(), l_pseudo.detach())
                lambdas.append(float(lam))
                loss, public_seen = l_priv + lam * l_pseudo, len(pidx)
            loss.backward()
            optimizer.step()
            # An epoch counts as n samples, its dropped remainder included (as client.train).
            ends_epoch = (step + 1) % per_epoch == 0
            client.count_work(private=len(idx) + (dropped if ends_epoch else 0), public=public_seen)
            total += float(loss.detach())
        client.state["weights"] = clone_state(model)
        if lambdas:
            mean_lambda = float(np.mean(lambdas))
            client.log(**{"lambda": mean_lambda})  # a Python keyword: passed as a dict
            client.state.setdefault("lambda_history", []).append((ctx.round, mean_lambda))
        return {"train_loss": float(total) / taken} if taken else {}

    def _round_lambda(self, ctx, model, x, y, public_x, pseudo_y):
        """"round" mode: lambda from the full private set and the full pseudo-labelled U
        (eval mode, no gradient), before the round's first co-training step."""
        batch = ctx.spec.evaluation.batch_size
        return self._lambda(mean_loss(model, x, y, batch), mean_loss(model, public_x, pseudo_y, batch))

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
