"""The compiled step's packed engine: few operations outside XLA, one device's numbers.

With XLA per replica the weights, gradients and non-trainable states cross
devices as one flat buffer per dtype, and the merge and the optimizer's
update run as one XLA call (`packing.py`, `compiled.py`). Here: the
operations a step runs outside XLA, counted by TensorFlow's profiler (exact,
whatever the load), stay few and do not grow with the variables; the cases
the packing must take care of (variables the loss does not reach, variables
of several dtypes, variables on several devices) keep one device's numbers.
The shared conformance list checks every model kind under XLA
(`test_conformance.py`, `jit=True`).
"""

from simulated import DEVICES

import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import packing
from kerasmulti._src.utils import step_ops


def _counted(model, optimizer="sgd"):
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    rng = np.random.default_rng(5)
    x, y = rng.random((8, 4), dtype=np.float32), rng.random((8, 4), dtype=np.float32)
    parallel.train_on_batch(x, y)
    parallel.train_on_batch(x, y)
    return step_ops.count(lambda: parallel.train_on_batch(x, y))


def _dense_stack(layers):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(layers)])


def test_a_compiled_step_runs_the_same_few_operations_outside_xla_whatever_the_variable_count():
    # Before packing: 7 operations per variable (a read, sends, a sum, the update): 385 at 50 variables.
    small, large = _counted(_dense_stack(5)), _counted(_dense_stack(80))  # 10 and 160 variables
    # Slicing the batch, the sends, the loss tracker: a count of 0 would mean no event was read.
    assert 0 < small.outside_xla <= 40, small.by_type
    assert large.outside_xla == small.outside_xla, (small.by_type, large.by_type)
    # A read, one program per replica, one update: not one per variable. (TensorFlow 2.16's
    # XLA runtime on CPUs records no event per program run: 0 there.)
    assert large.xla_programs == small.xla_programs
    if keras_private.tensorflow_version() >= (2, 21):
        assert small.xla_programs == 4


def test_adam_and_batchnorm_keep_the_count_small():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = inputs
    for _ in range(6):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(4)(h))
    counted = _counted(keras.Model(inputs, keras.layers.Dense(4)(h)), optimizer="adam")
    assert counted.outside_xla <= 40, counted.by_type


def test_a_layout_packs_and_unpacks_tensors_of_several_dtypes_in_order():
    tensors = [tf.constant([[1.0, 2.0]]), tf.constant([3, 4], tf.int64), tf.constant(5.0), tf.constant([6.0], tf.float16)]
    layout = packing.Layout(tensors)
    flats = layout.pack(tensors)
    assert sorted(flats) == ["float16", "float32", "int64"]
    np.testing.assert_array_equal(flats["float32"], [1.0, 2.0, 5.0])
    for got, want in zip(layout.unpack(flats), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("count", [17, 300])  # two levels of joins; three (more than 16 x 16 pieces)
def test_many_pieces_pack_exactly_in_xla_with_no_concatenation_of_more_than_16(count):
    # XLA's CPU compiler takes time superlinear in one concatenation's operands (214 pieces: 1.3 s).
    rng = np.random.default_rng(count)
    tensors = [tf.constant(rng.normal(size=(k % 3 + 1, 2)), tf.float32) for k in range(count)]
    tensors += [tf.constant([k], tf.int32) for k in range(5)]
    layout = packing.Layout(tensors)
    pack = tf.function(layout.pack, jit_compile=True, autograph=False)
    flats = pack(tensors)
    np.testing.assert_array_equal(flats["float32"], np.concatenate([t.numpy().ravel() for t in tensors[:count]]))
    np.testing.assert_array_equal(flats["int32"], np.arange(5))
    hlo = pack.experimental_get_compiler_ir(tensors)(stage="optimized_hlo")
    joins = [line for line in hlo.splitlines() if " concatenate(" in line]
    widest = max(line.split(" concatenate(")[1].split(")")[0].count("%") for line in joins)
    assert 2 <= widest <= 16, joins


def test_a_layout_and_device_of_take_variables_as_stored_inside_an_autocast_scope():
    # A mixed model's call opens a float16 scope, in which a Keras variable reports float16 and reads cast.
    from keras.src.backend import AutocastScope

    with tf.device("/cpu:1"):
        variables = [keras.Variable(np.ones(2), dtype="float32"), keras.Variable(np.ones(3), dtype="bfloat16")]
    with AutocastScope("float16"):
        assert packing.Layout(variables).keys == ["float32", "bfloat16"]
        assert all(packing.device_of(v).endswith("CPU:1") for v in variables)


def test_device_reads_cut_each_devices_buffers_back_into_the_variables_values():
    with tf.device("/cpu:0"):
        first = [keras.Variable([[1.0, 2.0]]), keras.Variable(3, dtype="int64")]
    with tf.device("/cpu:1"):
        second = [keras.Variable([4.0, 5.0, 6.0]), keras.Variable(7.0)]
    variables = [first[0], second[0], first[1], second[1]]  # the devices interleaved
    reads = packing.DeviceReads(variables)
    assert len(reads.devices) == 2
    pieces = reads.split(reads.read())
    assert all(piece.shape.rank == 1 for piece in pieces)  # cut, not yet shaped
    for got, variable in zip(reads.values(pieces), variables):
        assert got.dtype == variable.dtype and got.shape == variable.shape
        np.testing.assert_array_equal(got, variable.numpy())


def test_a_replica_program_takes_the_weights_as_pieces_cut_outside_it(monkeypatch):
    # Cut inside XLA, every kernel reading a piece would read its own offset of one buffer,
    # and XLA's CPU backend compiled the ResNet50-shaped model's replica 3-4x longer.
    seen = []
    values = packing.DeviceReads.values
    monkeypatch.setattr(packing.DeviceReads, "values", lambda self, pieces: seen.extend(pieces) or values(self, pieces))
    model = _dense_stack(6)
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    parallel.train_on_batch(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    assert len(seen) == len(model.weights)  # traced once, for both replicas
    assert {piece.op.type for piece in seen} == {"Placeholder"}, {piece.op.type for piece in seen}


@pytest.mark.parametrize("optimizer", ["adam"])  # slot variables: SGD's build creates none in the trace
def test_the_update_program_is_traced_once_with_the_optimizer_built_as_one_device_builds_it(monkeypatch, optimizer):
    # Built inside the update's first trace, the optimizer's new variables made
    # TensorFlow trace it again (1.5 s of a Transformer's first step on CPU).
    from kerasmulti._src.data_parallel import compiled

    traces = []
    apply = compiled.CompiledReplicas._apply
    monkeypatch.setattr(compiled.CompiledReplicas, "_apply", lambda self, *a: traces.append(1) or apply(self, *a))
    x, y = np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)
    reference = _dense_stack(3)
    reference.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    reference.train_on_batch(x, y)
    parallel = kerasmulti.parallelize(_dense_stack(3), gpus=2)
    parallel.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    parallel.train_on_batch(x, y)
    assert len(traces) == 1
    # Built by the first training step only, as one device builds it: predict and evaluate leave it.
    untrained = kerasmulti.parallelize(_dense_stack(3), gpus=2)
    untrained.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    untrained.predict(x, verbose=0)
    untrained.evaluate(x, y, verbose=0)
    assert not untrained.optimizer.built
    # Under the optimizer's own name, as Keras' `apply` builds it.
    assert {v.path.split("/")[0] for v in parallel.optimizer.variables} == {parallel.optimizer.name}
    assert len(parallel.optimizer.variables) == len(reference.optimizer.variables)


class _Counted(keras.layers.Layer):
    """A Dense that counts the calls traced through it (in `calls.n`: Keras would copy a list); no output shape of its own."""

    def __init__(self, units, calls, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.calls = keras.layers.Dense(units), calls

    def call(self, x):
        self.calls.n += 1
        return self.dense(x)


def test_a_functional_models_first_step_traces_its_call_as_one_device_does():
    # Keras' loss was built on a symbolic run of the whole call first (as Keras does under a
    # strategy): 0.3 s of the ResNet50-shaped model's first step. A functional model's
    # outputs are known from its build.
    calls, x = types.SimpleNamespace(n=0), np.random.default_rng().normal(size=(12, 4)).astype("float32")  # even shares

    def build():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(2)(_Counted(3, calls)(inputs)))

    reference = build()
    reference.compile(optimizer="sgd", loss="mse", jit_compile=True)
    calls.n = 0
    expected = reference.train_on_batch(x, x[:, :2])
    one_device = calls.n
    assert one_device > 0
    for jit_compile, traced in ((True, one_device), (False, DEVICES * one_device)):  # uncompiled: once per replica
        parallel = kerasmulti.parallelize(build(), gpus=DEVICES)
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
        calls.n = 0
        np.testing.assert_allclose(parallel.train_on_batch(x, x[:, :2]), expected, rtol=1e-6)
        assert calls.n == traced, jit_compile


@pytest.mark.parametrize("given_as", ["list", "dict"])
def test_a_functional_model_whose_inputs_meet_at_once_trains_as_on_one_device(given_as):
    # Its outputs worked out layer by layer from the batch's tensors, Concatenate refused them
    # ("should be called on a list of inputs"), and a dict's keys went in sorted order.
    rng = np.random.default_rng()
    b, a = rng.normal(size=(12, 3)).astype("float32"), rng.normal(size=(12, 4)).astype("float32")
    x, y = ([b, a] if given_as == "list" else {"a": a, "b": b}), rng.normal(size=(12, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(6)
        inputs = [keras.Input((3,), name="b"), keras.Input((4,), name="a")]
        return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Concatenate()(inputs)))

    for jit_compile in (True, False):
        reference, template = build(), build()
        reference.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
        parallel = kerasmulti.parallelize(template, gpus=2)
        parallel.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
        fit = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(parallel.fit(x, y, **fit).history["loss"], reference.fit(x, y, **fit).history["loss"], rtol=1e-5)
        for got, want in zip(template.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _Unreached(keras.layers.Layer):
    """A Dense whose second kernel the loss never reaches, and an int64 counter."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), initializer="glorot_uniform")
        self.unused = self.add_weight(shape=(3,), initializer="ones")
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False)

    def call(self, x):
        return x @ self.kernel


def _unreached_model():
    keras.utils.set_random_seed(8)
    return keras.Sequential([keras.Input((5,)), _Unreached(), keras.layers.Dense(2)])


def test_a_variable_the_loss_does_not_reach_is_left_to_the_optimizer_as_on_one_device():
    # AdamW decays a variable whose gradient is zero; one device's step leaves
    # one without a gradient alone, as must the packed step (which carries zeros for it).
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(12, 5)).astype("float32"), rng.normal(size=(12, 2)).astype("float32")
    reference, template = _unreached_model(), _unreached_model()
    reference.compile(optimizer=keras.optimizers.AdamW(0.1, weight_decay=0.5), loss="mse")
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer=keras.optimizers.AdamW(0.1, weight_decay=0.5), loss="mse", jit_compile=True)
    reference.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_array_equal(template.layers[0].unused.numpy(), np.ones(3))
    for got, want in zip(template.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_variables_on_several_devices_train_with_one_device_numbers_and_a_warning():
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(12, 4)).astype("float32"), rng.normal(size=(12, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(12)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
        return model

    reference, template = build(), build()
    with tf.device(f"/cpu:{DEVICES - 1}"):  # the second layer's weights move to the last device
        moved = keras.layers.Dense(2)
        moved.build((None, 3))
    moved.set_weights(template.layers[1].get_weights())
    template = keras.Sequential([keras.Input((4,)), template.layers[0], moved])
    assert len({packing.device_of(v) for v in template.weights}) == 2
    reference.compile(optimizer="sgd", loss="mse")
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    reference.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match=r"live on several devices.*Received: devices=\["):
        parallel.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(template.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gradient_accumulation_and_several_steps_per_execution_keep_one_devices_numbers(optimizer):
    # Keras' accumulation runs inside the optimizer, here inside the packed update's XLA call.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(13)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])

    def make():
        return keras.optimizers.get({"class_name": optimizer, "config": {"gradient_accumulation_steps": 2}})

    reference, template = build(), build()
    reference.compile(optimizer=make(), loss="mse", steps_per_execution=2, jit_compile=True)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer=make(), loss="mse", steps_per_execution=2, jit_compile=True)
    fit = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)
    expected, got = reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    # 8 steps, an update every 2nd: Keras counts updates.
    assert int(parallel.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 4
    for got_weight, want in zip(template.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_weight, want, rtol=1e-5, atol=1e-6)


def test_a_frozen_model_is_warned_about_and_left_unchanged_under_xla():
    template = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    template.trainable = False
    before = template.get_weights()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="adam", loss="mse", jit_compile=True)
    x, y = np.random.default_rng().normal(size=(8, 3)), np.zeros((8, 2))
    with pytest.warns(UserWarning, match="does not have any trainable weights"):
        parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for got, want in zip(template.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_a_mixed_model_keeps_its_packed_step_and_its_float32_layers_in_float32():
    # The parallel model's call opens Keras' float16 autocast scope: the packed read under it
    # took the float32 weights as float16, and a predict before the first fit made the buffers
    # float16, warned that the variables "live on several devices" and ran the update op by op.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def build():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", dtype="float32"),
                                     keras.layers.Dense(3, dtype="float32")])

        rng = np.random.default_rng()
        x, y = rng.normal(size=(12, 8)).astype("float32"), rng.integers(0, 3, (12,))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        reference, template = build(), build()
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=True)
        parallel = kerasmulti.parallelize(template, gpus=2)
        parallel.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            parallel.predict(x, batch_size=6, verbose=0)
            parallel.fit(x, y, batch_size=6, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=6, shuffle=False, verbose=0)
        for got, expected in zip(template.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        # Keras' state scope casts its values to the variables' dtype, which in a float16 scope is float16:
        # a float32 layer of the replicas' programs read its weights rounded (5e-4 off the template's predict).
        np.testing.assert_allclose(parallel.predict(x, batch_size=6, verbose=0), template.predict(x, verbose=0),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=6, verbose=0),
                                   reference.evaluate(x, y, batch_size=6, verbose=0), rtol=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", "global bfloat16"])
def test_variables_stored_in_other_float_dtypes_train_under_xla_as_on_one_device(dtype):
    # Read with an autocast scope of None, Keras' variables report float32 whatever they hold:
    # the layout put bfloat16 weights in the float32 buffer ("ConcatV2 ... types don't all match"),
    # and the state scope cast a bfloat16 model's weights to float32 (Dense.call refused the bias).
    policy = "bfloat16" if dtype == "global bfloat16" else None
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        def build():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu", dtype=policy or dtype),
                                     keras.layers.Dense(3)])

        reference, template = build(), build()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng()
    x, y = rng.normal(size=(12, 5)).astype("float32"), rng.normal(size=(12, 3)).astype("float32")
    reference.compile(optimizer="sgd", loss="mse", jit_compile=True)
    parallel = kerasmulti.parallelize(template, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    expected = reference.predict(x, batch_size=12, verbose=0)
    got = parallel.predict(x, batch_size=12, verbose=0)
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"), rtol=1e-2, atol=1e-2)
    reference.fit(x, y, batch_size=12, verbose=0)
    parallel.fit(x, y, batch_size=12, verbose=0)
    assert [v.dtype for v in template.weights] == [v.dtype for v in reference.weights]
    for got, expected in zip(template.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got.astype("float64"), expected.astype("float64"), rtol=1e-3, atol=1e-4)


class _LastMean(keras.layers.Layer):
    """Assigns its input's mean over the rows to a non-trainable vector (of `dtype`) in a training call."""

    def build(self, input_shape):
        self.last = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="last")

    def call(self, x, training=False):
        if training:
            self.last.assign(keras.ops.cast(keras.ops.mean(keras.ops.cast(x, "float32"), axis=0), self.last.dtype))
        return x


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_state_is_merged_by_rows_in_float32_and_rounded_once(dtype):
    # Two rows of zeros on the first device, one row c on the second: first + 1/3 * (c - first)
    # in float32, rounded once; taken in the state's dtype the share itself would be rounded.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), _LastMean(dtype=dtype), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model, gpus=2, split=[2, 1])
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    c = np.asarray(np.random.default_rng(3).uniform(1, 100, size=64), dtype=tf.as_dtype(dtype).as_numpy_dtype)
    x = np.stack([np.zeros(64), np.zeros(64), c.astype("float32")]).astype("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assigns variables in its call")
        parallel.train_on_batch(x, np.zeros((3, 1), np.float32))
    expected = (np.float32(1) / np.float32(3) * c.astype("float32")).astype(c.dtype)
    np.testing.assert_array_equal(model.layers[0].last.numpy(), expected)
