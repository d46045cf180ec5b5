"""A placed model is the unplaced model: its numbers (dtypes), its output names, its saved file, its pipeline."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import contextlib
import importlib
import json
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

SEED = int(np.random.SeedSequence().entropy % 2**31)


@pytest.fixture
def rng():
    print(f"seed {SEED}")  # shown with a failure, to replay it
    return np.random.default_rng(SEED)


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _scope(placed, device):
    return kerasmulti.device_scope(device) if placed else contextlib.nullcontext()


def _one_layer(placed, dtype, input_dtype):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,), dtype=input_dtype)
    with _scope(placed, "/cpu:1"):
        outputs = keras.layers.Dense(2, dtype=dtype)(inputs)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize(
    "policy, dtype, input_dtype",
    [("mixed_float16", "float32", "float32"), ("float32", "float64", "float64")],
)
def test_a_placed_layer_computes_in_its_own_dtype_as_unplaced(request, rng, tmp_path, policy, dtype, input_dtype):
    # The wrapper cast inputs by the global policy first: float16 for a float32 layer, float32 for a float64 one.
    if policy == "mixed_float16":
        request.getfixturevalue("mixed_float16")
    x = (rng.normal(size=(16, 3)) * 1000).astype(input_dtype)  # float16 keeps 3 digits: a cast shows
    x[:, 1] = 1 + rng.uniform(1e-12, 1e-10, size=16)  # float32 drops these: a cast to it shows
    placed, unplaced = _one_layer(True, dtype, input_dtype), _one_layer(False, dtype, input_dtype)
    expected = unplaced.predict(x, verbose=0)
    assert expected.dtype == dtype
    np.testing.assert_array_equal(placed.predict(x, verbose=0), expected)
    np.testing.assert_array_equal(placed(tf.constant(x)).numpy(), unplaced(tf.constant(x)).numpy())  # a plain call too
    path = tmp_path / "placed.keras"
    placed.save(path)
    for load in (keras.models.load_model, kerasmulti.load_model):
        np.testing.assert_array_equal(load(path).predict(x, verbose=0), expected, err_msg=load.__module__)


def test_a_wrapper_saved_before_it_kept_its_layers_dtype_runs_in_that_dtype(rng):
    # A subclassed model's file holds OnDevice configs: older ones with the name and policy the wrapper had then.
    layer = keras.layers.Dense(1, dtype="float64", kernel_initializer="ones", name="wide")
    config = {"name": "wide_on_cpu1", "trainable": True, "dtype": "float32", "device": "/device:CPU:1",
              "layer": keras.saving.serialize_keras_object(layer)}
    wrapper = kerasmulti.OnDevice.from_config(config)
    assert wrapper.name == "wide_on_cpu1"
    x = tf.constant(1 + rng.uniform(1e-12, 1e-10, size=(4, 3)), dtype="float64")
    np.testing.assert_array_equal(wrapper(x).numpy(), wrapper.layer(x).numpy())
    assert wrapper(x).dtype == tf.float64


def _scored(placed, seed=7):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="body")(inputs)
    with _scope(placed, "/cpu:1"):
        score = keras.layers.Dense(1, name="score")(hidden)
    with _scope(placed, "/cpu:2"):
        tags = keras.layers.Dense(2, name="tags")(hidden)
    model = keras.Model(inputs, [score, tags])
    model.compile(optimizer="sgd", loss={"score": "mse", "tags": "mae"}, metrics={"tags": "mse"})
    return model


def _scored_data(rng, rows=16):
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, {"score": rng.normal(size=(rows, 1)).astype("float32"), "tags": rng.normal(size=(rows, 2)).astype("float32")}


def _assert_history(got, expected):
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, err_msg=key)


def test_placed_outputs_keep_their_names_for_dict_losses_targets_and_history(rng):
    x, y = _scored_data(rng)
    placed, unplaced = _scored(True), _scored(False)
    assert placed.output_names == unplaced.output_names == ["score", "tags"]
    assert placed.get_layer("score").device == "/device:CPU:1"
    expected = unplaced.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert "score_loss" in expected
    _assert_history(placed.fit(x, y, batch_size=8, epochs=2, verbose=0).history, expected)


def _without_names(path, to):
    """`path` as written before wrapper names were recorded: the `kerasmulti_names` entries taken out."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "kerasmulti_names"}
        return [strip(v) for v in value] if isinstance(value, list) else value

    with zipfile.ZipFile(path) as source, zipfile.ZipFile(to, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                data = json.dumps(strip(json.loads(data))).encode()
            target.writestr(item, data)
    return to


def test_a_saved_placed_model_loads_compiled_with_its_output_names_in_keras_and_kerasmulti(rng, tmp_path):
    x, y = _scored_data(rng)
    placed, unplaced = _scored(True), _scored(False)
    placed.fit(x, y, batch_size=8, verbose=0)
    unplaced.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / "scored.keras"
    placed.save(path)
    expected = unplaced.fit(x, y, batch_size=8, verbose=0).history
    older = _without_names(path, tmp_path / "older.keras")
    for load, file in ((keras.models.load_model, path), (kerasmulti.load_model, path), (kerasmulti.load_model, older)):
        loaded = load(file)
        assert loaded.output_names == ["score", "tags"], (load.__module__, file.name)
        _assert_history(loaded.fit(x, y, batch_size=8, verbose=0).history, expected)
    devices = {layer.name: layer.device for layer in kerasmulti.load_model(older).layers if isinstance(layer, kerasmulti.OnDevice)}
    assert devices == {"score": "/device:CPU:1", "tags": "/device:CPU:2"}


def test_a_layer_also_run_unplaced_or_on_another_device_gets_wrappers_of_their_own_names(rng):
    def build(placed):
        keras.utils.set_random_seed(9)
        a, b, c = keras.Input((3,)), keras.Input((3,)), keras.Input((3,))
        shared = keras.layers.Dense(2, name="shared")
        first = shared(a)  # unplaced, before it is placed
        with _scope(placed, "/cpu:1"):
            second = shared(b)
        with _scope(placed, "/cpu:2"):
            third = shared(c)
        return keras.Model([a, b, c], keras.layers.Add(name="sum")([first, second, third]))

    placed, unplaced = build(True), build(False)
    names = [(layer.name, getattr(layer, "device", None)) for layer in placed.layers if layer.name.startswith("shared")]
    assert names == [("shared", None), ("shared_on_cpu1", "/device:CPU:1"), ("shared_on_cpu2", "/device:CPU:2")]
    x = [rng.normal(size=(4, 3)).astype("float32") for _ in range(3)]
    np.testing.assert_allclose(placed.predict(x, verbose=0), unplaced.predict(x, verbose=0), rtol=1e-6)


def test_on_device_twice_for_one_device_gives_one_wrapper_called_twice(rng):
    def build(placed):
        keras.utils.set_random_seed(11)
        a, b = keras.Input((3,)), keras.Input((3,))
        shared = keras.layers.Dense(2, name="shared")
        place = (lambda layer: kerasmulti.on_device(layer, "/cpu:1")) if placed else (lambda layer: layer)
        return keras.Model([a, b], [place(shared)(a), place(shared)(b)])

    placed, unplaced = build(True), build(False)
    assert [layer.name for layer in placed.layers if isinstance(layer, kerasmulti.OnDevice)] == ["shared"]
    x = [rng.normal(size=(4, 3)).astype("float32") for _ in range(2)]
    for got, expected in zip(placed.predict(x, verbose=0), unplaced.predict(x, verbose=0)):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_cut_model_compiled_with_dict_losses_trains_on_targets_keyed_by_its_output_names(rng):
    x, y = _scored_data(rng, rows=20)
    reference = _scored(False).fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    piped = kerasmulti.pipeline(_scored(False), microbatches=2, gpus=2)
    assert kerasmulti.unwrap(piped).output_names == ["score", "tags"]
    _assert_history(piped.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history, reference)


def _stacked(placed, seed=13):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    with _scope(placed, "/cpu:1"):
        hidden = keras.layers.Dense(6, activation="relu")(inputs)
    with _scope(placed, "/cpu:2"):
        outputs = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_remapping_a_pipeline_is_refused_and_its_template_pipelines_again_on_the_new_devices(rng):
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    piped = kerasmulti.pipeline(_stacked(True), microbatches=2)
    with pytest.raises(ValueError, match=r"pipeline\(\) again\. Received: model='pipeline_functional.*'$"):
        kerasmulti.remap_devices(piped, {"/cpu:1": "/cpu:0"})
    assert piped.stages == ["/device:CPU:1", "/device:CPU:2"]
    template = kerasmulti.remap_devices(kerasmulti.unwrap(piped), {"/cpu:1": "/cpu:0"})
    again = kerasmulti.pipeline(template, microbatches=2)
    assert again.stages == ["/device:CPU:0", "/device:CPU:2"]
    expected = _stacked(False).fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    _assert_history(again.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history, expected)


def test_device_scope_inside_a_subclassed_models_call_warns_that_it_places_nothing(monkeypatch):
    monkeypatch.setattr(importlib.import_module("kerasmulti._src.model_parallel.device_scope"), "_warned", [])

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(2, name="inner")

        def call(self, x):
            with kerasmulti.device_scope("/cpu:2"):
                return self.inner(x)

    with pytest.warns(UserWarning, match=r"'inner' got tensors and runs unplaced.*Received: layer='inner'$"):
        Net()(np.ones((2, 3), "float32"))


def test_a_placed_model_run_inside_its_scope_is_not_warned_about(monkeypatch):
    # Built, then called, fitted and predicted in the same block, as a notebook cell does: it is placed.
    monkeypatch.setattr(importlib.import_module("kerasmulti._src.model_parallel.device_scope"), "_warned", [])
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    with kerasmulti.device_scope("/cpu:1"), warnings.catch_warnings():
        warnings.simplefilter("error")
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        model(x)
        model.fit(x, x[:, :2], verbose=0)
        model.predict(x, verbose=0)
    assert [type(layer).__name__ for layer in model.layers[1:]] == ["OnDevice", "OnDevice"]
