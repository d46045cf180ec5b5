"""Arrays reach a parallel model's fit, evaluate and predict as a steady pipeline.

What Keras receives is recorded (its `fit`, `evaluate` and `predict` are
spied on): a `tf.data` pipeline with autotuning off and a known length, in
place of the arrays. The numbers are the template's on one device
(`test_conformance.py` feeds arrays throughout); here also with a
validation split, validation arrays and their own batch size.
"""

from simulated import DEVICES

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from cases import assert_same_logs, assert_same_weights
from keras.src.trainers.data_adapters import array_data_adapter

import kerasmulti
from kerasmulti._src.data_parallel import epoch_order as _epoch_order
from kerasmulti._src.data_parallel import feeding as _feeding


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def _data(rows=22, seed=8):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


@pytest.fixture
def received(monkeypatch):
    """What Keras' own fit, evaluate and predict were given, by method name."""
    seen = {}
    for name in ("fit", "evaluate", "predict"):
        original = getattr(keras.Model, name)

        @functools.wraps(original)  # the signature stays Keras'
        def spy(self, *args, _original=original, _name=name, **kwargs):
            seen[_name] = kwargs
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(keras.Model, name, spy)
    return seen


def _is_steady(dataset, batches):
    assert isinstance(dataset, tf.data.Dataset)
    assert dataset.options().autotune.enabled is False
    assert int(dataset.cardinality()) == batches


def test_arrays_become_a_pipeline_without_autotuning(received):
    x, y = _data()
    parallel = kerasmulti.parallelize(_model(), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0, validation_data=(x[:7], y[:7]), validation_batch_size=3)
    _is_steady(received["fit"]["x"], 5)
    _is_steady(received["fit"]["validation_data"], 3)
    assert received["fit"]["y"] is None and received["fit"]["shuffle"] is False
    parallel.evaluate(x, y, batch_size=4, verbose=0)
    _is_steady(received["evaluate"]["x"], 6)
    parallel.predict(x, batch_size=10, verbose=0)
    _is_steady(received["predict"]["x"], 3)


def test_steps_and_datasets_reach_keras_as_given(received):
    x, y = _data()
    parallel = kerasmulti.parallelize(_model(), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    parallel.fit(x, y, batch_size=4, steps_per_epoch=2, epochs=1, verbose=0)
    assert received["fit"]["x"] is x
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    parallel.evaluate(dataset, verbose=0)
    assert received["evaluate"]["x"] is dataset
    parallel.predict(x, steps=2, batch_size=4, verbose=0)
    assert received["predict"]["x"] is x


def test_no_warning_from_our_own_pipeline():
    x, y = _data()
    parallel = kerasmulti.parallelize(_model(), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.fit(x, y, batch_size=4, epochs=2, verbose=0)  # shuffle=True, Keras' default
        parallel.predict(x, verbose=0)
    assert not [str(w.message) for w in caught if "shuffle" in str(w.message) or "ran out of data" in str(w.message)]


@pytest.mark.parametrize("validation", ["split", "arrays_with_weights", "split_with_steps", "arrays_with_steps"])
def test_validation_matches_one_device(validation):
    # With validation_steps the arrays reached Keras without their batch size: 32-row batches.
    x, y = _data(30)
    weights = np.random.default_rng(2).uniform(0.5, 2.0, size=len(x)).astype("float32")
    reference, template = _model(), _model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0, sample_weight=weights)
    if validation.startswith("split"):
        fit["validation_split"] = 0.3
    elif validation == "arrays_with_weights":
        fit.update(validation_data=(x[:9], y[:9], weights[:9]), validation_batch_size=2)
    else:
        fit.update(validation_data=(x[:9], y[:9]))
    if validation.endswith("steps"):
        fit["validation_steps"] = 1  # one batch of batch_size rows, of the 9
    expected, got = reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history
    assert "val_loss" in got
    assert_same_logs(expected, got)
    assert_same_weights(reference, template)


def _rows(dataset):
    return [int(v) for batch in dataset for v in np.asarray(batch[0])[:, 0]]


def test_shuffling_is_keras_own():
    # Keras' array pipeline, seeded alike, gives the same order: every row once.
    x = np.arange(12, dtype="float32").reshape(12, 1)
    keras.utils.set_random_seed(5)
    ours = _rows(_feeding.fit_arguments(_feeding.bound(keras.Model.fit, (x, x), dict(batch_size=5)))["x"])
    keras.utils.set_random_seed(5)
    adapter = array_data_adapter.ArrayDataAdapter(x, x, batch_size=5, shuffle=True)
    assert ours == _rows(adapter.get_tf_dataset())
    assert sorted(ours) == list(range(12)) and ours != list(range(12))


@pytest.mark.parametrize("method, steps", [("fit", "steps_per_epoch"), ("evaluate", "steps"), ("predict", "steps")])
@pytest.mark.parametrize("hidden", ["repeat", "repeat-filter", "sample_from_datasets"])
def test_an_endless_dataset_without_steps_is_refused_before_reading_it(method, steps, hidden):
    # Keras reads its first epoch forever; behind .filter() TensorFlow cannot even tell it is endless.
    x, _ = _data(16)
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat()
    if hidden == "repeat-filter":
        data = data.filter(lambda a, b: a[0] > -100.0)
    if hidden == "sample_from_datasets":  # drawing on from the endless input once the finite one is spent
        data = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.from_tensor_slices((x, x[:, :1])), data], seed=1)
    assert _feeding.endless(data.batch(4))  # else the call below would read forever, not fail
    parallel = kerasmulti.parallelize(_model(), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=rf"{method}\(\) got a tf.data.Dataset as x that never ends.*Pass {steps}=.*Received: {steps}=None"):
        getattr(parallel, method)(data.batch(4), verbose=0)
    getattr(parallel, method)(data.batch(4), verbose=0, **{steps: 2})  # bounded: runs


def test_endless_validation_data_without_validation_steps_is_refused():
    x, _ = _data(16)
    parallel = kerasmulti.parallelize(_model(), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    endless = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(4)
    with pytest.raises(ValueError, match=r"fit\(\) got a tf.data.Dataset as validation_data that never ends.*Received: validation_steps=None"):
        parallel.fit(x, x[:, :1], validation_data=endless, verbose=0)


_FINITE_WITH_A_REPEAT = {
    "zip-with-a-finite-input": lambda xs, ys: tf.data.Dataset.zip((xs.repeat().filter(lambda a: True), ys)),
    "take_while": lambda xs, ys: tf.data.Dataset.zip((xs, ys)).repeat().enumerate().take_while(lambda i, e: i < 22).map(lambda i, e: e),
    # TensorFlow counts this one INFINITE.
    "sample_from_datasets-stop_on_empty": lambda xs, ys: tf.data.Dataset.sample_from_datasets(
        [tf.data.Dataset.zip((xs, ys)).repeat(), tf.data.Dataset.zip((xs, ys))], seed=1, stop_on_empty_dataset=True
    ),
}


@pytest.mark.parametrize("pipeline", list(_FINITE_WITH_A_REPEAT))
def test_a_finite_pipeline_with_a_repeat_inside_trains_as_on_one_device(pipeline):
    # Refused as "never ends" though Keras trains on it.
    x, y = _data()

    def make():
        return _FINITE_WITH_A_REPEAT[pipeline](tf.data.Dataset.from_tensor_slices(x), tf.data.Dataset.from_tensor_slices(y)).batch(4)

    reference, template = _model(), _model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="sgd", loss="mse")
    fit = dict(epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(make(), **fit).history, parallel.fit(make(), **fit).history)
    np.testing.assert_allclose(parallel.evaluate(make(), verbose=0), reference.evaluate(make(), verbose=0), rtol=1e-5)
    assert_same_weights(reference, template)


def _sparse_model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), sparse=True), keras.layers.Dense(2)])


def test_sparse_x_in_a_backups_resumable_order_trains_as_one_device_on_that_order(tmp_path, monkeypatch):
    # tf.gather does not take a SparseTensor: fit with a ParallelBackupAndRestore (and shuffle=True) failed.
    rng = np.random.default_rng()
    dense, y = rng.normal(size=(10, 6)).astype("float32"), rng.normal(size=(10, 2)).astype("float32")
    dense[dense < 0.5], dense[4] = 0.0, 0.0  # row 4 has no entries
    orders, order = [], _epoch_order.EpochOrder
    monkeypatch.setattr(_epoch_order, "EpochOrder", lambda seed: orders.append(order(seed)) or orders[-1])
    reference, template = _sparse_model(), _sparse_model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="sgd", loss="mse")
    backup = kerasmulti.ParallelBackupAndRestore(str(tmp_path))
    parallel.fit(tf.sparse.from_dense(dense), y, batch_size=4, epochs=2, verbose=0, callbacks=[backup])  # shuffle=True
    seed = int(orders[-1].seed.numpy())
    for epoch in range(2):
        rows = tf.random.experimental.stateless_shuffle(tf.range(10, dtype=tf.int64), seed=[seed, epoch]).numpy()
        reference.fit(tf.sparse.from_dense(dense[rows]), y[rows], batch_size=4, shuffle=False, verbose=0)
    assert_same_weights(reference, template)
