"""A load that slows chosen devices: for the balancing tests and benchmark, and the multi-worker monitor's test."""

import time

import keras
import numpy as np
import tensorflow as tf


class SlowDevice(keras.layers.Layer):
    """A load: sleeps `ms_per_row` per row, `factor` times as long on devices named in `slow`.

    With `backward=True` its gradient sleeps as long again (a backward pass as slow as the forward).
    """

    def __init__(self, ms_per_row, slow, factor, backward=False, **kwargs):
        super().__init__(**kwargs)
        self.ms_per_row, self.slow, self.factor, self.backward = ms_per_row, slow, factor, backward

    def call(self, x):
        device = "" if tf.executing_eagerly() else tf.identity(x).device
        seconds = self.ms_per_row / 1000 * (self.factor if any(device.endswith(d) for d in self.slow) else 1)

        def sleep(rows, _):
            time.sleep(float(rows) * seconds)
            return np.float32(0)

        def slept(t):
            # t[0, 0] as an input: a sleep of constant inputs would be folded away.
            zero = tf.numpy_function(sleep, [tf.shape(t)[0], t[0, 0]], tf.float32, stateful=False)
            zero.set_shape(())
            return t + tf.stop_gradient(zero)

        if not self.backward:
            return slept(x)

        @tf.custom_gradient
        def load(t):
            return slept(t), slept

        return load(x)

    def compute_output_shape(self, shape):
        return shape
