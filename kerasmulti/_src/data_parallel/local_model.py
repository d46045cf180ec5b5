"""`LocalParallelModel`: data parallelism on this process's devices.

Built by `parallelize` (`parallelize.py`). Split, replicate, merge: every
batch is split along axis 0 into one shard per device; the template model
runs on each shard under that device's scope (at call time, where Keras 3
honours it); the outputs are concatenated in order on the CPU. A step is
planned once (`local_replicas.py`) and carried out by one of three executors:
Keras' step on threads (`threaded.py`) or the replicas' XLA programs
(`compiled.py`), both behind one `run`, or the template's own steps
(`custom_steps.py`).

Training does not back-propagate through the merged output (on two
simulated devices it ran at 0.68x one device): each replica computes its loss and gradients on its shard, and
the gradients are summed. Each replica's loss is its part of the whole
batch's (`loss_parts.py`), so the sum equals the one-device gradient for every
Keras loss reduction, masked losses included. Metrics are computed once on
the merged output, so stateful metrics (AUC) see the whole batch.
BatchNormalization is synchronised, see `sync_batchnorm.py`.
"""

from __future__ import annotations

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
from kerasmulti._src.data_parallel import local_replicas as _local_replicas
from kerasmulti._src.data_parallel import loss_metrics as _loss_metrics
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import monitor as _monitor
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import row_mixing as _row_mixing
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm
from kerasmulti._src.data_parallel import threaded as _threaded
from kerasmulti._src.data_parallel.parallel_model import ParallelModel
from kerasmulti._src.keras_private import compute_output_spec, loss_module, record


class LocalParallelModel(ParallelModel):
    """A `ParallelModel` whose replicas run on this process's devices; built by `parallelize`."""

    def __init__(self, template, devices, merge_device, split=None, **kwargs):
        # Planned and run by `local_replicas` (made first: the template's own steps run there too).
        batchnorm = _sync_batchnorm.batchnorm_layers(template)
        self._replicas = _local_replicas.LocalReplicas(self, devices, merge_device, split, batchnorm)
        super().__init__(template, devices, merge_device, **kwargs)
        self._threaded = _threaded.ThreadedReplicas(self, template, self._replicas, self._microbatch_order, self._sum_device)
        self._auto_split = self._replicas.auto_split
        self._timing = _balance.StepTiming(devices) if self._auto_split else None
        self._input_order = None  # `epoch_order`: shuffled arrays a backup resumes
        self._compiled_work = None  # timed on one device under XLA: the step's work, compiled (`make_train_function`)

    def _custom_steps(self):
        return _custom_steps.CustomSteps(self._template, self._replicas)

    def _outer_jit_compile(self, jit_compile, run_eagerly: bool):
        if len(self._replica_devices) == 1:
            return jit_compile
        self._compiled = None
        if not run_eagerly and _compiled.resolve(self._template, jit_compile, len(self._replica_devices)):
            self._compiled = _compiled.CompiledReplicas(self, self._template, self._replicas.merge_device)
        return False  # the outer step spans the devices

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Trains as `keras.Model.fit`; arrays go through a steady pipeline (`feeding`)."""
        self._adopt_template_compile()
        arguments = _feeding.bound(keras.Model.fit, (x, y, batch_size, *args), kwargs)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2, training=True)
        _row_mixing.probe_loss_once(self, arguments, stacklevel=2)
        _monitor.attach(self, arguments.get("callbacks"))
        self._fit_started(arguments)
        seed = _epoch_order.seed_for(arguments.get("callbacks"), self._fit_calls)
        return super().fit(**_feeding.fit_arguments(arguments, model=self, seed=seed))

    def evaluate(self, *args, **kwargs):
        """Evaluates as `keras.Model.evaluate`; arrays go through a steady pipeline."""
        self._adopt_template_compile()
        arguments = _feeding.bound(keras.Model.evaluate, args, kwargs)
        _monitor.warn_if_given("evaluate", arguments.get("callbacks"), stacklevel=2)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2)
        return super().evaluate(**_feeding.evaluate_arguments(arguments, model=self))

    def predict(self, *args, **kwargs):
        """Predicts as `keras.Model.predict`; arrays go through a steady pipeline."""
        arguments = _feeding.bound(keras.Model.predict, args, kwargs)
        _monitor.warn_if_given("predict", arguments.get("callbacks"), stacklevel=2)
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2)
        return super().predict(**_feeding.predict_arguments(arguments, model=self))

    def train_on_batch(self, x, y=None, sample_weight=None, *args, **kwargs):
        """As `keras.Model.train_on_batch`; arrays are checked as `fit` checks them."""
        _call_checks.check_batch("train_on_batch", self, x, y, sample_weight)
        return super().train_on_batch(x, y, sample_weight, *args, **kwargs)

    def test_on_batch(self, x, y=None, sample_weight=None, *args, **kwargs):
        """As `keras.Model.test_on_batch`; arrays are checked as `evaluate` checks them."""
        _call_checks.check_batch("test_on_batch", self, x, y, sample_weight)
        return super().test_on_batch(x, y, sample_weight, *args, **kwargs)

    def predict_on_batch(self, x):
        """As `keras.Model.predict_on_batch`; arrays are checked as `predict` checks them."""
        _call_checks.check_batch("predict_on_batch", self, x)
        return super().predict_on_batch(x)

    @property
    def split(self) -> list[float] | None:
        """Each device's proportion of a batch: None for even sizes; `split="auto"`: measured."""
        if self._auto_split is not None:
            return self._auto_split.current()
        return None if self._replicas.split is None else list(self._replicas.split)

    def _new_timing(self):
        return _balance.StepTiming(self._replica_devices)

    def call(self, inputs, training=None):
        plan = self._replicas.plan(_split.batch_size(inputs))
        if len(plan.shards) == 1:
            return self._replicas.run(plan, lambda i: self._template(inputs, training=training))[0]
        pieces, shares = self._replicas.pieces(inputs, plan), plan.shares
        if not training and self._compiled is not None:
            return self._replicas.merge(self._compiled.forward(plan, pieces), plan)

        def replica(i):
            _replicas.set_valid(plan.shards[i].counted)
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
        return self._replicas.merge(self._replicas.run(plan, replica, synchronized), plan)

    def make_train_function(self, force=False):
        """Keras' train function; timed on one device under XLA, Keras' step runs plain around the compiled work.

        (The clocks, `numpy_function`s, have no XLA kernel: they stay outside it, in `train_step`.)
        """
        if self.train_function is not None and not force:
            return self.train_function
        outside = self._timing is not None and len(self._replica_devices) == 1 and not self.run_eagerly and self.jit_compile
        self._compiled_work = tf.function(self._train_work, reduce_retracing=True, jit_compile=True) if outside else None
        if not outside:
            return super().make_train_function(force)
        self.jit_compile = False
        try:
            return super().make_train_function(force)
        finally:
            self.jit_compile = True

    def train_step(self, data):
        timing = self._timing
        if timing is None:
            return self._train_work(data)[0]
        started = timing.step_start(data)
        # The work waits for the start's reading: with one shard nothing else would.
        with tf.control_dependencies([started]):
            data = keras.tree.map_structure(_balance.waiting_copy, data)
        if self._compiled_work is not None:
            logs, shards = self._compiled_work(data)
        else:
            logs, shards = self._train_work(data, timing)
        # Its end: the updated weights and the logs (a step may update no weight).
        busy, rows = timing.record(shards, started, (self._updated_weights(), logs))
        if self._auto_split is not None:
            self._auto_split.observe(busy, rows)
        return logs

    def _train_work(self, data, timing=None):
        """The step's work, its timing's readings inside where it has several replicas; its logs and the shards that ran."""
        if self._custom is not None:
            return self._custom.run("train_step", data, timing)
        return self._keras_train_step(data)

    def _keras_train_step(self, data):
        """Keras' training step over the replicas; its logs and the shards that ran."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._replica_step(x, y, sample_weight, training=True)
        if step is None:
            rows = _split.batch_size(x)
            return super().train_step(data), [_split.Shard(0, rows, rows)]
        y_pred, shards = step
        if not self.trainable_weights:
            warnings.warn("The model does not have any trainable weights.", stacklevel=3)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight), shards

    def test_step(self, data):
        if self._custom is not None:
            return self._custom.run("test_step", data)[0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._replica_step(x, y, sample_weight, training=False)
        if step is None:
            return super().test_step(data)
        return self.compute_metrics(x, y, step[0], sample_weight=sample_weight)

    def _replica_step(self, x, y, sample_weight, training):
        """Every replica's forward pass, its part of the loss and (training) its update, by the step's executor.

        Records the batch's loss as Keras' steps do, and returns the merged
        predictions and the shards that ran, or None when the batch runs on
        one replica.
        """
        plan = self._replicas.plan(_split.batch_size(x))
        if len(plan.shards) == 1:
            return None
        timing = self._timing if training else None
        self._build_compile_loss(x, y, sample_weight)
        pieces = self._replicas.pieces((x, y, sample_weight), plan)
        executor = self._compiled if self._compiled is not None else self._threaded
        with _loss_metrics.deferred_loss_metrics(self) as deferred:
            results = executor.run(plan, pieces, training, deferred, timing)
            with tf.device(self._merge_device):
                deferred.flush(plan.batch, plan.shards)
                y_pred = _split.merge([r[0] for r in results], plan.shards)
                losses = [r[1] for r in results]
                # reduction="none" leaves a loss per row: those are merged like outputs.
                loss = tf.add_n(losses) if losses[0].shape.rank == 0 else _split.merge(losses, plan.shards)
        keras_private.loss_tracker(self).update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=plan.batch
        )
        return y_pred, plan.shards

    def _microbatch_order(self):
        """Which replica waits for which (`pipeline`'s 1F1B); None: each starts when it can."""
        return None

    def _sum_device(self, variable) -> str:
        return self._merge_device  # where `cpu_merge` says

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
        y_pred = keras_private.symbolic_outputs(self._template, x)
        compute_output_spec(keras_private.compute_loss, self, x, y, y_pred, sample_weight, False)
