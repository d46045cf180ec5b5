"""The private Keras and TensorFlow names kerasmulti relies on still have the shape it uses.

A release that renames or reshapes one fails here, naming it, instead of
changing kerasmulti's numbers or file safety without a test noticing.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import inspect

import keras
import pytest

from kerasmulti._src import keras_private as _keras_private

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
    "saving_lib.save_model": ["model", "filepath", "weights_format", "zipped"],
    "saving_lib.load_weights_only": ["model", "filepath", "skip_mismatch"],
    "make_node_key": ["op", "node_index"],
    "multi_worker_util.coordination_leader": ["cluster_spec"],
    "eager_context.context": [],
    "Functional": [],
    "coordination_config_pb2.CoordinatedJob": [],
}


def _resolve(name):
    from kerasmulti._src.model_parallel import portable as _portable

    # A placed layer makes kerasmulti replace Keras' saving functions: check Keras' own.
    originals = {
        "saving_lib.save_model": _portable._original_save,
        "saving_lib.load_weights_only": _portable._original_load_weights,
    }
    if name in originals:
        return originals[name]
    value = _keras_private
    for part in name.split("."):
        value = getattr(value, part)
    return value


def test_every_private_name_is_listed():
    listed = {name.split(".")[0] for name in SIGNATURES}
    assert listed == set(_keras_private.__all__), "list each name of kerasmulti/_keras_private.py here, and only those"


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_private_name_keeps_its_signature(name):
    target = _resolve(name)
    assert callable(target), f"{name} is no longer callable"
    if not SIGNATURES[name]:
        return
    parameters = list(inspect.signature(target).parameters)
    for expected in SIGNATURES[name]:
        assert expected in parameters, f"{name} lost its parameter {expected!r}: now {parameters}"


def test_private_names_still_behave_as_used():
    """Behaviour, not only names: masks round-trip, the loss reduction reduces, the call context exists."""
    import numpy as np
    import tensorflow as tf

    x = tf.ones((2, 3))
    _keras_private.set_keras_mask(x, tf.constant([True, False]))
    assert _keras_private.get_keras_mask(x).numpy().tolist() == [True, False]
    total = _keras_private.loss_module.reduce_weighted_values(
        tf.constant([1.0, 3.0]), sample_weight=None, reduction="sum_over_batch_size"
    )
    assert float(total) == 2.0
    assert _keras_private.global_state.get_global_attribute("current_call_ctx") is None
    assert _keras_private.record.could_possibly_record() is False
    with tf.GradientTape():
        assert _keras_private.record.could_possibly_record() is True
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _keras_private.model_supports_jit(model) in (True, False)
    spec = _keras_private.compute_output_spec(model, keras.KerasTensor((None, 3)), training=False)
    assert tuple(spec.shape) == (None, 2)
    assert _keras_private.array_data_adapter.can_convert_arrays([np.ones(3)])


def test_private_tensorflow_runtime_keeps_the_attributes_used():
    """The launcher's started-or-not test and the join's coordination settings."""
    context = _keras_private.eager_context.context()
    for attribute in ("_initialized", "_physical_devices", "coordination_service"):
        assert hasattr(context, attribute), f"TensorFlow's context lost {attribute}"
    parameters = inspect.signature(context.configure_coordination_service).parameters
    for name in ("service_type", "service_leader", "coordinated_jobs", "cluster_register_timeout_in_ms"):
        assert name in parameters, f"configure_coordination_service lost {name!r}"
    job = _keras_private.coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=2)
    assert (job.name, job.num_tasks) == ("worker", 2)
    assert issubclass(_keras_private.Functional, keras.Model)
    assert inspect.signature(_keras_private.Functional.__init__).parameters.keys() >= {"inputs", "outputs"}


def test_keras_callbacks_still_save_through_the_methods_kerasmulti_overrides(tmp_path):
    """ParallelModelCheckpoint and ParallelBackupAndRestore write atomically by
    overriding Keras' private `_save_model`: if Keras stopped calling it, Keras'
    own non-atomic save would run instead, and nothing else would notice."""
    calls = []

    class Checkpoint(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            calls.append(("checkpoint", epoch))

    class Backup(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            calls.append(("backup", self._current_epoch))

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    import numpy as np

    callbacks = [Checkpoint(str(tmp_path / "m.keras")), Backup(str(tmp_path / "backup"))]
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=2, verbose=0, callbacks=callbacks)
    assert [c for c in calls if c[0] == "checkpoint"] == [("checkpoint", 0), ("checkpoint", 1)]
    assert len([c for c in calls if c[0] == "backup"]) == 2
    assert not (tmp_path / "m.keras").exists()  # Keras' own save did not run beside ours


def test_accumulating_optimizers_keep_the_attributes_multi_worker_accumulation_uses():
    """`_accumulation.apply` runs Keras' accumulating apply on the optimizer's own
    private state: each attribute exists and means what it is used for."""
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.1, clipvalue=0.5, gradient_accumulation_steps=2)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build(model.trainable_variables)
    for attribute in _keras_private.OPTIMIZER_ATTRIBUTES:
        assert hasattr(optimizer, attribute), f"Keras' optimizer lost {attribute}"
    kernel, bias = model.trainable_variables
    accumulators = optimizer._accumulated_gradients
    assert [optimizer._get_variable_index(v) for v in (kernel, bias)] == [0, 1]
    assert [tuple(a.shape) for a in accumulators] == [(3, 2), (2,)]
    assert "gradient_accumulator" in accumulators[0].path
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        grads, variables = optimizer._filter_empty_gradients([None, np.ones(2, "float32")], [kernel, bias])
    assert list(variables) == [bias] and len(grads) == 1
    clipped = optimizer._clip_gradients([np.full((2,), 3.0, "float32")])
    np.testing.assert_array_equal(np.asarray(clipped[0]), [0.5, 0.5])
    assert optimizer._use_weight_decay(kernel) and not optimizer._use_weight_decay(bias)
    assert int(np.asarray(optimizer._iterations)) == 0
    inspect.signature(optimizer.update_step).bind("gradient", "variable", "learning_rate")
    # What `_accumulation` mirrors: Keras' accumulating apply and its iterations
    optimizer.apply([np.ones((3, 2), "float32"), np.ones(2, "float32")])
    assert int(np.asarray(optimizer._iterations)) == 1 and int(np.asarray(optimizer.iterations)) == 0
    np.testing.assert_array_equal(np.asarray(accumulators[1]), [1.0, 1.0])


def test_loss_scale_optimizers_keep_the_attributes_multi_worker_accumulation_uses():
    """`_accumulation.apply` re-runs LossScaleOptimizer's skip-or-apply and
    rescaling on its own state: each attribute exists and behaves so."""
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=8.0, dynamic_growth_steps=2)
    optimizer.build(model.trainable_variables)
    for attribute in _keras_private.LOSS_SCALE_ATTRIBUTES:
        assert hasattr(optimizer, attribute), f"Keras' LossScaleOptimizer lost {attribute}"
    assert optimizer.inner_optimizer is inner and optimizer.dynamic_growth_steps == 2
    finite = [np.ones((3, 2), "float32"), np.ones(2, "float32")]
    assert bool(optimizer.check_finite(finite))
    assert not bool(optimizer.check_finite([finite[0], np.array([1.0, np.inf], "float32")]))
    optimizer.apply([finite[0], np.array([1.0, np.nan], "float32")])  # skipped, scale halved
    assert float(np.asarray(optimizer.dynamic_scale)) == 4.0 and int(np.asarray(inner._iterations)) == 0
    optimizer.apply(finite)  # applied (accumulated, unscaled), one finite step counted
    assert int(np.asarray(optimizer.step_counter)) == 1 and int(np.asarray(inner._iterations)) == 1
    np.testing.assert_array_equal(np.asarray(inner._accumulated_gradients[1]), [0.25, 0.25])
    optimizer.apply(finite)  # the 2nd finite step in a row doubles the scale
    assert float(np.asarray(optimizer.dynamic_scale)) == 8.0 and int(np.asarray(optimizer.step_counter)) == 0
