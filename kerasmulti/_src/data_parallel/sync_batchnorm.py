"""Synchronised BatchNormalization: replicas normalise with the whole batch's statistics.

At every BatchNormalization call the replicas sum per channel their row counts
and sums (for the mean), then their squared deviations from it (for the
variance), exactly as one device would compute them. The sums are
differentiable all-reduces, so gradients flowing through the statistics reach
every replica. Only replica 0 updates the moving statistics, once per step.
The cost is two small all-reduces per BatchNormalization layer forward and two
backward per step, and a synchronisation point at each: replicas wait for the
slowest one.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from keras import layers, ops

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.data_parallel import replicas as _replicas


def batchnorm_layers(model) -> list:
    return [
        layer
        for layer in keras_private.flatten_layers(model, include_self=False)
        if isinstance(layer, layers.BatchNormalization)
    ]


@contextlib.contextmanager
def synchronized(bn_layers: list):
    """Inside: `bn_layers` normalise with whole-batch statistics in a synchronised run."""
    for layer in bn_layers:
        layer.call = _synchronized_call(layer, type(layer).call.__get__(layer))
    try:
        yield
    finally:
        for layer in bn_layers:
            del layer.call


def _synchronized_call(layer, original):
    """A BatchNormalization `call` that normalises with whole-batch statistics."""

    def call(inputs, training=None, mask=None):
        rendezvous = _replicas.rendezvous()
        if rendezvous is None or not (training and layer.trainable):
            return original(inputs, training=training, mask=mask)
        _compiled_calls.refuse(f"holds BatchNormalization '{layer.name}' (whole-batch statistics)")
        x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        valid = ops.cast(_replicas.valid(), x.dtype)
        global_mean, variance = global_moments(layer, x, mask, lambda value: _all_reduce_sum(rendezvous, value * valid))
        if _replicas.replica_id() == 0:
            momentum = layer.momentum
            layer.moving_mean.assign(
                ops.cast(layer.moving_mean, x.dtype) * momentum
                + global_mean * (1.0 - momentum)
            )
            layer.moving_variance.assign(
                ops.cast(layer.moving_variance, x.dtype) * momentum
                + variance * (1.0 - momentum)
            )
        outputs = ops.batch_normalization(
            x=x,
            mean=global_mean,
            variance=variance,
            axis=layer.axis,
            offset=ops.cast(layer.beta, x.dtype) if layer.center else None,
            scale=ops.cast(layer.gamma, x.dtype) if layer.scale else None,
            epsilon=layer.epsilon,
        )
        return ops.cast(outputs, layer.compute_dtype)

    return call


def global_moments(layer, x, mask, reduce_sum) -> tuple:
    """The mean and variance of `x` per feature of `layer` over every replica's rows, as one device takes them.

    `reduce_sum` sums a tensor over the replicas. The mean comes first (the
    row counts and sums, one reduction), then the squared deviations from it
    (a second): E[x²] - E[x]², Keras' own `synchronized=True`, loses most of
    float32's digits where a feature's mean is large against its spread (a
    deep convnet's first layers). As Keras' `_moments`, masked elements are
    left out (`where`, so that whatever they hold cannot reach the sums) and
    a masked count gets epsilon: a wholly masked batch gives zeros, not NaN.
    """
    axes = [a for a in range(len(x.shape)) if a != layer.axis % len(x.shape)]  # all but the features
    if mask is None:
        kept, epsilon = None, 0.0
    else:
        kept = ops.cast(ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(x)), "bool")
        epsilon = keras.backend.epsilon()

    def masked(values):
        return values if kept is None else ops.where(kept, values, 0)

    totals = reduce_sum(ops.stack([ops.stop_gradient(ops.sum(masked(ops.ones_like(x)), axes)), ops.sum(masked(x), axes)]))
    count = totals[0] + epsilon
    mean = totals[1] / count
    variance = reduce_sum(ops.sum(masked(ops.square(x - _expand(mean, x, axes))), axes)) / count
    return mean, variance


def replica_context_moments(layer):
    """`layer`'s `_moments` (a BatchNormalization's statistics) taken by `global_moments` over the replicas of
    `tf.distribute`'s replica context (across workers), or Keras' own outside one."""

    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if context is None:
            return getattr(type(layer), keras_private.BATCHNORM_MOMENTS)(layer, inputs, mask)
        return global_moments(layer, inputs, mask, lambda value: context.all_reduce("sum", value))

    return moments


def _all_reduce_sum(rendezvous, value):
    """Sum over replicas, differentiable: its gradient is the sum of upstreams.

    Replica j's loss depends on replica i's activations through the shared
    statistics; summing the upstream gradients carries those cross terms back
    to every replica, as `tf.distribute`'s all-reduce does. The sum is taken
    outside the custom gradient, its gradient stopped: traced, TensorFlow walks
    back from a custom gradient's outputs to its inputs, and through the other
    replicas' values that walk would cover their whole graph so far at every
    layer (a first step growing with the square of the BatchNormalization layers).
    """
    total = tf.stop_gradient(tf.add_n(rendezvous.all_gather(value, "BatchNormalization statistics")))

    @tf.custom_gradient
    def reduce(local):
        def summed(value):
            return tf.add_n(rendezvous.all_gather(value, "a BatchNormalization gradient"))

        def grad(upstream):
            share = _replicas.gradient_share()
            if isinstance(share, float) and share == 1.0:
                return summed(upstream)
            return share_weighted_sum(upstream, share, summed)

        return tf.identity(total), grad

    return reduce(value)


def share_weighted_sum(upstream, share, summed):
    """The gradient of a sum over replicas, in a step that multiplies each replica's gradients by its share.

    Each upstream is weighed by its own replica's share before the sum
    (`summed`), and the result divided by this replica's, which the step
    multiplies back: replica j's part reaches replica i as share_j / share_i.
    """
    share = tf.cast(share, upstream.dtype)
    return tf.math.divide_no_nan(summed(upstream * share), share)


def _expand(stat, x, axes):
    for axis in sorted(a % len(x.shape) for a in axes):
        stat = ops.expand_dims(stat, axis)
    return stat
