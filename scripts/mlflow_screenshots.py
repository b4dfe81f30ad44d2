#!/usr/bin/env python
"""Screenshots of the MLflow UI on a pfl sweep, taken with headless Chromium (a script, not a test).

Runs a sweep (``pfl-run SPEC``) into a new SQLite store in a temporary folder, starts ``mlflow
ui`` on that store on a free port meanwhile (waits until ``/health`` answers; always stops it at
the end), and opens what pfl-run printed. Saves, in OUT:

- ``mlflow-runs-chart.png``: the ``charts:`` link pfl-run printed: the study's compared runs
  (each point's parent run) in the chart view, one curve per point;
- ``mlflow-runs-table.png``: the ``table:`` link: the same runs with their metric columns;
- ``mlflow-compare.png``: the **compare-runs** page of the study parent's children (parallel
  coordinates, run details, parameters, metrics):
  ``/#/compare-runs?runs=["<id>", ...]&experiments=["<experiment id>"]``.

The printed links name a saved view of the runs page (an experiment tag that holds the
study's filter, sort and columns; ``pfl_core.tracking.links``), since MLflow 3.17's UI drops
a saved view when the address carries a search filter of its own.

    python scripts/mlflow_screenshots.py docs/images                           # the quickstart
    python scripts/mlflow_screenshots.py /tmp/shots --spec my.toml --set experiment.rounds=2
    python scripts/mlflow_screenshots.py /tmp/shots --dump-dom                 # also the pages' DOM

Needs ``chromium`` (or ``chromium-browser``) on PATH, or ``--browser PATH``. Prints where the
pictures are. Exit status 1 (with the reason) when the sweep, the UI or the browser fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BROWSER_NAMES = ("chromium", "chromium-browser")
CHART_PICTURE = "mlflow-runs-chart.png"
TABLE_PICTURE = "mlflow-runs-table.png"
COMPARE_PICTURE = "mlflow-compare.png"
# Chromium's virtual time runs far ahead of the wall clock while the page is idle; the runs
# charts need a long budget before they stop showing spinners (15 s of it is not enough).
VIRTUAL_TIME_BUDGET_MS = 120_000


def note(message: str, started: float) -> None:
    print(f"-- {message} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)


class ScreenshotError(RuntimeError):
    """A step failed: the message says which and why."""


def find_browser(explicit: str | None = None) -> str | None:
    """The headless-capable Chromium to use: ``explicit``, else the first of BROWSER_NAMES on PATH."""
    if explicit:
        return explicit
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_sweep(spec: Path, overrides: list[str], tracking_uri: str, timeout_s: float) -> str:
    """Run the sweep; returns what it printed (its last lines: the links to the study)."""
    command = [str(BIN / "pfl-run"), str(spec), "--tracking-uri", tracking_uri]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Its own process group: on a timeout its executor's worker processes are stopped with it.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise ScreenshotError(f"the sweep took more than {timeout_s:.0f} s (--timeout): {' '.join(command)}") from None
    if proc.returncode != 0:
        raise ScreenshotError(f"the sweep failed (exit {proc.returncode}): {' '.join(command)}\n{stderr.strip()[-2000:]}")
    return stdout


def printed_links(stdout: str, base: str) -> dict[str, str]:
    """The ``charts:`` and ``table:`` addresses pfl-run printed, moved to the UI at ``base``."""
    links = {}
    for line in stdout.splitlines():
        label, _, url = line.strip().partition(": ")
        if label in ("charts", "table") and url.strip().startswith("http"):
            url = url.strip()
            links[label] = base + url[url.index("/#/"):]
    if set(links) != {"charts", "table"}:
        raise ScreenshotError(f"pfl-run printed no charts:/table: links; its output ended:\n{stdout[-1500:]}")
    return links


def create_store(tracking_uri: str) -> None:
    """Create the SQLite store's tables (MLflow does so on first use)."""
    import mlflow

    mlflow.MlflowClient(tracking_uri).search_experiments()


def study_runs(tracking_uri: str) -> tuple[str, str, list]:
    """(experiment id, study parent run id, the parent's child runs) of the only study in the store."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiments = [e for e in client.search_experiments() if client.search_runs([e.experiment_id], max_results=1)]
    if len(experiments) != 1:
        raise ScreenshotError(f"expected the runs of one experiment in {tracking_uri}, found {len(experiments)}")
    experiment_id = experiments[0].experiment_id
    runs = client.search_runs([experiment_id], max_results=1000)
    top_level = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    if len(top_level) != 1:
        raise ScreenshotError(f"expected one study parent run, found {len(top_level)} top-level runs "
                              "(the spec needs a [sweep] with at least two points)")
    parent_id = top_level[0].info.run_id
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent_id]
    if len(children) < 2:
        raise ScreenshotError(f"the study parent {parent_id} has {len(children)} child runs; need 2 or more")
    return experiment_id, parent_id, children


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    query = urllib.parse.urlencode({
        "runs": json.dumps(run_ids),
        "experiments": json.dumps([experiment_id]),
        "workflowType": "machine_learning",
    }, quote_via=urllib.parse.quote)
    return f"{base}/#/compare-runs?{query}"


def wait_until_up(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ScreenshotError(f"mlflow ui exited with status {server.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise ScreenshotError(f"mlflow ui did not answer on {base}/health within {timeout_s:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """Stop a process we started in its own session, and its children (``mlflow ui``'s workers,
    the sweep's executor processes): the whole process group."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def browse(browser: str, url: str, window: tuple[int, int], output: list[str], timeout_s: float) -> str:
    """Run headless Chromium on ``url`` with the output flags given; returns its stdout."""
    with tempfile.TemporaryDirectory(prefix="pfl-chromium-") as profile:
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
                   f"--window-size={window[0]},{window[1]}", "--hide-scrollbars",
                   f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", *output, url]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise ScreenshotError(f"{browser} failed (exit {proc.returncode}) on {url}:\n{proc.stderr.strip()[-2000:]}")
    return proc.stdout


def screenshot(browser: str, url: str, path: Path, window: tuple[int, int], dump_dom: bool, timeout_s: float) -> None:
    # One page load gives both the picture and (with --dump-dom on stdout) the DOM it shows.
    dom = browse(browser, url, window, [f"--screenshot={path}"] + (["--dump-dom"] if dump_dom else []), timeout_s)
    if not path.is_file():
        raise ScreenshotError(f"{browser} wrote no picture for {url}")
    if dump_dom:
        path.with_suffix(".html").write_text(dom)


def window_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTH,HEIGHT, got {text!r}") from None
    return width, height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the pictures (created if absent; same-named files replaced)")
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "quickstart.toml",
                        help="a spec with a [sweep] (default: specs/quickstart.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to pfl-run --set; repeatable")
    parser.add_argument("--window-size", type=window_size, default=(1600, 1000), metavar="W,H",
                        help="browser window of the runs chart view (default 1600,1000)")
    parser.add_argument("--table-window-size", type=window_size, default=(2400, 800), metavar="W,H",
                        help="browser window of the runs table, wide enough for its metric columns (default 2400,800)")
    parser.add_argument("--compare-window-size", type=window_size, default=(1600, 2000), metavar="W,H",
                        help="browser window of the compare view, tall enough for its metrics (default 1600,2000)")
    parser.add_argument("--browser", help="Chromium executable (default: chromium or chromium-browser on PATH)")
    parser.add_argument("--dump-dom", action="store_true", help="also write each page's DOM beside its picture (.html)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds allowed for each step (default 180)")
    parser.add_argument("--store", type=Path, metavar="DIR",
                        help="keep the sweep's MLflow store (mlflow.db, its artifacts) in DIR (default: a temporary "
                             "folder, removed at the end)")
    args = parser.parse_args(argv)

    browser = find_browser(args.browser)
    if browser is None:
        print(f"mlflow_screenshots: error: none of {', '.join(BROWSER_NAMES)} is on PATH (or give --browser)",
              file=sys.stderr)
        return 1
    if args.store is not None and (args.store / "mlflow.db").exists():  # its runs would mix with the sweep's
        print(f"mlflow_screenshots: error: --store: {args.store} already holds an mlflow.db; give a new folder",
              file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="pfl-mlflow-ui-") as tmp:
            folder = args.store or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{folder.resolve() / 'mlflow.db'}"
            create_store(tracking_uri)
            # The UI starts while the sweep runs (both take seconds to import); the store exists
            # already, so neither creates its tables under the other's feet.
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            server = subprocess.Popen(
                [str(BIN / "mlflow"), "ui", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1",
                 "--port", str(port), "--workers", "1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                started = time.monotonic()
                printed = run_sweep(args.spec, args.overrides, tracking_uri, args.timeout)
                note(f"sweep {args.spec} logged to {tracking_uri}", started)
                experiment_id, _, children = study_runs(tracking_uri)
                links = printed_links(printed, base)
                wait_until_up(base, server, args.timeout)
                note(f"mlflow ui answers on {base} (time since the sweep began)", started)
                pictures = [
                    (args.out / CHART_PICTURE, links["charts"], args.window_size),
                    (args.out / TABLE_PICTURE, links["table"], args.table_window_size),
                    (args.out / COMPARE_PICTURE, compare_url(base, experiment_id, [run.info.run_id for run in children]),
                     args.compare_window_size),
                ]
                for path, url, window in pictures:
                    started = time.monotonic()
                    screenshot(browser, url, path, window, args.dump_dom, args.timeout)
                    note(f"{path.name} taken", started)
                    print(f"{path}  ({window[0]}x{window[1]}, {url.replace(base, '')})")
            finally:
                stop(server)
    except (ScreenshotError, subprocess.TimeoutExpired) as error:
        print(f"mlflow_screenshots: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
