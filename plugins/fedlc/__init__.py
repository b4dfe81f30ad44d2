"""FedLC: Zhang, Li, Li, Xu, Wu, Ding and Wu, "Federated Learning with Label Distribution Skew via
Logits Calibration", ICML 2022 (arXiv:2209.00189).

FedAvg whose clients train on calibrated logits. With n_{c,y} the number of training samples of
class y on client c and z = f(x; w) the model's logits, client c's loss on (x, y) is

    (L1)  L_cal(x, y) = -log( exp(z_y - Delta_y) / sum_{y'} exp(z_{y'} - Delta_{y'}) ),
          Delta_y = tau * n_{c,y}^(-1/4)

the cross-entropy of the logits z - Delta: the rarer a class on the client, the larger its
offset, so fitting the client's rare classes needs their logits raised further and fitting its
common classes pushes the rare (and the missing) ones down less: a client with a skewed label
distribution over-fits its majority classes less (the paper's pairwise label margin).

    server: w_0 = the seeded initial weights                                     (setup)
    each round: FedAvg's broadcast of w_t, local SGD for training.local_epochs   (local_train)
                epochs on (L1) (``task_loss``), upload, w_{t+1} = sum_c n_c/n w_c (server_aggregate)
    evaluation: every client is scored with the global model on its plain, uncalibrated logits
                (the calibration is a training loss only: the paper's inference uses f(x; w))

(L1) labels the loss here; we could read only the paper's abstract and public descriptions of it,
not its full text, so its equation numbers are not cited. The formula is the one the project's
guide states (docs/writing-a-plugin.md, "Changing the loss") and FL-bench and PFLlib implement.

Deviations, from the paper and from the reference implementations (read, not copied):

- **The denominator.** The paper's calibrated loss leaves the true class out of the denominator
  (sum over y' != y). That loss is not bounded below (it falls without limit as z_y grows), and
  FL-bench reports that its training collapsed with it (``src/server/fedlc.py``'s note, issue 5);
  here, as in FL-bench and PFLlib, the denominator is the full softmax's.
- **A class the client lacks** counts as one sample: its offset is tau, the largest (the
  guide's choice), and stays finite, so tau = 0 is exactly FedAvg. FL-bench counts it as 1e-8
  samples (an offset of 100 tau); the paper leaves n = 0 undefined.
- **PFLlib** (``system/flcore/servers/serverlc.py``, ``clients/clientlc.py``, at d832e76)
  calibrates with tau * n_y^(-1/4) where n_y is the number of class-y training samples summed
  over *all* clients: the server reads every client's label counts and gives every client the
  same offsets, i.e. the global label distribution, not the client's own n_{c,y} of the paper
  (a client's skew is then not calibrated at all under a balanced global distribution). A class
  no client holds gets an infinite offset (0^(-1/4)), and the offsets are tiled to
  ``batch_size`` rows, which works only because its train loader drops the last partial batch.
  Here each client uses its own counts, computed on its side (no label counts leave a client).
- **Aggregation** is FedAvg's, weighted by training samples (the paper's FedAvg; PFLlib's and
  FL-bench's too). Bytes are FedAvg's: the offsets never travel.
- ``tau = 1.0``: the default of both PFLlib and FL-bench (``--tau 1.0``).
- The calibrated loss replaces the cross-entropy wherever the core's did (``task_loss``): every
  ``client.train`` of local training and of cold-start fine-tuning (a newcomer calibrates with its
  own counts and trains ``experiment.coldstart_epochs`` epochs from the global model, the core
  default); an add-on's ``local_objective`` term (FedProx's proximal term through an add-on,
  say) is still added. The calibration is the same function as the guide's FedLC add-on
  (``tests/test_fedlc.py`` checks the two agree bit for bit), packaged as an algorithm.

No client state: nothing to keep across rounds, so a lost upload (``dropout``) loses nothing
but that round's contribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import define, field

from pfl_core.api import at_least, finite, hookimpl
from pfl_plugins.fedavg import FedAvg


@define
class FedLCParams:
    tau: float = field(default=1.0, validator=[finite, at_least(0)], metadata={
        "doc": "tau of the offsets tau * n_y^(-1/4) (L1); 0 is FedAvg. Default: PFLlib's and FL-bench's"})


def calibration_offsets(counts, tau: float, like: torch.Tensor) -> torch.Tensor:
    """Delta_y = tau * n_y^(-1/4) for each class (L1), a class with no sample counted as one; in
    ``like``'s dtype and device."""
    counts = torch.as_tensor(counts, dtype=like.dtype, device=like.device)
    return tau * counts.clamp_min(1) ** -0.25


def calibrated_cross_entropy(logits: torch.Tensor, y: torch.Tensor, counts, tau: float) -> torch.Tensor:
    """(L1) averaged over the batch: the cross-entropy of ``logits - Delta``."""
    return F.cross_entropy(logits - calibration_offsets(counts, tau, logits), y)


class FedLC(FedAvg):
    """FedLC (Zhang et al. 2022): FedAvg whose clients train on the cross-entropy of logits
    calibrated by their own label counts, z_y - tau * n_{c,y}^(-1/4); each client is scored with
    the global model's plain logits. FedAvg's bytes and budget."""

    name = "fedlc"
    Params = FedLCParams

    @hookimpl
    def task_loss(self, ctx, client, logits, y):
        # one count per class of the dataset, zeros included, in the logits' order
        return calibrated_cross_entropy(logits, y, client.data.label_counts(), self.params.tau)


__all__ = ["FedLC", "FedLCParams", "calibrated_cross_entropy", "calibration_offsets"]
