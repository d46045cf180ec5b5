"""Every private Keras and TensorFlow name kerasmulti uses, in one place.

kerasmulti owns its training step, so it reaches into Keras where no public
name does the job. This module is the only one that does: each private
module, function, attribute and method is imported or read here, saying what
it is for and why no public name serves; the rest of the package calls the
functions below. Where Keras has a public name (`keras.utils.unpack_x_y_sample_weight`,
`keras.StatelessScope`, `keras.backend.epsilon`, `Model.compute_loss`,
`BatchNormalization.axis`, a strategy's `cluster_resolver`), the code uses
that instead. Read this file to know what a Keras or TensorFlow release can
break: `tests/test_keras_private.py` checks every name here still exists with
the signature kerasmulti calls it with, so a release that moves one fails
that test by name instead of changing behaviour silently. The versions these
were read from are the ones `setup.cfg` pins.

Optimizers' and variables' private names are in `optimizers.py`, imported here:
callers use this module for them too. Patches of Keras objects (loss reduction,
saving, layer calls, BatchNormalization) live with the feature they serve; what they patch is imported from here or is a
public class. Private methods that kerasmulti's subclasses override are in `OVERRIDDEN`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys

import keras
from keras import tree

if keras.backend.backend() != "tensorflow":
    # Everything below is the TensorFlow backend's: another backend's would
    # fail in ways that do not say why.
    raise ImportError(
        "kerasmulti runs Keras on TensorFlow, but Keras uses another backend. "
        "Set KERAS_BACKEND=tensorflow before importing Keras. "
        f"Received: backend={keras.backend.backend()!r}"
    )

# Builds a model's variables (and Keras' compiled loss) symbolically, as
# Keras does before a step under a distribution strategy (`_symbolic_build`).
# Public `Layer.compute_output_spec` calls `call` directly and skips Keras'
# own argument handling (`training=` on models whose call does not take it).
from keras.src.backend import compute_output_spec

# Keras' call context (a loss computed inside a layer call is not a replica's part
# of the batch's loss) and its shared objects of one save or load (`on_device.py`).
from keras.src.backend.common import global_state

# A tensor's Keras mask travels as an attribute the public API neither reads
# nor writes; replica outputs are merged with theirs.
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

# Keras' TensorFlow convolution: for a grouped convolution (ConvNeXt's
# depthwise layers) its `conv` runs an XLA function that reads the kernel
# variable itself, which XLA refuses on a replica's device (the variable lives
# on the first). `replicas.py` has it read the kernel first; no public
# name reaches that path. Keras 3.16 moves the backend's op modules into `ops/`.
try:
    from keras.src.backend.tensorflow.ops import nn as tensorflow_nn
except ImportError:  # Keras 3.15 and earlier
    from keras.src.backend.tensorflow import nn as tensorflow_nn

# `fit`'s epoch iterator: a resumed epoch passes over its trained batches by
# giving the one `fit` made its own `_enumerate_iterator` (`training_state.py`).
from keras.src.backend.tensorflow.trainer import TFEpochIterator

# Keras' loss module: `reduce_weighted_values` is the one function every Keras
# loss reduces through, so a replica's share of the batch's loss is patched in
# there (`loss_parts.py`); the other helpers are the ones that function uses.
from keras.src.losses import loss as loss_module

# A functional model's graph, read node by node (`rebuild.py`,
# `summary.py`): Keras exposes no public node API; the key says whether a
# layer's call belongs to this model.
from keras.src.models.functional import Functional
from keras.src.ops.function import make_node_key

# Keras' unseeded random ops draw from one process-wide SeedGenerator, kept in
# `global_state` under this name and made at the first draw; the first-call probe
# (`row_mixing.py`) puts it back as it found it.
from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

# Keras' saving entry points: `model.save` / `load_model` / `load_weights`
# all go through them, so a placed model is written as a plain one there
# (`portable.py`); Keras has no public hook around saving.
from keras.src.saving import saving_lib

# Keras' array pipeline (batches, shuffling, class weights, validation split)
# with tf.data autotuning off (`feeding.py`); `fit` builds it only internally.
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
from keras.src.trainers.trainer import model_supports_jit  # Keras' own test for `jit_compile="auto"`

# Joining a cluster with a deadline (`cluster._join`): the coordination
# service is what MultiWorkerMirroredStrategy configures itself, but without
# `cluster_register_timeout_in_ms` a missing worker blocks for an hour.
from tensorflow.python.distribute import multi_worker_util  # noqa: E402

# TensorFlow's runtime context: whether it started (a forked launch cannot use
# it then) and its coordination service. No public name tells either.
from tensorflow.python.eager import context as eager_context  # noqa: E402

# Optimizers' and variables' private names, in a module of their own (`optimizers.py`).
from kerasmulti._src.keras_private.optimizers import (  # noqa: E402
    LOSS_SCALE_ATTRIBUTES,  # noqa: F401  (for tests/test_keras_private.py, not in `__all__`)
    OPTIMIZER_ATTRIBUTES,  # noqa: F401
    accumulators,
    clip_gradients,
    filter_empty_gradients,
    learning_rate_or_schedule,
    optimizer_iterations,
    optimizer_strategy,
    optimizer_trainable_variables,
    reinitialize,
    rekey_optimizer,
    sum_gradients_with,
    uses_weight_decay,
    variable_key,
)

# The coordination service's config proto moved (TensorFlow 2.16 and 2.17:
# tensorflow.tsl.protobuf; 2.18 on: tensorflow.compiler.xla.tsl.protobuf):
# the module TensorFlow's own context imported is the one this TensorFlow has.
# None if neither is there: only joining a cluster needs it (`cluster._join`).
coordination_config_pb2 = getattr(eager_context, "coordination_config_pb2", None)
# The profiler's trace format, from which `utils/step_ops.py` counts a step's operations.
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

# The deadline needs the registration barrier (`cluster_register_with_barrier`),
# absent before TensorFlow 2.19; on 2.19.1 a worker other than the chief still
# missed it at times (3 runs of 5). Joining is refused before 2.20.
CLUSTER_TENSORFLOW = (2, 20)


def tensorflow_version() -> tuple[int, int]:
    """The running TensorFlow's (major, minor)."""
    import tensorflow as tf

    major, minor = tf.version.VERSION.split(".")[:2]
    return int(major), int(minor)


# Whether a GradientTape is recording: a user's tape cannot see replicas that
# run on threads of their own. TensorFlow has no public way to ask.
from tensorflow.python.eager import record  # noqa: E402

# Private methods of Keras classes that kerasmulti's subclasses override, by the class that
# defines them. `Trainer._resolve_auto_jit_compile`: a parallel model decides XLA per replica;
# `Model._aggregate_additional_loss`: each replica adds its share of regularisers and `add_loss`;
# `Trainer._maybe_symbolic_build`: under MultiWorkerMirroredStrategy Keras reduces a per-replica
# batch and crashes (keras-team/keras#20585), and it is handed `fit`'s epoch iterator;
# `_get_metrics_result_or_logs`: the logs of a resumed epoch that ran no step;
# `ModelCheckpoint._save_model`, `BackupAndRestore._save_model`: the one place each callback
# writes, made atomic and template-only.
OVERRIDDEN = {
    keras.Model: ("_resolve_auto_jit_compile", "_maybe_symbolic_build", "_aggregate_additional_loss", "_get_metrics_result_or_logs"),
    keras.callbacks.ModelCheckpoint: ("_save_model",),
    keras.callbacks.BackupAndRestore: ("_save_model",),
}
# `BatchNormalization._moments(inputs, mask)`: replaced on each layer across workers by one
# device's statistics over every worker's rows (`sync_batchnorm.replica_context_moments`).
BATCHNORM_MOMENTS = "_moments"


# --- Layers and functional graphs ---------------------------------------------


def flatten_layers(layer, include_self: bool = True) -> list:
    """Every layer inside `layer`, recursively (`Layer._flatten_layers`).

    `Model.layers` lists direct children only; Keras has no public recursive walk.
    """
    return list(layer._flatten_layers(include_self=include_self, recursive=True))


def seed_generators(layer) -> list:
    """The `SeedGenerator`s a layer (Dropout, noise) owns: their states are variables."""
    return list(getattr(layer, "_seed_generators", []))


def dataset_inputs(dataset) -> list:
    """The datasets a `tf.data.Dataset` reads (`DatasetV2._inputs()`): no public name walks a pipeline."""
    return list(dataset._inputs())


def dataset_count(dataset):
    """The `count` of a `repeat()` or `take()` dataset (`_count`), as an int; None for others."""
    count = getattr(dataset, "_count", None)
    return None if count is None else int(count)


def stops_on_empty(dataset):
    """`sample_from_datasets`' `stop_on_empty_dataset` (`_DirectedInterleaveDataset._stop_on_empty_dataset`); None for others."""
    return getattr(dataset, "_stop_on_empty_dataset", None)


def own_metrics(layer) -> list:
    """The metrics a layer holds as attributes (`Layer._metrics`), not its sublayers'."""
    return list(getattr(layer, "_metrics", []))


def added_losses(layer) -> list:
    """The list of losses `add_loss` appended during this call (`Layer._losses`), mutable in place."""
    return layer._losses


def swap_added_losses(layer, losses):
    """Replaces a layer's own `loss_parts` list (read from `__dict__`, not through its tracker); returns the old one."""
    old = layer.__dict__["_losses"]
    layer.__dict__["_losses"] = losses
    return old


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a symbolic tensor: what made it."""
    return tensor._keras_history


def inbound_nodes(layer) -> list:
    """Every call of `layer` in any graph, in order (`Operation._inbound_nodes`)."""
    return list(getattr(layer, "_inbound_nodes", []))


def graph_node_keys(model) -> set | None:
    """Keys of the nodes of `model`'s own graph (a Sequential's is its `_functional`); None if it has none."""
    graph = getattr(model, "_functional", None) or model
    return getattr(graph, "_nodes", None)


def nodes_by_depth(model) -> dict:
    """A functional model's nodes, by depth from its outputs (`Functional._nodes_by_depth`)."""
    return model._nodes_by_depth


def set_sequential_layers(model, layers: list) -> None:
    """Replaces a Sequential's layer list before it builds (a scope places them there)."""
    model._layers = layers


# Keras' functions that rebuild layers from a config: loading and cloning.
DESERIALISING = frozenset({"from_config", "functional_from_config", "deserialize_keras_object"})


def keras_is_deserialising(skip: int = 1) -> bool:
    """Whether Keras is rebuilding a model from its config (loading, cloning) below this call.

    Keras has no flag for it: the stack is read for Keras' own functions from `skip` frames up (1: the caller).
    """
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if code.co_name in DESERIALISING and f"{os.sep}keras{os.sep}" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def sequential_layers(model) -> list:
    """A Sequential's layers with its `InputLayer` (which `Sequential.layers` leaves out)."""
    return list(model._layers)


@contextlib.contextmanager
def without_autocast():
    """Inside: no autocast scope, as outside every layer's call; Keras variables read and report their stored dtypes.

    A layer's call opens Keras' autocast scope (float16 under mixed_float16),
    also a model's with `autocast=False` whose compute dtype is not its
    variables'; the packed reads and state scopes (`packing.py`) take the
    variables as stored. `AutocastScope(None)` does not: under it a variable's
    `dtype` reports the default float type, float32 for a bfloat16 one.
    """
    previous = global_state.get_global_attribute("autocast_scope")
    global_state.set_global_attribute("autocast_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("autocast_scope", previous)


# --- Training -------------------------------------------------------------------


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """`model.compute_loss`, with `training` only where the override takes it.

    The public method, called as Keras' private `_compute_loss` calls it: a
    `compute_loss` written before Keras 3.3 has no `training` argument.
    """
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(x, y, y_pred, sample_weight, training=training)
    return model.compute_loss(x, y, y_pred, sample_weight)


def symbolic_outputs(model, x):
    """`model(x, training=False)` for a symbolic `x`: the outputs' structure, shapes and dtypes.

    A functional or Sequential model knows them from its build (its outputs'
    `KerasTensor`s, `Functional._outputs_struct`): 0.0 s where tracing its whole
    call takes 0.3 s (214 variables). Other models' call is traced.
    """
    functional = model if isinstance(model, Functional) else getattr(model, "_functional", None)
    kind = Functional if model is functional else keras.Sequential
    if isinstance(functional, Functional) and type(model).call is kind.call:
        batch = tree.flatten(x)[0].shape[0]  # the batch's rows, where the build has None

        def spec(t):
            return keras.KerasTensor((batch, *t.shape[1:]) if t.shape and t.shape[0] is None else t.shape, t.dtype)

        return tree.map_structure(spec, functional._outputs_struct)
    return compute_output_spec(model, x, training=False)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` log (`Trainer._loss_tracker`)."""
    return model._loss_tracker


def compiled_loss(model):
    """The `CompileLoss` that `compile(loss=...)` made (`Trainer._compile_loss`), or None."""
    return getattr(model, "_compile_loss", None)


def compile_arguments(model) -> dict:
    """The arguments `compile` was called with, as given (`Trainer._compile_config.config`)."""
    return dict(model._compile_config.config)


def symbolic_build(model, data_batch) -> None:
    """Creates the compiled loss and metrics' variables from one batch, as Keras does under a strategy."""
    model._symbolic_build(data_batch=data_batch)


# --- Callbacks ------------------------------------------------------------------


def checkpoint_file_path(callback, epoch, batch, logs) -> str:
    """The file `ModelCheckpoint` writes for this epoch or batch (its `filepath` formatted)."""
    return callback._get_file_path(epoch, batch, logs)


def checkpoint_should_save(callback, epoch, batch, logs, filepath) -> bool:
    """Whether `ModelCheckpoint` saves now (`save_best_only`, `initial_value_threshold`...)."""
    return callback._should_save_model(epoch, batch, logs, filepath)


def set_monitor_op(callback) -> None:
    """Sets a `MonitorCallback`'s comparison (`monitor_op`) from its mode and the model's metrics."""
    callback._set_monitor_op()


def backup_paths(callback) -> dict:
    """`BackupAndRestore`'s four files: the latest and previous weights and training metadata."""
    return {
        "weights": callback._weights_path,
        "metadata": callback._training_metadata_path,
        "previous_weights": callback._prev_weights_path,
        "previous_metadata": callback._prev_training_metadata_path,
    }


def set_initial_epoch(model, epoch: int) -> None:
    """Makes `fit` start at `epoch`, as Keras' `BackupAndRestore` does (`Model._initial_epoch`)."""
    model._initial_epoch = epoch


def backup_due(callback, batch: int) -> bool:
    """Whether `BackupAndRestore` backs up after `batch` (an int `save_freq`), counting it as seen."""
    return callback._should_save_on_batch(batch)


# --- TensorFlow runtime ---------------------------------------------------------


def tensorflow_started() -> bool:
    """Whether TensorFlow's runtime started, or found a GPU (whose driver a forked process cannot use)."""
    started = eager_context.context()
    listed = started._physical_devices or []
    return started._initialized or any(device.device_type == "GPU" for device in listed)


__all__ = [
    "BATCHNORM_MOMENTS", "CLUSTER_TENSORFLOW", "OVERRIDDEN", "accumulators", "added_losses", "backup_paths", "backup_due",
    "checkpoint_file_path", "checkpoint_should_save", "clip_gradients", "compile_arguments", "compiled_loss", "compute_loss",
    "filter_empty_gradients", "flatten_layers", "graph_node_keys", "inbound_nodes", "keras_history",
    "learning_rate_or_schedule", "loss_tracker", "nodes_by_depth", "optimizer_iterations", "optimizer_strategy",
    "optimizer_trainable_variables", "rekey_optimizer", "reinitialize", "variable_key", "dataset_count", "dataset_inputs", "own_metrics",
    "sum_gradients_with", "seed_generators", "set_monitor_op", "set_sequential_layers", "keras_is_deserialising",
    "DESERIALISING", "GLOBAL_SEED_GENERATOR", "set_initial_epoch",
    "sequential_layers", "swap_added_losses", "symbolic_build", "tensorflow_started", "tensorflow_version", "uses_weight_decay",
    "Functional", "TFEpochIterator", "array_data_adapter", "array_slicing", "compute_output_spec", "coordination_config_pb2",
    "eager_context", "get_keras_mask", "global_state", "loss_module", "make_node_key", "model_supports_jit",
    "multi_worker_util", "record", "saving_lib", "set_keras_mask", "tensorflow_nn", "xplane_pb2",
    "without_autocast",
]
