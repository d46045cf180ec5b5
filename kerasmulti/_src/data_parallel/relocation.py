"""Moving a model's variables to other devices, with what refers to them.

`parallelize(cpu_relocation=True)` moves a template's variables to the host;
`pipeline(gpus=N)` moves each stage's to its stage's device. Each variable
is made anew on its device with its value (`keras_private.reinitialize`, as
Keras makes variables): the Keras variable stays the same object, its
TensorFlow variable is new. What held the old one comes along: a built
optimizer finds its variables again (Keras keys them by TensorFlow
variable), and the model's traced steps, which captured the old variables
and would go on training those, are dropped and traced again at the next
call.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import custom_steps as _custom_steps


def relocate(model: keras.Model, device_of: Callable, optimizer_device: str | None = None, sharing=()) -> None:
    """Moves each of `model`'s variables to `device_of(variable)` (None: it stays).

    Its optimizers' own variables (steps, slots) move to `optimizer_device`,
    or stay where they are with None; either way the optimizers update the
    moved variables. `sharing`: other models holding the same variables (the
    model a pipeline's cut was rebuilt from), brought along as `model` is.
    """
    for variable in model.variables:
        _move(variable, device_of(variable))
    models = [model, *sharing]
    optimizers = [o for m in models for o in _custom_steps.optimizers(m)]
    for optimizer in {id(o): o for o in optimizers}.values():
        if optimizer_device is not None:
            for variable in optimizer.variables:
                _move(variable, optimizer_device)
        for built in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if built is not None and built.built:
                keras_private.reindex_optimizer(built)
    for traced in models:
        for attribute in ("train_function", "test_function", "predict_function"):
            setattr(traced, attribute, None)


def _move(variable, device: str | None) -> None:
    if device is None or tf.DeviceSpec.from_string(variable.value.device) == _full(device):
        return
    with tf.device(device):
        keras_private.reinitialize(variable, variable.value.read_value())


def _full(device: str) -> tf.DeviceSpec:
    """`device` as TensorFlow names a variable's device (`/cpu:1` is `/job:localhost/.../device:CPU:1`)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.make_merged_spec(tf.DeviceSpec(job="localhost", replica=0, task=0))
