"""The round engine: resolve a spec into plugins, then run rounds and track them."""

from __future__ import annotations

import functools
import json
import time
from typing import Iterator

import attrs
import numpy as np
import torch

from pfl_core import registry
from pfl_core.data.cache import DataCache, take_handed_over
from pfl_core.data.federated import build_federated_data
from pfl_core.engine.divergence import lower_advice
from pfl_core.errors import (
    Interrupted,
    NonFiniteError,
    PflError,
    SpecError,
    interrupt_seen,
    raise_lost_interrupt,
)
from pfl_core.execution.planner import ExecutorCache, make_executor, plan
from pfl_core.payload import nbytes
from pfl_core.registry import Plugin
from pfl_core.runtime.client import ClientResult, ClientTask, copy_payload, is_overflow, run_client
from pfl_core.runtime.context import ModelBank, RunContext
from pfl_core.runtime.evaluation import coldstart_models, evaluate_clients, evaluation_sample
from pfl_core.runtime.precision import check_precision_supported
from pfl_core.seeding import numpy_rng
from pfl_core.spec import Spec, dump_toml, structure, unstructure
from pfl_core.state import checkpoint
from pfl_core.tracking.tables import table_csv
from pfl_core.tracking.terminal import Progress, note_line, status_line, warning_line
from pfl_core.tracking.tracker import NullTracker, flatten, log_accuracy_distribution, one_line, run_status


@attrs.define
class Resolved:
    """A validated spec with its plugins instantiated and every default filled in."""

    spec: Spec
    plugins: list[Plugin]  # add-ons first, the algorithm last
    as_dict: dict

    @property
    def algorithm(self) -> Plugin:
        return self.plugins[-1]

    def toml(self) -> str:
        return dump_toml(self.as_dict)


def resolve(raw: dict) -> Resolved:
    """Structure and validate a raw spec dict (after overrides); raises SpecError."""
    spec = structure(raw, Spec)
    addons = []
    for i, ref in enumerate(spec.addons):
        addon = registry.instantiate(registry.ADDON, ref.name, ref.params, f"addons[{i}].name", f"addons[{i}].params")
        addon.spec_path = f"addons[{i}]"
        addons.append(addon)
    algorithm = registry.instantiate(
        registry.ALGORITHM, spec.algorithm.name, spec.algorithm.params, "algorithm.name", "algorithm.params"
    )
    plugins = addons + [algorithm]
    dataset = registry.instantiate(registry.DATASET, spec.data.name, spec.data.params, "data.name", "data.params")
    partitioner = registry.instantiate(
        registry.PARTITIONER, spec.partition.scheme, spec.partition.params, "partition.scheme", "partition.params"
    )
    models = ModelBank(spec, input_shape=(), num_classes=0, device=torch.device("cpu"))
    registry.make_plugin_manager(plugins).hook.check_spec(spec=spec)

    as_dict = unstructure(spec)
    as_dict["algorithm"]["params"] = registry.resolved_params(algorithm)
    for i, addon in enumerate(addons):
        as_dict["addons"][i]["params"] = registry.resolved_params(addon)
    as_dict["data"]["params"] = registry.resolved_params(dataset)
    as_dict["partition"]["params"] = registry.resolved_params(partitioner)
    as_dict["model"]["params"] = registry.resolved_params(models.plugin(spec.model.name))
    as_dict.pop("sweep", None)
    # Computed, never read back: what every participating client trains (pfl_core/registry/budget.py).
    as_dict["budget"] = algorithm.local_work(spec).table(spec.experiment.rounds)
    check_something_trains(spec, as_dict["budget"])
    return Resolved(spec, plugins, as_dict)


def check_something_trains(spec: Spec, budget: dict) -> None:
    """``training.local_epochs = 0`` for a method whose declared local work is then zero (FedAvg,
    Local, ...) would report the untrained model's accuracy as a result. Methods with their
    own epoch counts (FedRep, FedSimSup, FedAlt's personal epochs ...) declare them, so they
    still train and pass; a budget the method cannot declare (nan) is not judged."""
    total = budget["private_epochs"] + budget["public_epochs"]
    if spec.training.local_epochs == 0 and total == 0:
        raise SpecError("training.local_epochs",
                        f"is 0, and {spec.algorithm.name} has no other local training, so it trains nothing and "
                        "would report the untrained model's accuracy; set it >= 1")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise PflError("executor.device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


@attrs.define
class RunResult:
    history: list[dict]
    client_rows: list[dict]
    final: dict[str, float]
    run_id: str | None = None
    # Failures after training (e.g. in cold-start evaluation): reported, the run's results kept.
    errors: list[str] = attrs.Factory(list)
    seconds: float = 0.0  # wall time of the whole run, data loading included
    kept_from: str | None = None  # the stopped study's run it was copied from (pfl-run SPEC --resume)


class Engine:
    def __init__(self, resolved: Resolved, tracker=None, progress: bool = True, run_name: str | None = None,
                 progress_label: str | None = None, on_evaluated=None, data_cache: DataCache | None = None,
                 artifacts: bool = True, executor_cache: ExecutorCache | None = None):
        """``on_evaluated(round, metrics)``: called after each evaluation round is logged (a
        tuning trial reports to its pruner there, and may stop the run by raising
        :class:`~pfl_core.errors.Stopped`). ``data_cache``: federated data built once and
        handed out as copies (the trials of a tuning study); ``executor_cache``: the executor
        kept from the previous run, handed back at the end (the same trials). ``artifacts=False``: log params and
        metrics only, not the partition's and the clients' tables and pictures (a tuning trial:
        its final runs log them; drawing them cost a tenth of a short trial)."""
        self.resolved = resolved
        self.artifacts = artifacts
        self.on_evaluated = on_evaluated
        self.data_cache = data_cache
        self.executor_cache = executor_cache
        self.spec = resolved.spec
        self.tracker = tracker or NullTracker()
        self.show_progress = progress and self.spec.tracking.progress
        self.run_name = run_name or self.spec.tracking.run_name or self.spec.algorithm.name
        self.progress_label = progress_label or self.run_name  # "run 2/6 fedprox" during a sweep
        self.trained = self.diverged = 0  # skip_client: participants that trained / that diverged, all rounds
        self.worker_retries = 0
        self.resume = None

    # -- set-up -----------------------------------------------------------------------

    def prepare(self) -> RunContext:
        """Load and partition the data, build the plugin manager and the run context."""
        spec = self.spec
        torch.set_flush_denormal(True)  # denormals slowed small CNNs 4-6x on CPU
        device = pick_device(spec.executor.device)
        check_precision_supported(spec.training, device)  # before minutes of loading
        # A named executor is set up before the data loads: a Ray cluster that cannot be
        # reached is reported at once, not after minutes of loading.
        executor = self._make_executor(device) if spec.executor.name != "auto" else None
        status_line(f"{self.progress_label}: loading {spec.data.name} and partitioning it "
                    f"({spec.partition.scheme}, {spec.partition.num_clients} clients) ...", self.show_progress)
        handed_over = self.data_cache.get(spec, device) if self.data_cache else take_handed_over(spec, device)
        data = handed_over if handed_over is not None else build_federated_data(spec, device=device)
        models = ModelBank(spec, data.input_shape, data.num_classes, device)
        pm = registry.make_plugin_manager(self.resolved.plugins)
        ctx = RunContext(spec, self.resolved.algorithm.params, data, models, pm.hook,
                         executor or self._make_executor(device, data, models), device)
        ctx.tracker = self.tracker
        held_out = spec.experiment.coldstart_clients
        if held_out:
            chosen = numpy_rng(spec.experiment.seed, "coldstart").choice(ctx.num_clients, held_out, replace=False)
            ctx.coldstart_clients = sorted(int(i) for i in chosen)
            ctx.training_clients = [i for i in range(ctx.num_clients) if i not in ctx.coldstart_clients]
        return ctx

    def _make_executor(self, device: torch.device, data=None, models: ModelBank | None = None):
        """The spec's executor; ``auto`` resolved for this machine and this run's round size
        (which needs the data and the models)."""
        spec = self.spec
        per_round, work = 0, 0.0
        if data is not None:
            per_round = max(1, round(spec.experiment.participation * len(data.clients)))
            mean_samples = data.mean_num_train()
            parameters = sum(t.numel() for t in models.initial_state(models.arch_of(0)).values())
            work = per_round * mean_samples * max(spec.training.local_epochs, 1) * parameters
        name, workers, threads = plan(spec.executor, device.type, per_round, work)
        torch.set_num_threads(threads)
        self.executor_plan = {"name": name, "workers": workers if name in ("process", "ray") else 1, "threads": threads}
        make = self.executor_cache.get if self.executor_cache else make_executor
        executor = make(name, workers, threads, spec.executor.retries, spec.executor.address)
        if hasattr(executor, "on_retry"):
            executor.on_retry = self._worker_retried
        return executor

    def _worker_retried(self, text: str) -> None:
        """A worker died and its items run again: said on stderr and kept as a run tag
        (``pfl.worker_retry.N``), since the result is still exact but the run was not smooth."""
        self.worker_retries += 1
        warning_line(text)
        self.tracker.set_tag(f"pfl.worker_retry.{self.worker_retries}", text)

    # -- one round --------------------------------------------------------------------

    def _client_results(self, ctx: RunContext, participants: list[int], skip: bool = False) -> Iterator:
        """Run the participants' client side through the executor; yield ``(client_id, upload,
        staged)`` in participant order, as the sequential loop would, the server's bookkeeping done.

        Server side, in this process: the broadcast (bytes counted down) as each client is
        handed to the executor, then, as each result comes back, the client's new state, its
        bytes up, work, training loss and per-client values. The client side (``run_client``)
        sees only a :class:`ClientView`, so any executor can run it. ``skip``
        (``training.on_nonfinite = "skip_client"``): a diverged client's state stays as before
        the round and its upload is None; every upload yielded is then a copy. ``staged`` is the
        client's ``client.staged``, for the caller to commit once it knows the upload arrived."""
        view = ctx.client_view()
        executor = ctx.executor

        def tasks():
            for client_id in participants:
                message = ctx.broadcast(client_id)
                # a process executor sends the state and returns the new one; in this process
                # the client works on the live state
                yield ClientTask(ctx.round, client_id, message, ctx.store[client_id], skip)

        for result in executor.map(functools.partial(run_client, view), tasks()):
            yield (*self._absorb(ctx, result), result.staged)

    def _streamed_uploads(self, ctx: RunContext, participants: list[int]) -> Iterator:
        """``(client_id, upload)`` as each arrives: the aggregate receives it now, so the
        client's staged state is committed now."""
        for client_id, upload, staged in self._client_results(ctx, participants):
            commit_staged(ctx, client_id, staged)
            yield client_id, upload

    def _absorb(self, ctx: RunContext, result: "ClientResult") -> tuple[int, dict | None]:
        """The server's side of one finished client (see ``_client_results``)."""
        client_id = result.client_id
        if ctx.store[client_id] is not result.state:  # came back from another process
            ctx.store.replace(client_id, result.state)
        for name, value in result.resolved:
            ctx.resolved_value(name, value)
        if result.diverged is not None:
            if result.upload is None and self.spec.training.on_nonfinite == "skip_client":
                return client_id, None
            advice = lower_advice(self.spec, self.resolved.plugins)
            raise NonFiniteError(f"round {ctx.round}, client {client_id}, method {self.spec.algorithm.name}: "
                                 f"{result.diverged}; training diverged: {advice}, "
                                 f"or set training.on_nonfinite = \"skip_client\"")
        if result.train_loss is not None:
            ctx.train_losses.append(result.train_loss)
        for logged_id, values in result.logged:
            ctx.log_client(logged_id, **values)
        ctx.comm_up += nbytes(result.upload)
        ctx.record_work(client_id, result.work)
        return client_id, result.upload

    def run_round(self, ctx: RunContext, round: int) -> None:
        hooks = ctx.hooks
        ctx.round = round
        participants = list(hooks.select_clients(ctx=ctx, round=round))
        ctx.participants = participants
        ctx.train_losses = []
        hooks.on_round_start(ctx=ctx, round=round, participants=participants)
        weights = hooks.client_weighting(ctx=ctx, participants=participants)
        skip = self.spec.training.on_nonfinite == "skip_client"
        if skip or hooks.upload_lost.get_hookimpls():
            # Every client first (a diverged or lost upload is only known once it ran), then the
            # aggregate of the arrivals, their weights renormalised; none: the server state stays.
            kept, skipped = [], 0
            for i, upload, staged in self._client_results(ctx, participants, skip=skip):
                if upload is None:
                    skipped += 1
                elif any(hooks.upload_lost(ctx=ctx, client_id=i)):
                    ctx.comm_up -= nbytes(upload)  # never received: not counted up, staged state dropped
                else:  # kept past the next client: a copy (skip's uploads are copies already)
                    commit_staged(ctx, i, staged)
                    kept.append((i, upload if skip else copy_payload(upload)))
            if skip:
                ctx.round_metrics["skipped_clients"] = float(skipped)
                self.diverged += skipped
                self.trained += len(participants) - skipped
            if kept:
                if len(kept) < len(participants):
                    total = sum(weights[i] for i, _ in kept)
                    weights = {i: (weights[i] / total if total else 1.0 / len(kept)) for i, _ in kept}
                hooks.server_aggregate(ctx=ctx, uploads=iter(kept), weights=weights)
        else:
            uploads: Iterator = self._streamed_uploads(ctx, participants)
            hooks.server_aggregate(ctx=ctx, uploads=uploads, weights=weights)
            for _ in uploads:  # clients the aggregate did not consume still train
                pass
        if ctx.train_losses:
            ctx.round_metrics["train_loss_mean"] = sum(ctx.train_losses) / len(ctx.train_losses)
        for extra in hooks.on_round_end(ctx=ctx, round=round):
            if extra:
                ctx.round_metrics.update(extra)

    # -- the run ----------------------------------------------------------------------

    def run(self, resume: checkpoint.Loaded | None = None) -> RunResult:
        """Run every round; ``resume``: continue from a checkpoint (its MLflow run, its state)."""
        spec = self.spec
        started = time.perf_counter()
        ctx = self.ctx = self.prepare()  # kept for inspection after the run
        self.resume = resume
        if resume is not None and resume.state.get("run_id") and hasattr(self.tracker, "resume"):
            self.tracker.resume(resume.state["run_id"])
        else:
            tags = {"algorithm": spec.algorithm.name, "pfl.version": _version(), **spec.tracking.tags}
            self.tracker.start(spec.tracking_experiment, self.run_name,
                               flatten(self.resolved.as_dict), tags)
        status = "FAILED"
        try:
            self.checkpointer = checkpoint.checkpointer_for(self, resume)
            if hasattr(self.tracker, "keep_journal_in"):  # what the store misses goes beside the checkpoints
                self.tracker.keep_journal_in(self.checkpointer.folder)
            try:
                result = self._run(ctx)
            except RuntimeError as exc:  # a server step (FedAdam's tau^2, ...) beyond float32: one line
                if not is_overflow(exc):
                    raise
                where = f"round {ctx.round}" if ctx.round else "before round 1"
                raise NonFiniteError(f"{where}, method {spec.algorithm.name}: a value left float32's range (torch: "
                                     f"{exc}); {lower_advice(spec, self.resolved.plugins)}") from None
            status = "FINISHED"
            result.run_id = self.tracker.run_id
            result.seconds = time.perf_counter() - started
            return result
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                interrupt_seen()
            status = run_status(exc)  # Ctrl-C / SIGTERM: KILLED, not FAILED
            if isinstance(exc, NonFiniteError):  # findable in the UI (a tuning trial that diverged)
                self.tracker.set_tag("pfl.diverged", str(exc)[:1000])
            if isinstance(exc, Interrupted) and exc.round is None:  # where it stopped, for the one line
                exc.round, exc.rounds, exc.run_name = checkpoint.round_in_progress(self), spec.experiment.rounds, self.run_name
                exc.run_id = self.tracker.run_id
                mlflow = getattr(self.tracker, "mlflow", None)
                exc.tracking_uri = mlflow.get_tracking_uri() if mlflow is not None else None
                exc.resume = checkpoint.resume_command(self)
            raise
        finally:
            ctx.store.close()  # removes the spill folder; states in memory stay readable
            if self.executor_cache:  # the next trial may run in the same pool
                self.executor_cache.release(ctx.executor)
            else:
                ctx.executor.close()  # e.g. frees the run's data in Ray's object store
            if self.data_cache:
                self.data_cache.release(ctx.data)
            self.tracker.end(status)

    def _run(self, ctx: RunContext) -> RunResult:
        spec = self.spec
        if self.artifacts:
            self._log_partition(ctx)
        for name, value in self.executor_plan.items():  # what executor.name = "auto" came to
            ctx.resolved_value(f"executor.{name}", value)
        ctx.hooks.setup(ctx=ctx)
        evaluated = evaluation_sample(ctx, note=note_line)  # None: every training client
        progress = Progress(spec.experiment.rounds, self.progress_label, enabled=self.show_progress)
        history: list[dict] = []
        rows: list[dict] = []
        done = 0  # rounds a resumed run's checkpoint holds
        if self.resume is not None:  # after setup: the checkpoint's state replaces the initial one
            done, history, rows = checkpoint.restore(ctx, self.resume)
            progress.update(done)
        try:
            for round in range(done + 1, spec.experiment.rounds + 1):
                raise_lost_interrupt()  # a Ctrl-C whose exception a callback dropped stops here
                ctx.round_metrics = {}
                started = time.perf_counter()
                self.run_round(ctx, round)
                ctx.round_metrics = {**client_aggregates(ctx.client_series, round), **ctx.round_metrics}
                metrics = {
                    "round_seconds": time.perf_counter() - started,
                    "comm_up_bytes": float(ctx.comm_up),
                    "comm_down_bytes": float(ctx.comm_down),
                    **ctx.budget_metrics(),
                    **ctx.round_metrics,
                }
                if round % spec.evaluation.every == 0 or round == spec.experiment.rounds:
                    started = time.perf_counter()
                    scores, rows = evaluate_clients(ctx, client_ids=evaluated)
                    if spec.evaluation.validation:
                        scores.update(evaluate_clients(ctx, split="val", prefix="val_", client_ids=evaluated)[0])
                    metrics.update(scores, eval_seconds=time.perf_counter() - started)
                    metrics.update(ctx.budget_metrics())  # with this evaluation's fine-tuning steps
                    history.append({"round": round, **metrics})
                self.tracker.log_metrics(metrics, step=round)
                progress.update(round, metrics if "acc_mean" in metrics else None)
                self.checkpointer.after_round(ctx, round, history, rows)
                if self.on_evaluated is not None and history and history[-1]["round"] == round:
                    self.on_evaluated(round, metrics)
        except Interrupted:  # between rounds: the completed round's checkpoint, if not yet written
            self.checkpointer.on_interrupt(ctx, history, rows)
            raise
        finally:  # a failed round leaves no half-drawn bar
            close = getattr(progress, "close", None)  # a stand-in progress may have none
            if close is not None:
                close()
        raise_lost_interrupt()
        final = dict(history[-1]) if history else {}
        for extra in ctx.hooks.on_finish(ctx=ctx):
            if extra:
                final.update(extra)
                self.tracker.log_metrics(extra, step=spec.experiment.rounds)
        errors: list[str] = []
        if ctx.coldstart_clients:
            try:
                coldstart, coldstart_rows = self._evaluate_coldstart(ctx)
            except Exception as exc:  # keep the trained run: report, log what exists, go on
                errors.append(f"cold-start evaluation failed ({type(exc).__name__}: {one_line(exc)}); "
                              f"the training results are kept")
                self.tracker.set_tag("pfl.error", errors[-1])
            else:
                final.update(coldstart)
                self.tracker.log_metrics(coldstart, step=spec.experiment.rounds)
                rows = ([{**row, "coldstart": False} for row in rows]
                        + [{**row, "coldstart": True} for row in coldstart_rows])
        if self.diverged and not self.trained and self.resume is None:
            text = (f"run {self.run_name!r}: every client update was dropped ({self.diverged} diverged, "
                    f"training.on_nonfinite = \"skip_client\"), so the server learned nothing from its clients; "
                    f"{lower_advice(spec, self.resolved.plugins)}")
            warning_line(text)
            self.tracker.set_tag("pfl.warning", text)
        if self.artifacts:
            self._log_results(rows, ctx.client_series)
        final.pop("round", None)
        return RunResult(history=history, client_rows=rows, final=final, errors=errors)

    def _evaluate_coldstart(self, ctx: RunContext) -> tuple[dict[str, float], list[dict]]:
        """Personalise each held-out client from the final state (its broadcast, then
        ``coldstart_personalize``: ``evaluation.coldstart_models``), then score it."""
        return evaluate_clients(ctx, client_ids=ctx.coldstart_clients,
                                models_for=lambda client: coldstart_models(ctx, client), prefix="coldstart_")

    # -- artifacts --------------------------------------------------------------------

    # Above this many clients the partition picture (a bar per client) is unreadable and slow
    # to draw (41 s at 1,000 clients): partition_table.csv holds the same numbers.
    MAX_CLIENTS_DRAWN = 500

    def _log_partition(self, ctx: RunContext) -> None:
        if type(self.tracker) is NullTracker:  # tracking off: nothing would keep what is built here
            return
        data = ctx.data
        self.tracker.log_text(self.resolved.toml(), "resolved_spec.toml")
        table = data.partition_table()
        names = data.class_names or [str(c) for c in range(data.num_classes)]
        self.tracker.log_text(table_csv(["client", *names], [[i, *row] for i, row in enumerate(table.tolist())]),
                              "partition/partition_table.csv")
        if not 0 < len(table) <= self.MAX_CLIENTS_DRAWN:  # too many clients to draw, or none tabulated (on demand)
            self.tracker.log_text(json.dumps(data.indices_artifact()), "partition/indices.json")
            return
        from pfl_core.tracking import plots  # lazily: matplotlib is slow to import and only needed to draw

        fig = plots.partition_figure(table, names, f"{self.spec.partition.scheme} partition, "
                                     f"{len(data.clients)} clients")
        self.tracker.log_figure(fig, "partition/partition.png")
        plots.close(fig)
        self.tracker.log_text(json.dumps(data.indices_artifact()), "partition/indices.json")

    def _log_results(self, rows: list[dict], series: list[dict]) -> None:
        """The final per-client results, the per-client series as one table (``client.log``:
        its aggregates are the metrics) and the final accuracy's spread over the clients (the
        picture MLflow's charts cannot draw; they draw the metrics by round)."""
        if rows:
            self.tracker.log_text(table_csv(list(rows[0]), [list(r.values()) for r in rows]), "results/clients.csv")
        if series:
            self.tracker.log_text(table_csv(list(SERIES_COLUMNS), [[r[k] for k in SERIES_COLUMNS] for r in series]),
                                  "results/client_series.csv")
        log_accuracy_distribution(self.tracker, [(self.run_name, rows)], f"{self.run_name}: final accuracy per client")


SERIES_COLUMNS = ("round", "client", "name", "value")  # a row of RunContext.client_series


def commit_staged(ctx: RunContext, client_id: int, staged: dict) -> None:
    """A received upload: the client's ``client.staged`` becomes part of its state."""
    if staged:
        ctx.store[client_id].update(staged)


def client_aggregates(series: list[dict], round: int) -> dict[str, float]:
    """``<name>_mean``, ``_min`` and ``_max`` over the clients of ``round``'s rows of the
    per-client series (rows are appended in round order: this round's are at the end)."""
    values: dict[str, list[float]] = {}
    for row in reversed(series):
        if row["round"] != round:
            break
        values.setdefault(row["name"], []).append(row["value"])
    out = {}
    for name, vs in values.items():
        out.update({f"{name}_mean": float(np.mean(vs)), f"{name}_min": float(np.min(vs)),
                    f"{name}_max": float(np.max(vs))})
    return out


def _version() -> str:
    from pfl_core._version import __version__

    return __version__
