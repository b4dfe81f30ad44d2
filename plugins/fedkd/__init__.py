"""FedKD: Wu, Wu, Lyu, Huang and Xie, "Communication-efficient federated learning via knowledge
distillation", Nature Communications 13, 2032 (2022; arXiv:2108.13323).

Each client k keeps a mentor (teacher) T_k that never leaves it, beside its copy of a shared
mentee (student) S. Both learn from the client's data and from each other by adaptive mutual
distillation; only the mentee's update travels, compressed by a truncated SVD whose kept
energy grows over the rounds. The paper's method section could not be read here (only its
abstract and overview); the steps below follow those, the authors' code (github:wuch15/FedKD,
run.py at 20ce6333, model_bert.py at 962afa5e) and PFLlib (github:TsingZ0/PFLlib at d832e76f,
clientkd.py / serverkd.py); FL-bench has no FedKD. Equation labels are this docstring's:

    per mini-batch (x, y), z_T = T_k(x), z_S = S_k(x), H_T and H_S the classifier inputs:
    (L1) task losses  L_T = task(z_T, y),  L_S = task(z_S, y)            (client.objective)
    (L2) adaptive weight  a = 1 / (L_T + L_S)   (both models right: strong distillation)
    (L3) mentor   L_T + a KL(p_S || p_T) + a MSE(H_T, W_T H_S)
    (L4) mentee   L_S + a KL(p_T || p_S) + a MSE(H_T, W_S H_S)
         (p = softmax(z); in each model's loss the other model's p and H are constants; the
          projections W_T, W_S, d x d with d the classifier's input size, train with the loss
          they appear in and stay on the client)
    one optimiser step per batch moves T_k, S_k, W_T, W_S together (the gradient of
    (L3) + (L4) w.r.t. each is its own loss's: the cross terms are constants)

    energy schedule, round r of R:  T(r) = T_start + (T_end - T_start) (r - 1) / (R - 1)  (E1)
    compression of a matrix G (a 2-D weight; a conv kernel as out x (in * kh * kw)):      (E2)
         G = U diag(s) V^T; keep the smallest K with s_1^2 + ... + s_K^2 >= T(r) (s_1^2 + ...);
         send U_K, s_K, V_K (K (m + n + 1) numbers); 1-D tensors (biases) travel dense

    client k in round r, given the mentee w^r:                                (on_receive)
        S_k <- w^r;  T_k, W_T, W_S <- its own (the seeded initial weights and identities at first)
        training.local_epochs epochs of (L3) + (L4)                            (local_train)
        upload (E2) of Delta_k = S_k - w^r at T(r)                             (client_upload)
    server: Delta = sum_k w_k decompress(Delta_k) (w_k: 1/|K| by default);          (server_aggregate)
        Delta^ = (E2) of Delta at T(r);  w^{r+1} = w^r + decompress(Delta^)
    download in round r + 1: Delta^ to each client whose upload of round r arrived (it holds
        w^r and adds Delta^ itself, the same float arithmetic as the server's); the whole w^{r+1}
        to every other client (a newcomer, one that sat out or whose upload was lost)
    evaluation: each client's mentor T_k (never-trained clients: the seeded initial weights)

Defaults and decisions:

- ``T_start = 0.95``, ``T_end = 0.98``: PFLlib's defaults; the authors' script takes them as
  arguments. (E1) runs from T_start in round 1 to T_end in round R (T_end when R = 1). The
  authors' run.py uses T_start + (T_end - T_start) r / R in round r (T_start is never used);
  PFLlib's server goes from T_start to T_end over its R + 1 rounds.
- (E2) keeps the smallest K reaching the energy share (>=, so K <= rank always). The authors'
  client and PFLlib's loop test ``>`` over the first len(s) - 1 prefixes only and keep nothing
  (K = 0) when the share needs every singular value; that case here keeps all of them. A zero
  matrix keeps K = 0. The SVD runs in float64; factors travel in the tensor's dtype.
- The mentee's update is compressed, as the paper and the authors' code do; PFLlib compresses
  the mentee's weights themselves (its truncation error never averages out).
- The aggregate is the uniform mean over the arrived uploads (``weighting = "uniform"``: the
  authors' np.mean and PFLlib's 1/N); ``"samples"`` weights by n_k as FedAvg does.
- The mentor has the client's architecture (``model.name``): pfl has no teacher/student pair
  of sizes; the paper's mentor is the larger model. PFLlib does the same. The hidden loss
  compares the classifier inputs (PFLlib's base output); the paper also matches transformer
  layers' hidden states and attention maps.
- Every cross term's target is detached and the adaptive weight (L2) is a constant per batch:
  each model learns from the other, not the other from being imitated. The authors' code and
  PFLlib backpropagate through the targets and through 1 / (L_T + L_S) (the weight's gradient
  pushes the task losses up). KL is per-sample, averaged over the batch (``batchmean``);
  both references use KLDivLoss's element mean (divided by the class count as well).
- In round 1 the mentor and the mentee start from the same seeded weights, so they train
  identically and every cross term is 0 (FedAvg's first round, with twice the work); they part
  from round 2 on, when the mentee is replaced by the aggregate (PFLlib starts both from one
  initialisation too; its random W_h makes the hidden term non-zero from the start).
- The projections W_T, W_S start as identities (the hidden loss starts as the plain feature
  MSE; nothing random); PFLlib has one W_h with PyTorch's random init shared by both losses;
  the authors' projections are created but unused.
- One optimiser (``training``'s: lr, momentum, weight decay) for all four parts; PFLlib has a
  separate mentee lr (equal by default), plain SGD and gradient clipping at norm 10 (not here).
- The task loss is ``client.objective`` (cross-entropy, or a ``task_loss`` plugin's, plus
  add-on terms); ``train_loss`` is the mean over batches of (L3) + (L4).
- Budget (``local_work``): 2 x training.local_epochs private epochs (two models see every
  sample); the steps count twice as well.
- Bytes: up, the factors of Delta_k; down, Delta^'s factors or w^{r+1} (see above).
- Lost uploads (``dropout``): the mentor and projections are the client's and keep the round's
  training; the server counts a client as holding w^r only if its round-r upload arrived, so a
  lost upload costs the full model next time, never a wrong mentee.
- Cold start: the newcomer receives the final w, trains its fresh mentor with the mentee by
  (L3) + (L4) for ``experiment.coldstart_epochs`` epochs, and is scored with its mentor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    FieldError,
    LocalWork,
    MutualPair,
    SpecError,
    WeightAveraging,
    between,
    classifier,
    clone_state,
    described,
    hookimpl,
    load_state,
    model_key,
    one_of,
    probe_model,
    spec_archs,
)


@described(">= T_start")
def check_schedule(instance, attribute, value) -> None:
    del attribute, value
    if instance.T_end < instance.T_start:
        raise FieldError("T_end", f"must be >= T_start ({instance.T_start}), got {instance.T_end}")


@define
class FedKDParams:
    T_start: float = field(default=0.95, validator=[between(0, 1, low_open=True)], metadata={
        "doc": "energy share the truncated SVD keeps in round 1 (E1, E2); PFLlib's default"})
    T_end: float = field(default=0.98, validator=[between(0, 1, low_open=True), check_schedule], metadata={
        "doc": "energy share kept in the last round, >= T_start; linear in between (E1); PFLlib's default"})
    weighting: str = field(default="uniform", validator=one_of("uniform", "samples"), metadata={
        "doc": 'the server\'s mean of the decompressed updates: 1/|K| (the authors\' and PFLlib\'s) or "samples", '
               "n_k / n (FedAvg's)"})


# -- (E1), (E2): the energy schedule and the truncated SVD ----------------------------------------


def energy(round: int, rounds: int, T_start: float, T_end: float) -> float:
    """(E1): T_start in round 1, T_end in round ``rounds``, linear in between."""
    if rounds <= 1:
        return T_end
    return T_start + (T_end - T_start) * (round - 1) / (rounds - 1)


def kept_rank(singular_values: torch.Tensor, share: float) -> int:
    """The smallest K with s_1^2 + ... + s_K^2 >= share * (s_1^2 + ... + s_r^2); 0 for a zero matrix."""
    cumulative = torch.cumsum(singular_values.double() ** 2, 0)
    total = cumulative[-1]  # the same sum the prefixes reach: share = 1 keeps every value
    if total == 0:
        return 0
    return min(int((cumulative < share * total).sum()) + 1, len(singular_values))


def compress(delta: dict, share: float) -> dict:
    """(E2) on every floating tensor of 2 or more dimensions: {"u", "s", "v"} (U_K, s_K, V_K^T);
    other tensors as they are."""
    out = {}
    for key, tensor in delta.items():
        if not tensor.is_floating_point() or tensor.dim() < 2:
            out[key] = tensor
            continue
        u, s, vh = torch.linalg.svd(tensor.reshape(tensor.shape[0], -1).double(), full_matrices=False)
        k = kept_rank(s, share)
        out[key] = {"u": u[:, :k].to(tensor.dtype), "s": s[:k].to(tensor.dtype), "v": vh[:k].to(tensor.dtype)}
    return out


def decompress(compressed: dict, like: dict) -> dict:
    """The tensors (E2) sent, each in the shape and dtype of ``like``'s (float64 products)."""
    out = {}
    for key, value in compressed.items():
        if isinstance(value, dict):
            matrix = (value["u"].double() * value["s"].double()) @ value["v"].double()
            out[key] = matrix.reshape(like[key].shape).to(like[key].dtype)
        else:
            out[key] = value
    return out


def apply_update(base: dict, update: dict) -> dict:
    """base + the update, floating tensors only (others, e.g. BatchNorm's counter, replaced)."""
    return {k: (base[k] + update[k] if base[k].is_floating_point() else update[k].clone()) for k in base}


# -- (L1)-(L4): adaptive mutual distillation -----------------------------------------------------


def distillation(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)), the target a constant, averaged over the batch."""
    return F.kl_div(F.log_softmax(logits, dim=1), F.softmax(target_logits.detach(), dim=1), reduction="batchmean")


def fedkd_losses(task_T, task_S, z_T, z_S, H_T, H_S, W_T, W_S) -> tuple[torch.Tensor, torch.Tensor]:
    """(L3) and (L4) from the task losses (L1), logits and classifier inputs; W_T, W_S: modules."""
    a = 1.0 / (task_T + task_S).detach()  # (L2)
    mentor = task_T + a * distillation(z_T, z_S) + a * F.mse_loss(H_T, W_T(H_S.detach()))
    mentee = task_S + a * distillation(z_S, z_T) + a * F.mse_loss(H_T.detach(), W_S(H_S))
    return mentor, mentee


def linear_classifier(spec, arch: str, model: nn.Module) -> nn.Linear:
    """``model``'s last layer, whose input is the hidden state H of (L3), (L4): refused unless an nn.Linear."""
    layer = classifier(model)
    if not isinstance(layer, nn.Linear):
        raise SpecError(model_key(spec), f"fedkd's hidden loss needs a model whose last layer is a Linear classifier; "
                                         f"{arch}'s is a {type(layer).__name__}")
    return layer


def identity_projection(d: int) -> nn.Linear:
    layer = nn.Linear(d, d, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(d))
    return layer


class FedKD(WeightAveraging):
    """FedKD (Wu et al. 2022): a mentor per client, never sent and evaluated, beside the shared
    mentee; both trained by adaptive mutual distillation; the mentee's update travels as a
    truncated SVD keeping a growing energy share (T_start -> T_end). Budget: 2 x
    ``training.local_epochs``."""

    name = "fedkd"
    Params = FedKDParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(2.0 * spec.training.local_epochs)

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):  # what can be built before the data is loaded (--dry-run)
            model = probe_model(spec, arch)
            if model is not None:
                linear_classifier(spec, arch, model)

    def share(self, ctx) -> float:
        return energy(ctx.round, ctx.spec.experiment.rounds, self.params.T_start, self.params.T_end)

    # -- server -------------------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # w^1: the seeded initial weights
        ctx.server["update"] = None  # Delta^ of the last aggregate
        ctx.server["holders"] = []  # clients holding w^r - Delta^ (their last upload arrived)
        ctx.server["aggregated_round"] = 0

    @hookimpl
    def client_weighting(self, ctx, participants):
        if self.params.weighting == "uniform":
            return {i: 1.0 / len(participants) for i in participants}
        return None  # the core's n_k / n

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        if ctx.server["update"] is not None and client_id in ctx.server["holders"]:
            return {"update": ctx.server["update"]}
        return {"weights": ctx.server["global"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        glob = ctx.server["global"]
        total, arrived = None, []
        for i, message in uploads:  # streamed: one decompressed update at a time
            delta = decompress(message["update"], glob)
            if total is None:
                total = {k: (weights[i] * v.double() if v.is_floating_point() else v) for k, v in delta.items()}
            else:
                for k, v in delta.items():
                    if v.is_floating_point():
                        total[k] += weights[i] * v.double()
            arrived.append(i)
        if total is None:
            return True
        mean = {k: (v.to(glob[k].dtype) if glob[k].is_floating_point() else v) for k, v in total.items()}
        update = compress(mean, self.share(ctx))
        # stored only now: the broadcast of this round read the previous values
        ctx.server["global"] = apply_update(glob, decompress(update, glob))
        ctx.server["update"] = update
        ctx.server["holders"] = sorted(arrived)
        ctx.server["aggregated_round"] = ctx.round
        ctx.log(kept_energy=self.share(ctx))
        return True

    @hookimpl
    def on_round_end(self, ctx, round):
        if ctx.server["aggregated_round"] != round:  # nothing arrived: w^r and Delta^ stay, and
            participants = set(ctx.participants)  # this round's participants hold w^r, not w^r - Delta^
            ctx.server["holders"] = [i for i in ctx.server["holders"] if i not in participants]

    # -- client -------------------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        if "weights" in message:
            base = clone_state(message["weights"])
        else:
            base = apply_update(client.state["mentee"], decompress(message["update"], client.state["mentee"]))
        client.state["mentee"] = base  # w^r, the server's, for the next round's Delta^
        load_state(client.model, base)
        return True

    def mutual_pair(self, ctx, client) -> MutualPair:
        """The mentee in the working model (w^r loaded), the mentor and projections from the client's state."""
        mentor = ctx.models.working(client.arch, slot="fedkd_mentor")
        load_state(mentor, client.state.get("mentor") or ctx.models.initial_state(client.arch))
        d = linear_classifier(ctx.spec, client.arch, client.model).in_features
        device = next(client.model.parameters()).device
        projections = nn.ModuleDict({"W_T": identity_projection(d), "W_S": identity_projection(d)}).to(device)
        if "projections" in client.state:
            projections.load_state_dict(client.state["projections"])
        return MutualPair(mentor, client.model, projections)

    def mutual_update(self, ctx, client, epochs: int) -> dict:
        """(L3) + (L4) for ``epochs`` epochs; the mentor and projections kept in client.state."""
        pair = self.mutual_pair(ctx, client)
        W_T, W_S = pair.projections["W_T"], pair.projections["W_S"]

        def loss(model, x, y, mentor_logits):
            seen = model.seen
            task_T = client.objective(model.mentor, x, y, mentor_logits)
            task_S = client.objective(model.mentee, x, y, seen["mentee_logits"])
            mentor, mentee = fedkd_losses(task_T, task_S, mentor_logits, seen["mentee_logits"],
                                          seen["H_T"], seen["H_S"], W_T, W_S)
            return mentor + mentee

        before, steps_before = client.work.private, client.work.private_steps
        metrics = client.train(pair, epochs=epochs, optimizer=client.optimizer(params=pair.parameters()), loss_fn=loss)
        # the second model's passes and steps over the same batches
        client.count_work(private=client.work.private - before, private_steps=client.work.private_steps - steps_before)
        client.state["mentor"] = clone_state(pair.mentor)
        client.state["projections"] = clone_state(pair.projections)
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        return self.mutual_update(ctx, client, ctx.spec.training.local_epochs)

    @hookimpl
    def client_upload(self, ctx, client):
        base = client.state["mentee"]
        trained = client.model.state_dict()
        delta = {k: (trained[k] - base[k] if base[k].is_floating_point() else trained[k].clone()) for k in base}
        return {"update": compress(delta, self.share(ctx))}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # the mentor is evaluated: nothing from the server

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_state(client.model, client.state.get("mentor") or ctx.models.initial_state(client.arch))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        self.mutual_update(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return self.personalized_models(ctx, client, {})


__all__ = ["FedKD", "FedKDParams", "apply_update", "compress", "decompress", "distillation",
           "energy", "fedkd_losses", "identity_projection", "kept_rank"]
