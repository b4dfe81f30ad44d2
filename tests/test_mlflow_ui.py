"""A real-browser check of the MLflow UI on a sweep's store (scripts/mlflow_screenshots.py).

Skips where no Chromium is on PATH (``apt-get install chromium`` on Debian). Otherwise a tiny
two-point sweep is logged, ``mlflow ui`` started on its store, and the runs chart view and the
compare view are screenshotted and their DOM dumped by headless Chromium.
"""

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

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
CHART_WINDOW = (1200, 800)
COMPARE_WINDOW = (1200, 1400)


def page_texts(dom: str) -> set[str]:
    """The text nodes of a dumped page, stripped."""
    texts = set()

    class Collector(HTMLParser):
        def handle_data(self, data):
            texts.add(data.strip())

    Collector().feed(dom)
    return texts


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mlflow_ui")
    spec = folder / "ui_check.toml"
    spec.write_text(SPEC)
    out = folder / "pictures"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--spec", str(spec), "--dump-dom",
         "--window-size", "{},{}".format(*CHART_WINDOW), "--compare-window-size", "{},{}".format(*COMPARE_WINDOW)],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # It says where the pictures are.
    for name in (mlflow_screenshots.CHART_PICTURE, mlflow_screenshots.COMPARE_PICTURE):
        assert str(out / name) in proc.stdout
    return out


@needs_browser
@pytest.mark.parametrize("name, window", [(mlflow_screenshots.CHART_PICTURE, CHART_WINDOW),
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
def test_the_runs_chart_view_plots_each_sweep_run(pictures):
    dom = (pictures / mlflow_screenshots.CHART_PICTURE).with_suffix(".html").read_text()
    texts = page_texts(dom)
    # The model-training runs page: not MLflow 3's GenAI overview a new browser opens on, nor
    # the same runs shown as "Training runs" under the GenAI sidebar (Overview, Traces, ...).
    assert "Model metrics" in texts and "Overview" not in texts and "Training runs" not in texts
    # Each chart's legend names the run and the metric: the charts drew the runs' series
    # (a view still loading shows spinners and no legend; charts below the window are not drawn).
    for run in ("local", "fedavg"):
        assert f"{run} (acc_mean)" in dom and f"{run} (acc_p10)" in dom


@needs_browser
def test_the_compare_view_shows_the_sweep_runs_and_their_metrics(pictures):
    dom = (pictures / mlflow_screenshots.COMPARE_PICTURE).with_suffix(".html").read_text()
    assert "Comparing 2 Runs from 1 Experiment" in dom
    assert "acc_mean" in dom and "algorithm.name" in dom


def test_the_urls_are_mlflow_hash_routes():
    chart = mlflow_screenshots.runs_chart_url("http://h", "7", "abc")
    assert chart.startswith("http://h/#/experiments/7/runs?workflowType=machine_learning&compareRunsMode=CHART&")
    assert "searchFilter=tags.mlflow.parentRunId%20%3D%20%27abc%27" in chart
    compare = mlflow_screenshots.compare_url("http://h", "7", ["r1", "r2"])
    assert compare.startswith('http://h/#/compare-runs?runs=%5B%22r1%22%2C%20%22r2%22%5D&experiments=%5B%227%22%5D')
