"""The private names of Keras optimizers and variables kerasmulti uses (see `keras_private`).

Part of `keras_private`, which imports every name here: the rest of the
package reaches them through it, and `tests/test_keras_private.py` checks
each one exists with the signature kerasmulti calls it with.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

# Not imports but private attributes of a Keras optimizer: multi-worker
# gradient accumulation (`accumulation.py`) re-runs Keras' accumulating
# `apply` with its synchronisation outside the `cond` that crashes under
# MultiWorkerMirroredStrategy (keras-team/keras#20582), on the optimizer's own
# state so that its checkpoints and iterations are Keras': `_iterations`,
# `_accumulated_gradients`, `_get_variable_index`, `_filter_empty_gradients`,
# `_clip_gradients`, `_use_weight_decay`; a worker's step sums its gradients before
# Keras clips them and passes them through `_all_reduce_sum_gradients`. No public
# name reaches these. (Listed for `tests/test_keras_private.py`, not in `__all__`.)
OPTIMIZER_ATTRIBUTES = (
    "_iterations", "_accumulated_gradients", "_get_variable_index", "_filter_empty_gradients", "_clip_gradients",
    "_use_weight_decay", "_all_reduce_sum_gradients",
)

# Likewise attributes of Keras' LossScaleOptimizer (mixed precision) that
# `accumulation.py` runs its skip-or-apply and rescaling with, around the
# accumulation, since its own `apply` calls the inner optimizer's, which
# crashes: the scale and the count of finite steps are its state, undocumented
# (no underscore, but no public API), as is `check_finite`.
LOSS_SCALE_ATTRIBUTES = ("inner_optimizer", "dynamic_scale", "step_counter", "dynamic_growth_steps", "check_finite")


# TensorFlow keeps the variable creators of the function being traced per
# thread and graph (`Graph._variable_creator_stack`): through them
# `tf.function` learns that its first trace made variables, and traces again
# once they exist. A replica's thread starts with none; `tf.distribute` hands
# its replica threads the caller's (`mirrored_run._enter_graph`), and
# `custom_steps.py` hands them to the replica that builds an optimizer. No
# public name reads or sets them.
def variable_creators() -> list:
    """The variable creators of this thread in the default graph (a copy): a function's being traced, or none."""
    return list(tf.compat.v1.get_default_graph()._variable_creator_stack)


@contextlib.contextmanager
def creating_variables_with(creators: list):
    """Inside: this thread makes variables through `creators` (from `variable_creators`, on another thread)."""
    graph = tf.compat.v1.get_default_graph()
    saved = graph._variable_creator_stack
    graph._variable_creator_stack = list(creators)
    try:
        yield
    finally:
        graph._variable_creator_stack = saved


def reinitialize(variable, value) -> None:
    """Makes `variable` anew with `value` in the current device scope, as Keras does (`assign` would not move it)."""
    variable._initialize(value)


def variable_key(optimizer, variable):
    """How `optimizer` keys `variable` in its tables (`_var_key`: the TensorFlow variable), which `reinitialize` changes."""
    return optimizer._var_key(variable)


def rekey_optimizer(optimizer, keys: dict) -> None:
    """After `reinitialize`: `keys` (old to new) in every table `optimizer` keys by variable, and its inner ones'.

    `_trainable_variables_indices`, a MultiOptimizer's `_var_to_optimizer_idx`,
    the `_exclude_from_weight_decay` set, and the latter's cache (dropped).
    """
    inner = [getattr(optimizer, "inner_optimizer", None), *getattr(optimizer, "_inner_optimizers", [])]
    for part in [optimizer] + [o for o in inner if o is not None]:
        for name in ("_trainable_variables_indices", "_var_to_optimizer_idx"):
            if isinstance(getattr(part, name, None), dict):
                setattr(part, name, {keys.get(k, k): index for k, index in getattr(part, name).items()})
        if isinstance(getattr(part, "_exclude_from_weight_decay", None), set):
            part._exclude_from_weight_decay = {keys.get(k, k) for k in part._exclude_from_weight_decay}
        vars(part).pop("_exclude_from_weight_decay_cache", None)


def optimizer_strategy(optimizer, default):
    """The `tf.distribute` strategy an optimizer's variables were made under."""
    return getattr(optimizer, "_distribution_strategy", default)


def learning_rate_or_schedule(optimizer):
    """The learning rate as given, a variable, schedule or callable (`_learning_rate`; the property evaluates it)."""
    return optimizer._learning_rate


def optimizer_trainable_variables(optimizer) -> list:
    """The variables an optimizer was built for, in its order (`_trainable_variables`)."""
    return list(optimizer._trainable_variables)


def optimizer_iterations(optimizer):
    """The step counter variable itself (`_iterations`); `iterations` may be a read value under a strategy."""
    return optimizer._iterations


def accumulators(optimizer, variables) -> list:
    """The gradient-accumulation buffers of `variables` (`_accumulated_gradients`)."""
    return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]


def filter_empty_gradients(optimizer, grads, variables):
    """Drops None gradients as `apply` does, warning as Keras warns."""
    return optimizer._filter_empty_gradients(grads, variables)


def clip_gradients(optimizer, grads):
    """Applies the optimizer's `clipnorm` / `clipvalue` / `global_clipnorm` as `apply` does."""
    return optimizer._clip_gradients(grads)


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether weight decay applies to `variable` (its exclusions honoured)."""
    return optimizer._use_weight_decay(variable)


def sum_gradients_with(optimizer, function) -> None:
    """Sets how `optimizer` sums gradients across replicas (`_all_reduce_sum_gradients`); None: as Keras does."""
    if function is None:
        del optimizer._all_reduce_sum_gradients
    else:
        optimizer._all_reduce_sum_gradients = function


def carry_weight_decay_exclusions(source, target) -> None:
    """Gives `target`, `source` re-created from its config, `source`'s `exclude_from_weight_decay` choices.

    Keras keeps them outside the config (`_exclude_from_weight_decay`: variable
    keys; `_exclude_from_weight_decay_pattern`: the names, compiled), so
    `from_config` drops them; `exclude_from_weight_decay` itself takes
    variables, not keys. A LossScaleOptimizer's inner optimizer's carry over too.
    """
    pairs = [(source, target)]
    if hasattr(source, "inner_optimizer") and hasattr(target, "inner_optimizer"):
        pairs.append((source.inner_optimizer, target.inner_optimizer))
    for old, new in pairs:
        for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
            if hasattr(old, name):
                value = getattr(old, name)
                setattr(new, name, set(value) if isinstance(value, set) else value)
        vars(new).pop("_exclude_from_weight_decay_cache", None)


def tensorflow_variable_key(variable):
    """The key TensorFlow's Keras optimizers file `variable` under, before any optimizer exists.

    `Optimizer._var_key` reads nothing of its optimizer (the TensorFlow
    variable's `_unique_id`), so it runs unbound: variables re-created in a
    strategy's scope get new keys, which `rekey_optimizer` maps.
    """
    import keras

    return keras.optimizers.Optimizer._var_key(None, variable)
