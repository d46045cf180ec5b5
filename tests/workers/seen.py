"""A metric for the multi-worker scripts: how often each sample was seen."""

import keras
import tensorflow as tf


class Seen(keras.metrics.Metric):
    """Counts each sample id (y, 0 to samples - 1) seen: across the cluster, or (here=True) by this worker."""

    def __init__(self, samples, here=False):
        super().__init__(name="seen_here" if here else "seen")
        self.samples = samples
        if here:  # a plain variable: parallelize leaves it local to the worker
            self.counts = tf.Variable(tf.zeros(samples))
        else:
            self.counts = self.add_variable(shape=(samples,), initializer="zeros", name="counts")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = tf.cast(tf.reshape(y_true, [-1]), "int32")
        self.counts.assign_add(tf.math.bincount(ids, minlength=self.samples, maxlength=self.samples, dtype="float32"))

    def reset_state(self):
        self.counts.assign(tf.zeros(self.samples))

    def result(self):
        return tf.identity(self.counts)
