"""A real-browser check of the MLflow UI on a sweep's store (scripts/mlflow_screenshots.py).

Skips where no Chromium is on PATH (``apt-get install chromium`` on Debian). Otherwise a tiny
two-point sweep over two seeds is logged, ``mlflow ui`` started on its store, and the two links
pfl-run printed (``charts:``, ``table:``) and the compare view are screenshotted and their DOM
dumped by headless Chromium: the tests read what the pages show, and the sweep's store (kept
with ``--store``) what its runs hold.
"""

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from pfl_core.tracking.plots import method_colour

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "mlflow_screenshots.py"
sys.path.insert(0, str(SCRIPT.parent))
import mlflow_screenshots  # noqa: E402

BROWSER = mlflow_screenshots.find_browser()
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason=f"no headless browser: none of {', '.join(mlflow_screenshots.BROWSER_NAMES)} is on PATH")

SPEC = """
[experiment]
name = "ui_check"
seed = 0
rounds = 2
seeds = [0, 1]

[data]
name = "synthetic"
params = { num_devices = 3, samples_per_device = 60, dim = 10 }

[partition]
scheme = "domain"
num_clients = 3

[model]
name = "mlp"
params = { hidden = [] }

[algorithm]
name = "fedavg"

[training]
local_epochs = 1
batch_size = 20
lr = 0.1

[evaluation]
every = 1

[sweep]
"algorithm.name" = ["local", "fedavg"]
"""
CHART_WINDOW = (1600, 1000)  # the study's charts' heading whole beside MLflow's assistant panel
TABLE_WINDOW = (2400, 800)  # the table draws only the columns in its window
COMPARE_WINDOW = (1200, 1400)


def page_text_list(dom: str) -> list[str]:
    """The non-empty text nodes of a dumped page, stripped, in document order."""
    texts = []

    class Collector(HTMLParser):
        def handle_data(self, data):
            if data.strip():
                texts.append(data.strip())

    Collector().feed(dom)
    return texts


def page_texts(dom: str) -> set[str]:
    return set(page_text_list(dom))


def matching_runs(dom: str) -> int:
    """The runs page's count line, "<n> matching runs" (two text nodes)."""
    texts = page_text_list(dom)
    return int(texts[texts.index("matching runs") - 1])


def chart_titles(dom: str) -> list[str]:
    """The chart view's section headings and chart titles in page order: the texts after the
    runs list ("matching runs") up to the "Add section" button."""
    texts = page_text_list(dom)
    return texts[texts.index("matching runs") + 1: texts.index("Add section")]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mlflow_ui")
    spec = folder / "ui_check.toml"
    spec.write_text(SPEC)
    out = folder / "pictures"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--spec", str(spec), "--dump-dom", "--store", str(folder / "store"),
         "--window-size", "{},{}".format(*CHART_WINDOW), "--table-window-size", "{},{}".format(*TABLE_WINDOW), "--compare-window-size", "{},{}".format(*COMPARE_WINDOW)],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # It says where the pictures are.
    for name in (mlflow_screenshots.CHART_PICTURE, mlflow_screenshots.COMPARE_PICTURE):
        assert str(out / name) in proc.stdout
    return out


@needs_browser
@pytest.mark.parametrize("name, window", [(mlflow_screenshots.CHART_PICTURE, CHART_WINDOW),
                                          (mlflow_screenshots.TABLE_PICTURE, TABLE_WINDOW),
                                          (mlflow_screenshots.COMPARE_PICTURE, COMPARE_WINDOW)])
def test_the_pictures_are_pngs_of_the_window_with_content(pictures, name, window):
    with Image.open(pictures / name) as image:
        assert image.format == "PNG"
        assert image.size == window
        colours = image.convert("RGB").getcolors(maxcolors=window[0] * window[1])
    # A blank or failed page (white, or one error colour) has a handful of colours and one
    # that covers nearly everything; a rendered MLflow page has anti-aliased text and charts.
    assert len(colours) > 100
    assert max(count for count, _ in colours) < 0.9 * window[0] * window[1]


@needs_browser
def test_the_printed_charts_link_plots_each_point_and_nothing_else(pictures):
    dom = (pictures / mlflow_screenshots.CHART_PICTURE).with_suffix(".html").read_text()
    texts = page_texts(dom)
    # The model-training runs page: not MLflow 3's GenAI overview a new browser opens on, nor
    # the same runs shown as "Training runs" under the GenAI sidebar (Overview, Traces, ...).
    assert "Model metrics" in texts and "Overview" not in texts and "Training runs" not in texts
    # The two points' parent runs, listed flat: not the study parent (collapsed, one bar) nor
    # the per-seed runs. Each chart's legend names the point and the metric: the charts drew
    # the points' per-round means and their intervals (acc_mean_ci95).
    assert matching_runs(dom) == 2
    assert not any(text.startswith("ui_check ") or "seed=" in text for text in texts)
    for run in ("local", "fedavg"):
        assert run in texts
        for series in ("acc_mean", "acc_mean_ci95_lower", "acc_mean_ci95_upper"):
            assert f"{run} ({series})" in texts, series


@needs_browser
def test_the_charts_link_opens_on_accuracy_with_its_interval_and_the_difference_from_the_reference(pictures):
    titles = chart_titles((pictures / mlflow_screenshots.CHART_PICTURE).with_suffix(".html").read_text())
    # First the study's heading, naming the reference, then its two charts (a chart's title is
    # its metric keys: the mean and its interval's ends in one chart; the paired differences),
    # and only then MLflow's section of every other metric, collapsed: none of its charts drawn.
    heading = titles.index("acc_mean, Δ vs local")
    accuracy = titles.index("acc_mean vs acc_mean_ci95_lower vs acc_mean_ci95_upper")
    difference = titles.index("delta_acc_mean")
    assert heading == 0 and heading < accuracy < difference < titles.index("Model metrics")
    assert not any(title.startswith(("acc_p10", "comm_up_bytes", "acc_mean_std")) for title in titles)
    # local is the reference: the difference chart has a bar for fedavg alone
    assert "fedavg" in titles[difference:] and "local" not in titles[difference:titles.index("Model metrics")]


@needs_browser
def test_each_method_is_drawn_in_its_own_colour(pictures):
    dom = (pictures / mlflow_screenshots.CHART_PICTURE).with_suffix(".html").read_text()
    texts = page_text_list(dom)
    # the runs list shows each run's colour (its hex value, then its name); the study's order
    # is the comparison's (local, fedavg): tab10's blue, then its orange
    colours = {name: texts[texts.index(name) - 1] for name in ("local", "fedavg")}
    assert colours == {"local": method_colour(0), "fedavg": method_colour(1)} == {"local": "#1f77b4",
                                                                                  "fedavg": "#ff7f0e"}
    assert "rgb(31, 119, 180)" in dom and "rgb(255, 127, 14)" in dom  # the charts draw them


@needs_browser
def test_each_points_parent_run_holds_its_mean_curve_picture(pictures):
    client = MlflowClient(f"sqlite:///{pictures.parent / 'store' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ui_check")
    points = client.search_runs([experiment.experiment_id], "tags.`pfl.point` != ''")
    assert sorted(run.info.run_name for run in points) == ["fedavg", "local"]
    for run in points:
        assert "results/acc_mean_curves.png" in {a.path for a in client.list_artifacts(run.info.run_id, "results")}
        with Image.open(client.download_artifacts(run.info.run_id, "results/acc_mean_curves.png")) as image:
            assert image.format == "PNG"


@needs_browser
def test_the_printed_table_link_shows_the_points_with_their_metric_columns(pictures):
    dom = (pictures / mlflow_screenshots.TABLE_PICTURE).with_suffix(".html").read_text()
    texts = page_texts(dom)
    assert matching_runs(dom) == 2 and {"local", "fedavg"} <= texts
    for column in ("acc_mean", "acc_mean_ci95", "delta_acc_mean", "acc_p10", "comm_up_bytes"):
        assert column in texts, column
    # the cells hold the points' values: FedAvg's Δ against the first point (local) is a number
    assert sum(1 for text in texts if text.replace(".", "", 1).replace("-", "", 1).isdigit()) >= 8


@needs_browser
def test_the_compare_view_shows_the_sweep_runs_and_their_metrics(pictures):
    dom = (pictures / mlflow_screenshots.COMPARE_PICTURE).with_suffix(".html").read_text()
    assert "Comparing 2 Runs from 1 Experiment" in dom
    assert "acc_mean" in dom and "algorithm.name" in dom


def test_the_urls_are_mlflow_hash_routes():
    printed = "tracking: x\n  charts: http://127.0.0.1:5000/#/experiments/7/runs?a=1\n  table:  http://127.0.0.1:5000/#/t"
    assert mlflow_screenshots.printed_links(printed, "http://h:1") == {"charts": "http://h:1/#/experiments/7/runs?a=1",
                                                                        "table": "http://h:1/#/t"}
    compare = mlflow_screenshots.compare_url("http://h", "7", ["r1", "r2"])
    assert compare.startswith('http://h/#/compare-runs?runs=%5B%22r1%22%2C%20%22r2%22%5D&experiments=%5B%227%22%5D')
