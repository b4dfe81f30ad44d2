"""FedPCL: Tan, Long, Ma, Liu, Zhou and Jiang, "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach", NeurIPS 2022 (arXiv:2209.10083).

Only class prototypes travel. Each client learns a representation r(x) = normalize(f_i(x)), the
L2-normalised input of its model's classifier, with two prototype-wise contrastive losses, and
classifies a sample by the prototype nearest to its representation (the largest dot product).

    server: global prototypes G = {}, stored local prototypes {} (none before round 1)
    each round t, S_t = the round's participants:
        server -> client i: G and every stored client's local prototypes P_j, each P_j padded
                  with G^c for the classes c client j did not report                 (on_broadcast)
        client i: its own model (the seeded initial one before its first round)       (on_receive)
                  if G is empty (round 1): no training (the authors' loss is 0 without prototypes)
                  else training.local_epochs epochs minimising, per mini-batch,
                      L_g = CE(r(x) G^T / tau, y)                 global prototype contrast
                      L_p = mean_j CE(r(x) P_j^T / tau, y)        local prototype contrast
                      L   = L_g + L_p
                  over the samples whose class has a global prototype, the gradient's norm
                  clipped to clip_norm before each step                                (local_train)
                  P_i^c = mean of r(x) over its training samples of class c, eval mode;
                  uploads {c: P_i^c}                                                  (client_upload)
        server: stores P_i for every received upload (replacing i's earlier one);
                G^c = unweighted mean of the received P_i^c over the clients reporting c this
                round; a class nobody reported keeps its earlier G^c                (server_aggregate)
    evaluation: client i scores class c by r(x) . P_i^c with its own prototypes, recomputed from
    its current model on its training data (the ones it last uploaded); a class it holds no
    sample of is scored against G^c (``unseen_from_global``, PFLlib) or never predicted; a class
    with neither gets -1e9.

What was read: the paper's abstract and public summaries of it (lightweight framework: several
fixed pre-trained backbones, a small trainable projection network that fuses their features;
class prototypes shared instead of weights; a supervised contrastive loss against the global
prototypes and one against the clients' local prototypes; personalised inference). The full text
(its equations and Algorithm 1) could not be read from this machine, so the steps above are
labelled by hook, not by equation number. The details follow two implementations, read in full
(not copied): PFLlib (TsingZ0/PFLlib at d832e76, ``system/flcore/clients/clientpcl.py``,
``system/flcore/servers/serverpcl.py``) and the authors' code (yuetan031/FedPCL at 0c3895b,
``lib/update.py`` ``update_weights_lg`` and ``test_inference_twoway``, ``lib/losses.py``
``ConLoss``, ``lib/utils.py`` ``proto_aggregation``). FL-bench (KarhouTam/FL-bench) has no FedPCL.

The backbone. No pre-trained weights can be downloaded here, so, as PFLlib does (it replaces
the model's classifier by the identity and trains the whole network from scratch), the whole
model up to the classifier is trained from its seeded initial weights; the representation is
the classifier's input. The paper's frozen pre-trained backbones and separate projection network
are therefore not reproduced: what is evaluated is FedPCL's prototype-contrastive training and
nearest-prototype inference on a network trained from scratch. The classifier layer itself is
never used (no loss reaches it; it keeps its initial weights). A model with a single
parameterised layer has no representation apart from its input: refused.

Defaults and deviations:

- ``tau = 0.07``: the authors' code's fixed temperature (``ConLoss(temperature=0.07)``); PFLlib's
  ``--tau`` default is 1.0 (pass ``tau = 1.0`` to get it). On ``specs/fedpcl.toml`` (seeds 0-2)
  acc_mean was 0.971 at tau = 0.07 and 0.966 at tau = 1.0 (a difference within the seeds' spread).
- ``clip_norm = 10``: PFLlib clips the gradient norm at 10 "to prevent divergence"; the authors'
  code does not clip (``clip_norm`` none).
- Loss form: L_g + L_p with softmax over the class prototypes (PFLlib's form, and the paper's as
  summarised). The authors' ``ConLoss`` is a SupCon variant (each sample's class prototype as
  anchor, the batch's features of two augmented views as contrast set) summed over all clients'
  prototype sets, with no separate global term; pfl has no augmentation pipeline.
- Prototypes are indexed by class. PFLlib stacks prototype dictionaries in insertion order (the
  order the shuffled loader first met each class) and reads row y as class y's prototype, so its
  rows and labels disagree unless the order happens to be sorted; here row c is class c.
- L_p averages over the clients that have reported at least once (their latest prototypes),
  the client's own earlier upload among them, as in both implementations.
  PFLlib averages over all N clients, a never-reported client counting as a copy of G (which
  weights L_g more early on); the authors' code (full participation) sums over all clients.
- The global prototypes are the unweighted mean of this round's received local prototypes
  (PFLlib and the authors' ``proto_aggregation``), not sample-weighted as FedProto's.
- Samples whose class has no global prototype yet (partial participation, lost uploads) are left
  out of both losses; PFLlib assumes every class has one.
- Evaluation scores with the client's own prototypes (both implementations); PFLlib's padding
  of a client's missing classes with G^c happens through an aliasing of its stored dictionary,
  the authors' code never predicts them: ``unseen_from_global`` picks (default PFLlib's). The
  authors score by the MSE distance to the prototype, PFLlib (and here) by the dot product, the
  similarity the loss trains. A client that never trained is scored with the prototypes of its
  initial model (PFLlib reports accuracy 0 for it).
- Round 1 trains nobody (both implementations: no prototypes, no loss); the participants only
  compute and upload prototypes of their initial models.
- Lost uploads (``dropout`` add-on): the server neither stores nor averages a lost upload. The
  model is the client's own and keeps the round's training; nothing mirrors the server, so
  nothing is staged (docs/writing-a-plugin.md, "Client state and lost uploads").
- The loss is the method's whole loss (``client.train(loss_fn=...)``): a ``task_loss`` or
  ``local_objective`` add-on does not apply to it.
- Bytes: G and every stored client's local prototypes down (PFLlib sends the same set), one
  prototype per class held up.
- Cold start: a newcomer receives the final prototypes, trains ``experiment.coldstart_epochs``
  epochs from the initial weights with L_g + L_p, and is scored with its own prototypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    Plugin,
    SpecError,
    capture_embedding,
    classifier,
    clone_state,
    embeddings,
    finite,
    greater_than,
    hookimpl,
    load_state,
    model_key,
    probe_num_layers,
    spec_archs,
)

NO_PROTOTYPE = -1e9


@define
class FedPCLParams:
    tau: float = field(default=0.07, validator=[finite, greater_than(0)], metadata={
        "doc": "temperature of both prototype-contrastive losses (the authors' code: 0.07; PFLlib's default: 1.0)"})
    clip_norm: float | None = field(default=10.0, validator=[finite, greater_than(0)], metadata={
        "doc": "clip each step's gradient norm to this (PFLlib's 10); none: no clipping (the authors' code)"})
    unseen_from_global: bool = field(default=True, metadata={
        "doc": "at evaluation, score a class the client holds no sample of against its global prototype "
               "(PFLlib); false: never predict it (the authors' code)"})


def representations(model, x) -> torch.Tensor:
    """r(x) = the L2-normalised classifier input of every row of ``x``, eval mode, no gradient."""
    return F.normalize(embeddings(model, x), dim=1)


def class_prototypes(model, x, y) -> dict[int, torch.Tensor]:
    """{c: mean of r(x) over the samples of class c} (normalised first, then averaged)."""
    r = representations(model, x)
    return {int(c): r[y == c].mean(0) for c in y.unique().tolist()}


def prototype_table(prototypes: dict[int, torch.Tensor], classes: list[int],
                    fallback: dict[int, torch.Tensor]) -> torch.Tensor:
    """Row k: the prototype of classes[k], taken from ``fallback`` where ``prototypes`` lacks it."""
    return torch.stack([prototypes[c] if c in prototypes else fallback[c] for c in classes])


def contrastive_loss(r: torch.Tensor, y: torch.Tensor, global_protos: dict[int, torch.Tensor],
                     local_protos: list[dict[int, torch.Tensor]], tau: float) -> torch.Tensor:
    """L_g + L_p for the batch's normalised representations ``r``: CE over the classes that have
    a global prototype, of r . G^T / tau and (averaged over the clients) of r . P_j^T / tau."""
    classes = sorted(global_protos)
    index = {c: k for k, c in enumerate(classes)}
    known = [k for k, c in enumerate(y.tolist()) if c in index]
    if not known:  # no sample's class has a prototype: nothing to contrast
        return r.sum() * 0
    r = r[known]
    target = torch.tensor([index[int(y[k])] for k in known], device=r.device)
    global_table = prototype_table(global_protos, classes, global_protos)
    loss = F.cross_entropy(r @ global_table.T / tau, target)
    if local_protos:
        local_loss = sum(F.cross_entropy(r @ prototype_table(p, classes, global_protos).T / tau, target)
                         for p in local_protos)
        loss = loss + local_loss / len(local_protos)
    return loss


class NearestPrototype(nn.Module):
    """logits_c = r(x) . P^c over the prototypes ``table`` ({class: prototype}); -1e9 elsewhere."""

    def __init__(self, model, table: dict[int, torch.Tensor], num_classes: int):
        super().__init__()
        self.model, self.table, self.num_classes = model, table, num_classes

    def forward(self, x):
        store = {}
        with capture_embedding(self.model, store):
            self.model(x)
        r = F.normalize(store["emb"].flatten(1).float(), dim=1)
        out = torch.full((len(x), self.num_classes), NO_PROTOTYPE, dtype=r.dtype, device=r.device)
        if self.table:
            classes = sorted(self.table)
            similarity = r @ torch.stack([self.table[c] for c in classes]).T  # bfloat16 under bf16 autocast
            out[:, classes] = similarity.to(out.dtype)
        return out


class FedPCL(Plugin):
    """FedPCL (Tan et al. 2022): clients train their representation with prototype-wise
    contrastive losses against the global and the clients' local class prototypes; only
    prototypes travel; each client is scored by its nearest own prototype."""

    name = "fedpcl"
    Params = FedPCLParams

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        for arch in spec_archs(spec):
            if probe_num_layers(spec, arch) == 1:
                raise SpecError(model_key(spec), f"fedpcl contrasts the representation the classifier reads, and "
                                                 f"{arch} has a single layer (its representation is the input "
                                                 f"itself); use a model with a hidden layer")

    @hookimpl
    def setup(self, ctx):
        archs = sorted({ctx.models.arch_of(i) for i in range(ctx.num_clients)})
        widths = {arch: classifier(ctx.models.working(arch)).weight.shape[1] for arch in archs}
        if len(set(widths.values())) > 1:
            listed = ", ".join(f"{arch}: {w}" for arch, w in widths.items())
            raise SpecError(model_key(ctx.spec), f"fedpcl shares class prototypes, so every architecture's "
                                                 f"representation (its classifier's input) needs the same width; "
                                                 f"got {listed}")
        ctx.server["global"] = {}
        ctx.server["local"] = {}  # client id -> its latest received prototypes

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"global": ctx.server["global"],
                "local": [ctx.server["local"][j] for j in sorted(ctx.server["local"])]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        # ``uploads`` streams while later participants still train and read the broadcast:
        # the server's state changes only once every upload is in.
        received = {i: message["prototypes"] for i, message in uploads}
        reported: dict[int, list[torch.Tensor]] = {}
        for i in sorted(received):
            for c, p in received[i].items():
                reported.setdefault(c, []).append(p)
        merged = {**ctx.server["global"], **{c: torch.stack(ps).mean(0) for c, ps in reported.items()}}
        ctx.server["global"] = {c: merged[c] for c in sorted(merged)}
        ctx.server["local"] = {**ctx.server["local"], **received}
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"global": ctx.server["global"]}

    # -- client side ---------------------------------------------------------------------------

    def own_model(self, ctx, client):
        """The client's own model (the seeded initial one before it trained)."""
        return load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.own_model(ctx, client)
        client.scratch["prototypes"] = message
        return True

    def train(self, client, epochs=None) -> dict:
        """``epochs`` (default training.local_epochs) of L_g + L_p; none without global prototypes."""
        message = client.scratch["prototypes"]
        if not message["global"]:
            return {}
        store = {}

        def loss(model, x, y, logits):
            r = F.normalize(store["emb"].flatten(1), dim=1)
            return contrastive_loss(r, y, message["global"], message["local"], self.params.tau)

        client.scratch["clip"] = True
        try:
            with capture_embedding(client.model, store):
                return client.train(epochs=epochs, loss_fn=loss)
        finally:
            client.scratch["clip"] = False

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(client)
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def adjust_gradients(self, ctx, client, model, optimizer):
        if self.params.clip_norm is not None and client.scratch.get("clip") and model is client.model:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.params.clip_norm)

    @hookimpl
    def client_upload(self, ctx, client):
        return {"prototypes": class_prototypes(client.model, client.data.train_x, client.data.train_y)}

    def scored(self, ctx, client, model, global_protos):
        table = class_prototypes(model, client.data.train_x, client.data.train_y)
        if self.params.unseen_from_global:
            table = {**global_protos, **table}
        return {"": NearestPrototype(model, table, ctx.num_classes)}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return self.scored(ctx, client, self.own_model(ctx, client), message["global"])

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # the seeded initial weights, the final prototypes
        self.train(client, ctx.spec.experiment.coldstart_epochs)
        return self.scored(ctx, client, client.model, message["global"])


__all__ = ["FedPCL", "FedPCLParams", "NearestPrototype", "class_prototypes", "contrastive_loss"]
