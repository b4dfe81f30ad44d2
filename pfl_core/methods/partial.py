"""Partial models: some state-dict keys are shared (broadcast and aggregated), the rest personal.

The one helper behind FedAlt, FedSim, FedBABU, LG-FedAvg (and pMixFed's layer bookkeeping):

    server: w_shared (the shared keys of the global model)
    each round t, each participant i:
        v_i <- client.state["personal"] (the seeded initial weights before i's first round)
        model_i <- (w_shared, v_i)                              (on_broadcast / on_receive)
        model_i <- update(model_i)                              (the method's local_train)
        v_i <- personal keys of model_i                         (client.state["personal"])
        upload the shared keys of model_i
    w_shared <- sum_i p_i * shared keys of model_i             (server_aggregate, p_i = n_i/n)

Only the shared keys travel, so only they are counted as communication. A *layer* is one
parameterised module (``pfl_core.models.layers``), listed base (input) to head (output);
``head_layers`` is the number of layers, counted from the output, that form the head (the same
parameter, with the same meaning, as FedPer's and FedRep's): the split point ``k = L -
head_layers`` puts layers ``1..k`` in the base and ``k+1..L`` in the head. ``None`` means the
middle, ``k = L // 2`` (``head_layers = L - L // 2``), which for pMixFed's CNNs is the paper's
"layers [1, 2] are shared" (cnn2: 4 layers, cnn4: 5 layers). Both parts must be non-empty:
``1 <= head_layers <= L - 1``; anything else is a spec error naming
``algorithm.params.head_layers`` (checked before any data is loaded for the zoo's models, and
again in ``setup`` on the real model). The former ``split`` (base layers, negative from the
end) is refused with a pointer here: ``split = -j`` is ``head_layers = j``.

Subclasses say which part is shared (``shared_part = "base"`` or ``"head"``) and how a client
updates (``local_train``).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
from attrs import define, field

from pfl_core.errors import SpecError
from pfl_core.methods.averaging import WeightAveraging
from pfl_core.methods.per_run import per_run
from pfl_core.models.layers import layer_keys, parameterised_layers
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.context import ModelBank, clone_state, load_state
from pfl_core.spec import at_least

# Input shapes tried when counting a model's layers before any data is loaded (check_spec).
# The number of parameterised layers of pfl's zoo does not depend on the input shape.
_PROBE_SHAPES = [(1, 28, 28), (3, 32, 32), (3, 64, 64), (20,)]


@define
class SplitParams:
    head_layers: Optional[int] = field(default=None, validator=at_least(1), metadata={
        "doc": "how many parameterised layers, counted from the output, form the head (the rest is the "
               "base); none: the middle (L - L // 2, base L // 2). Both parts non-empty (checked against "
               "the model)"})


def resolve_split(num_layers: int, head_layers: Optional[int]) -> int:
    """The number k of base layers (``num_layers - head_layers``; None: ``num_layers // 2``);
    ValueError unless both base and head are non-empty."""
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} parameterised layer(s); a base/head split needs at least 2")
    if head_layers is None:
        return num_layers // 2
    if not 1 <= head_layers <= num_layers - 1:
        raise ValueError(f"{head_layers} head layers is outside the model's layers: the model has {num_layers} "
                         f"layers, so head_layers must be in 1..{num_layers - 1} (both base and head non-empty)")
    return num_layers - head_layers


def probe_model(spec, arch: str):
    """``arch`` built on a guessed input shape before any data is loaded (None if none builds)."""
    plugin = ModelBank(spec, input_shape=(), num_classes=0, device=torch.device("cpu")).plugin(arch)
    # On torch's meta device: the structure only, nothing allocated or initialised (a huge
    # width spent a minute filling gigabytes here before the real build refused it).
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for shape in _PROBE_SHAPES:
            try:
                return plugin.build(shape, 10)
            except Exception:  # noqa: BLE001 - a shape this model does not take
                continue
    return None


def probe_num_layers(spec, arch: str) -> Optional[int]:
    """The number of layers of ``arch`` built on a guessed input shape, before data is loaded
    (None if no guess builds; ``setup`` checks the real model then)."""
    model = probe_model(spec, arch)
    return None if model is None else len(parameterised_layers(model))


def spec_archs(spec) -> list[str]:
    return list(dict.fromkeys(spec.model.clients or spec.model.pool or [spec.model.name]))


def partial_average(pairs: Iterable[tuple[float, dict[str, torch.Tensor]]]):
    """Per-key ``sum_i p_i state_i[key]`` over the clients that sent ``key``, streamed.

    A key every client sent uses the weights as given (pass them normalised), with exactly the
    arithmetic of ``pfl_core.runtime.aggregate.weighted_average`` (so sharing every key is FedAvg bit
    for bit). A key only some clients sent is renormalised over them: ``sum_i p_i s_i /
    sum_i p_i``. Non-float entries come from the first sender. Returns ``(average, senders)``,
    ``senders[key]`` the number of clients that sent it; ``({}, {})`` if nobody took part.
    """
    total: dict[str, torch.Tensor] = {}
    weight_sum: dict[str, float] = {}
    senders: dict[str, int] = {}
    n = 0
    for weight, state in pairs:
        n += 1
        for key, value in state.items():
            if key not in total:
                total[key] = (value.detach() * weight) if value.is_floating_point() else value.detach().clone()
                weight_sum[key], senders[key] = weight, 1
                continue
            senders[key] += 1
            if value.is_floating_point():
                total[key].add_(value.detach(), alpha=weight)
                weight_sum[key] += weight
    for key, value in total.items():
        if senders[key] < n and value.is_floating_point():
            value.div_(weight_sum[key])
    return total, senders


@contextlib.contextmanager
def only_training(model: torch.nn.Module, keys: set[str]):
    """Parameters outside ``keys`` get no gradient while inside (restored afterwards)."""
    frozen = [p for name, p in model.named_parameters() if name not in keys and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield [p for name, p in model.named_parameters() if name in keys]
    finally:
        for p in frozen:
            p.requires_grad_(True)


class PartialModel(WeightAveraging):
    """FedAvg on the shared keys only; the personal keys stay on the client (see module doc)."""

    name = "partial"
    Params = SplitParams
    shared_part = "base"  # "base": layers 1..k shared; "head": layers k+1..L shared
    keeps_personal = True  # False: the personal part stays at its initial weights (FedBABU)

    # -- layer bookkeeping ------------------------------------------------------------

    def _split_error(self, exc: Exception) -> SpecError:
        return SpecError(f"{self.spec_path}.params.head_layers", str(exc))

    def split_keys(self, ctx, arch: str) -> tuple[list[str], list[str]]:
        """(shared keys, personal keys) of ``arch``'s state dict, in state-dict order: a function of
        the model and ``head_layers``, computed by whichever side needs it, once per run."""
        return per_run(ctx, self, f"split:{arch}", lambda: self._split(ctx, arch))

    def _split(self, ctx, arch: str) -> tuple[list[str], list[str]]:
        layers = layer_keys(ctx.models.working(arch))
        k = self.base_layers(len(layers))
        base = [key for layer in layers[:k] for key in layer]
        head = [key for layer in layers[k:] for key in layer]
        return {"base": (base, head), "head": (head, base)}[self.shared_part]  # a typo fails loudly

    def base_layers(self, num_layers: int) -> int:
        """k: how many of the model's ``num_layers`` layers form the base."""
        try:
            return resolve_split(num_layers, self.params.head_layers)
        except ValueError as exc:
            raise self._split_error(exc) from None

    def shared_keys(self, ctx, arch: str) -> list[str]:
        return self.split_keys(ctx, arch)[0]

    def personal_keys(self, ctx, arch: str) -> list[str]:
        return self.split_keys(ctx, arch)[1]

    def load_personal(self, ctx, client):
        """The client's personal keys into its working model (initial weights if it never trained)."""
        personal = client.state.get("personal")
        if personal is None:
            init = ctx.models.initial_state(client.arch)
            personal = {k: init[k] for k in self.personal_keys(ctx, client.arch)}
        return load_state(client.model, personal)

    def keep_personal(self, ctx, client) -> None:
        if self.keeps_personal:
            state = client.model.state_dict()
            client.state["personal"] = {k: state[k].detach().clone() for k in self.personal_keys(ctx, client.arch)}

    # -- hooks ------------------------------------------------------------------------

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        for arch in spec_archs(spec):
            n = probe_num_layers(spec, arch)
            if n is not None:
                try:
                    resolve_split(n, self.params.head_layers)
                except ValueError as exc:
                    raise self._split_error(exc) from None

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)
        for arch in dict.fromkeys(ctx.models.client_archs):
            self.split_keys(ctx, arch)  # a split outside the real model's layers fails here
            self.log_resolved_split(ctx, arch)

    def log_resolved_split(self, ctx, arch: str) -> None:
        num_layers = len(layer_keys(ctx.models.working(arch)))  # e.g. none resolved to L - L // 2
        ctx.resolved_value(f"head_layers.{arch}", num_layers - self.base_layers(num_layers))

    def shared_global(self, ctx, client_id: int) -> dict:
        """The global model's shared keys for ``client_id``'s architecture."""
        glob = ctx.server["global"]
        return {"weights": {k: glob[k] for k in self.shared_keys(ctx, ctx.models.arch_of(client_id))}}

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return self.shared_global(ctx, client_id)

    @hookimpl
    def on_receive(self, ctx, client, message):
        self.load_personal(ctx, client)
        load_state(client.model, message["weights"])
        return True

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        self.keep_personal(ctx, client)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        state = client.model.state_dict()
        return {"weights": {k: state[k] for k in self.shared_keys(ctx, client.arch)}}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        averaged, _ = partial_average((weights[i], message["weights"]) for i, message in uploads)
        ctx.server["global"].update(averaged)  # nobody took part: unchanged
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.shared_global(ctx, client_id)

    @hookimpl
    def personalized_models(self, ctx, client, message):
        self.load_personal(ctx, client)
        return {"": load_state(client.model, message["weights"])}


def clone_keys(model: torch.nn.Module, keys) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: state[k].detach().clone() for k in keys}


__all__ = ["PartialModel", "SplitParams", "clone_keys", "clone_state", "only_training", "partial_average",
           "probe_model", "probe_num_layers", "resolve_split", "spec_archs"]
