"""What a run shows on the terminal: the progress bar, status lines, bytes and seconds for
people, and where the tracked runs are."""

from __future__ import annotations

import shlex
import sys

from pfl_core.tracking import journal
from pfl_core.tracking.links import runs_links, save_study_view
from pfl_core.tracking.tracker import current_study


class Progress:
    """A per-round progress bar on stderr (tqdm): elapsed time, ETA, and the latest metrics.

    tqdm redraws one line on a terminal and degrades to occasional lines elsewhere (CI logs,
    pipes). ``label`` names the run ("run 2/6 fedprox mu=0.1" during a sweep).
    """

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.latest: dict[str, float] = {}
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="round", file=stream or sys.stderr, leave=True,
                            dynamic_ncols=True, mininterval=0.5,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rounds "
                                       "[{elapsed}<{remaining}{postfix}]")

    def update(self, round: int, metrics: dict[str, float] | None = None) -> None:
        if self.bar is None:
            return
        if metrics:
            self.latest = metrics
        shown = ", ".join(
            f"{k} {human_bytes(self.latest[k]) if k.endswith('_bytes') else _fmt(self.latest[k])}"
            for k in ("acc_mean", "loss_mean", "comm_up_bytes")
            if k in self.latest
        )
        self.bar.set_postfix_str(shown, refresh=False)
        self.bar.update(round - self.bar.n)
        if round >= self.total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def status_line(text: str, enabled: bool = True, stream=None) -> None:
    """One line on stderr (``loading data ...``) that does not break a tqdm bar; only on a
    terminal, so a piped or logged run's stderr holds nothing but its one-line error if the
    loading fails."""
    stream = stream or sys.stderr
    if enabled and getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        tqdm.write(text, file=stream)


def warning_line(text: str, stream=None) -> None:
    """``pfl: warning: TEXT`` on stderr, on any stream (a log keeps it), without breaking a
    progress bar."""
    from tqdm import tqdm

    tqdm.write(f"pfl: warning: {text}", file=stream or sys.stderr)


def note_line(text: str, stream=None) -> None:
    """``pfl: note: TEXT`` on stderr, on any stream (a log keeps it): what a reader of the
    results must know (e.g. that the metrics are over a sample of clients)."""
    from tqdm import tqdm

    tqdm.write(f"pfl: note: {text}", file=stream or sys.stderr)


def human_bytes(value: float) -> str:
    """A byte count for people: ``0 B``, ``512 B``, ``16.2 kB``, ``1.6 MB``, ``3.1 GB`` (powers of
    1000, as MLflow's and most tools' MB)."""
    if value != value:  # nan
        return "-"
    value = float(value)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1000:
        return f"{sign}{value:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 999.95 or unit == "TB":
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_seconds(value: float) -> str:
    """``0.4 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if value != value:
        return "-"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(round(value)), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _fmt(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def experiment_location(spec, study_id: str | None = None) -> str | None:
    """Where a tracked invocation's runs are: the tracking URI, the experiment and the MLflow
    UI addresses of the runs study ``study_id`` compares (None when tracking is off)."""
    if not spec.tracking.enabled:
        return None
    import mlflow

    name = spec.tracking_experiment
    uri = mlflow.get_tracking_uri()
    try:
        with journal.short_http():  # a server gone at the end of the run: said at once, not in minutes
            experiment = mlflow.get_experiment_by_name(name) if name else None
    except Exception:
        experiment = None
    if experiment is None:
        return f"tracking: {uri}"
    id = experiment.experiment_id
    lines = [f"tracking: {uri}, experiment {experiment.name!r} (id {id})"]
    if study_id:
        try:
            with journal.short_http():
                study = current_study()
                compared = (study.compared, study.compare_to) if study is not None and study.id == study_id else ()
                save_study_view(mlflow.MlflowClient(), id, study_id, f"pfl study {study_id}", *compared)
        except Exception:  # the runs are logged; without the view the links open the experiment's runs
            study_id = None
    if uri.startswith(("http://", "https://")):
        charts, table = runs_links(uri, id, study_id)
    else:
        lines.append(f"  view: mlflow ui --backend-store-uri {shlex.quote(uri)}   then open")
        charts, table = runs_links("http://127.0.0.1:5000", id, study_id)
    lines += [f"  charts: {charts}", f"  table:  {table}"]
    return "\n".join(lines)
