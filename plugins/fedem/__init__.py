"""FedEM: Marfoq, Neglia, Bellet, Kameni and Vidal, "Federated Multi-Task Learning under a
Mixture of Distributions", NeurIPS 2021 (arXiv:2108.10252), the client-server algorithm
(Algorithm 1, "FedEM").

Every client's data is modelled as a mixture of M underlying distributions shared by all
clients, each with its own predictor (a *component* h_theta_m, the client's architecture); a
client t differs from the others only in its mixture weights pi_t (on the simplex). The server
holds the M components; each client holds its pi_t. Per round, as run here (the step names are
the paper's; the labels (E), (M-pi), (M-theta), (A) and (P) are this docstring's):

    server: theta_1 .. theta_M = M independently seeded initialisations             (setup)
            every client's pi_t = 1/M
    each round k, each participant t, given theta_1^{k-1} .. theta_M^{k-1}:          (on_broadcast, on_receive)
        (E)       q_t(z_i = m) = pi_tm^{k-1} exp(-l(h_theta_m^{k-1}(x_i), y_i))
                                 / sum_m' pi_tm'^{k-1} exp(-l(h_theta_m'^{k-1}(x_i), y_i))
                  for every training sample i (l: the cross-entropy)                (local_train)
        (M-pi)    pi_tm^k = 1/n_t sum_i q_t(z_i = m)                                 (local_train)
        (M-theta) theta_m,t^k = LocalSolver: training.local_epochs epochs of the configured
                  optimiser from theta_m^{k-1} on the q-weighted loss
                  1/|B| sum_{i in B} q_t(z_i = m) l(h_theta_m(x_i), y_i), for every m (local_train)
        upload theta_1,t^k .. theta_M,t^k                                            (client_upload)
    (A)   theta_m^k = sum_t n_t / n theta_m,t^k for every m, over the participants   (server_aggregate)
    (P)   client t predicts with the mixture of the components' probabilities
              p_t(y | x) = sum_m pi_tm softmax(h_theta_m(x))_y                       (personalized_models)

Where this was read: the paper's abstract and algorithm as summarised above could not be
checked against the paper's full text from this machine (only its abstract was reachable), so
no equation numbers are cited; (E), (M-pi), (M-theta), (A) and (P) follow the authors' code
(github.com/omarfoq/FedEM: ``client.py`` MixtureClient.update_sample_weights and
update_learners_weights, ``learners/learner.py`` fit_epoch's weighted loss,
``learners/learners_ensemble.py`` evaluate_iterator, ``aggregator.py`` CentralizedAggregator),
and FL-bench's ``src/client/fedem.py`` / ``src/server/fedem.py`` (read, not copied). PFLlib has no
FedEM.

What is evaluated: client t is scored with (P) on the current global components and the pi_t
it holds (its last delivered M-step; 1/M before it first takes part). The evaluated module
outputs log p_t(y | x), so the accuracy is the mixture's argmax and the logged loss its negative
log-likelihood, as the authors' ``evaluate_iterator`` computes them.

Defaults and decisions:

- ``M = 3``: the authors' default number of components (``--n_learners``), also FL-bench's.
  ``M = 1`` is FedAvg: q = pi = 1 and (M-theta) is the plain cross-entropy, so the global
  weights are FedAvg's bit for bit (tested) and the evaluated mixture is the global model's
  softmax (same accuracy; the loss equal up to rounding).
- Initial components: component 1 is the run's seeded initial weights (FedAvg's), component m
  > 1 the same architecture built under the seed ``seed_for("fedem_init:m")``. The components
  must start apart: M identical components get identical q and stay identical forever (the
  authors build each learner with its own random draw).
- (E) is computed on the client's whole training split with the received components in eval
  mode (BatchNorm's running statistics, no dropout), as the authors' ``gather_losses`` on their
  un-shuffled copy of the training set does. Those forward passes are not counted as training
  work.
- (M-theta): the M components train together, one mini-batch loop whose step loss is the sum of
  the M q-weighted losses; the components share no parameter, so each one's step is exactly its
  own LocalSolver step on that batch (momentum and weight decay per parameter as configured).
  The authors run one loop per component, each with its own shuffle; FL-bench, like this, one
  loop for all. The optimiser is fresh every round (pfl's rule for every method); the authors
  keep each learner's optimiser across rounds (plain SGD by default, so no state to keep). The
  loop is ``client.train`` with ``loss_fn``: the q-weighted loss is the whole loss, so add-ons'
  ``local_objective`` / ``task_loss`` terms do not apply to it (as for FedRoD's loss);
  ``adjust_gradients`` add-ons see the M components as one module.
- (A) is FedAvg's n_t-weighted mean over the round's participants, component by component. The
  authors' aggregator averages over all clients with weights n_t / n, the clients not sampled
  contributing the previous global components (the same under full participation); FL-bench
  averages the participants as here.
- (P) mixes probabilities, as the paper and the authors' code. FL-bench mixes the components'
  logits (sum_m pi_m h_theta_m(x)), a different predictor.
- Lost uploads: pi_t advances only with a delivered upload (``client.staged``): in FL-bench the
  client's weights travel with its upload and the server keeps them, so a client whose upload
  is lost is where a client that did not take part is (its previous pi_t, the server's
  components without its update). The responsibilities q are recomputed every round and never
  kept.
- A component whose weight underflows to 0 for a client stays at 0 for that client (log 0 in
  (E)), as in the authors' code.
- Budget (``local_work``): M x training.local_epochs private epochs per round (each sample goes
  through M forward/backward passes an epoch); optimiser steps count M per mini-batch.
- Bytes: M models down and M models up per participant; pi_t never leaves the client.
- Logged per client: ``pi_max`` (the weight of the client's heaviest component after (M-pi)).
- Cold start: the newcomer receives the final components, starts from pi = 1/M and runs
  ``experiment.coldstart_epochs`` EM iterations ((E) then (M-pi)) with the components fixed,
  the paper's way of serving a client unseen at training time (the authors' test clients take
  one such step per evaluation); it is scored with (P).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    LocalWork,
    Plugin,
    at_least,
    clone_state,
    hookimpl,
    load_state,
    require_single_architecture,
    weighted_average,
)


@define
class FedEMParams:
    M: int = field(default=3, validator=at_least(1), metadata={
        "doc": "number of mixture components (shared models); the authors' default; 1 is FedAvg"})


# -- the paper's steps, as plain functions -------------------------------------------------------


def e_step(pi: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """(E): q[i, m] proportional to pi[m] exp(-losses[i, m]), normalised over m (a softmax of
    log pi - loss, which stays finite where exp(-loss) underflows)."""
    return torch.softmax(torch.log(pi)[None, :] - losses, dim=1)


def m_step(q: torch.Tensor) -> torch.Tensor:
    """(M-pi): pi[m] = the mean of q[:, m] over the client's samples."""
    return q.mean(dim=0)


def weighted_loss(logits: torch.Tensor, y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(M-theta) for every component at once: sum_m 1/|B| sum_i q[i, m] l(logits[i, m], y[i]);
    ``logits`` is [batch, M, classes], ``q`` [batch, M]."""
    total = sum((F.cross_entropy(logits[:, m], y, reduction="none") * q[:, m]).sum() for m in range(q.shape[1]))
    return total / len(y)


@torch.no_grad()
def component_losses(components: list[nn.Module], x: torch.Tensor, y: torch.Tensor, batch_size: int) -> torch.Tensor:
    """l(h_theta_m(x_i), y_i) for every sample i and component m, [n, M], in eval mode."""
    columns = []
    for component in components:
        was_training = component.training
        component.eval()
        column = [F.cross_entropy(component(x[s : s + batch_size]), y[s : s + batch_size], reduction="none")
                  for s in range(0, len(y), batch_size)]
        component.train(was_training)
        columns.append(torch.cat(column) if column else torch.zeros(0, device=y.device))
    return torch.stack(columns, dim=1)


class Stacked(nn.Module):
    """The M components side by side: one module for the training loop, logits [batch, M, classes]."""

    def __init__(self, components: list[nn.Module]):
        super().__init__()
        self.components = nn.ModuleList(components)

    def forward(self, x):
        return torch.stack([component(x) for component in self.components], dim=1)


class Mixture(nn.Module):
    """(P): log sum_m pi_m softmax(h_theta_m(x)), the log-probabilities of the client's mixture
    (their cross-entropy is the mixture's negative log-likelihood, their argmax its prediction)."""

    def __init__(self, components: list[nn.Module], pi: torch.Tensor):
        super().__init__()
        self.components = nn.ModuleList(components)
        self.register_buffer("log_pi", torch.log(pi))

    def forward(self, x):
        log_probs = torch.stack([F.log_softmax(component(x), dim=-1) for component in self.components], dim=1)
        return torch.logsumexp(log_probs + self.log_pi[None, :, None], dim=1)


def flatten(components: list[dict]) -> dict:
    """M state dicts as one, keyed (m, key): (A) for all components in one streamed pass."""
    return {(m, key): value for m, state in enumerate(components) for key, value in state.items()}


def unflatten(flat: dict, M: int) -> list[dict]:
    return [{key: value for (m, key), value in flat.items() if m == index} for index in range(M)]


# -- the plugin ---------------------------------------------------------------------------------


class FedEM(Plugin):
    """FedEM (Marfoq et al. 2021): M shared component models; each client keeps mixture weights
    pi over them, updated by an EM step on its data every round, and trains every component on
    its responsibility-weighted loss; the server averages each component. Each client is scored
    with the pi-weighted mixture of the components' probabilities. M models down and up per
    participant. Budget: ``M * training.local_epochs``."""

    name = "fedem"
    Params = FedEMParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(self.params.M * spec.training.local_epochs))

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)

    # -- server ---------------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        arch = ctx.models.arch_of(0)
        components = [clone_state(ctx.models.initial_state(arch))]
        plugin = ctx.models.plugin(arch)
        for m in range(1, self.params.M):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(ctx.seed_for(f"fedem_init:{m}"))
                module = plugin.build(ctx.models.input_shape, ctx.num_classes).to(ctx.device)
            components.append(clone_state(module))
        ctx.server["components"] = components
        self.modules(ctx, arch)  # built now, before any worker starts

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"components": ctx.server["components"]}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        averaged = weighted_average((weights[i], flatten(message["components"])) for i, message in uploads)
        if averaged is not None:  # nobody's upload arrived: keep the components
            ctx.server["components"] = unflatten(averaged, self.params.M)
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"components": ctx.server["components"]}

    # -- client ---------------------------------------------------------------------------------

    def modules(self, ctx, arch: str) -> list[nn.Module]:
        """One reusable working module per component (built once, drawing nothing from the run's
        random stream)."""
        with torch.random.fork_rng(devices=[]):
            return [ctx.models.working(arch, slot=f"fedem{m}") for m in range(self.params.M)]

    def received(self, ctx, client, message) -> list[nn.Module]:
        modules = self.modules(ctx, client.arch)
        for module, state in zip(modules, message["components"]):
            load_state(module, state)
        return modules

    def mixture_weights(self, client) -> torch.Tensor:
        """pi_t: the client's last delivered M-step, 1/M before its first."""
        pi = client.state.get("pi")
        if pi is None:
            return torch.full((self.params.M,), 1.0 / self.params.M, device=client.data.train_y.device)
        return pi

    def responsibilities(self, ctx, client, modules, pi) -> torch.Tensor:
        """(E) on the client's training split with the components in ``modules``."""
        data = client.data
        losses = component_losses(modules, data.train_x, data.train_y, ctx.spec.evaluation.batch_size)
        return e_step(pi, losses)

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.received(ctx, client, message)
        return True

    @hookimpl
    def local_train(self, ctx, client):
        modules = self.modules(ctx, client.arch)
        q = self.responsibilities(ctx, client, modules, self.mixture_weights(client))  # (E)
        pi = m_step(q)  # (M-pi)
        client.staged["pi"] = pi  # kept only if this round's upload arrives
        client.log(pi_max=float(pi.max()))
        labels = client.data.train_y

        def loss(model, x, index, logits):  # the loop's "labels" are the samples' positions
            return weighted_loss(logits, labels[index], q[index])

        stacked = Stacked(modules)
        before, steps_before = client.work.private, client.work.private_steps
        metrics = client.train(model=stacked, optimizer=client.optimizer(params=stacked.parameters()),
                               y=torch.arange(len(labels), device=labels.device), loss_fn=loss)  # (M-theta)
        extra = self.params.M - 1  # the loop counted one pass and one step of one model
        client.count_work(private=extra * (client.work.private - before),
                          private_steps=extra * (client.work.private_steps - steps_before))
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        return {"components": [module.state_dict() for module in self.modules(ctx, client.arch)]}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        modules = self.received(ctx, client, message)
        return {"": Mixture(modules, self.mixture_weights(client))}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        modules = self.received(ctx, client, message)
        pi = self.mixture_weights(client)
        if ctx.spec.experiment.coldstart_epochs:
            losses = component_losses(modules, client.data.train_x, client.data.train_y,
                                      ctx.spec.evaluation.batch_size)
            for _ in range(ctx.spec.experiment.coldstart_epochs):  # EM on pi alone: the components stay
                pi = m_step(e_step(pi, losses))
        client.state["pi"] = pi
        return {"": Mixture(modules, pi)}


__all__ = ["FedEM", "FedEMParams", "Mixture", "Stacked", "component_losses", "e_step", "flatten", "m_step",
           "unflatten", "weighted_loss"]
