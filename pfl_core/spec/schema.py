"""The experiment spec: one attrs class per TOML section.

Plugin parameters (``algorithm.params``, ``addons[i].params``, ``data.params``, ``model.params``,
``partition.params``) are kept as raw tables here and structured into each plugin's own attrs
``Params`` class by the registry, with the same strict converter (:mod:`pfl_core.spec.convert`).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field

from pfl_core.spec.validators import (
    MAX_CLIENTS,
    MAX_EPOCHS,
    MAX_ROUNDS,
    FieldError,
    _distinct,
    _valid_seeds,
    as_float32,
    at_least,
    at_most,
    between,
    finite,
    greater_than,
    learning_rate,
    one_of,
    optimizer_step_problem,
)


@define
class ExperimentSection:
    name: str = "pfl"
    seed: int = field(default=0, validator=at_least(0))
    # Repeats: run the whole experiment once per seed (partition, initialisation, training),
    # report mean, std and 95% interval over them. Overrides `seed`.
    seeds: Optional[list[int]] = field(default=None, validator=_valid_seeds)
    # The run label every other sweep point is compared with (default: the first point).
    compare_to: str = ""
    # Reference baselines run once per spec on the identical partition and seeds as sibling
    # runs; every run then logs gain_vs_local and gain_vs_best_reference (does collaboration
    # help here?). E.g. ["local", "centralized"].
    reference: list[str] = field(factory=list, validator=_distinct("reference"))
    rounds: int = field(default=10, validator=[at_least(1), at_most(MAX_ROUNDS)])
    # Fraction of clients sampled each round with the round's seeded RNG.
    participation: float = field(default=1.0, validator=between(0, 1, low_open=True))
    # Cold-start clients: held out of training entirely (seeded choice); after the last round
    # each personalises from the final federated state for coldstart_epochs local epochs and
    # is evaluated separately (coldstart_acc_mean ...): the participation gap.
    coldstart_clients: int = field(default=0, validator=at_least(0))
    coldstart_epochs: int = field(default=1, validator=[at_least(0), at_most(MAX_EPOCHS)])
    description: str = ""


@define
class DataSection:
    name: str
    params: dict[str, Any] = field(factory=dict)
    # Pool the dataset's official test split with its training split before partitioning.
    include_test: bool = False
    # Use a seeded uniform subset of this many pool samples (quick experiments, tests).
    subsample: Optional[int] = field(default=None, validator=at_least(1))


TUNING_POOL_DEFAULT = 0.2  # partition.tuning_pool of a spec with [tune] that does not give it


@define
class PartitionSection:
    num_clients: int = field(validator=[at_least(1), at_most(MAX_CLIENTS)])
    scheme: str = "iid"
    params: dict[str, Any] = field(factory=dict)
    # Each client must receive at least this many samples (before its train/val/test split).
    min_samples: int = field(default=10, validator=at_least(1))
    val_fraction: float = field(default=0.1, validator=between(0, 1, high_open=True))
    test_fraction: float = field(default=0.2, validator=between(0, 1, low_open=True, high_open=True))
    # The tuning pool: this share of the data set, drawn once per data set (a fixed seed, not
    # experiment.seed; pfl_core/data/federated.py), is never in a test split; a tuning trial
    # (tuning_trial) draws its validation split from it alone. [tune] sets it (default
    # TUNING_POOL_DEFAULT) and writes it into tuned_spec.toml; None: no pool.
    tuning_pool: Optional[float] = field(default=None, validator=between(0, 1, low_open=True, high_open=True))
    tuning_trial: bool = False

    def __attrs_post_init__(self):
        if self.val_fraction + self.test_fraction >= 1:
            raise FieldError(
                "test_fraction",
                f"val_fraction + test_fraction must be < 1, got "
                f"{self.val_fraction} + {self.test_fraction}",
            )


@define
class PublicSection:
    """The public unlabeled set U, carved from the training pool, disjoint from all clients."""

    size: Optional[int] = field(default=None, validator=at_least(1))
    fraction: Optional[float] = field(default=None, validator=between(0, 1, low_open=True, high_open=True))
    sampling: str = field(default="balanced", validator=one_of("balanced", "dirichlet"))
    alpha: float = field(default=1.0, validator=[finite, greater_than(0)])
    # Whether U's labels are available to plugins (FedMD's transfer-learning step needs them).
    labelled: bool = False

    def __attrs_post_init__(self):
        if (self.size is None) == (self.fraction is None):
            raise FieldError("size", "give exactly one of public.size or public.fraction")


@define
class ModelSection:
    name: str = "lenet5"
    params: dict[str, Any] = field(factory=dict)
    # Per-client architectures: an explicit list (one per client) or a pool assigned round-robin.
    clients: Optional[list[str]] = None
    pool: Optional[list[str]] = None
    # Parameters for architectures named in clients/pool other than `name`.
    arch_params: dict[str, dict[str, Any]] = field(factory=dict)

    def __attrs_post_init__(self):
        if self.clients is not None and self.pool is not None:
            raise FieldError("pool", "give model.clients or model.pool, not both")
        for key in ("clients", "pool"):
            if getattr(self, key) is not None and len(getattr(self, key)) == 0:
                raise FieldError(key, "must not be empty")


@define
class PluginRef:
    name: str
    params: dict[str, Any] = field(factory=dict)


@define
class TrainingSection:
    local_epochs: int = field(default=1, validator=[at_least(0), at_most(MAX_EPOCHS)])
    batch_size: int = field(default=10, validator=at_least(1))
    optimizer: str = field(default="sgd", validator=one_of("sgd", "adam"))
    lr: float = field(default=0.01, validator=learning_rate)
    momentum: float = field(default=0.0, validator=between(0, 1, high_open=True))
    weight_decay: float = field(default=0.0, validator=[finite, at_least(0)])
    shuffle: bool = True
    # Skip each epoch's last partial batch (kept when it is a client's only batch). The papers
    # leave it open; on by default because a full-learning-rate step on a 1-2 sample
    # remainder cost small clients up to 7 points (docs/spec-reference.md).
    drop_last: bool = True
    # A client whose training loss or upload becomes NaN/inf: "stop" the run (one line naming
    # round, client and method) or "skip_client" (left out of this round's aggregate, its
    # state restored; skipped_clients is logged per round).
    on_nonfinite: str = field(default="stop", validator=one_of("stop", "skip_client"))
    # The forward passes' and losses' arithmetic (pfl_core/runtime/precision.py): "bf16" runs them
    # under torch.autocast to bfloat16; weights, optimiser state and aggregation stay float32.
    precision: str = field(default="fp32", validator=one_of("fp32", "bf16"))

    def __attrs_post_init__(self):
        # What the optimiser derives from lr and momentum must fit float32 as well (issue 33).
        if self.optimizer == "sgd" and as_float32(self.momentum) >= 1:
            raise FieldError("momentum", f"{self.momentum!r} is 1 in float32, the precision of the optimiser's "
                                         f"arithmetic, so the velocity never decays; it must be < 1 there "
                                         f"(at most {as_float32(1 - 2**-24)!r})")
        problem = optimizer_step_problem(self.optimizer, self.lr, self.momentum)
        if problem:
            raise FieldError("lr", problem)


@define
class EvaluationSection:
    every: int = field(default=1, validator=at_least(1))
    batch_size: int = field(default=1024, validator=at_least(1))
    # Also score each client's personalized model on its validation split (val_acc_mean ...),
    # the split to tune hyperparameters on (never the test split).
    validation: bool = False
    # Evaluate a sample of this many training clients, where evaluating all is infeasible (a
    # million clients): drawn once per run from experiment.seed, the same at every evaluation
    # (pfl_core/runtime/evaluation.py: evaluation_sample). 0: every training client.
    clients: int = field(default=0, validator=at_least(0))


@define
class TrackingSection:
    enabled: bool = True
    # Empty: MLflow's own default (a SQLite file mlflow.db in the working directory).
    uri: str = ""
    # Empty: experiment.name.
    experiment: str = ""
    # Empty: "<algorithm>" (plus the sweep values for a sweep).
    run_name: str = ""
    tags: dict[str, str] = field(factory=dict)
    progress: bool = True


# More threads or worker processes than any machine has cores: a typo (torch refuses a count
# beyond a C int, which was an "internal error" before validation said so).
MAX_THREADS = 4096


@define
class ExecutorSection:
    # "auto": a process pool on a multi-core CPU when a round has enough work to share, else
    # sequential (pfl_core/execution/planner.py: plan). Every executor gives bit-identical results,
    # except "batched" (one architecture's clients trained together with torch.func.vmap,
    # pfl_core/execution/batched.py), equal to them up to float rounding where it trains clients together.
    name: str = field(default="auto", validator=one_of("auto", "sequential", "process", "ray", "batched"))
    device: str = field(default="cpu", validator=one_of("cpu", "cuda", "auto"))
    # torch intra-op threads per process; 0 = 1 (more threads per process oversubscribe the
    # cores of a shared or parallel machine).
    threads: int = field(default=0, validator=[at_least(0), at_most(MAX_THREADS)])
    # worker processes (process executor); left out: one per available core.
    workers: Optional[int] = field(default=None, validator=[at_least(1), at_most(MAX_THREADS)])
    # times a client whose worker process died is run again before the run stops
    retries: int = field(default=1, validator=at_least(0))
    # ray executor: "" starts Ray on this machine; "auto" joins the cluster this machine is part
    # of (ray start); "host:6379" or "ray://host:10001" an existing cluster (docs/architecture.md).
    address: str = ""


@define
class CheckpointSection:
    enabled: bool = True
    # Rounds between checkpoints; 0: automatic, the shortest period whose writes cost under 5%
    # of the run time (measured: the last write's time against the mean round time).
    every: int = field(default=0, validator=at_least(0))
    # Folder under which each run gets its own folder (named by its MLflow run id); empty:
    # ``checkpoints/`` beside the SQLite tracking store (the working directory for a server).
    # Without tracking and without a folder, nothing is checkpointed.
    dir: str = ""
    # How many checkpoints each run keeps (the older ones are deleted).
    keep: int = field(default=2, validator=at_least(1))


@define
class StateSection:
    # Client states kept in memory (the least recently used others are spilled to disk as
    # safetensors files, pfl_core/state/store.py); 0: automatic, at most 256 states and 256 MiB of
    # their tensors. Results do not depend on it.
    cache_clients: int = field(default=0, validator=at_least(0))
    # Folder in which the run's spill folder is made (and removed at the end of the run);
    # empty: the system's temporary folder.
    spill_dir: str = ""


def _validation_metric(_instance, attribute, value):
    if not value.startswith("val_"):
        raise FieldError(attribute.name, f"{value!r} is scored on the test split; tune on a validation metric "
                                         f"(val_{value.removeprefix('val_') or 'acc_mean'}, with "
                                         f"partition.val_fraction > 0): the test split is for the final runs only")


@define
class TuneSection:
    """Hyperparameter tuning of each sweep point by Optuna (pfl_core/study/tune.py)."""

    trials: int = field(default=20, validator=[at_least(1), at_most(10_000)])
    # the objective: a validation metric, at the last evaluation ("final") or its best round
    metric: str = field(default="val_acc_mean", validator=_validation_metric)
    objective: str = field(default="final", validator=one_of("final", "best"))
    direction: str = field(default="maximize", validator=one_of("maximize", "minimize"))
    # "shared": one seeded Sobol design of tune.space's keys, the same for every method, each
    # method's own keys crossed with it trial by trial (pfl_core/study/tune.py says why not TPE)
    sampler: str = field(default="shared", validator=one_of("shared", "tpe", "random", "grid"))
    pruner: str = field(default="median", validator=one_of("median", "none"))
    # the seeds a trial runs on (its objective: their mean); default: one seed that is not
    # among experiment.seeds, so choosing and the final evaluation do not share noise
    seeds: Optional[list[int]] = field(default=None, validator=_valid_seeds)
    parallel: int = field(default=1, validator=[at_least(1), at_most(64)])  # trials at once
    # dotted spec key -> { low, high [, log, step] } or { choices = [...] }: every point's space
    space: dict[str, Any] = field(factory=dict)
    # algorithm name -> its own keys' space, added to `space` for that method's points
    method: dict[str, dict[str, Any]] = field(factory=dict)


@define
class ReportSection:
    # p-values of a table of several paired comparisons are adjusted for multiple comparisons
    # (Holm's step-down method; "none": raw p); a * marks an adjusted p below 0.05
    correction: str = field(default="holm", validator=one_of("holm", "none"))
    # the family the correction runs over: "table", every comparison of the table at once (each
    # compared metric x each run against the compared-to run); "metric", each metric's
    # comparisons apart (a family per column of differences)
    correction_family: str = field(default="table", validator=one_of("table", "metric"))
    # what "the same budget" means when methods are compared: passes over the private data
    # ("passes", budget.private_epochs) or optimiser steps summed over a client's models ("steps")
    budget: str = field(default="passes", validator=one_of("passes", "steps"))


@define
class Spec:
    data: DataSection
    partition: PartitionSection
    algorithm: PluginRef
    experiment: ExperimentSection = field(factory=ExperimentSection)
    model: ModelSection = field(factory=ModelSection)
    public: Optional[PublicSection] = None
    addons: list[PluginRef] = field(factory=list)
    training: TrainingSection = field(factory=TrainingSection)
    evaluation: EvaluationSection = field(factory=EvaluationSection)
    tracking: TrackingSection = field(factory=TrackingSection)
    executor: ExecutorSection = field(factory=ExecutorSection)
    # dotted key -> list of values; the cartesian product runs as separate runs.
    sweep: dict[str, list[Any]] = field(factory=dict)
    # Computed by resolve() (declared local work, pfl_core/registry/budget.py); a value given here is
    # replaced, so a resolved spec can be run again as it is.
    budget: dict[str, Any] = field(factory=dict)
    checkpoint: CheckpointSection = field(factory=CheckpointSection)
    state: StateSection = field(factory=StateSection)
    report: ReportSection = field(factory=ReportSection)
    tune: Optional[TuneSection] = None

    @property
    def tracking_experiment(self) -> str:
        """The MLflow experiment the runs go to: ``tracking.experiment``, else ``experiment.name``."""
        return self.tracking.experiment or self.experiment.name

    def __attrs_post_init__(self):
        if self.tune is not None and self.partition.tuning_pool is None:
            self.partition.tuning_pool = TUNING_POOL_DEFAULT  # tuning validation never meets a final test split
        if self.partition.tuning_trial and self.partition.tuning_pool is None:
            raise FieldError("partition.tuning_trial", "is true, but there is no partition.tuning_pool to draw "
                                                       "the validation split from; give it, e.g. 0.2")
        if self.tune is not None and self.partition.val_fraction == 0:
            raise FieldError("partition.val_fraction", "is 0, but [tune] chooses hyperparameters on the validation "
                                                       "split; give it a share of each client's data, e.g. 0.1")
        if self.experiment.coldstart_clients >= self.partition.num_clients:
            raise FieldError(
                "experiment.coldstart_clients",
                f"{self.experiment.coldstart_clients} cold-start clients leave no client to train "
                f"(partition.num_clients = {self.partition.num_clients})",
            )
        if self.evaluation.clients > self.partition.num_clients:
            raise FieldError("evaluation.clients", f"samples {self.evaluation.clients} clients to evaluate, more than "
                                                   f"there are (partition.num_clients = {self.partition.num_clients}); "
                                                   "0 evaluates every client")
        archs = sorted(set(self.model.clients or self.model.pool or [self.model.name]))
        if self.executor.name == "batched" and len(archs) > 1:
            raise FieldError("executor.name", f"'batched' trains clients of one architecture together, but "
                                              f"{'model.clients' if self.model.clients else 'model.pool'} gives "
                                              f"{len(archs)} ({', '.join(archs)}); use 'sequential' or 'process'")


