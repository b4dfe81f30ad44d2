"""A server-side hypernetwork: an MLP on a client's embedding (or descriptor), then one linear
head per tensor of the model it produces (pFedHN's table of learned client embeddings, PeFLL's
descriptor from an embedding network)."""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.func import functional_call

from pfl_core.errors import SpecError


class HyperNetwork(nn.Module):
    """h(v; phi): an MLP on an embedding v, then one linear head per produced tensor (the pFedHN
    authors' CNNHyper, for any target model). ``embeddings`` holds a learned v_1..v_N when
    ``num_clients`` > 0 (pFedHN); with 0 there is no table and v comes from elsewhere (PeFLL)."""

    def __init__(self, num_clients: int, embed_dim: int, hidden_dim: int, hidden_layers: int,
                 shapes: dict[str, tuple]):
        super().__init__()
        if num_clients:
            self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden_dim)]
        for _ in range(hidden_layers):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.shapes = dict(shapes)
        self.heads = nn.ModuleList(nn.Linear(hidden_dim, math.prod(shape)) for shape in self.shapes.values())

    def forward(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.mlp(v)
        return {name: head(features).view(shape) for (name, shape), head in zip(self.shapes.items(), self.heads)}


def hypernetwork_size(num_clients: int, embed_dim: int, hidden_dim: int, hidden_layers: int, produced: int) -> int:
    """Parameters of the hypernetwork producing ``produced`` numbers: the embedding table, the
    MLP, and the heads' weights (hidden_dim per produced number) and biases (one)."""
    mlp = (embed_dim + 1) * hidden_dim + hidden_layers * (hidden_dim + 1) * hidden_dim
    return num_clients * embed_dim + mlp + (hidden_dim + 1) * produced



def refuse_if_larger_than_memory(size: int, hidden_dim: int, key: str) -> None:
    """A hypernetwork of ``size`` parameters is refused at ``key`` (its ``hidden_dim``) before it is
    allocated when about four float32 copies of it (the network, the stepped one and the
    optimiser's state) exceed this machine's memory."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not on this platform
        return
    if 4 * 4 * size > memory:
        raise SpecError(key, f"the hypernetwork would have {size:.3g} parameters (hidden_dim = {hidden_dim} per "
                             f"produced weight), about {16 * size / 2**30:.3g} GiB on the server with its optimiser "
                             f"state, more than this machine's {memory / 2**30:.1f} GiB; lower hidden_dim")

def produce(hypernetwork: HyperNetwork, phi: dict[str, torch.Tensor], v: torch.Tensor) -> dict[str, torch.Tensor]:
    """theta = h(v; phi), phi given as a state dict (the module supplies only the structure)."""
    return functional_call(hypernetwork, phi, (v,))
