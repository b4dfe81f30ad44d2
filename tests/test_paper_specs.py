"""Every spec in specs/ resolves as ``pfl-run SPEC --dry-run`` resolves it, and the paper-table
specs give every method the same private budget.

The spec-level checks (types, plugin parameters, each plugin's ``check_spec``, the sweep
points, ``experiment.compare_to``, the ``experiment.reference`` runs) need no data. The
data-level check of ``--dry-run`` (partition the data, build every architecture for its input
shape) runs where the spec's dataset file is here and skips, naming the file, where it is not
(../shared/data exists only on the project's machines)."""

import math
from pathlib import Path

import pytest
import torch

from pfl_core.data.federated import build_federated_data
from pfl_core.runtime.context import ModelBank
from pfl_core.spec import load_toml
from pfl_core.study.points import check_compare_to, reference_points, resolve_points, run_name_for, run_names

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.toml"))
TABLE_SPECS = ["fedmosaic_table2.toml", "fedsimsup_table2.toml", "pmixfed_table.toml"]


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the specs' data paths are relative to the repository root


def resolved_runs(path: Path) -> list[tuple[str, object]]:
    """(run name, Point) for every sweep point and every reference run, as --dry-run resolves them."""
    points = resolve_points(load_toml(path), [])
    names = run_names(points)  # as pfl-run names them (same-method points told apart)
    check_compare_to(points, names)
    return [*zip(names, points), *reference_points(points)]


def test_the_specs_folder_is_found():
    assert len(SPECS) >= 15 and all(ROOT.joinpath("specs", name).is_file() for name in TABLE_SPECS)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_spec_resolves_without_data(path):
    runs = resolved_runs(path)
    assert runs
    for name, point in runs:
        private = point.resolved.as_dict["budget"]["private_epochs"]
        assert math.isnan(private) or private >= 0, (name, private)  # nan: a method that can only measure it


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_spec_partitions_its_data_where_the_data_is_here(path):
    """--dry-run's data check, for the first sweep point and its first seed."""
    point = resolve_points(load_toml(path), [])[0]
    spec = point.for_seed(point.seeds[0]).spec if point.seeds else point.resolved.spec
    if spec.data.name == "npz":
        file = ROOT / spec.data.params["path"]
        if not file.is_file():
            pytest.skip(f"{path.name} needs {file.resolve()}, absent here (only on the project's machines)")
    elif spec.data.name != "synthetic":
        pytest.skip(f"{path.name} reads torchvision's {spec.data.name!r} files (downloaded on first use); "
                    f"not checked offline")
    data = build_federated_data(spec)
    ModelBank(spec, data.input_shape, data.num_classes, torch.device("cpu")).check_builds()
    assert data.clients


@pytest.mark.parametrize("name", TABLE_SPECS)
def test_paper_table_specs_give_every_run_the_same_private_budget(name):
    runs = resolved_runs(ROOT / "specs" / name)
    budgets = {label: point.resolved.as_dict["budget"]["private_epochs"] for label, point in runs}
    assert len(set(budgets.values())) == 1, budgets
    assert next(iter(budgets.values())) > 0
    labels = list(budgets)
    assert "local (reference)" in labels and "centralized (reference)" in labels, labels


@pytest.mark.parametrize("name", TABLE_SPECS)
def test_paper_table_specs_repeat_five_seeds_against_the_method_under_test(name):
    points = resolve_points(load_toml(ROOT / "specs" / name), [])
    experiment = points[0].resolved.spec.experiment
    assert experiment.seeds == [0, 1, 2, 3, 4]  # issue 21: the comparison specs default to 5 seeds
    assert experiment.reference == ["local", "centralized"]
    assert experiment.compare_to == run_name_for(points[0].resolved, points[0].settings)  # listed first
    algorithms = [p.resolved.spec.algorithm.name for p in points]
    assert len(set(algorithms)) == len(algorithms), algorithms  # one point per method
    assert not {"local", "centralized"} & set(algorithms)  # those are the reference runs


REPRO_SPECS = sorted(p.name for p in (ROOT / "specs").glob("repro_*.toml"))
# Points that run the steps convention on purpose (the same optimiser steps per model part),
# beside the passes-convention point of the same method (issue 24: both conventions).
STEPS_CONVENTION_POINTS = {"repro_pmixfed_cifar10.toml": {"fedalt"}, "repro_pmixfed_mnist.toml": {"fedalt"}}


@pytest.mark.parametrize("name", REPRO_SPECS)
def test_reproduction_specs_give_every_point_the_same_private_passes(name):
    runs = resolved_runs(ROOT / "specs" / name)
    steps_points = STEPS_CONVENTION_POINTS.get(name, set())
    budgets = {label: point.resolved.as_dict["budget"]["private_epochs"]
               for label, point in runs if label not in steps_points}
    assert len(set(budgets.values())) == 1, budgets
    assert {label for label, _ in runs} >= steps_points  # the exemption names a real point


# A second table (the paper's other baselines) and the first table it belongs to: tuned alike.
SECOND_TABLES = {"repro_pmixfed_cifar10_baselines.toml": "repro_pmixfed_cifar10.toml",
                 "repro_fedmosaic_fmnist_baselines.toml": "repro_fedmosaic_fmnist_pathological.toml",
                 "repro_fedsimsup_cifar10_baselines.toml": "repro_fedsimsup_cifar10_dirichlet.toml"}


def test_every_second_table_is_named_with_its_first():
    assert sorted(SECOND_TABLES) == [n for n in REPRO_SPECS if n.endswith("_baselines.toml")]


@pytest.mark.parametrize("second, first", sorted(SECOND_TABLES.items()))
def test_a_second_table_tunes_every_point_with_its_first_tables_budget_and_search(second, first):
    """Issue 34: no "holds (baselines untuned)": the other baselines get the same trials, the
    same search and the same tuning seeds as the method under test, which runs in both tables."""
    raw2, raw1 = load_toml(ROOT / "specs" / second), load_toml(ROOT / "specs" / first)
    method = raw1["experiment"]["compare_to"]
    assert raw2["tune"] == {**raw1["tune"], "method": {method: raw1["tune"]["method"][method]}} \
        if method in raw1["tune"].get("method", {}) else raw2["tune"] == raw1["tune"]
    points = resolve_points(raw2, [])
    assert points[0].resolved.spec.algorithm.name == method == raw2["experiment"]["compare_to"].split()[0]
    # nothing pins a learning rate beside the search: every point's lr comes from its tuning
    assert all("training.lr" not in p.settings for p in points)
    assert {k: v for k, v in raw2["partition"].items() if k != "params"} == \
        {k: v for k, v in raw1["partition"].items() if k != "params"}


@pytest.mark.parametrize("name", [n for n in REPRO_SPECS if "untuned" not in n and "flipped" not in n
                                  and n not in SECOND_TABLES])
def test_tuned_reproduction_specs_tune_local_fedavg_and_the_method_on_five_seeds(name):
    raw = load_toml(ROOT / "specs" / name)
    points = resolve_points(raw, [])
    algorithms = [p.resolved.spec.algorithm.name for p in points]
    # FedAvg averages parameters: it cannot run where the clients' architectures differ (COSMOS)
    same_architecture = not points[0].resolved.spec.model.pool
    assert {"local", "fedavg"} <= set(algorithms) or (not same_architecture and "local" in algorithms), algorithms
    assert raw["tune"]["trials"] >= 8 and raw["tune"]["metric"].startswith("val_")
    assert not set(raw["tune"]["seeds"]) & {0, 1, 2, 3, 4}  # tuning seeds are not final seeds
    experiment = points[0].resolved.spec.experiment
    assert experiment.seeds == [0, 1, 2, 3, 4]
    assert experiment.compare_to == run_name_for(points[0].resolved, points[0].settings)
