"""`parallelize`: checks the template, picks the devices, wraps the model.

In one process it returns a `ParallelModel` over this machine's devices
(`_parallel.py`); in a process that joined a cluster (`_cluster.py`) it adopts
the template into the cluster's strategy and returns a `WorkerModel`
(`_multiworker.py`). Models that cannot be split (stateful RNNs, batch
renormalisation) are refused here, before anything is traced.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import keras
import tensorflow as tf

from kerasmulti import _balance, _cluster, _devices
from kerasmulti._parallel import ParallelModel, _warn_overrides, unwrap
from kerasmulti._private import compute_output_spec


def _refuse_unsplittable(model) -> None:
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if getattr(layer, "stateful", False):
            # Its state carries over row by row from one batch to the next,
            # and replicas see different rows.
            raise ValueError(
                f"parallelize() cannot split the stateful layer '{layer.name}' "
                f"({type(layer).__name__}). Rebuild it with stateful=False, or use one "
                f"device. Received: layer={layer.name!r} with stateful=True"
            )
        if isinstance(layer, keras.layers.BatchNormalization) and layer.renorm:
            # Its correction terms are not synchronised across replicas.
            raise ValueError(
                f"parallelize() does not support batch renormalisation (layer "
                f"'{layer.name}'). Use renorm=False, or use one device. "
                f"Received: layer={layer.name!r} with renorm=True"
            )


# Keras layers whose output for a row depends on other rows of the batch
# (besides BatchNormalization, which replicas synchronise).
_ROW_MIXING = ("MixUp", "CutMix")


def _warn_row_mixing(model, stacklevel) -> None:
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if type(layer).__name__ in _ROW_MIXING and type(layer).__module__.startswith("keras."):
            warnings.warn(
                f"Layer '{layer.name}' ({type(layer).__name__}) mixes rows only within each "
                "replica's sub-batch, so training differs from one device. Apply it in the "
                f"input pipeline (tf.data) instead. Received: layer={layer.name!r}",
                stacklevel=stacklevel + 1,
            )


def _relocate_to_cpu(model) -> None:
    with tf.device("/cpu:0"):
        for variable in model.variables:
            variable._initialize(variable.value.read_value())


def parallelize(
    model: keras.Model,
    gpus: int | Sequence[int] | None = None,
    devices: Sequence[str] | None = None,
    cpu_merge: bool = True,
    cpu_relocation: bool = False,
    split: str | Sequence[float] = "even",
) -> ParallelModel:
    """Replicates a Keras model on several devices for data-parallel training.

    Each batch is split along axis 0 into one shard per device (sizes differ by
    at most one, or follow `split`; a batch smaller than the device count uses
    fewer replicas).
    The model runs on every shard on its own device, and the outputs are
    concatenated in order on the CPU. The returned model shares every weight
    with `model`: compile and fit it, and `model` is trained; `save()` on it
    saves `model`. Results equal those of `model` on one device, including
    `sample_weight`, `class_weight`, stateful metrics, BatchNormalization
    statistics (synchronised across replicas), every Keras loss reduction,
    masked losses and the losses layers add (as means over rows, which is
    what Keras' regularisers add). (A loss function that returns an already
    averaged scalar is exact without sample weights and approximate with
    them, with a warning.) The model's own `train_step`, `test_step`,
    `predict_step`, `compute_loss` or `compute_metrics`, if it overrides
    them, is not run (a warning says so). With BatchNormalization, train
    with `fit` or `train_on_batch`: under your own `GradientTape`, a call
    with `training=True` raises, since its replicas run on threads.
    With one device it is a pass-through, so code written for N GPUs runs on
    a laptop. On GPUs, `compile()` keeps Keras' default XLA: each replica's
    forward pass, loss and gradients are compiled for its own device
    (`jit_compile="auto"`; `False` keeps uncompiled replicas). Compiled
    replicas normalise BatchNormalization per replica, as `MirroredStrategy`
    does; uncompiled ones with the whole batch's statistics.

    In a process started as a worker of a cluster (`TF_CONFIG`, e.g. by
    `kerasmulti launch`), the model is adopted into
    `MultiWorkerMirroredStrategy` instead and trains across all workers, with
    the numbers of one process on the same global batches; `gpus` and
    `devices` are then checked but the strategy uses every GPU the worker
    sees (or its CPU). See the README's "Multi-worker training".

    Args:
        model: A built `keras.Model` (Sequential, functional, subclassed or
            loaded from a file).
        gpus: How many devices to use (the first `gpus` of
            `kerasmulti.available_devices()`), a list of device ids, or None
            for all of them.
        devices: Explicit TensorFlow device names instead of `gpus`, e.g.
            `["/gpu:0", "/gpu:2"]`.
        cpu_merge: Merge the replicas' outputs (and sum their gradients) on
            `/cpu:0`. With False, merging happens on the first device.
        cpu_relocation: Move the model's variables to host memory (`/cpu:0`),
            as Keras 2's `multi_gpu_model` did, e.g. when they do not fit on
            one device.
        split: How a batch is shared among the devices: `"even"` (sizes
            differ by at most one), a list of one weight per device (sizes in
            proportion, e.g. `[2, 1]` when the first device is twice as fast),
            or `"auto"`: even at first, then in proportion to each device's
            speed measured over the first training steps (see
            `ThroughputMonitor`). The numbers stay those of one device.

    Returns:
        A `ParallelModel`, a `keras.Model` with the template's inputs, outputs
        and output names.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If the model is not built, holds a stateful RNN, or the
            devices requested do not exist (a `DeviceError`, listing the
            available devices).
        RuntimeError: In a cluster, if joining it failed (a `ClusterError`
            saying why, e.g. TensorFlow ran before `import kerasmulti`).

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(np.ones((64, 8)), np.ones((64, 3)), batch_size=16, verbose=0)
    parallel.save("model.keras")  # saves `model`, loadable without kerasmulti
    ```
    """
    if isinstance(model, keras.Model):
        _warn_overrides(unwrap(model), ("predict_step",))
    strategy = _cluster.strategy()
    if strategy is not None:
        _check_model(model)
        # Checked, though the strategy picks the devices.
        if _balance.resolve(split, _devices.resolve_devices(gpus, devices)) is not None:
            raise ValueError(
                "split= other than 'even' works in one process only (tf.distribute shares "
                "batches evenly across workers). Leave split='even'. "
                f"Received: split={split!r}"
            )
        _warn_row_mixing(unwrap(model), stacklevel=2)
        from kerasmulti import _multiworker

        return _multiworker.adopt(unwrap(model), strategy)
    return local_parallel(model, gpus, devices, cpu_merge, cpu_relocation, split)


def local_parallel(model, gpus=None, devices=None, cpu_merge=True, cpu_relocation=False, split="even") -> ParallelModel:
    """`parallelize` on this process's devices, also inside a cluster."""
    if isinstance(model, ParallelModel):
        model = model._template
    _check_model(model)
    replica_devices = _devices.resolve_devices(gpus, devices)
    proportions = _balance.resolve(split, replica_devices)
    if len(replica_devices) == 1:
        proportions = None  # nothing to share
    if len(replica_devices) > 1:
        _warn_row_mixing(model, stacklevel=3)
    if cpu_relocation:
        _relocate_to_cpu(model)
    merge_device = "/cpu:0" if cpu_merge else replica_devices[0]
    return ParallelModel(model, replica_devices, merge_device, proportions)


def _check_model(model) -> None:
    if isinstance(model, ParallelModel):
        model = model._template
    if not isinstance(model, keras.Model):
        raise TypeError(
            "parallelize() expects a keras.Model. Wrap a single layer in "
            f"keras.Sequential first. Received: model={type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            f"parallelize() needs a built model, but '{model.name}' has no weights yet. "
            "Call model.build(input_shape) or call the model on one batch first. "
            f"Received: model={model.name!r} with built=False"
        )
    _build_layers(model)
    _refuse_unsplittable(model)


def _build_layers(model) -> None:
    """Creates the weights of a model built with `build(shape)` but not yet called.

    Keras marks a subclassed model without a `build()` method built at once
    and creates its layers' weights at the first call; one device does that
    in its first step, but replicas must share weights that exist before
    they run. This is the symbolic build Keras runs under a strategy.
    """
    if all(layer.built for layer in model._flatten_layers()):
        return
    shape = (model.get_build_config() or {}).get("input_shape")
    try:
        inputs = keras.tree.map_shape_structure(lambda s: keras.KerasTensor(s, dtype=model.input_dtype), shape)
        compute_output_spec(model, inputs, training=False)
    except Exception as error:
        raise ValueError(
            f"parallelize() could not create the weights of '{model.name}' from "
            f"its build shape: {error}. Call the model on one batch of real data "
            f"first. Received: model={model.name!r} built with input_shape={shape}"
        ) from error
