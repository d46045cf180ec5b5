"""pipeline(): a placed model on micro-batches gives one device's numbers with the whole batch."""

from simulated import DEVICES

import re
import time
import warnings

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from cases import StopAfterBatches

import kerasmulti
from kerasmulti._src import keras_private
from kerasmulti._src.model_parallel import segments
from kerasmulti._src.utils import step_ops

assert DEVICES >= 3  # stages on /cpu:1 and /cpu:2; a third device for the cut
FIT = dict(batch_size=10, epochs=2, shuffle=False, verbose=0)  # 26 rows: 10, 10, 6


def _stacked(seed, batchnorm=False):
    """Two stages of Dense layers, placed with device_scope."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    with kerasmulti.device_scope("/cpu:1"):
        hidden = keras.layers.Dense(12, activation="relu")(inputs)
        if batchnorm:
            hidden = keras.layers.BatchNormalization()(hidden)
    with kerasmulti.device_scope("/cpu:2"):
        hidden = keras.layers.Dense(12, activation="tanh")(hidden)
        outputs = keras.layers.Dense(2)(hidden)
    return keras.Model(inputs, outputs)


class MeanActivity(keras.layers.Layer):
    """Adds the mean of its inputs' squares as a loss: a mean over the batch's rows."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def _two_inputs_two_outputs(seed):
    """A masked sequence input and a dense one; a per-step head and a regularised head, on two stages."""
    keras.utils.set_random_seed(seed)
    tokens, extra = keras.Input((5,), dtype="int32", name="tokens"), keras.Input((3,), name="extra")
    with kerasmulti.device_scope("/cpu:1"):
        steps = keras.layers.Embedding(9, 4, mask_zero=True)(tokens)
        steps = keras.layers.LSTM(4, return_sequences=True)(steps)
    with kerasmulti.device_scope("/cpu:2"):
        tags = keras.layers.Dense(2, name="tags")(steps)
        pooled = keras.layers.GlobalAveragePooling1D()(steps)
        joined = MeanActivity()(keras.layers.concatenate([pooled, extra]))
        score = keras.layers.Dense(1, name="score", activity_regularizer=keras.regularizers.L1(0.01))(joined)
    return keras.Model([tokens, extra], {"tags": tags, "score": score})


def _data(kind, rows=26):
    rng = np.random.default_rng()
    if kind == "two inputs, two outputs, mask":
        lengths = rng.integers(1, 6, size=(rows, 1))
        tokens = np.where(np.arange(5) < lengths, rng.integers(1, 9, size=(rows, 5)), 0).astype("int32")
        x = {"tokens": tokens, "extra": rng.normal(size=(rows, 3)).astype("float32")}
        y = {"tags": rng.normal(size=(rows, 5, 2)).astype("float32"), "score": rng.normal(size=(rows, 1)).astype("float32")}
        return dict(x=x, y=y)
    return dict(
        x=rng.normal(size=(rows, 6)).astype("float32"), y=rng.normal(size=(rows, 2)).astype("float32"),
        sample_weight=rng.uniform(0.2, 2.0, size=rows).astype("float32"),
    )


CASES = {
    "dense, sample weights": (lambda seed: _stacked(seed), dict(loss="mse", metrics=["mae"])),
    "batchnorm": (lambda seed: _stacked(seed, batchnorm=True), dict(loss="mse", metrics=["mae"])),
    "two inputs, two outputs, mask": (_two_inputs_two_outputs, dict(loss={"tags": "mse", "score": "mse"}, metrics={"score": "mae"})),
}


def _assert_same(reference, template, expected, got, rtol=1e-5, atol=1e-6):
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=rtol, atol=atol, err_msg=key)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=atol, err_msg=a.path)


@pytest.mark.parametrize(
    "case, microbatches",
    # The slowest case (its trace grows with the micro-batches: 8 took 67 s) at 2 and 4; 1, 3 and 8,
    # and 8's short last batch, are the other cases'.
    [(case, m) for case in CASES for m in (4, 1, 2, 3, 8) if case != "two inputs, two outputs, mask" or m in (2, 4)],
)
def test_a_pipeline_trains_and_evaluates_with_one_devices_numbers(case, microbatches):
    # 26 rows in batches of 10: the last has 6, fewer than 8 micro-batches (6 parts, not an error).
    build, compile_arguments = CASES[case]
    data = _data(case)
    reference, template = build(3), build(3)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), **compile_arguments)
    piped = kerasmulti.pipeline(template, microbatches=microbatches)
    piped.compile(optimizer=keras.optimizers.Adam(0.01), **compile_arguments)
    expected, got = reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history
    _assert_same(reference, template, expected, got)
    evaluate = dict(batch_size=10, verbose=0, return_dict=True)
    _assert_same(reference, template, reference.evaluate(**data, **evaluate), piped.evaluate(**data, **evaluate))


@pytest.mark.parametrize(
    # The masked case falls back to GPipe's schedule, the test above's: once is enough.
    "case, microbatches",
    [("dense, sample weights", 4), ("dense, sample weights", 3), ("two inputs, two outputs, mask", 4)],
)
def test_the_1f1b_schedule_trains_with_one_devices_numbers(case, microbatches):
    # The masked loss needs every micro-batch's totals first: its steps run GPipe's schedule, said once.
    build, compile_arguments = CASES[case]
    data = _data(case)
    reference, template = build(4), build(4)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), **compile_arguments)
    piped = kerasmulti.pipeline(template, microbatches=microbatches, schedule="1f1b")
    piped.compile(optimizer=keras.optimizers.Adam(0.01), **compile_arguments)
    assert piped.schedule == "1f1b"
    expected = reference.fit(**data, **FIT).history
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = piped.fit(**data, **FIT).history
    fallbacks = [w for w in caught if "GPipe's schedule" in str(w.message)]
    assert len(fallbacks) == (1 if "mask" in case else 0)
    _assert_same(reference, template, expected, got)


class _Noted(keras.layers.Layer):
    """Passes `h` on, noting each micro-batch's forward pass and, slowly, its backward pass (`ids` names it)."""

    def __init__(self, events, **kwargs):
        super().__init__(**kwargs)
        self.note_event = events.append  # a list attribute Keras would track as a copy

    def call(self, inputs):
        ids, h = inputs

        def note(kind, seconds=0.0):
            def noted(t, value):
                time.sleep(seconds)  # a slow backward pass: GPipe's forward passes would run meanwhile
                self.note_event((kind, int(round(float(t[0, 0])))))
                return value

            return noted

        @tf.custom_gradient
        def passing(ids, h):
            def gradient(dy):
                back = tf.numpy_function(note("backward", 0.05), [ids, dy], dy.dtype, stateful=False)
                return tf.zeros_like(ids), tf.ensure_shape(back, dy.shape)

            return tf.ensure_shape(tf.numpy_function(note("forward"), [ids, h], h.dtype, stateful=False), h.shape), gradient

        return passing(ids, h)


def test_1f1b_starts_a_micro_batch_once_the_one_a_stage_count_earlier_has_its_gradients():
    # 2 stages, 4 micro-batches: at most 2 in flight, so micro-batch 2 waits for 0's gradients, 3 for 1's.
    # (Its control, schedule="gpipe", ran micro-batches 2 and 3 forward during 0's slow backward pass;
    # not asserted here, as that order is the executor's, not a guarantee.)
    events = []
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    with kerasmulti.device_scope("/cpu:1"):
        hidden = _Noted(events)([inputs, keras.layers.Dense(8)(inputs)])
    with kerasmulti.device_scope("/cpu:2"):
        outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(hidden))
    piped = kerasmulti.pipeline(keras.Model(inputs, outputs), microbatches=4, schedule="1f1b")
    piped.compile(optimizer="sgd", loss="mse")
    x = np.zeros((8, 4), "float32")
    x[:, 0] = np.arange(8) // 2  # each micro-batch's number, in its rows
    piped.train_on_batch(x, np.ones((8, 1), "float32"))
    assert sorted(events) == sorted([(kind, m) for kind in ("forward", "backward") for m in range(4)])
    assert all(events.index(("forward", m)) > events.index(("backward", m - 2)) for m in (2, 3)), events


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_with_xla_stages_trains_evaluates_and_predicts_with_one_devices_numbers(case):
    build, compile_arguments = CASES[case]
    data = _data(case)
    reference, template = build(3), build(3)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), **compile_arguments)
    piped = kerasmulti.pipeline(template, microbatches=4)
    piped.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=True, **compile_arguments)
    assert piped.replica_jit_compile
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        expected, got = reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history
    uncompiled = [str(w.message) for w in record if "runs uncompiled" in str(w.message)]
    if case.startswith("two inputs"):  # the Embedding and the LSTM; BatchNormalization layers run uncompiled without a word
        assert len(uncompiled) == 2, uncompiled
        assert re.match(r"Layer 'embedding.*' runs uncompiled: it holds Embedding layers .* sparse gradients", uncompiled[0])
        assert re.match(r"Layer 'lstm.*' runs uncompiled: it holds recurrent layers", uncompiled[1])
    else:
        assert not uncompiled
    # XLA rounds differently from TensorFlow's own kernels: the last bits move, as Keras' XLA step's do.
    close = dict(rtol=1e-4, atol=1e-5)
    _assert_same(reference, template, expected, got, **close)
    evaluate = dict(batch_size=10, verbose=0, return_dict=True)
    _assert_same(reference, template, reference.evaluate(**data, **evaluate), piped.evaluate(**data, **evaluate), **close)
    for a, b in zip(keras.tree.flatten(reference.predict(data["x"], verbose=0)), keras.tree.flatten(piped.predict(data["x"], verbose=0))):
        np.testing.assert_allclose(b, a, **close)


def _sequential(seed, hidden=4):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(12, activation="tanh") for _ in range(hidden)] + [keras.layers.Dense(2)])


def _sequential_masked(seed):
    # The Embedding and the LSTM cannot be XLA programs, BatchNormalization needs every micro-batch:
    # each a run of its own, uncompiled, between compiled runs of Dense layers; the mask crosses them.
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"), keras.layers.Embedding(9, 4, mask_zero=True), keras.layers.Dense(6, activation="tanh"),
        # No bias before BatchNormalization: its gradient is rounding noise, which Adam scales up.
        keras.layers.LSTM(6, return_sequences=True), keras.layers.Dense(6, use_bias=False), keras.layers.BatchNormalization(),
        keras.layers.Dense(6, activation="tanh"), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])


def _masked_data(rows=26):
    rng = np.random.default_rng()
    lengths = rng.integers(1, 6, size=(rows, 1))
    tokens = np.where(np.arange(5) < lengths, rng.integers(1, 9, size=(rows, 5)), 0).astype("int32")
    return dict(x=tokens, y=rng.normal(size=(rows, 2)).astype("float32"))


@pytest.mark.slow  # 8 s, XLA programs: CI runs it, the fast tier does not
@pytest.mark.parametrize("kind", ["dense, sample weights", "embedding, LSTM, batchnorm, mask"])
def test_a_cut_sequential_model_runs_each_stage_as_one_xla_program_with_one_devices_numbers(kind):
    build, data = (_sequential, _data("dense")) if kind.startswith("dense") else (_sequential_masked, _masked_data())
    reference, template = build(4), build(4)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    piped = kerasmulti.pipeline(template, gpus=2, microbatches=4)
    piped.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        expected, got = reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history
    uncompiled = sorted(str(w.message).split("'")[1] for w in record if "runs uncompiled" in str(w.message))
    assert [re.sub(r"_\d+$", "", name) for name in uncompiled] == ([] if kind.startswith("dense") else ["embedding", "lstm"])
    close = dict(rtol=1e-4, atol=1e-5)  # XLA's own rounding, as Keras' XLA step's
    _assert_same(reference, template, expected, got, **close)
    np.testing.assert_allclose(piped.predict(data["x"], verbose=0), reference.predict(data["x"], verbose=0), **close)


def test_only_a_chain_of_placed_layers_is_run_as_segments():
    assert [device for device, _ in segments.runs(kerasmulti.unwrap(kerasmulti.pipeline(_stacked(1), 2)))] == [
        "/device:CPU:1", "/device:CPU:2"]  # device_scope's functional chain: one segment per stage
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    with kerasmulti.device_scope("/cpu:1"):
        hidden = keras.layers.Dense(6)(inputs)
    with kerasmulti.device_scope("/cpu:2"):
        outputs = keras.layers.Dense(2)(keras.layers.Add()([inputs, hidden]))  # a branch: not a chain
    assert segments.runs(keras.Model(inputs, outputs)) is None
    assert segments.runs(_sequential(1)) is None  # nothing placed


def test_a_sub_model_holding_batchnorm_runs_alone_and_is_named_in_the_warning():
    def build(seed):
        keras.utils.set_random_seed(seed)
        block = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, use_bias=False), keras.layers.BatchNormalization()], name="block")
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), block, keras.layers.Dense(2)])

    data = _data("dense")
    reference, template = build(6), build(6)
    reference.compile(optimizer="sgd", loss="mse")
    piped = kerasmulti.pipeline(template, gpus=2, microbatches=2)
    piped.compile(optimizer="sgd", loss="mse", jit_compile=True)
    found = segments.runs(kerasmulti.unwrap(piped))
    assert [type(unit).__name__ for _, unit in found] == ["Segment", "OnDevice", "Segment"]  # the Dense before it compiles
    with pytest.warns(UserWarning, match=r"Model 'block' runs uncompiled: it .*BatchNormalization"):
        expected, got = reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history
    _assert_same(reference, template, expected, got, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # 7 s, XLA programs: CI runs it, the fast tier does not
def test_a_cut_sequential_models_xla_programs_do_not_grow_with_its_layers():
    # One program per stage and micro-batch (its forward, its gradient, its weights' read);
    # 16 a step at 3 layers and at 7; one per placed layer before: 24 at 3 layers, 56 at 7.
    counts = []
    for hidden in (2, 6):
        piped = kerasmulti.pipeline(_sequential(4, hidden), gpus=2, microbatches=2)
        piped.compile(optimizer="sgd", loss="mse", jit_compile=True)
        data = _data("dense")
        piped.fit(data["x"], data["y"], batch_size=10, epochs=1, verbose=0)
        batches = iter(tf.data.Dataset.from_tensors((data["x"][:10], data["y"][:10])).repeat())
        piped.train_function(batches)
        counts.append(step_ops.count(lambda: piped.train_function(batches), steps=2).xla_programs)
    if keras_private.tensorflow_version() < (2, 21):
        pytest.skip(f"TensorFlow {tf.__version__}'s XLA runtime on CPUs records no event per program: {counts}")
    assert counts[0] == counts[1] > 0, counts


@pytest.mark.parametrize("jit_compile", [True, False])
def test_xla_stages_run_their_matrix_products_inside_xla_programs(jit_compile):
    data = _data("dense")
    piped = kerasmulti.pipeline(_stacked(2), microbatches=2)
    piped.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    piped.fit(**data, batch_size=10, epochs=1, verbose=0)
    step = piped.train_function
    batches = iter(tf.data.Dataset.from_tensors((data["x"][:10], data["y"][:10])).repeat())
    step(batches)
    ran = step_ops.count(lambda: step(batches), steps=2)
    matmuls = sum(n for name, n in ran.by_type.items() if "MatMul" in name)
    assert matmuls == 0 if jit_compile else matmuls >= 3 * 2  # 3 Dense layers, 2 micro-batches


def test_xla_stages_follow_keras_auto_rule_and_refuse_other_values():
    piped = kerasmulti.pipeline(_stacked(2), microbatches=2)
    piped.compile(optimizer="sgd", loss="mse")
    assert not piped.replica_jit_compile  # "auto": XLA where every stage is a GPU, as Keras with a GPU
    with pytest.raises(ValueError, match=r"jit_compile must be True, False or 'auto'.*Received: jit_compile=1"):
        piped.compile(optimizer="sgd", loss="mse", jit_compile=1)


def test_a_pipeline_predicts_the_templates_outputs_also_through_parallel_predict(tmp_path):
    template = _stacked(4)
    x = _data("dense")["x"]
    piped = kerasmulti.pipeline(template, microbatches=4)
    expected = template.predict(x, batch_size=10, verbose=0)
    np.testing.assert_allclose(piped.predict(x, batch_size=10, verbose=0), expected, rtol=1e-6, atol=1e-6)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(piped, x, batch_size=10, output=path, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f[template.output_names[0]][()], expected, rtol=1e-6, atol=1e-6)


def test_gpus_cuts_an_unplaced_model_into_stages_of_similar_cost_sharing_its_weights():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(16, activation="relu") for _ in range(6)] + [keras.layers.Dense(2)])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    piped = kerasmulti.pipeline(model, gpus=3, microbatches=4)
    placed = kerasmulti.unwrap(piped)
    devices = [layer.device for layer in placed.layers]
    # Costs (parameters, plus multiply-adds per row): 240 for 6 -> 16, 560 for each 16 -> 16, 70 for 16 -> 2;
    # 7 layers, a third of 3,110 each: 800, 1,120, 1,190.
    assert devices == ["/device:CPU:0"] * 2 + ["/device:CPU:1"] * 2 + ["/device:CPU:2"] * 3
    assert piped.stages == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    # The pipeline's summary is its template's (the layers' names, not under the wrapper's).
    summary = kerasmulti.placement_summary(piped)
    assert [row["layer"] for row in summary.rows] == [layer.name for layer in placed.layers]
    assert [row["device"] for row in summary.rows] == devices
    # Each stage's weights live on its device (they were all made on CPU:0), as device_scope makes them.
    for wrapper in placed.layers:
        assert [v.value.device[-5:] for v in wrapper.layer.weights] == [wrapper.device[-5:]] * 2
    data = _data("dense")
    reference.compile(optimizer="sgd", loss="mse")
    piped.compile(optimizer="sgd", loss="mse")
    _assert_same(reference, model, reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history)


def test_the_model_cut_with_gpus_goes_on_training_without_xla_where_it_had_it():
    # Its weights lie on several devices after the cut, which one XLA program cannot read
    # (before: "Trying to access resource ... located in device CPU:1" at its next fit).
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for target in (model, reference):
        target.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kerasmulti.pipeline(model, gpus=2, microbatches=2)
    assert not [w for w in caught if "jit_compile" in str(w.message)]  # the cut compiles its stages itself
    assert {v.value.device[-5:] for v in model.weights} == {"CPU:0", "CPU:1"}
    assert model.jit_compile is False
    data = _data("dense")
    _assert_same(reference, model, reference.fit(**data, **FIT).history, model.fit(**data, **FIT).history)
    np.testing.assert_allclose(model.predict(data["x"], verbose=0), reference.predict(data["x"], verbose=0), rtol=1e-5, atol=1e-6)
    model.compile(optimizer="sgd", loss="mse")  # "auto" keeps XLA off for it, as for any placed model
    assert model.jit_compile is False


def test_mixing_layers_warn_with_micro_batches_and_one_micro_batch_takes_a_stateful_layer():
    inputs = keras.Input((8, 8, 1))
    flat = keras.layers.Flatten()(keras.layers.MixUp()(inputs))
    with pytest.warns(UserWarning, match=r"mixes rows only within each micro-batch, unlike on one device.*Received: layer="):
        kerasmulti.pipeline(keras.Model(inputs, keras.layers.Dense(1)(flat)), gpus=2, microbatches=4)
    # One micro-batch splits nothing: a stateful RNN runs on the whole batch (before: refused as split).
    keras.utils.set_random_seed(2)
    inputs = keras.Input(batch_shape=(4, 3, 2))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(3, stateful=True)(inputs)))
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    piped = kerasmulti.pipeline(model, gpus=2, microbatches=1)
    x = np.random.default_rng().normal(size=(4, 3, 2)).astype("float32")
    for _ in range(2):  # the second call starts from the state the first left
        np.testing.assert_allclose(piped.predict(x, batch_size=4, verbose=0), reference.predict(x, batch_size=4, verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"cannot split the stateful layer .* Use stateful=False or one device, or microbatches=1\. "):
        kerasmulti.pipeline(keras.models.clone_model(reference), gpus=2, microbatches=2)


@pytest.mark.slow  # 10-16 s: the fast tier keeps the other cuts' tests
def test_the_cut_keeps_a_layer_called_twice_one_layer_and_a_compiled_model_compiled(tmp_path):
    # One wrapper per layer (two would share a name, which Keras refuses); the model's
    # compile, optimizer and its state come along, as with a model loaded from a file.
    def build():
        keras.utils.set_random_seed(8)
        shared, inputs = keras.layers.Dense(6, activation="tanh", name="shared"), keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(2)(shared(keras.layers.Dense(6)(shared(inputs)))))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    data = _data("dense")
    reference, model = build(), build()
    reference.fit(**data, **FIT)
    model.fit(**data, **FIT)
    piped = kerasmulti.pipeline(model, gpus=2, microbatches=3)
    assert piped.compiled and piped.optimizer is model.optimizer and int(piped.optimizer.iterations.numpy()) == 6
    assert len(kerasmulti.unwrap(piped).weights) == len(model.weights)
    _assert_same(reference, model, reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history)
    # The model it was cut from trains the moved weights (its step, traced on the old ones, is traced again).
    _assert_same(reference, model, reference.fit(**data, **FIT).history, model.fit(**data, **FIT).history)
    # Saved, it loads placed again: the layer called twice through one wrapper (two would share a name).
    piped.save(tmp_path / "cut.keras")
    loaded = kerasmulti.load_model(tmp_path / "cut.keras")
    assert [w.device for w in loaded.layers if isinstance(w, kerasmulti.OnDevice)] == [w.device for w in kerasmulti.unwrap(piped).layers if isinstance(w, kerasmulti.OnDevice)]
    np.testing.assert_allclose(loaded.predict(data["x"], verbose=0), reference.predict(data["x"], verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_model_compiled_with_xla_and_cut_gets_xla_stages_and_one_devices_numbers(jit_compile):
    # Its placed copy's compile records XLA off (Keras refuses it for placed layers): the pipeline
    # came without XLA, silently (found by review).
    def build():
        keras.utils.set_random_seed(8)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile)
        return model

    data = _data("dense")
    reference, model = build(), build()
    piped = kerasmulti.pipeline(model, gpus=2, microbatches=3)
    assert piped.replica_jit_compile is jit_compile
    _assert_same(reference, model, reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history)


@pytest.mark.slow  # 14 s: CI runs it, the fast tier does not
def test_the_cut_leaves_operations_that_are_not_layers_unplaced_and_trains_with_one_devices_numbers():
    # Embedding's mask (a NotEqual node) and keras.ops calls are nodes of the graph too.
    def build():
        keras.utils.set_random_seed(9)
        tokens = keras.Input((5,), dtype="int32")
        steps = keras.layers.LSTM(4)(keras.layers.Embedding(9, 4, mask_zero=True)(tokens))
        return keras.Model(tokens, keras.layers.Dense(2)(keras.ops.relu(steps) * 2.0))

    reference, model = build(), build()
    piped = kerasmulti.pipeline(model, gpus=2, microbatches=3)
    assert piped.stages == ["/device:CPU:0", "/device:CPU:1"]
    placed = [type(w.layer).__name__ for w in kerasmulti.unwrap(piped).layers if isinstance(w, kerasmulti.OnDevice)]
    assert placed == ["Embedding", "LSTM", "Dense"]
    data = _masked_data()
    for m in (reference, piped):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    _assert_same(reference, model, reference.fit(**data, **FIT).history, piped.fit(**data, **FIT).history)


def test_a_pipeline_sums_each_gradient_on_its_stages_device_not_the_hosts():
    piped = kerasmulti.pipeline(_stacked(3), microbatches=2)
    parallel = kerasmulti.parallelize(_stacked(3), gpus=2)
    for model, expected in ((piped, ["CPU:1", "CPU:1", "CPU:2", "CPU:2", "CPU:2", "CPU:2"]), (parallel, ["CPU:0"] * 6)):
        weights = kerasmulti.unwrap(model).trainable_weights
        sums = [model._threaded._summed([tf.ones(w.shape), tf.ones(w.shape)], w) for w in weights]
        assert [s.device[-5:] for s in sums] == expected and all(np.all(s.numpy() == 2) for s in sums)


def test_summary_goes_where_print_fn_sends_it():
    lines = []
    kerasmulti.pipeline(_stacked(0), microbatches=2).summary(print_fn=lambda line, **kwargs: lines.append(line))
    assert lines[0].startswith("Pipelined over 2 stage(s): /device:CPU:1, /device:CPU:2; 2 micro-batches.")
    assert len(lines) > 1  # the template's own summary followed


def test_pipelines_and_parallel_models_do_not_nest_yet():
    with pytest.raises(ValueError, match=r"pipeline\(\) of a parallel model is not built yet.*Received: model='parallel_"):
        kerasmulti.pipeline(kerasmulti.parallelize(_stacked(0), gpus=2), microbatches=2)
    with pytest.raises(ValueError, match=r"parallelize\(\) of a pipelined model is not built yet.*Received: model='pipeline_"):
        kerasmulti.parallelize(kerasmulti.pipeline(_stacked(0), microbatches=2), gpus=2)
    again = kerasmulti.pipeline(kerasmulti.pipeline(_stacked(0), microbatches=2), microbatches=3)
    assert again.microbatches == 3 and not isinstance(kerasmulti.unwrap(again), kerasmulti.ParallelModel)


@pytest.mark.parametrize("stages, costs, runs", [
    (3, [5, 1, 1, 1, 5], [(0, 1), (1, 4), (4, 5)]),  # the largest stage costs 5: no cut does better
    (2, [1, 1], [(0, 1), (1, 2)]),
    (2, [9, 1, 1, 1], [(0, 1), (1, 4)]),
])
def test_the_cut_makes_the_costliest_stage_as_cheap_as_possible(stages, costs, runs):
    from kerasmulti._src.model_parallel.pipeline import _balanced

    assert _balanced(stages, costs) == runs


def test_a_pipelined_model_saves_a_file_plain_keras_loads(tmp_path):
    template = _stacked(6)
    piped = kerasmulti.pipeline(template, microbatches=3)
    piped.compile(optimizer="adam", loss="mse")
    data = _data("dense")
    piped.fit(**data, **FIT)
    path = str(tmp_path / "piped.keras")
    piped.save(path)
    loaded = keras.models.load_model(path)
    assert not any(isinstance(layer, kerasmulti.OnDevice) for layer in loaded.layers)
    np.testing.assert_allclose(loaded.predict(data["x"], verbose=0), template.predict(data["x"], verbose=0), rtol=1e-6)


def test_a_cut_pipelines_weights_file_refused_by_a_plain_one_says_how_to_move_weights(tmp_path):
    # Keras' "Layer 'd1' expected 2 variables, but received 0" named no way out (found by review).
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Dense(6, name="d1")(inputs)))

    model = build()
    piped = kerasmulti.pipeline(model, microbatches=2, gpus=2)
    piped.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng().normal(size=(8, 4)).astype("float32")
    piped.fit(x, x[:, :1], batch_size=4, verbose=0)  # weights a fresh build does not have
    model.save_weights(str(tmp_path / "plain.weights.h5"))
    with pytest.raises(ValueError, match=r"Load a file from this model \(a placed model's .weights.h5 holds its placed layout: "
                                         r"move weights to or from a plain model in a .keras file\), or pass skip_mismatch"):
        piped.load_weights(str(tmp_path / "plain.weights.h5"))
    piped.save(str(tmp_path / "piped.keras"))
    fresh = build()
    assert not np.allclose(fresh.get_layer("d1").kernel, model.get_layer("d1").kernel)
    fresh.load_weights(str(tmp_path / "piped.keras"))  # the way the message gives
    for a, b in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_pipelined_run_stopped_mid_epoch_resumes_to_an_uninterrupted_runs_weights(tmp_path):
    # The backup's file safety under SIGKILL is the callback's own (tests/callbacks).
    data = _data("dense")

    def run(backup, *callbacks):
        template = _stacked(7, batchnorm=True)
        piped = kerasmulti.pipeline(template, microbatches=4)
        piped.compile(optimizer="adam", loss="mse")
        piped.fit(**data, batch_size=10, epochs=3, verbose=0,
                  callbacks=[kerasmulti.ParallelBackupAndRestore(str(backup), save_freq=1), *callbacks])
        return template

    straight = run(tmp_path / "straight")
    with pytest.raises(RuntimeError, match="stopped"):
        run(tmp_path / "resumed", StopAfterBatches(5))  # in the second epoch, after its second batch
    resumed = run(tmp_path / "resumed")
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7, err_msg=a.path)


def _unplaced(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)])


def _one_stage():
    inputs = keras.Input((6,))
    with kerasmulti.device_scope("/cpu:1"):
        outputs = keras.layers.Dense(2)(keras.layers.Dense(4)(inputs))
    return keras.Model(inputs, outputs)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def _built_subclassed():
    model = Subclassed()
    model.build((None, 6))
    return model


def _with_own_step():
    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((6,))
    with kerasmulti.device_scope("/cpu:1"):
        hidden = keras.layers.Dense(4)(inputs)
    with kerasmulti.device_scope("/cpu:2"):
        return OwnStep(inputs, keras.layers.Dense(2)(hidden))


def _on_a_missing_device():
    inputs = keras.Input((6,))
    hidden = kerasmulti.OnDevice(keras.layers.Dense(4), "/device:CPU:0", _validated=True)(inputs)
    return keras.Model(inputs, kerasmulti.OnDevice(keras.layers.Dense(2), "/device:CPU:9", _validated=True)(hidden))


@pytest.mark.parametrize("make, arguments, error, message", [
    (_stacked, dict(microbatches=0), ValueError, r"microbatches of at least 1\. Received: microbatches=0"),
    (_stacked, dict(microbatches=2.5), TypeError, r"microbatches as an int, such as 4\. Received: microbatches=2\.5"),
    (_stacked, dict(microbatches=True), TypeError, r"Received: microbatches=True"),
    (lambda seed: keras.layers.Dense(2), dict(microbatches=2), TypeError, r"expects a keras\.Model.*Received: model=Dense"),
    (lambda seed: _unplaced(seed), dict(microbatches=2), ValueError, r"placed over 2\+ devices.*gpus= to cut it\. Received: stages=\[\]"),
    (lambda seed: _one_stage(), dict(microbatches=2), ValueError, r"Received: stages=\['/device:CPU:1'\]"),
    (_stacked, dict(microbatches=2, gpus=2), ValueError, r"cuts unplaced models only.*Drop gpus=\. Received: gpus=2"),
    (lambda seed: _unplaced(seed), dict(microbatches=2, gpus=1), ValueError, r"at least 2\. Received: gpus=1"),
    (lambda seed: _unplaced(seed), dict(microbatches=2, gpus=3), ValueError, r"cannot cut 2 layer\(s\) into 3 stages.*Received: gpus=3"),
    (lambda seed: _unplaced(seed), dict(microbatches=2, gpus=9), kerasmulti.DeviceError, r"Received: gpus=9"),
    (lambda seed: _built_subclassed(), dict(microbatches=2, gpus=2), ValueError, r"functional and Sequential models only.*Received: model=Subclassed"),
    (lambda seed: _on_a_missing_device(), dict(microbatches=2), kerasmulti.DeviceError,
     r"placed on /device:CPU:9, which this machine does not have\. Move them with kerasmulti\.remap_devices\(model, .*Received: stages="),
    (lambda seed: keras.Sequential([keras.layers.Dense(2)]), dict(microbatches=2, gpus=2), ValueError,
     r"pipeline\(\) needs a built model.*Received: model='sequential.*' with built=False"),
    (lambda seed: _unplaced(seed), dict(microbatches=2, gpus=2.0), TypeError, r"gpus as an int, the number of stages\. Received: gpus=2\.0"),
    (lambda seed: _unplaced(seed), dict(microbatches=2, gpus=True), TypeError, r"Received: gpus=True"),
    (_stacked, dict(microbatches=2, schedule=None), TypeError, r"schedule as a string.*Received: schedule=None"),
    (_stacked, dict(microbatches=2, schedule="pipedream"), ValueError, r"schedule='gpipe' or '1f1b'\. Received: schedule='pipedream'"),
    (lambda seed: _stacked(seed, batchnorm=True), dict(microbatches=4, schedule="1f1b"), ValueError,
     r"every micro-batch must pass it first\. Use schedule='gpipe'\. Received: BatchNormalization=\['batch_normalization"),
    (lambda seed: _with_own_step(), dict(microbatches=4, schedule="1f1b"), ValueError,
     r"Keras' own train_step.*Received: overrides=\['train_step'\]"),
])
def test_bad_pipelines_are_refused_saying_what_to_do(make, arguments, error, message):
    with pytest.raises(error, match=message):
        kerasmulti.pipeline(make(0), **arguments)
