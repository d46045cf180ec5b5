"""Keras' gradient accumulation in multi-worker training.

`Optimizer(gradient_accumulation_steps=k)` sums the gradients of k steps and
applies their average on every k-th. Keras decides which with a `cond` in the
replica's step whose branches synchronise (the update all-reduces and merges),
and `MultiWorkerMirroredStrategy` cannot merge inside a `cond`: the step fails
with "`merge_call` called while defining a new graph" (keras-team/keras#20582).

`apply` is the same algorithm with the synchronisation moved out of the
`cond`: every step all-reduces its gradient (so the accumulators hold the
global batch's, identical on every replica), then one `merge_call` runs the
`cond` in cross-replica context, where the update and the accumulators'
assignments are per-device `extended.update`s with nothing to merge. The
accumulators, iterations, clipping, weight decay, constraints and learning
rate are the optimizer's own, in Keras' order, so the weights and the
optimizer's state (checkpoints mid-accumulation included) are those of one
process with the same optimizer on the whole batches.

Mixed precision's `LossScaleOptimizer` around an accumulating optimizer
(compile wraps one under "mixed_float16") is Keras' too: the step is skipped
and the scale halved when the global batch's gradient is not finite, the scale
doubles after `dynamic_growth_steps` finite steps, and the inner optimizer
accumulates the unscaled gradients. Variables overwritten with their gradient
(Keras' float8 scales) are refused: their "gradients" are per-replica values
that a sum across replicas would corrupt.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasmulti._src import keras_private


def _scaler(optimizer):
    """The LossScaleOptimizer around the accumulating optimizer, or None."""
    return optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def _inner(optimizer):
    return optimizer.inner_optimizer if _scaler(optimizer) else optimizer


def accumulates(optimizer) -> bool:
    return bool(getattr(_inner(optimizer), "gradient_accumulation_steps", None))


def check(optimizer, variables=()) -> None:
    """Refuses what `apply` does not reproduce (at compile, and again when the step traces)."""
    if not accumulates(optimizer):
        return
    if _inner(optimizer).use_ema:
        raise ValueError(
            "Gradient accumulation across workers does not keep use_ema's moving averages. "
            "Turn off use_ema or gradient_accumulation_steps, or train on one worker. "
            "Received: use_ema=True"
        )
    overwritten = [v.path for v in variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise ValueError(
            "Gradient accumulation across workers cannot overwrite variables with their "
            f"gradient ({', '.join(overwritten)}). Turn off gradient_accumulation_steps or float8, or use one worker. "
            "Received: overwrite_with_gradient=True"
        )


def apply(optimizer, grads, variables=None) -> None:
    """`optimizer.apply(grads, variables)` for an accumulating optimizer, in a replica's step.

    Without `variables`, the variables the optimizer was built for, as Keras' `apply`.
    """
    context = tf.distribute.get_replica_context()
    if variables is None:
        variables = _built_for(optimizer, grads)
    check(optimizer, variables)  # variables a model built after compile created
    scaler, optimizer = _scaler(optimizer), _inner(optimizer)
    grads, variables = keras_private.filter_empty_gradients(optimizer, grads, list(variables))
    scale = optimizer.loss_scale_factor
    if scale is not None:
        grads = [g / scale for g in grads]
    # The global batch's gradient, as one process computes it: each replica's
    # gradient is that of its part of the global batch's loss.
    grads = context.all_reduce("sum", [tf.convert_to_tensor(g) for g in grads])
    # Keras' LossScaleOptimizer: a step applies only if the (global) gradient is
    # finite, after unscaling it by the dynamic scale.
    finite = scaler.check_finite(grads) if scaler else tf.constant(True)
    if scaler:
        grads = [g / tf.cast(scaler.dynamic_scale, g.dtype) for g in grads]
    steps = optimizer.gradient_accumulation_steps
    accumulators = keras_private.accumulators(optimizer, variables)
    sums = [g + a for g, a in zip(grads, accumulators)]
    # Keras' update branch, computed on every step (cheap, and outside the cond).
    averaged = keras_private.clip_gradients(optimizer, [s / steps for s in sums])
    learning_rate = optimizer.learning_rate
    context.merge_call(_update, args=(scaler, finite, optimizer, averaged, sums, variables, accumulators, learning_rate))
    # A skipped step (non-finite gradient) leaves the variables and iterations.
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(tf.where(finite, variable.constraint(variable), variable))
    iterations = keras_private.optimizer_iterations(optimizer)
    iterations.assign_add(tf.cast(finite, iterations.dtype))


def _built_for(optimizer, grads) -> list:
    variables = keras_private.optimizer_trainable_variables(_inner(optimizer))
    if len(grads) != len(variables):
        raise ValueError(
            f"optimizer.apply(grads) without variables needs a gradient for each of the {len(variables)} variables "
            "the optimizer was built for, in their order. Pass the variables too: "
            f"optimizer.apply(grads, variables). Received: len(grads)={len(grads)}"
        )
    return variables


def _update(strategy, scaler, finite, optimizer, averaged, sums, variables, accumulators, learning_rate):
    """Cross-replica: applies the averages on every k-th step, else accumulates;
    under a LossScaleOptimizer, only for a finite gradient, then adjusts the scale."""
    if scaler is None:
        return _step(strategy, optimizer, averaged, sums, variables, accumulators, learning_rate)

    def applied():
        _step(strategy, optimizer, averaged, sums, variables, accumulators, learning_rate)
        grow = scaler.step_counter == scaler.dynamic_growth_steps - 1
        tf.cond(grow, lambda: _rescale(scaler, 2.0), lambda: _count(scaler))

    # Every replica's all-reduced gradient, so its finiteness, is the same.
    tf.cond(strategy.experimental_local_results(finite)[0], applied, lambda: _rescale(scaler, 0.5))


def _rescale(scaler, factor):
    scaler.step_counter.assign(0)
    scaler.dynamic_scale.assign(scaler.dynamic_scale * factor)


def _count(scaler):
    scaler.step_counter.assign_add(1)


def _step(strategy, optimizer, averaged, sums, variables, accumulators, learning_rate):
    extended = strategy.extended
    steps = optimizer.gradient_accumulation_steps

    def each(variable, fn, *args):
        extended.update(variable.value, fn, args=args, group=False)

    def update():
        if optimizer.weight_decay is not None:
            for variable in variables:
                if keras_private.uses_weight_decay(optimizer, variable):
                    each(variable, _decay, optimizer.learning_rate, optimizer.weight_decay)
        for grad, variable in zip(averaged, variables):
            each(variable, lambda var, g, lr: optimizer.update_step(g, var, lr), grad, learning_rate)
        # Every accumulator, as Keras: a variable left out of this step (frozen
        # meanwhile) must not keep a partial sum to apply once it trains again.
        for accumulator in keras_private.accumulators(optimizer, keras_private.optimizer_trainable_variables(optimizer)):
            each(accumulator, lambda var: var.assign(tf.zeros_like(var)))

    def accumulate():
        for total, accumulator in zip(sums, accumulators):
            each(accumulator, lambda var, value: var.assign(value), total)

    tf.cond((keras_private.optimizer_iterations(optimizer) + 1) % steps == 0, update, accumulate)


def _decay(variable, learning_rate, weight_decay):
    # Keras' decoupled weight decay (its `_apply_weight_decay`), on one device.
    lr = tf.cast(learning_rate, variable.dtype)
    variable.assign_sub(variable * tf.cast(weight_decay, variable.dtype) * lr)
