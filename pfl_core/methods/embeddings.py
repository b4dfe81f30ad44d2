"""The classifier (a model's last parameterised layer), the embeddings it reads, and class
prototypes over them (FedProto, Tan et al. 2022, Eq. 3 and 6); used by FedProto, FedPAC,
FedAS, FedPHP and pFedFDA."""

from __future__ import annotations

import torch
from torch import nn

from pfl_core.models.layers import layer_keys, parameterised_layers


def classifier(model: nn.Module) -> nn.Module:
    return parameterised_layers(model)[-1][1]



def classifier_gives_the_logits(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the output of ``model``'s last parameterised layer is the model's output on ``x``
    (no activation or layer after the classifier); the model's mode is restored."""
    seen = {}
    handle = classifier(model).register_forward_hook(lambda m, inp, out: seen.__setitem__("out", out))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        handle.remove()
        model.train(was)
    out = seen.get("out")
    return out is not None and out.shape == logits.shape and torch.equal(out, logits)

class capture_embedding:
    """Context manager: ``store["emb"]`` is the classifier's input after every forward."""

    def __init__(self, model, store):
        self.layer, self.store = classifier(model), store

    def __enter__(self):
        self.handle = self.layer.register_forward_hook(lambda m, inp, out: self.store.__setitem__("emb", inp[0]))
        return self.store

    def __exit__(self, *exc):
        self.handle.remove()


class rewrite_classifier_input:
    """Context manager: every forward of ``model`` records the classifier's input in
    ``store["emb"]`` and feeds the classifier ``self.rewrite(input)`` instead (a subclass's
    feature transform: FedDBE's bias, GPFL's valve, FedCP's policy); ``store["emb"]`` is
    cleared on exit."""

    def __init__(self, model: nn.Module, store: dict | None = None):
        self.layer = classifier(model)
        self.store = {} if store is None else store

    def rewrite(self, features: torch.Tensor) -> torch.Tensor | None:
        """What the classifier reads instead of ``features``; None: ``features`` unchanged."""
        return None

    def _pre(self, module, inputs):
        self.store["emb"] = inputs[0]
        rewritten = self.rewrite(inputs[0])
        return None if rewritten is None else (rewritten,)

    def __enter__(self):
        self.handles = [self.layer.register_forward_pre_hook(self._pre)]
        return self.store

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.store.pop("emb", None)


@torch.no_grad()
def local_prototypes(model, x, y, num_classes, batch_size=1024):
    """({class: mean embedding}, {class: count}) over (x, y) (Eq. 3), in eval mode."""
    was = model.training
    model.eval()
    sums, counts, store = {}, {}, {}
    with capture_embedding(model, store):
        for start in range(0, len(y), batch_size):
            model(x[start:start + batch_size])
            emb, yb = store["emb"].flatten(1), y[start:start + batch_size]
            for c in yb.unique().tolist():
                mask = yb == c
                sums[c] = sums.get(c, 0) + emb[mask].sum(0)
                counts[c] = counts.get(c, 0) + int(mask.sum())
    model.train(was)
    return {c: sums[c] / counts[c] for c in sums}, counts


def aggregate_prototypes(reports):
    """Eq. 6: {class: sum_i n_ij C_ij / sum_i n_ij} over (prototypes, counts) reports."""
    sums, totals = {}, {}
    for protos, counts in reports:
        for c, p in protos.items():
            sums[c] = sums.get(c, 0) + counts[c] * p
            totals[c] = totals.get(c, 0) + counts[c]
    return {c: sums[c] / totals[c] for c in sums}


def head_keys(model) -> list[str]:
    """The state-dict keys of the model's last parameterised layer (the classifier)."""
    return layer_keys(model)[-1]


@torch.no_grad()
def embeddings(model, x, batch_size: int = 1024) -> torch.Tensor:
    """z = the classifier's input for every row of ``x``, in eval mode (flattened)."""
    was = model.training
    model.eval()
    store, out = {}, []
    with capture_embedding(model, store):
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
            out.append(store["emb"].flatten(1))
    model.train(was)
    return torch.cat(out)


class MutualPair(nn.Module):
    """Two models side by side for ``client.train`` (mutual learning: FedKD's mentor and mentee,
    FML's personal and meme models): ``forward`` returns the first one's logits and keeps the
    second's logits and both classifier inputs in ``self.seen``."""

    def __init__(self, mentor: nn.Module, mentee: nn.Module, projections: nn.ModuleDict | None = None):
        super().__init__()
        self.mentor, self.mentee = mentor, mentee
        self.projections = projections if projections is not None else nn.ModuleDict()
        self.seen: dict = {}

    def forward(self, x):
        mentor_out, mentee_out = {}, {}
        with capture_embedding(self.mentor, mentor_out):
            mentor_logits = self.mentor(x)
        with capture_embedding(self.mentee, mentee_out):
            self.seen = {"mentee_logits": self.mentee(x), "H_T": mentor_out["emb"].flatten(1),
                         "H_S": mentee_out["emb"].flatten(1)}
        return mentor_logits
