"""Replica i's ops run on device i, in fit, evaluate and predict.

Each step function is traced as Keras traces it (`tf.function` over the
model's own `train_step` / `test_step` / `predict_step`) and every op of the
graph is read: each replica's ops carry that replica's device, and the
compute ops (MatMul, Conv2D and their gradients) are spread over all devices.
"""

from simulated import DEVICES

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

# A variable read runs where the variable lives (TensorFlow colocates it), and
# a captured variable handle is a placeholder: neither is a replica's compute.
FOLLOW_VARIABLE = {"ReadVariableOp", "Placeholder"}


def _check(concrete, batch_norm=False):
    ops = concrete.graph.get_operations()
    replica_ops = {
        i: [op for op in ops if f"replica_{i}/" in op.name and op.type not in FOLLOW_VARIABLE]
        for i in range(DEVICES)
    }
    for i, group in replica_ops.items():
        assert group, f"no ops traced for replica {i}"
        wrong = [(op.name, op.device) for op in group if not op.device.endswith(f"CPU:{i}")]
        assert not wrong, f"replica {i} ops placed elsewhere: {wrong[:5]}"
    compute = [op for op in ops if op.type in ("MatMul", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput")]
    assert {op.device for op in compute} == {f"/device:CPU:{i}" for i in range(DEVICES)}
    return ops


@pytest.fixture
def compiled():
    model = keras.Sequential(
        [keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng().normal(size=(12, 6, 6, 1)).astype("float32")
    y = np.zeros((12, 3), "float32")
    parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)  # builds optimizer and metrics
    return parallel, tf.constant(x), tf.constant(y)


def test_fit_places_each_replica_on_its_device(compiled):
    parallel, x, y = compiled
    ops = _check(tf.function(parallel.train_step).get_concrete_function((x, y)))
    gradient_ops = [op for op in ops if op.type in ("MatMul", "Conv2DBackpropFilter") and "gradient" in op.name.lower()]
    assert {op.device for op in gradient_ops} == {f"/device:CPU:{i}" for i in range(DEVICES)}


def test_evaluate_places_each_replica_on_its_device(compiled):
    parallel, x, y = compiled
    _check(tf.function(parallel.test_step).get_concrete_function((x, y)))


def test_predict_places_each_replica_on_its_device(compiled):
    parallel, x, _ = compiled
    _check(tf.function(parallel.predict_step).get_concrete_function((x,)))


def test_unknown_batch_size_still_places_every_replica(compiled):
    parallel, x, y = compiled
    spec = tf.TensorSpec((None, 6, 6, 1)), tf.TensorSpec((None, 3))
    _check(tf.function(parallel.train_step).get_concrete_function(spec))


def test_batchnorm_training_places_each_replica_on_its_device():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((6, 5), "float32"), np.ones((6, 1), "float32")
    parallel.fit(x, y, verbose=0)
    _check(tf.function(parallel.train_step).get_concrete_function((tf.constant(x), tf.constant(y))))


def test_merge_happens_on_cpu0_or_first_device():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    x = tf.ones((6, 2))
    for cpu_merge, device in ((True, "CPU:0"), (False, "CPU:1")):
        parallel = kerasmulti.parallelize(model, devices=["/cpu:1", "/cpu:2"], cpu_merge=cpu_merge)
        ops = tf.function(parallel.predict_step).get_concrete_function((x,)).graph.get_operations()
        concats = [op for op in ops if op.type == "ConcatV2"]
        assert concats and all(op.device.endswith(device) for op in concats)
