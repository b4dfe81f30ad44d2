"""PFL-DA: "Personalized Federated Learning via Domain Adaptation with an
Application to Distributed 3D Printing", Technometrics 2023 (its abstract:
par.nsf.gov/biblio/10404518).

What was read: the paper's abstract only (the article is paywalled and no preprint could be read
from this machine), so the step labels (P1)-(P4) below are ours and every detail follows the
reference implementation, read in full (not copied): PFLlib (github.com/TsingZ0/PFLlib at
d832e76f6a23b833038949ec1e4fdefe63a4d350, ``system/flcore/clients/clientda.py``,
``system/flcore/servers/serverda.py``, ``system/main.py``'s ``PFL-DA`` entry and ``--lamda``).
FL-bench has no PFL-DA.

The model is a body b (everything before the head) and a head (the last ``head_layers``
parameterised layers, default 1: the classifier). The server keeps only a global head g; each
client i keeps its whole model, a personal body b_i and a personal head h_i (both the seeded
initial weights before its first round). The global head is the shared "source" model and the
personal head the client's "target" model adapted towards it. Each round:

    server: sends g to the participants                                        (on_broadcast)
    client i, given g:                                                           (local_train)
      (P1) personal head: training.local_epochs epochs of the configured optimiser on h_i,
           b_i frozen, minimising CE(h_i(b_i(x)), y) + lam * ||h_i - g||_2 (the plain, unsquared
           Euclidean norm of all head parameters together; g fixed)            (local_objective)
      (P2) body and global head: training.local_epochs epochs on (b_i, g) jointly, h_i frozen
           (not used), minimising CE(g(b_i(x)), y); gives b_i' and g_i'
      keeps b_i' and h_i' (from P1); uploads g_i'                              (client_upload)
    server: (P3) g <- sum_{i arrived} n_i / n g_i' (training samples, renormalised over the
           arrivals: the core client weighting; PFLlib weights by training samples too)
                                                                           (server_aggregate)
    (P4) evaluation: client i's personal model b_i' + h_i' as it left its last round (the
         seeded initial model before it first trains), as PFLlib tests ``self.model``; nothing
         from the server                                  (evaluation_message, personalized_models)

(P2) never uses h_i, so the global head and every body follow the same trajectory whatever
``lam``: the pull moves only the personal heads, hence only the evaluated models.

Decisions and deviations:

- **The regulariser of (P1) has a gradient here.** PFLlib builds ||g - h_i||_2 from ``.data``
  of both heads, so the term carries no gradient and PFLlib's personal head trains on plain
  cross-entropy whatever ``--lamda`` is. The pull of h_i towards the global head is the point of
  the domain adaptation (the abstract: each device borrows strength from the others while it
  keeps its own model), so here it is differentiated; ``lam = 0`` is PFLlib's effective
  behaviour. At h_i = g (round 1: both are the initial head) the norm's gradient is 0 (torch's
  subgradient of the norm at 0).
- The default ``lam = 1.0`` is PFLlib's ``--lamda`` default (which is inert there); the paper's
  values could not be read.
- One optimiser for (P2) over the body and the global head (PFLlib: two plain SGD optimisers
  with the same learning rate, the same thing for plain SGD); the configured optimiser and
  learning rate for both phases, fresh each phase. PFLlib's learning-rate decay is not
  followed (the core's ``training`` settings apply).
- Everything except the global head stays on the client, BatchNorm statistics included: the
  body is never sent (PFLlib's server holds only the head). A head's buffers (``head_layers``
  covering a BatchNorm) travel and are averaged with it.
- Lost uploads (``dropout`` add-on): the client keeps b_i' and h_i' (its own, never added up by
  the server) and the server keeps g; nothing is staged (docs/writing-a-plugin.md, "Client state
  and lost uploads").
- Cold start (held-out clients): the newcomer receives the final g and runs (P1) and (P2) for
  ``experiment.coldstart_epochs`` epochs each from the seeded initial model; its b + h_i is
  scored (PFLlib instead fine-tunes the newcomer's whole model on cross-entropy).
- The training loss reported (``train_loss_mean``) is (P2)'s: the body under the global head.
- Only one architecture (the head is averaged).
- Budget (``local_work``): 2 x training.local_epochs private epochs a round. Bytes: the head down
  and up.
"""

from __future__ import annotations

import torch
from attrs import define, field

from pfl_core.api import (
    LocalWork,
    Plugin,
    SpecError,
    at_least,
    clone_keys,
    finite,
    hookimpl,
    layer_keys,
    load_state,
    only_training,
    per_run,
    probe_num_layers,
    require_single_architecture,
    resolve_split,
    spec_archs,
    weighted_average,
)


@define
class PFLDAParams:
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "weight of the pull ||h_i - g||_2 of the personal head towards the global head (P1); 0: no "
               "pull (PFLlib's effective behaviour: its term has no gradient). Default: PFLlib's --lamda"})
    head_layers: int = field(default=1, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the head (global and personal); "
               "the rest is the personal body (1: the classifier, PFLlib's head)"})


def head_distance(model: torch.nn.Module, anchor: dict[str, torch.Tensor], keys) -> torch.Tensor:
    """||h - g||_2 over the model's head parameters ``keys`` together (g = ``anchor``, a constant)."""
    keys = set(keys)
    gaps = [(p - anchor[name].to(p.device).detach()).flatten()
            for name, p in model.named_parameters() if name in keys]
    return torch.linalg.vector_norm(torch.cat(gaps))


class PFLDA(Plugin):
    """PFL-DA (Technometrics 2023, as PFLlib runs it): a shared global head trained on each client's
    personal body; each client's personal head is trained on its body and pulled towards the global
    head; the personal model (body + personal head) is evaluated (see the module doc)."""

    name = "pflda"
    Params = PFLDAParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(2 * spec.training.local_epochs))

    def base_layers(self, num_layers: int) -> int:
        """How many of the model's layers form the body; a split leaving no body is refused at its key."""
        try:
            return resolve_split(num_layers, self.params.head_layers)
        except ValueError as exc:
            raise SpecError(f"{self.spec_path}.params.head_layers", str(exc)) from None

    def split(self, ctx) -> tuple[list[str], list[str]]:
        """(body keys, head keys) of the run's one architecture in state-dict order, once per run;
        a ``head_layers`` that leaves no body is refused at its key."""
        def compute():
            model = ctx.models.working(ctx.models.arch_of(0))
            layers = layer_keys(model)
            head = {key for layer in layers[self.base_layers(len(layers)):] for key in layer}
            keys = list(model.state_dict())
            return [key for key in keys if key not in head], [key for key in keys if key in head]
        return per_run(ctx, self, "body_head", compute)

    def head_params(self, ctx, client) -> list[str]:
        head = set(self.split(ctx)[1])
        return [n for n, _ in client.model.named_parameters() if n in head]

    # -- server side -------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)
        num_layers = probe_num_layers(spec, spec_archs(spec)[0])  # before any data is loaded
        if num_layers is not None:
            self.base_layers(num_layers)

    @hookimpl
    def setup(self, ctx):
        _, head = self.split(ctx)  # a head_layers the model cannot take fails here
        initial = ctx.models.initial_state(ctx.models.arch_of(0))
        ctx.server["head"] = {k: initial[k].clone() for k in head}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"head": ctx.server["head"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        averaged = weighted_average((weights[i], message["head"]) for i, message in uploads)
        if averaged is not None:  # nobody's upload arrived: g stays
            ctx.server["head"] = averaged
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {}  # the personal model is evaluated: nothing from the server

    # -- client side -------------------------------------------------------------------------

    def load_personal(self, ctx, client):
        """(b_i, h_i) into the working model: the seeded initial model before i first trains."""
        return load_state(client.model, client.state.get("personal") or ctx.models.initial_state(client.arch))

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_personal(ctx, client)
        client.scratch["global_head"] = message["head"]
        return True

    def adapt(self, ctx, client, epochs: int) -> tuple[dict, dict]:
        """(P1) then (P2) for ``epochs`` epochs each, from (b_i, h_i) in the working model and g in
        the scratch. Leaves (b_i', g_i') in the working model; returns (P2's metrics, (b_i', h_i'))."""
        model, scratch = client.model, client.scratch
        body, head = self.split(ctx)
        trainable_head = self.head_params(ctx, client)
        scratch["anchor"] = scratch["global_head"]  # switches the pull of (P1) on (local_objective)
        try:
            with only_training(model, set(trainable_head)) as params:
                client.train(epochs=epochs, optimizer=client.optimizer(params=params))
        finally:
            del scratch["anchor"]
        personal_head = clone_keys(model, head)
        load_state(model, scratch["global_head"])  # (P2) trains the body under the global head
        metrics = client.train(epochs=epochs, optimizer=client.optimizer(params=list(model.parameters())))
        return metrics, {**clone_keys(model, body), **personal_head}

    @hookimpl
    def local_train(self, ctx, client):
        metrics, personal = self.adapt(ctx, client, ctx.spec.training.local_epochs)
        client.state["personal"] = personal
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lam ||h_i - g||_2 during (P1) only (None otherwise: no term)."""
        anchor = client.scratch.get("anchor")
        if anchor is None or self.params.lam == 0:
            return None
        return self.params.lam * head_distance(model, anchor, self.head_params(ctx, client))

    @hookimpl
    def client_upload(self, ctx, client):
        return {"head": clone_keys(client.model, self.split(ctx)[1])}  # g_i'

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.load_personal(ctx, client)}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        _, personal = self.adapt(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return {"": load_state(client.model, personal)}


__all__ = ["PFLDA", "PFLDAParams", "head_distance"]
