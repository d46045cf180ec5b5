"""The private Keras and TensorFlow names kerasmulti relies on still have the shape it uses.

A release that renames or reshapes one fails here, naming it, instead of
changing kerasmulti's numbers or file safety without a test noticing.
"""

import inspect

import keras
import pytest

from kerasmulti import _private

# name -> the parameters kerasmulti passes (by name or position, in order)
SIGNATURES = {
    "compute_output_spec": ["fn"],
    "get_keras_mask": ["x"],
    "set_keras_mask": ["x", "mask"],
    "global_state.get_global_attribute": ["name"],
    "loss_module.reduce_weighted_values": ["values", "sample_weight", "reduction", "dtype"],
    "loss_module.standardize_reduction": ["reduction"],
    "loss_module.apply_mask": ["sample_weight", "mask", "dtype", "reduction"],
    "loss_module.squeeze_or_expand_to_same_rank": ["x1", "x2"],
    "loss_module.unscale_loss_for_distribution": ["value"],
    "model_supports_jit": ["model"],
    "array_data_adapter.can_convert_arrays": ["arrays"],
    "array_data_adapter.ArrayDataAdapter": ["x", "y", "sample_weight", "batch_size", "steps", "shuffle", "class_weight"],
    "array_slicing.train_validation_split": ["arrays", "validation_split"],
    "record.could_possibly_record": [],
}


def _resolve(name):
    value = _private
    for part in name.split("."):
        value = getattr(value, part)
    return value


def test_every_private_name_is_listed():
    listed = {name.split(".")[0] for name in SIGNATURES}
    assert listed == set(_private.__all__), "list each name of kerasmulti/_private.py here, and only those"


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_private_name_keeps_its_signature(name):
    target = _resolve(name)
    assert callable(target), f"{name} is no longer callable"
    parameters = list(inspect.signature(target).parameters)
    for expected in SIGNATURES[name]:
        assert expected in parameters, f"{name} lost its parameter {expected!r}: now {parameters}"


def test_private_names_still_behave_as_used():
    """Behaviour, not only names: masks round-trip, the loss reduction reduces, the call context exists."""
    import numpy as np
    import tensorflow as tf

    x = tf.ones((2, 3))
    _private.set_keras_mask(x, tf.constant([True, False]))
    assert _private.get_keras_mask(x).numpy().tolist() == [True, False]
    total = _private.loss_module.reduce_weighted_values(
        tf.constant([1.0, 3.0]), sample_weight=None, reduction="sum_over_batch_size"
    )
    assert float(total) == 2.0
    assert _private.global_state.get_global_attribute("current_call_ctx") is None
    assert _private.record.could_possibly_record() is False
    with tf.GradientTape():
        assert _private.record.could_possibly_record() is True
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _private.model_supports_jit(model) in (True, False)
    spec = _private.compute_output_spec(model, keras.KerasTensor((None, 3)), training=False)
    assert tuple(spec.shape) == (None, 2)
    assert _private.array_data_adapter.can_convert_arrays([np.ones(3)])
