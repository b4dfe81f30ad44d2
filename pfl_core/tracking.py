"""Run tracking: MLflow, or nothing (``tracking.enabled = false``), behind one interface."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from typing import Any

from .errors import PflError


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists become JSON. Same keys for every method."""
    out: dict[str, str] = {}
    if isinstance(data, dict) and data:
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(data, dict):  # an empty table still gets its param, so every run has it
        out[key] = "{}"
    elif isinstance(data, (list, tuple)):
        out[key] = json.dumps(data)
    elif data is None:
        out[key] = "none"
    else:
        out[key] = str(data)
    return out


class NullTracker:
    """Tracking switched off: everything is accepted and dropped."""

    run_id = None

    def start(self, experiment: str, run_name: str, params: dict[str, str], tags: dict[str, str]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, filename: str) -> None:
        pass

    def log_figure(self, figure, filename: str) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def log_metrics_to(self, run_id: str | None, metrics: dict[str, float]) -> None:
        """Add metrics to a run that may already have ended (a sweep's gains, known last)."""

    def end(self, status: str = "FINISHED") -> None:
        pass


class MlflowTracker(NullTracker):
    """Logs to MLflow. ``uri`` empty: MLflow's own default (sqlite ``mlflow.db`` here)."""

    def __init__(self, uri: str = ""):
        import logging

        import mlflow  # imported lazily: it is slow and only needed when tracking

        # Quiet MLflow's start-up chatter (database migrations, run links) on stderr.
        for name in ("alembic", "mlflow"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.mlflow = mlflow
        if uri:
            mlflow.set_tracking_uri(uri)
        self.run_id = None

    def start(self, experiment, run_name, params, tags):
        mlflow = self.mlflow
        try:
            mlflow.set_experiment(experiment)
        except Exception as exc:  # unreachable server, unwritable store
            raise PflError(f"MLflow tracking at {mlflow.get_tracking_uri()} failed: {one_line(exc)} (tracking.uri)") from None
        # A run started while another is active (a seed of a repeated experiment) is its child.
        run = mlflow.start_run(run_name=run_name, tags=tags, nested=mlflow.active_run() is not None)
        self.run_id = run.info.run_id
        items = sorted(params.items())
        for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            mlflow.log_params(dict(items[start : start + 100]))

    def log_metrics(self, metrics, step):
        self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_text(self, text, filename):
        self.mlflow.log_text(text, filename)

    def log_figure(self, figure, filename):
        self.mlflow.log_figure(figure, filename)

    def set_tag(self, key, value):
        self.mlflow.set_tag(key, value)

    def log_metrics_to(self, run_id, metrics):
        if run_id is None or not metrics:
            return
        from mlflow.entities import Metric

        client = self.mlflow.MlflowClient()
        stamp = int(__import__("time").time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), stamp, 0) for k, v in metrics.items()])

    def end(self, status="FINISHED"):
        if self.run_id is not None:
            self.mlflow.end_run(status=status)
            self.run_id = None


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def make_tracker(section, uri_override: str | None = None):
    if not section.enabled:
        return NullTracker()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowTracker(uri_override or section.uri)


class Progress:
    """A per-round progress bar on stderr showing the latest metrics.

    On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints one line per
    evaluation so logs stay readable.
    """

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.latest: dict[str, float] = {}

    def update(self, round: int, metrics: dict[str, float] | None = None) -> None:
        if not self.enabled:
            return
        if metrics:
            self.latest = metrics
        width = 20
        filled = int(width * round / self.total)
        bar = "#" * filled + "." * (width - filled)
        shown = "  ".join(
            f"{k} {_fmt(self.latest[k])}"
            for k in ("acc_mean", "loss_mean", "comm_up_bytes", "round_seconds")
            if k in self.latest
        )
        line = f"{self.label} [{bar}] {round}/{self.total}  {shown}"
        if self.tty:
            self.stream.write("\r" + line + " " * 4)
            if round == self.total:
                self.stream.write("\n")
        elif metrics:
            self.stream.write(line + "\n")
        self.stream.flush()


def _fmt(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:.1f}M"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
