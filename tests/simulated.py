"""Splits the CPU into 3 logical devices, before TensorFlow starts: import it first.

Every test module that runs TensorFlow imports this (most take `DEVICES` from
it), so that a module run alone gets the same devices as the whole suite;
tests that need no TensorFlow do not import it, and do not start it.
`KERASMULTI_TEST_DEVICES=4` runs a module on 4 devices instead (a test of
the custom steps does, in a process of its own).
"""

import os

import pytest
import tensorflow as tf

import kerasmulti

DEVICES = int(os.environ.get("KERASMULTI_TEST_DEVICES", "3"))
# TensorFlow runs as many ops at once as the machine has cores (2 in CI). A
# replica's op that blocks (a sleep standing for a slow device, a rendezvous)
# would then hold up another replica's, and timings would show the queue
# rather than the devices: one thread per device, and as many again. Set
# first: on a machine with GPUs, simulate_devices lists them, which starts
# TensorFlow, after which threading can no longer be set.
tf.config.threading.set_inter_op_parallelism_threads(2 * DEVICES)
kerasmulti.simulate_devices(DEVICES)

# Joining a cluster of workers is refused before TensorFlow 2.20 (docs/limitations.md,
# "Versions"): tests that start real workers need it. Their refusal has a test of its own.
from kerasmulti._src import keras_private as _keras_private  # noqa: E402  (after the devices)

NEEDS_CLUSTER = pytest.mark.skipif(
    _keras_private.tensorflow_version() < _keras_private.CLUSTER_TENSORFLOW,
    reason=f"multi-worker training needs TensorFlow 2.20 or later; this is {tf.version.VERSION}",
)
