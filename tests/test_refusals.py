"""Models and inputs that cannot be split get a clear error."""

import keras
import numpy as np
import pytest

import kerasmulti


def test_non_model_is_refused():
    with pytest.raises(TypeError, match=r"expects a keras.Model.*Received: model=Dense"):
        kerasmulti.parallelize(keras.layers.Dense(3))


def test_unbuilt_model_is_refused():
    with pytest.raises(ValueError, match=r"needs a built model.*model.build\(input_shape\).*Received: model='unbuilt' with built=False"):
        kerasmulti.parallelize(keras.Sequential([keras.layers.Dense(2)], name="unbuilt"))


def test_stateful_rnn_is_refused_naming_the_layer():
    model = keras.Sequential(
        [keras.Input((4, 2), batch_size=6), keras.layers.LSTM(3, stateful=True, name="memory"), keras.layers.Dense(1)]
    )
    with pytest.raises(ValueError, match=r"stateful layer 'memory' \(LSTM\).*Received: layer='memory' with stateful=True"):
        kerasmulti.parallelize(model, gpus=2)


def test_batch_renormalization_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(renorm=True, name="bn")])
    with pytest.raises(ValueError, match=r"renormalisation in layer 'bn'.*Received: layer='bn' with renorm=True"):
        kerasmulti.parallelize(model, gpus=2)


def _two_inputs():
    a, b = keras.Input((2,)), keras.Input((3,))
    return keras.Model([a, b], keras.layers.Dense(1)(keras.layers.concatenate([a, b])))


def test_inputs_with_different_batch_sizes_are_refused():
    parallel = kerasmulti.parallelize(_two_inputs(), gpus=2)
    with pytest.raises(ValueError, match=r"same batch size.*Received: batch sizes \[4, 5\]"):
        parallel([np.zeros((4, 2), "float32"), np.zeros((5, 3), "float32")])


def test_unparallelize_and_unwrap():
    model = _two_inputs()
    parallel = kerasmulti.parallelize(model, gpus=2)
    assert kerasmulti.unwrap(parallel) is model
    assert kerasmulti.unwrap(model) is model
    again = kerasmulti.parallelize(parallel, gpus=3)
    assert kerasmulti.unwrap(again) is model
    with pytest.raises(TypeError, match=r"unwrap\(\) expects a keras.Model.*Received: model=str"):
        kerasmulti.unwrap("model.keras")


def test_scalar_and_missing_inputs_are_refused_by_the_splitter():
    from kerasmulti import _split

    with pytest.raises(ValueError, match=r"needs a batch axis.*Received: input with shape \(\)"):
        _split.batch_size([np.zeros((4, 2)), np.float32(1.0)])
    with pytest.raises(ValueError, match=r"at least one input tensor.*Received: inputs=\[None\]"):
        _split.batch_size([None])


def test_batch_sizes_that_disagree_at_run_time_are_refused():
    import tensorflow as tf

    parallel = kerasmulti.parallelize(_two_inputs(), gpus=2)
    step = tf.function(lambda a, b: parallel([a, b]))
    spec = step.get_concrete_function(tf.TensorSpec((None, 2)), tf.TensorSpec((None, 3)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="same batch size.*Received: different batch sizes"):
        spec(tf.zeros((4, 2)), tf.zeros((5, 3)))
