"""pMixFed: "pMixFed: Efficient Personalized Federated Learning through Adaptive Layer-Wise
Mixup" (seeds/pmixfed.txt, Section 5 and Appendix 8). The paper lost its equations in
extraction; this implements the project's resolution (``METHODS.md``, pMixFed section), an
*interpretation*, with the decisions below where that resolution is silent.

Layers l = 1..L, base (input) to head (output): one parameterised module is one layer
(``pfl_core.models.layers``: a Conv2d, a Linear, a BatchNorm each count once, buffers go with
their module), in registration order, which is forward order for pfl's zoo.

    mix factor      gamma = sigmoid(k * (t/T)^2 * dAcc - b)            (schedule "sigmoid-adaptive")
    mix degree      mu_l  = clip(1 - (l-1) / ((L-1)(1-gamma)), 0, 1)   mu_1 = 1, mu_L = 0
    broadcast       local_i,l <- mu_l * global_l + (1 - mu_l) * local_i,l
    aggregation     global_l <- sum_i p_i [nu_l * global_l(prev) + (1 - nu_l) * local_i,l]
                    nu_l = gamma_agg * (1 - (l-1)/(L-1)),  p_i = n_i / n

* Broadcast (per client i, round t of T): dAcc_i = Acc(local_i) - Acc(global), both on client
  i's *validation* split (never its test split); local_i is the client's model as it left its
  last round (the seeded initial weights before its first). A larger gamma makes mu fall
  faster, so more layers reach exactly 0 ("frozen"). A layer with mu_l = 0 is neither sent
  down nor uploaded (so it is not counted as communication) nor aggregated.
* Aggregation: dAcc = mean over this round's participants of Acc(previous global) minus the
  mean of Acc(fresh local model), on their validation splits; gamma_agg from the same sigmoid,
  the same for all clients; nu_l < 1 always, so the global base keeps learning. The sum over i
  runs over the clients that uploaded layer l, with p_i renormalised over them.
* Heterogeneous clients: the global model is the union of the clients' layers; a client layer
  *matches* the global entry with the same state-dict key and shape (the deepest
  architecture names the entries; a same-named layer of another shape gets its own entry
  ``key@arch``). mu_l is computed on the client's own L; a layer a client does not have
  takes no part in its broadcast or aggregation, so the deeper layers are learned by the
  clients that have them (renormalised p_i).

Decisions where the resolution is silent (also in docs/reproductions.md):

* Defaults b = 0, k = 10 (the paper's values were lost): b = 0 centres the sigmoid where
  local and global are equally accurate (gamma = 0.5 whenever t/T is small); k = 10 lets a
  10-point accuracy gap at the last round move gamma from 0.5 to 0.73.
* Acc(global) is the global model as stored. Its head (mu_L = 0, never shared) keeps the
  seeded initial weights, so Acc(global) stays near chance on label-skewed clients and dAcc
  grows as the local models learn: more layers freeze as training advances (paper Fig. 6a).
* In simulation the server-side broadcast hook measures dAcc on the client's validation data
  (a deployment would have the client measure it and request the layers with mu > 0; that
  request is not counted). Each upload carries the client's two validation accuracies (16
  bytes, counted) for the aggregation-stage dAcc; "dynamic-only" and "beta" send none.
* "dynamic-only": gamma = ``gamma`` fixed, at broadcast and at aggregation.
* "beta" (the paper's mixup ablation, mu ~ Beta(a, a)): each layer between base and head
  draws its own mu_l ~ Beta(a, a) per client and round; mu_1 = 1 and mu_L = 0 are kept (the
  base is shared, the head personal, as in every pMixFed variant); gamma_agg ~ Beta(a, a) once
  per round. No mix factor is logged for the broadcast (there is none).
* A client that has never trained (partial participation) is evaluated with the global model;
  a cold-start client takes the whole final global model (mu = 1 on every layer: it has no
  local model to mix with; the global head is the initial one) and fine-tunes it for
  ``experiment.coldstart_epochs`` epochs.
* A client whose validation split is empty uses dAcc = 0.

Logged per round: ``gamma/<client>`` and ``frozen_layers/<client>`` (the paper's Fig. 8 and
Fig. 6a), their means ``gamma_mean`` and ``frozen_layers_mean``, and ``gamma_agg``.

Schedules are pluggable: ``SCHEDULES[name] = fn`` with
``fn(params, *, stage, num_layers, dacc, progress, rng) -> (gamma or None, degrees)``,
``stage`` "broadcast" (degrees = mu_1..mu_L) or "aggregate" (degrees = nu_1..nu_L);
``fn.uses_accuracy`` says whether it needs dAcc (else dacc is 0 and nothing is measured).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from attrs import define, field

from pfl_core import SpecError, hookimpl
from pfl_core.context import clone_state, load_state
from pfl_core.evaluation import score
from pfl_core.models.layers import layer_keys
from pfl_core.spec import FieldError, between, finite, greater_than
from plugins.partial import PartialModel, partial_average, probe_num_layers, spec_archs

# -- the schedule -------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def mix_factor(dacc: float, progress: float, slope: float, offset: float) -> float:
    """gamma = sigmoid(k * (t/T)^2 * dAcc - b)."""
    return sigmoid(slope * progress**2 * dacc - offset)


def broadcast_degrees(gamma: float, num_layers: int) -> list[float]:
    """mu_l = clip(1 - (l-1) / ((L-1)(1-gamma)), 0, 1), l = 1..L: 1 at the base, 0 at the head."""
    last = num_layers - 1
    if gamma >= 1.0:  # the limit: only the base is shared
        return [1.0] + [0.0] * last
    return [min(1.0, max(0.0, 1.0 - l / (last * (1.0 - gamma)))) for l in range(num_layers)]


def aggregation_degrees(gamma: float, num_layers: int) -> list[float]:
    """nu_l = gamma * (1 - (l-1)/(L-1)): gamma at the base, 0 at the head."""
    last = num_layers - 1
    return [gamma * (1.0 - l / last) for l in range(num_layers)]


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


def _known_schedule(_instance, attribute, value):
    if value not in SCHEDULES:
        raise FieldError(attribute.name, f"must be one of {', '.join(map(repr, SCHEDULES))}, got {value!r}")


@define
class PMixFedParams:
    schedule: str = field(default="sigmoid-adaptive", validator=_known_schedule)
    offset: float = field(default=0.0, validator=finite)  # b
    slope: float = field(default=10.0, validator=finite)  # k
    gamma: float = field(default=0.5, validator=[finite, between(0, 1, low_open=True, high_open=True)])
    beta_a: float = field(default=1.0, validator=[finite, greater_than(0)])


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

    # -- the global model and its layers ---------------------------------------------

    @hookimpl
    def check_spec(self, spec):  # any architectures; each needs a base and a head
        for arch in spec_archs(spec):
            n = probe_num_layers(spec, arch)
            if n is not None and n < 2:
                raise SpecError("model.name", f"pmixfed mixes layers from base to head: {arch} has {n} layer(s), "
                                              f"it needs at least 2")

    @hookimpl
    def setup(self, ctx):
        archs = list(dict.fromkeys(ctx.models.client_archs))
        layers = {arch: layer_keys(ctx.models.working(arch)) for arch in archs}
        for arch in archs:
            if len(layers[arch]) < 2:
                raise SpecError("model.name", f"pmixfed mixes layers from base to head: {arch} has "
                                              f"{len(layers[arch])} layer(s), it needs at least 2")
        glob, keymap, position = {}, {}, {}
        for arch in sorted(archs, key=lambda a: -len(layers[a])):  # the deepest names the entries
            init = ctx.models.initial_state(arch)
            keymap[arch] = {}
            for index, keys in enumerate(layers[arch]):
                for key in keys:
                    gk = key if key not in glob or glob[key].shape == init[key].shape else f"{key}@{arch}"
                    if gk not in glob:
                        glob[gk] = init[key].detach().clone()
                        position[gk] = (index, len(layers[arch]))
                    keymap[arch][key] = gk
        ctx.server["global"] = glob
        ctx.server["keymap"] = keymap
        ctx.server["layers"] = layers
        ctx.server["position"] = position  # global key -> (layer index, L) in its owning arch
        ctx.server["mix"] = {}

    def global_for(self, ctx, arch: str) -> dict[str, torch.Tensor]:
        glob = ctx.server["global"]
        return {key: glob[gk] for key, gk in ctx.server["keymap"][arch].items()}

    def local_state(self, ctx, client) -> dict[str, torch.Tensor]:
        return client.state.get("local") or ctx.models.initial_state(client.arch)

    # -- broadcast ---------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        client = ctx.client(client_id)
        layers = ctx.server["layers"][client.arch]
        dacc, acc_global = 0.0, None
        if self.schedule.uses_accuracy:
            acc_local = val_accuracy(ctx, client, load_state(client.model, self.local_state(ctx, client)))
            acc_global = val_accuracy(ctx, client, load_state(client.model, self.global_for(ctx, client.arch)))
            if acc_local is not None:
                dacc = acc_local - acc_global
        gamma, mu = self.schedule(self.params, stage="broadcast", num_layers=len(layers), dacc=dacc,
                                  progress=ctx.round / ctx.spec.experiment.rounds, rng=client.rng("pmixfed_mix"))
        ctx.server["mix"][client_id] = {"mu": list(mu), "gamma": gamma, "acc_global": acc_global}
        frozen = sum(1 for m in mu if m == 0)
        ctx.log({f"frozen_layers/{client_id}": frozen, **({f"gamma/{client_id}": gamma} if gamma is not None else {})})
        keymap, glob = ctx.server["keymap"][client.arch], ctx.server["global"]
        return {"weights": {keymap[k]: glob[keymap[k]] for m, keys in zip(mu, layers) if m > 0 for k in keys}}

    @hookimpl
    def on_receive(self, ctx, client, message):
        mu = ctx.server["mix"][client.id]["mu"]
        layers = ctx.server["layers"][client.arch]
        keymap = ctx.server["keymap"][client.arch]
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
        mix = ctx.server["mix"][client.id]
        layers = ctx.server["layers"][client.arch]
        keymap = ctx.server["keymap"][client.arch]
        state = client.model.state_dict()
        upload = {"weights": {keymap[k]: state[k] for m, keys in zip(mix["mu"], layers) if m > 0 for k in keys}}
        if self.schedule.uses_accuracy and client.scratch["acc_local"] is not None:
            upload["val_acc_local"] = client.scratch["acc_local"]
            upload["val_acc_global"] = mix["acc_global"]
        return upload

    # -- aggregation --------------------------------------------------------------------

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        acc_local, acc_global = [], []

        def pairs():
            for i, message in uploads:
                if "val_acc_local" in message:
                    acc_local.append(message["val_acc_local"])
                    acc_global.append(message["val_acc_global"])
                yield weights[i], message["weights"]

        averaged, _ = partial_average(pairs())
        dacc = float(np.mean(acc_global) - np.mean(acc_local)) if acc_local else 0.0
        glob, position = ctx.server["global"], ctx.server["position"]
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
        metrics = {"frozen_layers_mean": float(np.mean([sum(1 for v in m["mu"] if v == 0) for m in mixes]))}
        if gammas:
            metrics["gamma_mean"] = float(np.mean(gammas))
        if gamma_agg is not None:
            metrics["gamma_agg"] = gamma_agg
        ctx.log(metrics)
        return True

    # -- evaluation and newcomers --------------------------------------------------------

    @hookimpl
    def personalized_models(self, ctx, client):
        local = client.state.get("local")
        return {"": load_state(client.model, local if local is not None else self.global_for(ctx, client.arch))}

    @hookimpl
    def coldstart_personalize(self, ctx, client):
        load_state(client.model, self.global_for(ctx, client.arch))
        client.train(epochs=ctx.spec.experiment.coldstart_epochs)
        return {"": client.model}
