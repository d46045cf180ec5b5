"""Bringing objects made outside a strategy's scope into it, keeping their values.

A model, optimizer or metric made before `parallelize` (as usual) holds plain
variables, which every worker would read and update as its own; inside the
scope they are distributed, and the strategy keeps the workers' copies equal.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.keras_private import optimizers as _private_optimizers

# An adopted variable's key in optimizers, old to new: an optimizer made
# before `parallelize` names variables by key (`exclude_from_weight_decay(var_list=...)`).
_new_keys: dict = {}


def adopt_variables(variables) -> None:
    """Re-creates Keras variables in the current strategy scope, keeping their values."""
    for variable in variables:
        if not isinstance(variable.value, tf.distribute.DistributedValues):
            old = _private_optimizers.tensorflow_variable_key(variable)
            keras_private.reinitialize(variable, variable.value.read_value())
            _new_keys[old] = _private_optimizers.tensorflow_variable_key(variable)


def optimizer_in_scope(optimizer, strategy):
    """`optimizer`, re-created inside `strategy`'s scope (with its state) if it was made outside."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    keras_private.rekey_optimizer(optimizer, _new_keys)
    if keras_private.optimizer_strategy(optimizer, strategy) is strategy:
        return optimizer
    config = optimizer.get_config()
    learning_rate = keras_private.learning_rate_or_schedule(optimizer)
    if not isinstance(learning_rate, keras.Variable):
        # A schedule or a callable: shared as it is; its config may name a
        # class or a lambda that from_config cannot rebuild.
        config["learning_rate"] = learning_rate
    adopted = optimizer.__class__.from_config(config)
    _private_optimizers.carry_weight_decay_exclusions(optimizer, adopted)
    if optimizer.built:
        adopted.build(keras_private.optimizer_trainable_variables(optimizer))
        for new, old in zip(adopted.variables, optimizer.variables):
            new.assign(old)
    return adopted


def template_optimizers_in_scope(template, strategy) -> None:
    """Re-creates in `strategy`'s scope the optimizers a template keeps (a GAN's two, in a list too), made outside it."""
    adopted = {}

    def in_scope(value):
        if not isinstance(value, keras.optimizers.Optimizer):
            return value
        if id(value) not in adopted:
            adopted[id(value)] = optimizer_in_scope(value, strategy)
        return adopted[id(value)]

    for name, value in list(vars(template).items()):
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
        changed = {key: in_scope(item) for key, item in items if in_scope(item) is not item}
        if isinstance(value, tuple) and changed:
            setattr(template, name, tuple(changed.get(i, item) for i, item in enumerate(value)))
        elif isinstance(value, (dict, list)):
            for key, item in changed.items():
                value[key] = item
        elif in_scope(value) is not value:
            setattr(template, name, in_scope(value))
    # A sub-model compiled with its own optimizer (a GAN of Keras 2's style).
    for layer in keras_private.flatten_layers(template, include_self=False):
        if isinstance(layer, keras.Model) and in_scope(getattr(layer, "optimizer", None)) is not getattr(layer, "optimizer", None):
            layer.optimizer = in_scope(layer.optimizer)
