"""Same-architecture clients trained together: ``executor.name = "batched"``.

A round's participants, all of one architecture, train in one vectorised loop: their
parameters are stacked along a leading client dimension and every step is one
``torch.func.vmap`` over ``torch.func.grad`` of ``torch.func.functional_call``, each client with
its own mini-batch (drawn in the order its ``client.generator("train")`` gives, as the
sequential loop draws it) and its own SGD update (momentum and weight decay as
``torch.optim.SGD`` computes them). Clients are sorted by their number of steps (samples,
epochs, a straggler's batch budget), so step t computes only the clients still training; a
short last batch is padded and its padding weighted 0. The round's participants' training
data is joined once per round and all their parameters are held at once: memory grows with
the participants per round.

Only the standard client side is trained this way; :func:`why_not_batched` decides, per round:

- the ``local_train`` implementations are all ones that call ``client.train()`` once with no
  arguments and afterwards only read the trained model (:data:`TRAIN_ONCE`: the core default,
  Local's, and the partial-model family's: LG-FedAvg, FedSim);
- the ``local_objective`` terms are the core cross-entropy, plus FedProx's proximal term, and
  no plugin implements ``task_loss`` (which replaces the cross-entropy);
- no plugin implements ``adjust_gradients`` (SCAFFOLD's and FedDyn's corrections);
- ``training.optimizer = "sgd"``; the model has no buffers (BatchNorm) and no dropout;
  the participants share one architecture.

So FedAvg, FedProx, Local, LG-FedAvg and FedSim train together (also with the faults add-ons);
every other method's rounds run one client after another, exactly as ``sequential`` runs them.
``on_receive`` and ``client_upload`` are the method's own, run for each client: receive for
every participant first, then the training of all of them together, then, one client at a
time as the aggregate asks for them, the trained weights are put in the working model, the
method's ``local_train`` runs with ``client.train()`` answering from the joint training, and
the upload is made (:func:`engine.run_client`, so the server's bookkeeping is the sequential
executor's). Receiving before anyone trains is only the sequential loop's order when
``on_receive`` loads every weight the client starts from, as the methods above do. Results equal the sequential loop's up to float rounding (vectorised matrix
products sum in another order): the tests compare final weights within 1e-5.
"""

from __future__ import annotations

import types
from typing import Callable, Iterable, Iterator

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.runtime.client import copy_payload, run_client
from pfl_core.runtime.context import Client, ClientView
from pfl_core.runtime.precision import precision_autocast
from pfl_core.runtime.training import batch_order, batch_starts, mean_training_loss
from pfl_core.seeding import seed_torch

# ``local_train`` implementations that train with exactly one ``client.train()`` call with no
# arguments and then only read the model (to keep or upload it).
TRAIN_ONCE = {
    "pfl_core.registry.defaults.CoreDefaults.local_train",
    "pfl_plugins.local.Local.local_train",
    "pfl_core.methods.partial.PartialModel.local_train",
}
CROSS_ENTROPY = "pfl_core.registry.defaults.CoreDefaults.local_objective"
PROXIMAL = "pfl_plugins.fedprox.FedProx.local_objective"  # mu/2 ||w - w_t||^2, w_t in scratch["w_t"]


def _qualified(impl) -> str:
    function = getattr(impl.function, "__func__", impl.function)
    return f"{function.__module__}.{function.__qualname__}"


def why_not_batched(view, participants: list[int]) -> str | None:
    """None when this round's client side can train together, else the reason it cannot."""
    if view.spec.training.optimizer != "sgd":
        return f"training.optimizer = {view.spec.training.optimizer!r} (only sgd trains together)"
    for impl in view.hooks.local_train.get_hookimpls():
        if _qualified(impl) not in TRAIN_ONCE:
            return f"local_train of {impl.plugin_name} is its own training loop"
    for impl in view.hooks.local_objective.get_hookimpls():
        if _qualified(impl) not in (CROSS_ENTROPY, PROXIMAL):
            return f"local_objective of {impl.plugin_name} is not cross-entropy or FedProx's term"
    for impl in view.hooks.task_loss.get_hookimpls():
        return f"task_loss of {impl.plugin_name} replaces the cross-entropy"
    for impl in view.hooks.adjust_gradients.get_hookimpls():
        return f"adjust_gradients of {impl.plugin_name} changes the gradients"
    archs = {view.models.arch_of(i) for i in participants}
    if len(archs) > 1:
        return f"the participants have several architectures ({', '.join(sorted(archs))})"
    for arch in archs:
        model = view.models.working(arch)
        if any(True for _ in model.buffers()):
            return f"{arch} has buffers (BatchNorm statistics)"
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
            return f"{arch} has dropout"
    return None


def proximal_coefficient(hooks) -> float | None:
    """FedProx's mu when its term is part of the objective, else None."""
    for impl in hooks.local_objective.get_hookimpls():
        if _qualified(impl) == PROXIMAL:
            return float(impl.plugin.params.mu)
    return None


@attrs.define
class Trained:
    """One client's result of the joint training: what ``client.train()`` would have left."""

    weights: dict[str, torch.Tensor]
    loss_total: torch.Tensor  # sum of its step losses (float32, on the CPU, as run_epochs sums them)
    steps: int
    samples: int  # work: samples of its epochs (run_epochs' counter)


@attrs.define
class Schedule:
    """Every participant's mini-batches for the round: positions into the joined train data."""

    index: torch.Tensor  # [clients, steps, batch] long
    weight: torch.Tensor  # [clients, steps, batch] float: 1 a real sample, 0 padding
    steps: list[int]
    samples: list[int]


def schedule(clients: list, training) -> Schedule:
    """The batches each client's ``client.train()`` would take, in its seeded order: the same
    loop as ``run_epochs`` (epochs, shuffling, ``drop_last``, ``client.batch_limit``)."""
    batch = training.batch_size
    per_client, steps, samples = [], [], []
    offset = 0
    for client in clients:
        n = client.num_train
        generator = client.generator("train")
        budget = client.batch_limit
        batches, work = [], 0
        for _ in range(training.local_epochs):
            order = batch_order(n, generator, training.shuffle)
            seen = 0
            stopped = False
            for start in batch_starts(n, batch, training.drop_last):
                if budget is not None and len(batches) >= budget:
                    stopped = True
                    break
                idx = order[start:start + batch]
                seen += len(idx)
                batches.append(idx + offset)
            if stopped:
                work += seen
                break
            work += n
        per_client.append(batches)
        steps.append(len(batches))
        samples.append(work)
        offset += n
    most = max(steps, default=0)
    index = torch.zeros(len(clients), most, batch, dtype=torch.long)
    weight = torch.zeros(len(clients), most, batch)
    for c, batches in enumerate(per_client):
        for t, idx in enumerate(batches):
            index[c, t, :len(idx)] = idx
            weight[c, t, :len(idx)] = 1.0
    return Schedule(index, weight, steps, samples)


def train_together(model: nn.Module, clients: list, starts: list[dict[str, torch.Tensor]],
                   trainable: list[set[str]], training, mu: float | None = None,
                   anchors: list[dict[str, torch.Tensor]] | None = None) -> list[Trained]:
    """Train ``clients`` (one architecture: ``model``) from their ``starts`` together, each as
    ``client.train()`` with the core cross-entropy (plus ``mu/2 ||w - anchor||^2`` when ``mu``
    is given) and ``torch.optim.SGD`` would. Parameters not in a client's ``trainable`` keep
    their value, as a parameter without a gradient does under torch's SGD."""
    from torch.func import functional_call, grad, vmap

    device = next(model.parameters()).device
    names = [name for name, _ in model.named_parameters()]
    plan = schedule(clients, training)
    # Longest first: at step t the clients still training are a prefix, the only ones computed.
    order = sorted(range(len(clients)), key=lambda c: -plan.steps[c])
    going = [sum(1 for c in order if plan.steps[c] > t) for t in range(max(plan.steps, default=0))]
    index, weight = plan.index[order].to(device), plan.weight[order].to(device)
    inputs = torch.cat([c.data.train_x for c in clients]) if clients else None  # index's positions
    labels = torch.cat([c.data.train_y for c in clients]) if clients else None
    params = {n: torch.stack([starts[c][n] for c in order]) for n in names}
    anchor = {n: torch.stack([anchors[c][n] for c in order]) for n in names} if mu is not None else {}
    # per client, whether it trains n: only for the parameters some client does not train
    trains = {n: torch.tensor([n in trainable[c] for c in order], device=device)
              for n in names if not all(n in t for t in trainable)}
    lr, momentum, decay = training.lr, training.momentum, training.weight_decay
    velocity = {n: torch.zeros_like(p) for n, p in params.items()} if momentum else {}

    def loss_of(weights, anchored, x, y, sample_weight):
        logits = functional_call(model, weights, (x,))
        per_sample = F.cross_entropy(logits, y, reduction="none")
        loss = (per_sample * sample_weight).sum() / sample_weight.sum().clamp_min(1.0)
        if mu is not None:  # FedProx's term comes first in the hook order: 0 + term + cross-entropy
            loss = mu / 2 * sum((weights[n] - anchored[n]).pow(2).sum() for n in names) + loss
        return loss, loss.detach()

    step = vmap(grad(loss_of, has_aux=True))
    losses = torch.zeros(len(clients), device=device)  # read back once, at the end: no sync per step
    was_training = model.training
    model.train()
    try:
        for t, k in enumerate(going):
            idx = index[:k, t]
            with precision_autocast(training, device):  # as the sequential loop's forward and loss
                grads, loss = step({n: p[:k] for n, p in params.items()}, {n: a[:k] for n, a in anchor.items()},
                                   inputs[idx], labels[idx], weight[:k, t])
            with torch.no_grad():
                for n in names:  # torch.optim.SGD's step (no dampening, no Nesterov), per client
                    p, g = params[n][:k], grads[n]
                    if decay:
                        g = g.add(p, alpha=decay)
                    if momentum:
                        g = velocity[n][:k].mul_(momentum).add_(g)
                    if n in trains:  # where frozen (no gradient), SGD leaves it as it is
                        keep = trains[n][:k].view((-1,) + (1,) * (p.dim() - 1))
                        p.copy_(torch.where(keep, p.add(g, alpha=-lr), p))
                    else:
                        p.add_(g, alpha=-lr)
                losses[:k] += loss
    finally:
        model.train(was_training)
    losses = losses.cpu()
    position = {c: i for i, c in enumerate(order)}
    return [Trained({n: params[n][position[c]] for n in names}, losses[position[c]], plan.steps[c], plan.samples[c])
            for c in range(len(clients))]


# -- the executor's client side ------------------------------------------------------------


class _Replay:
    """The hooks a client's ``run_client`` sees once it was trained together: ``on_receive``
    already ran; ``local_train`` puts the trained weights in the working model and runs the
    method's own ``local_train``, whose ``client.train()`` answers from the joint training.
    Every other hook is the run's."""

    def __init__(self, hooks, trained: dict[int, Trained], trainable: dict[int, set[str]], received: dict[int, dict]):
        self._hooks = hooks
        self._trained = trained
        self._trainable = trainable
        self._received = received  # per client, the scratch its on_receive filled (FedNova's, FedProx's anchor)

    def __getattr__(self, name):
        return getattr(self._hooks, name)

    def on_receive(self, ctx, client, message):
        client.scratch.update(self._received.pop(client.id))  # what on_receive left for the later hooks
        return True

    def local_train(self, ctx, client):
        result = self._trained.pop(client.id)
        model = client.model
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(result.weights[name])
                p.requires_grad_(name in self._trainable[client.id])
        calls = []

        def train(*args, **kwargs):  # what TRAIN_ONCE's implementations call
            if args or kwargs or calls:
                raise RuntimeError("executor 'batched': local_train called client.train() with arguments or "
                                   "twice, which the joint training did not do; report this as a bug")
            calls.append(True)
            client.count_work(private=result.samples, private_steps=result.steps)
            return mean_training_loss(result.loss_total, result.steps)  # NonFiniteError as run_epochs raises it

        client.train = train
        return self._hooks.local_train(ctx=ctx, client=client)


def map_clients(fn: Callable, items: Iterable) -> Iterator:
    """``executor.map`` for ``batched``: a round's client side trained together when
    :func:`why_not_batched` allows it, anything else one item after another."""
    view = fn.args[0] if getattr(fn, "func", None) is run_client and fn.args else None
    if not isinstance(view, ClientView):  # evaluation, server-side work: one by one
        for item in items:
            yield fn(item)
        return
    tasks = list(items)  # every participant receives before any trains
    reason = why_not_batched(view, [task.client_id for task in tasks])
    if reason is not None or not tasks:
        view.resolved_value("executor.batched", f"no: {reason}" if reason else "yes")  # sent with the first result
        for task in tasks:
            yield fn(task)
        return

    hooks = view.hooks
    replay_view = ClientView(types.SimpleNamespace(**{name: getattr(view, name) for name in ClientView.READ_ONLY}))
    replay_view.resolved_value("executor.batched", "yes")
    mu = proximal_coefficient(hooks)
    clients, starts, trainable, anchors, reports, before = [], [], [], [], [], []
    for task in tasks:
        seed_torch(view.seed_for("client", task.client_id))
        client = Client(replay_view, task.client_id, state=task.state)
        before.append(copy_payload(dict(client.state)) if task.skip else None)
        hooks.on_receive(ctx=replay_view, client=client, message=task.message)
        model = client.model
        clients.append(client)
        starts.append({n: p.detach().clone() for n, p in model.named_parameters()})
        trainable.append({n for n, p in model.named_parameters() if p.requires_grad})
        if mu is not None:
            anchors.append(dict(zip((n for n, _ in model.named_parameters()), client.scratch["w_t"])))
        reports.append(replay_view.take_reports())
    trained = train_together(clients[0].model, clients, starts, trainable, view.spec.training, mu, anchors)

    object.__setattr__(replay_view, "hooks", _Replay(hooks, {c.id: r for c, r in zip(clients, trained)},
                                                     {c.id: t for c, t in zip(clients, trainable)},
                                                     {c.id: c.scratch for c in clients}))
    for task, (logged, resolved), saved in zip(tasks, reports, before):
        replay_view.logged.extend(logged)  # what its on_receive reported, before the rest
        replay_view.resolved.extend(resolved)
        result = run_client(replay_view, task)
        if result.diverged is not None and saved is not None:  # its state as before on_receive
            result.state.clear()
            result.state.update(saved)
        yield result
