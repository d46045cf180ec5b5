"""Shuffled arrays in an order a resumed run can read again.

Keras shuffles arrays with an unseeded random op: each epoch's order depends
on every order drawn before it in the process, so a run resumed at epoch 5
(or in the middle of it) reads other batches than the run it continues.
Here each epoch's order is a function of a seed and the epoch's number:

    order(epoch) = stateless_shuffle(range(rows), seed=(seed, epoch))

a new order every epoch, and the same again in any process that knows the
seed. The seed lives in a variable that `ParallelBackupAndRestore` writes
into its backup and restores, so a resumed run draws what the interrupted
one would have, also when the program was not seeded. The rows themselves
are Keras' own: its array adapter casts them and turns `class_weight` into
sample weights, once, before they are gathered batch by batch.

Used for `fit(shuffle=True)` on arrays across workers (every worker must
draw the same order) and, in one process, when a `ParallelBackupAndRestore`
is among the callbacks; there also for a `PyDataset`'s batches
(`OrderedBatches`).
"""

from __future__ import annotations

import hashlib
import random

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src.keras_private import array_data_adapter


def shuffle_seed() -> int:
    """A seed for an input order.

    Reproducible when the program seeded Python's `random` (as
    `keras.utils.set_random_seed` does), else random; read from the state
    without drawing from it, so the user's random streams stay as they
    would be without kerasmulti.
    """
    digest = hashlib.sha256(repr(random.getstate()).encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1)


def seed_for(callbacks, fit_calls: int) -> int | None:
    """The seed of one process's `fit` on shuffled arrays: None (Keras' own order) without a backup.

    A backup that resumes the order (`ParallelBackupAndRestore`) needs it
    drawn from a seed; `fit_calls` makes each `fit` call's orders new.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    if not any(getattr(c, "resumes_input_order", False) for c in callbacks or []):
        return None
    return shuffle_seed() + fit_calls


class EpochOrder(keras.callbacks.Callback):
    """The seed and the epoch an input's order is drawn from; sets the epoch as each begins.

    While `fit` runs, the model's `_input_order` is this object, so that a
    backup can write and restore `seed`.
    """

    def __init__(self, seed: int):
        super().__init__()
        self.seed = tf.Variable(seed, dtype=tf.int64, trainable=False)
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False)

    def set_model(self, model):
        super().set_model(model)
        model._input_order = self

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch.assign(epoch)

    def on_train_end(self, logs=None):
        self.model._input_order = None


def with_callback(callbacks, callback):
    """`fit`'s `callbacks` with `callback` added (a list, or Keras' `CallbackList`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(callback)
        return callbacks
    return [*(callbacks or []), callback]


def shuffled(x, y, sample_weight, batch_size, class_weight, order: EpochOrder) -> tf.data.Dataset:
    """`fit`'s arrays as batches whose rows come in `order`'s order for the current epoch."""
    # One batch of every row: Keras' casting and class weights, applied once.
    whole = array_data_adapter.ArrayDataAdapter(
        x, y, sample_weight=sample_weight, batch_size=2**62, shuffle=False, class_weight=class_weight
    )
    tensors = next(iter(whole.get_tf_dataset()))
    rows = int(tree.flatten(tensors)[0].shape[0])

    def draw(_):
        seed = tf.stack([order.seed.read_value(), order.epoch.read_value()])
        return tf.random.experimental.stateless_shuffle(tf.range(rows, dtype=tf.int64), seed=seed)

    in_order = tf.data.Dataset.range(1).map(draw).flat_map(tf.data.Dataset.from_tensor_slices)
    # flat_map hides the length, and Keras would warn at the first epoch's
    # end that the input "ran out of data".
    in_order = in_order.apply(tf.data.experimental.assert_cardinality(rows))
    dataset = in_order.batch(batch_size or 32).map(
        lambda picked: tree.map_structure(lambda t: _take_rows(t, picked), tensors)
    ).prefetch(2)
    options = tf.data.Options()
    options.autotune.enabled = False  # no teardown stall (see `feeding`)
    # The seed and the epoch are read when each epoch's order is drawn.
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return dataset.with_options(options)


def _take_rows(tensor, picked):
    """The rows `picked` of `tensor`, in that order: `tf.gather`, also for a `tf.SparseTensor`, which it does not take."""
    if not isinstance(tensor, tf.SparseTensor):
        return tf.gather(tensor, picked)
    count = tf.shape(picked, out_type=tf.int64)[0]
    # Each row's place in the batch, -1 where it is not picked (the picked rows are distinct).
    place = tf.scatter_nd(picked[:, None], tf.range(1, count + 1), tensor.dense_shape[:1]) - 1
    new_rows = tf.gather(place, tensor.indices[:, 0])
    kept = new_rows >= 0
    indices = tf.concat([tf.boolean_mask(new_rows, kept)[:, None], tf.boolean_mask(tensor.indices, kept)[:, 1:]], axis=1)
    rows = tf.SparseTensor(indices, tf.boolean_mask(tensor.values, kept), tf.concat([[count], tensor.dense_shape[1:]], 0))
    return tf.sparse.reorder(rows)


class OrderedBatches(keras.utils.PyDataset):
    """A `PyDataset`'s batches in an order drawn from `order`'s seed and epoch, which a backup resumes.

    Keras shuffles a PyDataset's batches (fit's `shuffle=True`) with no
    seed. Read by one worker thread (the default), each batch is fetched
    while its epoch runs, after the epoch's number is set.
    """

    def __init__(self, data, order: EpochOrder):
        super().__init__()
        self.data, self.order, self._drawn = data, order, (None, None)

    @property
    def num_batches(self):
        return self.data.num_batches

    def __getitem__(self, index):
        key = (int(self.order.seed.numpy()), int(self.order.epoch.numpy()))
        if key != self._drawn[0]:
            self._drawn = (key, np.random.default_rng(list(key)).permutation(self.data.num_batches))
        return self.data[int(self._drawn[1][index])]

    def on_epoch_begin(self):
        self.data.on_epoch_begin()

    def on_epoch_end(self):
        self.data.on_epoch_end()


def resumable(data, steps_per_epoch=None) -> bool:
    """Whether `fit(shuffle=True)` on `data` can take `OrderedBatches`' order: a finite PyDataset read by one thread.

    And read whole each epoch: with fewer `steps_per_epoch`, Keras goes on
    with one iterator across epochs, whose pass would mix two epochs' orders.
    """
    return (isinstance(data, keras.utils.PyDataset) and data.num_batches is not None
            and steps_per_epoch in (None, data.num_batches)
            and getattr(data, "workers", 1) <= 1 and not getattr(data, "use_multiprocessing", False))

