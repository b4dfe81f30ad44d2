"""The MLflow UI addresses pfl prints: a study's compared runs in the chart view and in the
runs table with the key metrics as columns (MLflow 3.17's URL state, checked in a browser by
tests/test_mlflow_ui.py)."""

from __future__ import annotations

import json
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


def save_study_view(client, experiment_id: str, study_id: str, title: str) -> None:
    """The experiment tag the study's links open: its compared runs (POINT_TAG), sorted by
    acc_mean (the UI then lists them flat, not nested under their parents), with
    STUDY_COLUMNS. The UI ignores a saved view when the address has a search facet of its own,
    so the filter lives in the view, not in the link."""
    state = {"searchFilter": f"tags.`{POINT_TAG}` = '{study_id}'", "orderByKey": f"metrics.`{KEY_METRICS[0]}`",
             "orderByAsc": False, "selectedColumns": [f"metrics.`{n}`" for n in STUDY_COLUMNS]}
    client.set_experiment_tag(experiment_id, f"{VIEW_PREFIX}{study_view_key(study_id)}", view_state(title, state))


def runs_links(base: str, experiment_id: str, study_id: str | None = None) -> list[str]:
    """The MLflow UI addresses of one study's compared runs (its saved view,
    ``save_study_view``), or of the experiment's runs: the chart view and the table."""
    view = study_view_key(study_id) if study_id else KEY_METRICS_VIEW
    runs = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?"
    query = {"workflowType": WORKFLOW, "viewStateShareKey": view}
    return [runs + urlencode({**query, "compareRunsMode": mode}, quote_via=quote) for mode in ("CHART", "TABLE")]
