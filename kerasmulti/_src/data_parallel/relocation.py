"""Moving a model's variables to other devices, with what refers to them.

`parallelize(cpu_relocation=True)` moves a template's variables to the host;
`pipeline(gpus=N)` moves each stage's to its stage's device. Each variable
is made anew on its device with its value (`keras_private.reinitialize`, as
Keras makes variables): the Keras variable stays the same object, its
TensorFlow variable is new. What held the old one comes along: an
optimizer's tables keyed by TensorFlow variable (its index of variables, a
`MultiOptimizer`'s map, weight-decay exclusions) are re-keyed, and the
model's traced steps, which captured the old variables and would go on
training those, are dropped and traced again at the next call.
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
    models = [model, *sharing]
    optimizers = list({id(o): o for m in models for o in _custom_steps.optimizers(m)}.values())
    moving = [(v, device_of(v)) for v in model.variables]
    moving = [(v, device) for v, device in moving if device is not None and not _on(v, device)]
    before = [[keras_private.variable_key(o, v) for v, _ in moving] for o in optimizers]
    for variable, device in moving:
        _move(variable, device)
    for optimizer, keys in zip(optimizers, before):
        if optimizer_device is not None:
            for variable in optimizer.variables:
                if not _on(variable, optimizer_device):
                    _move(variable, optimizer_device)
        after = [keras_private.variable_key(optimizer, v) for v, _ in moving]
        keras_private.rekey_optimizer(optimizer, dict(zip(keys, after)))
    for traced in models:
        for attribute in ("train_function", "test_function", "predict_function"):
            setattr(traced, attribute, None)


def _move(variable, device: str) -> None:
    with tf.device(device):
        keras_private.reinitialize(variable, variable.value.read_value())


def _on(variable, device: str) -> bool:
    """Whether `variable` lives on `device` (`/cpu:1` is `/job:localhost/.../device:CPU:1` there)."""
    wanted = tf.DeviceSpec.from_string(device).make_merged_spec(tf.DeviceSpec(job="localhost", replica=0, task=0))
    return tf.DeviceSpec.from_string(variable.value.device) == wanted
