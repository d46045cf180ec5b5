"""`parallelize` across worker processes, on `MultiWorkerMirroredStrategy`.

The engine is TensorFlow's: the strategy all-reduces gradients between
workers (and between the GPUs of each), shards the input, and broadcasts the
chief's initial weights. kerasmulti adopts the user's model into it and works
around what breaks Keras 3 `fit` there:

- Adoption: each of the template's variables is re-created inside the
  strategy's scope from its current value, so the template itself becomes the
  distributed model. There is no clone to keep in sync: the object the user
  holds, saves and checkpoints is the one being trained.
- Keras' symbolic build reduces a per-replica batch, which crashes
  (keras-team/keras#20585); the model is built from one replica's batch instead.
- Keras averages a step's logs across workers along axis 0, which fails for
  scalars; the steps return every log with a leading axis of one.
- Keras scales each replica's loss by 1/replicas, which is exact only when the
  global batch splits evenly and the loss is a plain mean over rows. Each
  replica's loss is its part of the global batch's instead (`loss_parts`: the
  batch totals it divides by are all-reduced), so a remainder batch (even one
  that leaves a replica empty), masked losses, `"sum"` and
  `"mean_with_sample_weight"` give the loss and gradient of one process on
  the whole batch; logged losses are weighted to match.
- BatchNormalization is synchronised across replicas while the steps trace,
  so its statistics are those of the global batch, as on one device; each
  replica adds its index to its random seeds (Dropout's), which the
  strategy would keep equal on every replica (`worker_steps.keras_step`).
- A template with steps of its own (a GAN, a VAE) runs them on every
  replica, with one process's numbers (`worker_steps.py`).
- Keras' gradient accumulation merges inside a `cond`, which crashes under
  the strategy (keras-team/keras#20582); `accumulation` runs the same
  algorithm with its synchronisation outside the `cond`.
- Objects made outside the scope are brought in: an optimizer is re-created
  from its config; a metric's variables are re-created, like the template's.
- Every worker reads the same input and keeps its part of each batch, in an
  order drawn from a seed the chief chooses (`worker_inputs`).
- fit, evaluate and predict end with a barrier, and a lost worker becomes a
  `ClusterError` that says to restart the job (it resumes from a backup).
- `ThroughputMonitor` times each replica inside the step, not counting its
  waits in collectives (`balance.ReplicaTiming`), and gathers every worker's figures at each
  epoch's end, a collective: `fit` checks first that every worker has one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import keras
import tensorflow as tf
from keras import tree

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import feeding as _feeding
from kerasmulti._src.data_parallel import loss_metrics as _loss_metrics
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import monitor as _monitor
from kerasmulti._src.data_parallel import row_mixing as _row_mixing
from kerasmulti._src.data_parallel.parallel_model import ParallelModel
from kerasmulti._src.multi_worker import accumulation as _accumulation
from kerasmulti._src.multi_worker import adoption as _adoption
from kerasmulti._src.multi_worker import worker_inputs as _worker_inputs
from kerasmulti._src.multi_worker import worker_steps as _worker_steps
from kerasmulti._src.utils import patching as _patching


class WorkerModel(ParallelModel):
    """A `ParallelModel` whose replicas are all workers' devices; built by `parallelize`."""

    def __init__(self, template, strategy):
        self._strategy = strategy
        devices = list(strategy.extended.worker_devices)
        super().__init__(template, devices, devices[0])

    @property
    def num_workers(self) -> int:
        return _cluster.worker_count(self._strategy)

    def compile(self, *args, **kwargs):
        """Configures training as `keras.Model.compile`, inside the strategy's scope.

        An optimizer object made outside the scope (as usual) is re-created
        inside it from its config, with its state if it has any: its slots
        must be distributed like the weights. `parallel.optimizer` is then the
        re-created one. Metric objects keep their identity; their variables
        are moved into the scope, so their results cover every worker. A
        template with steps of its own is compiled with its own `compile`; the
        optimizers it keeps (a GAN's two) are re-created alike.
        """
        steps = kwargs.get("steps_per_execution", 1)
        if steps != 1:
            # With several, TensorFlow 2.21's multi-worker step fails on an
            # unfed placeholder.
            raise ValueError(
                "parallelize() across workers runs one step per execution. Leave "
                f"steps_per_execution at 1. Received: steps_per_execution={steps!r}"
            )
        with self._strategy.scope():
            if args and self._custom is None:
                args = (_adoption.optimizer_in_scope(args[0], self._strategy), *args[1:])
            elif "optimizer" in kwargs and self._custom is None:
                kwargs["optimizer"] = _adoption.optimizer_in_scope(kwargs["optimizer"], self._strategy)
            super().compile(*args, **kwargs)
            _accumulation.check(self.optimizer, self.trainable_weights)
            # Metric objects made outside the scope (AUC(), ...) hold plain
            # variables, which every worker would read as its own part only.
            for name in ("metrics", "weighted_metrics"):
                for metric in tree.flatten(kwargs.get(name)):
                    if isinstance(metric, keras.metrics.Metric):
                        _adoption.adopt_variables(metric.variables)

    def _replica_count(self) -> int:
        return self._strategy.num_replicas_in_sync

    def _compile_as_template(self, jit_compile="auto") -> None:
        with self._strategy.scope():
            _adoption.template_optimizers_in_scope(self._template, self._strategy)
            super()._compile_as_template(jit_compile)

    def _custom_steps(self):
        return _worker_steps.WorkerSteps(self._template)

    def _outer_jit_compile(self, jit_compile, run_eagerly: bool):
        return jit_compile if len(self._replica_devices) == 1 else False  # the strategy runs the replicas

    def _resolve_auto_jit_compile(self):
        # XLA would compile the step around the strategy's collectives, a
        # combination Keras does not test; the default stays off.
        return False

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Trains as `keras.Model.fit`, every worker taking its part of each global batch.

        Every worker passes the same global data (arrays or a `tf.data`
        dataset batched with the global batch size); each keeps its own part
        of every batch. Arrays are shuffled with a seed the workers share,
        differently in every epoch, so each sample is seen once per epoch
        across the cluster. For data that differs between workers (each
        reads its own files), pass `x` as a function, as Keras 2's
        `DatasetCreator` took: it gets a `tf.distribute.InputContext` and
        returns this worker's `tf.data.Dataset`, batched per replica. Workers
        whose data runs out first take empty batches until the others are
        done, so uneven sizes train as one process would on the workers'
        batches put together.
        """
        arguments = _feeding.bound(keras.Model.fit, (x, y, batch_size, *args), kwargs)
        with _cluster.lost_workers_explained("fit()"):
            _worker_inputs.check_alike(self._strategy, arguments, bool(_monitor.monitors(arguments.get("callbacks"))))
            self._adopt_template_compile()
            _monitor.attach(self, arguments.get("callbacks"))
        _row_mixing.probe_once(self, arguments.get("x"), stacklevel=2, training=True)
        _row_mixing.probe_loss_once(self, arguments, stacklevel=2)
        self._fit_started(arguments)
        seed = self._seed + self._fit_calls  # a new order in every fit() call too
        return self._on_all_workers(super().fit, (), _worker_inputs.fit_arguments(self._strategy, arguments, seed))

    def evaluate(self, *args, **kwargs):
        """Evaluates as `keras.Model.evaluate`, each worker on its part of every batch."""
        with _cluster.lost_workers_explained("evaluate()"):
            self._adopt_template_compile()
        kwargs = _feeding.bound(keras.Model.evaluate, args, kwargs)
        _monitor.warn_if_given("evaluate", kwargs.get("callbacks"), stacklevel=2)
        _row_mixing.probe_once(self, kwargs.get("x"), stacklevel=2)
        kwargs["x"] = _worker_inputs.worker_input(kwargs["x"])
        return self._on_all_workers(super().evaluate, (), kwargs)

    def predict(self, *args, **kwargs):
        """Predicts as `keras.Model.predict`; every worker returns all the rows, in order."""
        kwargs = _feeding.bound(keras.Model.predict, args, kwargs)
        _monitor.warn_if_given("predict", kwargs.get("callbacks"), stacklevel=2)
        _row_mixing.probe_once(self, kwargs.get("x"), stacklevel=2)
        kwargs["x"] = _worker_inputs.worker_input(kwargs["x"])
        return self._on_all_workers(super().predict, (), kwargs)

    def predict_on_batch(self, x):
        """Predicts one batch as `keras.Model.predict_on_batch`, each worker on its part of its rows.

        Keras' own would run the whole batch on every replica and return its rows once per replica.
        """
        return self.predict(x, batch_size=int(tree.flatten(x)[0].shape[0]), verbose=0)

    def save(self, filepath, *args, **kwargs):
        """Saves the template on the chief only: every worker holds the same weights."""
        if _cluster.is_chief():
            return super().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the template's weights on the chief only."""
        if _cluster.is_chief():
            return super().save_weights(filepath, *args, **kwargs)

    def export(self, filepath, *args, **kwargs):
        """Exports the template on the chief only."""
        if _cluster.is_chief():
            return super().export(filepath, *args, **kwargs)

    def _on_all_workers(self, method, args, kwargs):
        if not _cluster.is_chief():
            kwargs["verbose"] = 0  # one progress bar, the chief's
        with _cluster.lost_workers_explained(f"{method.__name__}()"), _written_by_chief(kwargs.get("callbacks")):
            result = method(*args, **kwargs)
            # Leave together: files the chief wrote or deleted at the end
            # (checkpoints, the backup) are final before any worker goes on.
            _barrier_step(self._strategy)
        return result

    def _any_worker(self, flag: bool) -> bool:
        """Whether `flag` is set on any worker (a collective: every worker calls it alike)."""
        return bool(_worker_inputs.gather_step(self._strategy, tf.constant(int(flag), tf.int64)).numpy().any())

    def _wait_for_all(self) -> None:
        _barrier_step(self._strategy)

    def call(self, inputs, training=None):
        return self._template(inputs, training=training)

    def train_step(self, data):
        if self._timing is None:
            return self._train_step(data)
        context = tf.distribute.get_replica_context()  # its replicas' waits in collectives are not busy time
        with _patching.patched([(context, "all_reduce", self._timing.timed(context.all_reduce))]):
            return self._train_step(data)

    def _train_step(self, data):
        if self._timing is not None:
            data, started = self._timing.start(data)
        if self._custom is not None:  # the template's own step (`worker_steps.py`)
            logs = self._custom.run("train_step", data)
            if self._timing is not None:
                self._timing.record(started, logs, self._updated_weights(), _worker_steps.replica_rows(data))
            return _with_leading_axis(logs)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable = self.trainable_weights
        with tf.GradientTape() as tape, _worker_steps.keras_step(self._template, self._batchnorm):
            y_pred = self(x, training=True)
            loss = self._replica_loss(x, y, y_pred, sample_weight, training=True)
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, trainable) if trainable else []
        computed = (y_pred, loss, gradients)
        if trainable:
            if _accumulation.accumulates(self.optimizer):
                _accumulation.apply(self.optimizer, gradients, trainable)  # Keras' crashes here
            else:  # clipped and checked finite as the global batch's (`apply_summed`)
                _worker_steps.apply_summed(self.optimizer, self.optimizer.apply, gradients, trainable)
        if self._timing is not None:
            self._timing.record(started, computed, self._updated_weights(), _worker_steps.replica_rows(x))
        return self._logs(x, y, y_pred, sample_weight)

    def _new_timing(self):
        strategy = self._strategy
        return _balance.ReplicaTiming(_cluster_devices(strategy), lambda table: _worker_inputs.gather_step(strategy, table))

    def test_step(self, data):
        if self._custom is not None:
            return _with_leading_axis(self._custom.run("test_step", data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        self._replica_loss(x, y, y_pred, sample_weight, training=False)
        return self._logs(x, y, y_pred, sample_weight)

    def _logs(self, x, y, y_pred, sample_weight):
        # The whole batch's on every replica: Keras averages the replicas'
        # logs, which for their own running results is not the batch's.
        with _worker_steps.whole_batch_results(self.metrics):
            return _with_leading_axis(self.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

    def _replica_loss(self, x, y, y_pred, sample_weight, training):
        """This replica's part of the global batch's loss, recorded as Keras' steps do."""
        share, rows, total = _worker_steps.share_of_batch(x)
        with self._part(share, rows, total):
            loss = keras_private.compute_loss(self, x, y, y_pred, sample_weight, training)
        # part / share, weighted by this replica's rows: the mean across
        # workers is the global batch's loss.
        keras_private.loss_tracker(self).update_state(tf.math.divide_no_nan(loss, tf.cast(share, loss.dtype)), sample_weight=rows)
        return loss

    @contextlib.contextmanager
    def _part(self, share, rows, total):
        """Losses are this replica's part of the global batch's (`loss_parts`), and recorded so (`loss_metrics`)."""
        context = tf.distribute.get_replica_context()
        summed = _loss_parts.counted_or_summed(rows, total, lambda value, by_rows: context.all_reduce("sum", value))
        with _loss_metrics.recorded_by_share(self, share, rows, context.num_replicas_in_sync), \
                _loss_parts.replica_part(share, 1.0, rows, summed):
            yield

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras reduces the first distributed batch to build the model, which
        # fails across workers; one replica's part has the shapes it needs.
        self._remember_epochs(iterator)
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        data_batch = tree.map_structure(self._first_replica, data_batch)
        model = self if self._custom is None else self._template
        if model is not self and not _compiled_with_loss_or_metrics(model):
            return  # a GAN: nothing to build before its step (it may have no call)
        with self._strategy.scope():
            keras_private.symbolic_build(model, data_batch)

    def _first_replica(self, value):
        if isinstance(value, tf.distribute.DistributedValues):
            return self._strategy.experimental_local_results(value)[0]
        return value

    def summary(self, *args, **kwargs):
        """Prints the template's summary, preceded by the cluster's replicas."""
        print(
            f"Data-parallel over {self._strategy.num_replicas_in_sync} replica(s) on "
            f"{self.num_workers} worker(s); this worker's: {', '.join(self._replica_devices)}."
        )
        return self._template.summary(*args, **kwargs)


@tf.autograph.experimental.do_not_convert
def _barrier(strategy):
    return strategy.reduce("sum", strategy.run(lambda: tf.constant(1.0)), axis=None)


# Made once, traced once per strategy: a tf.function made at every call would
# retrace every time, and TensorFlow warns about that after five.
_barrier_step = tf.function(_barrier, autograph=False)


def _cluster_devices(strategy) -> list[str]:
    """Every replica's device, in the strategy's replica order (workers in turn, chief first)."""
    local = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    tasks = [(job, task) for job in ("chief", "worker") for task in range(len(spec.get(job, [])))]
    if not tasks:
        return [d.to_string() for d in local]
    return [d.replace(job=job, task=task).to_string() for job, task in tasks for d in local]


def _compiled_with_loss_or_metrics(model) -> bool:
    arguments = keras_private.compile_arguments(model)
    return any(arguments.get(name) is not None for name in ("loss", "metrics", "weighted_metrics"))


def _with_leading_axis(logs):
    return tree.map_structure(lambda value: tf.expand_dims(value, 0), logs)


def adopt(template: keras.Model, strategy) -> WorkerModel:
    """Moves the template's variables into `strategy` and wraps it for training.

    The values are kept; the strategy then broadcasts the chief's, so every
    worker starts from the chief's weights even if it built its model with
    another seed. The chief also chooses the seed that shuffles arrays in
    `fit`: each worker reads the same input and keeps its part of every
    batch, so their shuffles must agree.
    """
    with _cluster.lost_workers_explained("parallelize()"), strategy.scope():
        seed = tf.Variable(_worker_inputs.shuffle_seed(), dtype="int64", trainable=False)
        # Metrics are not among a model's variables: a GAN's trackers, a layer's own.
        _adoption.adopt_variables(template.variables + [v for m in _custom_steps.metrics(template) for v in m.variables])
        for attribute in ("train_function", "test_function", "predict_function"):
            setattr(template, attribute, None)
        parallel = WorkerModel(template, strategy)
    parallel._seed, parallel._fit_calls = int(seed.numpy()), 0
    parallel._adopt_template_compile()  # a compiled template makes a compiled model, as in one process
    return parallel


@contextlib.contextmanager
def _written_by_chief(callbacks):
    """Inside: Keras callbacks that write files write them on the chief only.

    On the other workers, `CSVLogger` and `TensorBoard` write into a
    temporary folder, deleted afterwards, as Keras 2 did: all workers writing
    the same file would clobber it. (Saving goes through the parallel model,
    whose `save` writes on the chief only.)
    """
    if _cluster.is_chief() or not callbacks:
        yield
        return
    attributes = {keras.callbacks.CSVLogger: "filename", keras.callbacks.TensorBoard: "log_dir"}
    moved = []
    with tempfile.TemporaryDirectory(prefix="kerasmulti-worker-") as folder:
        for callback in tree.flatten(callbacks):
            for kind, attribute in attributes.items():
                if isinstance(callback, kind):
                    original = getattr(callback, attribute)
                    name = os.path.basename(str(original).rstrip("/")) or "log"
                    setattr(callback, attribute, os.path.join(folder, name))
                    moved.append((callback, attribute, original))
        try:
            yield
        finally:
            for callback, attribute, original in moved:
                setattr(callback, attribute, original)
