"""Issue 33, numerics of the training settings: a step size, or what an optimiser derives from
it, that leaves float32's range is one line naming its key (never an internal error); an epoch
or round count no run could finish is refused; a divergence names every setting that scales a
client's update, not only training.lr."""

import math

import pytest
import torch
from test_cli import one_line_error, run_cli, write_spec
from tiny import run_tiny, tiny_raw

from pfl_core.engine import resolve
from pfl_core.engine.divergence import update_settings
from pfl_core.errors import NonFiniteError
from pfl_core.runtime.context import Client
from pfl_core.spec.validators import FLOAT_MAX, optimizer_step_problem

SMALLEST_NORMAL = 2.0**-126  # float32's
ADAM_LIMIT = FLOAT_MAX * (1 - 0.9)  # the largest lr whose Adam first step, lr / (1 - beta1), float32 holds


def error_line(capsys, tmp_path, raw, *extra) -> str:
    """The one stderr line of a run (or with --dry-run, a check) that must fail with exit 2."""
    code, _, err = run_cli(capsys, write_spec(tmp_path, raw), *extra)
    line = one_line_error(err)
    assert code == 2, err
    assert "internal error" not in line, line
    return line


def one_round(**overrides) -> dict:
    return tiny_raw(**{"experiment.rounds": 1, **overrides})


# -- defect 3: learning rates and what the optimisers derive from them -----------------------

def test_adam_at_an_lr_whose_first_step_overflows_is_one_line_naming_training_lr(tmp_path, capsys):
    """The issue's scenario: training.optimizer = "adam", training.lr = 1e38 ended as an internal
    error (torch: "value cannot be converted to type float without overflow")."""
    line = error_line(capsys, tmp_path, one_round(**{"training.optimizer": "adam", "training.lr": 1e38}), "--dry-run")
    assert line.startswith("pfl-run: error: training.lr: 1e+38 makes adam's first step"), line
    assert "1e+39" in line and "<= 3.4e+37" in line, line


def test_the_adam_limit_is_where_torch_starts_to_refuse():
    """The rule is torch's own: at the largest accepted lr torch's Adam takes its first step, at
    the next float it stops with its overflow error, and the spec refuses that lr."""
    def first_step(lr):
        weight = torch.nn.Parameter(torch.ones(2))
        weight.grad = torch.ones(2)
        torch.optim.Adam([weight], lr=lr).step()
        return weight

    assert optimizer_step_problem("adam", ADAM_LIMIT, 0.0) is None
    assert torch.isfinite(first_step(ADAM_LIMIT)).all()
    resolve(tiny_raw(**{"training.optimizer": "adam", "training.lr": ADAM_LIMIT}))
    beyond = math.nextafter(ADAM_LIMIT, math.inf)
    while optimizer_step_problem("adam", beyond, 0.0) is None:  # a step of an ulp may round back
        beyond = math.nextafter(beyond, math.inf)
    with pytest.raises(RuntimeError, match="without overflow"):
        first_step(beyond)
    assert optimizer_step_problem("sgd", beyond, 0.0) is None  # SGD steps with lr itself


def test_sgd_at_a_huge_lr_diverges_in_one_line_naming_training_lr(tmp_path, capsys):
    line = error_line(capsys, tmp_path, one_round(**{"training.lr": 1e38}))
    assert "training diverged: lower training.lr (now 1e+38)," in line, line


@pytest.mark.parametrize("lr, held", [(1e-46, "0 in float32"), (1e-40, "a subnormal number in float32")])
def test_an_lr_that_float32_holds_as_zero_or_subnormal_is_refused(tmp_path, capsys, lr, held):
    """1e-46 trained nothing and reported the initial model as a result; a subnormal lr is
    flushed to 0 by the run (torch.set_flush_denormal)."""
    line = error_line(capsys, tmp_path, tiny_raw(**{"training.lr": lr}), "--dry-run")
    assert line.startswith(f"pfl-run: error: training.lr: {lr:g} is {held}"), line
    assert ">= 1.18e-38" in line, line


def test_the_smallest_normal_float32_is_a_valid_lr():
    assert resolve(tiny_raw(**{"training.lr": SMALLEST_NORMAL})).spec.training.lr == SMALLEST_NORMAL
    with pytest.raises(Exception, match="training.lr"):
        resolve(tiny_raw(**{"training.lr": math.nextafter(SMALLEST_NORMAL, 0)}))


def test_a_momentum_that_is_one_in_float32_is_refused(tmp_path, capsys):
    line = error_line(capsys, tmp_path, tiny_raw(**{"training.momentum": 0.99999999}), "--dry-run")
    assert line.startswith("pfl-run: error: training.momentum: 0.99999999 is 1 in float32"), line


def test_sgd_momentum_amplifying_the_step_beyond_float32_is_refused_at_training_lr(tmp_path, capsys):
    # float32(0.9999999) = 1 - 2**-23: the steady step is lr * 2**23 = 8.39e38 for lr = 1e32
    raw = tiny_raw(**{"training.momentum": 0.9999999, "training.lr": 1e32})
    line = error_line(capsys, tmp_path, raw, "--dry-run")
    assert line.startswith("pfl-run: error: training.lr: 1e+32 makes sgd's step"), line
    assert "8.39e+38" in line and "training.momentum = 0.9999999" in line, line
    resolve(tiny_raw(**{"training.momentum": 0.9999999, "training.lr": 1e31}))  # 8.39e37 fits


@pytest.mark.parametrize("algorithm, key", [("pfedme", "personal_lr"), ("fedadam", "server_lr"),
                                            ("scaffold", "server_lr"), ("fedgen", "generator_lr")])
def test_a_plugin_learning_rate_of_zero_in_float32_is_refused_at_its_key(tmp_path, capsys, algorithm, key):
    raw = tiny_raw(**{"algorithm.name": algorithm, f"algorithm.params.{key}": 1e-46})
    line = error_line(capsys, tmp_path, raw, "--dry-run")
    assert line.startswith(f"pfl-run: error: algorithm.params.{key}: 1e-46 is 0 in float32"), line


def test_a_plugin_lr_the_configured_adam_cannot_step_with_is_one_line_naming_it(tmp_path, capsys):
    """pFedMe's inner optimiser is the configured one at personal_lr: Adam's first step overflows."""
    raw = one_round(**{"training.optimizer": "adam", "algorithm.name": "pfedme",
                       "algorithm.params.personal_lr": 1e38})
    line = error_line(capsys, tmp_path, raw)
    assert "a learning rate of 1e+38 makes adam's first step" in line, line
    assert "algorithm.params.personal_lr (now 1e+38)" in line, line


def test_a_server_step_beyond_float32_is_one_line_naming_the_parameter(tmp_path, capsys):
    """FedAdam's v_{-1} = tau^2 is 1e60 for tau = 1e30: torch refused it, an internal error."""
    line = error_line(capsys, tmp_path, one_round(**{"algorithm.name": "fedadam", "algorithm.params.tau": 1e30}))
    assert "before round 1, method fedadam: a value left float32's range" in line, line
    assert "algorithm.params.tau (now 1e+30)" in line, line


def test_an_overflow_inside_a_clients_training_is_a_divergence(monkeypatch):
    """A step size a method derives itself (here: alpha=1e39) that torch refuses ends as a
    client's divergence, which training.on_nonfinite handles, not as an internal error."""
    def overflowing_train(self, *args, **kwargs):
        torch.zeros(1).add_(torch.ones(1), alpha=1e39)

    monkeypatch.setattr(Client, "train", overflowing_train)
    with pytest.raises(NonFiniteError, match=r"client 0, .*a step left float32's range .*lower training.lr"):
        run_tiny(**{"experiment.rounds": 1, "executor.name": "sequential"})
    _, engine = run_tiny(**{"experiment.rounds": 1, "executor.name": "sequential",
                            "training.on_nonfinite": "skip_client"})
    assert engine.diverged == 4 and engine.trained == 0


def test_a_tune_range_reaching_a_float32_zero_lr_is_refused_at_the_range(tmp_path, capsys):
    raw = tiny_raw(**{"tune.space": {"training.lr": {"low": 1e-46, "high": 0.1, "log": True}}})
    line = error_line(capsys, tmp_path, raw, "--dry-run")
    assert line.startswith("pfl-run: error: tune.space.training.lr: 1e-46 is 0 in float32"), line


@pytest.mark.parametrize("key, limit", [("training.local_epochs", 10_000), ("experiment.coldstart_epochs", 10_000),
                                        ("experiment.rounds", 1_000_000)])
def test_epoch_and_round_counts_no_run_could_finish_are_refused(tmp_path, capsys, key, limit):
    """training.local_epochs = 2**63 - 1 was accepted and the run never ended."""
    line = error_line(capsys, tmp_path, tiny_raw(**{key: 2**63 - 1}), "--dry-run")
    assert line.startswith(f"pfl-run: error: {key}: must be <= {limit}"), line
    resolve(tiny_raw(**{key: limit}))  # the limit itself is allowed


# -- defect 7: a divergence names the settings that scale the update -------------------------

def test_a_divergence_from_weight_decay_names_training_weight_decay(tmp_path, capsys):
    line = error_line(capsys, tmp_path, one_round(**{"training.weight_decay": 1e30}))
    assert "training diverged: lower whichever of training.lr (now 0.1) and training.weight_decay (now 1e+30) " \
           "is too large, or set training.on_nonfinite" in line, line


def test_a_divergence_from_fedprox_mu_names_algorithm_params_mu(tmp_path, capsys):
    line = error_line(capsys, tmp_path, one_round(**{"algorithm.name": "fedprox", "algorithm.params.mu": 1e30}))
    assert "method fedprox" in line and "algorithm.params.mu (now 1e+30)" in line, line
    assert "training.weight_decay" not in line, line  # 0: not a candidate


def test_the_candidates_are_the_settings_that_scale_an_update():
    def settings(**overrides):
        resolved = resolve(tiny_raw(**overrides))
        return update_settings(resolved.spec, resolved.plugins)

    assert settings() == ["training.lr (now 0.1)"]
    assert settings(**{"algorithm.name": "fedprox"}) == ["training.lr (now 0.1)"]  # mu at its default
    assert settings(**{"training.momentum": 0.9, "training.weight_decay": 0.001}) == [
        "training.lr (now 0.1)", "training.momentum (now 0.9)", "training.weight_decay (now 0.001)"]
    # Adam ignores momentum; a non-default method parameter and an add-on's are named by their keys
    assert settings(**{"training.optimizer": "adam", "training.momentum": 0.9, "algorithm.name": "fedprox",
                       "algorithm.params.mu": 0.5, "addons": [{"name": "dropout", "params": {"p": 0.5}}]}) == [
        "training.lr (now 0.1)", "addons[0].params.p (now 0.5)", "algorithm.params.mu (now 0.5)"]
