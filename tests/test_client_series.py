"""Per-client values (``client.log`` / ``ctx.log_client``): one table per run, and only their
mean, min and max over clients as metrics; the clients' final accuracy as a distribution."""

import csv
import io

import numpy as np
import pytest
from tiny import tiny_raw

from pfl_core import Plugin, hookimpl, registry
from pfl_core.engine import Engine, resolve
from pfl_core.engine.engine import client_aggregates
from pfl_core.tracking import plots
from pfl_core.tracking.tracker import NullTracker, log_accuracy_distribution


class Recording(NullTracker):
    run_id = "run-1"

    def __init__(self):
        self.metrics, self.texts, self.figures = {}, {}, {}

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_text(self, text, filename):
        self.texts[filename] = text

    def log_figure(self, figure, filename):
        self.figures[filename] = figure


class Scores(Plugin):
    """Logs ``score = 10 * client + round`` from each client's training (client side) and
    ``server_side = 2 * round`` for client 0 at the round's end (server side)."""

    name = "scores"
    kind = registry.ADDON

    @hookimpl(wrapper=True)
    def local_train(self, ctx, client):
        result = yield
        client.log(score=10 * client.id + ctx.round)
        return result

    @hookimpl
    def on_round_end(self, ctx, round):
        ctx.log_client(0, server_side=2 * round)


def run(tracker, **overrides):
    resolved = resolve(tiny_raw(**overrides))
    resolved.plugins.insert(0, Scores())
    engine = Engine(resolved, tracker=tracker, progress=False)
    return engine.run(), engine


def test_aggregates_are_over_the_rounds_own_rows():
    series = [{"round": 1, "client": c, "name": "x", "value": v} for c, v in [(0, 100.0), (1, -100.0)]]
    series += [{"round": 2, "client": c, "name": "x", "value": v} for c, v in [(0, 1.0), (1, 5.0), (2, 3.0)]]
    series += [{"round": 2, "client": 1, "name": "y", "value": 7.0}]
    assert client_aggregates(series, 2) == {"x_mean": 3.0, "x_min": 1.0, "x_max": 5.0,
                                            "y_mean": 7.0, "y_min": 7.0, "y_max": 7.0}
    assert client_aggregates(series, 3) == {}  # nothing logged this round: no metric


def test_client_values_become_aggregates_and_one_table(tmp_path):
    tracker = Recording()
    result, engine = run(tracker, **{"experiment.rounds": 2})
    for round in (1, 2):  # clients 0..3: score = 10 * client + round
        logged = tracker.metrics[round]
        assert logged["score_mean"] == pytest.approx(15 + round)
        assert (logged["score_min"], logged["score_max"]) == (round, 30 + round)
        assert logged["server_side_mean"] == logged["server_side_min"] == logged["server_side_max"] == 2 * round
    # no per-client keys among the metrics
    assert not [k for step in tracker.metrics.values() for k in step if "/" in k]
    assert "score_mean" in result.final
    table = list(csv.DictReader(io.StringIO(tracker.texts["results/client_series.csv"])))
    assert {(int(r["round"]), int(r["client"]), r["name"], float(r["value"])) for r in table} == (
        {(rd, c, "score", 10.0 * c + rd) for rd in (1, 2) for c in range(4)}
        | {(rd, 0, "server_side", 2.0 * rd) for rd in (1, 2)})
    assert len(table) == len(engine.ctx.client_series) == 10


def test_a_run_without_client_values_logs_no_series_table():
    tracker = Recording()
    Engine(resolve(tiny_raw(**{"experiment.rounds": 1})), tracker=tracker, progress=False).run()
    assert "results/client_series.csv" not in tracker.texts
    assert "results/client_accuracy.png" in tracker.figures


def test_cold_start_clients_are_marked_in_the_accuracy_picture(monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "accuracy_distribution_figure", lambda groups, title: drawn.append(groups) or "fig")
    monkeypatch.setattr(plots, "close", lambda fig: None)
    tracker = Recording()
    resolved = resolve(tiny_raw(**{"experiment.rounds": 1, "experiment.coldstart_clients": 1}))
    engine = Engine(resolved, tracker=tracker, progress=False)
    result = engine.run()
    ((label, accs, colds),) = drawn[0]
    assert label == "fedavg" and tracker.figures["results/client_accuracy.png"] == "fig"
    assert accs == [r["acc"] for r in result.client_rows]
    cold = engine.ctx.coldstart_clients
    assert [r["client"] for r, c in zip(result.client_rows, colds) if c] == cold and len(cold) == 1


def test_tracking_off_draws_nothing(monkeypatch):
    monkeypatch.setattr(plots, "accuracy_distribution_figure", lambda *a: pytest.fail("drawn without a tracker"))
    log_accuracy_distribution(NullTracker(), [("a", [{"acc": 0.5}])], "t")


def test_the_distribution_figure_boxes_training_clients_and_marks_cold_start_ones():
    groups = [("fedavg", [0.2, 0.4, 0.9, 0.1], [False, False, False, True]),
              ("local", [0.6, 0.7, 0.8], [False, False, False])]
    fig = plots.accuracy_distribution_figure(groups, "t")
    try:
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.get_xticklabels()] == ["fedavg", "local"]
        points = {c.get_label(): c.get_offsets() for c in ax.collections if not c.get_label().startswith("_")}
        assert sorted(points) == [plots.CLIENT_LABEL, plots.COLDSTART_LABEL]
        assert sorted(points[plots.COLDSTART_LABEL][:, 1]) == [0.1]
        # the legend's "client" series is the first run's; the second run's points are unlabelled
        clients = [c.get_offsets() for c in ax.collections if c.get_label() != plots.COLDSTART_LABEL]
        assert sorted(np.concatenate(clients)[:, 1]) == [0.2, 0.4, 0.6, 0.7, 0.8, 0.9]
        cold_x = points[plots.COLDSTART_LABEL][0, 0]
        assert 0.8 < cold_x < 1.2  # drawn over its own run's box
        # one box per run over its training clients only: medians 0.4 (not 0.3, with the
        # cold-start client) and 0.7, in run order
        medians = [line for line in ax.lines if line.get_gid() == "median"]
        assert [float(np.mean(m.get_xdata())) for m in medians] == [1.0, 2.0]
        assert [m.get_ydata()[0] for m in medians] == pytest.approx([0.4, 0.7])
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [plots.CLIENT_LABEL, plots.COLDSTART_LABEL]
    finally:
        plots.close(fig)
