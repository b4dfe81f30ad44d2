"""Privacy add-ons: the Gaussian mechanism on expertise and k-ary randomised response on labels."""

import math
from types import SimpleNamespace

import pytest
import torch
from tiny import run_tiny, tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import SpecError
from pfl_core.payload import Packed
from pfl_core.spec import dump_toml
from pfl_plugins.privacy import (
    GaussianExpertise,
    GaussianExpertiseParams,
    gaussian_epsilon,
    keep_probability,
    randomised_response,
)

torch.set_num_threads(1)  # tiny models: thread contention dominates on a loaded 2-core machine

BASE = {"algorithm.name": "fedmosaic", "public.size": 60, "experiment.rounds": 2}


def addon(name, **params):
    return {"addons": [{"name": name, "params": params}]}


def test_gaussian_epsilon_formula():
    # eps_E = c sqrt(|U|) / sigma * sqrt(2 ln(1.25 / delta))
    assert gaussian_epsilon(2.0, 1e-5, 100, 1.0) == pytest.approx(10 / 2 * math.sqrt(2 * math.log(1.25e5)))
    assert gaussian_epsilon(1.0, 1e-5, 10_000, math.log(10)) == pytest.approx(
        math.log(10) * 100 * math.sqrt(2 * math.log(1.25 / 1e-5)))
    assert gaussian_epsilon(4.0, 0.01, 100, 1.0) == pytest.approx(gaussian_epsilon(2.0, 0.01, 100, 1.0) / 2)


def test_gaussian_expertise_logs_eps_every_round():
    result, _ = run_tiny(**BASE, **addon("gaussian_expertise", sigma=0.5, delta=1e-5))
    expected = gaussian_epsilon(0.5, 1e-5, 60, 1.0)  # expertise "W": c = 1
    assert all(h["eps_E"] == pytest.approx(expected) and h["eps_round"] == pytest.approx(expected)
               for h in result.history)
    assert result.final["comm_up_bytes"] == 2 * 4 * 90  # noise does not change the bytes sent


def wrap(plugin, ctx, client, upload):
    """Drive a hook wrapper by hand: what it returns for a given inner answer."""
    gen = plugin.client_upload(ctx, client)
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(upload)
    return stop.value.value


def test_gaussian_expertise_noises_clips_and_requantises_the_codes():
    ctx = SimpleNamespace(params=SimpleNamespace(expertise="W"), num_classes=10)
    client = SimpleNamespace(generator=lambda purpose: torch.Generator().manual_seed(1))
    codes = torch.full((5000,), 128, dtype=torch.uint8)
    labels = Packed(torch.zeros(5000, dtype=torch.uint8), 4)
    out = wrap(GaussianExpertise(GaussianExpertiseParams(sigma=0.1)), ctx, client,
               {"labels": labels, "expertise": Packed(codes, 8)})
    assert out["labels"] is labels and out["expertise"].bits == 8 and out["expertise"].value.dtype == torch.uint8
    values = out["expertise"].value.double() / 255
    assert float(values.std()) == pytest.approx(0.1, rel=0.1)      # sigma on the [0, 1] scale
    assert float(values.mean()) == pytest.approx(128 / 255, abs=0.01)
    loud = wrap(GaussianExpertise(GaussianExpertiseParams(sigma=10.0)), ctx, client,
                {"labels": labels, "expertise": Packed(codes, 8)})["expertise"].value
    assert set(loud.unique().tolist()) <= set(range(256)) and {0, 255} <= set(loud.unique().tolist())  # clipped


def test_gaussian_expertise_uses_log_C_for_entropy_expertise():
    result, _ = run_tiny(**BASE, **{"algorithm.params.expertise": "U"}, **addon("gaussian_expertise", sigma=1.0))
    assert result.final["eps_E"] == pytest.approx(gaussian_epsilon(1.0, 1e-5, 60, math.log(10)))


def test_gaussian_expertise_needs_an_algorithm_that_sends_expertise():
    raw = tiny_raw(**{**BASE, "algorithm.name": "fedct"}, **addon("gaussian_expertise"))
    with pytest.raises(SpecError) as err:
        Engine(resolve(raw), progress=False).run()
    assert err.value.path == "addons[0].name"


def test_randomised_response_keep_probability_and_frequencies():
    assert keep_probability(math.log(9), 10) == pytest.approx(0.5)
    labels = torch.zeros(20_000, dtype=torch.uint8)
    noisy = randomised_response(labels, math.log(9), 10, torch.Generator().manual_seed(0))
    assert noisy.dtype == torch.uint8
    assert float((noisy == 0).double().mean()) == pytest.approx(0.5, abs=0.02)
    others = torch.bincount(noisy.long(), minlength=10)[1:].double() / len(noisy)
    assert torch.allclose(others, torch.full((9,), 0.5 / 9, dtype=torch.float64), atol=0.01)


def test_label_mechanism_logs_eps_and_both_add_ups_sum_per_round():
    both = {"addons": [{"name": "label_mechanism", "params": {"eps_label": 1.0, "sensitivity": 3}},
                       {"name": "gaussian_expertise", "params": {"sigma": 1.0}}]}
    result, _ = run_tiny(**BASE, **both)
    eps_e = gaussian_epsilon(1.0, 1e-5, 60, 1.0)
    assert result.final["eps_L"] == pytest.approx(3.0)
    assert result.final["eps_round"] == pytest.approx(3.0 + eps_e)
    default, _ = run_tiny(**{**BASE, "algorithm.name": "fedct"}, **addon("label_mechanism", eps_label=0.5))
    assert default.final["eps_L"] == pytest.approx(60 * 0.5)  # worst case: every label of U


def test_label_mechanism_composes_with_fedct_and_a_huge_epsilon_changes_nothing():
    ct = {**BASE, "algorithm.name": "fedct"}
    _, clean = run_tiny(**ct)
    _, exact = run_tiny(**ct, **addon("label_mechanism", eps_label=60.0))
    assert torch.equal(clean.ctx.server["consensus"], exact.ctx.server["consensus"])
    _, noisy = run_tiny(**ct, **addon("label_mechanism", eps_label=0.01))
    assert not torch.equal(clean.ctx.server["consensus"], noisy.ctx.server["consensus"])


def test_bad_privacy_parameters_name_the_key():
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**BASE, **addon("gaussian_expertise", sigma=0.0)))
    assert err.value.path == "addons[0].params.sigma"
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**BASE, **addon("gaussian_expertise", delta=1.0)))
    assert err.value.path == "addons[0].params.delta"


# -- label_mechanism with expertise in the clear ------------------------------------------


@pytest.mark.parametrize("expertise", ["W", "U"])
def test_label_mechanism_refuses_expertise_sent_without_noise(expertise):
    # "W" is the share of the true predicted class: it gives the randomised label back.
    # "U" is an un-noised function of the same model: the release has no finite epsilon.
    mosaic = {**BASE, "algorithm.params.expertise": expertise}
    both = [{"name": "corrupted_clients", "params": {"clients": [0]}}, {"name": "label_mechanism"}]
    with pytest.raises(SpecError) as err:
        resolve(tiny_raw(**mosaic, addons=both))
    assert err.value.path == "addons[1].name" and f"expertise '{expertise}'" in str(err.value)
    with pytest.raises(SpecError) as err:  # the default expertise is "W"
        resolve(tiny_raw(**BASE, **addon("label_mechanism")))
    assert err.value.path == "addons[0].name"


def test_label_mechanism_is_accepted_with_noised_or_no_expertise():
    noised = [{"name": "label_mechanism"}, {"name": "gaussian_expertise"}]
    for algorithm in ({"algorithm.params.expertise": "W"}, {"algorithm.params.expertise": "U"}):
        resolve(tiny_raw(**BASE, **algorithm, addons=noised))
    resolve(tiny_raw(**BASE, **{"algorithm.params.expertise": "uniform"}, **addon("label_mechanism")))
    resolve(tiny_raw(**{**BASE, "algorithm.name": "fedct"}, **addon("label_mechanism")))


def test_label_mechanism_with_clear_expertise_exits_2_with_one_line(tmp_path, capsys):
    spec = tmp_path / "leak.toml"
    spec.write_text(dump_toml(tiny_raw(**BASE, **addon("label_mechanism"))))
    assert run_main([str(spec), "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "addons[0].name" in err[0] and "gaussian_expertise" in err[0]
