"""The public API for plugin authors: everything a method or add-on needs, in one import.

    from pfl_core.methods.averaging import WeightAveraging
    from pfl_core.registry.hookspecs import hookimpl
    from pfl_core.spec.validators import at_least, finite

Built-in plugins take pfl's machinery only from here (``tests/test_layers.py`` checks it), and
so does the third-party example under ``examples/``. A plugin may also build on another
plugin's class (``from pfl_plugins.fedavg import FedAvg``). Names here are kept stable: one that
moves keeps a deprecated alias for a release (CHANGELOG.md).
"""

from pfl_core.data import DatasetPlugin, PartitionerPlugin, RawDataset
from pfl_core.engine import Engine, Resolved, RunResult, resolve
from pfl_core.errors import DataError, NonFiniteError, PflError, SpecError
from pfl_core.methods.averaging import WeightAveraging, model_key, require_single_architecture
from pfl_core.methods.codistill import (
    DTYPES,
    CodistillParams,
    PublicPredictionMethod,
    distill,
    kl_to_target,
    mean_l1_distances,
    predict,
    predict_logits,
    require_public,
)
from pfl_core.methods.embeddings import (
    MutualPair,
    aggregate_prototypes,
    capture_embedding,
    classifier,
    classifier_gives_the_logits,
    embeddings,
    head_keys,
    local_prototypes,
    rewrite_classifier_input,
)
from pfl_core.methods.expertise import dequantise, expertise_bound, quantise
from pfl_core.methods.hypernetwork import HyperNetwork, hypernetwork_size, produce, refuse_if_larger_than_memory
from pfl_core.methods.mixing import ClippedSGD, LearnedMix, elementwise_mix
from pfl_core.methods.partial import (
    PartialModel,
    SplitParams,
    clone_keys,
    only_training,
    partial_average,
    probe_model,
    probe_num_layers,
    resolve_split,
    spec_archs,
)
from pfl_core.methods.per_run import per_run
from pfl_core.methods.personal import KeepsOwnEntries, load_personal
from pfl_core.methods.proximal import AnchoredAveraging, proximal_term
from pfl_core.models import ModelPlugin
from pfl_core.models.layers import layer_keys, parameterised_layers, split_at
from pfl_core.payload import Packed, bits_for_classes, nbytes
from pfl_core.registry import ADDON, ALGORITHM, DATASET, MODEL, PARTITIONER, NoParams, Plugin, instantiate
from pfl_core.registry import refresh as refresh_plugins
from pfl_core.registry import resolve as resolve_plugin
from pfl_core.registry.budget import LocalWork
from pfl_core.registry.hookspecs import hookimpl
from pfl_core.runtime.aggregate import weighted_average
from pfl_core.runtime.context import ClientView, ModelBank, clone_state, load_state
from pfl_core.runtime.evaluation import score
from pfl_core.runtime.precision import precision_autocast
from pfl_core.runtime.training import (
    add_to_gradients,
    batch_order,
    batch_starts,
    cross_entropy_loss,
    make_optimizer,
    mean_training_loss,
    reset_optimizer,
    run_epochs,
)
from pfl_core.seeding import derive_seed, numpy_rng, torch_generator
from pfl_core.spec import (
    FieldError,
    at_least,
    at_most,
    between,
    choices_text,
    described,
    finite,
    greater_than,
    learning_rate,
    one_of,
)
from pfl_core.tracking import plots
from pfl_core.tracking.terminal import warning_line

__all__ = [
    # the plugin system
    "ADDON", "ALGORITHM", "DATASET", "MODEL", "PARTITIONER", "NoParams", "Plugin", "hookimpl", "instantiate",
    "resolve_plugin", "refresh_plugins", "LocalWork",
    # errors and parameter validators
    "DataError", "FieldError", "NonFiniteError", "PflError", "SpecError", "at_least", "at_most", "between",
    "choices_text", "described", "finite", "greater_than", "learning_rate", "one_of",
    # messages and their size
    "Packed", "bits_for_classes", "nbytes",
    # models, clients and training
    "ClientView", "ModelBank", "add_to_gradients", "batch_order", "batch_starts", "clone_state", "cross_entropy_loss",
    "layer_keys", "load_state",
    "make_optimizer", "mean_training_loss", "parameterised_layers", "precision_autocast", "reset_optimizer",
    "run_epochs", "score", "split_at", "weighted_average",
    # seeds
    "derive_seed", "numpy_rng", "torch_generator",
    # figures and warnings
    "plots", "warning_line",
    # data set, partitioner and model plugins
    "DatasetPlugin", "ModelPlugin", "PartitionerPlugin", "RawDataset",
    # running a spec in a plugin's tests
    "Engine", "Resolved", "RunResult", "resolve",
    # shared method machinery
    "AnchoredAveraging", "ClippedSGD", "CodistillParams", "DTYPES", "LearnedMix", "PartialModel", "PublicPredictionMethod",
    "SplitParams", "elementwise_mix",
    "HyperNetwork", "hypernetwork_size", "produce", "refuse_if_larger_than_memory",
    "WeightAveraging", "MutualPair", "aggregate_prototypes", "capture_embedding", "classifier", "classifier_gives_the_logits", "clone_keys", "dequantise",
    "distill", "embeddings", "expertise_bound", "head_keys", "kl_to_target", "KeepsOwnEntries", "load_personal", "local_prototypes",
    "mean_l1_distances", "model_key", "only_training", "partial_average", "per_run", "predict", "predict_logits",
    "probe_model", "probe_num_layers", "proximal_term", "quantise", "require_public", "rewrite_classifier_input", "require_single_architecture",
    "resolve_split", "spec_archs",
]
