"""pMixFed: "pMixFed: Efficient Personalized Federated Learning through Adaptive Layer-Wise
Mixup" (seeds/pmixfed.txt, Sections 5.2 and 6.5, Appendix 8.1). The paper lost its equations
in extraction; this implements the project's *revised* resolution (``METHODS.md``, pMixFed
section), an interpretation, with the decisions below where that resolution is silent.

Layers l = 1..L, base (input) to head (output): one parameterised module is one layer
(``pfl_core.models.layers``: a Conv2d, a Linear, a BatchNorm each count once, buffers go with
their module), in registration order, which is forward order for pfl's zoo. Layer L is the head.

    mix factor (Eq. 10)   gamma = sigmoid(k * (t/T)^2 * dAcc - b)      schedule "sigmoid-adaptive"
    broadcast  (App. 8.1.1, Eq. 11-12)
        mu_l = clip(1 - gamma / (1 - gamma) * (l-1)/(L-1), 0, 1)  for l < L,   mu_L = 0
        local_i,l <- mu_l * global_l + (1 - mu_l) * local_i,l     for the layers with mu_l > 0
    upload                the layers with mu_l > 0 and the head (layer L)
    aggregation (Eq. 13, App. 8.1.2)
        nu_l = gamma_agg * (1 - (l-1)/(L-1))                      (gamma_agg at the base, 0 at the head)
        global_l <- sum_i p_i [nu_l * global_l(prev) + (1 - nu_l) * local_i,l],   p_i = n_i / n

* Broadcast (per client i, round t of T): dAcc_i = Acc(local_i) - Acc(global), both on client
  i's *validation* split (never its test split); local_i is the client's model as it left its
  last round (the seeded initial weights before its first). mu_1 = 1 (the base is always fully
  shared) and mu_L = 0 (the global head is never sent down, App. 8.1.1). A larger gamma makes
  mu fall faster from base to head: at gamma = 0.5 it falls linearly and every layer below the
  head is shared; at gamma = 0.75 every layer past the lower third reaches 0.
* Frozen layers: a layer l < L with mu_l = 0 is *frozen* this round: it is not broadcast, not
  uploaded (so not counted as communication) and not aggregated from this client; the client
  keeps (and still trains) its own copy. The head is not "frozen": it is never sent down but
  always uploaded.
* Aggregation: every client uploads its non-frozen layers and its head; dAcc = mean over this
  round's participants of Acc(previous global) minus the mean of Acc(fresh local model), on
  their validation splits; gamma_agg from the same sigmoid, one for all clients. nu_L = 0, so
  the global head is the p-weighted average of the local heads and the global model is a
  complete, trained model (Acc(global) in dAcc is meaningful, cold-start clients receive a
  trained head). nu_l < 1 always, so the global base keeps learning. The sum over i runs over
  the clients that uploaded layer l, with p_i renormalised over them (a layer every
  participant froze keeps its previous global value).
* Heterogeneous clients (App. 8.3): the global model is the union of the clients' layers; a
  client layer *matches* the global entry with the same state-dict key and shape (the deepest
  architecture names the entries; a same-named layer of another shape gets its own entry
  ``key@arch``). mu_l and nu_l are computed on the layer's own architecture's L; a layer a
  client does not have takes no part in its broadcast or aggregation, so the deeper layers
  are learned by the clients that have them (renormalised p_i).

Decisions where the resolution is silent:

* Defaults k (``slope``) and b (``offset``) were lost in the paper's extraction; they are
  chosen by the validation sweep of ``specs/pmixfed_tuning.toml`` (docs/pmixfed-tuning.md:
  mean *validation* accuracy, never test).
* "Frozen" means excluded from communication, not from local training (the paper: the layer
  "will not be mixed up with the global model"); every layer trains for
  ``training.local_epochs`` epochs, so pMixFed's local budget is the default ``local_work``
  (``training.local_epochs`` private epochs per round; validation scoring is not training).
* In simulation the server-side broadcast hook measures dAcc on the client's validation data
  (a deployment would have the client measure it); that measurement is not counted as
  communication (the byte comparison with FedAlt/FedSim/FedAvg counts model layers). Each
  upload carries the client's fresh local validation accuracy (8 bytes, counted) for the
  aggregation-stage dAcc; the global model's accuracy, measured at the broadcast, stays on
  the server. "dynamic-only" and "beta" send none.
* The client mixes, so it must know mu: a broadcast whose sent layers include a fractional
  mu carries the sent layers' degrees (8 bytes each, counted); otherwise the sent layers
  are the ones with mu = 1 and the others have mu = 0, which the client reads off the
  message.
* "dynamic-only": gamma = ``gamma`` fixed, at broadcast and at aggregation.
* "beta" (the paper's mixup ablation, mu ~ Beta(a, a)): each layer strictly between base and
  head draws its own mu_l ~ Beta(a, a) per client and round; mu_1 = 1 and mu_L = 0 are kept
  (base shared, head never sent down, as in every pMixFed variant); gamma_agg ~ Beta(a, a)
  once per round. No mix factor is logged for the broadcast (there is none).
* A client that has never trained (partial participation) is evaluated with the whole global
  model (trained head included); a cold-start client receives the whole final global model
  (it has no local model to mix with) and fine-tunes it for ``experiment.coldstart_epochs``.
* The personalised model of a client that trained is its local model as it left its last
  round (after local training, before the next broadcast).
* A client whose validation split is empty uses dAcc = 0.
* A broadcast mix degree below 1e-9 is floating-point rounding at a boundary and counts as 0
  (gamma = 0.6, L = 4: 1 - 1.5 * 2/3 evaluates to 2e-16), so that layer is frozen.
* gamma rounds to exactly 1.0 in floating point for a large k * dAcc: mu is then 1 at the base
  and 0 everywhere else (the limit of the family).

Logged per round: ``gamma`` and ``frozen_layers`` per client (layers below the head with
mu = 0; the paper's Fig. 8 and Fig. 6a; in ``results/client_series.csv``), their mean, min
and max over the round's clients (``gamma_mean``, ``frozen_layers_min`` ...), and ``gamma_agg``.

Schedules are pluggable: ``SCHEDULES[name] = fn`` with
``fn(params, *, stage, num_layers, dacc, progress, rng) -> (gamma or None, degrees)``,
``stage`` "broadcast" (degrees = mu_1..mu_L) or "aggregate" (degrees = nu_1..nu_L);
``fn.uses_accuracy`` says whether it needs dAcc (else dacc is 0 and nothing is measured). A
schedule that gives the head mu_L > 0 broadcasts it too (mu = 1 everywhere and nu = 0 is FedAvg).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from attrs import define, field

from pfl_core.api import (
    FieldError,
    PartialModel,
    SpecError,
    at_least,
    between,
    choices_text,
    clone_state,
    described,
    finite,
    greater_than,
    hookimpl,
    layer_keys,
    load_state,
    partial_average,
    per_run,
    probe_num_layers,
    score,
    spec_archs,
)

# -- the schedule -------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def mix_factor(dacc: float, progress: float, slope: float, offset: float) -> float:
    """gamma = sigmoid(k * (t/T)^2 * dAcc - b)."""
    return sigmoid(slope * progress**2 * dacc - offset)


# A mix degree below this is rounding at a boundary (gamma = 0.6, L = 4: 1 - 1.5 * 2/3 gives
# 2e-16): it is 0, so the layer is frozen rather than sent to be mixed in at 2e-16.
ROUNDING = 1e-9


def broadcast_degrees(gamma: float, num_layers: int) -> list[float]:
    """mu_l = clip(1 - gamma/(1-gamma) * (l-1)/(L-1), 0, 1) for l < L and mu_L = 0 (l = 1..L)."""
    last = num_layers - 1
    if gamma >= 1.0:  # the limit: only the base is shared
        return [1.0] + [0.0] * last
    ratio = gamma / (1.0 - gamma)
    mu = [min(1.0, max(0.0, 1.0 - ratio * l / last)) for l in range(last)]
    return [0.0 if m < ROUNDING else m for m in mu] + [0.0]


def aggregation_degrees(gamma: float, num_layers: int) -> list[float]:
    """nu_l = gamma * (1 - (l-1)/(L-1)): gamma at the base, 0 at the head."""
    last = num_layers - 1
    return [gamma * (1.0 - l / last) for l in range(num_layers)]


def frozen_count(mu: list[float]) -> int:
    """Frozen layers: below the head with mu_l = 0 (neither broadcast nor uploaded)."""
    return sum(1 for m in mu[:-1] if m == 0)


def _degrees(stage: str, gamma: float, num_layers: int) -> list[float]:
    return (broadcast_degrees if stage == "broadcast" else aggregation_degrees)(gamma, num_layers)


def sigmoid_adaptive(params, *, stage, num_layers, dacc, progress, rng):
    gamma = mix_factor(dacc, progress, params.slope, params.offset)
    return gamma, _degrees(stage, gamma, num_layers)


sigmoid_adaptive.uses_accuracy = True


def dynamic_only(params, *, stage, num_layers, dacc, progress, rng):
    return params.gamma, _degrees(stage, params.gamma, num_layers)


dynamic_only.uses_accuracy = False


def beta_sampled(params, *, stage, num_layers, dacc, progress, rng):
    a = params.beta_a
    if stage == "aggregate":
        gamma = float(rng.beta(a, a))
        return gamma, aggregation_degrees(gamma, num_layers)
    middle = [float(v) for v in rng.beta(a, a, size=num_layers - 2)]
    return None, [1.0, *middle, 0.0]


beta_sampled.uses_accuracy = False

SCHEDULES: dict[str, Callable] = {
    "sigmoid-adaptive": sigmoid_adaptive,
    "dynamic-only": dynamic_only,
    "beta": beta_sampled,
}


@described(choices_text(SCHEDULES))
def _known_schedule(_instance, attribute, value):
    if value not in SCHEDULES:
        raise FieldError(attribute.name, f"must be one of {', '.join(map(repr, SCHEDULES))}, got {value!r}")


@define
class PMixFedParams:
    schedule: str = field(default="sigmoid-adaptive", validator=_known_schedule, metadata={
        "doc": "the mix factor: gamma = sigmoid(k (t/T)^2 dAcc - b) (Eq. 10); gamma fixed; or mixup "
               "degrees drawn from Beta(beta_a, beta_a) (the paper's ablation)"})
    # Eq. 10's k and b (lost in extraction): chosen by specs/pmixfed_tuning.toml (docs/pmixfed-tuning.md).
    # k < 0 would share *more* of the global model when the local one is better: refused.
    offset: float = field(default=1.0, validator=finite, metadata={
        "doc": "b of Eq. 10 (lost in the paper's extraction; chosen by specs/pmixfed_tuning.toml)"})
    slope: float = field(default=50.0, validator=[finite, at_least(0)], metadata={
        "doc": "k of Eq. 10 (chosen likewise); k < 0 would share more of the global model when the local "
               "one is better"})
    gamma: float = field(default=0.5, validator=[finite, between(0, 1, low_open=True, high_open=True)],
                         metadata={"doc": 'the fixed mix factor of "dynamic-only", at broadcast and aggregation'})
    beta_a: float = field(default=1.0, validator=[finite, greater_than(0)],
                          metadata={"doc": 'a of Beta(a, a) in "beta"'})


# -- the plugin ---------------------------------------------------------------------------


def val_accuracy(ctx, client, model) -> float | None:
    if len(client.data.val_y) == 0:
        return None
    return score(model, client.data.val_x, client.data.val_y, ctx.spec.evaluation.batch_size).accuracy


class PMixFed(PartialModel):
    name = "pmixfed"
    Params = PMixFedParams

    @property
    def schedule(self):
        return SCHEDULES[self.params.schedule]

    def not_deployable(self) -> str | None:
        """Why the client side cannot run on Flower nodes (pfl_core/deploy/flower.py), or None."""
        if not self.schedule.uses_accuracy:
            return None
        return (f"algorithm.params.schedule = {self.params.schedule!r} measures each client's local and global "
                f"accuracy on its validation split at broadcast (Eq. 10's dAcc), on the server, which in a "
                f"deployment holds neither the client's model nor its data; 'dynamic-only' and 'beta' run")

    # -- the global model and its layers ---------------------------------------------

    @hookimpl
    def check_spec(self, spec):  # any architectures; each needs a base and a head
        for arch in spec_archs(spec):
            n = probe_num_layers(spec, arch)
            if n is not None and n < 2:
                raise SpecError("model.name", f"pmixfed mixes layers from base to head: {arch} has {n} layer(s), "
                                              f"it needs at least 2")

    def layout(self, ctx) -> tuple[dict, dict, dict]:
        """(layers, keymap, position): each architecture's layers (lists of state-dict keys), its
        keys' names in the global model, and each global key's (layer index, L) in the
        architecture that owns it. A function of the models, computed by whichever side needs it
        (server and clients), once per run."""
        return per_run(ctx, self, "layout", lambda: self._layout(ctx))

    def _layout(self, ctx) -> tuple[dict, dict, dict]:
        archs = list(dict.fromkeys(ctx.models.client_archs))
        layers = {arch: layer_keys(ctx.models.working(arch)) for arch in archs}
        for arch in archs:
            if len(layers[arch]) < 2:
                raise SpecError("model.name", f"pmixfed mixes layers from base to head: {arch} has "
                                              f"{len(layers[arch])} layer(s), it needs at least 2")
        shapes, keymap, position = {}, {}, {}
        for arch in sorted(archs, key=lambda a: -len(layers[a])):  # the deepest names the entries
            init = ctx.models.initial_state(arch)
            keymap[arch] = {}
            for index, keys in enumerate(layers[arch]):
                for key in keys:
                    gk = key if key not in shapes or shapes[key] == init[key].shape else f"{key}@{arch}"
                    if gk not in shapes:
                        shapes[gk] = init[key].shape
                        position[gk] = (index, len(layers[arch]))
                    keymap[arch][key] = gk
        return layers, keymap, position

    @hookimpl
    def setup(self, ctx):
        _, keymap, _ = self.layout(ctx)
        glob = {}
        for arch, names in keymap.items():  # the deepest architecture first: it names the entries
            init = ctx.models.initial_state(arch)
            for key, gk in names.items():
                if gk not in glob:
                    glob[gk] = init[key].detach().clone()
        ctx.server["global"] = glob
        ctx.server["mix"] = {}

    def global_for(self, ctx, arch: str) -> dict[str, torch.Tensor]:
        glob = ctx.server["global"]
        return {key: glob[gk] for key, gk in self.layout(ctx)[1][arch].items()}

    def local_state(self, ctx, client) -> dict[str, torch.Tensor]:
        return client.state.get("local") or ctx.models.initial_state(client.arch)

    # -- broadcast ---------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        client = ctx.client(client_id)
        if client_id in ctx.coldstart_clients:  # a newcomer: the whole global model, nothing mixed
            return {"weights": self.global_for(ctx, client.arch)}
        layers_of, keymap_of, _ = self.layout(ctx)
        layers = layers_of[client.arch]
        dacc, acc_global = 0.0, None
        if self.schedule.uses_accuracy:
            acc_local = val_accuracy(ctx, client, load_state(client.model, self.local_state(ctx, client)))
            acc_global = val_accuracy(ctx, client, load_state(client.model, self.global_for(ctx, client.arch)))
            if acc_local is not None:
                dacc = acc_local - acc_global
        gamma, mu = self.schedule(self.params, stage="broadcast", num_layers=len(layers), dacc=dacc,
                                  progress=ctx.round / ctx.spec.experiment.rounds, rng=client.rng("pmixfed_mix"))
        ctx.server["mix"][client_id] = {"mu": list(mu), "gamma": gamma, "acc_global": acc_global}
        client.log(frozen_layers=frozen_count(mu), **({"gamma": gamma} if gamma is not None else {}))
        keymap, glob = keymap_of[client.arch], ctx.server["global"]
        message = {"weights": {keymap[k]: glob[keymap[k]] for m, keys in zip(mu, layers) if m > 0 for k in keys}}
        sent_degrees = [float(m) for m in mu if m > 0]
        if any(m < 1 for m in sent_degrees):  # the client mixes: it needs the degrees of what it gets
            message["mu"] = sent_degrees
        return message

    @staticmethod
    def received_degrees(message, layers, keymap) -> list[float]:
        """mu per layer from a broadcast: 0 for a layer not sent (frozen), else its degree in
        ``message["mu"]`` (sent when some degree is fractional; otherwise every sent one is 1)."""
        sent, given = message["weights"], iter(message.get("mu", ()))
        return [next(given, 1.0) if keymap[keys[0]] in sent else 0.0 for keys in layers]

    @hookimpl
    def on_receive(self, ctx, client, message):
        layers_of, keymap_of, _ = self.layout(ctx)
        layers, keymap = layers_of[client.arch], keymap_of[client.arch]
        mu = client.scratch["mu"] = self.received_degrees(message, layers, keymap)
        load_state(client.model, self.local_state(ctx, client))
        sent = message["weights"]
        with torch.no_grad():
            own = client.model.state_dict()
            for m, keys in zip(mu, layers):
                if m == 0:
                    continue  # frozen: the local layer as it is
                for key in keys:
                    g = sent[keymap[key]]
                    if m == 1 or not g.is_floating_point():
                        own[key].copy_(g)
                    else:  # mu * global + (1 - mu) * local
                        own[key].mul_(1.0 - m).add_(g, alpha=m)
        return True

    # -- local training and upload ------------------------------------------------------

    @hookimpl
    def local_train(self, ctx, client):
        metrics = client.train()
        client.state["local"] = clone_state(client.model)
        if self.schedule.uses_accuracy:
            client.scratch["acc_local"] = val_accuracy(ctx, client, client.model)
        return metrics

    @hookimpl
    def client_upload(self, ctx, client):
        mu = client.scratch["mu"]
        layers_of, keymap_of, _ = self.layout(ctx)
        layers, keymap = layers_of[client.arch], keymap_of[client.arch]
        state = client.model.state_dict()
        sent = [keys for m, keys in zip(mu, layers) if m > 0]
        if mu[-1] == 0:
            sent.append(layers[-1])  # the head: never sent down, always uploaded
        upload = {"weights": {keymap[k]: state[k] for keys in sent for k in keys}}
        if self.schedule.uses_accuracy and client.scratch["acc_local"] is not None:
            upload["val_acc_local"] = client.scratch["acc_local"]  # the global's the server measured itself
        return upload

    # -- aggregation --------------------------------------------------------------------

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        acc_local, acc_global = [], []

        def pairs():
            for i, message in uploads:
                if "val_acc_local" in message:
                    acc_local.append(message["val_acc_local"])
                    acc_global.append(ctx.server["mix"][i]["acc_global"])  # measured at its broadcast
                yield weights[i], message["weights"]

        averaged, _ = partial_average(pairs())
        dacc = float(np.mean(acc_global) - np.mean(acc_local)) if acc_local else 0.0
        glob, position = ctx.server["global"], self.layout(ctx)[2]
        nu_for, gamma_agg = {}, None
        for gk, avg in averaged.items():
            index, num_layers = position[gk]
            if num_layers not in nu_for:
                gamma_agg, nu_for[num_layers] = self.schedule(
                    self.params, stage="aggregate", num_layers=num_layers, dacc=dacc,
                    progress=ctx.round / ctx.spec.experiment.rounds, rng=ctx.rng("pmixfed_mix"))
            nu = nu_for[num_layers][index]
            if nu == 0 or not avg.is_floating_point():
                glob[gk] = avg
            else:  # nu * global(prev) + (1 - nu) * sum_i p_i local_i
                glob[gk] = avg.mul_(1.0 - nu).add_(glob[gk], alpha=nu)
        mixes = [ctx.server["mix"][i] for i in ctx.participants if i in ctx.server["mix"]]
        gammas = [m["gamma"] for m in mixes if m["gamma"] is not None]
        metrics = {"frozen_layers_mean": float(np.mean([frozen_count(m["mu"]) for m in mixes]))} if mixes else {}
        if gammas:
            metrics["gamma_mean"] = float(np.mean(gammas))
        if gamma_agg is not None:
            metrics["gamma_agg"] = gamma_agg
        ctx.log(metrics)
        return True

    # -- evaluation and newcomers --------------------------------------------------------

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return {"weights": self.global_for(ctx, ctx.models.arch_of(client_id))}  # for a client never trained

    @hookimpl
    def personalized_models(self, ctx, client, message):
        local = client.state.get("local")
        return {"": load_state(client.model, local if local is not None else message["weights"])}

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        load_state(client.model, message["weights"])  # the whole global model (on_broadcast to a newcomer)
        client.train(epochs=ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}
