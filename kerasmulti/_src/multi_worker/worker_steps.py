"""The template's own steps across workers, in the strategy's replica context.

A GAN's, a VAE's or the guide's `train_step` (and `test_step`, `predict_step`, `compute_loss`) runs
unchanged on every replica of the cluster, on its part of each global batch, as `custom_steps.py` runs
it on one process's devices and with the same numbers. `tf.distribute` runs such a step as it is, and
its numbers are one device's only where the step scales its losses for the strategy and the batch splits
evenly; kerasmulti changes these points, for the time of the step:

- losses: Keras' loss objects divide by the replica count under a strategy, a hand-written mean does
  not. Neither is scaled here: each replica's loss is the mean over its own rows, as on one process's
  replicas.
- `optimizer.apply` (and `apply_gradients`): each replica's gradients are multiplied by its share of the
  global batch's rows (by `scale_loss`, if the step calls it: mixed precision's scaled loss) and summed
  across the replicas; Keras' optimizer then clips the sum, checks it finite (mixed precision) and
  applies it, as one process does (`apply_summed`). An optimizer built by its first `apply` (a GAN's)
  builds in cross-replica context, where the strategy can create its variables.
- `metric.update_state` given scalars only (a tracker given a mean loss): the replicas' values are
  merged as in one process (averaged by the shares; a scalar `sample_weight`, Keras' row count, summed),
  and the first replica makes the one update. Tensors with a row per batch row add up as they are.
  `metric.result` reads the state summed over the replicas, as one device's metric would hold it: a
  step's logs are the batch's, on every replica.
- BatchNormalization is synchronised across the replicas; the gradient of its statistics weighs each
  replica's upstream by that replica's share, as `sync_batchnorm.py` does in one process.
- the logs: Keras averages each across the replicas, so a scalar is weighted by the shares and any other
  log is the first replica's, as in one process.

A variable the step assigns itself (a step counter, a statistic of its rows) takes the first replica's
value on every replica's copy, as in one process (the strategy would let each copy keep its own
replica's). Random draws (a GAN's latent vectors, Dropout) come from the template's seed generators,
whose copies are equal on every replica, so that with `tf.distribute` every replica draws the same
numbers; here each replica adds its index to the seed (as the compiled step's replicas do), in Keras'
own steps too. An unseeded draw (`keras.random.normal(shape)`) would create Keras' global seed generator
inside the step, which the strategy cannot do: it is refused, saying to pass a generator the model owns.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import keras
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import step_merging as _step_merging
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm
from kerasmulti._src.data_parallel.sync_batchnorm import batchnorm_layers, share_weighted_sum
from kerasmulti._src.keras_private import loss_module
from kerasmulti._src.multi_worker import accumulation as _accumulation
from kerasmulti._src.utils import patching as _patching


def replica_rows(data):
    """The rows of this replica's part of the batch, as a scalar tensor."""
    first = next(value for value in tree.flatten(data) if value is not None)
    return tf.shape(first)[0]


def share_of_batch(data):
    """This replica's share of the global batch's rows, its rows and the batch's (float32)."""
    rows = tf.cast(replica_rows(data), "float32")
    total = tf.distribute.get_replica_context().all_reduce("sum", rows)
    return tf.math.divide_no_nan(rows, total), rows, total


def run(template, step: str, data, compiled: bool = False):
    """`template`'s `step` ("train_step", "test_step") on this replica's rows; its logs, for Keras to average.

    With `compiled`, the step's model calls run as XLA programs (`compiled_calls.py`).
    """
    share, _, _ = share_of_batch(data)
    _replica.share = share
    context = tf.distribute.get_replica_context()
    meets = _share_weighted_all_reduce(context.all_reduce, share)  # this replica's own context
    with _for_the_worker(("step", id(template)), lambda: _patches(template, compiled)), \
            _patching.patched([(context, "all_reduce", meets)]), _unseeded_draws_explained(template, step):
        logs = getattr(template, step)(data)
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float32)
    return tree.map_structure(lambda value: _weighted_log(value, share, first, context.num_replicas_in_sync), logs)


class WorkerSteps:
    """Runs a template's own steps on a replica of the cluster's strategy (as `custom_steps.CustomSteps` in one process)."""

    def __init__(self, template):
        self._template = template
        self.overridden = _custom_steps.overridden(template)
        self.compiles = False  # the model calls, with XLA (`compiled_calls`)

    def run(self, step: str, data):
        return run(self._template, step, data, self.compiles)

    def predict(self, data):
        with predicting(self._template, self.compiles):
            return self._template.predict_step(data)


def keras_step(template, batchnorm: list):
    """Inside Keras' own step on a replica: `batchnorm` synchronised, the seeds the replica's (`_replica_seeds`)."""
    return _for_the_worker(("keras step", id(template)), lambda: _entered(_synchronized_batchnorm(batchnorm), _replica_seeds(template)))


def whole_batch_results(metrics: list):
    """Inside Keras' own step on a replica: `metrics`' results are the cluster's, so the step's logs are the batch's."""
    patches = lambda: _patching.patched([(m, "result", _cluster_result(m, m.result)) for m in metrics])  # noqa: E731
    return _for_the_worker(("results", *map(id, metrics)), patches)


def predicting(template, compiled: bool):
    """Inside the template's own `predict_step` on a replica: its seeds, and with `compiled` its model calls compiled."""
    return _for_the_worker(("predict", id(template)), lambda: _entered(_replica_seeds(template), _compiled_calls_of(template, compiled)))


_replica = threading.local()  # this replica thread's share of the batch
_installing = threading.Lock()
_installations: dict = {}  # key: [replicas inside, the open context]


@contextlib.contextmanager
def _for_the_worker(key, make):
    """Inside: the context `make()` opens, once for all the worker's replicas (its GPUs', each on a thread).

    The first replica in enters it and the last out leaves it: the patches it sets
    are on objects every replica shares, so they must not be set once a replica.
    """
    with _installing:
        entry = _installations.setdefault(key, [0, None])
        if entry[0] == 0:
            entry[1] = make()
            entry[1].__enter__()
        entry[0] += 1
    try:
        yield
    finally:
        with _installing:
            entry[0] -= 1
            if entry[0] == 0:
                del _installations[key]
                entry[1].__exit__(None, None, None)


@contextlib.contextmanager
def _entered(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _share():
    return _replica.share


def _weighted_log(value, share, first, replicas):
    """A log times replicas x its weight, Keras averaging it: a scalar by the share, others the first replica's."""
    if not isinstance(value, (tf.Tensor, tf.Variable)) or not value.dtype.is_floating:
        return value
    if value.shape.rank is None:  # tf.numpy_function's: a scalar or not only when it runs
        weight = tf.where(tf.equal(tf.rank(value), 0), tf.cast(share, tf.float32), tf.cast(first, tf.float32))
    else:
        weight = share if value.shape.rank == 0 else first
    return tf.math.multiply_no_nan(value, tf.cast(weight * replicas, value.dtype))


@contextlib.contextmanager
def _patches(template, compiled: bool):
    """The points of a step where the replicas meet (see the module docstring), for every replica of the worker."""
    scaled_already = set()  # (optimizer, replica) whose `scale_loss` multiplied the loss by the share
    pairs = []
    for optimizer in _custom_steps.optimizers(template):
        scale_loss = _custom_steps.scale_loss_by_share(optimizer, optimizer.scale_loss, _share, scaled_already)
        pairs += [(optimizer, "apply", _optimizer_apply(optimizer, optimizer.apply, scaled_already)),
                  (optimizer, "scale_loss", scale_loss)]
    for metric in _custom_steps.metrics(template):
        pairs += [(metric, "update_state", _metric_update(metric, metric.update_state)),
                  (metric, "result", _cluster_result(metric, metric.result))]
    normalising = {id(v) for layer in batchnorm_layers(template) for v in layer.variables}  # synchronised
    for variable in _custom_steps.assigned_variables(template):
        if not variable.trainable and id(variable) not in normalising:
            pairs += [(variable, name, _first_replica_assign(variable, getattr(variable, name)))
                      for name in ("assign", "assign_add", "assign_sub")]
    with _compiled_calls_of(template, compiled), _patching.patched(pairs), _unscaled_losses(), \
            _synchronized_batchnorm(batchnorm_layers(template)), _replica_seeds(template):
        yield


def _compiled_calls_of(template, compiled: bool):
    """Inside: with `compiled`, `template`'s model calls run as XLA programs on this replica."""
    return _compiled_calls.compiled(_compiled_calls.units(template) if compiled else [])


def _optimizer_apply(optimizer, original, scaled_already: set):
    def apply(grads, trainable_variables=None):
        _compiled_calls.refuse(f"applies optimizer '{optimizer.name}'")
        if (id(optimizer), _replicas.replica_id()) not in scaled_already:
            grads = [_custom_steps.scaled(g, _share()) for g in grads]
        variables = list(trainable_variables) if trainable_variables is not None else None
        if not optimizer.built:
            if variables is None:
                raise ValueError(
                    f"Optimizer '{optimizer.name}' is not built: pass apply() the variables, or build it first. "
                    "Received: trainable_variables=None"
                )
            tf.distribute.get_replica_context().merge_call(lambda _: _build(optimizer, variables))
        if _accumulation.accumulates(optimizer):
            return _accumulation.apply(optimizer, grads, variables)
        return apply_summed(optimizer, original, grads, variables)

    return apply


def apply_summed(optimizer, apply, grads, variables):
    """`apply(grads, variables)` (of `optimizer`) with the replicas' gradients summed first.

    Keras' optimizer clips the gradient, and under mixed precision checks it
    finite, before it sums it across the replicas: each replica would clip
    its own part, and a part that overflows on one worker only would send
    that worker alone into the update's all-reduce (a hang). Summed first,
    every replica holds the global batch's gradient, as one process does,
    and the optimizer passes it through instead of summing it again.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    summed = [_split.dense_unless_per_lookup(grads[i]) for i in present]  # a position embedding's rows
    summed = tf.distribute.get_replica_context().all_reduce("sum", summed) if present else []
    grads = list(grads)
    for i, g in zip(present, summed):
        grads[i] = g
    optimizers = [optimizer] + ([optimizer.inner_optimizer] if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else [])
    with _for_the_worker(("summed", id(optimizer)), lambda: _sums_passed_through(optimizers)):
        return apply(grads, variables)


@contextlib.contextmanager
def _sums_passed_through(optimizers):
    """Inside: `optimizers` pass gradients through instead of summing them across the replicas."""
    for optimizer in optimizers:
        keras_private.sum_gradients_with(optimizer, list)
    try:
        yield
    finally:
        for optimizer in optimizers:
            keras_private.sum_gradients_with(optimizer, None)


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
    """Builds `optimizer` for `variables` as its first `apply` would, its variables made outside the step's graph."""
    with tf.init_scope(), keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(variables)
    optimizer.built = True


def _metric_update(metric, original):
    signature = inspect.signature(original)

    def update_state(*args, **kwargs):
        _compiled_calls.refuse(f"updates metric '{metric.name}'")
        bound = signature.bind(*args, **kwargs)
        given = {name: value for name, value in bound.arguments.items() if value is not None}
        if not given or not all(map(_scalar, given.values())):
            return original(*args, **kwargs)  # a row per batch row: the replicas' rows add up
        # Scalars only (a tracker given a mean loss): merged as one process merges them
        # (`custom_steps`), and the update made once, by the first replica.
        context, share = tf.distribute.get_replica_context(), _share()
        for name, value in given.items():
            weight = tf.cast(share > 0, tf.float32) if name == "sample_weight" else share  # Keras passes rows
            value = tf.convert_to_tensor(value)
            part = tf.where(weight > 0, tf.cast(value, tf.float32) * weight, 0.0)  # a mean over no rows: NaN
            bound.arguments[name] = tf.cast(context.all_reduce("sum", part), value.dtype)

        def update():
            original(*bound.args, **bound.kwargs)
            return tf.constant(True)

        tf.cond(tf.equal(context.replica_id_in_sync_group, 0), update, lambda: tf.constant(False))

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
    return isinstance(value, (int, float)) or _step_merging.rank(value) == 0


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


def _synchronized_batchnorm(layers):
    """Inside: `layers` (BatchNormalization) take their statistics over every replica's rows, as one device would
    (Keras' own `synchronized=True` loses digits: `sync_batchnorm.global_moments`)."""
    moments = keras_private.BATCHNORM_MOMENTS
    return _patching.patched([(layer, moments, _sync_batchnorm.replica_context_moments(layer)) for layer in layers])


@contextlib.contextmanager
def _replica_seeds(template):
    """Inside: the template's seed generators give each replica a seed of its own (see the module docstring)."""
    generators = [g for layer in keras_private.flatten_layers(template) for g in keras_private.seed_generators(layer)]
    with _patching.patched([(g, "next", _replica_next(g.next)) for g in generators]):
        yield


def _replica_next(original):
    def next(ordered=True):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return _replicas.seed_of_replica(original(ordered), replica)  # as the compiled step's replicas

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
