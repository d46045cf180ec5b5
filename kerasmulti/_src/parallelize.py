"""`parallelize`: the public entry, in one process or in a cluster's workers.

In one process it returns a `ParallelModel` over this machine's devices
(`data_parallel/`); in a process that joined a cluster (`cluster.py`) it
adopts the template into the cluster's strategy and returns a `WorkerModel`
(`multi_worker/`). It sits above both, so neither imports the other's way up.
"""

from __future__ import annotations

from typing import Sequence

import keras

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import devices as _devices
from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import wrap as _wrap
from kerasmulti._src.data_parallel.parallel_model import ParallelModel, unwrap
from kerasmulti._src.model_parallel.pipeline import PipelineModel
from kerasmulti._src.multi_worker import worker_model as _worker_model
from kerasmulti._src.utils.arguments import check_bool


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
    `predict_step`, `compute_loss` or `compute_metrics` (a GAN, a VAE), if
    it overrides them, runs on every replica, with one device's numbers
    where its losses are means over rows (docs/data-parallel.md, "Custom
    training steps"); a model without `call` whose parts are built is
    accepted, and `compile` takes its own signature. With BatchNormalization, train
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
            differ by at most one; None too), a list or 1-D array of one weight per device (sizes in
            proportion, e.g. `[2, 1]` when the first device is twice as fast),
            or `"auto"`: even at first, then in proportion to each device's
            speed measured over the first training steps (see
            `ThroughputMonitor`). The numbers stay those of one device.

    Returns:
        A `ParallelModel`, a `keras.Model` with the template's inputs, outputs
        and output names.

    Raises:
        TypeError: If `model` is not a `keras.Model`, or `cpu_merge` or
            `cpu_relocation` is not a bool.
        ValueError: If the model is not built, holds a stateful RNN (on two
            or more devices), or the devices requested do not exist (a
            `DeviceError`, listing the available devices); for a model from
            `pipeline` (not built yet).
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
    if isinstance(model, PipelineModel):
        raise ValueError(
            "parallelize() of a pipelined model is not built yet (docs/model-parallel.md). Pass one or the other. "
            f"Received: model={model.name!r}"
        )
    check_bool(cpu_merge, "parallelize()", "cpu_merge", "merge the replicas' outputs on the CPU")
    check_bool(cpu_relocation, "parallelize()", "cpu_relocation", "keep the variables in host memory")
    strategy = _cluster.strategy()
    if strategy is not None:
        _wrap.check_model(model)
        _devices.resolve_devices(gpus, devices)  # checked, though the strategy picks the devices
        if not (split is None or isinstance(split, str) and split == "even"):
            _balance.check_split(split)  # a value that is not one first gets its own error
            raise ValueError(
                "split= other than 'even' works in one process only. Leave split='even'. "
                f"Received: split={split!r}"
            )
        _wrap.warn_row_mixing(unwrap(model), stacklevel=2)
        return _worker_model.adopt(unwrap(model), strategy)
    return _wrap.local_parallel(model, gpus, devices, cpu_merge, cpu_relocation, split)
