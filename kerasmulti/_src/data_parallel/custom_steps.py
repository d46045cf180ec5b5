"""The template's own `train_step`, `test_step`, `predict_step` and `compute_loss`, data-parallel.

A GAN, a VAE, a distiller or any model written as Keras' guide "Customizing
what happens in fit()" shows keeps its training in its own step. Such a step
runs here per replica, as `tf.distribute` runs it in its replica context: every
replica runs the template's step unchanged on its rows, on its device's thread
(`replicas.run`, synchronised), and kerasmulti handles the points where one
device would see the whole batch (`tf.distribute.get_replica_context()` is
TensorFlow's default there: its `all_reduce` reaches no other replica):

- `optimizer.apply` (and `apply_gradients`, which calls it): the replicas'
  gradients, each multiplied by its replica's share of the rows, are summed
  and applied once, so a loss that is a mean over the batch's rows gives one
  device's gradient (terms that do not depend on the rows, such as weight
  regularisers, too: the shares sum to 1). Every replica then goes on with the
  new weights: two optimizers in one step (a GAN's) each step once.
- `metric.update_state`: the replicas' arguments are merged and one update
  is made (`step_merging.py`: rows joined, a mean loss averaged by the
  shares). A `Mean` tracker then holds the whole batch's mean, on uneven
  splits too.
- variables the step assigns itself (a step counter) are assigned by the
  first replica only, as `tf.distribute` does for `aggregation=
  "only_first_replica"`: a counter counts steps, not steps x replicas.
- the logs the step returns are averaged by the shares (`step_merging.py`):
  a metric's result is the same on every replica, and a per-replica mean
  loss becomes the batch's.

So the numbers are one device's where the step's losses are means over the
batch's rows (Keras' default reduction); a loss summed over rows counts each
replica's part by its share. Random draws inside the step (a GAN's latent
vectors, Dropout) are each replica's own, as with `tf.distribute`. Nested
tapes (a gradient penalty) run inside each replica, so they need nothing.
The step's meeting points span the devices, so a replica's step is not one
XLA program; with `jit_compile`, its model calls are (`compiled_calls.py`).

The other design, running the step once and splitting each model call
inside it, was not taken: TensorFlow places the backward pass of a tape's
gradient on the default device, not on each replica's (the merged-output
backward measured 0.68x one device on two simulated devices), and a custom
gradient that would place it breaks second-order gradients.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import step_merging as _step_merging
from kerasmulti._src.data_parallel.packed_apply import PackedApply, build_optimizer
from kerasmulti._src.keras_private import optimizers as _private_optimizers
from kerasmulti._src.utils.nesting import Nesting
from kerasmulti._src.utils.patching import patched

# The steps a template may override that this module runs for it.
STEPS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")

_updating_for_all = Nesting()  # per replica thread: inside an update made for all replicas (nested calls pass)


class _Run:
    """The step being traced: read by its replica threads (one step traces at a time)."""

    shares: list = []
    shards: list = []
    merge_device: str = "/cpu:0"
    creators: list = []  # the tracing thread's variable creators (`_build_in_step`)


_run = _Run()


def overridden(template: keras.Model) -> list[str]:
    """The steps `template`'s class overrides, in `STEPS` order."""
    return [name for name in STEPS if getattr(type(template), name, None) is not getattr(keras.Model, name)]


def parts_built(template: keras.Model) -> bool:
    """Whether every layer of `template` but itself has its weights (a GAN's networks)."""
    layers = keras_private.flatten_layers(template, include_self=False)
    return bool(layers) and all(layer.built for layer in layers)


def scaled(gradient, share):
    """`gradient` times a replica's share of the rows; 0 for a share of 0, even where it is not finite.

    A replica without rows (across workers) may hold the gradient of a mean over no rows.
    """
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.math.multiply_no_nan(gradient.values, tf.cast(share, gradient.values.dtype))
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return tf.math.multiply_no_nan(gradient, tf.cast(share, gradient.dtype))


def scale_loss_by_share(optimizer, original, share_of_replica, scaled_already: set):
    """`optimizer.scale_loss`, also multiplying by the replica's share; its gradients then are.

    A replica's gradient of its own mean is 1 / share times its part of the
    batch's: under mixed precision it would overflow where one device's does
    not. `scaled_already` notes (optimizer, replica) for `apply`.
    """

    def scale_loss(loss):
        if _updating_for_all.inside():
            return original(loss)
        scaled_already.add((id(optimizer), _replicas.replica_id()))
        return tf.math.multiply_no_nan(original(loss), tf.cast(share_of_replica(), loss.dtype))

    return scale_loss


def _optimizer_apply(optimizer, original, packed: bool, scaled_already: set):
    updates = {}  # the packed updates (`packed_apply`) of this step's trace, by the variables they apply to

    def apply(grads, trainable_variables=None):
        _compiled_calls.refuse(f"applies optimizer '{optimizer.name}'")
        if _updating_for_all.inside():
            return original(grads, trainable_variables)
        if trainable_variables is not None:
            _build_in_step(optimizer, trainable_variables)
        meeting = _replicas.rendezvous()
        by_scale_loss = (id(optimizer), _replicas.replica_id()) in scaled_already  # `scale_loss_by_share`
        share = tf.constant(1.0) if by_scale_loss else _share()
        grads = list(grads)
        if packed and PackedApply.usable(optimizer, trainable_variables, grads):
            key = tuple(id(v) for v in trainable_variables)
            if key not in updates:
                updates[key] = PackedApply(optimizer, original, trainable_variables, grads)
            update = updates[key]
            gathered = meeting.all_gather(update.pack(grads, share), f"{optimizer.name}.apply")
            apply_all = functools.partial(update.apply, gathered)
        else:
            gathered = meeting.all_gather([scaled(g, share) for g in grads], f"{optimizer.name}.apply")

            def apply_all():
                original([_split.sum_gradients([r[k] for r in gathered]) for k in range(len(grads))], trainable_variables)

        merged = None
        if _replicas.replica_id() == 0:
            with _updating_for_all, _made() as merged:
                apply_all()
        # The others go on only once the update is in the step, so they read the new weights.
        meeting.all_gather(None, f"after {optimizer.name}.apply", merged=merged)

    return apply


def _build_in_step(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` as its first `apply` would, its variables seen by the step's trace.

    A replica's thread makes them through the tracing thread's variable
    creators, as `tf.distribute`'s replicas do: `tf.function` then traces the
    step again once they exist, as on one device. The first trace holds what
    the unbuilt optimizer answered; `LossScaleOptimizer.scale_loss`, the
    initial scale as a constant: kept, every step would scale by it.
    """
    with _building:  # by the first replica to get here; the others find it built
        build_optimizer(optimizer, variables, _private_optimizers.creating_variables_with(_run.creators))


_building = threading.Lock()


def _share():
    return _run.shares[_replicas.replica_id()]


def _metric_update(metric, original):
    signature = inspect.signature(original)

    def update_state(*args, **kwargs):
        _compiled_calls.refuse(f"updates metric '{metric.name}'")
        if _updating_for_all.inside():
            return original(*args, **kwargs)
        meeting = _replicas.rendezvous()
        gathered = meeting.all_gather((args, kwargs), f"{metric.name}.update_state")
        made = None
        if _replicas.replica_id() == 0:
            with tf.device(_run.merge_device):
                merged = _step_merging.merged_arguments(signature, gathered, _run.shares, _run.shards)
                with _updating_for_all, _made() as made:
                    original(*merged.args, **merged.kwargs)
        # Results read after this point see the update, on every replica.
        meeting.all_gather(None, f"after {metric.name}.update_state", merged=made)

    return update_state


@contextlib.contextmanager
def _made():
    """Inside: a timed replica lists the operations it makes (the update it runs for all), for the others' clocks."""
    made, graph = [], None if tf.executing_eagerly() or not _replicas.timed() else tf.compat.v1.get_default_graph()
    count = len(graph.get_operations()) if graph is not None else 0
    yield made
    made.extend(graph.get_operations()[count:] if graph is not None else [])


def _first_replica_assign(variable, original):
    def assign(value, *args, **kwargs):
        # Inside a compiled call every replica records it: assigned after the call, through here again.
        if _updating_for_all.inside() or _compiled_calls.inside() or _replicas.replica_id() == 0 or _replicas.rendezvous() is None:
            return original(value, *args, **kwargs)
        return variable

    return assign


def optimizers(template) -> list:
    """The optimizers a template's steps may apply: its own, those it keeps (a GAN's, in a list too), its sub-models'.

    (A GAN of Keras 2's style compiles its generator and discriminator each with an optimizer.)
    """
    found = [template.optimizer] if getattr(template, "optimizer", None) is not None else []
    candidates = [item for value in vars(template).values() for item in held(value)]
    candidates += [getattr(layer, "optimizer", None) for layer in keras_private.flatten_layers(template)
                   if isinstance(layer, keras.Model)]
    for item in candidates:
        if isinstance(item, keras.optimizers.Optimizer) and all(item is not o for o in found):
            found.append(item)
    return found


def held(value) -> list:
    """The items of an attribute's value: a list's, a tuple's, a dict's values, or the value itself."""
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, (list, tuple)) else [value]


def metrics(template) -> list:
    """The metrics a template's steps may update: its `metrics` and its layers' own."""
    found = []
    for metric in list(template.metrics) + [m for layer in keras_private.flatten_layers(template)
                                             for m in keras_private.own_metrics(layer)]:
        if all(metric is not m for m in found):
            found.append(metric)
    return found


def assigned_variables(template) -> list:
    """The template's variables a step may assign itself: not its seeds (per replica)."""
    seeds = {id(g.state) for layer in keras_private.flatten_layers(template)
             for g in keras_private.seed_generators(layer)}
    return [v for v in template.variables if id(v) not in seeds]


def _replica_context(template, compiled: bool):
    pairs = _compiled_calls.calls(template) if compiled else []
    scaled_already = set()
    for optimizer in optimizers(template):
        pairs += [(optimizer, "apply", _optimizer_apply(optimizer, optimizer.apply, compiled, scaled_already)),
                  (optimizer, "scale_loss", scale_loss_by_share(optimizer, optimizer.scale_loss, _share, scaled_already))]
    pairs += [(m, "update_state", _metric_update(m, m.update_state)) for m in metrics(template)]
    for variable in assigned_variables(template):
        pairs += [(variable, name, _first_replica_assign(variable, getattr(variable, name)))
                  for name in ("assign", "assign_add", "assign_sub")]
    return patched(pairs)


class CustomSteps:
    """Runs a template's own steps over this process's replicas (`local_replicas.LocalReplicas`)."""

    def __init__(self, template, replicas):
        self._template = template
        self._replicas = replicas
        self.overridden = overridden(template)
        self.compiles = False  # the model calls in each replica's step, with XLA (`compiled_calls`)

    def run(self, step: str, data, timing=None):
        """The template's `step` ("train_step" or "test_step") on every replica.

        Returns the merged logs and the shards that ran; `timing`
        (`balance.StepTiming`), if given, gets each replica's busy time.
        """
        template, replicas = self._template, self._replicas
        plan = replicas.plan(_split.batch_size(data, "data"))
        if len(plan.shards) == 1:
            return getattr(template, step)(data), plan.shards
        pieces = replicas.pieces(data, plan)
        shares = plan.shares
        self._build_compiled_loss(data)

        def replica(i):
            _replicas.set_valid(plan.shards[i].counted)
            _replicas.set_gradient_share(shares[i])  # `_optimizer_apply` scales its gradients so
            data_i = timing.start(i, pieces[i]) if timing else pieces[i]
            _replicas.set_timing(timing)  # its waits at meeting points apart from its work
            logs = getattr(template, step)(data_i)
            if timing:
                # Its end: its logs, and the weights as read after its step (logs may hold no tensor).
                timing.end(i, (logs, data_i, [tf.convert_to_tensor(v) for v in template.trainable_weights]))
            return logs

        _run.shares, _run.shards, _run.merge_device = shares, plan.shards, replicas.merge_device
        _run.creators = _private_optimizers.variable_creators()
        with _replica_context(template, self.compiles):
            logs = replicas.run(plan, replica, synchronized=True)
        with tf.device(replicas.merge_device):
            return _step_merging.merged_logs(logs, shares), plan.shards

    def predict(self, data):
        """The template's `predict_step` on every replica's rows; the outputs joined in order."""
        template, replicas = self._template, self._replicas
        plan = replicas.plan(_split.batch_size(data, "data"))
        if len(plan.shards) == 1:
            return template.predict_step(data)
        pieces = replicas.pieces(data, plan)
        with patched(_compiled_calls.calls(template) if self.compiles else []):
            outputs = replicas.run(plan, lambda i: template.predict_step(pieces[i]))
        return replicas.merge(outputs, plan)

    def _build_compiled_loss(self, data):
        """Builds the template's compiled loss (and its per-output trackers) before the replicas run.

        Built inside a replica, its trackers would be created after the
        metrics are patched, and every replica would update them.
        """
        template = self._template
        compiled = keras_private.compiled_loss(template)
        if compiled is None or compiled.built or not template.built:
            return
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = keras_private.symbolic_outputs(template, x)
        keras_private.compute_output_spec(keras_private.compute_loss, template, x, y, y_pred, sample_weight, False)


def warn_not_run(template: keras.Model, names) -> None:
    """Warns that Keras' own steps run, not the template's (across workers; `parallel_predict`).

    Called by the public function the user called, so the warning points at
    the user's line.
    """
    skipped = [name for name in overridden(template) if name in names]
    if skipped:
        # Each replica runs Keras' own steps, with compile()'s loss and
        # metrics and the losses layers add.
        warnings.warn(
            f"The parallel model does not run {', '.join(skipped)} of the template "
            f"'{template.name}'. Put a custom loss in compile(loss=...) or add_loss(), "
            f"post-process predict()'s output, or use one device. Received: overrides={skipped}",
            stacklevel=3,
        )
