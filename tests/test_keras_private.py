"""The private Keras and TensorFlow names kerasmulti relies on still have the shape it uses.

A release that renames or reshapes one fails here, naming it, instead of
changing kerasmulti's numbers or file safety without a test noticing.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import inspect
import os

import keras
import pytest
import tensorflow as tf

from kerasmulti._src import keras_private as _keras_private

# name -> the parameters kerasmulti passes (by name or position, in order)
SIGNATURES = {
    "compute_output_spec": ["fn"],
    "get_keras_mask": ["x"],
    "set_keras_mask": ["x", "mask"],
    "global_state.get_global_attribute": ["name"],
    "global_state.set_global_attribute": ["name", "value"],
    "loss_module.reduce_weighted_values": ["values", "sample_weight", "reduction", "dtype"],
    "loss_module.standardize_reduction": ["reduction"],
    "loss_module.apply_mask": ["sample_weight", "mask", "dtype", "reduction"],
    "loss_module.squeeze_or_expand_to_same_rank": ["x1", "x2"],
    "loss_module.unscale_loss_for_distribution": ["value"],
    "model_supports_jit": ["model"],
    "tensorflow_nn.conv": ["inputs", "kernel"],
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
    "TFEpochIterator": ["distribute_strategy"],
    "coordination_config_pb2.CoordinatedJob": [],
    "xplane_pb2.XSpace": [],
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


def _imported(name) -> bool:
    """Whether `name` in keras_private is Keras' or TensorFlow's (not one of its own accessors)."""
    value = getattr(_keras_private, name)
    return inspect.ismodule(value) or not getattr(value, "__module__", "").startswith(_keras_private.__name__)


def test_every_private_name_is_listed():
    listed = {name.split(".")[0] for name in SIGNATURES}
    imported = {name for name in _keras_private.__all__ if _imported(name) and not name.isupper()}
    assert listed == imported, "list each name keras_private imports here, and only those"


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
    from keras.src.backend import AutocastScope  # what a mixed layer's call opens

    halves, singles = keras.Variable(np.ones(2), dtype="bfloat16"), keras.Variable(np.ones(2), dtype="float32")
    with AutocastScope("float16"), _keras_private.without_autocast():
        assert (halves.dtype, singles.dtype, singles.value.dtype) == ("bfloat16", "float32", tf.float32)
    assert _keras_private.global_state.get_global_attribute("autocast_scope") is None
    assert _keras_private.record.could_possibly_record() is False
    with tf.GradientTape():
        assert _keras_private.record.could_possibly_record() is True
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _keras_private.model_supports_jit(model) in (True, False)
    spec = _keras_private.compute_output_spec(model, keras.KerasTensor((None, 3)), training=False)
    assert tuple(spec.shape) == (None, 2)
    assert _keras_private.array_data_adapter.can_convert_arrays([np.ones(3)])


def test_fit_numbers_its_batches_through_the_epoch_iterators_own_enumeration():
    """A resumed epoch passes over its trained batches by replacing `_enumerate_iterator` on fit's iterator."""
    import numpy as np

    epochs = _keras_private.TFEpochIterator(
        x=np.zeros((6, 1)), y=np.zeros((6, 1)), batch_size=2, distribute_strategy=tf.distribute.get_strategy()
    )
    assert [(begin, end) for begin, end, _ in epochs] == [(0, 0), (1, 1), (2, 2)]
    batches = next(iter(epochs))[2]
    epochs._enumerate_iterator = lambda: iter([(2, 2, batches)])
    assert [(begin, end) for begin, end, _ in epochs] == [(2, 2)]


def test_the_tf_data_pipeline_walk_still_sees_repeat_and_take():
    import tensorflow as tf

    pipeline = tf.data.Dataset.range(4).repeat().take(3).filter(lambda x: True)
    kinds, counts = [], []
    pending = [pipeline]
    while pending:
        dataset = pending.pop()
        kinds.append(type(dataset).__name__)
        counts.append(_keras_private.dataset_count(dataset))
        pending.extend(_keras_private.dataset_inputs(dataset))
    assert kinds == ["_FilterDataset", "_TakeDataset", "_RepeatDataset", "_RangeDataset"]
    assert counts[1:3] == [3, -1]
    # The other ops `feeding.endless` reads by name: a rename would refuse (or pass) pipelines unseen.
    endless = tf.data.Dataset.range(4).repeat()
    assert type(endless.take_while(lambda x: x < 2)).__name__ == "_TakeWhileDataset"
    assert type(endless.concatenate(endless)).__name__ == "_ConcatenateDataset"
    for stop in (False, True):
        sampled = tf.data.Dataset.sample_from_datasets([endless, endless], stop_on_empty_dataset=stop)
        assert type(sampled).__name__ == "_DirectedInterleaveDataset" and _keras_private.stops_on_empty(sampled) is stop


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
    # The registration barrier the join's deadline needs; before 2.20 joining is refused.
    fields = _keras_private.coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    assert _keras_private.tensorflow_version() == tuple(int(p) for p in tf.version.VERSION.split(".")[:2])
    if _keras_private.tensorflow_version() >= _keras_private.CLUSTER_TENSORFLOW:
        assert "cluster_register_with_barrier" in fields
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
    """`accumulation.apply` runs Keras' accumulating apply on the optimizer's own
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
    # What `accumulation` mirrors: Keras' accumulating apply and its iterations
    optimizer.apply([np.ones((3, 2), "float32"), np.ones(2, "float32")])
    assert int(np.asarray(optimizer._iterations)) == 1 and int(np.asarray(optimizer.iterations)) == 0
    np.testing.assert_array_equal(np.asarray(accumulators[1]), [1.0, 1.0])


def test_loss_scale_optimizers_keep_the_attributes_multi_worker_accumulation_uses():
    """`accumulation.apply` re-runs LossScaleOptimizer's skip-or-apply and
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


def test_the_methods_kerasmulti_overrides_keep_their_signatures():
    expected = {
        "_resolve_auto_jit_compile": ["self"],
        "_maybe_symbolic_build": ["self", "iterator", "data_batch"],
        "_aggregate_additional_loss": ["self", "loss"],
        "_get_metrics_result_or_logs": ["self", "logs"],
    }
    for cls, names in _keras_private.OVERRIDDEN.items():
        for name in names:
            parameters = list(inspect.signature(getattr(cls, name)).parameters)
            if cls is keras.Model:
                assert parameters == expected[name], f"{cls.__name__}.{name} is now {parameters}"
    assert list(inspect.signature(keras.callbacks.ModelCheckpoint._save_model).parameters) == ["self", "epoch", "batch", "logs"]
    assert list(inspect.signature(keras.callbacks.BackupAndRestore._save_model).parameters) == ["self"]
    moments = getattr(keras.layers.BatchNormalization, _keras_private.BATCHNORM_MOMENTS)  # replaced across workers
    assert list(inspect.signature(moments).parameters) == ["self", "inputs", "mask"]


def _tower():
    inputs = keras.Input((3,), name="x")
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activity_regularizer="l2"), keras.layers.Dropout(0.5)], name="inner")
    outputs = keras.layers.Dense(2, name="head")(inner(inputs))
    return keras.Model(inputs, outputs), inner


def test_layer_and_graph_accessors_read_what_they_say():
    import numpy as np

    model, inner = _tower()
    names = [layer.name for layer in _keras_private.flatten_layers(model, include_self=False)]
    assert names[:1] == ["x"] and "inner" in names and "head" in names and "dropout" in " ".join(names)
    assert _keras_private.flatten_layers(model)[0] is model
    dropout = inner.layers[-1]
    assert len(_keras_private.seed_generators(dropout)) == 1 and _keras_private.seed_generators(model) == []
    operation, node_index, tensor_index = _keras_private.keras_history(model.outputs[0])
    assert operation.name == "head" and (node_index, tensor_index) == (0, 0)
    assert len(_keras_private.inbound_nodes(inner)) == 1
    keys = _keras_private.graph_node_keys(model)
    assert _keras_private.make_node_key(inner, 0) in keys
    assert _keras_private.graph_node_keys(inner)  # a Sequential's graph is its own functional one
    depths = _keras_private.nodes_by_depth(model)
    assert {node.operation.name for nodes in depths.values() for node in nodes} >= {"x", "inner", "head"}
    layers = _keras_private.sequential_layers(inner)
    assert isinstance(layers[0], keras.layers.InputLayer) and layers[1:] == inner.layers
    dense = inner.layers[0]
    inner(np.ones((2, 3), "float32"))
    assert len(_keras_private.added_losses(dense)) == 1  # the activity regulariser of that call
    old = _keras_private.swap_added_losses(dense, [])
    assert len(old) == 1 and _keras_private.added_losses(dense) == []
    _keras_private.swap_added_losses(dense, old)
    assert _keras_private.added_losses(dense) is old


def test_sequential_layers_can_be_replaced_before_the_model_builds():
    model = keras.Sequential([keras.layers.Dense(2, name="a")])
    replacement = keras.layers.Dense(3, name="b")
    _keras_private.set_sequential_layers(model, [replacement])
    model.build((None, 4))
    assert model.layers == [replacement] and model.output_shape == (None, 3)


def test_keras_is_deserialising_inside_clone_and_load_only(tmp_path):
    seen = []

    class Probe(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.append(_keras_private.keras_is_deserialising())

        def call(self, x):
            return x

    model = keras.Sequential([keras.Input((2,)), Probe()])
    keras.models.clone_model(model)
    model.save(tmp_path / "probe.keras")
    keras.models.load_model(tmp_path / "probe.keras", custom_objects={"Probe": Probe})
    assert seen == [False, True, True]
    for name in _keras_private.DESERIALISING:  # the functions looked for still exist in Keras
        assert name in {"from_config", "functional_from_config", "deserialize_keras_object"}
    from keras.src.models import functional
    from keras.src.saving import serialization_lib

    assert callable(functional.functional_from_config) and callable(serialization_lib.deserialize_keras_object)


def test_training_accessors_read_what_they_say():
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _keras_private.compiled_loss(model) is None
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert _keras_private.compile_arguments(model)["loss"] == "mse"
    assert _keras_private.compile_arguments(model)["metrics"] == ["mae"]
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    assert not _keras_private.compiled_loss(model).built
    _keras_private.symbolic_build(model, (x, y))
    assert _keras_private.compiled_loss(model).built
    y_pred = model(x)
    loss = _keras_private.compute_loss(model, x, y, y_pred, None, True)
    np.testing.assert_allclose(float(loss), float(np.mean(np.square(np.asarray(y_pred)))), rtol=1e-6)
    tracker = _keras_private.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)

    class OldStyle(keras.Model):  # a compute_loss written before Keras 3.3: no `training`
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return keras.ops.sum(y_pred) * 0 + 7.0

    old = OldStyle()
    assert float(_keras_private.compute_loss(old, x, y, y_pred, None, False)) == 7.0
    variable = model.trainable_variables[0]
    value = np.full(variable.shape, 2.0, "float32")
    with tf.device("/cpu:1"):
        _keras_private.reinitialize(variable, value)
    np.testing.assert_array_equal(np.asarray(variable), value)
    assert variable.value.device.endswith("CPU:1")


def test_optimizer_accessors_read_what_they_say():
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule, gradient_accumulation_steps=2)
    assert _keras_private.learning_rate_or_schedule(optimizer) is schedule
    optimizer.build(model.trainable_variables)
    assert _keras_private.optimizer_trainable_variables(optimizer) == list(model.trainable_variables)
    assert _keras_private.optimizer_strategy(optimizer, "default") is not None
    kernel, bias = model.trainable_variables
    assert [tuple(a.shape) for a in _keras_private.accumulators(optimizer, [bias, kernel])] == [(2,), (3, 2)]
    assert int(np.asarray(_keras_private.optimizer_iterations(optimizer))) == 0
    assert _keras_private.uses_weight_decay(optimizer, kernel) in (True, False)


def _made_anew(variables, optimizer) -> dict:
    """Each of `variables` made anew on /cpu:1 with zeros; the optimizer's keys, old to new."""
    import numpy as np

    old = [_keras_private.variable_key(optimizer, v) for v in variables]
    for variable in variables:
        with tf.device("/cpu:1"):
            _keras_private.reinitialize(variable, np.zeros(variable.shape, "float32"))
    return dict(zip(old, [_keras_private.variable_key(optimizer, v) for v in variables]))


@pytest.mark.parametrize("kind", ["SGD", "AdamW, bias excluded from weight decay", "MultiOptimizer"])
def test_an_optimizer_rekeyed_after_its_variables_were_made_anew_updates_the_new_ones(kind):
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    kernel, bias = model.trainable_variables
    if kind == "MultiOptimizer" and not hasattr(keras.optimizers, "MultiOptimizer"):
        pytest.skip("this Keras has no MultiOptimizer (Keras 3.15 added it)")
    if kind == "SGD":
        optimizer = keras.optimizers.SGD(1.0)
    elif kind == "MultiOptimizer":
        sgd = keras.optimizers.SGD(1.0)
        optimizer = keras.optimizers.MultiOptimizer(lambda v: sgd)
    else:
        optimizer = keras.optimizers.AdamW(1.0, weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_list=[bias])
    optimizer.build([kernel, bias])
    excluded = kind.startswith("AdamW")
    keys = _made_anew([kernel, bias], optimizer)
    gradients = [np.ones((3, 2), "float32"), np.ones((2,), "float32")]
    if excluded:  # the exclusion is kept by the TensorFlow variable: lost when it is made anew
        assert _keras_private.uses_weight_decay(optimizer, bias)
    else:  # the optimizer finds its variables by their TensorFlow variables
        with pytest.raises((ValueError, KeyError)):
            optimizer.apply(gradients, [kernel, bias])
    _keras_private.rekey_optimizer(optimizer, keys)
    assert not (excluded and _keras_private.uses_weight_decay(optimizer, bias))
    optimizer.apply(gradients, [kernel, bias])
    if not excluded:
        np.testing.assert_array_equal(np.asarray(kernel), -np.ones((3, 2)))
        np.testing.assert_array_equal(np.asarray(bias), -np.ones(2))
    else:  # Adam's first step moves each by its learning rate; the kernel decays too, from zero
        np.testing.assert_allclose(np.asarray(bias), -np.ones(2), rtol=1e-5)


def test_callback_accessors_read_what_they_say(tmp_path):
    import numpy as np

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch:02d}-{loss:.1f}.keras"), monitor="loss", save_best_only=True)
    checkpoint.set_model(model)
    path = _keras_private.checkpoint_file_path(checkpoint, 0, None, {"loss": 2.0})
    assert path == str(tmp_path / "m-01-2.0.keras")
    checkpoint.on_epoch_end(0, {"loss": 2.0})  # Keras' own save: the best so far is 2.0
    assert os.path.exists(path)
    assert not _keras_private.checkpoint_should_save(checkpoint, 1, None, {"loss": 3.0}, path)
    assert _keras_private.checkpoint_should_save(checkpoint, 1, None, {"loss": 1.0}, path)
    maximised = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), monitor="acc", mode="max")
    _keras_private.set_monitor_op(maximised)
    assert maximised.monitor_op(2.0, 1.0) and not maximised.monitor_op(1.0, 2.0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    paths = _keras_private.backup_paths(backup)
    assert sorted(os.path.basename(p) for p in paths.values()) == sorted(
        ["latest.weights.h5", "latest.weights.h5.bkp", "training_metadata.json", "training_metadata.json.bkp"]
    )
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=2, verbose=0, callbacks=[backup])
    every_other = keras.callbacks.BackupAndRestore(str(tmp_path / "other"), save_freq=2)
    assert [_keras_private.backup_due(every_other, batch) for batch in (0, 1, 2, 3, 0, 1)] == [
        False, True, False, True, False, True
    ]
    assert os.path.exists(paths["weights"]) or not os.path.exists(tmp_path / "backup")  # Keras deletes it at the end
    _keras_private.set_initial_epoch(model, 3)
    history = model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=4, verbose=0)
    assert history.epoch == [3]


def test_tensorflow_started_reads_the_runtime():
    import tensorflow as tf

    tf.constant(1.0)
    assert _keras_private.tensorflow_started() is True


def test_no_module_but_keras_private_reaches_a_foreign_private_name():
    """Private names the package reads are its own, or go through keras_private (os._exit aside)."""
    import ast
    from pathlib import Path

    root = Path(_keras_private.__file__).resolve().parents[2]  # kerasmulti/ (keras_private is a package in _src)
    trees = {path: ast.parse(path.read_text()) for path in root.rglob("*.py")}
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    foreign = set()
    for path, tree in trees.items():
        if "keras_private" in path.parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr not in own and node.attr != "_exit":  # os._exit: the standard library's
                    foreign.add(f"{path.relative_to(root)}: {node.attr}")
            # getattr(x, "_name"), setattr, hasattr, and x.__dict__["_name"] (dunders are Python's)
            named = None
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"getattr", "hasattr", "setattr", "delattr"}:
                named = node.args[1] if len(node.args) > 1 else None
            elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "__dict__":
                named = node.slice
            if isinstance(named, ast.Constant) and isinstance(named.value, str) and named.value.startswith("_") and not named.value.startswith("__"):
                if named.value not in own:
                    foreign.add(f"{path.relative_to(root)}: '{named.value}'")
    assert not foreign, sorted(foreign)


def test_a_workers_step_replaces_how_an_optimizer_sums_gradients_and_gives_it_back():
    """`worker_steps.apply_summed` sums the gradients itself; the optimizer then passes them through."""
    optimizer = keras.optimizers.SGD()
    keras_sum = type(optimizer)._all_reduce_sum_gradients
    assert list(inspect.signature(keras_sum).parameters) == ["self", "grads_and_vars"]
    _keras_private.sum_gradients_with(optimizer, list)
    assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
    _keras_private.sum_gradients_with(optimizer, None)
    assert optimizer._all_reduce_sum_gradients.__func__ is keras_sum


def test_private_names_of_optimizers_and_variable_creation_are_still_there():
    """`creating_variables_with` (an optimizer built in a replica's step) and the weight-decay exclusions carried across workers."""
    import keras
    import tensorflow as tf

    from kerasmulti._src.keras_private import optimizers

    assert isinstance(tf.compat.v1.get_default_graph()._variable_creator_stack, list)
    with optimizers.creating_variables_with(optimizers.variable_creators()):
        pass
    variable = keras.Variable(tf.zeros(2), name="bias")
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[variable], var_names=["bias"])
    assert optimizers.tensorflow_variable_key(variable) in optimizer._exclude_from_weight_decay
    assert optimizer._exclude_from_weight_decay_pattern is not None
    rebuilt = keras.optimizers.AdamW.from_config(optimizer.get_config())
    optimizers.carry_weight_decay_exclusions(optimizer, rebuilt)
    assert not rebuilt._use_weight_decay(variable)
