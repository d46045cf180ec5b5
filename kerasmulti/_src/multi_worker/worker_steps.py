"""The template's own steps across workers, in the strategy's replica context.

A GAN's, a VAE's or the guide's `train_step` (and `test_step`,
`predict_step`, `compute_loss`) runs unchanged on every replica of the
cluster, on its part of each global batch, as `custom_steps.py` runs it on
one process's devices and with the same numbers. `tf.distribute` runs such a
step as it is, and its numbers are one device's only where the step scales
its losses for the strategy and the batch splits evenly; kerasmulti changes
these points, for the time of the step:

- losses: Keras' loss objects divide by the replica count under a strategy,
  a hand-written mean does not. Neither is scaled here: each replica's loss
  is the mean over its own rows, as on one process's replicas.
- `optimizer.apply` (and `apply_gradients`): each replica's gradients are
  multiplied by its share of the global batch's rows, then Keras' optimizer
  sums them across the replicas and applies the sum once. An optimizer built
  by its first `apply` (a GAN's) builds in cross-replica context, where the
  strategy can create its variables.
- `metric.update_state` given scalars only (a tracker given a mean loss):
  weighted by the replica's share of the rows, so that the metric's on-read
  sums add the batch's mean, once a step, as on one device. Tensors with a row per batch row add up as they are.
  `metric.result` reads the state summed over the replicas, as one device's
  metric would hold it: a step's logs are the batch's, on every replica.
- BatchNormalization is synchronised across the replicas; the gradient of
  its statistics weighs each replica's upstream by that replica's share, as
  `sync_batchnorm.py` does in one process.
- the logs: scalars times share x replicas, since Keras averages each log
  across the replicas.

A variable the step assigns itself (a step counter, a statistic of its rows)
takes the first replica's value on every replica's copy, as in one process
(the strategy would let each copy keep its own replica's). Random draws (a GAN's latent vectors, Dropout)
come from the template's seed generators, whose copies are equal on every
replica, so that with `tf.distribute` every replica draws the same numbers;
here each replica folds its index into the seed (`replica_seeds`), in Keras'
own steps too. An unseeded draw (`keras.random.normal(shape)`) would create
Keras' global seed generator inside the step, which the strategy cannot do:
it is refused, saying to pass a generator the model owns.
"""

from __future__ import annotations

import contextlib
import inspect

import keras
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel.sync_batchnorm import batchnorm_layers, share_weighted_sum
from kerasmulti._src.keras_private import loss_module
from kerasmulti._src.multi_worker import accumulation as _accumulation


def replica_rows(data):
    """The rows of this replica's part of the batch, as a scalar tensor."""
    first = next(value for value in tree.flatten(data) if value is not None)
    return tf.shape(first)[0]


def share_of_batch(rows):
    """This replica's share of the global batch's rows, its rows and the batch's (float32)."""
    rows = tf.cast(rows, "float32")
    total = tf.distribute.get_replica_context().all_reduce("sum", rows)
    return tf.math.divide_no_nan(rows, total), rows, total


def run(template, step: str, data, compiled: bool = False):
    """`template`'s `step` ("train_step", "test_step") on this replica's rows; its logs, for Keras to average.

    With `compiled`, the step's model calls run as XLA programs (`compiled_calls.py`).
    """
    share, _, _ = share_of_batch(replica_rows(data))
    with compiled_calls(template, compiled), _replica_context(template, share), _unseeded_draws_explained(template, step):
        logs = getattr(template, step)(data)
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    return tree.map_structure(lambda value: _weighted_log(value, share * replicas), logs)


def _weighted_log(value, weight):
    if not isinstance(value, (tf.Tensor, tf.Variable)) or len(value.shape) != 0 or not value.dtype.is_floating:
        return value
    return tf.math.multiply_no_nan(value, tf.cast(weight, value.dtype))


@contextlib.contextmanager
def _replica_context(template, share):
    pairs = [(o, "apply", _optimizer_apply(o, o.apply, share)) for o in _custom_steps.optimizers(template)]
    for metric in _custom_steps.metrics(template):
        pairs += [(metric, "update_state", _metric_update(metric, metric.update_state, share)),
                  (metric, "result", _cluster_result(metric, metric.result))]
    normalising = {id(v) for layer in batchnorm_layers(template) for v in layer.variables}  # synchronised
    for variable in _custom_steps.assigned_variables(template):
        if not variable.trainable and id(variable) not in normalising:
            pairs += [(variable, name, _first_replica_assign(variable, getattr(variable, name)))
                      for name in ("assign", "assign_add", "assign_sub")]
    context = tf.distribute.get_replica_context()
    pairs.append((context, "all_reduce", _share_weighted_all_reduce(context.all_reduce, share)))
    with _custom_steps.patched(pairs), _unscaled_losses(), synchronized_batchnorm(batchnorm_layers(template)), \
            replica_seeds(template):
        yield


def compiled_calls(template, compiled: bool):
    """Inside: with `compiled`, `template`'s model calls run as XLA programs on this replica."""
    return _custom_steps.patched(_compiled_calls.calls(template) if compiled else [])


def _optimizer_apply(optimizer, original, share):
    def apply(grads, trainable_variables=None):
        _compiled_calls.refuse(f"applies optimizer '{optimizer.name}'")
        grads = [_custom_steps.scaled(g, share) for g in grads]
        variables = list(trainable_variables) if trainable_variables is not None else None
        if not optimizer.built:
            tf.distribute.get_replica_context().merge_call(lambda _: _build(optimizer, variables))
        if _accumulation.accumulates(optimizer):
            return _accumulation.apply(optimizer, grads, variables)
        return original(grads, variables)

    return apply


def _first_replica_assign(variable, original):
    def assign(value, *args, **kwargs):
        context = tf.distribute.get_replica_context()
        # Cross-replica: the optimizer's update. In a compiled call: assigned after it, through here.
        if context is None or _compiled_calls.inside():
            return original(value, *args, **kwargs)
        value = tf.convert_to_tensor(value, variable.dtype)
        first = tf.equal(context.replica_id_in_sync_group, 0)  # the others' may be a mean over no rows
        return original(context.all_reduce("sum", tf.where(first, value, tf.zeros_like(value))), *args, **kwargs)

    return assign


def _build(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` as its first `apply` would."""
    with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(variables)
    optimizer.built = True


def _metric_update(metric, original, share):
    signature = inspect.signature(original)
    weighed = "sample_weight" in signature.parameters

    def update_state(*args, **kwargs):
        _compiled_calls.refuse(f"updates metric '{metric.name}'")
        bound = signature.bind(*args, **kwargs)
        values = {name: v for name, v in bound.arguments.items() if name != "sample_weight"}
        if not weighed or not all(map(_scalar, values.values())):
            return original(*args, **kwargs)
        # A scalar (a mean over this replica's rows) counts by the replica's share, or by the
        # rows where the step passes them (Keras' own steps); a replica without rows may hold a
        # mean over none (NaN).
        for name, value in values.items():
            value = tf.convert_to_tensor(value)
            bound.arguments[name] = tf.where(share > 0, value, tf.zeros_like(value))
        if bound.arguments.get("sample_weight") is None:
            bound.arguments["sample_weight"] = share
        return original(*bound.args, **bound.kwargs)

    return update_state


def _cluster_result(metric, original):
    """`metric.result`, from its state summed over the replicas (in replica context each holds its own)."""

    def result():
        _compiled_calls.refuse(f"reads metric '{metric.name}'")
        variables = [v for v in metric.variables if v.aggregation in ("sum", "mean")]
        if not variables:
            return original()
        context = tf.distribute.get_replica_context()
        reduced = [context.all_reduce(v.aggregation, tf.identity(v.value)) for v in variables]
        with keras.StatelessScope(state_mapping=list(zip(variables, reduced))):
            return original()

    return result


def _scalar(value) -> bool:
    if isinstance(value, (int, float)):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 0


def _share_weighted_all_reduce(original, share):
    """The replica context's `all_reduce`, its gradient weighing each replica's upstream by its share.

    The step's gradients are multiplied by each replica's share after the
    tape (`_optimizer_apply`), so a sum across replicas inside the forward
    pass (BatchNormalization's statistics) is differentiated as in one
    process (`sync_batchnorm.share_weighted_sum`).
    """

    def all_reduce(reduce_op, value, options=None):
        _compiled_calls.refuse("sums across the replicas (whole-batch BatchNormalization)")
        if not isinstance(value, tf.Tensor) or str(reduce_op).upper() not in ("SUM", "REDUCEOP.SUM"):
            return original(reduce_op, value, options)

        @tf.custom_gradient
        def reduce(local):
            def grad(upstream):
                return share_weighted_sum(upstream, share, lambda value: original("sum", value, options))

            return original(reduce_op, local, options), grad

        return reduce(value)

    return all_reduce


@contextlib.contextmanager
def _unscaled_losses():
    """Inside: Keras' losses are not divided by the replica count (nor their logs multiplied back)."""
    scale, unscale = loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution
    loss_module.scale_loss_for_distribution = loss_module.unscale_loss_for_distribution = _unchanged
    try:
        yield
    finally:
        loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution = scale, unscale


def _unchanged(value):
    return value


@contextlib.contextmanager
def synchronized_batchnorm(layers):
    """Inside: `layers` (BatchNormalization) compute their statistics over every replica's rows."""
    previous = [layer.synchronized for layer in layers]
    for layer in layers:
        layer.synchronized = True
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer.synchronized = value


@contextlib.contextmanager
def replica_seeds(template):
    """Inside: the template's seed generators give each replica a seed of its own (see the module docstring)."""
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    generators = [g for layer in keras_private.flatten_layers(template) for g in keras_private.seed_generators(layer)]
    with _custom_steps.patched([(g, "next", _replica_next(g.next, replica)) for g in generators]):
        yield


def _replica_next(original, replica):
    def next(ordered=True):
        seed = original(ordered)
        folded = tf.cast(tf.random.experimental.stateless_fold_in(seed, replica), seed.dtype)
        return tf.where(replica > 0, folded, seed)  # the first replica draws as one device

    return next


@contextlib.contextmanager
def _unseeded_draws_explained(template, step: str):
    try:
        yield
    except ValueError as error:
        if "singleton tf.Variables" not in str(error):
            raise
        raise ValueError(
            f"{step} of '{template.name}' made a variable on a worker (an unseeded keras.random draw does). "
            f"Pass seed=keras.random.SeedGenerator(...) made in __init__. Received: step={step!r}"
        ) from error
