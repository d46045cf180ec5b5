"""XLA per replica: each replica's step compiled for its own device.

Keras compiles a step with XLA for one device, so a parallel model cannot
hand its whole step to XLA. Instead each replica's forward pass, loss and
gradients are one `tf.function(jit_compile=True)`, called under that
replica's `tf.device` from the parallel model's (uncompiled) step. The
function is stateless: it is fed the variables' values, read once by the
outer step (XLA refuses a resource that lives on another device), runs the
template under Keras' `StatelessScope`, and returns what the step needs: the
predictions (and their Keras masks), the replica's part of the loss, its
gradients, the loss trackers' values and the new non-trainable values.

Replicas cannot meet inside a compiled function, so two things differ from
the uncompiled path (`replicas.py`):

- The batch's loss totals. A replica divides its weighted loss sum by the
  whole batch's total (`loss_parts.py`). Where that total is proportional to
  the rows (element counts, no mask, no `"mean_with_sample_weight"` with
  weights) the replica computes it from its own count: count / rows * batch.
  Otherwise a first compiled pass per replica (forward and loss only)
  returns the counts, and their sum is fed to the step: one forward pass
  more, paid only by such models.
- BatchNormalization normalises with each replica's own statistics, as
  `MirroredStrategy` and PyTorch's DDP do by default, and the moving
  statistics become the mean of the replicas' updates weighted by their rows
  (so the moving mean is the one-device moving mean; the moving variance is
  the mean of the replicas' variances). Models with a BatchNormalization
  layer built with `synchronized=True` keep the exact, uncompiled path.

Every replica draws its own random numbers: replica i's seed generators
start from the shared state with i added to the seed, and replica 0's
advanced state is kept.
"""

from __future__ import annotations

import warnings

import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import packing as _packing
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm
from kerasmulti._src.data_parallel.packed_apply import build_optimizer
from kerasmulti._src.keras_private import get_keras_mask, model_supports_jit, set_keras_mask


def synchronized_batchnorm(template) -> list:
    """The BatchNormalization layers built with `synchronized=True`."""
    return [layer for layer in _sync_batchnorm.batchnorm_layers(template) if getattr(layer, "synchronized", False)]


def resolve(template, jit_compile, replicas: int) -> bool:
    """Whether a parallel model over `replicas` devices compiles its replicas with XLA.

    `"auto"` follows Keras (on where there is a GPU and every layer supports
    XLA) but stays off where the exact path is asked for by a
    BatchNormalization layer with `synchronized=True`.
    """
    check_jit_compile(jit_compile)
    if replicas < 2 or jit_compile is False:
        return False
    blockers = xla_blockers(template)
    if jit_compile == "auto":
        return not blockers and template._resolve_auto_jit_compile()
    if blockers:
        raise ValueError(
            f"A parallel model cannot compile its replicas with XLA: {blockers}. "
            "Pass jit_compile=False (exact, uncompiled replicas) or 'auto'. "
            "Received: jit_compile=True"
        )
    return True


def check_jit_compile(jit_compile) -> None:
    if jit_compile is not True and jit_compile is not False and jit_compile != "auto":
        raise ValueError(
            f"jit_compile must be True, False or 'auto'. Pass one of those. Received: jit_compile={jit_compile!r}"
        )


def compile_as_given(model, arguments: dict) -> None:
    """`model.compile(**arguments)`, recording `jit_compile` as given without Keras' warning where `model`
    refuses XLA (placed layers): its XLA runs elsewhere (per replica, per stage) or its copy's steps do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Model doesn't support `jit_compile=True`")
        model.compile(**arguments)


def xla_blockers(template) -> str:
    """Why the replicas of `template` cannot run as XLA programs ("": they can)."""
    synchronized = synchronized_batchnorm(template)
    if synchronized:
        names = [layer.name for layer in synchronized]
        return (
            f"BatchNormalization layer(s) {names} were built with synchronized=True, "
            "whose statistics need every replica, which a compiled replica cannot reach"
        )
    if not model_supports_jit(template):
        unsupported = [layer for layer in keras_private.flatten_layers(template) if not layer.supports_jit]
        if not unsupported:
            # Keras' other reasons: op determinism on, or a Mac's GPU.
            return "Keras turns XLA off for this model on this machine (op determinism, or a Mac's GPU)"
        # OnDevice: a layer placed with device_scope or on_device.
        named = ", ".join(f"{layer.name} ({type(layer).__name__})" for layer in unsupported)
        return f"layers that Keras marks as not supporting XLA: {named}"
    return ""


class _Totals:
    """The batch's loss totals as one replica computes them inside its function.

    Called by `loss_parts` once per loss reduction, in the same order on every
    replica. `given` holds the summed counts from a counting pass, for
    totals that are not proportional to the rows.
    """

    def __init__(self, rows, batch, given):
        self.rows, self.batch, self.given = rows, batch, given
        self.counts = []
        self.needs_counts = False

    def __call__(self, value, by_rows: bool):
        index = len(self.counts)
        self.counts.append(tf.cast(value, tf.float32))
        if not by_rows:
            self.needs_counts = True
            if self.given is not None:
                return tf.cast(self.given[index], value.dtype)
        return _loss_parts.proportional_total(value, self.rows, self.batch)


class CompiledReplicas:
    """Runs a parallel model's replicas as XLA functions; one per model.

    Args:
        model: The parallel model, whose loss, loss trackers and optimizer
            the replicas use.
        template: The model the replicas run.
        merge_device: Where the replicas' counts are summed.
    """

    def __init__(self, model, template, merge_device: str):
        self._model = model
        self._template = template
        self._merge_device = merge_device
        self._step = tf.function(self._replica, jit_compile=True, reduce_retracing=True, autograph=False)
        self._needs_counts = {}
        self._reads = None  # `_prepare`: the template may be built only by the first step
        self._connected = None  # which variables the loss reaches, found when a training step is traced
        # None synchronized (`resolve`); a frozen one normalises with its moving statistics, as on one device.
        local = [layer.name for layer in _sync_batchnorm.batchnorm_layers(template) if layer.trainable]
        if local:
            warnings.warn(  # from the user's compile(): here, its `_outer_jit_compile`, compile
                "Under XLA per replica, BatchNormalization normalises each replica's rows, not the batch's (as "
                f"tf.distribute). For one device's numbers pass jit_compile=False. Received: layers={local}",
                stacklevel=4,
            )

    def _prepare(self):
        """Lays out the template's variables (again, if they changed) for the packed step."""
        template = self._template
        trainable, state = template.trainable_variables, template.non_trainable_variables
        variables = trainable + state
        same = self._reads is not None and [id(v) for v in self._reads.variables] == [id(v) for v in variables]
        if same and self._trainable == len(trainable):  # a frozen last layer keeps the order, not the count
            return
        self._reads = _packing.DeviceReads(variables)
        self._trainable = len(trainable)  # the first values of `_reads`; their gradients' layout is traced (`_dense`)
        self._state = _packing.Layout(state)
        seed_ids = {
            id(generator.state)
            for layer in keras_private.flatten_layers(template)
            for generator in keras_private.seed_generators(layer)
        }
        self._is_seed = [id(v) in seed_ids for v in state]
        statistics = {id(v) for layer in _sync_batchnorm.batchnorm_layers(template) for v in layer.non_trainable_variables}
        self._merged_as_statistics = [id(v) not in seed_ids | statistics for v in state]  # warned about if assigned
        optimizer = self._model.optimizer
        everything = variables + (list(optimizer.variables) if optimizer is not None else [])
        devices = {_packing.device_of(v) for v in everything}
        if len(devices) == 1:
            self._update_device = devices.pop()
            self._update = tf.function(self._apply, jit_compile=True, autograph=False)
        else:
            # XLA reads a variable only on its own device: the update runs op by op.
            warnings.warn(
                "The model's variables live on several devices, so its weight update runs "
                "uncompiled (slower). Build the model under one device. "
                f"Received: devices={sorted(devices)}",
                stacklevel=2,
            )
            self._update_device, self._update = None, self._apply

    def forward(self, plan, pieces):
        """Every replica's inference forward pass (`training=False`) under `plan` (`local_replicas.StepPlan`); their outputs."""
        pieces = [(x, None, None) for x in pieces]
        results = self._call_all(plan.devices, self._arguments(pieces, plan, 1.0), None, False, "forward")
        return [_with_masks(r["y_pred"], r["masks"]) for r in results]

    def run(self, plan, pieces, training, deferred, timing=None):
        """Every replica's step under `plan` (`local_replicas.StepPlan`); returns `(y_pred, loss)` per replica.

        A training step also applies the summed gradients with the model's
        optimizer and assigns the non-trainable updates (BatchNormalization,
        seed states) to the template, in one XLA call on the variables'
        device. The loss trackers' values go to `deferred`
        (`loss_metrics.DeferredLossMetrics`), the replicas' busy times to
        `timing` (`balance.StepTiming`), if given.
        """
        optimizer, trainable = self._model.optimizer, self._template.trainable_variables
        if training and optimizer is not None and trainable:
            build_optimizer(optimizer, trainable)  # training only: predict and evaluate leave it unbuilt, as Keras
        loss_scale = optimizer.scale_loss(tf.ones(())) if training and optimizer is not None else 1.0
        # Timed, the weights are read once the step has started, and each replica starts once they are read.
        with tf.control_dependencies([timing.started()] if timing else []):
            arguments = self._arguments(pieces, plan, loss_scale)
        key = (training, pieces[0][2] is None)
        self._deferred = deferred
        if key not in self._needs_counts:
            # Tracing alone tells whether a total needs the other replicas'
            # counts; where none does (most models), this trace is the step's.
            with _replicas.as_replica(0):
                read, *rest = arguments[0]
                self._step.get_concrete_function(self._reads.split(read), *rest, None, training, "step")
            self._needs_counts[key] = self._traced_needs_counts
        totals = None
        if self._needs_counts[key]:
            counts = self._call_all(plan.devices, arguments, None, training, "count", timing)
            with tf.device(self._merge_device):
                totals = tf.add_n([c["counts"] for c in counts])
        results = self._call_all(plan.devices, arguments, totals, training, "step", timing)
        for i, r in enumerate(results):
            deferred.put(i, r["tracked"])
        if training:
            shares = [tf.cast(s, tf.float32) for s in plan.shares]
            with tf.device(self._update_device):
                self._update([r["gradients"] for r in results], [r["state"] for r in results], shares,
                             [r["rows"] for r in results])
        return [(_with_masks(r["y_pred"], r["masks"]), r["loss"]) for r in results]

    def _arguments(self, pieces, plan, loss_scale):
        """Each replica's arguments: the variables' values (packed), its rows, its scalars."""
        self._prepare()
        read = self._reads.read()
        batch = tf.cast(plan.batch, tf.float32)
        loss_scale = tf.cast(loss_scale, tf.float32)
        arguments = []
        for i, shard in enumerate(plan.shards):
            x, y, sample_weight = pieces[i]
            scalars = [tf.cast(value, tf.float32) for value in (i, plan.shares[i], _split.counts(shard), shard.sliced)]
            arguments.append((read, x, y, sample_weight, *scalars, batch, loss_scale))
        return arguments

    def _call_all(self, devices, arguments, totals, training, mode, timing=None):
        results = []
        for i, device in enumerate(devices):
            with tf.device(device), tf.name_scope(f"replica_{i}"), _replicas.as_replica(i):
                args = arguments[i]
                if timing:  # the weights read, x, y and sample_weight wait for the start time
                    args = (*timing.start(i, args[:4]), *args[4:])
                args = (self._reads.split(args[0]), *args[1:])  # on the replica's device
                results.append(self._step(*args, totals, training, mode))
                if timing:
                    timing.end(i, results[-1])
        return results

    def _apply(self, gradients, states, shares, rows):
        """Sums the replicas' packed gradients, applies them, assigns the non-trainable state.

        Sparse gradients (`rows`: an Embedding's, each replica's values and
        indices) are joined as the uncompiled step joins them (`split.joined_rows`):
        an optimizer that is not linear in the gradient (Adam) updates as on one device.
        """
        template = self._template
        if self._trainable:
            dense, joined = iter(self._dense.unpack(_packing.summed(gradients))), iter(zip(zip(*rows), self._shared))
            values = [
                _joined(*next(joined), variable) if sparse else next(dense)
                for sparse, variable in zip(self._sparse, template.trainable_variables)
            ]
            # Where the loss does not reach a variable, the optimizer is told so (as one device's step).
            values = [g if connected else None for g, connected in zip(values, self._connected)]
            self._model.optimizer.apply_gradients(zip(values, template.trainable_variables))
        # The replicas' float values weighted by their rows, one buffer per dtype at a time:
        # first + sum(share * (v - first)), so that equal values stay bit for bit, in float32
        # at least (a share rounded to bfloat16 would be 2**-9 off). Integers (seed states,
        # counters) are the first's.
        first, merged = states[0], dict(states[0])
        for key, flat in first.items():
            if flat.dtype.is_floating and len(states) > 1:
                wide = tf.float32 if flat.dtype.size < 4 else flat.dtype
                base = tf.cast(flat, wide)
                spread = [tf.cast(s, wide) * (tf.cast(r[key], wide) - base) for r, s in zip(states[1:], shares[1:])]
                merged[key] = tf.cast(base + tf.add_n(spread), flat.dtype)
        for variable, value in zip(template.non_trainable_variables, self._state.unpack(merged)):
            variable.assign(value)

    def _replica(
        self, read, x, y, sample_weight, replica, share, valid, rows, batch, loss_scale, totals, training, mode,
    ):
        """One replica's work, traced for XLA: `mode` is "step", "count" or "forward"."""
        template = self._template
        values = self._reads.values(read)
        count = self._trainable
        trainable, state = values[:count], values[count:]
        state = [_replicas.seed_of_replica(v, replica) if seed else v for v, seed in zip(state, self._is_seed)]
        mapping = list(zip(template.trainable_variables, trainable))
        mapping += list(zip(template.non_trainable_variables, state))
        local = _Totals(rows, batch, totals)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            if training:
                tape.watch(trainable)
            with _packing.StoredScope(state_mapping=mapping, collect_losses=True) as scope:
                given = [scope.get_current_value(v) for v in template.non_trainable_variables]
                y_pred = template(x, training=training)
                if mode == "step":
                    _warn_if_assigned(template, scope, given, self._merged_as_statistics)
                _split.check_batch_axis(y_pred, x)
                if mode == "forward":
                    return {"y_pred": y_pred, "masks": tree.map_structure(get_keras_mask, y_pred)}
                with _loss_parts.replica_part(share, valid, rows, local):
                    loss = keras_private.compute_loss(self._model, x, y, y_pred, sample_weight, training)
                scaled = loss * tf.cast(loss_scale, loss.dtype)
        self._traced_needs_counts = local.needs_counts
        if mode == "count":
            return {"counts": tf.stack(local.counts) if local.counts else tf.zeros((0,))}
        gradients, rows = {}, []
        if training:
            gradients = tape.gradient(scaled, trainable) if trainable else []
            self._connected = [g is not None for g in gradients]
            # An Embedding's gradient lists a row per lookup: those stay rows (`_apply`), packed they would be a table.
            kinds = [_split.row_kind(g.indices) if isinstance(g, tf.IndexedSlices) else "dense" for g in gradients]
            self._sparse = [kind in ("lookup", "shared") for kind in kinds]  # a "unique" one goes dense: no row repeats
            self._shared = [kind == "shared" for kind in kinds if kind in ("lookup", "shared")]
            rows = [(g.values, g.indices) for g, sparse in zip(gradients, self._sparse) if sparse]
            dense = [(g, v) for g, v, sparse in zip(gradients, trainable, self._sparse) if not sparse]
            self._dense = _packing.Layout([v for _, v in dense])
            gradients = self._dense.pack([tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in dense])
        return {
            "y_pred": y_pred,
            "masks": tree.map_structure(get_keras_mask, y_pred),
            "loss": loss,
            "gradients": gradients,
            "rows": rows,
            "tracked": {str(k): v for k, v in self._deferred.of_replica(_replicas.replica_id()).items()},
            "state": self._state.pack([scope.get_current_value(v) for v in template.non_trainable_variables]),
        }


def _warn_if_assigned(template, scope, given: list, merged_as_statistics: list) -> None:
    """Warns (as the step is traced) where a layer other than BatchNormalization assigns a variable in `call`."""
    assigned = [v.path for v, before, other in zip(template.non_trainable_variables, given, merged_as_statistics)
                if other and scope.get_current_value(v) is not before]
    if assigned:
        # docs/limitations.md, "Custom steps and layer metrics".
        warnings.warn(
            f"Under XLA per replica, '{template.name}' assigns variables in its call; the replicas' values are averaged "
            "by rows, as BatchNormalization's statistics, which a row counter or a maximum is not (docs/limitations.md). "
            f"Received: assigned={assigned}",
            stacklevel=2,
        )


def _joined(rows, shared: bool, variable) -> tf.IndexedSlices:
    """One variable's sparse gradient from each replica's (values, indices), joined as `split.sum_gradients` does."""
    shape = tf.constant(tuple(variable.shape))
    gradients = [tf.IndexedSlices(values, indices, shape) for values, indices in rows]
    return _split.shared_rows(gradients) if shared else _split.joined_rows(gradients, once=False)


def _with_masks(y_pred, masks):
    flat_masks = tree.flatten(masks) if masks is not None else []
    for tensor, mask in zip(tree.flatten(y_pred), flat_masks):
        if mask is not None:
            set_keras_mask(tensor, mask)
    return y_pred
