"""What hooks see: the run context, the client view, engine-owned stores and the model bank."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pfl_core import registry, seeding
from pfl_core.errors import SpecError
from pfl_core.payload import nbytes
from pfl_core.registry.budget import WorkCounter
from pfl_core.runtime.training import make_optimizer, reset_optimizer, run_epochs
from pfl_core.spec import Spec
from pfl_core.state.store import ClientStore


def clone_state(module_or_state) -> dict[str, torch.Tensor]:
    """A detached copy of a state dict (what a client or the server keeps between rounds)."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return {k: v.detach().clone() for k, v in state.items()}


def load_state(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Copy ``state`` into ``module`` in place (no reallocation; keys may be a subset)."""
    with torch.no_grad():
        own = module.state_dict()
        for key, value in state.items():
            own[key].copy_(value)
    return module


class ArchCycle(Sequence):
    """Client ``i``'s architecture, ``archs[i % len(archs)]`` (``model.pool``, or one
    ``model.name`` for all), without a list of one entry per client (a million clients)."""

    def __init__(self, archs, num_clients: int):
        self.archs = list(archs)
        self.num_clients = num_clients

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, client_id):
        if isinstance(client_id, slice):
            return [self[i] for i in range(self.num_clients)[client_id]]
        if not -self.num_clients <= client_id < self.num_clients:
            raise IndexError(f"client {client_id} of {self.num_clients}")
        return self.archs[client_id % self.num_clients % len(self.archs)]


class ModelBank:
    """Architectures per client, seeded initial weights, and one reusable module per arch.

    Every client of an architecture starts from the same seeded initial weights. Training
    reuses one *working* module per architecture: a method loads the weights it wants into
    it (global or personal) instead of building a model per client.
    """

    def __init__(self, spec: Spec, input_shape: tuple, num_classes: int, device: torch.device):
        self.spec = spec
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.device = device
        model = spec.model
        n = spec.partition.num_clients
        if model.clients is not None:
            if len(model.clients) != n:
                raise SpecError(
                    "model.clients",
                    f"lists {len(model.clients)} architectures for {n} clients (partition.num_clients)",
                )
            self.client_archs = list(model.clients)
            path = "model.clients"
        elif model.pool is not None:
            self.client_archs = ArchCycle(model.pool, n)
            path = "model.pool"
        else:
            self.client_archs = ArchCycle([model.name], n)
            path = "model.name"
        self._plugins: dict[str, Any] = {}
        self._initial: dict[str, dict[str, torch.Tensor]] = {}
        self._working: dict[str, nn.Module] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._sized: set[str] = set()  # architectures whose size _check_size has checked
        self._paths: dict[str, str] = {}  # the spec key that first named each architecture
        # every architecture first appears within one cycle of an ArchCycle
        first_cycle = len(self.client_archs) if path == "model.clients" else min(n, len(self.client_archs.archs))
        for i, arch in enumerate(self.client_archs[:first_cycle]):
            self._paths.setdefault(arch, f"{path}[{i}]" if path != "model.name" else path)
            self.plugin(arch, self._paths[arch])
        for arch in model.arch_params:  # also those only a plugin builds (a server model): keys checked now
            self.plugin(arch, f"model.arch_params.{arch}")

    def check_builds(self, server_archs: dict[str, str] | None = None) -> None:
        """Build each client architecture once for this data's input shape (dry runs), then
        each of ``server_archs`` (a method's server models: architecture -> the spec key naming
        it) that no client has: a model that cannot take these inputs, or is larger than this
        machine's memory, fails here with the run's own error, naming its spec key."""
        servers = {arch: path for arch, path in (server_archs or {}).items() if arch not in self._paths}
        for arch, path in {**self._paths, **servers}.items():
            self._construct(arch, path)

    def plugin(self, arch: str, path: str = "model.name"):
        if arch not in self._plugins:
            spec = self.spec.model
            if arch == spec.name:
                params, params_path = spec.params, "model.params"
            else:
                params, params_path = spec.arch_params.get(arch, {}), f"model.arch_params.{arch}"
            plugin = registry.instantiate(registry.MODEL, arch, params, path, params_path)
            plugin.name_path = path  # shape errors at build time name the right key
            plugin.params_path = params_path  # and a model too large to allocate its parameters
            self._plugins[arch] = plugin
        return self._plugins[arch]

    def arch_of(self, client_id: int) -> str:
        return self.client_archs[client_id]

    def build(self, arch: str, path: str = "model.name") -> nn.Module:
        """A new module of ``arch`` with the run's seeded initial weights."""
        module = self._construct(arch, path)
        return load_state(module, self.initial_state(arch))

    def _construct(self, arch: str, path: str = "model.name") -> nn.Module:
        plugin = self.plugin(arch, path)
        if arch not in self._sized:
            self._check_size(arch, plugin)
            self._sized.add(arch)
        try:
            return plugin.build(self.input_shape, self.num_classes).to(self.device)
        except (MemoryError, RuntimeError, TypeError, OverflowError) as exc:  # e.g. hidden = [1000000000]
            text = " ".join(str(exc).split())
            overflow = "overflow" in text.lower()  # a size beyond int64 (width = 1e30)
            if not (isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or "allocate" in text or overflow):
                raise
            asked = re.search(r"tried to allocate ([\d.]+ ?[A-Za-z]+)", text)
            detail = (f"torch could not allocate {asked.group(1)}" if asked else "a size beyond 64-bit integers"
                      if overflow else text[:160] or type(exc).__name__)
            raise self._too_large(arch, plugin, detail) from None

    def _check_size(self, arch: str, plugin) -> None:
        """Build on torch's meta device first (nothing allocated, no random draws kept): a model
        larger than this machine's memory is refused at once, not after minutes of initialising
        the part of it that fits (cnn4 with width = 1000000)."""
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                module = plugin.build(self.input_shape, self.num_classes)
        except Exception:  # noqa: BLE001 - a model that cannot be built on meta: the real build says why
            return
        size = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # not on this platform
            return
        if size > memory:
            raise self._too_large(arch, plugin, f"its weights need {size / 2**30:.1f} GiB, more than this "
                                                f"machine's {memory / 2**30:.1f} GiB of memory")

    def _too_large(self, arch: str, plugin, detail: str) -> SpecError:
        return SpecError(getattr(plugin, "params_path", "model.params"),
                         f"{arch} with these parameters is too large to build for {self.num_classes} classes and "
                         f"inputs {self.input_shape} ({detail})")

    def initial_state(self, arch: str) -> dict[str, torch.Tensor]:
        if arch not in self._initial:
            with torch.random.fork_rng(devices=[]):
                seeding.seed_torch(seeding.derive_seed(self.spec.experiment.seed, f"init:{arch}"))
                self._initial[arch] = clone_state(self._construct(arch))
        return self._initial[arch]

    def working(self, arch: str, slot: str = "client") -> nn.Module:
        """The reusable module of ``arch``; another ``slot`` (e.g. "server") is another module,
        so a server model and a client model of the same architecture can coexist."""
        key = arch if slot == "client" else f"{arch}#{slot}"
        if key not in self._working:
            self._working[key] = self.build(arch)
        return self._working[key]

    def working_optimizer(self, arch: str, training) -> torch.optim.Optimizer:
        if arch not in self._optimizers:
            self._optimizers[arch] = make_optimizer(self.working(arch).parameters(), training)
        return reset_optimizer(self._optimizers[arch])


class Client:
    """One client as the hooks see it during a round (or an evaluation)."""

    def __init__(self, ctx: "RunContext | ClientView", client_id: int, state: dict[str, Any] | None = None):
        self.ctx = ctx
        self.id = client_id
        self.round = ctx.round
        self.data = ctx.data.clients[client_id]
        self.arch = ctx.models.arch_of(client_id)
        # persists across rounds; a worker process gets a copy the engine writes back
        self.state = ctx.store[client_id] if state is None else state
        self.scratch: dict[str, Any] = {}  # this round only
        # State that advances only when this round's upload reaches the server: the engine
        # merges it into client.state (key by key) when the upload arrives and drops it when
        # the upload is lost (upload_lost) or the client is skipped (on_nonfinite).
        self.staged: dict[str, Any] = {}
        self.work = WorkCounter()  # samples trained on this round (the engine logs the budget)
        # Mini-batch steps this client may take this round over all its training loops (None:
        # no limit; the stragglers add-on sets it) and the steps taken so far (take_batch).
        self.batch_limit: int | None = None
        self.batches_taken = 0

    def log(self, **values: float) -> None:
        """This client's values for this round (``client.log(alpha=0.7)``): see ``ctx.log_client``."""
        self.ctx.log_client(self.id, **values)

    def count_work(self, private: int = 0, public: int = 0, private_steps: int = 0, public_steps: int = 0) -> None:
        """Record samples processed by a plugin's own training loop (``train`` counts its own):
        ``private`` over this client's train split, ``public`` over the public set; and optimiser
        steps beyond the one per mini-batch that ``take_batch`` counts (pFedMe's inner steps, a
        second model stepped on the same batch)."""
        self.work.private += int(private)
        self.work.public += int(public)
        self.work.private_steps += int(private_steps)
        self.work.public_steps += int(public_steps)

    def take_batch(self, work: str = "private") -> bool:
        """Asked by every training loop before each mini-batch step: False once this round's
        ``batch_limit`` is spent (the loop stops there), else True, and the step is counted (as
        a step on ``work``: "private" or "public" data)."""
        if self.batch_limit is not None and self.batches_taken >= self.batch_limit:
            return False
        self.batches_taken += 1
        if work == "public":
            self.work.public_steps += 1
        else:
            self.work.private_steps += 1
        return True

    @property
    def steps(self) -> int:
        """Optimiser steps this client took so far this round, over all its training loops
        (``take_batch`` counts one per mini-batch step, ``count_work`` adds the rest): the
        per-client, per-round count that ``budget.private_steps`` and ``budget.public_steps``
        add up."""
        return self.work.steps

    def gradient_adjuster(self, model: nn.Module, optimizer) -> Callable[[], None] | None:
        """The ``adjust_gradients`` hook for this client, ``model`` and ``optimizer``, for a
        training loop to call between ``backward()`` and ``optimizer.step()``; None when no plugin
        implements it (ask once per loop, not per step). ``train`` uses it."""
        hook = self.ctx.hooks.adjust_gradients
        if not hook.get_hookimpls():
            return None
        ctx = self.ctx
        return lambda: hook(ctx=ctx, client=self, model=model, optimizer=optimizer)

    @property
    def model(self) -> nn.Module:
        """The reusable working module of this client's architecture."""
        return self.ctx.models.working(self.arch)

    @property
    def num_train(self) -> int:
        return self.data.num_train

    def generator(self, purpose: str = "train") -> torch.Generator:
        return seeding.torch_generator(self.ctx.spec.experiment.seed, purpose, self.round, self.id)

    def rng(self, purpose: str) -> np.random.Generator:
        return seeding.numpy_rng(self.ctx.spec.experiment.seed, purpose, self.round, self.id)

    def optimizer(self, params=None, lr: float | None = None) -> torch.optim.Optimizer:
        """The configured optimiser: the working model's (reset) by default, else a new one."""
        if params is None and lr is None:
            return self.ctx.models.working_optimizer(self.arch, self.ctx.spec.training)
        params = self.model.parameters() if params is None else params
        return make_optimizer(params, self.ctx.spec.training, lr=lr)

    def objective(self, model: nn.Module, x, y, logits) -> torch.Tensor:
        """The sum of every plugin's ``local_objective`` term for one batch."""
        terms = self.ctx.hooks.local_objective(ctx=self.ctx, client=self, model=model, x=x, y=y, logits=logits)
        return sum(terms)

    def train(self, model: nn.Module | None = None, *, epochs: int | None = None, optimizer=None,
              x=None, y=None, loss_fn=None, work: str | None = None) -> dict[str, float]:
        """Run the configured epochs of mini-batch training (default: on the train split).

        Every epoch is counted as work: ``work`` = "private" or "public"; by default private
        when training on the client's train split, public otherwise (the public set). Stops
        early when the round's ``batch_limit`` is spent (``take_batch``; a partial epoch
        counts the samples it ran). Every step calls the ``adjust_gradients`` hook between
        ``backward()`` and ``optimizer.step()`` when a plugin implements it.

        ``loss_fn(model, x, y, logits) -> scalar tensor``, when given, is each batch's whole
        loss in place of ``self.objective``: no core cross-entropy, no ``task_loss``, no
        ``local_objective`` term of the method or the add-ons (add ``self.objective(model, x,
        y, logits)`` inside it to keep them)."""
        training = self.ctx.spec.training
        model = self.model if model is None else model
        if work is None:
            work = "private" if x is None or x is self.data.train_x else "public"
        optimizer = optimizer if optimizer is not None else self.optimizer()
        return run_epochs(
            model,
            optimizer,
            self.data.train_x if x is None else x,
            self.data.train_y if y is None else y,
            epochs=training.local_epochs if epochs is None else epochs,
            batch_size=training.batch_size,
            loss_fn=self.objective if loss_fn is None else loss_fn,
            generator=self.generator("train"),
            shuffle=training.shuffle,
            drop_last=training.drop_last,
            counter=lambda n: self.count_work(**{work: n}),
            take_batch=lambda: self.take_batch(work),
            before_step=self.gradient_adjuster(model, optimizer),
        )


class RunContext:
    """Everything a hook may use: the spec, the data, the stores, the hooks themselves."""

    def __init__(self, spec: Spec, params, data, models: ModelBank, hooks, executor, device):
        self.spec = spec
        self.params = params  # the algorithm's parsed Params
        self.data = data
        self.models = models
        self.hooks = hooks
        self.executor = executor
        self.device = device
        self.server: dict[str, Any] = {}  # engine-owned server state
        state = getattr(spec, "state", None)  # [state]: the bounded cache of per-client state
        self.store = ClientStore(len(data.clients), cache_clients=state.cache_clients if state else 0,
                                 spill_dir=state.spill_dir if state else None, device=device)
        self.round = 0
        self.round_metrics: dict[str, float] = {}
        self.participants: list[int] = []
        self.train_losses: list[float] = []  # this round's participants' mean training losses
        # Clients that take part in federated training (all of them unless a plugin holds
        # some out, e.g. cold-start clients that only personalise at the end).
        # a range, not a list: a million clients are no million objects
        self.training_clients: Sequence[int] = range(len(data.clients))
        self.coldstart_clients: list[int] = []
        self.comm_up = 0  # cumulative bytes, counted by the engine
        self.comm_down = 0
        self.tracker = None  # set by the engine; plugins log artifacts through it
        self.resolved_values: dict[str, Any] = {}  # ctx.resolved_value: what plugins decided at run time
        self.client_series: list[dict] = []  # ctx.log_client rows: {"round", "client", "name", "value"}

        self.work_private_epochs = 0.0  # summed over clients: epochs over their private data
        self.work_public_epochs = 0.0
        self.work_private_steps = 0  # summed over clients: optimiser steps on private data
        self.work_public_steps = 0
        self.finetune_steps = 0  # summed over clients: steps of fine-tuning before an evaluation

    def record_work(self, client_id: int, work: WorkCounter) -> None:
        """Add one client's round of local work (samples processed, as epochs) to the totals."""
        self.work_private_epochs += work.private / max(self.data.clients[client_id].num_train, 1)
        self.work_private_steps += work.private_steps
        self.work_public_steps += work.public_steps
        public = self.data.public
        if public is not None and len(public.indices):
            self.work_public_epochs += work.public / len(public.indices)

    def record_pooled_work(self, epochs: float = 0.0, steps: int = 0) -> None:
        """Server-side training over every training client's pooled data (Centralized): each
        client's private data was passed over ``epochs`` times, in ``steps`` optimiser steps
        over the pooled batches (the budget's per-client mean divides them over the training
        clients, as it does the clients' own steps: the same epochs give about FedAvg's steps)."""
        self.work_private_epochs += epochs * len(self.training_clients)
        self.work_private_steps += steps

    def budget_metrics(self) -> dict[str, float]:
        """Cumulative local work per training client, measured (compare with ``[budget]``)."""
        clients = max(len(self.training_clients), 1)
        return {"budget.private_epochs": self.work_private_epochs / clients,
                "budget.public_epochs": self.work_public_epochs / clients,
                "budget.private_steps": self.work_private_steps / clients,
                "budget.public_steps": self.work_public_steps / clients,
                "budget.finetune_steps": self.finetune_steps / clients}

    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    def client(self, client_id: int) -> Client:
        return Client(self, client_id)

    def client_view(self) -> "ClientView":
        """What client-side hooks get as ``ctx`` this round (see :class:`ClientView`)."""
        return ClientView(self)

    def rng(self, purpose: str) -> np.random.Generator:
        """A server-side numpy RNG for this round and purpose."""
        return seeding.numpy_rng(self.spec.experiment.seed, purpose, self.round)

    def generator(self, purpose: str) -> torch.Generator:
        return seeding.torch_generator(self.spec.experiment.seed, purpose, self.round)

    def broadcast(self, client_id: int) -> dict:
        """The server's message to one client (``on_broadcast``), its bytes counted down."""
        message = self.hooks.on_broadcast(ctx=self, client_id=client_id)
        self.comm_down += nbytes(message)
        return message

    def seed_for(self, purpose: str, client_id: int = seeding.SERVER) -> int:
        return seeding.derive_seed(self.spec.experiment.seed, purpose, self.round, client_id)

    def resolved_value(self, name: str, value: Any) -> None:
        """A setting a plugin resolved at run time (the head a ``head_layers = none`` came to,
        the number of clusters an automatic threshold formed): logged once as the run's param
        ``resolved.<name>`` beside the spec's own params."""
        if name in self.resolved_values and self.resolved_values[name] == value:
            return
        self.resolved_values[name] = value
        if self.tracker is not None and hasattr(self.tracker, "log_param"):
            self.tracker.log_param(f"resolved.{name}", value)

    def log_client(self, client_id: int, **values: float) -> None:
        """Per-client values for this round (``ctx.log_client(3, alpha=0.7)``): rows of the run's
        ``client_series`` table; only their mean, min and max over clients become metrics."""
        for name, value in values.items():
            self.client_series.append({"round": self.round, "client": int(client_id), "name": name,
                                       "value": float(value)})

    def log(self, metrics: dict[str, float] | None = None, **more: float) -> None:
        """Extra metrics for this round (logged with the round's evaluation metrics).
        Per-client values go to ``client.log`` / ``log_client`` instead (one table per run)."""
        self.round_metrics.update(metrics or {}, **more)


class ClientContractError(Exception):
    """A client-side hook used something only the server has (docs/architecture.md)."""


class ClientView:
    """The ``ctx`` client-side hooks see: read-only run data, nothing of the server's.

    ``on_receive``, ``local_train``, ``local_objective``, ``client_upload`` and the per-client
    part of evaluation may run in another process or on another machine, so they get the
    spec, the parsed parameters, the data, the model bank, the hooks and this round's facts,
    but not ``server``, ``store``, ``tracker``, the byte and work counters, or round metrics:
    what a client needs from the server comes in its message, what it keeps goes in
    ``client.state``. Per-client values (``client.log``) and run-time resolved settings
    (``ctx.resolved_value``) are collected here and handed back to the server with the upload.
    """

    READ_ONLY = ("spec", "params", "data", "models", "hooks", "device", "round", "participants",
                 "training_clients", "coldstart_clients")

    def __init__(self, ctx: RunContext):
        for name in self.READ_ONLY:
            object.__setattr__(self, name, getattr(ctx, name))
        object.__setattr__(self, "logged", [])  # (client_id, {name: value}) for the server
        object.__setattr__(self, "resolved", [])  # (name, value) for ctx.resolved_value

    num_clients = property(lambda self: len(self.data.clients))
    num_classes = property(lambda self: self.data.num_classes)
    rng = RunContext.rng
    generator = RunContext.generator
    seed_for = RunContext.seed_for

    def log_client(self, client_id: int, **values: float) -> None:
        self.logged.append((client_id, dict(values)))

    def resolved_value(self, name: str, value: Any) -> None:
        self.resolved.append((name, value))

    def take_reports(self) -> tuple[list, list]:
        """What client hooks logged and resolved since the last call (sent with the upload)."""
        logged, resolved = list(self.logged), list(self.resolved)
        self.logged.clear()
        self.resolved.clear()
        return logged, resolved

    def __getattr__(self, name: str):  # only reached for names not set above
        if name.startswith("__"):  # protocol lookups (pickle, copy): plain absence
            raise AttributeError(name)
        raise ClientContractError(
            f"a client-side hook used ctx.{name}, which only the server has; send what the client "
            f"needs in its message (on_broadcast / evaluation_message) and keep what it keeps in "
            f"client.state (see 'The client-side contract' in docs/architecture.md)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise ClientContractError(f"a client-side hook set ctx.{name}: client hooks may change only "
                                  f"client.state and the client's working model")
