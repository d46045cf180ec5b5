"""Model parallelism: device_scope / on_device placement, proven by tracing."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import contextlib
import io
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

RNG = np.random.default_rng(1234)  # module level: drawn before any test seeds it


def _shared_lstm(placed=True):
    tweet_a, tweet_b = keras.Input((6, 4), name="tweet_a"), keras.Input((6, 4), name="tweet_b")
    shared_lstm = keras.layers.LSTM(8)
    if placed:
        with kerasmulti.device_scope("/cpu:1"):
            encoded_a = shared_lstm(tweet_a)
        with kerasmulti.device_scope("/cpu:2"):
            encoded_b = shared_lstm(tweet_b)
    else:
        encoded_a, encoded_b = shared_lstm(tweet_a), shared_lstm(tweet_b)
    merged = keras.layers.concatenate([encoded_a, encoded_b], axis=-1)
    return keras.Model([tweet_a, tweet_b], keras.layers.Dense(1, activation="sigmoid")(merged))


def _towers(placed=True):
    def tower(name):
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)], name=name)

    a, b = tower("tower_a"), tower("tower_b")
    if placed:
        a, b = kerasmulti.on_device(a, "/cpu:1"), kerasmulti.on_device(b, "/cpu:2")
    left, right = keras.Input((5,)), keras.Input((5,))
    score = keras.layers.Dot(axes=1)([a(left), b(right)])
    return keras.Model([left, right], score)


def _op_devices(fn, specs, types):
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return {op.device for op in graph.get_operations() if op.type in types}


def _pairs(rows=12, shape=(6, 4)):
    return [RNG.normal(size=(rows, *shape)).astype("float32") for _ in range(2)]


def test_shared_lstm_example_keeps_one_set_of_weights_and_runs_each_call_on_its_device():
    model = _shared_lstm()
    wrappers = [layer for layer in model.layers if isinstance(layer, kerasmulti.OnDevice)]
    assert [w.device for w in wrappers] == ["/device:CPU:1", "/device:CPU:2"]
    assert wrappers[0].layer is wrappers[1].layer
    assert len(model.weights) == 3 + 2  # one LSTM, one Dense
    # The shared LSTM's weights were created under the first scope that built it.
    assert all(w.value.device.endswith("CPU:1") for w in wrappers[0].layer.weights)
    rows = {row["layer"]: row for row in kerasmulti.placement_summary(model).rows}
    assert rows[wrappers[1].name]["params"] == 0
    assert rows[wrappers[1].name]["shares_weights_with"] == wrappers[0].name
    assert rows[wrappers[0].name]["params"] == sum(int(np.prod(w.shape)) for w in wrappers[0].layer.weights)
    spec = tf.TensorSpec((None, 6, 4))
    assert _op_devices(lambda a, b: model([a, b]), (spec, spec), {"While"}) == {"/device:CPU:1", "/device:CPU:2"}


def test_results_and_training_equal_the_unplaced_model():
    placed, plain = _shared_lstm(), _shared_lstm(placed=False)
    plain.set_weights(placed.get_weights())
    x, y = _pairs(), (RNG.random((12, 1)) > 0.5).astype("float32")
    np.testing.assert_allclose(placed.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    for m in (placed, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(placed.fit(x, y, **fit).history["loss"], plain.fit(x, y, **fit).history["loss"], rtol=1e-5)
    for a, b in zip(placed.weights, plain.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_branch_and_training_steps_are_placed():
    model = _towers()
    x, y = _pairs(shape=(5,)), RNG.normal(size=(12, 1)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    gradients = tape.gradient(loss, model.trainable_variables)
    assert len(gradients) == 8
    assert all(g is not None and float(tf.reduce_max(tf.abs(g))) > 0 for g in gradients)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, epochs=1, verbose=0)
    steps = {
        "fit": (model.train_step, ((tf.constant(x[0]), tf.constant(x[1])), tf.constant(y))),
        "evaluate": (model.test_step, ((tf.constant(x[0]), tf.constant(x[1])), tf.constant(y))),
        "predict": (model.predict_step, ((tf.constant(x[0]), tf.constant(x[1])),)),
    }
    for name, (step, data) in steps.items():
        devices = _op_devices(step, (data,), {"MatMul"})
        assert {"/device:CPU:1", "/device:CPU:2"} <= devices, (name, devices)

    def matmuls(step, data):
        graph = tf.function(step).get_concrete_function(data).graph
        return [op.device for op in graph.get_operations() if op.type == "MatMul"]

    forward = matmuls(*steps["predict"])
    training = matmuls(*steps["fit"])
    # The backward pass runs on each branch's device too: more placed MatMuls
    # than the forward pass has, and none left on the default device.
    assert training.count("/device:CPU:1") > forward.count("/device:CPU:1") == 2
    assert training.count("/device:CPU:2") > forward.count("/device:CPU:2") == 2
    assert "" not in training


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_a_gradient_penalty_and_a_persistent_tape_reach_placed_layers_as_unplaced_ones(compiled):
    # WGAN-GP's penalty differentiates a gradient; a persistent tape is asked twice. Both
    # asked a placed layer's inner tape a second time (before: "non-persistent GradientTape").
    placed, plain = _towers(), _towers(placed=False)
    plain.set_weights(placed.get_weights())
    x = [tf.constant(a) for a in _pairs(shape=(5,))]

    def penalty_and_gradients(model):
        with tf.GradientTape() as outer, tf.GradientTape(persistent=True) as twice:
            twice.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                score = model(x, training=True)
            by_input = inner.gradient(score, x)
            penalty = tf.reduce_mean(tf.square(tf.norm(by_input[0], axis=1) - 1.0)) + tf.reduce_mean(score)
        by_weight = outer.gradient(penalty, model.trainable_variables)
        return [penalty, *by_weight, *twice.gradient(penalty, x), *twice.gradient(penalty, model.trainable_variables)]

    run = tf.function(penalty_and_gradients) if compiled else penalty_and_gradients
    got, expected = run(placed), run(plain)
    assert len(got) == 1 + 8 + 2 + 8 and all(g is not None for g in got)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_on_device_in_sequential_and_subclassed_models():
    class TwoDevices(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = kerasmulti.on_device(keras.layers.Dense(3), "/cpu:1")
            self.second = kerasmulti.on_device(keras.layers.Dense(2), "/cpu:2")

        def call(self, x):
            return self.second(self.first(x))

    sequential = keras.Sequential([keras.Input((4,)), kerasmulti.on_device(keras.layers.Dense(3), "/cpu:1"), keras.layers.Dense(2)])
    subclassed = TwoDevices()
    subclassed(np.zeros((1, 4), "float32"))
    spec = tf.TensorSpec((None, 4))
    assert _op_devices(lambda x: sequential(x), (spec,), {"MatMul"}) == {"/device:CPU:1", ""}
    assert _op_devices(lambda x: subclassed(x), (spec,), {"MatMul"}) == {"/device:CPU:1", "/device:CPU:2"}


def test_placement_and_sharing_survive_saving(tmp_path):
    model = _shared_lstm()
    x = _pairs()
    path = str(tmp_path / "placed.keras")
    model.save(path)
    loaded = kerasmulti.load_model(path)
    wrappers = [layer for layer in loaded.layers if isinstance(layer, kerasmulti.OnDevice)]
    assert [w.device for w in wrappers] == ["/device:CPU:1", "/device:CPU:2"]
    assert wrappers[0].layer is wrappers[1].layer
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def _attention(placed):
    keras.utils.set_random_seed(7)
    query, context = keras.Input((3, 4)), keras.Input((5, 4))
    value = keras.layers.Dense(4, name="value_projection")(context)
    attention = keras.layers.MultiHeadAttention(2, 4)
    with kerasmulti.device_scope("/cpu:1") if placed else contextlib.nullcontext():
        attended = attention(query, value)  # `value` is an argument besides the inputs
    return keras.Model([query, context], keras.layers.Flatten()(attended))


def test_gradients_reach_tensors_passed_as_other_arguments():
    placed, plain = _attention(placed=True), _attention(placed=False)
    x = [RNG.normal(size=(4, 3, 4)).astype("float32"), RNG.normal(size=(4, 5, 4)).astype("float32")]
    gradients = []
    for model in (placed, plain):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        gradients.append(tape.gradient(loss, model.get_layer("value_projection").trainable_variables))
    assert all(g is not None for g in gradients[0])
    for a, b in zip(*gradients):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", ["add", "self-attention"])
def test_one_tensor_passed_twice_to_a_placed_layer_gets_the_unplaced_gradient(call):
    # Its gradient came back twice over: self-attention's `mha(h, h)` trained placed or
    # pipelined to other weights, with no word (found by review).
    def build(place):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3, 4))
        hidden = keras.layers.Dense(4, name="first")(inputs)
        with kerasmulti.device_scope("/cpu:1") if place else contextlib.nullcontext():
            if call == "add":
                mixed = keras.layers.Add()([hidden, hidden])
            else:
                mixed = keras.layers.MultiHeadAttention(2, 2)(hidden, hidden)
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(mixed)))

    x, y = RNG.normal(size=(5, 3, 4)).astype("float32"), RNG.normal(size=(5, 1)).astype("float32")
    gradients = []
    for model in (build(True), build(False)):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((model(x, training=True) - y) ** 2)
        gradients.append(tape.gradient(loss, model.get_layer("first").trainable_variables))
    for a, b in zip(*gradients):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_placed_layer_takes_a_sparse_input_and_trains_as_unplaced():
    # tf.convert_to_tensor refused the SparseTensor: "Failed to convert elements of SparseTensor" (found by review).
    def train(place):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,), sparse=True)
        dense = keras.layers.Dense(3)
        hidden = kerasmulti.on_device(dense, "/cpu:1")(inputs) if place else dense(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
        x = tf.sparse.from_dense(np.where(RNG.random((8, 6)) > 0.5, 1.0, 0.0).astype("float32"))
        return model, model.fit(x, np.ones((8, 1)), batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]

    keras.utils.set_random_seed(3)
    state = RNG.bit_generator.state
    placed, placed_losses = train(True)
    RNG.bit_generator.state = state  # the same rows
    plain, plain_losses = train(False)
    np.testing.assert_allclose(placed_losses, plain_losses, rtol=1e-5)
    for a, b in zip(placed.weights, plain.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_placed_layer_takes_its_first_input_by_name_as_unplaced():
    # `mha(query=q, value=v)` failed placed: "missing a required argument: 'inputs'" (found by review).
    q, v = keras.Input((3, 4)), keras.Input((5, 4))
    with kerasmulti.device_scope("/cpu:1"):
        scoped = keras.layers.MultiHeadAttention(2, 2)(query=q, value=v)
    layer = keras.layers.MultiHeadAttention(2, 2)
    wrapped = kerasmulti.on_device(layer, "/cpu:2")(query=q, value=v)
    x = [RNG.normal(size=(2, 3, 4)).astype("float32"), RNG.normal(size=(2, 5, 4)).astype("float32")]
    for outputs, device in ((scoped, "/device:CPU:1"), (wrapped, "/device:CPU:2")):
        model = keras.Model([q, v], outputs)
        (placed,) = [lay for lay in model.layers if isinstance(lay, kerasmulti.OnDevice)]
        assert placed.device == device
        np.testing.assert_allclose(model.predict(x, verbose=0), placed.layer(query=x[0], value=x[1]), rtol=1e-5, atol=1e-6)


def test_same_named_layers_in_placed_sub_models_stay_apart_after_saving(tmp_path):
    def tower(name, device):
        inputs = keras.Input((4,))
        with kerasmulti.device_scope(device):
            outputs = keras.layers.Dense(3, name="projection")(inputs)  # same name in both
        return keras.Model(inputs, outputs, name=name)

    inputs = keras.Input((4,))
    towers = [tower("tower_a", "/cpu:1"), tower("tower_b", "/cpu:2")]
    model = keras.Model(inputs, keras.layers.Concatenate()([t(inputs) for t in towers]))
    path = str(tmp_path / "towers.keras")
    model.save(path)
    loaded = kerasmulti.load_model(path)
    assert loaded.count_params() == model.count_params() == 2 * (4 * 3 + 3)
    x = RNG.normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def _move_in_file(path, old, new):
    """Rewrites a .keras file as if saved on a machine with other devices."""
    with zipfile.ZipFile(path) as source:
        files = {name: source.read(name) for name in source.namelist()}
    files["config.json"] = files["config.json"].replace(old.encode(), new.encode())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as target:
        for name, data in files.items():
            target.writestr(name, data)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def test_missing_device_runs_anyway_with_one_warning_and_can_be_remapped(tmp_path):
    model = _shared_lstm()
    x = _pairs()
    path = str(tmp_path / "elsewhere.keras")
    model.save(path)
    _move_in_file(path, "/device:CPU:2", "/device:GPU:7")
    with pytest.warns(UserWarning, match=r"placed on /device:GPU:7, which this machine does not have.*remap_devices") as record:
        loaded = kerasmulti.load_model(path)
        got = loaded.predict(x, verbose=0)
        loaded(x)
    assert sum("GPU:7" in str(w.message) for w in record) == 1
    # The wrapper's name, as placement_summary lists it (not its layer's, which names the one on another device).
    moved = [w.name for w in loaded.layers if isinstance(w, kerasmulti.OnDevice) and w.device == "/device:GPU:7"]
    assert any(str(w.message).startswith(f"Layer '{moved[0]}' is placed on /device:GPU:7") for w in record), moved
    np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-6)
    kerasmulti.remap_devices(loaded, {"/gpu:7": "/cpu:0"})
    assert loaded.predict_function is None  # the step traced with the old devices is dropped
    spec = tf.TensorSpec((None, 6, 4))
    assert _op_devices(lambda a, b: loaded([a, b]), (spec, spec), {"While"}) == {"/device:CPU:1", "/device:CPU:0"}


def test_placement_summary_lists_devices_params_and_crossings():
    summary = kerasmulti.placement_summary(_towers())
    rows = {row["layer"]: row for row in summary.rows}
    assert rows["tower_a"]["device"] == "/device:CPU:1"
    assert rows["tower_a"]["params"] == 5 * 8 + 8 + 8 * 4 + 4
    assert rows["tower_b"]["type"] == "Sequential"
    assert [row["device"] for row in summary.rows if row["type"] == "Dot"] == [None]
    crossings = {(c["tensor"], c["from"], c["to"]) for c in summary.crossings}
    assert ("tower_a", "/device:CPU:1", None) in crossings
    assert ("tower_b", "/device:CPU:2", None) in crossings
    text = str(summary)
    assert "tower_a" in text and "/device:CPU:2" in text and "tensors crossing devices" in text


def test_placement_summary_lists_a_subclassed_models_layer_wrapped_in_init_once():
    # Keras tracks `self.a` before and after `self.a = on_device(self.a, ...)`: each layer was
    # listed twice, once as "(default)", and the params added to twice count_params (found by review).
    class Placed(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(5, name="a"), keras.Sequential([keras.layers.Dense(1)], name="b")
            self.a, self.b = kerasmulti.on_device(self.a, "/cpu:1"), kerasmulti.on_device(self.b, "/cpu:2")

        def call(self, x):
            return self.b(self.a(x))

    model = Placed()
    model(np.zeros((2, 4), "float32"))
    summary = kerasmulti.placement_summary(model)
    assert [(row["layer"], row["device"]) for row in summary.rows] == [("a", "/device:CPU:1"), ("b", "/device:CPU:2")]
    assert sum(row["params"] for row in summary.rows) == model.count_params() == 31


def test_placement_summary_opens_sub_models_and_skips_other_models_uses():
    def tower(name, device):
        inputs = keras.Input((4,))
        with kerasmulti.device_scope(device):
            outputs = keras.layers.Dense(3)(inputs)
        return keras.Model(inputs, outputs, name=name)

    inputs = keras.Input((4,))
    towers = [tower("tower_a", "/cpu:1"), tower("tower_b", "/cpu:2")]
    model = keras.Model(inputs, keras.layers.Concatenate(name="cat")([t(inputs) for t in towers]))
    summary = kerasmulti.placement_summary(model)
    placed = {row["layer"].split("/")[0]: row["device"] for row in summary.rows if row["type"] == "Dense"}
    assert placed == {"tower_a": "/device:CPU:1", "tower_b": "/device:CPU:2"}
    assert sum(row["params"] for row in summary.rows) == model.count_params()
    crossings = {(c["tensor"], c["from"], c["to"]) for c in summary.crossings}
    assert {("tower_a", "/device:CPU:1", None), ("tower_b", "/device:CPU:2", None)} <= crossings
    # The placed Dense of tower_a, called again in another model, is not tower_a's.
    other = keras.Input((4,))
    keras.Model(other, towers[0].layers[1](keras.layers.Dense(4, name="pre")(other)))
    assert not any("pre" in c["tensor"] for c in kerasmulti.placement_summary(towers[0]).crossings)


def test_a_sequential_built_in_a_scope_keeps_its_placement_when_saved(tmp_path):
    with kerasmulti.device_scope("/cpu:1"):
        tower = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    assert [row["device"] for row in kerasmulti.placement_summary(tower).rows] == ["/device:CPU:1"] * 2
    path = str(tmp_path / "tower.keras")
    tower.save(path)
    loaded = kerasmulti.load_model(path)
    spec = tf.TensorSpec((None, 4))
    assert _op_devices(lambda x: loaded(x), (spec,), {"MatMul"}) == {"/device:CPU:1"}
    x = RNG.normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), tower.predict(x, verbose=0), rtol=1e-6)


def test_remap_devices_retraces_parallel_predict():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, kerasmulti.on_device(keras.layers.Dense(3), "/cpu:1")(inputs))
    x = RNG.normal(size=(8, 4)).astype("float32")
    kerasmulti.parallel_predict(model, x, gpus=1, verbose=0)
    kerasmulti.remap_devices(model, {"/cpu:1": "/cpu:2"})
    np.testing.assert_allclose(kerasmulti.parallel_predict(model, x, gpus=1, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    (parallel, _), = model.__dict__["__kerasmulti_parallel_models"].values()
    traced = {
        op.device
        for function in parallel._kerasmulti_predict._list_all_concrete_functions()
        for op in function.graph.get_operations()
        if op.type == "MatMul"
    }
    assert traced == {"/device:CPU:2"}
    wrapped = kerasmulti.parallelize(model, gpus=1)
    wrapped.predict(x, verbose=0)
    model.predict(x, verbose=0)
    kerasmulti.remap_devices(wrapped, {"/cpu:2": "/cpu:1"})
    assert wrapped.predict_function is None and model.predict_function is None  # the template's too
    assert "__kerasmulti_parallel_models" not in model.__dict__
    assert _op_devices(lambda x: wrapped(x), (tf.TensorSpec((None, 4)),), {"MatMul"}) == {"/device:CPU:1"}


def test_device_names_are_checked_like_parallelize():
    with pytest.raises(kerasmulti.DeviceError, match=r"does not exist.*Known devices: /device:CPU:0.*Received: device='/gpu:5'"):
        with kerasmulti.device_scope("/gpu:5"):
            pass
    with pytest.raises(kerasmulti.DeviceError, match=r"Received: device='/cpu:9'"):
        kerasmulti.on_device(keras.layers.Dense(2), "/cpu:9")
    with pytest.raises(kerasmulti.DeviceError, match=r"remap_devices\(\).*Received: device='/gpu:1'"):
        kerasmulti.remap_devices(_towers(), {"/cpu:1": "/gpu:1"})
    with pytest.raises(TypeError, match=r"places a Keras layer.*Received: layer=function"):
        kerasmulti.on_device(lambda x: x, "/cpu:0")
    placed = kerasmulti.on_device(keras.layers.Dense(2, name="d"), "/cpu:0")
    with pytest.raises(ValueError, match=r"'d' is placed on /device:CPU:0 already.*Received: layer='d'$"):
        kerasmulti.on_device(placed, "/cpu:1")
    with pytest.raises(TypeError, match=r"describes a keras.Model.*Received: model=Dense"):
        kerasmulti.placement_summary(keras.layers.Dense(1))


def test_arguments_of_the_wrong_type_are_refused():
    with pytest.raises(TypeError, match=r"device_scope\(\) takes a device name as a string.*Received: device=1$"):
        with kerasmulti.device_scope(1):
            pass
    with pytest.raises(TypeError, match=r"on_device\(\) takes a device name.*Received: device=None$"):
        kerasmulti.on_device(keras.layers.Dense(2), None)
    # The class itself (it raised "'int' object has no attribute 'split'" and TensorFlow's parse error).
    for layer, device in ((keras.layers.Dense(2), 5), (5, "/cpu:0")):
        with pytest.raises(TypeError, match=r"^OnDevice places a Keras layer on a device named by a string, such as "
                           rf"'/gpu:0'\. Received: layer={type(layer).__name__}, device={device!r}$"):
            kerasmulti.OnDevice(layer, device)
    with pytest.raises(ValueError, match=r"^OnDevice cannot read the device name 'nonsense'\. Pass one such as '/gpu:1' "
                       r"or '/cpu:0'\. Received: device='nonsense'$"):
        kerasmulti.OnDevice(keras.layers.Dense(2), "nonsense")
    model = _towers()
    with pytest.raises(TypeError, match=r"keras.Model; pass the model that holds them\. Received: model=Dense$"):
        kerasmulti.remap_devices(keras.layers.Dense(2), {"/cpu:1": "/cpu:0"})
    with pytest.raises(TypeError, match=r"takes a dict from old device names.*Received: mapping=\[\('/cpu:1', '/cpu:0'\)\]$"):
        kerasmulti.remap_devices(model, [("/cpu:1", "/cpu:0")])
    with pytest.raises(TypeError, match=r"remap_devices\(\) takes device names as strings.*Received: device=1$"):
        kerasmulti.remap_devices(model, {1: "/cpu:0"})
    with pytest.raises(TypeError, match=r"remap_devices\(\) takes a device name as a string.*Received: device=0$"):
        kerasmulti.remap_devices(model, {"/cpu:1": 0})
    for old in ("gpu one", "/gpu", ""):
        with pytest.raises(ValueError, match=rf"not a TensorFlow device name.*Received: device='{old}'$"):
            kerasmulti.remap_devices(model, {old: "/cpu:0"})
    assert [w.device for w in model.layers if isinstance(w, kerasmulti.OnDevice)] == ["/device:CPU:1", "/device:CPU:2"]


def test_a_mapping_that_moves_nothing_is_refused():
    model = _towers()
    with pytest.raises(
        ValueError,
        match=r"found no layer to move: the model's placed layers run on /device:CPU:1, /device:CPU:2.*Received: mapping=\{'/gpu:3': '/cpu:0'\}$",
    ):
        kerasmulti.remap_devices(model, {"/gpu:3": "/cpu:0"})
    with pytest.raises(ValueError, match=r"found no placed layer in the model; keras.models.load_model drops placement, kerasmulti.load_model keeps it\. Received: mapping=\{'/cpu:1': '/cpu:0'\}$"):
        kerasmulti.remap_devices(_towers(placed=False), {"/cpu:1": "/cpu:0"})
    assert [w.device for w in model.layers if isinstance(w, kerasmulti.OnDevice)] == ["/device:CPU:1", "/device:CPU:2"]


def test_scopes_nest_and_end_cleanly():
    inputs = keras.Input((3,))
    with kerasmulti.device_scope("/cpu:1"):
        a = keras.layers.Dense(2, name="outer")(inputs)
        with kerasmulti.device_scope("/cpu:2"):
            b = keras.layers.Dense(2, name="inner")(a)
    c = keras.layers.Dense(1, name="after")(b)
    model = keras.Model(inputs, c)
    devices = {row["layer"]: row["device"] for row in kerasmulti.placement_summary(model).rows}
    assert devices["outer"] == "/device:CPU:1"
    assert devices["inner"] == "/device:CPU:2"
    assert devices["after"] is None
    assert keras.layers.Layer.__call__.__name__ == "__call__"  # the scope's hook is gone


def test_a_scope_puts_back_a_layer_call_patched_after_kerasmulti_loaded(monkeypatch):
    # A tracer's patch of Layer.__call__ is still there after the scope (before: the scope put
    # back the call kerasmulti found when it was imported). Inside, layers run Keras' own call.
    scope = kerasmulti.device_scope  # loaded before the patch, as after any earlier use
    traced, keras_call = [], keras.layers.Layer.__call__

    def tracing_call(self, *args, **kwargs):
        traced.append(self.name)
        return keras_call(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", tracing_call)
    inputs = keras.Input((3,))
    with scope("/cpu:1"):
        hidden = keras.layers.Dense(2, name="placed")(inputs)
    keras.layers.Dense(1, name="after")(hidden)
    assert keras.layers.Layer.__call__ is tracing_call and traced == ["after"]


def test_a_layer_call_patched_inside_a_scope_does_not_loop_in_the_next(monkeypatch):
    # A patch made inside a scope calls the scope's hook; the next scope, taking the patch for
    # the call to run, called itself through it (RecursionError).
    monkeypatch.setattr(keras.layers.Layer, "__call__", keras.layers.Layer.__call__)  # put back after the test
    with kerasmulti.device_scope("/cpu:1"):
        hook = keras.layers.Layer.__call__

        def tracing_call(self, *args, **kwargs):
            return hook(self, *args, **kwargs)

        keras.layers.Layer.__call__ = tracing_call
        keras.layers.Dense(2)(keras.Input((3,)))
    assert keras.layers.Layer.__call__ is tracing_call  # left as the block left it
    inputs = keras.Input((3,))
    with kerasmulti.device_scope("/cpu:2"):
        outputs = keras.layers.Dense(2, name="second")(inputs)
    rows = {row["layer"]: row["device"] for row in kerasmulti.placement_summary(keras.Model(inputs, outputs)).rows}
    assert rows["second"] == "/device:CPU:2"
    assert keras.layers.Layer.__call__ is tracing_call


def _masked_tweets(placement):
    """Embedding(mask_zero) then a shared LSTM over two padded sequences.

    `placement` is "none", "scope" (every layer call under device_scope),
    "in" (the LSTM wrapped, the mask comes in) or "out" (a wrapped sub-model
    whose output carries the mask out to an unplaced LSTM).
    """
    keras.utils.set_random_seed(7)
    tweet_a, tweet_b = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
    embed, shared_lstm = keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.LSTM(8)
    if placement == "scope":
        with kerasmulti.device_scope("/cpu:1"):
            encoded_a = shared_lstm(embed(tweet_a))
        with kerasmulti.device_scope("/cpu:2"):
            encoded_b = shared_lstm(embed(tweet_b))
    elif placement == "in":
        lstm_a, lstm_b = kerasmulti.on_device(shared_lstm, "/cpu:1"), kerasmulti.on_device(shared_lstm, "/cpu:2")
        encoded_a, encoded_b = lstm_a(embed(tweet_a)), lstm_b(embed(tweet_b))
    elif placement == "out":
        embedder = keras.Sequential([keras.Input((6,), dtype="int32"), embed, keras.layers.Dense(4)])
        placed = kerasmulti.on_device(embedder, "/cpu:1")
        encoded_a, encoded_b = shared_lstm(placed(tweet_a)), shared_lstm(placed(tweet_b))
    else:
        encoded_a, encoded_b = shared_lstm(embed(tweet_a)), shared_lstm(embed(tweet_b))
    merged = keras.layers.concatenate([encoded_a, encoded_b], axis=-1)
    return keras.Model([tweet_a, tweet_b], keras.layers.Dense(1, activation="sigmoid")(merged))


def _padded(rows=12):
    tokens = RNG.integers(1, 20, size=(rows, 6))
    lengths = RNG.integers(1, 7, size=(rows, 1))
    return np.where(np.arange(6) < lengths, tokens, 0).astype("int32")


@pytest.mark.parametrize("placement", ["scope", "in"])
def test_masks_cross_placed_layers_like_unplaced_ones(placement):
    placed, plain = _masked_tweets(placement), _masked_tweets("none")
    plain.set_weights(placed.get_weights())
    x, y = [_padded(), _padded()], (RNG.random((12, 1)) > 0.5).astype("float32")
    # Without its mask the LSTM would read the padding: the answers would differ.
    np.testing.assert_allclose(placed.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    for m in (placed, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(placed.fit(x, y, **fit).history["loss"], plain.fit(x, y, **fit).history["loss"], rtol=1e-5)


def test_a_placed_sub_model_passes_its_output_mask_on():
    placed = _masked_tweets("out")
    keras.utils.set_random_seed(7)
    tweet_a, tweet_b = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
    embedder = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.Dense(4)])
    shared_lstm = keras.layers.LSTM(8)
    merged = keras.layers.concatenate([shared_lstm(embedder(tweet_a)), shared_lstm(embedder(tweet_b))], axis=-1)
    plain = keras.Model([tweet_a, tweet_b], keras.layers.Dense(1, activation="sigmoid")(merged))
    plain.set_weights(placed.get_weights())
    x = [_padded(), _padded()]
    np.testing.assert_allclose(placed.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert (x[0] == 0).any() and (x[1] == 0).any()  # padding is present: a lost mask would show


def test_xla_stays_off_for_placed_models(monkeypatch):
    # With a GPU, Keras' jit_compile="auto" turns XLA on; XLA would compile
    # the step for one device, and fit would fail reading weights elsewhere.
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: real(kind) + ([gpu] if kind in (None, "GPU") else []))
    placed, plain = _towers(), _towers(placed=False)
    for model in (placed, plain):
        model.compile(optimizer="sgd", loss="mse")
    assert plain.jit_compile is True and placed.jit_compile is False
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        placed.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert placed.jit_compile is False
    x, y = _pairs(shape=(5,)), RNG.normal(size=(12, 1)).astype("float32")
    assert np.isfinite(placed.fit(x, y, epochs=1, verbose=0).history["loss"][0])


def test_parallel_predict_resumes_with_a_reloaded_placed_model(tmp_path):
    model = _shared_lstm()
    path = str(tmp_path / "placed.keras")
    model.save(path)
    x = _pairs(rows=20)
    output = str(tmp_path / "features.h5")
    kerasmulti.parallel_predict(kerasmulti.load_model(path), x, batch_size=4, output=output, verbose=0)
    with h5py.File(output, "r+") as f:  # as a kill after two batches leaves it
        f.attrs["kerasmulti_rows_done"] = 8
    kerasmulti.parallel_predict(kerasmulti.load_model(path), x, batch_size=4, output=output, verbose=0)
    with h5py.File(output, "r") as f:
        assert f.attrs["kerasmulti_rows_done"] == 20
        (name,) = list(f)  # the outputs alone
        np.testing.assert_allclose(f[name][:], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_a_model_loaded_inside_a_scope_keeps_its_own_placement(tmp_path):
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="projection")])
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="middle")(inputs)))
    x = RNG.normal(size=(5, 4)).astype("float32")
    for model in (sequential, functional, _shared_lstm()):
        path = str(tmp_path / f"{model.name}.keras")
        model.save(path)
        with kerasmulti.device_scope("/cpu:2"):
            loaded = kerasmulti.load_model(path)
        assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]
        data = _pairs() if len(model.inputs) == 2 else x
        np.testing.assert_allclose(loaded.predict(data, verbose=0), model.predict(data, verbose=0), rtol=1e-6)


def test_a_layer_called_twice_in_one_scope_runs_through_one_wrapper_and_saves(tmp_path):
    # Keras refuses two layers of one name in a model: `d(d(x))` placed twice on one device did.
    def build(placed):
        keras.utils.set_random_seed(3)
        inputs, shared = keras.Input((4,)), keras.layers.Dense(4, activation="tanh", name="shared")
        with kerasmulti.device_scope("/cpu:1") if placed else contextlib.nullcontext():
            hidden = shared(shared(inputs))
        with kerasmulti.device_scope("/cpu:1") if placed else contextlib.nullcontext():
            hidden = shared(hidden)  # another block on the same device: the same wrapper again
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="adam", loss="mse")
        return model

    model, reference = build(True), build(False)
    wrappers = [layer for layer in model.layers if isinstance(layer, kerasmulti.OnDevice)]
    assert [(w.name, w.device) for w in wrappers] == [("shared", "/device:CPU:1")]
    rng = np.random.default_rng()
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    np.testing.assert_allclose(history["loss"], reference.fit(x, y, batch_size=8, epochs=2, verbose=0).history["loss"], rtol=1e-6)
    model.save(tmp_path / "twice.keras")
    loaded = kerasmulti.load_model(tmp_path / "twice.keras")
    assert [(w.name, w.device) for w in loaded.layers if isinstance(w, kerasmulti.OnDevice)] == [("shared", "/device:CPU:1")]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
