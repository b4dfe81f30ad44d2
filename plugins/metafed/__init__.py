"""MetaFed: Chen, Lu, Qin, Wang and Xie, "MetaFed: Federated Learning among Federations with
Cyclic Knowledge Distillation for Personalized Healthcare", IEEE TNNLS 2023 (arXiv:2206.08516;
FL-IJCAI workshop 2022).

No central aggregation: the N federations (here the training clients) sit in a ring, and each
one's model learns from its predecessor's. Training is split into a warm-up, a common knowledge
accumulation stage and a personalization stage. f_i is client i's model, z_f(x) the input of f's
classifier (the features), V_i client i's validation split, acc(f, V_i) f's accuracy on it.

    (M0) ring: the training clients by id, i_0 < i_1 < ... < i_{N-1}; i_{k-1} precedes i_k, and
         i_{N-1} precedes i_0.
    (M1) warm-up (round 1, every training client):                  (select_clients, local_train)
         f_i <- warmup_epochs epochs of cross-entropy from theta^0 (the seeded initial weights);
         d_i = [acc(f_i, V_i) > distill_threshold]; i_{N-1} hands f_{i_{N-1}} on.
    (M2) common knowledge accumulation, one hop per round (rounds 2 .. R-1): hop h = round - 2
         trains the student s = i_{h mod N} with the teacher T = the model handed on last
         (normally its predecessor's, just trained by the previous hop):     (on_broadcast,
           d_s true:  f_s <- training.local_epochs epochs from f_s of          on_receive,
                      CE(f_s(x), y) + lam * MSE(z_{f_s}(x), z_T(x))            local_objective)
           d_s false: f_s <- T (copy: the student has not learned enough of its own data to
                      distill), then training.local_epochs epochs of CE
           no teacher (the first hop when i_{N-1}'s warm-up model was lost): plain CE from f_s;
         then d_s <- d_s or [acc(f_s, V_s) > distill_threshold]; s hands f_s on (client_upload,
         server_aggregate).
    (M3) personalization (round R, every training client): T = the model handed on last (after
         whole cycles, i_{N-1}'s: the one that has accumulated every federation's knowledge);
         a_S = acc(f_i, V_i), a_T = acc(T, V_i) (the teacher on the student's data):
           lam_i = 0                                   if a_T <= a_S and a_T < teacher_threshold
           lam_i = lam * 10^min(1, 5 (a_T - a_S)) / 10 otherwise;
         then (M2)'s step with lam_i: d_i true: distill with weight lam_i (lam_i = 0: plain CE);
         d_i false: copy T, then CE.
    evaluation: every client is scored with its own f_i (client state): the warm-up model after
    round 1, its latest accumulation model during (M2), its personalized model after round R.

How the ring maps onto pfl's rounds. The hops of a cycle depend on each other (s trains from the
model its predecessor trained a moment before), but pfl hands a round's participants to an
executor that may broadcast to a later participant before an earlier one's upload arrives
(docs/writing-a-plugin.md). A whole cycle in one round would need a new hook (a server-side
sequence of dependent client visits); one hop a round needs none. So a round is one hop:
``select_clients`` picks the round's student, ``on_broadcast`` sends it the teacher, and
``server_aggregate`` keeps the trained model to send to the next hop. A cycle takes N rounds:
R = 2 + cN rounds run c whole cycles, as the authors' ``iters`` = c + 1 (c cycles, then the
personalization) and FL-bench's c global epochs do, the warm-up counted apart by both. The
warm-up and the personalization need no ring order, so every training client takes part in them
at once. The server holds nothing but the model handed on last: it relays the ring's messages
and aggregates nothing. R = 2 runs the warm-up and a personalization from i_{N-1}'s warm-up
model; R = 1, the warm-up alone.

What was read. Of the paper, only its abstract and the opening of its introduction (ar5iv), which
give the two stages and the ring, not the equations: the step labels (M0)-(M3) are ours, and
every rule above follows the authors' own code, github:microsoft/PersonalizedFL at 441670e
(Jul 2023; ``alg/metafed.py``, ``util/traineval.py: trainwithteacher``, ``main.py``), checked
against FL-bench, github:KarhouTam/FL-bench at 06e658b (Oct 2025; ``src/server/metafed.py``,
``src/client/metafed.py``). PFLlib has no MetaFed. Read, not copied.

Decisions and deviations:

- The copy-or-distill rule of (M2) asks whether the *student's own* model is good on its data
  (d_s), as both implementations do; the teacher's accuracy on the student's data enters only in
  (M3), through lam_i. d_s never turns back to false once set (the authors' ``update_flag``);
  FL-bench recomputes it after every visit, so a client can go back to copying.
- Defaults are the authors': lam = 1, distill_threshold = 0.6, teacher_threshold = 0.5 (their
  ``thes`` for PAMAP2, MedMNIST and others; 0.4 for PACS and VLCS), warmup_epochs = 30 (FL-bench
  names them lamda, threshold_1, threshold_2, warmup_round).
- Features: the classifier's input (the last hidden layer after its activation), the authors'
  default feature plan (``plan = 1``); FL-bench takes it before the activation. A model without a
  hidden layer (``hidden = []``) has the input itself there: the distillation term is then 0.
- The copy takes every floating-point state entry (BatchNorm's statistics too, as the authors'
  default without ``--nosharebn``), not ``num_batches_tracked``.
- The first hop's teacher is i_{N-1}'s warm-up model (FL-bench); the authors' first step of their
  first cycle has no teacher. Both rings are otherwise the same.
- FL-bench's accumulation distills from a teacher module it never loads (the client's initial
  weights: ``self.teacher`` is only loaded in ``personalize``), and its personalization takes
  each client's predecessor as teacher; here, as in the authors' code, the teacher is the model
  handed on, and the personalization teacher is the last one for every client.
- Validation: pfl's validation split of each client (``partition.val_fraction``, which must be
  > 0); FL-bench carves 20% off the training split. A client whose split is empty scores 0 there.
  Reported accuracy is the test split's at every evaluation; the authors report each client's
  test accuracy at its best validation round.
- Rounds and participation: ``experiment.participation`` must be 1 (the ring selects its own
  participants, as FL-bench forces ``join_ratio = 1``). The authors run every cycle's hops in one
  of their rounds; here one hop is a round (above), so their 300 rounds of 20 clients are
  R = 2 + 299 * 20 here.
- Budget: a training client trains warmup_epochs + training.local_epochs (1 + (R - 2) / N)
  epochs on average over R rounds (R >= 2); ``local_work`` declares that total, spread evenly over
  the rounds. The teacher's forward passes and the validation scoring are not counted as work.
- Bytes: the teacher down (a model per hop, and one to every client for the personalization),
  the student's model up (to the relay); in a real ring a hop is one transfer, here two.
- Lost uploads (``dropout``): the relay keeps the model it received last, so the next hop learns
  from an older teacher. The student keeps its trained model and d_s: both are its own, and the
  server holds nothing derived from them, so nothing is staged.
- Cold start: a newcomer copies the model handed on last (the (M2) rule for a client without a
  good model of its own) and trains ``experiment.coldstart_epochs`` epochs of CE on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    Plugin,
    SpecError,
    at_least,
    between,
    capture_embedding,
    clone_state,
    finite,
    hookimpl,
    load_personal,
    load_state,
    require_single_architecture,
    score,
)

TEACHER = "metafed_teacher"  # the working-module slot the teacher is loaded into
WARMUP, HOP, PERSONALIZE = "warmup", "hop", "personalize"


@define
class MetaFedParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the feature distillation MSE(z_student, z_teacher) in (M2), and the base of "
               "(M3)'s lam_i (the authors' 1.0)"})
    distill_threshold: float = field(default=0.6, validator=between(0, 1), metadata={
        "doc": "a client distills from its teacher once its own validation accuracy exceeded this; "
               "until then it copies the teacher (M1, M2; the authors' threshold 0.6)"})
    teacher_threshold: float = field(default=0.5, validator=between(0, 1), metadata={
        "doc": "(M3): no distillation when the teacher is no better than the client's model on the client's "
               "validation split and below this accuracy (the authors' 0.5)"})
    warmup_epochs: int = field(default=30, validator=at_least(1), metadata={
        "doc": "epochs each client trains alone in round 1 (M1; the authors' 30)"})


def personalization_weight(lam: float, teacher_acc: float, student_acc: float, teacher_threshold: float) -> float:
    """(M3): lam_i from the teacher's and the student's accuracy on the student's validation split."""
    if teacher_acc <= student_acc and teacher_acc < teacher_threshold:
        return 0.0
    return lam * 10 ** min(1.0, (teacher_acc - student_acc) * 5) / 10


def val_accuracy(ctx, client, model) -> float:
    """acc(model, V_i); 0 on an empty validation split."""
    if len(client.data.val_y) == 0:
        return 0.0
    return score(model, client.data.val_x, client.data.val_y, ctx.spec.evaluation.batch_size).accuracy


def teacher_features(teacher, x) -> torch.Tensor:
    store = {}
    with torch.no_grad(), capture_embedding(teacher, store):
        teacher(x)
    return store["emb"].flatten(1)


class MetaFed(Plugin):
    """MetaFed (Chen et al. 2023): a ring of clients, each distilling its predecessor's features
    into its own model (or copying the predecessor while its own is weak), one hop per round after
    a warm-up, then a personalization from the last model handed on (see the module doc)."""

    name = "metafed"
    Params = MetaFedParams

    # -- the schedule (the same on both sides: it follows from the round and the spec) -----------

    @staticmethod
    def stage(ctx) -> str:
        if ctx.round == 1:
            return WARMUP
        return PERSONALIZE if ctx.round == ctx.spec.experiment.rounds else HOP

    @staticmethod
    def ring(ctx) -> list[int]:
        return sorted(ctx.training_clients)

    def local_work(self, spec) -> LocalWork:
        rounds, epochs = spec.experiment.rounds, spec.training.local_epochs
        clients = max(spec.partition.num_clients - spec.experiment.coldstart_clients, 1)
        hops = max(rounds - 2, 0)
        later = epochs * (hops / clients + (1 if rounds >= 2 else 0))  # a mean client's hops + personalization
        return LocalWork(later / rounds, pretrain_private_epochs=float(self.params.warmup_epochs))

    # -- server side -----------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)  # a copied or distilled teacher has the student's shape
        if spec.experiment.participation != 1:
            raise SpecError("experiment.participation", f"metafed picks its own participants (every client in "
                            f"the warm-up and personalization rounds, the next client of the ring in between); "
                            f"set it to 1, got {spec.experiment.participation}")
        if spec.partition.val_fraction == 0:
            raise SpecError("partition.val_fraction", "is 0, but metafed chooses between copying and distilling "
                            "by each client's accuracy on its validation split; give it a validation share > 0")

    @hookimpl
    def setup(self, ctx):
        with torch.random.fork_rng(devices=[]):  # build the teacher's module now, drawing nothing later
            ctx.models.working(ctx.models.arch_of(0), slot=TEACHER).requires_grad_(False)

    @hookimpl
    def select_clients(self, ctx, round):
        ring = self.ring(ctx)
        if round == 1 or round == ctx.spec.experiment.rounds:
            return ring
        return [ring[(round - 2) % len(ring)]]

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        handed_on = ctx.server.get("handed_on")
        warmup = self.stage(ctx) == WARMUP and client_id not in ctx.coldstart_clients
        return {} if warmup or handed_on is None else {"teacher": handed_on}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        for client_id, message in uploads:
            if "weights" in message:  # a hop's student (or i_{N-1} in the warm-up) hands its model on
                ctx.server["handed_on"] = clone_state(message["weights"])
                ctx.server["handed_on_by"] = client_id
        return True

    # -- client side -----------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        teacher = message.get("teacher")
        if client.id in ctx.coldstart_clients:  # a newcomer copies the model handed on last
            load_state(client.model, teacher or ctx.models.initial_state(client.arch))
            return True
        load_personal(ctx, client)  # f_i (theta^0 before the warm-up)
        if teacher is None:
            return True
        distills = client.state.get("distills", False)
        lam = self.params.lam
        if self.stage(ctx) == PERSONALIZE and distills:
            module = self.teacher_module(ctx, client, teacher)
            lam = personalization_weight(lam, val_accuracy(ctx, client, module),
                                         val_accuracy(ctx, client, client.model), self.params.teacher_threshold)
            client.log(metafed_lam=lam)
        if not distills:  # copy the teacher (its num_batches_tracked stays the student's)
            load_state(client.model, {k: v for k, v in teacher.items() if v.is_floating_point()})
        elif lam > 0:
            client.scratch["teacher"] = self.teacher_module(ctx, client, teacher)
            client.scratch["lam"] = lam
        client.log(metafed_distills=float(distills))
        return True

    def teacher_module(self, ctx, client, teacher):
        return load_state(ctx.models.working(client.arch, slot=TEACHER), teacher).eval()

    @hookimpl
    def local_train(self, ctx, client):
        stage = self.stage(ctx)
        epochs = self.params.warmup_epochs if stage == WARMUP else None
        store = client.scratch.setdefault("student_features", {})
        with capture_embedding(client.model, store):  # z_{f_s}(x) of every batch, for local_objective
            metrics = client.train(epochs=epochs)
        client.state["weights"] = clone_state(client.model)
        if stage != PERSONALIZE:  # (M1), (M2): d_i, once true, stays true
            good = val_accuracy(ctx, client, client.model) > self.params.distill_threshold
            client.state["distills"] = client.state.get("distills", False) or good
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lam * MSE(z_student(x), z_teacher(x)) (M2, M3); the core adds the cross-entropy."""
        teacher = client.scratch.get("teacher")
        if teacher is None or model is not client.model:
            return None
        student = client.scratch["student_features"]["emb"].flatten(1)
        return client.scratch["lam"] * F.mse_loss(student, teacher_features(teacher, x).to(student.dtype))

    @hookimpl
    def client_upload(self, ctx, client):
        stage = self.stage(ctx)
        if stage == HOP or (stage == WARMUP and client.id == self.ring(ctx)[-1]):
            return {"weights": client.model.state_dict()}
        return {}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": load_personal(ctx, client)}


__all__ = ["MetaFed", "MetaFedParams", "personalization_weight", "teacher_features", "val_accuracy"]
