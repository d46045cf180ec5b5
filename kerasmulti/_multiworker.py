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
  replica's loss is its part of the global batch's instead (`_losses`: the
  batch totals it divides by are all-reduced), so a remainder batch (even one
  that leaves a replica empty), masked losses, `"sum"` and
  `"mean_with_sample_weight"` give the loss and gradient of one process on
  the whole batch; logged losses are weighted to match.
- BatchNormalization is synchronised across replicas while the steps trace,
  so its statistics are those of the global batch, as on one device.
- Objects made outside the scope are brought in: an optimizer is re-created
  from its config; a metric's variables are re-created, like the template's.
- Arrays are shuffled with a seed the chief chooses, so every worker keeps
  its part of the same order; data that differs per worker comes as a
  dataset function, padded with empty batches to the longest worker's count.
- fit, evaluate and predict end with a barrier, and a lost worker becomes a
  `ClusterError` that says to restart the job (it resumes from a backup).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import tempfile

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing, data_adapter_utils

from kerasmulti import _cluster, _feeding, _losses, _split
from kerasmulti._parallel import ParallelModel


class WorkerModel(ParallelModel):
    """A parallel model whose replicas are all workers' devices; built by `parallelize`."""

    _runs_replicas = False  # the strategy runs the replicas

    def __init__(self, template, strategy):
        self._strategy = strategy
        devices = list(strategy.extended.worker_devices)
        super().__init__(template, devices, devices[0])

    @property
    def num_workers(self) -> int:
        return self._strategy.extended._num_workers

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """Configures training as `keras.Model.compile`, inside the strategy's scope.

        An optimizer object made outside the scope (as usual) is re-created
        inside it from its config, with its state if it has any: its slots
        must be distributed like the weights. `parallel.optimizer` is then the
        re-created one. Metric objects keep their identity; their variables
        are moved into the scope, so their results cover every worker.
        """
        steps = kwargs.get("steps_per_execution", 1)
        if steps != 1:
            raise ValueError(
                "parallelize() across workers runs one step per execution: with "
                "several, TensorFlow 2.21's multi-worker step fails on an unfed "
                "placeholder. Leave steps_per_execution at 1. "
                f"Received: steps_per_execution={steps!r}"
            )
        with self._strategy.scope():
            super().compile(_in_scope(optimizer, self._strategy), *args, **kwargs)
            # Metric objects made outside the scope (AUC(), ...) hold plain
            # variables, which every worker would read as its own part only.
            for name in ("metrics", "weighted_metrics"):
                for metric in tree.flatten(kwargs.get(name)):
                    if isinstance(metric, keras.metrics.Metric):
                        _adopt_variables(metric.variables)

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
        kwargs = _feeding.bound(keras.Model.fit, (x, y, batch_size, *args), kwargs)
        x, y, batch_size = kwargs.pop("x"), kwargs.pop("y"), kwargs.pop("batch_size")
        self._fit_calls += 1
        seed = self._seed + self._fit_calls  # a new order in every fit() call too
        if callable(x) and not isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
            x = self._per_worker_dataset(x)
        elif isinstance(x, keras.utils.PyDataset):
            x = _WorkerBatches(x, seed if kwargs["shuffle"] else None)
            kwargs["shuffle"] = False
        elif kwargs["shuffle"] and array_data_adapter.can_convert_arrays((x, y)):
            x, y, batch_size, kwargs = self._shuffled(x, y, batch_size, kwargs, seed)
        if kwargs.get("validation_data") is not None:
            kwargs["validation_data"] = _worker_input(kwargs["validation_data"])
        return self._on_all_workers(super().fit, (_worker_input(x), y, batch_size), kwargs)

    def evaluate(self, *args, **kwargs):
        """Evaluates as `keras.Model.evaluate`, each worker on its part of every batch."""
        kwargs = _feeding.bound(keras.Model.evaluate, args, kwargs)
        kwargs["x"] = _worker_input(kwargs["x"])
        return self._on_all_workers(super().evaluate, (), kwargs)

    def predict(self, *args, **kwargs):
        """Predicts as `keras.Model.predict`; every worker returns all the rows, in order."""
        kwargs = _feeding.bound(keras.Model.predict, args, kwargs)
        kwargs["x"] = _worker_input(kwargs["x"])
        return self._on_all_workers(super().predict, (), kwargs)

    def save(self, filepath, *args, **kwargs):
        """Saves the template on the chief only: every worker holds the same weights."""
        if _cluster.is_chief():
            return super().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the template's weights on the chief only."""
        if _cluster.is_chief():
            return super().save_weights(filepath, *args, **kwargs)

    def _shuffled(self, x, y, batch_size, kwargs, seed):
        # Keras shuffles arrays with an unseeded op: each worker would draw
        # its own order and keep its part of it, seeing some samples twice
        # and others never. Here every epoch's order is a function of the
        # chief's seed and the epoch's number: the same on every worker, a
        # new one each epoch, and the same again in a run resumed at that
        # epoch (a reshuffling dataset would start over from its first order).
        sample_weight = kwargs.pop("sample_weight", None)
        arrays = (x, y, sample_weight)
        split = kwargs.pop("validation_split", 0.0)
        if split and kwargs.get("validation_data") is None:
            arrays, validation = array_slicing.train_validation_split(arrays, split)
            kwargs["validation_data"] = validation
        rows = _split.batch_size(arrays[0])
        # Lists are one tensor to tf.data, several inputs to Keras.
        data = tree.lists_to_tuples(data_adapter_utils.pack_x_y_sample_weight(*arrays))
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False)

        def order(_):
            return tf.random.experimental.stateless_shuffle(
                tf.range(rows, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), epoch.read_value()])
            )

        rows_in_order = tf.data.Dataset.range(1).map(order).flat_map(tf.data.Dataset.from_tensor_slices)
        tensors = tree.map_structure(tf.convert_to_tensor, data)
        dataset = rows_in_order.batch(batch_size or 32).map(
            lambda rows: tree.map_structure(lambda t: tf.gather(t, rows), tensors)
        ).prefetch(2)
        options = tf.data.Options()
        options.autotune.enabled = False  # no teardown stall (see _sources.batched)
        # The epoch is read when each epoch's order is drawn.
        options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _EpochOrder(epoch)]
        kwargs["shuffle"] = False
        return dataset.with_options(options), None, None, kwargs

    def _per_worker_dataset(self, dataset_fn):
        strategy = self._strategy
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_workers,
            input_pipeline_id=strategy.extended._id_in_cluster,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        local = _batches(dataset_fn(context))
        counts = _gather_step(strategy, tf.constant(local, tf.int64))
        steps = int(tf.reduce_max(counts))

        def padded(context):
            dataset = dataset_fn(context)
            missing = steps - _batches(dataset)
            if missing == 0:
                return dataset
            empty = tree.map_structure(  # a dimension of any length (padded_batch) gets 0
                lambda spec: tf.zeros([0, *(d or 0 for d in spec.shape[1:])], spec.dtype), dataset.element_spec
            )
            return dataset.concatenate(tf.data.Dataset.from_tensors(empty).repeat(missing))

        return strategy.distribute_datasets_from_function(padded)

    def _on_all_workers(self, method, args, kwargs):
        if not _cluster.is_chief():
            kwargs["verbose"] = 0  # one progress bar, the chief's
        with _lost_workers_explained(f"{method.__name__}()"), _written_by_chief(kwargs.get("callbacks")):
            result = method(*args, **kwargs)
            # Leave together: files the chief wrote or deleted at the end
            # (checkpoints, the backup) are final before any worker goes on.
            _barrier_step(self._strategy)
        return result

    def call(self, inputs, training=None):
        return self._template(inputs, training=training)

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        trainable = self.trainable_weights
        with tf.GradientTape() as tape, _synchronized_batchnorm(self._batchnorm):
            y_pred = self(x, training=True)
            loss = self._replica_loss(x, y, y_pred, sample_weight, training=True)
            scaled = self.optimizer.scale_loss(loss)
        if trainable:
            gradients = tape.gradient(scaled, trainable)
            self.optimizer.apply_gradients(zip(gradients, trainable))
        return _with_leading_axis(self.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

    def test_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        self._replica_loss(x, y, y_pred, sample_weight, training=False)
        return _with_leading_axis(self.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

    def _replica_loss(self, x, y, y_pred, sample_weight, training):
        """This replica's part of the global batch's loss, recorded as Keras' steps do."""
        share, rows = _share(x)
        with self._part(share, rows):
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
            )
        # part / share, weighted by this replica's rows: the mean across
        # workers is the global batch's loss.
        self._loss_tracker.update_state(tf.math.divide_no_nan(loss, share), sample_weight=rows)
        return loss

    @contextlib.contextmanager
    def _part(self, share, rows):
        """Losses are this replica's part of the global batch's (see `_losses`).

        Keras' per-output loss trackers record each value times the replica
        count, weighted by the batch's rows; recording part / share with this
        replica's rows instead makes their mean across workers the global
        batch's value.
        """
        context = tf.distribute.get_replica_context()
        trackers = list(getattr(self._compile_loss, "metrics", None) or [])

        def record(tracker):
            def update_state(values, sample_weight=None):
                scale = share * context.num_replicas_in_sync  # Keras multiplied by the count
                type(tracker).update_state(tracker, tf.math.divide_no_nan(values, scale), sample_weight=rows)

            return update_state

        for tracker in trackers:
            tracker.update_state = record(tracker)
        try:
            with _losses.replica_part(share, 1.0, rows, lambda value, by_rows: context.all_reduce("sum", value)):
                yield
        finally:
            for tracker in trackers:
                del tracker.update_state

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras reduces the first distributed batch to build the model, which
        # fails across workers; one replica's part has the shapes it needs.
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        data_batch = tree.map_structure(self._first_replica, data_batch)
        with self._strategy.scope():
            self._symbolic_build(data_batch=data_batch)

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


def _in_scope(optimizer, strategy):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    if getattr(optimizer, "_distribution_strategy", strategy) is strategy:
        return optimizer
    config = optimizer.get_config()
    learning_rate = optimizer._learning_rate
    if not isinstance(learning_rate, keras.Variable):
        # A schedule or a callable: shared as it is; its config may name a
        # class or a lambda that from_config cannot rebuild.
        config["learning_rate"] = learning_rate
    adopted = optimizer.__class__.from_config(config)
    if optimizer.built:
        adopted.build([v for v in optimizer._trainable_variables])
        for new, old in zip(adopted.variables, optimizer.variables):
            new.assign(old)
    return adopted


@tf.autograph.experimental.do_not_convert
def _barrier(strategy):
    return strategy.reduce("sum", strategy.run(lambda: tf.constant(1.0)), axis=None)


@tf.autograph.experimental.do_not_convert
def _gather_one(strategy, value):
    return strategy.gather(strategy.run(lambda: tf.reshape(value, [1])), axis=0)


# Made once, traced once per strategy: a tf.function made at every call would
# retrace every time, and TensorFlow warns about that after five.
_barrier_step = tf.function(_barrier)
_gather_step = tf.function(_gather_one)


def _batches(dataset) -> int:
    count = int(dataset.cardinality())
    if count < 0:
        raise ValueError(
            "A per-worker dataset function must return a dataset of known, "
            "finite length, so that workers with fewer batches can be padded "
            "to the others' count. Give it one with "
            "`dataset.apply(tf.data.experimental.assert_cardinality(n))`, or "
            "drop `.repeat()`. Received: cardinality="
            f"{'infinite' if count == tf.data.INFINITE_CARDINALITY else 'unknown'}"
        )
    return count


def _cause(error) -> str:
    lines = [line.strip() for line in error.message.splitlines() if line.strip()]
    useful = [line for line in lines if "abort" in line or "unhealthy" in line or "down" in line]
    return (useful or lines or [""])[0]


@contextlib.contextmanager
def _lost_workers_explained(what: str):
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as error:
        raise _cluster.ClusterError(
            f"Multi-worker {what} stopped because a worker of the cluster is "
            "gone (killed, crashed or unreachable); the others cannot go on "
            "without its part of every step. Start the whole job again: with "
            "kerasmulti.ParallelBackupAndRestore among the callbacks it resumes "
            f"from the last epoch saved. Received: error={type(error).__name__}({_cause(error)!r})"
        ) from error


def _rows(x):
    return tf.shape(tree.flatten(x)[0])[0]


def _share(x):
    """This replica's share of the global batch's rows, and its rows (float32)."""
    rows = tf.cast(_rows(x), "float32")
    total = tf.distribute.get_replica_context().all_reduce("sum", rows)
    return tf.math.divide_no_nan(rows, total), rows


def _with_leading_axis(logs):
    return tree.map_structure(lambda value: tf.expand_dims(value, 0), logs)


@contextlib.contextmanager
def _synchronized_batchnorm(layers):
    previous = [layer.synchronized for layer in layers]
    for layer in layers:
        layer.synchronized = True
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer.synchronized = value


def _adopt_variables(variables) -> None:
    """Re-creates Keras variables in the current strategy scope, keeping their values."""
    for variable in variables:
        if not isinstance(variable.value, tf.distribute.DistributedValues):
            variable._initialize(variable.value.read_value())


def adopt(template: keras.Model, strategy) -> WorkerModel:
    """Moves the template's variables into `strategy` and wraps it for training.

    The values are kept; the strategy then broadcasts the chief's, so every
    worker starts from the chief's weights even if it built its model with
    another seed. The chief also chooses the seed that shuffles arrays in
    `fit`: each worker reads the same input and keeps its part of every
    batch, so their shuffles must agree.
    """
    with _lost_workers_explained("parallelize()"), strategy.scope():
        seed = tf.Variable(_shuffle_seed(), dtype="int64", trainable=False)
        _adopt_variables(template.variables)
        for attribute in ("train_function", "test_function", "predict_function"):
            setattr(template, attribute, None)
        parallel = WorkerModel(template, strategy)
    parallel._seed, parallel._fit_calls = int(seed.numpy()), 0
    return parallel


def _shuffle_seed() -> int:
    """The seed the chief proposes for shuffling arrays.

    Reproducible when the program seeded Python's `random` (as
    `keras.utils.set_random_seed` does), else random; read from the state
    without drawing from it, so the user's random streams stay as in one
    process.
    """
    digest = hashlib.sha256(repr(random.getstate()).encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1)


def _worker_input(data):
    """An input every worker reads whole, keeping its part of each batch.

    A PyDataset's batches are copied (see `_WorkerBatches`). TensorFlow's
    default splits a tf.data pipeline that reads files by file, so each
    worker would read other files: other batches than one process, and
    predictions out of order; it is split by rows instead, unless the user
    chose a policy.
    """
    if isinstance(data, keras.utils.PyDataset) and not isinstance(data, _WorkerBatches):
        return _WorkerBatches(data)
    if not isinstance(data, tf.data.Dataset):
        return data
    if data.options().experimental_distribute.auto_shard_policy != tf.data.experimental.AutoShardPolicy.AUTO:
        return data
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return data.with_options(options)


class _EpochOrder(keras.callbacks.Callback):
    """Sets the epoch that an input's order is drawn for, as each epoch begins."""

    def __init__(self, epoch: tf.Variable):
        super().__init__()
        self._epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch.assign(epoch)


class _WorkerBatches(keras.utils.PyDataset):
    """A PyDataset's batches, copied, in an order every worker draws alike.

    Keras shuffles a PyDataset with each process's own `random`: each worker
    would take its part of other batches, some samples twice, others never.
    With `seed`, the order is drawn from it, anew each epoch; without, it is
    the dataset's own. Batches are copies: across workers TensorFlow 2.21
    takes a generator's arrays without copying and may write into them,
    which corrupted the user's arrays behind the batches (labels of the last
    batch of an epoch replaced by other numbers, measured).
    """

    def __init__(self, data, seed=None):
        super().__init__(
            workers=getattr(data, "workers", 1),
            use_multiprocessing=getattr(data, "use_multiprocessing", False),
            max_queue_size=getattr(data, "max_queue_size", 10),
        )
        self.data, self.seed, self.epoch = data, seed, 0
        self.order = self._draw()

    def _draw(self):
        if self.seed is None or self.data.num_batches is None:  # no order to draw from an endless one
            return None
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.data.num_batches)

    @property
    def num_batches(self):
        return self.data.num_batches

    def __getitem__(self, index):
        batch = self.data[index if self.order is None else int(self.order[index])]
        return tree.map_structure(lambda a: np.array(a) if isinstance(a, np.ndarray) else a, batch)

    def on_epoch_begin(self):
        self.data.on_epoch_begin()

    def on_epoch_end(self):
        self.data.on_epoch_end()
        self.epoch += 1
        self.order = self._draw()


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
