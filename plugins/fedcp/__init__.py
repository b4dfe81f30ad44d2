"""FedCP: Zhang et al., "FedCP: Separating Feature Information for Personalized Federated
Learning via Conditional Policy", KDD 2023.

The model is a feature extractor W^fe (the body) and a linear classifier (the last layer). FedCP
gives each client two heads on the features h = f(x; W^fe) and a Conditional Policy Network
(CPN) that splits every sample's h into a global and a personalized part:

    v_i = normalise(sum over classes of W^hp_i)      (client-specific, from its own head) (C1)
    s = the first of the two-way Gumbel-softmax of CPN(h * v_i; theta) over {personal,
        global}, per feature (a soft mask in (0, 1)^K); the global part gets 1 - s     (C2)
    output = W^hp_i(h * s) + W^hg(h * (1 - s))                                          (C3)

W^hp_i, the personalized head, is the client's own and never leaves it; W^hg, the global head,
is the server's and is frozen during local training. Each round t:

    server: sends W^fe, theta (the CPN) and W^hg
    client i: W^fe, theta <- the received ones; W^hp_i its own (the initial head before its first
        round); v_i from (C1); E epochs of SGD on (W^fe, W^hp_i, theta), W^hg fixed, on
            CE(output, y) + lam * MMD^2(f(x; W^fe), f(x; W^fe_received))                     (C4)
        (the MMD keeps the features close to those of the received global extractor: RBF
        kernels of bandwidths 10, 15, 20, 50)
        uploads W^fe_i, theta_i and head_mix * W^hp_i + (1 - head_mix) * W^hg; keeps W^hp_i
    server: n_i-weighted averages: W^fe, theta, and W^hg from the uploaded heads            (C5)
    evaluation: the received W^fe, theta and W^hg with the client's own W^hp_i and v_i; the
        policy without Gumbel noise (the softmax of the CPN's scores)

(C1)-(C5) label the steps in this docstring; the paper's Section 4 (CPN, feature separation,
the MMD term) is the source, but we could not check its equation numbers here, so the labels
are ours. Where the paper leaves a detail to the code we follow PFLlib (``clientcp.py`` /
``servercp.py``, by the paper's first author) and say so:

- (C1) is PFLlib's v_i: the column sums of the personal head's weight, L2-normalised (so is the
  current code of the original FedCP repository; its early commits summed |W^hp - W^hg|
  instead). PFLlib draws the first round's v_i at random; we compute it from the initial head,
  as every later round.
- (C2): the CPN is PFLlib's, Linear(K, 2K) -> LayerNorm -> ReLU, its output read as two scores
  per feature; training draws the Gumbel noise from the client's seeded generator with
  temperature ``tau`` (1, PFLlib's). PFLlib also samples the noise at test time; we evaluate the
  noise-free policy so a client's score does not depend on a draw.
- (C5): the client's contribution to the global head is ``head_mix * W^hp_i + (1 - head_mix) *
  W^hg`` with PFLlib's ``head_mix = 0.5`` (its ``generate_upload_head``): the global head, frozen
  locally, learns from the personal heads at half speed, and the personal head itself stays on
  the client. ``head_mix = 0`` keeps W^hg at its initial weights.
- (C4): ``lam = 5``, the authors' run script (MNIST); PFLlib's MMD with its bandwidths, a mean
  over the batch's kernel matrices.
- The initial W^hg and every client's initial W^hp are the seeded initial classifier (PFLlib
  copies the model's head); theta starts from its own seeded draw.
- The CPN (theta) is trained by the same optimiser as the model (``training.*``: its learning
  rate, momentum and weight decay); PFLlib trains the model and the CPN together with one plain
  SGD of the learning rate (no momentum, no weight decay). So with ``training.momentum`` or
  ``training.weight_decay`` set (or ``optimizer = "adam"``), theta carries them too; with the
  defaults (``"sgd"``, both 0) every step is PFLlib's.
- Bytes: down W^fe, theta, W^hg; up W^fe_i, theta_i and one head. Budget:
  ``training.local_epochs`` private epochs a round. The classifier must be an ``nn.Linear``; a
  model without a feature extractor (one layer) or another last layer is refused at the model's
  key before any data is loaded.
- Cold start: the newcomer receives W^fe, theta, W^hg, starts from the initial personal head and
  trains ``experiment.coldstart_epochs`` epochs with (C2)-(C4); it is scored as a training client.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field
from torch import nn

from pfl_core.api import (
    at_least,
    between,
    capture_embedding,
    classifier,
    finite,
    greater_than,
    hookimpl,
    load_state,
    rewrite_classifier_input,
)
from pfl_plugins.feddbe import FedDBE
from pfl_plugins.fedpac import ClassifierSplit

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's RBF bandwidths for (C4)


@define
class FedCPParams:
    lam: float = field(default=5.0, validator=[finite, at_least(0)], metadata={
        "doc": "lambda (C4): weight of the MMD between the features of the local and of the received global "
               "feature extractor (the authors' run script)"})
    tau: float = field(default=1.0, validator=[finite, greater_than(0)], metadata={
        "doc": "temperature of the policy's Gumbel-softmax (C2)"})
    head_mix: float = field(default=0.5, validator=[finite, between(0, 1)], metadata={
        "doc": "(C5) a client uploads head_mix * its personal head + (1 - head_mix) * the global head it "
               "received, from which the server averages the global head (PFLlib's 0.5)"})

    @property
    def head_layers(self) -> int:
        return 1  # the personal head is the classifier (FedPer's split)


class ConditionalPolicyNetwork(nn.Module):
    """theta: K conditional features -> (2, K) scores, personal and global (C2)."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.fc(c))).view(len(c), 2, -1)


def conditional_vector(head_weight: torch.Tensor) -> torch.Tensor:
    """(C1): v_i, the column sums of W^hp_i (classes x K), L2-normalised: (1, K)."""
    return F.normalize(head_weight.detach().sum(0, keepdim=True), dim=1)


def policy(scores: torch.Tensor, tau: float, noise=None) -> torch.Tensor:
    """(C2): s, the personal share of every feature: the first entry of the softmax over the two
    scores (B, 2, K), with Gumbel noise drawn from ``noise`` (a torch.Generator) when given."""
    if noise is not None:
        scores = scores - torch.empty_like(scores).exponential_(generator=noise).log()  # + Gumbel(0, 1)
    return torch.softmax(scores / tau, dim=1)[:, 0]


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths=BANDWIDTHS) -> torch.Tensor:
    """(C4)'s MMD^2 estimate: mean of K(x, x) + K(y, y) - 2 K(x, y), K = sum over bandwidths a of
    exp(-||u - v||^2 / (2 a))."""
    def kernel(a, b):
        d = (a[:, None, :] - b[None, :, :]).pow(2).sum(2)
        return sum(torch.exp(-0.5 * d / bw) for bw in bandwidths)

    return (kernel(x, x) + kernel(y, y) - 2 * kernel(x, y)).mean()


class PolicySplit(rewrite_classifier_input):
    """While inside: the classifier (W^hp) reads h * s and W^hg's output on h * (1 - s) is added
    to its output (C3); ``store["emb"]`` is h and ``store["policy"]`` s after every forward."""

    def __init__(self, model, cpn, global_head, context, tau: float, noise=None, store=None):
        super().__init__(model, store)
        self.cpn, self.global_head = cpn, global_head
        self.context, self.tau, self.noise = context, tau, noise

    def rewrite(self, h):
        s = policy(self.cpn(h * self.context), self.tau, self.noise)  # (C1)-(C2): sample-specific
        self.store["policy"] = s
        self._global_part = h * (1 - s)
        return h * s

    def _post(self, module, inputs, output):
        weight, bias = self.global_head
        return output + F.linear(self._global_part, weight, bias)  # (C3)

    def __enter__(self):
        store = super().__enter__()
        self.handles.append(self.layer.register_forward_hook(self._post))
        return store

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._global_part = None


class FedCPModel(nn.Module):
    """A client's evaluated model: (C3) with the noise-free policy."""

    def __init__(self, model, cpn, global_head, context, tau: float):
        super().__init__()
        self.model, self.cpn = model, cpn
        self.global_head, self.context, self.tau = global_head, context, tau

    def forward(self, x):
        with PolicySplit(self.model, self.cpn, self.global_head, self.context, self.tau):
            return self.model(x)


class FedCP(ClassifierSplit):
    """FedCP (Zhang et al. 2023): a conditional policy network splits each sample's features
    between a personal head (kept on the client) and a frozen global head; the feature
    extractor, the policy network and the global head are averaged. Evaluated: the global
    extractor, policy network and global head with the client's own head."""

    name = "fedcp"
    Params = FedCPParams

    @hookimpl
    def check_spec(self, spec):
        super().check_spec(spec)  # one architecture, with a feature extractor
        FedDBE.check_linear_classifier(spec, self.name)

    def build_cpn(self, ctx, dim: int) -> ConditionalPolicyNetwork:
        return ConditionalPolicyNetwork(dim).to(ctx.device)

    @hookimpl
    def setup(self, ctx):
        super().setup(ctx)  # W^fe^0 (the body keys)
        dim = FedDBE.representation_dim(ctx, self.name)
        initial = ctx.models.initial_state(ctx.models.arch_of(0))
        ctx.server["global_head"] = {k: initial[k].clone() for k in self.head_keys(ctx)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed_for("fedcp_init"))
            ctx.server["cpn"] = {k: v.detach().clone() for k, v in self.build_cpn(ctx, dim).state_dict().items()}

    # -- server -------------------------------------------------------------------------------

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"body": ctx.server["body"], "cpn": ctx.server["cpn"], "global_head": ctx.server["global_head"]}

    @hookimpl
    def evaluation_message(self, ctx, client_id):
        return self.on_broadcast(ctx, client_id)

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        sums = {"cpn": {}, "head": {}}

        def others_too():
            for i, message in uploads:
                for part, total in sums.items():
                    for k, v in message[part].items():
                        total[k] = total.get(k, 0) + weights[i] * v.detach()
                yield i, message

        super().server_aggregate(ctx, others_too(), weights)  # W^fe: FedPer's n_i-weighted mean
        if sums["cpn"]:  # (C5); nobody took part: unchanged
            ctx.server["cpn"], ctx.server["global_head"] = sums["cpn"], sums["head"]
        return True

    # -- client -------------------------------------------------------------------------------

    def global_head(self, ctx, message) -> tuple:
        """W^hg as (weight, bias)."""
        head = message["global_head"]
        keys = self.head_keys(ctx)
        weight = next(head[k] for k in keys if k.endswith("weight"))
        bias = next((head[k] for k in keys if k.endswith("bias")), None)
        return weight, bias

    @hookimpl
    def on_receive(self, ctx, client, message):
        model = self.load_personal(ctx, client, message["body"])  # W^fe + W^hp_i
        cpn = self.build_cpn(ctx, classifier(model).in_features)
        cpn.load_state_dict(message["cpn"])
        client.scratch.update(cpn=cpn, global_head=self.global_head(ctx, message), message=message,
                              context=conditional_vector(classifier(model).weight))  # (C1)
        return True

    def policy_split(self, client, noise=None):
        s = client.scratch
        return PolicySplit(client.model, s["cpn"], s["global_head"], s["context"], self.params.tau, noise, s)

    def train(self, ctx, client, epochs=None):
        """(C2)-(C4) on W^fe, W^hp_i and theta; W^hg fixed."""
        model, cpn = client.model, client.scratch["cpn"]
        frozen = ctx.models.working(client.arch, slot="fedcp_global")  # f(.; W^fe_received) for (C4)
        load_state(frozen, client.scratch["message"]["body"])
        client.scratch["global_body"] = frozen
        with self.policy_split(client, noise=client.generator("fedcp_policy")):
            metrics = client.train(epochs=epochs, optimizer=client.optimizer(params=[*model.parameters(),
                                                                                      *cpn.parameters()]))
        return metrics

    @hookimpl
    def local_train(self, ctx, client):
        metrics = self.train(ctx, client)
        self.keep_head(ctx, client)  # W^hp_i stays here
        return metrics

    @hookimpl
    def local_objective(self, ctx, client, model, x, y, logits):
        """lam * MMD^2 between this batch's features and those of the received extractor (C4)."""
        if not self.params.lam or "emb" not in client.scratch or model is not client.model:
            return None
        with torch.no_grad():
            store = {}
            with capture_embedding(client.scratch["global_body"], store):
                client.scratch["global_body"](x)
        return self.params.lam * mmd_rbf(client.scratch["emb"].flatten(1), store["emb"].flatten(1))

    @hookimpl
    def client_upload(self, ctx, client):
        state = client.model.state_dict()
        mix = self.params.head_mix
        received = client.scratch["message"]["global_head"]
        head = {k: mix * state[k] + (1 - mix) * received[k] for k in self.head_keys(ctx)}  # (C5)
        return {"body": {k: state[k] for k in self.body_keys(ctx)}, "cpn": client.scratch["cpn"].state_dict(),
                "head": head}

    # -- evaluation and cold start ------------------------------------------------------------

    def scored(self, client):
        s = client.scratch
        return {"": FedCPModel(client.model, s["cpn"], s["global_head"], s["context"], self.params.tau)}

    @hookimpl
    def personalized_models(self, ctx, client, message):
        self.on_receive(ctx, client, message)
        return self.scored(client)

    @hookimpl
    def coldstart_personalize(self, ctx, client, message):
        self.on_receive(ctx, client, message)  # W^fe, theta, W^hg and the initial personal head
        self.train(ctx, client, ctx.spec.experiment.coldstart_epochs)
        return self.scored(client)


__all__ = ["BANDWIDTHS", "ConditionalPolicyNetwork", "FedCP", "FedCPModel", "FedCPParams", "PolicySplit",
           "conditional_vector", "mmd_rbf", "policy"]
