"""Wrong arguments to a parallel model's calls are refused before anything runs; right ones are not."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from cases import assert_same_logs, assert_same_weights

import kerasmulti


def _parallel(outputs=2, activation=None, loss="mse", features=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(outputs, activation=activation)], name="net")
    parallel = kerasmulti.parallelize(model, gpus=2)
    if loss is not None:
        parallel.compile("sgd", loss)
    return parallel


def _xy(rows=8, features=4, outputs=2):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, features)).astype("float32"), rng.normal(size=(rows, outputs)).astype("float32")


def _two_inputs():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.concatenate([a, b])), name="two")
    return kerasmulti.parallelize(model, gpus=2)


@pytest.mark.parametrize(
    "arguments, match",
    [
        (dict(optimizer="nope", loss="mse"), r"does not know this optimizer.*'adam'.*Received: optimizer='nope'"),
        (dict(optimizer="sgd", loss="nonexistent_loss"), r"does not know this loss.*Received: loss='nonexistent_loss'"),
        (dict(optimizer="sgd", loss={"x": "mse", "y": "nope"}), r"Received: loss='nope'"),
        (dict(optimizer="sgd", loss="mse", steps_per_execution=0), r"positive int.*Received: steps_per_execution=0"),
    ],
)
def test_compile_refuses_unknown_names(arguments, match):
    with pytest.raises(ValueError, match=match):
        _parallel(loss=None).compile(**arguments)


def test_compile_takes_crossentropy_and_numpy_steps():
    _parallel(loss=None).compile("adam", loss="crossentropy", steps_per_execution=np.int64(2))


def test_fit_and_evaluate_need_a_compiled_model():
    x, y = _xy()
    parallel = _parallel(loss=None)
    with pytest.raises(ValueError, match=r"fit\(\) needs a compiled model.*Received: compiled=False"):
        parallel.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"evaluate\(\) needs a compiled model"):
        parallel.evaluate(x, y, verbose=0)


@pytest.mark.parametrize(
    "arguments, match",
    [
        (dict(epochs="3"), r"epochs as an int.*Received: epochs='3'"),
        (dict(epochs=-1), r"Received: epochs=-1"),
        (dict(validation_split=1.5), r"validation_split as a fraction in \[0, 1\).*Received: validation_split=1.5"),
        (dict(batch_size=0), r"fit\(\) needs batch_size as a positive int.*Received: batch_size=0"),
        (dict(batch_size=4.5), r"Received: batch_size=4.5"),
        (dict(validation_batch_size=-2, validation_split=0.25), r"Received: validation_batch_size=-2"),
    ],
)
def test_fit_refuses_wrong_numbers(arguments, match):
    x, y = _xy()
    with pytest.raises(ValueError, match=match):
        _parallel().fit(x, y, verbose=0, **arguments)


def test_numbers_keras_takes_are_taken():
    x, y = _xy()
    parallel = _parallel()
    history = parallel.fit(x, y, batch_size=np.int64(4), epochs=np.int32(1), validation_split=0.25, verbose=0)
    assert len(history.history["loss"]) == 1
    parallel.fit(x, y, epochs=0, verbose=0)
    assert parallel.predict(x, batch_size=np.int64(3), verbose=0).shape == (8, 2)


def test_predict_and_evaluate_refuse_a_batch_size_of_zero():
    x, y = _xy()
    with pytest.raises(ValueError, match=r"predict\(\) needs batch_size.*Received: batch_size=0"):
        _parallel().predict(x, batch_size=0, verbose=0)
    with pytest.raises(ValueError, match=r"evaluate\(\) needs batch_size.*Received: batch_size=-1"):
        _parallel().evaluate(x, y, batch_size=-1, verbose=0)


def test_rows_must_agree_and_exist():
    x, y = _xy(10)
    with pytest.raises(ValueError, match=r"fit\(\) got the x, y arrays with different numbers of rows.*one per sample.*Received: rows=\{'x': 10, 'y': 8\}$"):
        _parallel().fit(x, y[:8], verbose=0)
    with pytest.raises(ValueError, match=r"got the x, y, sample_weight arrays .* Received: rows=\{'x': 10, 'y': 10, 'sample_weight': 7\}$"):
        _parallel().fit(x, y, sample_weight=np.ones(7), verbose=0)
    with pytest.raises(ValueError, match=r"fit\(\) got validation_data's x, y arrays with different numbers .* rows=\{'x': 10, 'y': 8\}$"):
        _parallel().fit(x, y, validation_data=(x, y[:8]), verbose=0)
    with pytest.raises(ValueError, match=r"fit\(\) got x arrays with no rows.*Received: rows=0"):
        _parallel().fit(x[:0], y[:0], verbose=0)
    with pytest.raises(ValueError, match=r"predict\(\) got x arrays with no rows"):
        _parallel().predict(x[:0], verbose=0)


def test_the_on_batch_calls_check_their_arrays_as_fit_evaluate_and_predict_do():
    # Unchecked, a replica's loss failed on its sub-batch: "Dimensions must be equal, but are 3 and 4".
    x, y = _xy()
    parallel = _parallel()
    with pytest.raises(ValueError, match=r"^train_on_batch\(\) got the x, y arrays with different numbers of rows.*Received: rows=\{'x': 8, 'y': 3\}$"):
        parallel.train_on_batch(x, y[:3])
    with pytest.raises(ValueError, match=r"^test_on_batch\(\) got the x, y, sample_weight arrays.*Received: rows=\{'x': 8, 'y': 8, 'sample_weight': 2\}$"):
        parallel.test_on_batch(x, y, sample_weight=np.ones(2))
    with pytest.raises(ValueError, match=r"^predict_on_batch\(\) got x rows of shape \(7,\).*Received: x.shape=\(8, 7\)$"):
        parallel.predict_on_batch(np.zeros((8, 7), "float32"))
    reference = keras.models.clone_model(kerasmulti.unwrap(parallel))
    reference.set_weights(kerasmulti.unwrap(parallel).get_weights())
    reference.compile("sgd", "mse")
    np.testing.assert_allclose(parallel.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-6)
    np.testing.assert_allclose(parallel.test_on_batch(x, y), reference.test_on_batch(x, y), rtol=1e-6)
    np.testing.assert_allclose(parallel.predict_on_batch(x), reference.predict_on_batch(x), rtol=1e-6)


def test_inputs_are_checked_against_the_model():
    x, y = _xy(features=5)
    with pytest.raises(ValueError, match=r"rows of shape \(5,\).*which takes \(4,\).*Reshape it.*Received: x.shape=\(8, 5\)"):
        _parallel().fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"got text as x.*of dtype float32.*StringLookup.*Received: dtype=<U1"):
        _parallel().fit(np.full((8, 4), "a"), y, verbose=0)
    with pytest.raises(ValueError, match=r"got 2 arrays as x, but model 'net' takes .*Pass one per input.*Received: x with 2 arrays"):
        _parallel().fit([x[:, :4], x[:, :4]], y, verbose=0)
    with pytest.raises(ValueError, match=r"validation_data rows of shape \(3,\).*Received: validation_data.shape=\(8, 3\)"):
        _parallel().fit(x[:, :4], y, validation_data=(x[:, :3], y), verbose=0)
    # A last axis of 1 is Keras' to squeeze, the others must still fit: (5, 1) reached Keras' error in a replica.
    with pytest.raises(ValueError, match=r"^fit\(\) got x rows of shape \(5, 1\) for input .* takes \(4,\)"):
        _parallel().fit(x[..., None], y, verbose=0)
    _parallel().fit(x[:, :4, None], y, verbose=0)


def test_a_dict_of_inputs_needs_every_input():
    parallel = _two_inputs()
    parallel.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"without the input\(s\) \['b'\] of model 'two'.*Add them by name.*Received: x keys=\['a', 'c'\]"):
        parallel.fit({"a": np.zeros((8, 3)), "c": np.zeros((8, 2))}, np.zeros((8, 1)), verbose=0)
    parallel.fit({"a": np.zeros((8, 3)), "b": np.zeros((8, 2))}, np.zeros((8, 1)), verbose=0)


def test_keras_rank_adjustment_and_text_models_are_taken():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile("sgd", "mse")
    parallel.fit(np.zeros(8, "float32"), np.zeros(8, "float32"), verbose=0)  # Keras adds the last axis
    words = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])(words)
    text = kerasmulti.parallelize(keras.Model(words, keras.layers.Dense(1)(keras.ops.cast(lookup, "float32"))), gpus=2)
    assert text.predict(tf.constant([["a"], ["b"], ["c"], ["a"]]), verbose=0).shape == (4, 1)


def test_y_is_needed_for_a_compiled_loss():
    x, _ = _xy()
    with pytest.raises(ValueError, match=r"got x without y, but model 'net' has a loss.*loss=None.*Received: y=None"):
        _parallel().fit(x, verbose=0)


class OwnTargets(keras.Model):
    """Trains on x alone (its first two columns are the targets), as an autoencoder does."""

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(data, training=True) - data[:, :2]) ** 2)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def test_a_model_with_its_own_train_step_trains_without_y():
    inputs = keras.Input((4,))
    parallel = kerasmulti.parallelize(OwnTargets(inputs, keras.layers.Dense(2)(inputs)), gpus=2)
    parallel.compile("sgd")
    history = parallel.fit(_xy()[0], batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_targets_are_checked_against_the_output():
    x, _ = _xy()
    with pytest.raises(ValueError, match=r"got 3 target values per row.*output has 2.*Use shape \(2,\).*Received: y.shape=\(8, 3\)"):
        _parallel().fit(x, np.zeros((8, 3)), verbose=0)
    with pytest.raises(ValueError, match=r"evaluate\(\) got 5 target values per row"):
        _parallel().evaluate(x, np.zeros((8, 5)), verbose=0)
    _parallel().fit(x, np.zeros((8, 1)), verbose=0)  # broadcast, as Keras does


def test_sparse_labels_must_be_classes_of_the_output():
    x, _ = _xy()
    with pytest.raises(ValueError, match=r"labels outside classes 0 to 2\. Remap, or use 6 units\. Received: y.min\(\)=0, y.max\(\)=5$"):
        _parallel(3, "softmax", "sparse_categorical_crossentropy").fit(x, np.array([0, 1, 2, 5] * 2), verbose=0)
    with pytest.raises(ValueError, match=r"outside classes 0 to 2\. Remap them\. Received: y.min\(\)=-2, y.max\(\)=1$"):
        _parallel(3, "softmax", "sparse_categorical_crossentropy").fit(x, np.array([0, 1, -2, 1] * 2), verbose=0)
    # Soft targets for a sparse loss: "use 2 units" (what the model has) was the advice.
    with pytest.raises(ValueError, match=r"labels that are not class indices.*categorical_crossentropy.*Received: y.dtype=float32$"):
        _parallel(2, "softmax", "sparse_categorical_crossentropy").evaluate(x, np.random.default_rng().normal(size=(8, 1)).astype("float32"), verbose=0)
    _parallel(3, "softmax", "sparse_categorical_crossentropy").fit(x, np.array([0.0, 1.0, 2.0, 1.0] * 2), verbose=0)  # whole floats
    ignoring = _parallel(3, "softmax", keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    ignoring.fit(x, np.array([0, 1, 2, -1] * 2), verbose=0)
    with pytest.raises(ValueError, match=r"class_weight for class 7.*has classes 0 to 2.*Received: class_weight keys=\[0, 7\]"):
        _parallel(3, "softmax", "sparse_categorical_crossentropy").fit(x, np.arange(8) % 3, class_weight={0: 1.0, 7: 2.0}, verbose=0)


def test_every_output_with_a_loss_needs_a_target():
    inputs = keras.Input((4,))
    outputs = {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(1, name="b")(inputs)}
    parallel = kerasmulti.parallelize(keras.Model(inputs, outputs, name="heads"), gpus=2)
    parallel.compile("sgd", {"a": "mse", "b": "mse"})
    with pytest.raises(ValueError, match=r"no target for output\(s\) \['b'\].*Received: y keys=\['a'\]"):
        parallel.fit(_xy()[0], {"a": np.zeros((8, 1))}, verbose=0)


def test_embedding_indices_must_be_rows_of_the_embedding():
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(5, 2, name="words"), keras.layers.Flatten()])
    parallel = kerasmulti.parallelize(model, gpus=2)
    with pytest.raises(ValueError, match=r"index 9 for Embedding 'words' \(rows 0 to 4\).*input_dim.*Received: x values 1 to 9"):
        parallel.predict(np.array([[1, 2, 3], [4, 9, 1]]), verbose=0)
    assert parallel.predict(np.array([[1, 2, 3], [4, 0, 1]]), verbose=0).shape == (2, 6)


def test_a_dataset_must_be_batched():
    x, y = _xy()
    with pytest.raises(ValueError, match=r"Dataset of single rows.*dataset.batch\(32\).*Received: element shape=\(4,\)"):
        _parallel().fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0)
    _parallel().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)


def test_save_paths_are_checked_before_writing(tmp_path):
    parallel = _parallel()
    with pytest.raises(FileNotFoundError, match=r"its folder '.*nodir' does not exist.*os.makedirs.*Received: filepath="):
        parallel.save(str(tmp_path / "nodir" / "m.keras"))
    os.makedirs(tmp_path / "m.keras")
    with pytest.raises(IsADirectoryError, match=r"it is a folder.*Received: filepath="):
        parallel.save(str(tmp_path / "m.keras"))
    with pytest.raises(FileNotFoundError, match=r"save_weights\(\) cannot write"):
        parallel.save_weights(str(tmp_path / "nodir" / "w.weights.h5"))


def test_load_weights_refuses_damaged_and_foreign_files_keeping_the_weights(tmp_path):
    parallel = _parallel()
    path = str(tmp_path / "w.weights.h5")
    parallel.save_weights(path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"is not a readable HDF5 file.*Save the weights again.*Received: filepath="):
        parallel.load_weights(path)
    with pytest.raises(FileNotFoundError, match=r"The weights file '.*missing.weights.h5' does not exist"):
        parallel.load_weights(str(tmp_path / "missing.weights.h5"))
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    other.save_weights(str(tmp_path / "other.weights.h5"))
    before = [w.copy() for w in parallel.get_weights()]
    with pytest.raises(ValueError, match=r"do not fit this model's.*weights are unchanged.*skip_mismatch=True.*Received: filepath="):
        parallel.load_weights(str(tmp_path / "other.weights.h5"))
    assert all(np.array_equal(a, b) for a, b in zip(before, parallel.get_weights()))


def _shop():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    outputs = {"price": keras.layers.Dense(1, name="dense_p")(inputs), "kind": keras.layers.Dense(2, name="dense_k")(inputs)}
    return keras.Model(inputs, outputs, name="shop")


def test_dict_outputs_take_targets_by_their_keys_not_their_layers_names():
    # y keyed as the outputs ("price", "kind") was refused for want of "dense_k" and "dense_p", the layers' names.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 4)), {"price": rng.normal(size=(8, 1)), "kind": rng.normal(size=(8, 2))}
    reference, template = _shop(), _shop()
    parallel = kerasmulti.parallelize(template, gpus=simulated.DEVICES)
    for model in (reference, parallel):
        model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"^fit\(\) got no target for output\(s\) \['kind'\].*Received: y keys=\['price'\]$"):
        parallel.fit(x, {"price": y["price"]}, verbose=0)
    np.testing.assert_allclose(parallel.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-5)
    np.testing.assert_allclose(parallel.test_on_batch(x, y), reference.test_on_batch(x, y), rtol=1e-5)
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    np.testing.assert_allclose(parallel.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), rtol=1e-5)
    assert_same_weights(reference, template)


class SubclassedShop(keras.Model):
    """A subclassed model with dict outputs: its outputs are known only once it runs."""

    def __init__(self):
        super().__init__()
        self.price, self.kind = keras.layers.Dense(1), keras.layers.Dense(2)

    def call(self, x):
        return {"price": self.price(x), "kind": self.kind(x)}


def test_a_subclassed_model_with_dict_outputs_takes_dict_targets_as_one_device():
    # The target check asked the parallel model for `output_names`, which a subclassed template lacks: AttributeError.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 4)), {"price": rng.normal(size=(8, 1)), "kind": rng.normal(size=(8, 2))}
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(4)
        models.append(SubclassedShop())
        models[-1](x[:1])
    reference, template = models
    parallel = kerasmulti.parallelize(template, gpus=simulated.DEVICES)
    for model in (reference, parallel):
        model.compile("sgd", "mse")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)


@pytest.mark.parametrize("method, whole", [("train_on_batch", "fit"), ("test_on_batch", "evaluate"), ("predict_on_batch", "predict")])
def test_the_on_batch_calls_refuse_a_dataset_naming_the_call_that_reads_one(method, whole):
    # A dataset failed in the split: "AttributeError: '_VariantDataset' object has no attribute 'shape'".
    rng = np.random.default_rng()
    x, y = rng.normal(size=(6, 4)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    parallel = _parallel()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    with pytest.raises(ValueError, match=rf"^{method}\(\) takes one batch of arrays, not a dataset.* to {whole}\(\)\. Received: x=_BatchDataset$"):
        getattr(parallel, method)(data)
    with pytest.raises(ValueError, match=rf"^{method}\(\) takes one batch .*Received: x=generator$"):
        getattr(parallel, method)(batch for batch in data)
    reference = keras.models.clone_model(kerasmulti.unwrap(parallel))
    reference.set_weights(kerasmulti.unwrap(parallel).get_weights())
    reference.compile("sgd", "mse")
    batch = next(iter(data))[: 1 if method == "predict_on_batch" else 2]  # the dataset's batch, as tensors
    np.testing.assert_allclose(getattr(parallel, method)(*batch), getattr(reference, method)(*batch), rtol=1e-5)
