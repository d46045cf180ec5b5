"""Placed models in `.keras` files that plain Keras loads, and `strip_placement`.

Each model is compared with itself placed, on seeded random data: predictions,
and one more epoch of training from the saved optimizer state.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

SEED = int(np.random.SeedSequence().entropy % 2**31)
DATA = Path(__file__).parent.parent / "data"


@pytest.fixture
def rng():
    print(f"seed {SEED}")  # shown with a failure, to replay it
    return np.random.default_rng(SEED)


def _placed_towers(names=""):
    """A shared LSTM on two devices, then two sub-models placed inside.

    `names` prefixes every name, so that two builds can be named alike.
    """
    tweet_a, tweet_b = keras.Input((3, 2), name=f"{names}tweet_a"), keras.Input((3, 2), name=f"{names}tweet_b")
    lstm = keras.layers.LSTM(4, name=f"{names}lstm")
    with kerasmulti.device_scope("/cpu:1"):
        a = lstm(tweet_a)
    with kerasmulti.device_scope("/cpu:2"):
        b = lstm(tweet_b)

    def tower(name, device):
        inputs = keras.Input((4,), name=f"{names}{name}_input")
        with kerasmulti.device_scope(device):
            outputs = keras.layers.Dense(2, name="projection")(inputs)  # same name in both
        return keras.Model(inputs, outputs, name=f"{names}{name}")

    merged = keras.layers.Concatenate(name=f"{names}merge")([tower("tower_a", "/cpu:1")(a), tower("tower_b", "/cpu:2")(b)])
    with kerasmulti.device_scope("/cpu:1"):  # a Sequential built in a scope holds its wrappers itself
        head = keras.Sequential([keras.Input((4,), name=f"{names}head_input"), keras.layers.Dense(1, name=f"{names}score")], name=f"{names}head")
    return keras.Model([tweet_a, tweet_b], head(merged), name=f"{names}towers")


def _trained(rng):
    model = _placed_towers()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = [rng.normal(size=(8, 3, 2)).astype("float32") for _ in range(2)]
    y = rng.normal(size=(8, 1)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, x, y


def _wrappers(model):
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, kerasmulti.OnDevice)]


def _op_devices(model, spec, types=("MatMul",)):
    graph = tf.function(lambda *x: model(list(x) if len(x) > 1 else x[0])).get_concrete_function(*spec).graph
    return {op.device for op in graph.get_operations() if op.type in types}


PLAIN_KERAS = """
import sys
import keras, numpy as np
model = keras.models.load_model(sys.argv[1])
assert "kerasmulti" not in sys.modules
data = np.load(sys.argv[2])
x = [data["x0"], data["x1"]]
predictions = model.predict(x, verbose=0)
model.fit(x, data["y"], batch_size=4, epochs=1, shuffle=False, verbose=0)
np.savez(sys.argv[3], predictions=predictions, *model.get_weights())
print(sorted({type(layer).__module__.split(".")[0] for layer in model._flatten_layers()}))
"""


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
@pytest.mark.slow
def test_an_h5_file_of_a_placed_model_loads_with_kerasmulti_load_model_in_a_fresh_process(tmp_path, rng):
    model, x, _ = _trained(rng)
    path, data = tmp_path / "placed.h5", tmp_path / "x.npz"
    # legacy HDF5: the file holds the OnDevice layers. Without the optimizer: Keras cannot write the
    # optimizer's slots of the two same-named "projection" layers (one path), placed or not.
    model.save(path, include_optimizer=False)
    np.savez(data, x0=x[0], x1=x[1], y=model.predict(x, verbose=0))
    script = (
        "import sys, numpy as np, kerasmulti\n"
        "kerasmulti.simulate_devices(3)\n"
        # compile=False: Keras' legacy loader cannot compile an .h5 with loss="mse"
        "model = kerasmulti.load_model(sys.argv[1], compile=False)\n"
        "d = np.load(sys.argv[2])\n"
        "np.testing.assert_allclose(model.predict([d['x0'], d['x1']], verbose=0), d['y'], rtol=1e-6, atol=1e-7)\n"
        "print(sorted({w.device for w in model.layers if isinstance(w, kerasmulti.OnDevice)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERASMULTI", "TF_CONFIG"))}
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), str(data)], capture_output=True, text=True, timeout=300,
        env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(sorted({w.device for w in _wrappers(model)}))


@pytest.mark.slow  # 6-9 s: the fast tier keeps the other loading tests
def test_plain_keras_loads_the_file_of_a_placed_model_and_trains_on(tmp_path, rng):
    model, x, y = _trained(rng)
    path, data, out = tmp_path / "placed.keras", tmp_path / "data.npz", tmp_path / "plain.npz"
    model.save(path)
    np.savez(data, x0=x[0], x1=x[1], y=y)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERASMULTI", "TF_CONFIG", "PYTHONPATH"))}
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_KERAS, str(path), str(data), str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**env, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['keras']"  # no layer of another package
    plain = np.load(out)
    np.testing.assert_allclose(plain["predictions"], model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    # The optimizer's state came along: one more epoch ends where the placed model's does.
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()
    assert len(weights) == len(plain.files) - 1
    for i, expected in enumerate(weights):
        np.testing.assert_allclose(plain[f"arr_{i}"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zipped", [True, False])
def test_loading_with_kerasmulti_puts_the_placement_back(tmp_path, rng, zipped):
    model, x, y = _trained(rng)
    path = tmp_path / ("placed.keras" if zipped else "placed")
    model.save(path, zipped=zipped)
    loaded = kerasmulti.load_model(path)
    assert [(w.name, w.device) for w in _wrappers(loaded)] == [(w.name, w.device) for w in _wrappers(model)]
    assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]
    lstm_a, lstm_b = (w for w in _wrappers(loaded) if w.name.startswith("lstm"))
    assert lstm_a.layer is lstm_b.layer
    spec = [tf.TensorSpec((None, 3, 2))] * 2
    assert _op_devices(loaded, spec, ("While", "MatMul")) == _op_devices(model, spec, ("While", "MatMul"))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    for m in (model, loaded):
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)



def test_keras_load_model_loads_the_plain_model_and_kerasmulti_load_model_a_plain_file_as_keras_does(tmp_path, rng):
    model, x, _ = _trained(rng)  # a placed model exists in this process: the saving routing is installed
    model.save(tmp_path / "placed.keras")
    plain = keras.models.load_model(tmp_path / "placed.keras")
    assert not _wrappers(plain)
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    unplaced = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    unplaced.save(tmp_path / "unplaced.keras")
    loaded = kerasmulti.load_model(tmp_path / "unplaced.keras")
    assert type(loaded) is keras.Sequential and not _wrappers(loaded)
    np.testing.assert_array_equal(loaded.get_weights()[0], unplaced.get_weights()[0])


def _config(path) -> str:
    """A file's config.json, with Keras' own object ids numbered in order of appearance.

    Keras marks an object it serialises twice (an LSTM's initializer, which
    its cell shares) with the object's memory address, in any model.
    """
    config = zipfile.ZipFile(path).read("config.json").decode()
    ids = {}
    return re.sub(r'"shared_object_id": (\d+)', lambda m: f'"shared_object_id": {ids.setdefault(m[1], len(ids))}', config)


def test_load_weights_reads_a_portable_file_into_the_placed_model(tmp_path, rng):
    model, x, _ = _trained(rng)
    model.save(tmp_path / "placed.keras")
    expected = model.predict(x, verbose=0)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    model.load_weights(tmp_path / "placed.keras")
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)


def test_the_saved_config_is_the_same_for_two_builds_of_one_model(tmp_path):
    configs = []
    for build in ("first", "second"):
        path = tmp_path / f"{build}.keras"
        _placed_towers(names="same_").save(path)
        configs.append(_config(path))
    assert configs[0] == configs[1]
    assert "OnDevice" not in configs[0] and configs[0].count("kerasmulti_devices") == 4


@keras.saving.register_keras_serializable("kerasmulti_tests")
class Branches(keras.layers.Layer):
    """One Dense run on two devices by a layer's own code, which kerasmulti cannot rebuild."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        dense = keras.layers.Dense(3, name="branch")
        self.first, self.second = kerasmulti.on_device(dense, "/cpu:1"), kerasmulti.on_device(dense, "/cpu:2")

    def build(self, input_shape):
        self.first.layer.build(input_shape)

    def call(self, x):
        return self.first(x) + self.second(x)


def _placed_in_code(names=""):
    inputs = keras.Input((4,), name=f"{names}inputs")
    shared = keras.layers.Dense(4, name=f"{names}shared")
    with kerasmulti.device_scope("/cpu:1"):
        a = shared(inputs)
    with kerasmulti.device_scope("/cpu:2"):
        b = shared(inputs)
    added = keras.layers.Add(name=f"{names}add")([a, b])
    return keras.Model(inputs, Branches(name=f"{names}branches")(added), name=f"{names}model")


def test_a_model_placed_in_its_own_code_keeps_its_wrappers_in_a_stable_file(tmp_path, rng):
    configs = []
    for build in ("first", "second"):
        model = _placed_in_code(names="same_")
        model.save(tmp_path / f"{build}.keras")
        configs.append(_config(tmp_path / f"{build}.keras"))
    assert configs[0] == configs[1]
    assert '"OnDevice"' in configs[0]  # needs kerasmulti to load, as the layer needs its own code
    loaded = kerasmulti.load_model(tmp_path / "second.keras")
    first, second = (w for w in loaded.layers if isinstance(w, kerasmulti.OnDevice))
    assert first.layer is second.layer and (first.device, second.device) == ("/device:CPU:1", "/device:CPU:2")
    x = rng.normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_a_wrapper_whose_layer_was_not_loaded_is_refused():
    config = {"name": "dense_on_cpu1", "device": "/device:CPU:1", "layer": None, "layer_id": 3}
    with pytest.raises(ValueError, match=r"was not loaded first.*load_model\. Received: layer_id=3"):
        kerasmulti.OnDevice.from_config(config)


def _masked(placed):
    keras.utils.set_random_seed(3)
    tokens = keras.Input((6,), dtype="int32")
    embed, lstm = keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.LSTM(5)
    if placed:
        embed = kerasmulti.on_device(embed, "/cpu:1")
    return keras.Model(tokens, lstm(embed(tokens)))


@pytest.mark.parametrize("case", ["towers", "masked"])
def test_strip_placement_runs_the_same_layers_without_wrappers(rng, case):
    if case == "towers":
        model = _placed_towers()
        x = [rng.normal(size=(6, 3, 2)).astype("float32") for _ in range(2)]
        spec = [tf.TensorSpec((None, 3, 2))] * 2
    else:
        model = _masked(placed=True)
        lengths = rng.integers(1, 7, size=(6, 1))
        x = np.where(np.arange(6) < lengths, rng.integers(1, 20, size=(6, 6)), 0).astype("int32")
        spec = [tf.TensorSpec((None, 6), tf.int32)]
        # Without the mask the LSTM would read the padding: the unplaced model is the reference.
        reference = _masked(placed=False)
        np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-6)
    plain = kerasmulti.strip_placement(model)
    assert not _wrappers(plain) and _wrappers(model)
    assert [id(w) for w in plain.weights] == [id(w) for w in model.weights]  # the same variables
    assert _op_devices(plain, spec, ("MatMul", "While")) == {""}  # nothing placed any more
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


def test_strip_placement_keeps_compile_settings_and_optimizer(rng):
    model, x, y = _trained(rng)
    plain = kerasmulti.strip_placement(model)
    assert plain.optimizer is model.optimizer and plain.loss == model.loss
    stripped = kerasmulti.strip_placement(kerasmulti.parallelize(model, gpus=1))  # its template's
    assert not _wrappers(stripped) and [id(w) for w in stripped.weights] == [id(w) for w in model.weights]
    unplaced = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert kerasmulti.strip_placement(unplaced) is unplaced


def test_strip_placement_refusals():
    with pytest.raises(TypeError, match=r"takes a keras.Model\. Received: model=Dense"):
        kerasmulti.strip_placement(keras.layers.Dense(2))
    with pytest.raises(ValueError, match=r"inside a subclassed model or layer.*Received: model='code_model'"):
        kerasmulti.strip_placement(_placed_in_code(names="code_"))


def test_a_missing_or_damaged_file_is_named_for_what_it_is(tmp_path):
    # Keras says "File not found" for both.
    missing = str(tmp_path / "nope.keras")
    with pytest.raises(ValueError, match=rf"The model file '.*nope.keras' does not exist\. Check the path\. Received: filepath='{re.escape(missing)}'"):
        kerasmulti.load_model(missing)
    damaged = tmp_path / "cut.keras"
    damaged.write_bytes(b"PK\x03\x04 not the rest of a zip")
    with pytest.raises(ValueError, match=r"'.*cut.keras' is not a readable .keras file: a .keras file is a zip archive, and this one is not"):
        kerasmulti.load_model(str(damaged))
