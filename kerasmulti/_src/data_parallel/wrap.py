"""Wraps a template in a `ParallelModel` over this process's devices, after checking it.

Models that cannot be split (stateful RNNs, batch renormalisation) are
refused here, before anything is traced; `check_model` and
`warn_row_mixing` serve the multi-worker path of `parallelize` too.
"""

from __future__ import annotations

import warnings

import keras

from kerasmulti._src import devices as _devices
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import relocation as _relocation
from kerasmulti._src.data_parallel.local_model import LocalParallelModel
from kerasmulti._src.data_parallel.parallel_model import ParallelModel
from kerasmulti._src.keras_private import compute_output_spec


def _refuse_unsplittable(model, caller: str) -> None:
    for layer in keras_private.flatten_layers(model, include_self=False):
        if getattr(layer, "stateful", False):
            # Its state carries over row by row from one batch to the next,
            # and replicas see different rows.
            raise ValueError(
                f"{caller} cannot split the stateful layer '{layer.name}' "
                f"({type(layer).__name__}). Use stateful=False or one device{', or microbatches=1' if 'pipeline' in caller else ''}. "
                f"Received: layer={layer.name!r} with stateful=True"
            )
        if isinstance(layer, keras.layers.BatchNormalization) and layer.renorm:
            # Its correction terms are not synchronised across replicas.
            raise ValueError(
                f"{caller} does not support batch renormalisation (layer "
                f"'{layer.name}'). Use renorm=False or one device. "
                f"Received: layer={layer.name!r} with renorm=True"
            )


# Keras layers whose output for a row depends on other rows of the batch
# (besides BatchNormalization, which replicas synchronise).
_ROW_MIXING = ("MixUp", "CutMix")


def warn_row_mixing(model, stacklevel, part: str = "replica's sub-batch") -> None:
    for layer in keras_private.flatten_layers(model, include_self=False):
        if type(layer).__name__ in _ROW_MIXING and type(layer).__module__.startswith("keras."):
            warnings.warn(
                f"Layer '{layer.name}' ({type(layer).__name__}) mixes rows only within each "
                f"{part}, unlike on one device. Apply it in the input pipeline. "
                f"Received: layer={layer.name!r}",
                stacklevel=stacklevel + 1,
            )


def local_parallel(model, gpus=None, devices=None, cpu_merge=True, cpu_relocation=False, split="even") -> LocalParallelModel:
    """`parallelize` on this process's devices, also inside a cluster."""
    if isinstance(model, ParallelModel):
        model = model._template
    replica_devices = _devices.resolve_devices(gpus, devices)
    check_model(model, replicas=len(replica_devices))
    proportions = _balance.resolve(split, replica_devices)
    if len(replica_devices) == 1:
        proportions = None  # nothing to share
    if len(replica_devices) > 1:
        warn_row_mixing(model, stacklevel=3)
    if cpu_relocation:
        _relocation.relocate(model, lambda variable: "/cpu:0", optimizer_device="/cpu:0")
    merge_device = "/cpu:0" if cpu_merge else replica_devices[0]
    parallel = LocalParallelModel(model, replica_devices, merge_device, proportions)
    parallel._template_on_host = cpu_relocation
    # A template that comes compiled (loaded from a .keras file) makes a compiled
    # parallel model, optimizer state and all: `if not parallel.compiled` tells the truth.
    parallel._adopt_template_compile()
    return parallel


def check_model(model, caller: str = "parallelize()", replicas: int = 2) -> None:
    """Refuses what cannot be parallelized; on one device (`replicas=1`) a model whose rows cannot be split is fine."""
    if isinstance(model, ParallelModel):
        model = model._template
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{caller} expects a keras.Model. Wrap a layer in "
            f"keras.Sequential first. Received: model={type(model).__name__}"
        )
    if not model.built and _custom_steps.overridden(model) and _custom_steps.parts_built(model):
        # A GAN holding a generator and a discriminator has no call, a
        # distiller is built at its first step: their parts have weights.
        if replicas > 1:
            _refuse_unsplittable(model, caller)
        return
    if not model.built:
        raise ValueError(
            f"{caller} needs a built model. Call it on one batch (a GAN: each model it holds) or model.build(input_shape). "
            f"Received: model={model.name!r} with built=False"
        )
    _build_layers(model, caller)
    if replicas > 1:
        _refuse_unsplittable(model, caller)


def _build_layers(model, caller: str) -> None:
    """Creates the weights of a model built with `build(shape)` but not yet called.

    Keras marks a subclassed model without a `build()` method built at once
    and creates its layers' weights at the first call; one device does that
    in its first step, but replicas must share weights that exist before
    they run. This is the symbolic build Keras runs under a strategy.
    """
    if all(layer.built for layer in keras_private.flatten_layers(model)):
        return
    shape = (model.get_build_config() or {}).get("input_shape")
    try:
        if isinstance(model, keras_private.Functional):  # its own inputs (layers without weights may wait to be built)
            inputs = model.input
        else:
            inputs = keras.tree.map_shape_structure(lambda s: keras.KerasTensor(s, dtype=model.input_dtype), shape)
        compute_output_spec(model, inputs, training=False)
    except Exception as error:
        raise ValueError(
            f"{caller} could not create the weights of '{model.name}' from "
            f"its build shape: {error}. Call it on one batch of real data. Received: model={model.name!r} built with input_shape={shape}"
        ) from error
