"""Sparse gradients (`IndexedSlices`) summed over replicas: one device's numbers with every Keras optimizer.

One device's sparse gradient lists some rows once (a sparse input's matmul)
and others once per lookup (an `Embedding`). Joined over replicas, the first
kind would list a row once per replica that touched it; an optimizer that is
not linear in the gradient (Adagrad squares each listed row) would then
differ from one device. The sum keeps each kind as one device lists it.
"""

from simulated import DEVICES

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

OPTIMIZERS = {
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.05),
    "nadam": lambda: keras.optimizers.Nadam(0.05),
    "ftrl": lambda: keras.optimizers.Ftrl(0.5),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.05),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
}


def _train(build, optimizer, x, y, parallel, batch_size, jit_compile):
    model = build()
    trained = kerasmulti.parallelize(model, gpus=DEVICES) if parallel else model
    trained.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse", jit_compile=jit_compile)
    history = trained.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
    assert not parallel or trained.replica_jit_compile == jit_compile
    return model, history


def _assert_one_devices_numbers(build, optimizer, x, y, batch_size, jit_compile=False):
    reference, expected = _train(build, optimizer, x, y, parallel=False, batch_size=batch_size, jit_compile=jit_compile)
    template, got = _train(build, optimizer, x, y, parallel=True, batch_size=batch_size, jit_compile=jit_compile)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_sparse_inputs_gradient_gives_one_devices_numbers_with_every_optimizer(optimizer):
    # Every row touches columns 0 and 1, so each replica's gradient lists them:
    # joined as they were, Adagrad's loss read 2.000359 against one device's 2.001105.
    def build():
        keras.utils.set_random_seed(4)
        return keras.Sequential([keras.Input((4,), sparse=True), keras.layers.Dense(3)])

    rng = np.random.default_rng()
    dense = np.where(rng.random((12, 4)) > 0.5, rng.normal(size=(12, 4)), 0.0)
    dense[:, :2] = rng.normal(size=(12, 2))
    x = tf.sparse.from_dense(dense.astype("float32"))
    y = rng.normal(size=(12, 3)).astype("float32")
    _assert_one_devices_numbers(build, optimizer, x, y, batch_size=2 * DEVICES)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_an_embeddings_rows_repeat_as_on_one_device(optimizer, jit_compile):
    # Each replica looks up distinct rows, the replicas the same ones: one device's
    # gradient lists row 1 once per lookup, and so must the sum (not once). Under XLA
    # per replica (against one device's XLA step) the rows leave each replica's program
    # as rows: a table there, Adam's weights were 0.003 off one device's.
    def build():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(6, 3), keras.layers.Flatten()])

    x = np.array([[1, 2], [3, 4]] * DEVICES * 2, dtype="int32")
    y = np.random.default_rng().normal(size=(len(x), 6)).astype("float32")
    _assert_one_devices_numbers(build, optimizer, x, y, batch_size=2 * DEVICES, jit_compile=jit_compile)


class _TokensAndPositions(keras.layers.Layer):
    """keras.io's TokenAndPositionEmbedding: positions looked up at arange(length), once per batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens, self.positions = keras.layers.Embedding(20, 4), keras.layers.Embedding(6, 4)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(0, keras.ops.shape(x)[1], 1))


class _TokensAndBuckets(_TokensAndPositions):
    """A relative-position bias's kind of lookup: rows that repeat, the same for every batch."""

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.convert_to_tensor([0, 1, 1, 2, 0, 3]))


class _TokensAndHeldPositions(_TokensAndPositions):
    """Position ids held as a tensor (over 128 elements: a function captures it as an input, not a constant)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.position_ids = tf.range(240) % 6

    def call(self, x):
        return self.tokens(x) + self.positions(self.position_ids[: keras.ops.shape(x)[1]])


class _TokensAndRelativeBuckets(_TokensAndPositions):
    """T5's relative-position bias: a bucket per pair of positions."""

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[1], 1)
        buckets = keras.ops.clip(positions[:, None] - positions[None, :], -2, 2) + 2  # rows repeat
        bias = keras.ops.mean(self.positions(buckets), axis=1)
        return self.tokens(x) + bias


def _positions_model(layer=_TokensAndPositions):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(layer()(inputs))
    return keras.Model(inputs, keras.layers.Dense(6)(pooled))


def _token_rows():
    x = np.random.default_rng().integers(0, 20, size=(8 * DEVICES, 6)).astype("int32")
    return x, np.random.default_rng().normal(size=(len(x), 6)).astype("float32")


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("optimizer, layer", [
    ("adagrad", _TokensAndPositions), ("adam", _TokensAndPositions), ("adam", _TokensAndBuckets), ("adam", _TokensAndHeldPositions),
], ids=["positions-adagrad", "positions-adam", "repeated rows-adam", "held positions-adam"])
def test_rows_looked_up_alike_for_every_batch_are_listed_as_on_one_device(optimizer, layer, jit_compile):
    # One device's gradient lists each lookup once, summed over the batch; every replica
    # listed them all again, so Adam squared each replica's part (7.8e-4 off after one step).
    x, y = _token_rows()
    build = functools.partial(_positions_model, layer)
    _assert_one_devices_numbers(build, optimizer, x, y, batch_size=4 * DEVICES, jit_compile=jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_rows_alike_for_every_batch_but_counted_only_when_the_step_runs_are_listed_as_on_one_device(jit_compile):
    # Sequences of a length unknown when traced (as T5's): the replicas' bucket rows were
    # summed into one row each, where one device lists one per pair of positions: Adam's
    # weights 1.2e-2 off one device's after two steps (keras_hub's T5).
    x, y = _token_rows()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4 * DEVICES)
    data = data.map(lambda a, b: (tf.reshape(a, [tf.shape(a)[0], -1]), b))  # (None, None) when traced

    def train(parallel):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((None,), dtype="int32")
        pooled = keras.layers.GlobalAveragePooling1D()(_TokensAndRelativeBuckets()(inputs))
        model = keras.Model(inputs, keras.layers.Dense(6)(pooled))
        trained = kerasmulti.parallelize(model, gpus=DEVICES) if parallel else model
        trained.compile(optimizer=OPTIMIZERS["adam"](), loss="mse", jit_compile=jit_compile)
        return model, trained.fit(data, epochs=2, verbose=0).history["loss"]

    (reference, expected), (template, got) = train(parallel=False), train(parallel=True)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_across_workers_a_position_embeddings_rows_are_summed_as_on_one_device():
    # The strategy's all-reduce joined the replicas' rows: Adam 8.2e-4 off after two steps.
    from cases import worker_model

    x, y = _token_rows()
    reference, template = _positions_model(), _positions_model()
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    parallel = worker_model(template)
    parallel.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    fit = dict(batch_size=4 * DEVICES, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(parallel.fit(x, y, **fit).history["loss"], reference.fit(x, y, **fit).history["loss"], rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)
