"""training.on_nonfinite (issue 12): "stop" (the default) ends the run naming round, client and
method; "skip_client" leaves a diverged client out of the round's aggregate and goes on."""

import pytest
import torch
from test_cli import one_line_error, write_spec
from tiny import tiny_raw

from pfl_core.cli import run_main
from pfl_core.engine import Engine, resolve
from pfl_core.errors import NonFiniteError

BAD = 2  # the client whose data diverges


class Recorder:
    """A tracker that keeps what it is given."""

    run_id = None

    def __init__(self):
        self.metrics = []
        self.tags = {}

    def start(self, *args):
        pass

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_text(self, *args):
        pass

    def log_figure(self, *args):
        pass

    def set_tag(self, key, value):
        self.tags[key] = value

    def end(self, status="FINISHED"):
        pass


class Poisoned(Engine):
    """Client BAD's inputs are NaN: its loss is NaN in every round it trains."""

    def __init__(self, *args, poison=(BAD,), **kwargs):
        super().__init__(*args, **kwargs)
        self.poison = poison

    def prepare(self):
        ctx = super().prepare()
        for i in self.poison:
            ctx.data.clients[i].train_x = torch.full_like(ctx.data.clients[i].train_x, float("nan"))
        return ctx


def trained_uploads(raw):
    """Each client's round-1 upload in a clean run (client seeds do not depend on the others)."""
    engine = Engine(resolve(raw), progress=False)
    uploads = {}
    original = engine._absorb

    def record(ctx, result):
        i, upload = original(ctx, result)
        uploads[i] = {k: v.detach().clone() for k, v in upload["weights"].items()}
        return i, upload

    engine._absorb = record
    engine.run()
    return uploads, engine.ctx


def test_skip_client_averages_the_others_and_logs_how_many_were_skipped():
    raw = tiny_raw(**{"experiment.rounds": 1, "training.on_nonfinite": "skip_client"})
    clean, clean_ctx = trained_uploads(raw)
    tracker = Recorder()
    engine = Poisoned(resolve(raw), tracker=tracker, progress=False)
    engine.run()
    sizes = {i: clean_ctx.data.clients[i].num_train for i in clean if i != BAD}
    total = sum(sizes.values())
    glob = engine.ctx.server["global"]
    for key, value in glob.items():
        expected = sum(clean[i][key] * (n / total) for i, n in sizes.items())
        assert torch.allclose(value, expected, atol=1e-6), key
    assert [m["skipped_clients"] for _, m in tracker.metrics if "skipped_clients" in m] == [1.0]
    assert all(torch.isfinite(v).all() for v in glob.values())


def test_skip_client_with_every_client_skipped_keeps_the_global_model_and_warns(capsys):
    raw = tiny_raw(**{"experiment.rounds": 2, "training.on_nonfinite": "skip_client"})
    tracker = Recorder()
    engine = Poisoned(resolve(raw), tracker=tracker, progress=False, poison=range(4))
    engine.run()
    initial = engine.ctx.models.initial_state(engine.ctx.models.arch_of(0))
    for key, value in engine.ctx.server["global"].items():
        assert torch.equal(value, initial[key]), key
    assert [m["skipped_clients"] for _, m in tracker.metrics] == [4.0, 4.0]
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "every client update was dropped (8 diverged" in warning[0], warning
    assert "every client update was dropped" in tracker.tags["pfl.warning"]


def test_skip_client_with_some_updates_kept_does_not_warn(capsys):
    raw = tiny_raw(**{"experiment.rounds": 1, "training.on_nonfinite": "skip_client"})
    tracker = Recorder()
    Poisoned(resolve(raw), tracker=tracker, progress=False).run()
    assert "warning" not in capsys.readouterr().err and "pfl.warning" not in tracker.tags


def test_stop_is_the_default_and_names_round_client_and_the_setting():
    with pytest.raises(NonFiniteError) as info:
        Poisoned(resolve(tiny_raw(**{"experiment.rounds": 1})), progress=False).run()
    message = str(info.value)
    assert f"round 1, client {BAD}" in message and "training.on_nonfinite" in message


def test_a_bad_on_nonfinite_is_one_line_naming_the_key(tmp_path, capsys):
    code = run_main([write_spec(tmp_path, tiny_raw(**{"training.on_nonfinite": "skip"})), "--dry-run"])
    line = one_line_error(capsys.readouterr().err)
    assert code == 2 and "training.on_nonfinite" in line and "'skip_client'" in line, line
