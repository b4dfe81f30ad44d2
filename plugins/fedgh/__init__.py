"""FedGH: Yi, Wang, Liu, Shi and Yu, "FedGH: Heterogeneous Federated Learning with Generalized
Global Header", ACM MM 2023 (arXiv:2303.13137).

Each client's model is its own feature extractor (possibly of its own architecture) followed by
a prediction header of one shape shared by all. Only the header and class-averaged
representations travel: the server trains one global header on the clients' per-class mean
representations and sends it back to replace each client's header.

    server: the global header theta^0 = the initial model's classifier
    each round t, S_t = the round's participants:
        client i: its own extractor (the initial one before its first round) with the global
                  header theta^{t-1} in place of its own header                (on_receive)
                  training.local_epochs epochs of cross-entropy on the whole model
                  (extractor and header)                                        (local_train)
                  for every class c it holds: R_i^c = mean of the extractor's output (the
                  classifier's input, eval mode) over its training samples of class c,
                  with the trained extractor; uploads {c: R_i^c}                (client_upload)
        server: theta^t <- server_epochs epochs of mini-batch SGD (server_lr, batch
                  server_batch_size, shuffled) on cross-entropy(header(R_i^c), c) over every
                  received pair (R_i^c, c), one sample per client and class    (server_aggregate)
    evaluation: client i is scored with its own extractor and the current global header
    theta^t (the model it holds after the server's next send), without local steps.

What was read: the paper's abstract and a summary of it (a personalised, heterogeneous feature
extractor kept local; a homogeneous prediction header shared; clients send class-averaged
representations, "local averaged representations", instead of weights; the server trains the
header on them, and it substitutes each client's local header). The full text (its equations
and algorithm listing) could not be read from this machine, so the steps above are labelled by
hook, not by equation; every detail follows PFLlib, read in full (not copied):
``system/flcore/servers/servergh.py`` and ``system/flcore/clients/clientgh.py`` of
TsingZ0/PFLlib at d832e76 (Nov 2025). FL-bench (KarhouTam/FL-bench at 06e658b) has no FedGH.

Defaults (PFLlib's): ``server_lr = 1.0`` (its ``--server_learning_rate``, shared with SCAFFOLD),
plain SGD, one epoch over the received pairs (``server_epochs = 1``) in mini-batches of the
clients' batch size (``server_batch_size`` none = training.batch_size), shuffled. On
``specs/fedgh.toml`` (seed 0) server_lr = 1.0, 0.05 and 0.005 scored 0.964, 0.964 and 0.963.

Decisions and deviations:

- The header is the model's last parameterised layer (pfl's classifier); the representation is
  that layer's input, flattened (PFLlib's ``model.base`` / ``model.head`` split of the same
  models). Clients may use different architectures (``model.pool`` / ``model.clients``, FedGH's
  model-heterogeneous setting) as long as every architecture's classifier has the same shapes;
  otherwise the run is refused at the model key.
- PFLlib's server header is client 0's own header module (``self.head = self.clients[0].model.head``),
  so client 0's local training moves the global header before the server trains it, every round
  client 0 trains. Here the server header starts each round from its own previous value.
- PFLlib sends the header to every client every round; here only the participants receive it
  (its bytes counted), and every client is evaluated with the current header, which is what a
  PFLlib client holds when PFLlib evaluates (after its send, before training).
- Shuffling the server's pairs uses the run's seeded server generator ("fedgh:header", per
  round), so runs repeat; the order of the pairs is the participants' order, classes ascending.
- Lost uploads (``dropout`` add-on): the server trains on the pairs that arrived (none: the
  header stays). The extractor is the client's own and keeps the round's training; nothing
  mirrors the server, so nothing is staged (docs/writing-a-plugin.md, "Client state and lost
  uploads").
- Bytes: the header down, one representation per class held up.
- Cold start: a newcomer receives the final header, starts from the initial extractor and trains
  ``experiment.coldstart_epochs`` epochs (the core default).
"""

from __future__ import annotations

import copy

import torch
from attrs import define, field

from pfl_core.api import (
    Plugin,
    SpecError,
    at_least,
    classifier,
    clone_state,
    cross_entropy_loss,
    hookimpl,
    learning_rate,
    load_state,
    local_prototypes,
    model_key,
    run_epochs,
)


@define
class FedGHParams:
    server_lr: float = field(default=1.0, validator=learning_rate, metadata={
        "doc": "learning rate of the server's SGD on the global header (PFLlib's --server_learning_rate)"})
    server_epochs: int = field(default=1, validator=at_least(1), metadata={
        "doc": "passes over the round's (representation, class) pairs (PFLlib's one)"})
    server_batch_size: int | None = field(default=None, validator=at_least(1), metadata={
        "doc": "mini-batch of the server's header training; none: training.batch_size (PFLlib's)"})


def header_state(model) -> dict[str, torch.Tensor]:
    """The classifier's own state, keyed by its own names ("weight", "bias")."""
    return {k: t.detach().clone() for k, t in classifier(model).state_dict().items()}


class FedGH(Plugin):
    """FedGH (Yi et al. 2023): clients keep their own feature extractors and upload per-class mean
    representations; the server trains one global header on them and sends it back to replace
    each client's header. Each client is scored with its extractor and the global header."""

    name = "fedgh"
    Params = FedGHParams

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        archs = sorted({ctx.models.arch_of(i) for i in range(ctx.num_clients)})
        shapes = {arch: {k: tuple(t.shape) for k, t in header_state(ctx.models.working(arch)).items()}
                  for arch in archs}
        if len({tuple(sorted(s.items())) for s in shapes.values()}) > 1:
            listed = "; ".join(f"{arch}: {s}" for arch, s in shapes.items())
            raise SpecError(model_key(ctx.spec), f"fedgh shares one prediction header, so every architecture's "
                                                 f"classifier needs the same shapes; got {listed}")
        ctx.server["header"] = {k: t.to(ctx.device) for k, t in
                                header_state(fresh_initial(ctx, archs[0])).items()}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"header": ctx.server["header"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        representations, labels = [], []
        for _, message in uploads:
            for c in sorted(message["representations"]):
                representations.append(message["representations"][c])
                labels.append(c)
        if representations:  # nobody's upload arrived: the header stays
            ctx.server["header"] = self.train_header(ctx, torch.stack(representations).to(ctx.device),
                                                     torch.tensor(labels, device=ctx.device))
        return True

    def train_header(self, ctx, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """``server_epochs`` of mini-batch SGD on cross-entropy(header(x), y) from the current header."""
        p = self.params
        header = copy.deepcopy(classifier(ctx.models.working(ctx.models.arch_of(0)))).to(ctx.device)
        header.load_state_dict(ctx.server["header"])
        optimizer = torch.optim.SGD(header.parameters(), lr=p.server_lr)
        batch = p.server_batch_size or ctx.spec.training.batch_size
        generator = ctx.generator("fedgh:header")
        with torch.enable_grad():
            run_epochs(header, optimizer, x, y, epochs=p.server_epochs, batch_size=batch,
                       loss_fn=cross_entropy_loss, generator=generator)
        return {k: t.detach().clone() for k, t in header.state_dict().items()}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"header": ctx.server["header"]}

    # -- client side ---------------------------------------------------------------------------

    def with_header(self, ctx, client, header):
        """The client's own model (initial before it trained) with ``header`` as its classifier."""
        load_state(client.model, client.state.get("weights") or ctx.models.initial_state(client.arch))
        classifier(client.model).load_state_dict(header)
        return client.model

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.with_header(ctx, client, message["header"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["weights"] = clone_state(client.model)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        representations, _ = local_prototypes(client.model, client.data.train_x, client.data.train_y,
                                              ctx.num_classes)
        return {"representations": representations}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        return {"": self.with_header(ctx, client, message["header"])}


def fresh_initial(ctx, arch):
    """A module holding the initial state of ``arch`` (not the shared working one)."""
    model = copy.deepcopy(ctx.models.working(arch))
    load_state(model, ctx.models.initial_state(arch))
    return model


__all__ = ["FedGH", "FedGHParams", "header_state"]
