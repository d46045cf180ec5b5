"""What each worker reads: its part of every global batch, in an order all workers share.

Every worker passes `fit` the same global data and keeps its part of each
batch, so every worker must draw the same order. Keras draws it with each
process's own random state; here it comes from a seed the chief chooses:

- Arrays become a dataset whose order in each epoch is a function of the
  seed and the epoch's number: the same on every worker, a new one each
  epoch (and each `fit` call), and the same again in a run resumed there.
- A `PyDataset`'s batches are copied (`WorkerBatches`), in an order drawn
  from the seed.
- A `tf.data` pipeline is split by rows, not by file.
- Data that differs per worker comes as a dataset function, padded with
  empty batches to the longest worker's count.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src import cluster as _cluster
from kerasmulti._src.data_parallel import epoch_order as _epoch_order
from kerasmulti._src.data_parallel.epoch_order import shuffle_seed  # noqa: F401 (the chief's seed)
from kerasmulti._src.keras_private import array_data_adapter, array_slicing
from kerasmulti._src.utils.arguments import is_int


def fit_arguments(strategy, arguments: dict, seed: int) -> dict:
    """`fit`'s bound arguments with every worker's input in the order `seed` draws.

    Args:
        strategy: The cluster's `MultiWorkerMirroredStrategy`.
        arguments: `keras.Model.fit`'s arguments, all by name.
        seed: Shared by every worker; a new one for each `fit` call.
    """
    x = arguments["x"]
    if callable(x) and not isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        arguments["x"] = _per_worker_dataset(strategy, x)
    elif isinstance(x, keras.utils.PyDataset):
        if arguments["shuffle"] and _epoch_order.resumable(x, arguments["steps_per_epoch"]):  # an order a backup resumes
            order = _epoch_order.EpochOrder(seed)
            arguments["callbacks"] = _epoch_order.with_callback(arguments["callbacks"], order)
            arguments["x"] = WorkerBatches(_epoch_order.OrderedBatches(x, order))
        else:
            arguments["x"] = WorkerBatches(x, seed if arguments["shuffle"] else None)
        arguments["shuffle"] = False
    elif arguments["shuffle"] and array_data_adapter.can_convert_arrays((x, arguments["y"])):
        arguments = _shuffled(arguments, seed)
    if arguments.get("validation_data") is not None:
        arguments["validation_data"] = worker_input(arguments["validation_data"])
    arguments["x"] = worker_input(arguments["x"])
    return arguments


def _shuffled(kwargs, seed):
    """`fit`'s arrays as a dataset whose order is drawn from `seed` and the epoch's number."""
    # Keras shuffles arrays with an unseeded op: each worker would draw
    # its own order and keep its part of it, seeing some samples twice
    # and others never (`epoch_order`).
    arrays = (kwargs.pop("x"), kwargs.pop("y"), kwargs.pop("sample_weight", None))
    split = kwargs.pop("validation_split", 0.0)
    if split and kwargs.get("validation_data") is None:
        arrays, validation = array_slicing.train_validation_split(arrays, split)
        kwargs["validation_data"] = validation
    batch_size = kwargs.pop("batch_size")
    if kwargs.get("validation_data") is not None and not isinstance(kwargs["validation_data"], tf.data.Dataset):
        # Batched as Keras batches them (its batch size goes with the training arrays): validation_steps counts them.
        kwargs["validation_batch_size"] = kwargs.get("validation_batch_size") or batch_size
    order = _epoch_order.EpochOrder(seed)
    dataset = _epoch_order.shuffled(*arrays, batch_size, kwargs.pop("class_weight", None), order)
    kwargs["callbacks"] = _epoch_order.with_callback(kwargs.get("callbacks"), order)
    kwargs.update(x=dataset, y=None, batch_size=None, shuffle=False)
    return kwargs


def _per_worker_dataset(strategy, dataset_fn):
    """This worker's dataset from `dataset_fn`, padded with empty batches to the longest worker's count."""
    context = tf.distribute.InputContext(
        num_input_pipelines=_cluster.worker_count(strategy),
        input_pipeline_id=_cluster.worker_index(strategy),
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )
    local = _batches(dataset_fn(context))
    counts = gather_step(strategy, tf.constant(local, tf.int64))
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


def check_alike(strategy, arguments: dict, monitored: bool) -> None:
    """Refuses a `fit` whose workers were given what must be alike on all of them (one collective).

    A `ThroughputMonitor` on some workers only would leave the others' gathers
    waiting; another global batch size, row count or epoch count would train
    other batches on each worker (or fail in a collective, naming no cause).
    """
    x = arguments.get("x")
    leaves = tree.flatten(x) if x is not None else []
    rows = len(leaves[0]) if leaves and isinstance(leaves[0], np.ndarray) else -1
    alike = {"batch_size": arguments.get("batch_size"), "rows": rows, "epochs": arguments.get("epochs"),
             "steps_per_epoch": arguments.get("steps_per_epoch")}
    values = [int(monitored)] + [int(v) if is_int(v) else -1 for v in alike.values()]
    local = len(strategy.extended.worker_devices)
    table = gather_step(strategy, tf.constant(values, tf.int64)).numpy()[::local]  # one row per worker
    if table[:, 0].any() and not table[:, 0].all():
        raise ValueError(
            "A ThroughputMonitor was passed to fit() on some workers only; it gathers every "
            "worker's figures. Pass it on every worker, or on none. "
            f"Received: workers_with_monitor={int(table[:, 0].sum())} of {len(table)}"
        )
    for column, name in enumerate(alike, start=1):
        if len(set(table[:, column])) > 1:
            given = [None if v == -1 else int(v) for v in table[:, column]]
            raise ValueError(
                f"fit() got a different {'number of rows' if name == 'rows' else name} on each worker; every worker "
                "passes the same global data. "
                f"Pass the same on all. Received: {name}={given} (by worker)"
            )


@tf.autograph.experimental.do_not_convert
def _gather(strategy, value):
    """`value` as every replica's worker holds it, stacked along a new first axis."""
    return strategy.gather(strategy.run(lambda: tf.expand_dims(value, 0)), axis=0)


# Made once, traced once per strategy and shape: a tf.function made at every
# call would retrace every time, and TensorFlow warns about that after five.
gather_step = tf.function(_gather, autograph=False)


def _batches(dataset) -> int:
    count = int(dataset.cardinality())
    if count < 0:
        # Workers with fewer batches are padded to the others' count, which
        # must be known.
        raise ValueError(
            "A per-worker dataset function must return a dataset of known, finite length. Drop "
            "`.repeat()`, or apply tf.data.experimental.assert_cardinality(n). Received: cardinality="
            f"{'infinite' if count == tf.data.INFINITE_CARDINALITY else 'unknown'}"
        )
    return count


def worker_input(data):
    """An input every worker reads whole, keeping its part of each batch.

    A PyDataset's batches are copied (see `WorkerBatches`). TensorFlow's
    default splits a tf.data pipeline that reads files by file, so each
    worker would read other files: other batches than one process, and
    predictions out of order; it is split by rows instead, unless the user
    chose a policy.
    """
    if isinstance(data, keras.utils.PyDataset) and not isinstance(data, WorkerBatches):
        return WorkerBatches(data)
    if not isinstance(data, tf.data.Dataset):
        return data
    if data.options().experimental_distribute.auto_shard_policy != tf.data.experimental.AutoShardPolicy.AUTO:
        return data
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return data.with_options(options)


class WorkerBatches(keras.utils.PyDataset):
    """A PyDataset's batches, copied, in an order every worker draws alike.

    Keras shuffles a PyDataset with each process's own `random`: each worker
    would take its part of other batches, some samples twice, others never.
    With `seed`, the order is drawn from it, anew each epoch; without, it is
    the dataset's own. Batches are copies because across workers TensorFlow
    2.21 takes a generator's arrays without copying and may write into them:
    the user's arrays behind the batches would be overwritten (such as the
    labels of an epoch's last batch).
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
