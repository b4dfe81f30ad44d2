"""The MLflow UI addresses pfl prints: a study's compared runs in the chart view and in the
runs table with the key metrics as columns (MLflow 3.17's URL state, checked in a browser by
tests/test_mlflow_ui.py)."""

from __future__ import annotations

import json
import math
import time
from urllib.parse import quote, urlencode

# On each run a study compares (a point's parent run, a single run, a reference run): the
# study's id. The links filter on it, so they open the comparison, not the tree of runs.
POINT_TAG = "pfl.point"
# Beside it: the point's sweep settings other than the method (the reference runs it is
# compared with share them), so a stored study's table can be rebuilt (`pfl results`).
GROUP_TAG = "pfl.group"

# MLflow 3's runs table shows no metric column by default. Its UI keeps a saved view of the
# table in an experiment tag (the format its "share view" writes); pfl saves one with the key
# metrics as columns, and the links it prints open it. A UI-internal format: if a later MLflow
# ignores it, the link still opens the runs.
KEY_METRICS = ("acc_mean", "acc_p10", "comm_up_bytes")
KEY_METRICS_VIEW = "pfl-key-metrics"
VIEW_PREFIX = "mlflow.sharedViewState."
VIEW_TAG = f"{VIEW_PREFIX}{KEY_METRICS_VIEW}"
# The UI remembers per browser whether it shows GenAI or model-training experiments and opens
# a new browser on GenAI, whatever the experiment's kind tag says; this query switches it.
WORKFLOW = "machine_learning"  # the query's workflowType


# The study view's columns: a point's final mean, its interval, its paired difference from
# the compared-to run with the adjusted p, the worst-decile accuracy and the bytes sent.
STUDY_COLUMNS = ("acc_mean", "acc_mean_ci95", "delta_acc_mean", "delta_acc_mean_p_adjusted", "acc_p10",
                 "comm_up_bytes")


def key_metrics_view() -> str:
    return view_state("pfl: key metrics", {"selectedColumns": [f"metrics.`{n}`" for n in KEY_METRICS]})


def view_state(name: str, state: dict) -> str:
    """A saved view of the runs page as MLflow's UI writes it into an experiment tag: its search
    facets (searchFilter, orderByKey, orderByAsc) and its UI state (selectedColumns)."""
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)})


def study_view_key(study_id: str) -> str:
    return f"pfl-study-{study_id}"


# The study view's first charts. MLflow's line charts draw no band around a line (only the
# min-max of a group of runs), so a point's parent run logs its 95% interval's ends beside its
# mean curve, and one chart draws the three in the run's colour: the mean solid, the ends dashed.
CURVE_METRIC = "acc_mean"
LOWER, UPPER = "_ci95_lower", "_ci95_upper"
CURVE_KEYS = (CURVE_METRIC, f"{CURVE_METRIC}{LOWER}", f"{CURVE_METRIC}{UPPER}")
DIFFERENCE_KEY = f"delta_{CURVE_METRIC}"  # each run's paired difference from the compared-to run
MODEL_METRICS_SECTION = "Model metrics"  # where MLflow's UI puts every other metric's chart
RUN_COLOR_TAG = "mlflow.runColor"  # a run's colour in the UI's charts and runs list


def interval_ends(metric: str, mean: float, half_width: float) -> dict[str, float]:
    """``<metric>_ci95_lower`` and ``_upper``, the 95% interval's ends the chart view draws
    (none where the interval is unknown: one seed)."""
    if not (math.isfinite(mean) and math.isfinite(half_width)):
        return {}
    return {f"{metric}{LOWER}": mean - half_width, f"{metric}{UPPER}": mean + half_width}


def study_section_name(compare_to: str | None) -> str:
    """The study's charts' heading: the chart view shows a chart's metric keys as its title,
    never a title of its own, so the heading names what the differences are taken against
    (short: the view cuts a long heading)."""
    return f"{CURVE_METRIC}, Δ vs {compare_to}" if compare_to else f"{CURVE_METRIC} by round"


def study_charts(compare_to: str | None, runs: int) -> dict:
    """The chart view's state: a first section (``study_section_name``) holding the accuracy
    chart (each run's mean curve between its interval's ends) and, where the study compares
    its runs, the bar chart of their paired differences from ``compare_to``; MLflow's chart of
    every other metric after it, collapsed."""
    shown = max(10, runs)  # the UI draws only the first 10 runs of a chart unless told more
    # displayName: the title where a UI shows one (3.17's runs view shows the metric keys)
    accuracy = {"uuid": "pfl-study-accuracy", "type": "LINE", "metricSectionId": "pfl-study", "deleted": False,
                "isGenerated": False, "runsCountToCompare": shown, "metricKey": CURVE_METRIC,
                "selectedMetricKeys": list(CURVE_KEYS),
                "displayName": f"{CURVE_METRIC} by round: mean over seeds (solid), 95% interval (dashed)",
                "xAxisKey": "step", "useGlobalXaxisKey": False, "lineSmoothness": 0, "useGlobalLineSmoothing": False,
                "scaleType": "linear", "xAxisScaleType": "linear", "displayPoints": True}
    charts = [accuracy]
    if compare_to:
        charts.append({"uuid": "pfl-study-difference", "type": "BAR", "metricSectionId": "pfl-study",
                       "deleted": False, "isGenerated": False, "runsCountToCompare": shown,
                       "metricKey": DIFFERENCE_KEY,
                       "displayName": f"Δ vs {compare_to}: final {CURVE_METRIC}, paired over seeds"})
    sections = [{"uuid": "pfl-study", "name": study_section_name(compare_to), "display": True, "isReordered": True,
                 "columns": 2},  # two charts side by side, wider than the UI's three columns
                {"uuid": "pfl-model-metrics", "name": MODEL_METRICS_SECTION, "display": False, "isReordered": False}]
    # isAccordionReordered keeps the sections in this order (the UI sorts them by name otherwise)
    return {"compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True,
            "runsHiddenMode": "SHOW_ALL"}


def save_study_view(client, experiment_id: str, study_id: str, title: str,
                    compared: list[tuple[str | None, str]] = (), compare_to: str | None = None) -> None:
    """The experiment tag the study's links open: its compared runs (POINT_TAG), sorted by
    acc_mean (the UI then lists them flat, not nested under their parents), with
    STUDY_COLUMNS and the study's charts first (``study_charts``). The UI ignores a saved view
    when the address has a search facet of its own, so the filter lives in the view, not in
    the link. ``compared``: each run's (run id, colour), the colour its method has in the
    study's pictures (``study.method_colours``)."""
    state = {"searchFilter": f"tags.`{POINT_TAG}` = '{study_id}'", "orderByKey": f"metrics.`{KEY_METRICS[0]}`",
             "orderByAsc": False, "selectedColumns": [f"metrics.`{n}`" for n in STUDY_COLUMNS],
             **study_charts(compare_to, len(compared))}
    client.set_experiment_tag(experiment_id, f"{VIEW_PREFIX}{study_view_key(study_id)}", view_state(title, state))
    for run_id, colour in compared:
        if run_id:
            client.set_tag(run_id, RUN_COLOR_TAG, colour)


def runs_links(base: str, experiment_id: str, study_id: str | None = None) -> list[str]:
    """The MLflow UI addresses of one study's compared runs (its saved view,
    ``save_study_view``), or of the experiment's runs: the chart view and the table."""
    view = study_view_key(study_id) if study_id else KEY_METRICS_VIEW
    runs = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?"
    query = {"workflowType": WORKFLOW, "viewStateShareKey": view}
    return [runs + urlencode({**query, "compareRunsMode": mode}, quote_via=quote) for mode in ("CHART", "TABLE")]
