"""Parallel results equal the template's on one device, for every model kind.

Batch sizes 1, n-1, n and a remainder (10 samples in batches of 4 over 3
devices) cover idle replicas, uneven shards and the retraced last batch.
Each runs with uncompiled replicas and with XLA per replica (`jit=True`);
BatchNormalization under XLA normalises per replica, which
`test_compiled.py` checks against its own reference.
"""

from simulated import DEVICES

import os
import warnings
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from cases import CASES, assert_same_logs, assert_same_weights

import kerasmulti

# The remainder batch (10 rows in batches of 4) first: the fast tier runs the first only.
BATCH_SIZES = [4, 1, DEVICES - 1, DEVICES]
SAMPLES = 10
# Every case uncompiled at every batch shape; under XLA per replica (all but
# BatchNormalization) at the remainder batch, whose epoch (4, 4, 2 rows over 3
# devices) has uneven shards, an idle replica and a retraced last step.
MATRIX = [
    pytest.param(batch_size, case, jit, id=f"{batch_size}-{case.name}-{'xla' if jit else 'plain'}")
    for batch_size in BATCH_SIZES
    for jit in (False, True)
    for case in CASES
    if not jit or (batch_size == 4 and case.name != "batchnorm")
]


def _ids(value):
    return getattr(value, "name", None) or ("xla" if value is True else "plain" if value is False else None)


def _setup(case, seed=7, data_seed=None):
    reference, template = case.pair(seed)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    # Seeded, so a failure reproduces: KERASMULTI_TEST_SEED=<seed> draws other data.
    data_seed = int(os.environ.get("KERASMULTI_TEST_SEED", data_seed if data_seed is not None else zlib.crc32(case.name.encode())))
    print(f"data seed: {data_seed}")
    x, y = case.data(np.random.default_rng(data_seed), SAMPLES)
    return reference, template, parallel, x, y


@pytest.mark.parametrize("batch_size,case,jit", MATRIX)
def test_predict_matches_template(case, jit, batch_size):
    reference, template, parallel, x, _ = _setup(case)
    if jit:
        parallel.compile(**case.compile_kwargs(), jit_compile=True)
        assert parallel.replica_jit_compile
    expected = reference.predict(x, batch_size=batch_size, verbose=0)
    got = parallel.predict(x, batch_size=batch_size, verbose=0)
    for e, g in zip(keras.tree.flatten(expected), keras.tree.flatten(got)):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    assert keras.tree.lists_to_tuples(keras.tree.map_structure(np.shape, got)) == keras.tree.lists_to_tuples(
        keras.tree.map_structure(np.shape, expected)
    )


@pytest.mark.parametrize("batch_size,case,jit", MATRIX)
def test_fit_and_evaluate_match_template(case, jit, batch_size):
    reference, template, parallel, x, y = _setup(case)
    initial = [np.asarray(w) for w in template.weights]
    assert initial, "the template has no weights to train"
    reference.compile(**case.compile_kwargs())
    parallel.compile(**case.compile_kwargs(), jit_compile=jit)
    assert parallel.replica_jit_compile is jit
    fit = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **fit).history
    got = parallel.fit(x, y, **fit).history
    assert_same_logs(expected, got)
    assert_same_weights(reference, template)
    changed = any(not np.allclose(np.asarray(w), w0) for w, w0 in zip(template.weights, initial))
    assert changed, "training did not move the template's weights"
    evaluated = parallel.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert_same_logs(reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True), evaluated)


def _compiled_pair(case, seed=3):
    reference, template, parallel, x, y = _setup(case, seed)
    reference.compile(**case.compile_kwargs())
    parallel.compile(**case.compile_kwargs())
    return reference, template, parallel, x, y


def test_sample_weight_is_honoured():
    reference, template, parallel, x, y = _compiled_pair(CASES[0])
    weights = np.random.default_rng(11).uniform(0, 2, size=len(x)).astype("float32")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0, sample_weight=weights)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)
    # The weights must matter, or this test proves nothing.
    unweighted, _ = CASES[0].pair(3)
    unweighted.compile(**CASES[0].compile_kwargs())
    unweighted.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(np.asarray(unweighted.weights[0]), np.asarray(template.weights[0]))


def test_class_weight_is_honoured():
    reference, template, parallel, x, y = _compiled_pair(CASES[0])
    class_weight = {0: 0.3, 1: 2.0}
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0, class_weight=class_weight)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)


def test_sparse_inputs_are_split_like_dense_ones():
    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((6,), sparse=True), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])

    rng = np.random.default_rng(11)
    x = tf.sparse.from_dense(np.where(rng.random((11, 6)) > 0.6, rng.normal(size=(11, 6)), 0).astype("float32"))
    y = rng.normal(size=(11, 1)).astype("float32")
    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    np.testing.assert_allclose(parallel.predict(x, batch_size=5, verbose=0), reference.predict(x, batch_size=5, verbose=0), rtol=1e-5, atol=1e-6)
    fit = dict(batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)


def test_per_output_losses_are_reported_like_one_device():
    case = CASES[1]
    reference, _, parallel, x, y = _compiled_pair(case)
    got = parallel.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    expected = reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    assert {"cls_loss", "reg_loss"} <= set(got)
    assert_same_logs(expected, got)


def test_dropout_still_trains_and_predicts_like_template():
    keras.utils.set_random_seed(1)
    template = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.5), keras.layers.Dense(1)]
    )
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x[:, :1] * 2.0
    parallel.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = parallel.fit(x, y, batch_size=16, epochs=15, verbose=0).history["loss"]
    assert history[-1] < 0.5 * history[0]
    np.testing.assert_allclose(parallel.predict(x, verbose=0), template.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    # Dropout is active in training: two training-mode calls differ.
    a = np.asarray(parallel(x, training=True))
    b = np.asarray(parallel(x, training=True))
    assert not np.allclose(a, b)


def test_template_and_parallel_share_weights():
    reference, template, parallel, x, y = _compiled_pair(CASES[0])
    assert [id(w) for w in parallel.weights] == [id(w) for w in template.weights]
    template.layers[0].kernel.assign(np.zeros(template.layers[0].kernel.shape))
    np.testing.assert_allclose(parallel.predict(x, verbose=0), template.predict(x, verbose=0))


def test_plain_call_inside_tf_function_matches():
    import tensorflow as tf

    reference, template, parallel, x, _ = _setup(CASES[1])
    got = tf.function(lambda a, b: parallel([a, b]))(*x)
    expected = reference(x)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case,jit", [(CASES[0], False), (next(c for c in CASES if c.name == "batchnorm"), False), (CASES[0], True)], ids=_ids
)
def test_several_steps_per_execution_match_template(case, jit):
    # Keras then traces the step inside a loop; replicas trace on threads there too.
    reference, template, parallel, x, y = _setup(case)
    reference.compile(**case.compile_kwargs(), steps_per_execution=3)
    parallel.compile(**case.compile_kwargs(), steps_per_execution=3, jit_compile=jit)
    # Batches of 4, not 2: two rows' BatchNormalization statistics amplify the
    # last-bit differences of convolutions on sub-batches (about 1 run in 16
    # then exceeded the tolerance, before and after this test's changes).
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)


@pytest.mark.parametrize(
    "case,jit", [(CASES[0], False), (next(c for c in CASES if c.name == "batchnorm"), False), (CASES[0], True)], ids=_ids
)
def test_mixed_precision_matches_template(case, jit):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, template, parallel, x, y = _setup(case)
        reference.compile(**case.compile_kwargs())
        parallel.compile(**case.compile_kwargs(), jit_compile=jit)
        fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
        expected, got = reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert template.layers[0].compute_dtype == "float16"
    # float16 sums in another order: equal to float16 precision, not float32's
    # (measured over 12 runs: loss within 3.3e-3, weights within 1.8e-3, with
    # BatchNormalization). Threshold metrics (accuracy, AUC) can flip on a
    # near-tie then, so the loss and the weights are compared.
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-2, atol=5e-3)
    assert_same_weights(reference, template, atol=1e-2)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("when", ["set before, layers float32", "set after the model was built"])
def test_a_float32_template_under_a_global_mixed_policy_predicts_and_trains_as_on_one_device(policy, when):
    # The parallel model took the global policy: it cast the inputs to float16 or bfloat16 (1.6e-3
    # off in predict) and, under mixed_float16, wrapped the optimizer in a LossScaleOptimizer.
    dtype = {"dtype": "float32"} if when.startswith("set before") else {}

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(1, **dtype)(keras.layers.Dense(8, activation="tanh", **dtype)(inputs)), **dtype)

    rng = np.random.default_rng()
    x, y = (rng.normal(size=(16, 4)) * 1.2345678).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    try:
        if dtype:
            keras.config.set_dtype_policy(policy)
        reference, template = build(), build()
        keras.config.set_dtype_policy(policy)
        parallel = kerasmulti.parallelize(template, gpus=DEVICES)
        for target in (reference, parallel):
            target.compile(optimizer="sgd", loss="mse")
        assert type(parallel.optimizer) is type(reference.optimizer)  # a LossScaleOptimizer where the model is mixed
        np.testing.assert_allclose(parallel.predict(x, batch_size=8, verbose=0), reference.predict(x, batch_size=8, verbose=0), rtol=1e-6, atol=1e-7)
        fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(parallel.fit(x, y, **fit).history["loss"], reference.fit(x, y, **fit).history["loss"], rtol=1e-5)
    finally:
        keras.config.set_dtype_policy("float32")
    assert_same_weights(reference, template)


def test_a_model_without_trainable_weights_is_warned_about_like_keras():
    template = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    template.trainable = False
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    x, y = np.random.default_rng(11).normal(size=(8, 3)), np.zeros((8, 2))
    with pytest.warns(UserWarning, match="does not have any trainable weights"):
        parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)


class RecordingSGD(keras.optimizers.SGD):
    """Records the types of the gradients it is given (once per trace)."""

    def apply(self, grads, trainable_variables=None):
        self.kinds = [type(g).__name__ for g in grads]
        return super().apply(grads, trainable_variables)


def test_an_embeddings_gradient_reaches_the_optimizer_sparse_as_on_one_device():
    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 3), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)]
        )

    rng = np.random.default_rng()
    x, y = rng.integers(0, 50, size=(10, 4)), rng.normal(size=(10, 1)).astype("float32")
    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer=RecordingSGD(0.1), loss="mse")
    expected = reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert_same_logs(expected, parallel.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history)
    assert_same_weights(reference, template)
    assert reference.optimizer.kinds[0] == parallel.optimizer.kinds[0] == "IndexedSlices"


def test_a_keras_warning_is_shown_once_a_call_not_once_a_replica():
    # Keras warns about an input key the model does not take; its message names
    # each replica's sub-batch, so Python alone would show it once per replica.
    inputs = keras.Input((4,), name="a")
    model = keras.Model({"a": inputs}, keras.layers.Dense(2)(inputs))
    x = {"a": np.zeros((8, 4), "float32"), "b": np.zeros((8, 1), "float32")}
    shown = {}
    for name, predicting in (("one device", model), ("parallel", kerasmulti.parallelize(model, gpus=DEVICES))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            predicting.predict(x, batch_size=8, verbose=0)
        shown[name] = [str(w.message).split("\n")[0] for w in caught if "structure of `inputs`" in str(w.message)]
    assert len(shown["one device"]) == len(shown["parallel"]) == 1


class ActivationMean(keras.layers.Layer):
    """A layer that tracks a metric of its inputs, reported in the model's logs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.activation_mean = keras.metrics.Mean(name="activation_mean")

    def call(self, x):
        self.activation_mean.update_state(x)
        return x


def test_metrics_the_templates_layers_hold_are_the_parallel_models_and_logged_as_on_one_device():
    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(1)(ActivationMean()(keras.layers.Dense(3)(inputs))))

    rng = np.random.default_rng()
    # Every batch splits into sub-batches of 2 rows: no replica is idle (see docs/limitations.md).
    x, y = rng.normal(size=(12, 4)).astype("float32"), rng.normal(size=(12, 1)).astype("float32")
    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="sgd", loss="mse")
    assert [m.name for m in parallel.metrics] == [m.name for m in reference.metrics] == ["loss", "activation_mean"]
    fit = dict(batch_size=2 * DEVICES, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
