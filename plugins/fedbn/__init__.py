"""FedBN: Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization", ICLR 2021, Algorithm 1.

FedAvg in which every BatchNorm layer stays on its client: its affine parameters (gamma, beta)
and its running statistics (mean, variance, batches tracked) are never sent, never averaged and
never counted as communication. Algorithm 1, as run here:

    server: w^0 = the seeded initial weights (the BatchNorm entries of it are never used)
    each round t, each participant k:
        (1)  w_k^{(l)} <- w^{(l)} for every non-BatchNorm layer l; the BatchNorm layers keep the
             client's own values (the initial ones before its first round)    (on_broadcast, on_receive)
        (2)  E epochs of SGD on the whole model (training.local_epochs)        (local_train)
        (3)  upload the non-BatchNorm layers; keep the BatchNorm ones          (client_upload)
    (4)  w^{(l)} <- sum_k n_k / n w_k^{(l)} for every non-BatchNorm layer l    (server_aggregate)
    evaluation: the global non-BatchNorm layers with the client's own BatchNorm layers

(Equation labels are this docstring's; (1)-(4) are the steps of the paper's Algorithm 1.)

Decisions:

- A BatchNorm layer is any ``torch.nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d,
  SyncBatchNorm): all of its state-dict keys are personal. Everything else is shared.
- Aggregation weights n_k / n (FedAvg's); Algorithm 1 writes the plain mean 1/K over clients,
  and the paper's experiments give every client the same number of samples, where the two agree.
- A model without BatchNorm is refused (a spec error at ``model.name``, before any data is
  loaded, so ``--dry-run`` reports it): FedBN would silently be FedAvg. The zoo's BatchNorm
  variants: ``norm = "batch"`` on mlp, lenet5, cnn2, cnn4 (FedBN's layout: a BatchNorm after
  every convolution and hidden fully connected layer), resnet18, mobilenet_v2,
  vgg16 with ``batch_norm = true``.
- With a single client FedBN is FedAvg (tested bit for bit): the average of one model is itself.
- Budget: training.local_epochs private epochs per round (FedAvg's).
- Cold start: the newcomer receives the final shared layers, starts from the initial BatchNorm
  layers and fine-tunes everything for ``experiment.coldstart_epochs`` (the core default).

The shared/personal bookkeeping (broadcast, receive, keep, upload, average) is
``pfl_core/methods/partial.py``'s, with BatchNorm keys as the personal part instead of a layer split.
"""

from __future__ import annotations

from torch import nn

from pfl_core.api import (
    NoParams,
    PartialModel,
    SpecError,
    hookimpl,
    model_key,
    probe_model,
    require_single_architecture,
    spec_archs,
)


def batchnorm_keys(model: nn.Module) -> set[str]:
    """The state-dict keys that belong to BatchNorm modules (parameters and statistics)."""
    owners = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return {key for key in model.state_dict() for owner in owners if key.startswith(f"{owner}.")}


def no_batchnorm(key: str, arch: str) -> SpecError:
    return SpecError(key, f"fedbn keeps the BatchNorm layers local, but '{arch}' has none (FedBN would be FedAvg); "
                          f"use a model with BatchNorm, e.g. model.params.norm = \"batch\" on mlp, lenet5, cnn2 or "
                          f"cnn4, or resnet18, mobilenet_v2, vgg16 with batch_norm = true")


class FedBN(PartialModel):
    """FedBN (Li et al. 2021): FedAvg whose BatchNorm layers (affine parameters and running
    statistics) stay on the client: never sent, averaged or counted. Needs a model with
    BatchNorm, otherwise an error at ``model.name`` (also on ``--dry-run``): ``norm = "batch"``
    on ``mlp``, ``lenet5``, ``cnn2``, ``cnn4``; ``resnet18``, ``mobilenet_v2``; ``vgg16`` with
    ``batch_norm = true``. Budget: ``training.local_epochs``."""

    name = "fedbn"
    Params = NoParams

    def _split(self, ctx, arch: str) -> tuple[list[str], list[str]]:
        """(shared: every non-BatchNorm key, personal: the BatchNorm keys), state-dict order."""
        model = ctx.models.working(arch)
        personal = batchnorm_keys(model)
        if not personal:
            raise no_batchnorm(model_key(ctx.spec), arch)
        keys = list(model.state_dict())
        return [k for k in keys if k not in personal], [k for k in keys if k in personal]

    def log_resolved_split(self, ctx, arch: str) -> None:
        pass  # no head_layers to resolve: the split is by module type

    @hookimpl
    def check_spec(self, spec):
        require_single_architecture(spec, self.name)
        for arch in spec_archs(spec):
            model = probe_model(spec, arch)
            if model is not None and not batchnorm_keys(model):
                raise no_batchnorm(model_key(spec), arch)


__all__ = ["FedBN", "batchnorm_keys", "probe_model"]
