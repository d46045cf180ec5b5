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
"""

from __future__ import annotations

import tensorflow as tf


def accumulates(optimizer) -> bool:
    return bool(getattr(optimizer, "gradient_accumulation_steps", None))


def check(optimizer) -> None:
    """Refuses what `apply` does not reproduce."""
    if accumulates(optimizer) and optimizer.use_ema:
        raise ValueError(
            "parallelize() across workers accumulates gradients itself (Keras' own "
            "accumulation crashes there) and does not keep use_ema's moving averages. "
            "Turn off use_ema or gradient_accumulation_steps, or train on one worker. "
            "Received: use_ema=True"
        )


def apply(optimizer, grads, variables) -> None:
    """`optimizer.apply_gradients` for an accumulating optimizer, in a replica's step."""
    context = tf.distribute.get_replica_context()
    grads, variables = optimizer._filter_empty_gradients(grads, list(variables))
    scale = optimizer.loss_scale_factor
    if scale is not None:
        grads = [g / scale for g in grads]
    # The global batch's gradient, as one process computes it: each replica's
    # gradient is that of its part of the global batch's loss.
    grads = context.all_reduce("sum", [tf.convert_to_tensor(g) for g in grads])
    steps = optimizer.gradient_accumulation_steps
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]
    sums = [g + a for g, a in zip(grads, accumulators)]
    # Keras' update branch, computed on every step (cheap, and outside the cond).
    averaged = optimizer._clip_gradients([s / steps for s in sums])
    learning_rate = optimizer.learning_rate
    context.merge_call(_update, args=(optimizer, averaged, sums, variables, accumulators, learning_rate))
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))
    optimizer._iterations.assign_add(1)


def _update(strategy, optimizer, averaged, sums, variables, accumulators, learning_rate):
    """Cross-replica: applies the averages on every k-th step, else accumulates."""
    extended = strategy.extended
    steps = optimizer.gradient_accumulation_steps

    def each(variable, fn, *args):
        extended.update(variable.value, fn, args=args, group=False)

    def update():
        if optimizer.weight_decay is not None:
            for variable in variables:
                if optimizer._use_weight_decay(variable):
                    each(variable, _decay, optimizer.learning_rate, optimizer.weight_decay)
        for grad, variable in zip(averaged, variables):
            each(variable, lambda var, g, lr: optimizer.update_step(g, var, lr), grad, learning_rate)
        for accumulator in accumulators:
            each(accumulator, lambda var: var.assign(tf.zeros_like(var)))

    def accumulate():
        for total, accumulator in zip(sums, accumulators):
            each(accumulator, lambda var, value: var.assign(value), total)

    tf.cond((optimizer._iterations + 1) % steps == 0, update, accumulate)


def _decay(variable, learning_rate, weight_decay):
    # Keras' decoupled weight decay (its `_apply_weight_decay`), on one device.
    lr = tf.cast(learning_rate, variable.dtype)
    variable.assign_sub(variable * tf.cast(weight_decay, variable.dtype) * lr)
