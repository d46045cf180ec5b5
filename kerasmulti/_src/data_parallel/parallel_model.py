"""`ParallelModel`: data parallelism for an existing Keras 3 model.

Built by `parallelize` (`parallelize.py`). Split, replicate, merge: every
batch is split along axis 0 into one shard per device; the template model
runs on each shard under that device's scope (at call time, where Keras 3
honours it); the outputs are concatenated in order on the CPU. The wrapper
owns no weights: it tracks the template, so training the wrapper trains the
template, and saving either saves the template.

Training does not back-propagate through the merged output (on two
simulated devices it ran at 0.68x one device): each replica computes its loss and gradients on its shard, and
the gradients are summed. Each replica's loss is its part of the whole
batch's (`loss_parts.py`), so the sum equals the one-device gradient for every
Keras loss reduction, masked losses included. Metrics are computed once on
the merged output, so stateful metrics (AUC) see the whole batch.
BatchNormalization is synchronised, see `sync_batchnorm.py`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import call_checks as _call_checks
from kerasmulti._src.data_parallel import compiled as _compiled
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import epoch_order as _epoch_order
from kerasmulti._src.data_parallel import feeding as _feeding
from kerasmulti._src.data_parallel import loss_metrics as _loss_metrics
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import monitor as _monitor
from kerasmulti._src.data_parallel import persistence as _persistence
from kerasmulti._src.data_parallel import replica_losses as _replica_losses
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import row_mixing as _row_mixing
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm
from kerasmulti._src.data_parallel import template_access as _template_access
from kerasmulti._src.keras_private import compute_output_spec, loss_module, record


class ParallelModel(_persistence.TemplatePersistence, _template_access.TemplateAccess, keras.Model):
    """A data-parallel view of a template model; build it with `parallelize`.

    It is a `keras.Model`: compile, fit, evaluate, predict and call it as the
    template. It owns no weights (they are the template's), and `save`,
    `save_weights` and `load_weights` act on the template.

    Example:

    ```python
    import keras, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    parallel = kerasmulti.parallelize(model)
    print(parallel.replica_devices)
    ```
    """

    def __init__(self, template, devices, merge_device, split=None, **kwargs):
        super().__init__(name=f"parallel_{template.name}", **kwargs)
        self._template = template
        self._replica_devices = list(devices)
        self._merge_device = merge_device
        # None (even), fixed proportions, or measured ones (`balance`).
        self._auto_split = _balance.AutoSplit(len(devices)) if split == "auto" else None
        self._split = split
        self._timing = _balance.StepTiming(devices) if self._auto_split else None
        self._batchnorm = _sync_batchnorm.batchnorm_layers(template)
        # The template's own steps, where it has some (`custom_steps.py`).
        self._custom = _custom_steps.CustomSteps(self) if self._runs_custom_steps() else None
        self._compiled = None  # the replicas' XLA step (`compiled.py`), once compiled so
        self._rows_probed = False  # `row_mixing.probe_once`: the first fit/evaluate/predict
        self._fit_calls, self._input_order = 0, None  # `epoch_order`: shuffled arrays a backup resumes
        if hasattr(template, "output_names"):
            self.output_names = template.output_names
        self.built = True

    def compile(self, *args, jit_compile="auto", **kwargs):
        """Configures training as `keras.Model.compile`.

        The template is compiled with the same settings and shares the
        optimizer, so it can be evaluated on one device and saved with its
        training state. XLA compiles a step for one device, so with several
        devices `jit_compile` applies to each replica's part of the step
        (forward pass, loss and gradients) on its own device
        (`compiled.py`): `"auto"` turns it on where Keras would (a GPU),
        True forces it (CPU devices too), False keeps the uncompiled
        replicas, whose BatchNormalization statistics are the whole batch's.

        A template with steps of its own (`custom_steps.py`) is compiled with its own `compile`
        signature (a GAN's `compile(d_optimizer, g_optimizer, loss_fn)`); XLA compiles its model calls.
        """
        if self._custom is not None:
            return self._compile_custom(args, kwargs, jit_compile)
        _call_checks.check_compile(args, kwargs)
        replicas = len(self._replica_devices)
        if replicas > 1:
            run_eagerly = kwargs.get("run_eagerly", False)
            self._compiled = None
            if not run_eagerly and self._compiles_replicas(jit_compile):
                self._compiled = _compiled.CompiledReplicas(self)
            jit_compile = False  # the outer step spans the devices
        super().compile(*args, jit_compile=jit_compile, **kwargs)
        auto_scale_loss = kwargs.get("auto_scale_loss", True)
        if auto_scale_loss and self._template.dtype_policy.name == "mixed_float16":
            # What Keras does for a mixed_float16 model, when only the
            # template (not the global policy) is mixed.
            self._scale_losses()
        # The template is compiled alike, sharing the optimizer: files saved
        # from either hold the training state, and a backup's layout is the
        # same in every process (it does not depend on whether a save ran).
        # Keras' compile config leaves auto_scale_loss out; without it the
        # template would wrap the shared optimizer in a LossScaleOptimizer.
        self._template.compile(
            **dict(keras_private.compile_arguments(self), optimizer=self.optimizer, auto_scale_loss=auto_scale_loss)
        )

    def _compiles_replicas(self, jit_compile) -> bool:
        """Whether this model compiles each replica's step with XLA itself (`compiled.py`)."""
        return _compiled.resolve(self._template, jit_compile, len(self._replica_devices))

    def _fed(self, feed, arguments: dict) -> dict:
        """`fit`/`evaluate`/`predict`'s arguments, arrays going through `feed`'s steady pipeline."""
        return feed(arguments, model=self)

    def _resolve_auto_jit_compile(self):
        # Keras' "auto" for a model never compiled (predict straight after
        # parallelize): the outer step spans the devices, so XLA stays off.
        if len(self._replica_devices) > 1:
            return False
        return super()._resolve_auto_jit_compile()

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Trains as `keras.Model.fit`; arrays go through a steady pipeline (`feeding`)."""
        self._adopt_template_compile()
        arguments = _feeding.bound(keras.Model.fit, (x, y, batch_size, *args), kwargs)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2, training=True)
        _monitor.attach(self, arguments.get("callbacks"))
        self._fit_calls += 1
        seed = _epoch_order.seed_for(arguments.get("callbacks"), self._fit_calls)
        return super().fit(**self._fed(functools.partial(_feeding.fit_arguments, seed=seed), arguments))

    def evaluate(self, *args, **kwargs):
        """Evaluates as `keras.Model.evaluate`; arrays go through a steady pipeline."""
        self._adopt_template_compile()
        arguments = _feeding.bound(keras.Model.evaluate, args, kwargs)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2)
        return super().evaluate(**self._fed(_feeding.evaluate_arguments, arguments))

    def predict(self, *args, **kwargs):
        """Predicts as `keras.Model.predict`; arrays go through a steady pipeline."""
        arguments = _feeding.bound(keras.Model.predict, args, kwargs)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2)
        return super().predict(**self._fed(_feeding.predict_arguments, arguments))

    @property
    def replica_jit_compile(self) -> bool:
        """Whether each replica's step (a custom step: its model calls) runs compiled with XLA (see `compile`)."""
        return self._compiled is not None or (self._custom is not None and self._custom.compiles)

    @property
    def replica_devices(self) -> list[str]:
        """The devices replicas run on, in shard order."""
        return list(self._replica_devices)

    @property
    def split(self) -> list[float] | None:
        """Each device's proportion of a batch: None for even sizes; `split="auto"`: measured."""
        if self._auto_split is not None:
            return self._auto_split.current()
        return None if self._split is None else list(self._split)

    def _proportions(self):
        return self._split if self._auto_split is None else self._auto_split.proportions.read_value()

    def _time_steps(self) -> None:
        """Turns on step timing (`ThroughputMonitor`); the next fit traces its step again."""
        if self._timing is None:
            self._timing = self._new_timing()
            self.train_function = None

    def _new_timing(self):
        return _balance.StepTiming(self._replica_devices)

    def _updated_weights(self) -> list:
        """The trainable weights as read after this step's update (its end, for timing; compiled: one waits for all)."""
        weights = self.trainable_weights or [self.optimizer.iterations]
        return [tf.convert_to_tensor(v) for v in (weights[:1] if self._compiled is not None else weights)]

    def call(self, inputs, training=None):
        batch = _split.batch_size(inputs)
        shards = _split.plan(batch, len(self._replica_devices), self._proportions())
        if len(shards) == 1:
            return _replicas.run(
                self._replica_devices[:1], lambda i: self._template(inputs, training=training)
            )[0]

        pieces = self._slice(inputs, shards)
        shares = _split.shares(shards, batch)
        if not training and self._compiled is not None:
            outputs = self._compiled.forward(self._devices_for(shards), pieces, shards, shares, batch)
            with tf.device(self._merge_device):
                return _split.merge(outputs, shards)

        def replica(i):
            _replicas.set_valid(shards[i].counted)
            # Losses its layers add (regularisers, add_loss) count by its rows.
            with _loss_parts.added_losses_scaled(self._template, shares[i]):
                return self._template(pieces[i], training=training)

        synchronized = bool(training) and bool(self._batchnorm)
        if synchronized and record.could_possibly_record():
            # Replicas share BatchNormalization statistics on threads of their
            # own, which the user's tape does not record: every gradient would
            # be None. fit() and train_on_batch() take each replica's gradients.
            raise RuntimeError(
                "A GradientTape cannot train a parallel model with BatchNormalization. Use fit(), "
                "train_on_batch() or a loop on kerasmulti.unwrap(parallel). "
                f"Received: training=True with {len(self._batchnorm)} BatchNormalization layer(s)"
            )
        with self._synchronized(synchronized):
            outputs = _replicas.run(
                self._devices_for(shards), replica, synchronized, self.variables
            )
        with tf.device(self._merge_device):
            return _split.merge(outputs, shards)

    def _runs_custom_steps(self) -> bool:
        return bool(_custom_steps.overridden(self._template))

    def train_step(self, data):
        if self._custom is not None:
            return self._custom.run("train_step", data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._timing is not None:
            started = self._timing.step_start(x)
        step = self._replica_step(x, y, sample_weight, training=True)
        if step is None:
            logs = super().train_step(data)
            rows = _split.batch_size(x)
            shards = [_split.Shard(0, rows, rows)]
        else:
            y_pred, gradients, shards = step
            if not self.trainable_weights:
                warnings.warn("The model does not have any trainable weights.", stacklevel=2)
            elif gradients is not None:
                self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
            logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self._timing is not None:
            busy, rows = self._timing.record(shards, started, self._updated_weights())
            if self._auto_split is not None:
                self._auto_split.observe(busy, rows)
        return logs

    def test_step(self, data):
        if self._custom is not None:
            return self._custom.run("test_step", data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._replica_step(x, y, sample_weight, training=False)
        if step is None:
            return super().test_step(data)
        return self.compute_metrics(x, y, step[0], sample_weight=sample_weight)

    def predict_step(self, data):
        if self._custom is not None and "predict_step" in self._custom.overridden:
            return self._custom.predict(data)
        return super().predict_step(data)

    def _replica_step(self, x, y, sample_weight, training):
        """Every replica's forward pass, its part of the loss and (training) its gradients.

        Records the batch's loss as Keras' steps do, and returns the merged
        predictions and the summed gradients, or None when the batch runs on
        one replica.
        """
        batch = _split.batch_size(x)
        shards = _split.plan(batch, len(self._replica_devices), self._proportions())
        if len(shards) == 1:
            return None
        timing = self._timing if training else None
        trainable = self.trainable_weights if training else []
        shares = _split.shares(shards, batch)
        self._build_compile_loss(x, y, sample_weight)

        pieces = self._slice((x, y, sample_weight), shards)

        def replica(i):
            _replicas.set_valid(shards[i].counted)
            x_i, y_i, sw_i = timing.start(i, pieces[i]) if timing else pieces[i]
            total = _loss_parts.counted_or_summed(shards[i].sliced, batch, _replicas.cross_replica_sum)
            part = _loss_parts.replica_part(shares[i], _replicas.valid(), shards[i].sliced, total)
            # Timed, its weights are read after the step's start: the replica's time, not the loop's.
            with tf.GradientTape() as tape, tf.control_dependencies([timing.started()] if timing else []):
                y_pred = self._template(x_i, training=training)
                _split.check_batch_axis(y_pred, x_i)
                with part:
                    loss = keras_private.compute_loss(self, x_i, y_i, y_pred, sw_i, training)
                scaled = self.optimizer.scale_loss(loss) if training and self.optimizer else loss
            gradients = tape.gradient(scaled, trainable) if trainable else []
            if timing:
                timing.end(i, (y_pred, loss, gradients))
            return y_pred, loss, gradients

        # Synchronised: the replicas' losses need the whole batch's totals
        # (`loss_parts.py`), and BatchNormalization its statistics.
        with contextlib.ExitStack() as stack:
            deferred = stack.enter_context(_loss_metrics.deferred_loss_metrics(self))
            if self._compiled is not None:
                scale = self.optimizer.scale_loss(tf.ones(())) if training and self.optimizer else 1.0
                results = self._compiled.run(
                    self._devices_for(shards), pieces, shards, shares, batch, training, scale, deferred, timing
                )
            else:
                stack.enter_context(self._synchronized(True))
                results = _replicas.run(self._devices_for(shards), replica, True, self.variables)
            with tf.device(self._merge_device):
                deferred.flush(batch, shards)
                y_pred = _split.merge([r[0] for r in results], shards)
                losses = [r[1] for r in results]
                # reduction="none" leaves a loss per row: those are merged like outputs.
                loss = tf.add_n(losses) if losses[0].shape.rank == 0 else _split.merge(losses, shards)
                # None where the compiled step applied them (`compiled.py`).
                gradients = None if self._compiled is not None else [_split.sum_gradients(list(g)) for g in zip(*[r[2] for r in results])]
        keras_private.loss_tracker(self).update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=batch
        )
        return y_pred, gradients, shards

    def _build_compile_loss(self, x, y, sample_weight):
        """Builds Keras' loss (and its per-output trackers) before the replicas run.

        Without a distribution strategy Keras builds it in the first step's
        loss call, and the trackers it creates then would miss
        `_loss_metrics.deferred_loss_metrics`. This is the build Keras does with a
        strategy (`_symbolic_build`): symbolic, so no op reaches the step.
        """
        compiled = keras_private.compiled_loss(self)
        if compiled is None or compiled.built:
            return
        y_pred = compute_output_spec(self._template, x, training=False)
        compute_output_spec(keras_private.compute_loss, self, x, y, y_pred, sample_weight, False)

    def _aggregate_additional_loss(self, loss):
        # Regularisers and add_loss: each replica adds its share.
        return _loss_parts.additional_part(super()._aggregate_additional_loss(loss))

    def _slice(self, structure, shards):
        # Slice where the batch arrives (the host, for a tf.data pipeline), so
        # each device receives its own rows, not a copy of the whole batch.
        with tf.device(self._merge_device):
            return [_split.take(structure, shard) for shard in shards]

    def _devices_for(self, shards):
        return self._replica_devices[: len(shards)]

    def _synchronized(self, enabled):
        if not enabled:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(_replica_losses.kept_per_replica(self))
        stack.enter_context(_sync_batchnorm.synchronized(self._batchnorm))
        return stack


def unwrap(model: keras.Model) -> keras.Model:
    """Returns the template model behind a parallel model.

    Args:
        model: A model returned by `parallelize`, or any `keras.Model` (which
            is returned as it is).

    Returns:
        The template `keras.Model`, whose weights the parallel model trains.

    Raises:
        TypeError: If `model` is not a `keras.Model`.

    Example:

    ```python
    import keras, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert kerasmulti.unwrap(kerasmulti.parallelize(model)) is model
    ```
    """
    if isinstance(model, ParallelModel):
        return model._template
    if isinstance(model, keras.Model):
        return model
    raise TypeError(
        "unwrap() expects a keras.Model or a model returned by "
        f"kerasmulti.parallelize(). Received: model={type(model).__name__}"
    )
