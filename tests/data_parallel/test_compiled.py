"""XLA per replica: placement, BatchNormalization per replica, seeds, refusals.

The numbers of every other model kind under XLA are checked with the shared
conformance list (`test_conformance.py`, `test_losses.py`, `jit=True`). Here:
each replica's compiled function runs on its own device; BatchNormalization
normalises per replica and averages the moving statistics by rows, checked
against a reference computed by hand on one device; every replica draws its
own Dropout masks; and when XLA is refused or stays off.
"""

from simulated import DEVICES

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled as _compiled


def _conv():
    model = keras.Sequential(
        [keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x = np.random.default_rng(11).normal(size=(12, 6, 6, 1)).astype("float32")
    y = np.zeros((12, 3), "float32")
    parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)
    return parallel, tf.constant(x), tf.constant(y)


def _replica_calls(concrete):
    calls = {}
    for op in concrete.graph.get_operations():
        found = re.search(r"(^|/)replica_(\d+)/", op.name)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall") and found:
            calls[int(found.group(2))] = op
    return calls


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
@pytest.mark.parametrize("step", ["train_step", "test_step", "predict_step"])
def test_each_replica_is_one_xla_call_on_its_own_device(step):
    parallel, x, y = _conv()
    data = (x,) if step == "predict_step" else (x, y)
    concrete = tf.function(getattr(parallel, step)).get_concrete_function(data)
    calls = _replica_calls(concrete)
    assert sorted(calls) == list(range(DEVICES))
    for i, op in calls.items():
        assert op.device.endswith(f"CPU:{i}"), (op.name, op.device)
        assert op.get_attr("_XlaMustCompile") is True
    # The compute is inside the compiled calls, not beside them.
    outside = [op.type for op in concrete.graph.get_operations() if op.type in ("Conv2D", "Conv2DBackpropFilter")]
    assert not outside
    if step == "train_step":
        inner = concrete.graph._functions[calls[0].node_def.attr["f"].func.name]
        assert "Conv2DBackpropFilter" in {node.op for node in inner.definition.node_def}


def test_auto_stays_off_on_cpu_and_true_forces_it():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    assert parallel.replica_jit_compile is False
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert parallel.replica_jit_compile is True
    assert parallel.jit_compile is False  # the outer step spans the devices
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True, run_eagerly=True)
    assert parallel.replica_jit_compile is False
    single = kerasmulti.parallelize(model, gpus=1)
    single.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert single.jit_compile is True and single.replica_jit_compile is False


def test_an_uncompiled_parallel_model_never_puts_its_outer_step_under_xla(monkeypatch):
    # Where Keras would pick XLA (a GPU), the step of a parallel model used
    # without compile() (predict) spans the devices and must stay plain.
    monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self: True)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert kerasmulti.parallelize(model, gpus=2).jit_compile is False
    assert kerasmulti.parallelize(model, gpus=1).jit_compile is True


def test_auto_follows_keras_and_keeps_synchronized_batchnorm_exact(monkeypatch):
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    synced = keras.Sequential([keras.Input((2,)), keras.layers.BatchNormalization(synchronized=True)])
    for model in (plain, synced):
        monkeypatch.setattr(model, "_resolve_auto_jit_compile", lambda: True)  # as Keras does with a GPU
    assert _compiled.resolve(plain, "auto", 2) is True
    assert _compiled.resolve(synced, "auto", 2) is False
    assert _compiled.resolve(plain, "auto", 1) is False


def test_a_template_compiled_by_auto_on_a_gpu_is_wrapped_with_auto_again(monkeypatch):
    # Keras records "auto" resolved (True with a GPU), in the template and its file. Wrapped
    # (again, or once loaded), a model with synchronized BatchNormalization was refused.
    inputs = keras.Input((2,))
    hidden = keras.layers.BatchNormalization(synchronized=True)(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    monkeypatch.setattr(model, "_resolve_auto_jit_compile", lambda: True)  # as Keras does with a GPU
    model.compile(optimizer="sgd", loss="mse")
    assert keras_private.compile_arguments(model)["jit_compile"] is True
    for _ in range(2):  # and wrapped again: the template keeps its "auto"
        parallel = kerasmulti.parallelize(model, gpus=2)
        assert parallel.replica_jit_compile is False and model.jit_compile is True
        parallel.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)


def test_xla_is_refused_where_it_cannot_hold_with_the_reason():
    synced = keras.Sequential([keras.Input((2,)), keras.layers.BatchNormalization(synchronized=True, name="bn")])
    parallel = kerasmulti.parallelize(synced, gpus=2)
    with pytest.raises(ValueError, match=r"\['bn'\] were built with synchronized=True.*jit_compile=False.*Received: jit_compile=True"):
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    inputs = keras.Input((2,))
    with kerasmulti.device_scope("/cpu:1"):
        hidden = keras.layers.Dense(2)(inputs)
    placed = kerasmulti.parallelize(keras.Model(inputs, keras.layers.Dense(1)(hidden)), gpus=2)
    with pytest.raises(ValueError, match=r"not supporting XLA: .*\(OnDevice\).*Received: jit_compile=True"):
        placed.compile(optimizer="sgd", loss="mse", jit_compile=True)
    # A layer Keras runs outside XLA, not a placed one, is named as such.
    tokens = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["a", "b"], name="lookup")(tokens)
    lookup = kerasmulti.parallelize(keras.Model(tokens, keras.layers.Embedding(3, 2)(ids)), gpus=2)
    with pytest.raises(ValueError, match=r"not supporting XLA: lookup \(StringLookup\)\. .*Received: jit_compile=True") as raised:
        lookup.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert "device_scope" not in str(raised.value)
    with pytest.raises(ValueError, match=r"must be True, False or 'auto'.*Received: jit_compile='yes'"):
        kerasmulti.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), gpus=2).compile(
            optimizer="sgd", loss="mse", jit_compile="yes"
        )


def test_xla_that_keras_turns_off_for_the_machine_is_refused_saying_so(monkeypatch):
    # Every layer supports XLA, but Keras says no (op determinism on, or a Mac's GPU).
    monkeypatch.setattr(_compiled, "model_supports_jit", lambda model: False)
    parallel = kerasmulti.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), gpus=2)
    with pytest.raises(ValueError, match=r"Keras turns XLA off for this model on this machine \(op determinism, or a Mac's GPU\).*Received: jit_compile=True"):
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)


def _batchnorm_model(seed=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.ReLU(),
            keras.layers.Dense(1),
        ]
    )


def _per_replica_reference(model, x, y, sizes, learning_rate):
    """One SGD step as DDP takes it, on one device, by hand.

    Each sub-batch is normalised with its own statistics; the loss is each
    sub-batch's squared error over the whole batch's element count; the
    moving statistics are the sub-batches' updates averaged by rows.
    """
    bn = model.layers[1]
    start_stats = [np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]
    gradients, new_stats, begin = None, [0.0, 0.0], 0
    for size in sizes:
        x_s, y_s = x[begin : begin + size], y[begin : begin + size]
        begin += size
        bn.moving_mean.assign(start_stats[0])
        bn.moving_variance.assign(start_stats[1])
        with tf.GradientTape() as tape:
            squared = tf.square(model(x_s, training=True) - y_s)
            loss = tf.reduce_sum(squared) / (len(x) * y.shape[1])
        g = tape.gradient(loss, model.trainable_weights)
        gradients = g if gradients is None else [a + b for a, b in zip(gradients, g)]
        new_stats[0] += size / len(x) * np.asarray(bn.moving_mean)
        new_stats[1] += size / len(x) * np.asarray(bn.moving_variance)
    bn.moving_mean.assign(new_stats[0])
    bn.moving_variance.assign(new_stats[1])
    for weight, gradient in zip(model.trainable_weights, gradients):
        weight.assign(weight - learning_rate * gradient)


@pytest.mark.parametrize("rows", [3 * DEVICES, 3 * DEVICES + 2])
def test_batchnorm_under_xla_normalises_per_replica_like_ddp(rows):
    rng = np.random.default_rng(21)
    x = (rng.normal(size=(rows, 4)) * 2 + 1).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    reference, template, plain = _batchnorm_model(), _batchnorm_model(), _batchnorm_model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    sizes = [rows // DEVICES + (1 if i < rows % DEVICES else 0) for i in range(DEVICES)]
    for _ in range(2):
        parallel.train_on_batch(x, y)
        plain.train_on_batch(x, y)
        _per_replica_reference(reference, x, y, sizes, 0.1)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5, err_msg=a.path)
    # Not the one-device (whole-batch) numbers: the modes really differ ...
    assert not np.allclose(np.asarray(plain.layers[0].kernel), np.asarray(template.layers[0].kernel), atol=1e-4)
    # ... and inference uses the moving statistics, so predict is the template's.
    np.testing.assert_allclose(parallel.predict(x, verbose=0), template.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_batchnorm_under_xla_keeps_the_one_device_moving_mean():
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(10, 4)) * 3 - 2).astype("float32")
    template, plain = _batchnorm_model(), _batchnorm_model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=True)
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    parallel.train_on_batch(x, np.zeros((10, 1)))
    plain.train_on_batch(x, np.zeros((10, 1)))
    moving = [layer for layer in template.layers if isinstance(layer, keras.layers.BatchNormalization)][0]
    np.testing.assert_allclose(np.asarray(moving.moving_mean), np.asarray(plain.layers[1].moving_mean), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(moving.moving_mean), 0.0)


class _LastBatch(keras.metrics.Metric):
    """Keeps the last batch of outputs it saw, so a test can read a training step's predictions."""

    def __init__(self, shape, **kwargs):
        super().__init__(**kwargs)
        self.last = self.add_variable(shape=shape, initializer="zeros", name="last")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.last.assign(y_pred)

    def result(self):
        return 0.0


def test_every_replica_draws_its_own_dropout_masks():
    inputs = keras.Input((256,))
    dropped = keras.layers.Dropout(0.5, name="dropped")(inputs)
    head = keras.layers.Dense(1, name="head")(inputs)
    parallel = kerasmulti.parallelize(keras.Model(inputs, {"dropped": dropped, "head": head}), gpus=DEVICES)
    last = _LastBatch((DEVICES, 256), name="last")
    parallel.compile(optimizer="sgd", loss={"head": "mse"}, metrics={"dropped": [last]}, jit_compile=True)
    x = np.ones((DEVICES, 256), "float32")  # one row per replica
    y = {"dropped": x, "head": np.zeros((DEVICES, 1), "float32")}
    seen = []
    for _ in range(3):
        parallel.train_on_batch(x, y)
        kept = np.asarray(last.last) != 0
        assert 0.3 < kept.mean() < 0.7
        assert len({row.tobytes() for row in kept}) == DEVICES
        seen.append(kept.tobytes())
    assert len(set(seen)) == 3, "the masks did not change between steps"


class _RowCounter(keras.layers.Layer):
    """Counts the rows it sees in training: a variable assigned in call, not BatchNormalization's."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

    def call(self, t, training=None):
        if training:
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(t)[0], "float32"))
        return t


def test_a_variable_assigned_in_call_other_than_batchnormalizations_is_warned_about_under_xla():
    # Its replicas' values were averaged by rows, silently: 12 rows counted where one device counts 24.
    x = np.random.default_rng().normal(size=(24, 4)).astype("float32")
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(_RowCounter(name="counter")(inputs))  # its statistics: not warned about
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.fit(x, x[:, :1], batch_size=6, epochs=1, verbose=0)
    messages = [str(w.message) for w in caught if "Under XLA per replica" in str(w.message)]
    assert messages and all(
        re.search(r"assigns variables in its call; the replicas' values are averaged by rows, as BatchNormalization's "
                  r"statistics, which a row counter or a maximum is not \(docs/limitations.md\)\. "
                  r"Received: assigned=\['counter/seen'\]$", m) for m in messages
    ), messages
    assert float(model.get_layer("counter").seen.numpy()) == 12.0  # as documented: averaged, one device counts 24


def test_batchnormalization_under_xla_per_replica_is_warned_about_at_compile():
    # Documented, but silent: "auto" turns XLA on with GPUs, and each replica's statistics differ from one device's.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.BatchNormalization(name="bn")])
    parallel = kerasmulti.parallelize(model, gpus=2)
    with pytest.warns(UserWarning, match=r"Under XLA per replica, BatchNormalization normalises each replica's rows, not "
                                         r"the batch's \(as tf.distribute\)\. For one device's numbers pass "
                                         r"jit_compile=False\. Received: layers=\['bn'\]") as caught:
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert caught[0].filename == __file__  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=False)


def test_a_frozen_batchnormalization_is_not_warned_about_under_xla():
    # It normalises with its moving statistics, as on one device (a frozen pretrained base).
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    model.layers[-1].trainable = False
    parallel = kerasmulti.parallelize(model, gpus=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert not [w for w in caught if "BatchNormalization" in str(w.message)]


@pytest.mark.parametrize("frozen", [["head"], ["body", "head"]], ids=["last layer", "all"])
def test_layers_frozen_at_the_end_keep_one_devices_numbers_under_xla(frozen):
    # Frozen last, the variables keep their order but fewer are trainable: the replicas read the
    # frozen ones as trainable, from the wrong device ("Trying to access resource ... CPU:0").
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh", name="body"), keras.layers.Dense(1, name="head")])

    rng = np.random.default_rng()
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=2)
    results = []
    for model, target in ((reference, reference), (template, parallel)):
        target.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
        target.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        for name in frozen:
            model.get_layer(name).trainable = False
        results.append([target.evaluate(x, y, batch_size=8, verbose=0), target.predict(x, batch_size=8, verbose=0)])
        target.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
        results[-1].append(target.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"])
    assert parallel.replica_jit_compile
    for got, expected in zip(results[1], results[0]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
