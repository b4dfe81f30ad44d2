"""The study's MLflow chart view (the ``charts:`` link): its first charts, accuracy with its 95%
interval and the paired differences named by their reference, each method in its own colour,
and each point's parent run holding its mean-curve-with-band picture. What a browser shows of
it: tests/test_mlflow_ui.py."""

import io
import json
import math

import matplotlib
import mlflow
import pytest
from matplotlib.collections import PolyCollection
from mlflow.tracking import MlflowClient
from PIL import Image
from test_cli import write_spec
from tiny import tiny_raw

from pfl_core.study import run_spec_file
from pfl_core.tracking import plots
from pfl_core.tracking.links import CURVE_KEYS, interval_ends, study_charts
from pfl_core.tracking.study import Study, method_colours
from pfl_core.tracking.tracker import _STUDY


def test_interval_ends_are_the_mean_less_and_plus_the_half_width():
    assert interval_ends("acc_mean", 0.5, 0.125) == {"acc_mean_ci95_lower": 0.375, "acc_mean_ci95_upper": 0.625}
    assert interval_ends("acc_mean", 0.5, math.nan) == {}  # one seed: no interval, no ends
    assert interval_ends("acc_mean", math.nan, 0.1) == {}


def test_the_methods_colours_are_tab10_then_tab20s_light_shades_all_distinct():
    tab10 = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors]
    light = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors[1::2]]
    assert [plots.method_colour(i) for i in range(20)] == tab10 + light
    assert len({plots.method_colour(i) for i in range(20)}) == 20
    assert plots.method_colour(20) == plots.method_colour(0)


def test_a_methods_colour_is_its_place_among_the_studys_planned_methods():
    assert method_colours(["b", "a"]) == [plots.method_colour(0), plots.method_colour(1)]  # no study: as given
    token = _STUDY.set(Study(methods=["a", "diverged", "b"]))
    try:
        # the comparison lists b then a, without the point that diverged: each keeps its colour
        assert method_colours(["b", "a"]) == [plots.method_colour(2), plots.method_colour(0)]
        assert method_colours(["b", "other"]) == [plots.method_colour(0), plots.method_colour(1)]  # not planned
    finally:
        _STUDY.reset(token)


def test_a_study_without_a_comparison_opens_on_its_accuracy_chart_alone():
    state = study_charts("", 3)
    assert [c["uuid"] for c in state["compareRunCharts"]] == ["pfl-study-accuracy"]
    assert state["compareRunSections"][0]["name"] == "acc_mean by round"
    assert study_charts("local", 25)["compareRunCharts"][1]["runsCountToCompare"] == 25  # every run drawn


def test_the_mean_curves_picture_draws_each_method_in_its_colour_with_its_band():
    figure = plots.mean_curves_figure([("a", [1, 2], [0.5, 0.6], [0.1, 0.1]), ("b", [1, 2], [0.4, 0.5], [0.2, 0.1]),
                                       ("one seed", [1, 2], [0.3, 0.4], [math.nan, math.nan])], "acc_mean", "t")
    try:
        ax = figure.axes[0]
        assert [matplotlib.colors.to_hex(line.get_color()) for line in ax.lines] == [plots.method_colour(i)
                                                                                    for i in range(3)]
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 2  # none for the method with one seed
        assert [matplotlib.colors.to_hex(b.get_facecolor()[0], keep_alpha=False) for b in bands] == [
            plots.method_colour(0), plots.method_colour(1)]
        # the first band spans mean - half .. mean + half at round 1
        ys = bands[0].get_paths()[0].vertices[:, 1]
        assert min(ys) == pytest.approx(0.4) and max(ys) == pytest.approx(0.7)
    finally:
        plots.close(figure)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A tracked 2-seed sweep of fedavg and local, compared to local (the second point: the
    reference is the one the spec names, not the first)."""
    folder = tmp_path_factory.mktemp("study_view")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    raw = tiny_raw(**{"experiment.rounds": 2, "experiment.seeds": [0, 1], "experiment.compare_to": "local",
                      "tracking.enabled": True, "evaluation.every": 1})
    raw["sweep"] = {"algorithm.name": ["fedavg", "local"]}
    printed = io.StringIO()
    results = run_spec_file(write_spec(folder, raw), [], quiet=False, tracking_uri=uri, out=printed)
    mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment(client.get_run(results[0].run_id).info.experiment_id)
    study_id = client.get_run(results[0].run_id).data.tags["pfl.study"]
    assert f"viewStateShareKey=pfl-study-{study_id}&compareRunsMode=CHART" in printed.getvalue()
    view = json.loads(json.loads(experiment.tags[f"mlflow.sharedViewState.pfl-study-{study_id}"])["state"])
    return client, results, view


def test_the_view_opens_on_accuracy_with_its_interval_then_the_difference_from_the_reference(study):
    _, _, view = study
    first, rest = view["compareRunSections"][0], view["compareRunSections"][1:]
    assert first["name"] == "acc_mean, Δ vs local" and first["display"]
    assert [s["name"] for s in rest] == ["Model metrics"] and not rest[0]["display"]  # the others, collapsed
    assert view["isAccordionReordered"]  # else the UI sorts the sections by name
    charts = [c for c in view["compareRunCharts"] if c["metricSectionId"] == first["uuid"]]
    assert [(c["type"], c["metricKey"]) for c in charts] == [("LINE", "acc_mean"), ("BAR", "delta_acc_mean")]
    assert charts[0]["selectedMetricKeys"] == list(CURVE_KEYS) == ["acc_mean", "acc_mean_ci95_lower",
                                                                    "acc_mean_ci95_upper"]
    assert charts[0]["lineSmoothness"] == 0 and not charts[0]["useGlobalLineSmoothing"]  # the values as logged
    assert view["compareRunCharts"][:2] == charts


def test_each_method_has_its_own_colour_in_the_comparisons_order(study):
    client, results, _ = study
    colours = [client.get_run(r.run_id).data.tags["mlflow.runColor"] for r in results]
    assert [r.name for r in results] == ["fedavg", "local"]
    assert colours == [plots.method_colour(0), plots.method_colour(1)] == ["#1f77b4", "#ff7f0e"]


def test_each_points_parent_logs_its_intervals_ends_and_its_curve_picture(study):
    client, results, _ = study
    for point in results:
        history = {key: {m.step: m.value for m in client.get_metric_history(point.run_id, key)}
                   for key in ("acc_mean", "acc_mean_ci95", "acc_mean_ci95_lower", "acc_mean_ci95_upper")}
        assert sorted(history["acc_mean_ci95_lower"]) == sorted(history["acc_mean"]) == [1, 2]
        for step, mean in history["acc_mean"].items():
            half = history["acc_mean_ci95"][step]
            assert history["acc_mean_ci95_lower"][step] == pytest.approx(mean - half)
            assert history["acc_mean_ci95_upper"][step] == pytest.approx(mean + half)
        pictures = {a.path for a in client.list_artifacts(point.run_id, "results")}
        assert "results/acc_mean_curves.png" in pictures


def rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def test_a_points_picture_draws_it_in_its_colour_in_the_study(study, tmp_path):
    client, results, _ = study
    for point, colour, other in zip(results, ["#1f77b4", "#ff7f0e"], ["#ff7f0e", "#1f77b4"]):
        path = client.download_artifacts(point.run_id, "results/acc_mean_curves.png", str(tmp_path))
        with Image.open(path) as image:
            pixels = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20)}
        assert rgb(colour) in pixels and rgb(other) not in pixels, point.name
