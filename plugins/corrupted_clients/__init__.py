"""Corrupted clients: an add-on that flips the labels of chosen clients, for robustness
experiments with any method (FedMosaic's Appendix B: "client 0 was assigned flipped labels").

Composes with every algorithm: it wraps ``setup`` (a pluggy hook wrapper), so the labels are
flipped before any plugin's own set-up reads them (label histograms, class frequencies).

- ``mapping = "reverse"``: y -> C - 1 - y (every class moves, a fixed permutation).
- ``mapping = "shift"``: y -> (y + 1) mod C.
- ``splits``: which of the client's splits are flipped. The default flips all three: the
  client's own distribution is flipped, so its test split measures how well it fits its own
  (corrupted) task, as in the paper. ``["train"]`` instead poisons training only.

At the end it summarises every per-client series a method logged (``client.log``, e.g.
FedMosaic's ``lambda``) for the two groups: ``<name>_corrupted_mean`` and ``<name>_clean_mean``,
each the mean over the group's clients of a client's mean over the rounds it logged; a
robustness experiment reads these two numbers (over seeds) instead of one metric per client.
"""

from __future__ import annotations

from attrs import define, field

from pfl_core.api import ADDON, FieldError, Plugin, SpecError, choices_text, described, hookimpl, one_of

SPLITS = ("train", "val", "test")


@described(f"non-empty, each {choices_text(SPLITS)}")
def _splits(_instance, attribute, value):
    bad = [s for s in value if s not in SPLITS]
    if bad or not value:
        raise FieldError(attribute.name, f"must be a non-empty list of {', '.join(SPLITS)}; got {value!r}")


@define
class CorruptedClientsParams:
    clients: list[int] = field(factory=lambda: [0], metadata={
        "doc": "the clients whose labels are flipped (before any plugin's setup); each an existing "
               "client id (checked by check_spec)"})
    mapping: str = field(default="reverse", validator=one_of("reverse", "shift"), metadata={
        "doc": "y -> C - 1 - y, or y -> (y + 1) mod C"})
    splits: list[str] = field(factory=lambda: list(SPLITS), validator=_splits, metadata={
        "doc": 'which of those clients\' splits are flipped; ["train"] poisons training only'})


def flip(y, num_classes: int, mapping: str):
    return (num_classes - 1 - y) if mapping == "reverse" else (y + 1) % num_classes


class CorruptedClients(Plugin):
    name = "corrupted_clients"
    kind = ADDON
    Params = CorruptedClientsParams

    @hookimpl
    def check_spec(self, spec):
        n = spec.partition.num_clients
        for i, client in enumerate(self.params.clients):
            if not 0 <= client < n:
                raise SpecError(f"{self.spec_path}.params.clients[{i}]", f"client {client} does not exist ({n} clients)")

    @hookimpl(wrapper=True)
    def setup(self, ctx):
        for client_id in self.params.clients:
            data = ctx.data.clients[client_id]
            for split in self.params.splits:
                labels = getattr(data, f"{split}_y")
                setattr(data, f"{split}_y", flip(labels, ctx.num_classes, self.params.mapping))
        return (yield)

    @hookimpl
    def on_finish(self, ctx):
        corrupted = set(self.params.clients)
        per_client: dict[tuple[str, int], list[float]] = {}
        for row in ctx.client_series:
            per_client.setdefault((row["name"], row["client"]), []).append(row["value"])
        groups: dict[str, list[float]] = {}
        for (name, client), values in per_client.items():
            group = "corrupted" if client in corrupted else "clean"
            groups.setdefault(f"{name}_{group}_mean", []).append(sum(values) / len(values))
        return {key: sum(means) / len(means) for key, means in groups.items()}
