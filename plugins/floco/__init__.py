"""Floco: Grinwald, Wiesner and Nakajima, "Federated Learning over Connected Modes", NeurIPS 2024
(arXiv:2403.03333).

What was read: the paper's abstract and summaries of its method (a solution simplex in the last
layer, clients placed in it by a PCA of their gradient signals, subregions that are L1 balls
around the placed points); its method section, equations and algorithm box could not be read
from this machine, so the step labels (F1)-(F6) below are ours and every detail follows the
reference implementation of FL-bench, read in full, not copied (github.com/KarhouTam/FL-bench at
commit 06e658bca5af6ce732e25bb7c0f8be321e14a85e, ``src/server/floco.py`` and
``src/client/floco.py``). PFLlib has no Floco.

The model's last layer (a ``Linear``) has M weight matrices W_1..W_M, the vertices of the
solution simplex, and one shared bias; a point alpha of the simplex gives the layer the weight
sum_m alpha_m W_m. The rest of the model (the base) is one shared set of weights.

    (F1) setup: W_m drawn Xavier-normal, independently (FedAvg's initial base and bias)   (setup)
    each round t, each participant i, given the base, the bias and W_1..W_M:      (on_broadcast)
    (F2) local training, training.local_epochs epochs of the configured optimiser on base, bias
         and every W_m; each mini-batch draws its own alpha:                       (local_train)
           before client i has a subregion: alpha ~ Uniform(simplex) (normalised Exp(1) draws);
           after: alpha = beta_i + r u, r ~ U(0, rho), u = v / |v|_1, v ~ U(-1, 1)^M (FL-bench's
           draw "in the L1 ball of radius rho around beta_i")
    (F3) the server averages base, bias and each W_m over the arrived uploads with the
         client_weighting weights (train sizes), as FedAvg                    (server_aggregate)
    (F4) round tau: every training client takes part (select_clients). After the round's
         training, each arrived client's trained vertices, flattened to one vector, form the rows
         of X; kappa = the first M principal-component scores of X (PCA: X centred, SVD, the
         sign of each axis fixed so that its largest-magnitude entry is positive; fewer than M
         components are padded with zeros)                                      (server_aggregate)
    (F5) for each z in linspace(1e-4, 1, 1000): B_z = each row of kappa projected onto
         {b >= 0, sum b = z} (Euclidean, sort-based), divided by z; keep the B_z of lowest
         log Riesz 2-energy, log(sum_{i<j} 1 / max(|b_i - b_j|, 1e-4)^2) - log(#pairs), the
         first z on ties: the most spread-out placement. beta_i = row i of that B_z; from round
         tau + 1 on client i trains in its subregion (F2)                      (server_aggregate)
    (F6) evaluation: client i on the model whose last-layer weight is sum_m beta_im W_m (the
         subregion's centre), or the simplex centre (alpha_m = 1/M) for a client without one
         (before round tau, or whose round-tau upload was lost)          (evaluation_message)

Floco+ (``personal_epochs`` > 0): each client also keeps a personal simplex v_i (base, bias and
M vertices of its own), which never leaves it:

    (P1) after (F2), v_i <- personal_epochs epochs on F_i(v_i) + lam/2 ||v_i - w||^2, w the
         global simplex received this round (Ditto's pull), alpha drawn as in (F2) from the
         client's own stream; v_i starts as the first global simplex it receives   (local_train)
    (P2) evaluation: client i on v_i at the point of (F6); on the global simplex before its
         first personal pass                                             (personalized_models)

Parameters (FL-bench's defaults): ``endpoints`` (M, 10), ``tau`` (10), ``rho`` (0.1),
``personal_epochs`` (0: Floco; FL-bench's ``pers_epoch``), ``lam`` (1; its ``lamda``).

Decisions and deviations:

- From FL-bench: at round tau it trains every client an extra time, uses only that pass for the
  projection, and then trains the round's own participants from the same model. Here round tau
  is one round of every training client whose uploads serve both the projection and the
  average (no extra pass of local work, and the budget counts what ran). FL-bench's tau counts
  rounds from 0, so its signal comes from the model after tau rounds; here from the model after
  tau - 1 rounds, and the subregions apply from round tau + 1 in both.
- The gradient signal: FL-bench's clients upload their trained vertices (not the change), and
  its PCA centres them; the same here. Centring removes the common starting point, so this is
  the PCA of the clients' updates.
- PCA: FL-bench calls scikit-learn (not a pfl dependency); here numpy's SVD with
  scikit-learn's sign convention (>= 1.5, largest entry of each axis positive). scikit-learn
  refuses fewer clients than M; here the missing components are zeros.
- The draw of (F2) is FL-bench's: r u has L1 norm r <= rho, but its entries need not sum to 0,
  so alpha can leave the simplex (sum != 1, entries < 0 near a face). Kept as the reference
  does it, because the paper's exact sampling could not be read.
- A client whose round-tau upload is lost (``dropout``) gets no subregion: it keeps drawing
  from the whole simplex and is evaluated at the simplex centre. No client keeps state of its
  own (the subregions live on the server), so nothing is staged.
- Floco+ (P1) from FL-bench (``pers_epoch``, ``lamda``): its gradient adds lamda * v - w, not
  lamda * (v - w) (the pull of Ditto, which the paper names); here lam (v - w), the gradient of
  lam/2 ||v - w||^2, over the trained parameters by name (FL-bench pairs parameters with the
  state dict's values by position, which misaligns under BatchNorm buffers). FL-bench's
  personal model never receives the subregion, so it trains on the whole simplex and is
  scored at its centre; here it trains in, and is scored at the centre of, the client's
  subregion. FL-bench starts every v_i at the initial model; here at the first global simplex
  the client receives (a client cannot rebuild the server's initial vertices). The personal
  pass reuses the round's batch order. v_i is the client's own: it advances whether or not the
  round's upload arrives (as Ditto's), so it is not staged.
- Cold-start clients (``experiment.coldstart_clients``) receive the simplex-centre model and
  fine-tune it as a plain network (experiment.coldstart_epochs, the core default).
- Budget: training.local_epochs + personal_epochs private epochs per round (local_work).
- Bytes: down the model with its last layer at the client's point (sum_m beta_im W_m), the M
  vertices and beta_i; up the base, the bias and the M vertices (the model's own last-layer
  weight is not uploaded: it is recomputed from the vertices).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from attrs import define, field
from torch import nn
from torch.func import functional_call

from pfl_core.api import (
    LocalWork,
    SpecError,
    WeightAveraging,
    at_least,
    finite,
    greater_than,
    hookimpl,
    load_state,
    model_key,
    parameterised_layers,
    per_run,
    weighted_average,
)

PERSONAL_ENDPOINTS = "floco.endpoints"  # the personal vertices' key in client.state["personal"]
ENERGY_FLOOR = 1e-4  # the shortest distance counted in the Riesz energy (F5): coincident points stay finite
RADII = np.linspace(1e-4, 1, 1000)  # the z searched in (F5)


@define
class FlocoParams:
    endpoints: int = field(default=10, validator=at_least(2), metadata={
        "doc": "M, the vertices of the solution simplex in the last layer (F1). Default: FL-bench's 10"})
    tau: int = field(default=10, validator=at_least(1), metadata={
        "doc": "the round in which every training client takes part and the server places the clients in the "
               "simplex (F4, F5); subregions apply from round tau + 1. At most experiment.rounds. "
               "Default: FL-bench's 10"})
    rho: float = field(default=0.1, validator=[finite, greater_than(0)], metadata={
        "doc": "radius of each client's L1-ball subregion around its beta_i (F2). Default: FL-bench's 0.1"})
    personal_epochs: int = field(default=0, validator=at_least(0), metadata={
        "doc": "Floco+: epochs of each participant's personal simplex per round (P1); 0 is Floco (no personal "
               "model). Default: FL-bench's 0"})
    lam: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "Floco+: weight lambda of the pull lambda/2 ||v_i - w||^2 of the personal simplex to the received "
               "global one (P1). Default: FL-bench's 1"})


def last_linear(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The model's last parameterised layer and its name, if it is a Linear (else None)."""
    name, layer = parameterised_layers(model)[-1]
    return (name, layer) if isinstance(layer, nn.Linear) else None


def initial_endpoints(shape: tuple[int, int], count: int, generator: torch.Generator) -> torch.Tensor:
    """(F1) ``count`` Xavier-normal weight matrices of ``shape`` (out, in), stacked."""
    out_features, in_features = shape
    std = math.sqrt(2.0 / (in_features + out_features))
    return torch.randn((count, out_features, in_features), generator=generator) * std


def combine(endpoints: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """sum_m alpha_m W_m."""
    return torch.tensordot(alpha.to(endpoints.dtype), endpoints, dims=1)


def draw_alpha(count: int, center: torch.Tensor | None, rho: float, generator: torch.Generator) -> torch.Tensor:
    """(F2) one mini-batch's point: uniform on the simplex without a subregion, else FL-bench's
    draw around ``center``."""
    if center is None:
        sample = torch.empty(count, dtype=torch.float64).exponential_(generator=generator)
        return sample / sample.sum()
    direction = torch.rand(count, dtype=torch.float64, generator=generator) * 2 - 1
    direction = direction / direction.abs().sum()
    radius = torch.rand((), dtype=torch.float64, generator=generator) * rho
    return center.to(torch.float64) + radius * direction


def principal_scores(rows: np.ndarray, components: int) -> np.ndarray:
    """(F4) the first ``components`` PCA scores of ``rows`` (n, d); zero columns past the rank."""
    centred = rows - rows.mean(axis=0, keepdims=True)
    u, s, vt = np.linalg.svd(centred, full_matrices=False)
    largest = np.argmax(np.abs(vt), axis=1)
    signs = np.sign(vt[np.arange(vt.shape[0]), largest])
    signs[signs == 0] = 1.0
    scores = (u * signs) * s
    out = np.zeros((rows.shape[0], components))
    k = min(components, scores.shape[1])
    out[:, :k] = scores[:, :k]
    return out


def project_onto_simplex(points: np.ndarray, z: float) -> np.ndarray:
    """Each row's Euclidean projection onto {b >= 0, sum b = z} (the sort-based algorithm)."""
    ordered = -np.sort(-points, axis=1)
    excess = np.cumsum(ordered, axis=1) - z
    ranks = np.arange(1, points.shape[1] + 1)
    support = np.count_nonzero(ordered - excess / ranks > 0, axis=1)
    shift = excess[np.arange(len(points)), support - 1] / support
    return np.maximum(points - shift[:, None], 0.0)


def log_riesz_energy(points: np.ndarray) -> float:
    """log of the mean Riesz 2-energy 1 / d^2 over the pairs of rows (d floored at ENERGY_FLOOR)."""
    upper = np.triu_indices(len(points), 1)
    distances = np.sqrt(((points[:, None] - points[None, :]) ** 2).sum(axis=2))[upper]
    distances = np.maximum(distances, ENERGY_FLOOR)
    return float(np.log((1.0 / distances**2).sum()) - np.log(len(distances)))


def place_clients(rows: np.ndarray, endpoints: int) -> tuple[np.ndarray, float]:
    """(F4, F5) each row's point beta in the simplex, and the z chosen."""
    kappa = principal_scores(rows, endpoints)
    if len(rows) < 2:  # no pair to spread: the unit simplex's projection
        return project_onto_simplex(kappa, 1.0), 1.0
    best, best_z, lowest = None, None, np.inf
    for z in RADII:
        betas = project_onto_simplex(kappa, z)
        betas = betas / betas.sum(axis=1, keepdims=True)
        energy = log_riesz_energy(betas)
        if np.isfinite(energy) and energy < lowest:
            best, best_z, lowest = betas, float(z), energy
    return best, best_z


class SimplexModel(nn.Module):
    """``model`` whose last-layer weight is sum_m alpha_m W_m, alpha drawn anew at each forward (F2)."""

    def __init__(self, model: nn.Module, weight_key: str, endpoints: nn.Parameter, draw):
        super().__init__()
        self.model = model
        self.endpoints = endpoints
        self.weight_key = weight_key
        self.draw = draw

    def forward(self, x):
        weight = combine(self.endpoints, self.draw())
        return functional_call(self.model, {self.weight_key: weight}, (x,))


class Floco(WeightAveraging):
    """Floco (Grinwald et al. 2024): the last layer is a simplex of M weight matrices; after round
    tau each client trains in, and is evaluated at the centre of, its own subregion, placed by a
    PCA of the clients' trained vertices (see the module doc)."""

    name = "floco"
    Params = FlocoParams

    def local_work(self, spec) -> LocalWork:
        return LocalWork(float(spec.training.local_epochs + self.params.personal_epochs))

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)
        if self.params.tau > spec.experiment.rounds:
            raise SpecError(f"{self.spec_path}.params.tau", f"must not exceed experiment.rounds "
                            f"({spec.experiment.rounds}): the clients would never be placed in the simplex")

    def weight_key(self, ctx) -> str:
        """The state-dict key of the last layer's weight (the simplex's place)."""
        def compute():
            with torch.random.fork_rng(devices=[]):  # building the working module now draws nothing later
                found = last_linear(ctx.models.working(ctx.models.arch_of(0)))
            if found is None:
                raise SpecError(model_key(ctx.spec), "floco needs a model whose last parameterised layer is a "
                                "Linear (its weight becomes the solution simplex)")
            return f"{found[0]}.weight"
        return per_run(ctx, self, "weight_key", compute)

    # -- server side ---------------------------------------------------------------------------

    @hookimpl
    def setup(self, ctx):
        key = self.weight_key(ctx)
        super().setup(ctx)
        shape = tuple(ctx.server["global"][key].shape)
        ctx.server["endpoints"] = initial_endpoints(shape, self.params.endpoints,
                                                    ctx.generator("floco_endpoints")).to(ctx.device)
        ctx.server["centers"] = {}  # beta_i, from round tau on

    @hookimpl
    def select_clients(self, ctx, round):
        if round == self.params.tau:  # (F4) every training client gives its signal
            return sorted(ctx.training_clients)
        return None  # the core's draw

    def model_at(self, ctx, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
        """The server's model with the last-layer weight at the simplex point ``alpha``."""
        key = self.weight_key(ctx)
        weights = dict(ctx.server["global"])
        weights[key] = combine(ctx.server["endpoints"], alpha).to(weights[key].dtype)
        return weights

    def center_of(self, ctx, client_id: int) -> torch.Tensor:
        center = ctx.server["centers"].get(client_id)
        return torch.full((self.params.endpoints,), 1.0 / self.params.endpoints) if center is None else center

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        message = {"weights": self.model_at(ctx, self.center_of(ctx, client_id)), "endpoints": ctx.server["endpoints"]}
        if client_id in ctx.server["centers"]:
            message["center"] = ctx.server["centers"][client_id]
        return message

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        """(F3), and at round tau (F4, F5)."""
        ids, vertices, states = [], [], []
        for client_id, message in uploads:  # each upload is valid until the next client runs: copy
            ids.append(client_id)
            vertices.append(message["endpoints"].detach().clone().to(ctx.device))
            states.append({k: v.detach().clone().to(ctx.device) for k, v in message["weights"].items()})
        if not ids:  # nobody's upload arrived: everything stays
            return True
        averaged = weighted_average((weights[i], state) for i, state in zip(ids, states))
        ctx.server["global"] = {**ctx.server["global"], **averaged}
        ctx.server["endpoints"] = weighted_average((weights[i], {"e": e}) for i, e in zip(ids, vertices))["e"]
        if ctx.round == self.params.tau:
            rows = np.stack([v.double().cpu().numpy().ravel() for v in vertices])
            betas, z = place_clients(rows, self.params.endpoints)
            ctx.server["centers"] = {i: torch.tensor(b, dtype=torch.float32) for i, b in zip(ids, betas)}
            ctx.log(floco_z=z, floco_placed=len(ids))
        return True

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        """(F6) the model at the centre of the client's subregion (the simplex centre without one)."""
        return {"weights": self.model_at(ctx, self.center_of(ctx, client_id)),
                "center": self.center_of(ctx, client_id)}

    # -- client side ---------------------------------------------------------------------------

    @hookimpl
    def on_receive(self, ctx, client, message):
        load_state(client.model, message["weights"])
        client.scratch["floco"] = {"endpoints": message["endpoints"], "center": message.get("center"),
                                   "received": message["weights"]}
        return True

    def train_simplex(self, client, endpoints: torch.Tensor, purpose: str, epochs: int | None = None):
        """Train client.model's base and bias and the vertices ``endpoints`` (a copy), a fresh
        alpha per mini-batch from the client's ``purpose`` stream; returns (metrics, the vertices)."""
        own = client.scratch["floco"]
        key = f"{last_linear(client.model)[0]}.weight"
        vertices = nn.Parameter(endpoints.detach().clone())
        generator = client.generator(purpose)
        center, rho, count = own["center"], self.params.rho, self.params.endpoints
        simplex = SimplexModel(client.model, key, vertices, lambda: draw_alpha(count, center, rho, generator))
        trained = [(n, p) for n, p in simplex.named_parameters() if n != f"model.{key}"]  # the layer's own weight is unused
        own["training"] = (simplex, trained)  # local_objective's view of the personal pass
        try:
            metrics = client.train(model=simplex, optimizer=client.optimizer([p for _, p in trained]), epochs=epochs)
        finally:
            del own["training"]
        return metrics, vertices.detach()

    @hookimpl
    def local_train(self, ctx, client):
        """(F2) train the base, the bias and every vertex; then Floco+'s personal simplex (P1)."""
        own = client.scratch["floco"]
        metrics, own["trained"] = self.train_simplex(client, own["endpoints"], "floco_alpha")
        if self.params.personal_epochs > 0:
            own["upload"] = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
            self.train_personal(client)
        return metrics

    def train_personal(self, client):
        """(P1) v_i <- personal_epochs epochs on F_i(v_i) + lam/2 ||v_i - w||^2, w the received global
        simplex (base, bias, vertices), alpha drawn in the client's subregion; kept in client.state."""
        own = client.scratch["floco"]
        key = f"{last_linear(client.model)[0]}.weight"
        received = own["received"]
        anchor = {f"model.{k}": v for k, v in received.items() if k != key}
        anchor["endpoints"] = own["endpoints"]
        personal = client.state.get("personal")
        if personal is None:  # v_i^0: the global simplex the client first receives
            personal = {**{k: v for k, v in received.items() if k != key}, PERSONAL_ENDPOINTS: own["endpoints"]}
        load_state(client.model, {k: v for k, v in personal.items() if k != PERSONAL_ENDPOINTS})
        own["anchor"] = anchor
        try:
            _, vertices = self.train_simplex(client, personal[PERSONAL_ENDPOINTS], "floco_personal_alpha",
                                             epochs=self.params.personal_epochs)
        finally:
            del own["anchor"]
        state = {k: v.detach().clone() for k, v in client.model.state_dict().items() if k != key}
        client.state["personal"] = {**state, PERSONAL_ENDPOINTS: vertices.clone()}

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """(P1) lam/2 ||v_i - w||^2 over the trained parameters, in the personal pass only."""
        own = client.scratch.get("floco") or {}
        anchor, training = own.get("anchor"), own.get("training")
        if anchor is None or training is None or model is not training[0]:
            return None  # no term
        distance = sum((p - anchor[n]).pow(2).sum() for n, p in training[1])
        return self.params.lam / 2 * distance

    @hookimpl
    def personalized_models(self, ctx, client, message):
        """(F6); Floco+: the personal simplex at the same point, once the client has one."""
        personal = client.state.get("personal") if self.params.personal_epochs > 0 else None
        if personal is None:
            return {"": load_state(client.model, message["weights"])}
        key = f"{last_linear(client.model)[0]}.weight"
        weights = {k: v for k, v in personal.items() if k != PERSONAL_ENDPOINTS}
        weights[key] = combine(personal[PERSONAL_ENDPOINTS], message["center"])
        return {"": load_state(client.model, weights)}

    @hookimpl
    def client_upload(self, ctx, client):
        key = f"{last_linear(client.model)[0]}.weight"
        own = client.scratch["floco"]
        state = own.get("upload") or client.model.state_dict()  # Floco+: the global pass's, kept aside
        return {"weights": {k: v for k, v in state.items() if k != key}, "endpoints": own["trained"]}


__all__ = ["Floco", "FlocoParams", "SimplexModel", "draw_alpha", "log_riesz_energy", "place_clients",
           "principal_scores", "project_onto_simplex"]
