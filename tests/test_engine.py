"""pfl_core.engine: the round's hook order and wiring, evaluation cadence, what is logged and
counted, cold-start hold-out, seeding, and the run's artifacts.

A small add-on (``Recorder``) is registered in front of the algorithm, as in
tests/test_core_loop.py: plain hooks for the collected ones, hook wrappers for the firstresult
ones, so it sees (and can override) every answer without replacing the algorithm's. A probe
algorithm (``Probe``) with payloads of known size checks what the engine counts and passes.
Figures are stubbed (the engine's calls are recorded): they are most of a tiny run's time.
"""

import json
import time

import numpy as np
import pytest
import torch
from tiny import tiny_raw

from pfl_core import Plugin, hookimpl, registry
from pfl_core.engine import Engine, resolve
from pfl_core.engine.engine import pick_device
from pfl_core.errors import PflError
from pfl_core.runtime.context import load_state
from pfl_core.runtime.evaluation import evaluate_clients
from pfl_core.seeding import derive_seed, numpy_rng
from pfl_core.tracking import plots
from pfl_core.tracking.tables import table_csv
from pfl_core.tracking.tracker import NullTracker, flatten


@pytest.fixture(autouse=True)
def figures(monkeypatch):
    """Stub the figures (slow, and dropped by the NullTracker anyway); record what was drawn."""
    drawn = []

    def partition_figure(table, class_names=None, title="partition"):
        drawn.append(("partition", table.tolist(), list(class_names), title))
        return "partition-figure"

    def accuracy_distribution_figure(groups, title):
        drawn.append(("accuracy", groups, title))
        return "accuracy-figure"

    monkeypatch.setattr(plots, "partition_figure", partition_figure)
    monkeypatch.setattr(plots, "accuracy_distribution_figure", accuracy_distribution_figure)
    monkeypatch.setattr(plots, "close", lambda fig: drawn.append(("close", fig)))
    return drawn


class RecordingTracker(NullTracker):
    run_id = "run-1"

    def __init__(self):
        self.started = None
        self.metrics = {}  # step -> merged metrics logged at that step
        self.calls = []  # (step, metrics) in logging order
        self.texts = {}
        self.figures = {}
        self.tags = {}
        self.status = None

    def start(self, experiment, run_name, params, tags):
        self.started = (experiment, run_name, params, tags)

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))
        self.metrics.setdefault(step, {}).update(metrics)

    def log_text(self, text, filename):
        self.texts[filename] = text

    def log_figure(self, figure, filename):
        self.figures[filename] = figure

    def set_tag(self, key, value):
        self.tags[key] = value

    def end(self, status="FINISHED"):
        self.status = status


class Recorder(Plugin):
    """Logs every hook call in order to ``self.log``; optional overrides and extra metrics."""

    name = "recorder"
    kind = registry.ADDON

    def __init__(self, select=None, weighting=None, train_result=None, round_end=None, finish=None,
                 evaluate_at_round_end=False, fail_at_round=None):
        super().__init__()
        self.log = []
        self.select, self.weighting, self.train_result = select, weighting, train_result
        self.round_end, self.finish = round_end, finish
        self.evaluate_at_round_end = evaluate_at_round_end
        self.fail_at_round = fail_at_round
        self.broadcasts = {}  # (round, client) -> the message object
        self.uploads = {}  # (round, client) -> the upload object
        self.received = {}  # (round, client) -> the message on_receive got
        self.weights = {}  # round -> the weights object client_weighting answered
        self.losses = {}  # round -> [train_loss of each participant]
        self.global_draws = {}  # (round, client) -> torch.rand() drawn at on_receive
        self.evaluations = {}  # round -> (test scores, val scores) computed in on_round_end
        self.coldstart_draws = {}  # client -> torch.rand() drawn when its cold start begins

    @hookimpl
    def setup(self, ctx):
        self.tracker = ctx.tracker
        self.log.append(("setup",))

    @hookimpl(wrapper=True)
    def select_clients(self, ctx, round):
        result = yield
        if self.select is not None:
            result = self.select(list(result))
        self.log.append(("select_clients", round, list(result)))
        return result

    @hookimpl
    def on_round_start(self, ctx, round, participants):
        assert ctx.round == round and ctx.participants == participants
        if self.fail_at_round == round:
            raise RuntimeError("probe failure")
        self.log.append(("on_round_start", round, list(participants)))

    @hookimpl(wrapper=True)
    def client_weighting(self, ctx, participants):
        result = yield
        if self.weighting is not None:
            result = self.weighting(list(participants))
        self.weights[ctx.round] = result
        self.log.append(("client_weighting", list(participants)))
        return result

    @hookimpl(wrapper=True)
    def server_aggregate(self, ctx, uploads, weights):
        assert weights is self.weights[ctx.round]
        self.log.append(("server_aggregate:start",))
        result = yield
        self.log.append(("server_aggregate:end",))
        return result

    @hookimpl(wrapper=True)
    def on_broadcast(self, ctx, client_id):
        message = yield
        self.broadcasts[ctx.round, client_id] = message
        self.log.append(("on_broadcast", client_id))
        return message

    @hookimpl(wrapper=True)
    def on_receive(self, ctx, client, message):
        self.global_draws[ctx.round, client.id] = torch.rand(()).item()
        self.received[ctx.round, client.id] = message
        assert client.round == ctx.round
        self.log.append(("on_receive", client.id))
        return (yield)

    @hookimpl(wrapper=True)
    def local_train(self, ctx, client):
        result = yield
        if self.train_result is not None:
            result = self.train_result(client.id, result)
        if result and "train_loss" in result:
            self.losses.setdefault(ctx.round, []).append(result["train_loss"])
        self.log.append(("local_train", client.id))
        return result

    @hookimpl(wrapper=True)
    def client_upload(self, ctx, client):
        upload = yield
        self.uploads[ctx.round, client.id] = upload
        self.log.append(("client_upload", client.id))
        return upload

    @hookimpl
    def on_round_end(self, ctx, round):
        self.log.append(("on_round_end", round))
        if self.evaluate_at_round_end:
            log, self.log = self.log, []  # the probe's own evaluation is not part of the order
            self.evaluations[round] = (evaluate_clients(ctx)[0], evaluate_clients(ctx, split="val")[0])
            self.log = log
        return self.round_end(ctx, round) if self.round_end else None

    @hookimpl(wrapper=True)
    def personalized_models(self, ctx, client):
        self.log.append(("personalized_models", client.id))
        return (yield)

    @hookimpl
    def on_finish(self, ctx):
        self.log.append(("on_finish",))
        return self.finish

    @hookimpl(wrapper=True)
    def coldstart_personalize(self, ctx, client):
        self.coldstart_draws[client.id] = torch.rand(()).item()
        self.log.append(("coldstart_personalize", client.id))
        return (yield)


DOWN_BYTES = 3 * 4  # float32[3]
UP_BYTES = 5 * 8 + 8  # float64[5] + one number


class Probe(Plugin):
    """An algorithm with payloads of known size; keeps what server_aggregate was given."""

    name = "probe"

    def __init__(self, consume=None):
        super().__init__()
        self.consume = consume  # how many uploads server_aggregate takes (None: all)
        self.aggregated = {}  # round -> [(client_id, upload), ...] as received

    @hookimpl
    def on_broadcast(self, ctx, client_id):
        return {"w": torch.zeros(3)}

    @hookimpl
    def client_upload(self, ctx, client):
        return {"u": torch.zeros(5, dtype=torch.float64), "n": 1}

    @hookimpl
    def server_aggregate(self, ctx, uploads, weights):
        got = self.aggregated.setdefault(ctx.round, [])
        for pair in uploads:
            got.append(pair)
            if self.consume is not None and len(got) == self.consume:
                break
        return True

    @hookimpl
    def personalized_models(self, ctx, client):
        return {"": client.model}


def run(*addons, algorithm=None, tracker=None, **overrides):
    resolved = resolve(tiny_raw(**overrides))
    for addon in reversed(addons):
        resolved.plugins.insert(0, addon)
    if algorithm is not None:
        resolved.plugins[-1] = algorithm
    engine = Engine(resolved, tracker=tracker, progress=False)
    return engine.run(), engine


def client_phase(i):
    return [("on_broadcast", i), ("on_receive", i), ("local_train", i), ("client_upload", i)]


def round_phase(r, participants, evaluated):
    out = [("select_clients", r, participants), ("on_round_start", r, participants),
           ("client_weighting", participants), ("server_aggregate:start",)]
    for i in participants:
        out += client_phase(i)
    out += [("server_aggregate:end",), ("on_round_end", r)]
    out += [("personalized_models", i) for i in evaluated]
    return out


# -- the order of a round --------------------------------------------------------------------


def test_hook_order_of_a_run():
    rec = Recorder()
    run(rec, **{"experiment.rounds": 2})
    clients = [0, 1, 2, 3]
    expected = [("setup",)]
    for r in (1, 2):
        expected += round_phase(r, clients, evaluated=clients)
    expected += [("on_finish",)]
    assert rec.log == expected


def test_the_selected_participants_and_only_they_run_in_the_order_given():
    rec = Recorder(select=lambda chosen: [3, 1])
    run(rec, **{"experiment.rounds": 1})
    assert rec.log[1:] == round_phase(1, [3, 1], evaluated=[0, 1, 2, 3]) + [("on_finish",)]


def test_clients_the_aggregate_does_not_consume_still_run_before_round_end():
    rec, probe = Recorder(), Probe(consume=1)
    result, _ = run(rec, algorithm=probe, **{"experiment.rounds": 1})
    assert [i for i, _ in probe.aggregated[1]] == [0]
    full = round_phase(1, [0, 1, 2, 3], evaluated=[0, 1, 2, 3])
    end = full.index(("server_aggregate:end",))
    # the engine drains the rest after the aggregate returns, before on_round_end
    drained = full[:4] + client_phase(0) + [("server_aggregate:end",)] + full[8:end] + full[end + 1:]
    assert rec.log[1:] == drained + [("on_finish",)]
    assert result.final["comm_up_bytes"] == 4 * UP_BYTES  # their uploads are counted too


# -- what each hook is given -------------------------------------------------------------------


def test_messages_uploads_and_weights_are_passed_through_unchanged():
    weighting = lambda participants: {i: 0.1 * (i + 1) for i in participants}  # noqa: E731
    rec, probe = Recorder(weighting=weighting), Probe()
    run(rec, algorithm=probe, **{"experiment.rounds": 2})
    for r in (1, 2):
        assert rec.weights[r] == {0: 0.1, 1: 0.2, 2: pytest.approx(0.3), 3: 0.4}  # checked `is` in the hook
        assert [i for i, _ in probe.aggregated[r]] == [0, 1, 2, 3]
        for i, upload in probe.aggregated[r]:
            assert upload is rec.uploads[r, i]  # the (id, upload) pairs are the uploads themselves
            assert rec.received[r, i] is rec.broadcasts[r, i]  # on_receive gets that client's broadcast


def test_default_weights_are_the_participants_shares_of_training_samples():
    rec = Recorder(select=lambda chosen: [0, 2])
    _, engine = run(rec, **{"experiment.rounds": 1})
    n = {i: engine.ctx.data.clients[i].num_train for i in (0, 2)}
    assert rec.weights[1] == {0: pytest.approx(n[0] / (n[0] + n[2])), 2: pytest.approx(n[2] / (n[0] + n[2]))}


# -- evaluation ------------------------------------------------------------------------------


def test_evaluation_every_k_rounds_and_at_the_last_round():
    tracker = RecordingTracker()
    rec = Recorder()
    result, _ = run(rec, tracker=tracker, **{"experiment.rounds": 5, "evaluation.every": 2})
    assert [h["round"] for h in result.history] == [2, 4, 5]
    evaluated_after = [rec.log[k - 1][1] for k, entry in enumerate(rec.log)
                       if entry[0] == "personalized_models" and rec.log[k - 1][0] == "on_round_end"]
    assert evaluated_after == [2, 4, 5]  # right after those rounds' on_round_end
    assert sorted(tracker.metrics) == [1, 2, 3, 4, 5]  # every round is logged ...
    assert [s for s in sorted(tracker.metrics) if "acc_mean" in tracker.metrics[s]] == [2, 4, 5]  # ... scored on 2, 4, 5
    for h in result.history:
        assert {k: v for k, v in h.items() if k != "round"} == tracker.metrics[h["round"]]
    assert result.final == {k: v for k, v in result.history[-1].items() if k != "round"}  # the last round's


def test_the_metrics_are_those_of_the_model_after_that_round():
    rec = Recorder(evaluate_at_round_end=True)
    result, engine = run(rec, **{"experiment.rounds": 3, "evaluation.every": 2})
    for h in result.history:
        test, _ = rec.evaluations[h["round"]]
        for key in ("acc_mean", "acc_std", "acc_p10", "loss_mean"):
            assert h[key] == pytest.approx(test[key], abs=1e-12), (h["round"], key)
    # the rounds scored differ from each other (the model trained in between)
    assert rec.evaluations[2][0]["loss_mean"] != rec.evaluations[3][0]["loss_mean"]
    final, rows = evaluate_clients(engine.ctx)
    assert result.final["loss_mean"] == pytest.approx(final["loss_mean"], abs=1e-12)
    assert [r["client"] for r in result.client_rows] == [0, 1, 2, 3]
    assert [r["acc"] for r in result.client_rows] == pytest.approx([r["acc"] for r in rows])


def test_validation_metrics_come_from_the_validation_split():
    rec = Recorder(evaluate_at_round_end=True)
    result, engine = run(rec, **{"experiment.rounds": 2, "evaluation.validation": True})
    for h in result.history:
        test, val = rec.evaluations[h["round"]]
        assert val["loss_mean"] != test["loss_mean"]  # the two splits are distinguishable here
        for key in ("acc_mean", "acc_std", "acc_p10", "loss_mean"):
            assert h[f"val_{key}"] == pytest.approx(val[key], abs=1e-12), key
            assert h[key] == pytest.approx(test[key], abs=1e-12), key
    assert result.final["val_loss_mean"] == pytest.approx(evaluate_clients(engine.ctx, split="val")[0]["loss_mean"])


def test_no_validation_metrics_unless_asked():
    result, _ = run(**{"experiment.rounds": 1})
    assert not [k for k in result.final if k.startswith("val_")]
    assert "acc_mean" in result.final


# -- communication ---------------------------------------------------------------------------


def test_bytes_are_the_summed_payloads_down_and_up_per_participant():
    tracker = RecordingTracker()
    result, _ = run(algorithm=Probe(), tracker=tracker, **{"experiment.rounds": 3})
    for r in (1, 2, 3):
        assert tracker.metrics[r]["comm_down_bytes"] == r * 4 * DOWN_BYTES
        assert tracker.metrics[r]["comm_up_bytes"] == r * 4 * UP_BYTES
    half = RecordingTracker()
    run(algorithm=Probe(), tracker=half, **{"experiment.rounds": 2, "experiment.participation": 0.5})
    assert [half.metrics[r]["comm_down_bytes"] for r in (1, 2)] == [2 * DOWN_BYTES, 4 * DOWN_BYTES]
    assert [half.metrics[r]["comm_up_bytes"] for r in (1, 2)] == [2 * UP_BYTES, 4 * UP_BYTES]


def test_fedavg_bytes_are_the_model_size_each_way():
    result, engine = run(**{"experiment.rounds": 2})
    model_bytes = sum(v.numel() * 4 for v in engine.ctx.models.initial_state("mlp").values())
    assert result.final["comm_down_bytes"] == 2 * 4 * model_bytes
    assert result.final["comm_up_bytes"] == 2 * 4 * model_bytes


def test_bytes_are_counted_after_wrappers():
    class Extra(Plugin):
        name = "extra"
        kind = registry.ADDON

        @hookimpl(wrapper=True)
        def client_upload(self, ctx, client):
            return {**(yield), "extra": torch.zeros(10, dtype=torch.float64)}

    result, _ = run(Extra(), algorithm=Probe(), **{"experiment.rounds": 1})
    assert result.final["comm_up_bytes"] == 4 * (UP_BYTES + 80)
    assert result.final["comm_down_bytes"] == 4 * DOWN_BYTES


# -- cold-start clients --------------------------------------------------------------------------


def test_coldstart_clients_are_held_out_of_training_and_selection():
    rec = Recorder()
    result, engine = run(rec, **{"experiment.rounds": 3, "experiment.coldstart_clients": 1,
                                 "experiment.participation": 0.5})
    (cold,) = numpy_rng(0, "coldstart").choice(4, 1, replace=False).tolist()
    ctx = engine.ctx
    assert ctx.coldstart_clients == [cold]
    assert ctx.training_clients == [i for i in range(4) if i != cold]
    finish = rec.log.index(("on_finish",))
    trained = [e[1] for e in rec.log[:finish] if e[0] in ("on_broadcast", "on_receive", "local_train")]
    selected = [e[2] for e in rec.log if e[0] == "select_clients"]
    assert len(selected) == 3 and all(len(s) == 2 for s in selected)  # half of the 3 training clients, rounded up
    assert cold not in trained and all(cold not in s for s in selected)
    assert set(trained) == set(ctx.training_clients)
    scored = [e[1] for e in rec.log[:finish] if e[0] == "personalized_models"]
    assert sorted(set(scored)) == ctx.training_clients
    # after on_finish: only the cold-start client is personalised: the engine broadcasts to it,
    # then coldstart_personalize gets that message (receive, train)
    assert rec.log[finish + 1: finish + 3] == [("on_broadcast", cold), ("coldstart_personalize", cold)]
    assert [e[1] for e in rec.log[finish + 1:] if len(e) > 1] == [cold, cold, cold]
    assert [r["client"] for r in result.client_rows if r["coldstart"]] == [cold]
    assert [r["client"] for r in result.client_rows if not r["coldstart"]] == ctx.training_clients
    assert "coldstart_acc_mean" in result.final and "coldstart_loss_mean" in result.final
    assert result.history[-1]["budget.private_epochs"] == pytest.approx(3 * 2 / 3)  # per training client


def test_without_coldstart_every_client_trains_and_rows_have_no_flag():
    result, engine = run(**{"experiment.rounds": 1})
    assert list(engine.ctx.training_clients) == [0, 1, 2, 3] and engine.ctx.coldstart_clients == []
    assert "coldstart" not in result.client_rows[0]
    assert not [k for k in result.final if k.startswith("coldstart_")]


def test_coldstart_metrics_are_logged_at_the_last_step():
    tracker = RecordingTracker()
    result, _ = run(tracker=tracker, **{"experiment.rounds": 2, "experiment.coldstart_clients": 1})
    cold = {k: v for k, v in result.final.items() if k.startswith("coldstart_")}
    assert cold and all(tracker.metrics[2][k] == v for k, v in cold.items())
    assert not [k for k in tracker.metrics[1] if k.startswith("coldstart_")]


# -- logged round metrics --------------------------------------------------------------------------


def test_round_end_metrics_and_ctx_log_are_logged_for_their_round_only():
    def round_end(ctx, round):
        if round == 1:
            ctx.log(only_first=1.0)
        return {"probe/round": float(round)}

    tracker = RecordingTracker()
    result, _ = run(Recorder(round_end=round_end), tracker=tracker, **{"experiment.rounds": 3, "evaluation.every": 2})
    assert [tracker.metrics[s]["probe/round"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert tracker.metrics[1]["only_first"] == 1.0
    assert "only_first" not in tracker.metrics[2] and "only_first" not in tracker.metrics[3]
    assert [h["probe/round"] for h in result.history] == [2.0, 3.0]


def test_train_loss_mean_is_the_mean_of_the_participants_losses():
    rec = Recorder()
    result, _ = run(rec, **{"experiment.rounds": 2})
    for h in result.history:
        losses = rec.losses[h["round"]]
        assert len(losses) == 4
        assert h["train_loss_mean"] == pytest.approx(sum(losses) / 4, rel=1e-12)


def test_train_loss_mean_skips_clients_that_report_no_loss():
    # client 0 reports another metric, client 1 nothing: the mean is over clients 2 and 3
    def train_result(cid, result):
        return {0: {"other": 5.0}, 1: {}}.get(cid, result)

    rec = Recorder(train_result=train_result)
    result, _ = run(rec, **{"experiment.rounds": 1})
    assert len(rec.losses[1]) == 2
    assert result.final["train_loss_mean"] == pytest.approx(sum(rec.losses[1]) / 2, rel=1e-12)
    nobody = Recorder(train_result=lambda cid, result: {})
    result, _ = run(nobody, **{"experiment.rounds": 1})
    assert "train_loss_mean" not in result.final


# -- seeds -------------------------------------------------------------------------------------


def test_each_client_runs_under_its_own_global_seed():
    rec = Recorder()
    run(rec, **{"experiment.rounds": 2, "experiment.seed": 3})
    for (r, i), drawn in rec.global_draws.items():
        expected = torch.rand((), generator=torch.Generator().manual_seed(derive_seed(3, "client", r, i))).item()
        assert drawn == expected, (r, i)


def test_results_do_not_depend_on_the_order_clients_run_in():
    # momentum: a buffer leaking from one client to the next would make order matter too
    overrides = {"experiment.rounds": 2, "training.momentum": 0.9}
    forward = Recorder()
    a, engine_a = run(forward, **overrides)
    backward = Recorder(select=lambda chosen: chosen[::-1])
    b, engine_b = run(backward, **overrides)
    assert [e[2] for e in backward.log if e[0] == "select_clients"] == [[3, 2, 1, 0]] * 2
    for key, value in engine_a.ctx.server["global"].items():
        assert torch.allclose(value, engine_b.ctx.server["global"][key], rtol=0, atol=1e-6), key
    assert b.final["acc_mean"] == a.final["acc_mean"]
    assert b.final["loss_mean"] == pytest.approx(a.final["loss_mean"], abs=1e-5)
    for r in (1, 2):  # and each client's own loss is the same whichever ran first
        assert sorted(forward.losses[r]) == pytest.approx(sorted(backward.losses[r]), abs=1e-6)


# -- the end of the run ------------------------------------------------------------------------


def test_on_finish_metrics_end_up_in_final_and_are_logged_at_the_last_step():
    tracker = RecordingTracker()
    result, _ = run(Recorder(finish={"finish_metric": 7.0}), tracker=tracker, **{"experiment.rounds": 2})
    assert result.final["finish_metric"] == 7.0
    assert (2, {"finish_metric": 7.0}) in tracker.calls
    assert "round" not in result.final
    assert {k: v for k, v in result.final.items() if k != "finish_metric"} == \
        {k: v for k, v in result.history[-1].items() if k != "round"}
    assert result.run_id == "run-1" and result.errors == []


def test_run_starts_and_ends_the_tracked_run_with_the_resolved_spec():
    tracker = RecordingTracker()
    resolved = resolve(tiny_raw(**{"experiment.rounds": 1, "tracking.tags": {"who": "me"}}))
    Engine(resolved, tracker=tracker, progress=False).run()
    experiment, run_name, params, tags = tracker.started
    assert experiment == "tiny" and run_name == "fedavg"
    assert params == flatten(resolved.as_dict)
    assert tags["algorithm"] == "fedavg" and tags["who"] == "me" and "pfl.version" in tags
    assert tracker.status == "FINISHED"
    named = RecordingTracker()
    rec = Recorder()
    resolved.plugins.insert(0, rec)
    Engine(resolved, tracker=tracker, progress=False).run()
    assert rec.tracker is tracker  # plugins log artifacts through ctx.tracker
    resolved = resolve(tiny_raw(**{"experiment.rounds": 1, "tracking.run_name": "mine",
                                   "tracking.experiment": "elsewhere"}))
    Engine(resolved, tracker=named, progress=False).run()
    assert named.started[:2] == ("elsewhere", "mine")
    given = RecordingTracker()
    Engine(resolved, tracker=given, progress=False, run_name="given").run()
    assert given.started[1] == "given"


def test_a_failing_round_ends_the_tracked_run_as_failed():
    tracker = RecordingTracker()
    with pytest.raises(RuntimeError, match="probe failure"):
        run(Recorder(fail_at_round=2), tracker=tracker, **{"experiment.rounds": 3})
    assert tracker.status == "FAILED"
    assert sorted(tracker.metrics) == [1]


def test_round_and_eval_seconds_are_durations_within_the_run():
    tracker = RecordingTracker()
    started = time.perf_counter()
    run(tracker=tracker, **{"experiment.rounds": 2})
    elapsed = time.perf_counter() - started
    assert 0 < sum(tracker.metrics[s]["round_seconds"] for s in (1, 2)) <= elapsed
    assert 0 < sum(tracker.metrics[s]["eval_seconds"] for s in (1, 2)) <= elapsed


def test_artifacts_resolved_spec_partition_and_client_table(figures):
    tracker = RecordingTracker()
    resolved = resolve(tiny_raw(**{"experiment.rounds": 2}))
    engine = Engine(resolved, tracker=tracker, progress=False)
    result = engine.run()
    data = engine.ctx.data
    assert tracker.texts["resolved_spec.toml"] == resolved.toml()
    table = data.partition_table()
    lines = tracker.texts["partition/partition_table.csv"].splitlines()
    assert lines[0] == ",".join(["client", *data.class_names])
    assert lines[1:] == [",".join(str(v) for v in [i, *row]) for i, row in enumerate(table.tolist())]
    assert json.loads(tracker.texts["partition/indices.json"]) == json.loads(json.dumps(data.indices_artifact()))
    rows = tracker.texts["results/clients.csv"].splitlines()
    assert rows[0] == ",".join(result.client_rows[0])
    assert len(rows) == 1 + 4 and rows[1].startswith("0,mlp,")
    assert ("partition", table.tolist(), data.class_names, "domain partition, 4 clients") in figures
    accs = [row["acc"] for row in result.client_rows]
    assert ("accuracy", [("fedavg", accs, [False] * 4)], "fedavg: final accuracy per client") in figures
    assert tracker.figures == {"partition/partition.png": "partition-figure",
                               "results/client_accuracy.png": "accuracy-figure"}
    assert ("close", "partition-figure") in figures and ("close", "accuracy-figure") in figures


def test_table_csv_formats_floats_and_keeps_the_rest():
    text = table_csv(["a", "b", "c"], [[1, 0.123456789, "x"], [2, 3.0, True]])
    assert text.splitlines() == ["a,b,c", "1,0.123457,x", "2,3,True"]


# -- set-up --------------------------------------------------------------------------------------


def test_resolve_orders_plugins_and_fills_every_default():
    raw = tiny_raw(**{"algorithm.name": "fedprox", "sweep": {"training.lr": [0.1, 0.2]}})
    raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [0]}}]
    resolved = resolve(raw)
    assert [p.name for p in resolved.plugins] == ["corrupted_clients", "fedprox"]
    assert resolved.algorithm.name == "fedprox" and resolved.algorithm.spec_path == "algorithm"
    assert resolved.plugins[0].spec_path == "addons[0]"
    d = resolved.as_dict
    assert "mu" in d["algorithm"]["params"] and d["addons"][0]["params"]["clients"] == [0]
    assert d["data"]["params"]["dim"] == 20 and "hidden" in d["model"]["params"]
    assert d["partition"]["params"] == registry.resolved_params(
        registry.instantiate(registry.PARTITIONER, "domain", {}, "p", "p"))
    assert "sweep" not in d and d["budget"]["private_epochs"] == 3


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(PflError) as info:
            pick_device("cuda")
        assert str(info.value) == "executor.device: 'cuda' was asked for but no CUDA device is available"


def test_prepare_sets_the_executor_threads_and_one_by_default():
    before = torch.get_num_threads()
    try:
        Engine(resolve(tiny_raw(**{"executor.threads": 3})), progress=False).prepare()
        assert torch.get_num_threads() == 3
        Engine(resolve(tiny_raw(**{"executor.threads": 0})), progress=False).prepare()
        assert torch.get_num_threads() == 1  # 0: one thread, whatever torch had
    finally:
        torch.set_num_threads(before)


def test_coldstart_choice_of_several_clients_and_their_seeds():
    rec = Recorder()
    _, engine = run(rec, **{"experiment.rounds": 1, "experiment.coldstart_clients": 2, "experiment.seed": 4})
    chosen = sorted(numpy_rng(4, "coldstart").choice(4, 2, replace=False).tolist())
    assert engine.ctx.coldstart_clients == chosen and len(set(chosen)) == 2
    assert engine.ctx.training_clients == [i for i in range(4) if i not in chosen]
    for i in chosen:  # each is personalised under its own seed, at the last round
        expected = torch.rand((), generator=torch.Generator().manual_seed(derive_seed(4, "coldstart", 1, i))).item()
        assert rec.coldstart_draws[i] == expected


def test_a_coldstart_failure_is_tagged_on_the_run():
    class Broken(Plugin):
        name = "broken"
        kind = registry.ADDON

        @hookimpl
        def coldstart_personalize(self, ctx, client):
            raise ValueError("nope")

    tracker = RecordingTracker()
    result, _ = run(Broken(), tracker=tracker, **{"experiment.rounds": 1, "experiment.coldstart_clients": 1})
    assert result.errors == ["cold-start evaluation failed (ValueError: nope); the training results are kept"]
    assert tracker.tags == {"pfl.error": result.errors[0]}
    assert tracker.status == "FINISHED"
    assert "coldstart" not in result.client_rows[0]  # rows of the training clients, unflagged


def test_progress_only_when_both_the_caller_and_the_spec_want_it():
    on, off = resolve(tiny_raw(**{"tracking.progress": True})), resolve(tiny_raw())
    assert Engine(on).show_progress is True
    assert Engine(on, progress=False).show_progress is False
    assert Engine(off, progress=True).show_progress is False


def test_version_tag_is_the_package_version():
    import pfl_core

    tracker = RecordingTracker()
    run(tracker=tracker, **{"experiment.rounds": 1})
    assert tracker.started[3]["pfl.version"] == pfl_core.__version__


@pytest.mark.parametrize("key, value, path", [
    ("algorithm.name", "fedavgg", "algorithm.name"),
    ("algorithm.params", {"nope": 1}, "algorithm.params"),
    ("data.name", "nodata", "data.name"),
    ("data.params", {"nope": 1}, "data.params"),
    ("partition.scheme", "noscheme", "partition.scheme"),
    ("partition.params", {"nope": 1}, "partition.params"),
    ("model.params", {"nope": 1}, "model.params"),
    ("model.pool", ["mlp", "lenet5"], "model.pool"),  # fedavg's check_spec runs in resolve
])
def test_resolve_names_the_bad_key(key, value, path):
    from pfl_core.errors import SpecError

    with pytest.raises(SpecError) as info:
        resolve(tiny_raw(**{key: value}))
    assert info.value.path.startswith(path), info.value.path


@pytest.mark.parametrize("addon, path", [({"name": "nothing_here"}, "addons[1].name"),
                                         ({"name": "corrupted_clients", "params": {"nope": 1}}, "addons[1].params")])
def test_resolve_names_the_bad_addon(addon, path):
    from pfl_core.errors import SpecError

    raw = tiny_raw()
    raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [0]}}, addon]
    with pytest.raises(SpecError) as info:
        resolve(raw)
    assert info.value.path.startswith(path), info.value.path


def test_resolved_model_params_have_their_defaults_filled():
    d = resolve(tiny_raw()).as_dict
    assert d["model"]["params"]["hidden"] == [16] and "norm" in d["model"]["params"]


def test_a_non_finite_upload_names_its_round_client_method_and_lr():
    from pfl_core.errors import NonFiniteError

    class NanUpload(Plugin):
        name = "nan_upload"
        kind = registry.ADDON

        @hookimpl(wrapper=True)
        def client_upload(self, ctx, client):
            upload = yield
            if (ctx.round, client.id) == (2, 2):
                return {**upload, "deep": [(torch.tensor([1.0, float("nan")]),)]}
            return upload

    tracker = RecordingTracker()
    with pytest.raises(NonFiniteError) as info:
        run(NanUpload(), algorithm=Probe(), tracker=tracker, **{"experiment.rounds": 3, "training.lr": 0.05})
    message = str(info.value)
    assert message.startswith("round 2, client 2, method fedavg: a sent parameter became NaN or infinite")
    assert "lower training.lr (now 0.05)" in message
    assert tracker.status == "FAILED" and sorted(tracker.metrics) == [1]


def test_progress_is_told_every_round_with_metrics_only_when_scored(monkeypatch):
    import pfl_core.engine.engine as engine_module

    made = []

    class SpyProgress:
        def __init__(self, total, label, enabled=True):
            self.args, self.updates = (total, label, enabled), []
            made.append(self)

        def update(self, round, metrics=None):
            self.updates.append((round, None if metrics is None else metrics.get("acc_mean")))

    monkeypatch.setattr(engine_module, "Progress", SpyProgress)
    result, _ = run(**{"experiment.rounds": 3, "evaluation.every": 2})
    (spy,) = made
    assert spy.args == (3, "fedavg", False)
    scored = {h["round"]: h["acc_mean"] for h in result.history}
    assert spy.updates == [(1, None), (2, scored[2]), (3, scored[3])]


def test_partition_table_uses_the_dataset_class_names():
    tracker = RecordingTracker()
    engine = Engine(resolve(tiny_raw()), tracker=tracker, progress=False)
    ctx = engine.prepare()
    names = [f"class-{c}" for c in range(ctx.data.num_classes)]
    ctx.data.class_names = names
    engine._log_partition(ctx)
    assert tracker.texts["partition/partition_table.csv"].splitlines()[0] == ",".join(["client", *names])


def test_prepare_puts_the_run_on_the_executor_device_and_flushes_denormals():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    try:
        ctx = Engine(resolve(tiny_raw()), progress=False).prepare()
        assert ctx.device == torch.device("cpu") and ctx.models.device == torch.device("cpu")
        assert float(torch.tensor([1e-40]) * 1.0) == 0.0  # a float32 denormal reads as 0
    finally:
        torch.set_flush_denormal(True)


def test_run_result_defaults():
    from pfl_core.engine import RunResult

    a, b = RunResult([], [], {}), RunResult([], [], {})
    assert a.run_id is None and a.errors == [] and a.errors is not b.errors


# -- the scores behind the metrics, by hand ----------------------------------------------------


def test_summary_metrics_by_hand():
    from pfl_core.runtime.evaluation import summarize

    m = summarize([0.5, 1.0, 0.75, 0.25], [1.0, 2.0, 3.0, 4.0], prefix="p_")
    assert m["p_acc_mean"] == pytest.approx(0.625)
    # population std: deviations -0.125, 0.375, 0.125, -0.375 -> sqrt(0.3125 / 4)
    assert m["p_acc_std"] == pytest.approx((0.3125 / 4) ** 0.5)
    # 10th percentile, linear: sorted [0.25, 0.5, 0.75, 1], position 0.1 * 3 = 0.3 -> 0.25 + 0.3 * 0.25
    assert m["p_acc_p10"] == pytest.approx(0.325)
    assert m["p_loss_mean"] == pytest.approx(2.5)
    assert set(m) == {"p_acc_mean", "p_acc_std", "p_acc_p10", "p_loss_mean"}


def test_score_counts_correct_argmax_and_summed_loss_in_eval_mode_then_restores_the_mode():
    from pfl_core.runtime.evaluation import score

    class Fixed(torch.nn.Module):
        """Logits = x itself; a dropout that would zero everything in train mode."""

        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(1.0)

        def forward(self, x):
            return self.drop(x)

    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    y = torch.tensor([0, 0, 0])
    model = Fixed().train()
    s = score(model, x, y, batch_size=2)  # two batches: 2 + 1
    assert (s.correct, s.count) == (2, 3) and s.accuracy == pytest.approx(2 / 3)
    expected = torch.nn.functional.cross_entropy(x, y, reduction="sum").item()
    assert s.loss_sum == pytest.approx(expected) and s.loss == pytest.approx(expected / 3)
    assert model.training  # put back as it was
    assert score(model.eval(), x, y).correct == 2 and not model.training


def test_default_selection_is_the_rounds_seeded_draw_from_the_training_clients():
    rec = Recorder()
    _, engine = run(rec, **{"experiment.rounds": 3, "experiment.participation": 0.5, "experiment.coldstart_clients": 1,
                            "experiment.seed": 2})
    pool = engine.ctx.training_clients
    selected = [e[2] for e in rec.log if e[0] == "select_clients"]
    for r, chosen in enumerate(selected, start=1):
        draw = numpy_rng(2, "select_clients", r).choice(len(pool), size=2, replace=False)
        assert chosen == sorted(pool[i] for i in draw), r


def test_resolved_spec_fills_the_defaults_of_every_plugin_table():
    raw = tiny_raw(**{"partition.scheme": "dirichlet", "partition.params": {"alpha": 0.3}})
    raw["addons"] = [{"name": "corrupted_clients", "params": {"clients": [0]}}]
    d = resolve(raw).as_dict
    tables = [(d["partition"], registry.PARTITIONER, "dirichlet", raw["partition"]["params"]),
              (d["data"], registry.DATASET, "synthetic", raw["data"]["params"]),
              (d["addons"][0], registry.ADDON, "corrupted_clients", raw["addons"][0]["params"]),
              (d["model"], registry.MODEL, "mlp", raw["model"]["params"])]
    for table, kind, name, given in tables:
        full = registry.resolved_params(registry.instantiate(kind, name, given, "k", "k.params"))
        assert table["params"] == full, name
        assert set(full) > set(given), name  # defaults the raw table did not set were filled in
        assert all(full[k] == v for k, v in given.items()), name


def test_many_clients_get_the_partition_table_but_no_picture(figures, monkeypatch):
    monkeypatch.setattr(Engine, "MAX_CLIENTS_DRAWN", 3)  # tiny has 4 clients
    tracker = RecordingTracker()
    Engine(resolve(tiny_raw(**{"experiment.rounds": 1})), tracker=tracker, progress=False).run()
    assert "partition/partition_table.csv" in tracker.texts and "partition/indices.json" in tracker.texts
    assert "partition/partition.png" not in tracker.figures
    assert not [f for f in figures if f[0] == "partition"]


def test_without_tracking_the_partition_is_not_even_tabulated(figures, monkeypatch):
    from pfl_core.data.federated import FederatedData
    monkeypatch.setattr(FederatedData, "partition_table", lambda self: pytest.fail("tabulated for nobody"))
    Engine(resolve(tiny_raw(**{"experiment.rounds": 1})), progress=False).run()
    assert not [f for f in figures if f[0] == "partition"]
