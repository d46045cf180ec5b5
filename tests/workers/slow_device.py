"""A load that slows chosen devices: for the balancing tests and benchmark, and the multi-worker monitor's test."""

import time

import keras
import numpy as np
import tensorflow as tf


class SlowDevice(keras.layers.Layer):
    """A load: sleeps `ms_per_row` per row, `factor` times as long on devices named in `slow`."""

    def __init__(self, ms_per_row, slow, factor, **kwargs):
        super().__init__(**kwargs)
        self.ms_per_row, self.slow, self.factor = ms_per_row, slow, factor

    def call(self, x):
        device = "" if tf.executing_eagerly() else tf.identity(x).device
        seconds = self.ms_per_row / 1000 * (self.factor if any(device.endswith(d) for d in self.slow) else 1)

        def sleep(rows, _):
            time.sleep(float(rows) * seconds)
            return np.float32(0)

        # x[0, 0] as an input: a sleep of constant inputs would be folded away.
        zero = tf.numpy_function(sleep, [tf.shape(x)[0], x[0, 0]], tf.float32, stateful=False)
        zero.set_shape(())
        return x + tf.stop_gradient(zero)

    def compute_output_shape(self, shape):
        return shape
