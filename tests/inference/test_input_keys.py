"""parallel_predict refuses a dict of inputs without one of the model's, before predicting."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import keras
import numpy as np
import pytest

import kerasmulti


def test_a_dict_without_an_input_is_refused_naming_it():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.concatenate([a, b])), name="two")
    with pytest.raises(ValueError, match=r"parallel_predict\(\) got data without the input\(s\) \['b'\].*Received: data keys=\['a', 'c'\]"):
        kerasmulti.parallel_predict(model, {"a": np.zeros((6, 3)), "c": np.zeros((6, 2))}, gpus=2, verbose=0)
    assert kerasmulti.parallel_predict(model, {"a": np.zeros((6, 3)), "b": np.zeros((6, 2))}, gpus=2, verbose=0).shape == (6, 1)
