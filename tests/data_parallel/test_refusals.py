"""Models and inputs that cannot be split get a clear error."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src.data_parallel import row_mixing


def test_non_model_is_refused():
    with pytest.raises(TypeError, match=r"expects a keras.Model.*Received: model=Dense"):
        kerasmulti.parallelize(keras.layers.Dense(3))


def test_unbuilt_model_is_refused():
    with pytest.raises(ValueError, match=r"needs a built model.*model.build\(input_shape\).*Received: model='unbuilt' with built=False"):
        kerasmulti.parallelize(keras.Sequential([keras.layers.Dense(2)], name="unbuilt"))


def test_stateful_rnn_is_refused_naming_the_layer():
    model = keras.Sequential(
        [keras.Input((4, 2), batch_size=6), keras.layers.LSTM(3, stateful=True, name="memory"), keras.layers.Dense(1)]
    )
    with pytest.raises(ValueError, match=r"stateful layer 'memory' \(LSTM\).*Received: layer='memory' with stateful=True"):
        kerasmulti.parallelize(model, gpus=2)


def test_a_stateful_rnn_on_one_device_trains_as_without_parallelize():
    # One device splits nothing: the error's "or one device" holds.
    def model():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((4, 2), batch_size=6), keras.layers.LSTM(3, stateful=True), keras.layers.Dense(1)])

    rng = np.random.default_rng()
    x, y = rng.normal(size=(18, 4, 2)).astype("float32"), rng.normal(size=(18, 1)).astype("float32")
    plain, template = model(), model()
    plain.compile(optimizer="sgd", loss="mse")
    parallel = kerasmulti.parallelize(template, gpus=1)
    parallel.compile(optimizer="sgd", loss="mse")
    expected = plain.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(parallel.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"], expected, rtol=1e-6)
    for a, b in zip(template.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kerasmulti.parallel_predict(template, x, gpus=1, batch_size=6, verbose=0),
                               plain.predict(x, batch_size=6, verbose=0), rtol=1e-6, atol=1e-7)


def test_batch_renormalization_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(renorm=True, name="bn")])
    with pytest.raises(ValueError, match=r"renormalisation \(layer 'bn'\).*Received: layer='bn' with renorm=True"):
        kerasmulti.parallelize(model, gpus=2)


def _two_inputs():
    a, b = keras.Input((2,)), keras.Input((3,))
    return keras.Model([a, b], keras.layers.Dense(1)(keras.layers.concatenate([a, b])))


def test_inputs_with_different_batch_sizes_are_refused():
    parallel = kerasmulti.parallelize(_two_inputs(), gpus=2)
    with pytest.raises(ValueError, match=r"same batch size.*Received: batch sizes \[4, 5\]"):
        parallel([np.zeros((4, 2), "float32"), np.zeros((5, 3), "float32")])


def test_unparallelize_and_unwrap():
    model = _two_inputs()
    parallel = kerasmulti.parallelize(model, gpus=2)
    assert kerasmulti.unwrap(parallel) is model
    assert kerasmulti.unwrap(model) is model
    again = kerasmulti.parallelize(parallel, gpus=3)
    assert kerasmulti.unwrap(again) is model
    with pytest.raises(TypeError, match=r"unwrap\(\) expects a keras.Model.*Received: model=str"):
        kerasmulti.unwrap("model.keras")


def test_scalar_and_missing_inputs_are_refused_by_the_splitter():
    from kerasmulti._src.data_parallel import split as _split

    with pytest.raises(ValueError, match=r"splits every input along axis 0, but one input is a scalar.*Received: input with shape \(\)"):
        _split.batch_size([np.zeros((4, 2)), np.float32(1.0)])
    with pytest.raises(ValueError, match=r"at least one input tensor.*Received: inputs=\[None\]"):
        _split.batch_size([None])


def test_batch_sizes_that_disagree_at_run_time_are_refused():
    import tensorflow as tf

    parallel = kerasmulti.parallelize(_two_inputs(), gpus=2)
    step = tf.function(lambda a, b: parallel([a, b]))
    spec = step.get_concrete_function(tf.TensorSpec((None, 2)), tf.TensorSpec((None, 3)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="same batch size.*Received: different batch sizes"):
        spec(tf.zeros((4, 2)), tf.zeros((5, 3)))


class SqueezedModel(keras.Model):
    """Squeezes every axis of size 1: on a 1-row sub-batch that includes the batch axis."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return keras.ops.squeeze(self.dense(x))


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "xla"])
def test_output_that_loses_its_batch_axis_is_refused(jit):
    model = SqueezedModel()
    model(np.zeros((2, 4), "float32"))
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    assert model.predict(x, verbose=0).shape == (3,)  # fine on one device
    parallel = kerasmulti.parallelize(model, gpus=2)  # 3 rows: sub-batches of 2 and 1
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=jit)
    message = r"sub-batch of 1 row\(s\) gave an output without one row per input row.*squeeze\(x, axis=-1\).*Received: output shape \(\)"
    with pytest.raises(ValueError, match=message):
        parallel.predict(x, batch_size=3, verbose=0)
    if not jit:
        # A compiled replica's trace generalises the batch axis, so there the
        # squeeze's rank is unknown and Keras' loss refuses it first.
        with pytest.raises(ValueError, match=message):
            parallel.fit(x, np.zeros(3, "float32"), batch_size=3, verbose=0)


class NeedsSixFeatures(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(keras.ops.concatenate([x, keras.ops.ones((6,))[None, :] * x], axis=-1))


def test_model_whose_build_shape_cannot_run_is_refused():
    import warnings

    model = NeedsSixFeatures()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.build((None, 3))  # marked built; its call cannot run on 3 features
    with pytest.raises(
        ValueError,
        match=r"(?s)could not create the weights of .* from its build shape.*one batch of real data.*input_shape=\(None, 3\)",
    ):
        kerasmulti.parallelize(model, gpus=2)


class ScalesItsTargets(keras.Model):
    """A functional model holding a layer outside its graph, without weights, built at its first use (as
    keras_hub's RetinaNet holds its label encoder)."""

    def __init__(self):
        inputs = keras.Input((4,))
        super().__init__(inputs, keras.layers.Dense(2)(inputs))
        self.scale = keras.layers.Rescaling(0.5)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, self.scale(y), y_pred, sample_weight, training)


def test_a_functional_model_with_a_layer_built_at_its_first_use_trains_as_on_one_device():
    # Refused before: the weights were made from the build config's shape, None for such a model.
    keras.utils.set_random_seed(3)
    reference, template = ScalesItsTargets(), ScalesItsTargets()
    template.set_weights(reference.get_weights())
    assert not template.scale.built
    parallel = kerasmulti.parallelize(template, gpus=2)
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    for target in (reference, parallel):
        target.compile(optimizer="sgd", loss="mse")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(parallel.fit(x, y, **fit).history["loss"], reference.fit(x, y, **fit).history["loss"], rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def _looks_across_rows():
    """The probe docs/data-parallel.md gives users, taken from the page itself."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "data-parallel.md").read_text()
    code = page.split("### Models that look across rows", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(code, namespace)
    return namespace["looks_across_rows"]


def test_the_documented_probe_spots_a_model_that_looks_across_rows():
    probe = _looks_across_rows()
    x = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    centred = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(inputs)
    mixing = keras.Model(inputs, keras.layers.Dense(2)(centred))
    row_wise = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.LayerNormalization()])
    assert probe(mixing, x)
    assert not probe(row_wise, x)
    # ... and the probe's verdict is what splitting does: the mixing model's parallel output differs.
    parallel = kerasmulti.parallelize(mixing, gpus=2)
    assert not np.allclose(parallel.predict(x, batch_size=8, verbose=0), mixing.predict(x, batch_size=8, verbose=0))


def test_a_model_that_mixes_rows_is_warned_about_at_its_first_parallel_call():
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    centred = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(inputs)
    mixing = keras.Model(inputs, keras.layers.Dense(2)(centred), name="mixing")
    parallel = kerasmulti.parallelize(mixing, gpus=2)
    with pytest.warns(UserWarning, match=r"outputs of 'mixing' for a row depend on the other rows.*Received: relative difference=") as record:
        parallel.predict(x, verbose=0)
    assert record[0].filename == __file__  # the warning points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per parallel model
        parallel.predict(x, verbose=0)
    row_wise = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.LayerNormalization()])
    parallel = kerasmulti.parallelize(row_wise, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.fit(x, np.zeros((8, 2)), verbose=0)
        kerasmulti.parallelize(mixing, gpus=1).predict(x, verbose=0)  # one device: nothing to split
        # Outputs that cancel to rounding noise (~1e-8) are not taken for mixing (found by review).
        keras.utils.set_random_seed(7)  # a model and rows whose outputs' rounding differed, whole and split
        images = keras.Input((6, 6, 1))
        normalised = keras.layers.GroupNormalization(groups=2)(keras.layers.Conv2D(2, 3)(images))
        cancelling = keras.Model(images, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(normalised)))
        pictures = np.random.default_rng(4).normal(size=(9, 6, 6, 1)).astype("float32")
        assert np.max(np.abs(cancelling.predict(pictures, verbose=0))) < 1e-6
        kerasmulti.parallelize(cancelling, gpus=2).predict(pictures, verbose=0)
    # Small outputs that do mix rows still are (1e-4 in size, 1e-4 apart).
    small = keras.Model(inputs, keras.layers.Rescaling(1e-4)(mixing(inputs)), name="small")
    with pytest.warns(UserWarning, match=r"outputs of 'small' for a row depend on the other rows"):
        kerasmulti.parallelize(small, gpus=2).predict(x, verbose=0)


class _ContrastiveLoss(keras.Model):
    """SigLIP's kind: logits of every row against every other (an axis as long as the batch), its own loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        labels = 2.0 * keras.ops.eye(keras.ops.shape(y_pred)[0]) - 1.0
        return -keras.ops.mean(keras.ops.log_sigmoid(labels * y_pred))


@pytest.mark.parametrize("own_loss", [False, True], ids=["keras' step", "its own compute_loss"])
def test_outputs_with_an_axis_as_long_as_the_batch_are_warned_about(own_loss):
    # The replicas' (4, 4) blocks were joined into (8, 4) where one device gives (8, 8): no word (found by review).
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    embedded = keras.layers.Dense(4)(inputs)
    similarities = keras.layers.Lambda(lambda e: keras.ops.matmul(e, keras.ops.transpose(e)))(embedded)
    model = (_ContrastiveLoss if own_loss else keras.Model)(inputs, similarities, name="pairs")
    parallel = kerasmulti.parallelize(model, gpus=2)
    with pytest.warns(UserWarning, match=re.escape(
        "The outputs of 'pairs' change shape with the batch's rows (an axis as long as the batch), so split over devices "
        "they are not one device's. Run it on one device. Received: output shape (4, 4), joined from two halves (4, 2)"
    )):
        assert parallel.predict(x, batch_size=8, verbose=0).shape == (8, 4)  # what it warns of


class _CentredInTraining(keras.layers.Layer):
    """Subtracts the batch mean in training only, and counts its training calls in a variable."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, t, training=None):
        if not training:
            return t
        self.calls.assign_add(1.0)
        return t - keras.ops.mean(t, axis=0, keepdims=True)


def test_a_model_that_mixes_rows_behind_a_dataset_or_only_in_training_is_warned_about_too():
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    inputs = keras.Input((3,))
    centred = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(inputs)
    mixing = keras.Model(inputs, keras.layers.Dense(2)(centred), name="mixing")
    # A dataset is never read for the probe: made-up rows show the mixing.
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(8)
    with pytest.warns(UserWarning, match=r"outputs of 'mixing' for a row depend on the other rows.*Received: relative difference="):
        kerasmulti.parallelize(mixing, gpus=2).predict(dataset, verbose=0)
    # Mixing only in training: fit probes in training mode, and puts back what that moved.
    layer = _CentredInTraining()
    trains_mixed = keras.Model(inputs, keras.layers.Dense(2)(layer(inputs)), name="trains_mixed")
    parallel = kerasmulti.parallelize(trains_mixed, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.predict(x, verbose=0)  # inference mode: rows stay apart
    parallel = kerasmulti.parallelize(trains_mixed, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match=r"'trains_mixed' for a row depend on the other rows of its batch in training mode, so split over devices"):
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # The probe's training calls were undone: the same fit again (no probe: once
    # per parallel model) moves the layer's counter as far as the first did.
    probed_fit = float(layer.calls.numpy())
    layer.calls.assign(0.0)
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert probed_fit == float(layer.calls.numpy()) > 0


@pytest.mark.parametrize("layer", ["batchnorm", "dropout"])
def test_layers_meant_to_differ_in_training_raise_no_row_mixing_warning(layer):
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    middle = keras.layers.BatchNormalization() if layer == "batchnorm" else keras.layers.Dropout(0.5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), middle, keras.layers.Dense(2)])
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("layer", ["MixUp", "CutMix"])
def test_keras_layers_that_mix_rows_are_warned_about(layer):
    mixer = getattr(keras.layers, layer)(name="mixer")
    shape = (8, 8, 3)
    model = keras.Sequential([keras.Input(shape), mixer, keras.layers.Flatten(), keras.layers.Dense(1)])
    with pytest.warns(UserWarning, match=rf"Layer 'mixer' \({layer}\) mixes rows only within each replica's sub-batch.*input pipeline.*Received: layer='mixer'"):
        kerasmulti.parallelize(model, gpus=2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kerasmulti.parallelize(model, gpus=1)  # one device: nothing to warn about


class _Counter(keras.layers.Layer):
    """Counts its calls in a variable of its own, in every mode."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False, name="calls")

    def call(self, t):
        self.calls.assign_add(1)
        return t


@pytest.mark.parametrize("method", ["predict", "fit"])
def test_the_probe_leaves_a_layers_own_counter_as_it_found_it(method):
    # One 2-device step calls the layer once per replica: 2, as without the probe
    # (whose five extra calls used to leave it at 5 after predict).
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    counter = _Counter()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(counter(inputs)))
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    if method == "predict":
        parallel.predict(x, batch_size=8, verbose=0)
    else:
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(counter.calls.numpy()) == 2


class _TrackedActivation(keras.layers.Layer):
    """Updates a metric of its own in `call`: the mean of its outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.activation = keras.metrics.Mean(name="mean_activation")
        self.dense = keras.layers.Dense(3)

    def call(self, t):
        out = self.dense(t)
        self.activation.update_state(out)
        return out


def _tracked(weights=None):
    layer = _TrackedActivation()
    inputs = keras.Input((6,))
    model = keras.Model(inputs, layer(inputs))
    if weights is not None:
        model.set_weights(weights)
    return model, layer.activation


@pytest.mark.parametrize("feed", ["arrays", "dataset"])
def test_the_probe_leaves_a_layers_own_metric_as_it_found_it(feed):
    # The probe's rows (made-up ones for a dataset) were counted in the layer's metric: 76 rows, not 64.
    x = np.random.default_rng().normal(size=(64, 6)).astype("float32")
    data, batch_size = (tf.data.Dataset.from_tensor_slices(x).batch(16), None) if feed == "dataset" else (x, 16)
    plain, expected = _tracked()
    wrapped, got = _tracked(plain.get_weights())
    plain.predict(data, batch_size=batch_size, verbose=0)
    kerasmulti.parallelize(wrapped, gpus=2).predict(data, batch_size=batch_size, verbose=0)
    assert float(got.count.numpy()) == float(expected.count.numpy()) == 64
    np.testing.assert_allclose(got.result(), expected.result(), rtol=1e-5, atol=1e-7)  # a mean near 0


class _Sampling(keras.layers.Layer):
    """A VAE's sampling layer: draws its noise at prediction time too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, t):
        return t + keras.random.normal(keras.ops.shape(t), seed=self.seed_generator)


def test_a_model_that_draws_random_numbers_at_prediction_time_is_not_warned_about():
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    sampling = _Sampling()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(sampling(inputs)), name="vae_like")
    state = sampling.seed_generator.state.numpy()
    parallel = kerasmulti.parallelize(model, gpus=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row_mixing.probe_once(parallel, x, stacklevel=1)
    np.testing.assert_array_equal(sampling.seed_generator.state.numpy(), state)  # the probe's draws are undone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.predict(x, verbose=0)


class _UnseededNoise(keras.layers.Layer):
    """Noise from Keras' global generator (no seed of its own): training only."""

    def call(self, t, training=None):
        return t + keras.random.normal(keras.ops.shape(t)) if training else t


@pytest.mark.parametrize("generator", ["made", "not yet made"])
def test_the_probe_leaves_the_unseeded_draws_state_and_pythons_random_as_it_found_them(generator):
    # fit's training-mode probe drew from Keras' global generator (or made it, from Python's
    # random): a seeded program drew other numbers afterwards for having called fit.
    import random

    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")

    def draws_after(probed: bool):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,))
        parallel = kerasmulti.parallelize(keras.Model(inputs, keras.layers.Dense(2)(_UnseededNoise()(inputs))), gpus=2)
        parallel.compile(optimizer="sgd", loss="mse")
        if generator == "made":
            keras.random.normal((1,))
        if probed:
            parallel.fit(x, x[:, :2], batch_size=8, epochs=0, verbose=0)  # probes, trains nothing
            assert parallel._rows_probed
        return random.random(), keras.ops.convert_to_numpy(keras.random.normal((3,))).tolist()

    assert draws_after(probed=True) == draws_after(probed=False)


def test_a_model_assigning_its_weights_in_call_is_warned_about_and_the_probe_leaves_them_as_they_were():
    # SpectralNormalization writes its kernel while training: each replica would, and the probe's
    # training calls normalised the user's kernel four times over, leaving it moved.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.SpectralNormalization(keras.layers.Dense(4))(inputs)))
    before = [w.numpy().copy() for w in model.weights]
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match=r"assigns weights in its call \(as SpectralNormalization does\).*"
                                         r"Received: assigned=\['.*kernel'\]"):
        parallel.fit(x, y, batch_size=8, epochs=0, verbose=0)  # probes, trains nothing
    for value, weight in zip(before, model.weights):
        np.testing.assert_array_equal(weight.numpy(), value, err_msg=weight.path)


class _AddedLoss(keras.layers.Layer):
    def __init__(self, reduce, **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce

    def call(self, t):
        self.add_loss(0.01 * self.reduce(keras.ops.square(t)))
        return t


@pytest.mark.parametrize("reduce, warned", [(keras.ops.sum, True), (keras.ops.mean, False)], ids=["sum", "mean"])
def test_a_loss_a_layer_adds_that_is_not_a_mean_over_the_rows_is_warned_about(reduce, warned):
    # Each replica's added loss counts by its share of the rows: exact for a mean, not for a sum.
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, kernel_regularizer="l2")(_AddedLoss(reduce)(inputs))  # a regulariser: exact
    parallel = kerasmulti.parallelize(keras.Model(inputs, keras.layers.Dense(2)(hidden)), gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.fit(x, x[:, :2], batch_size=8, epochs=0, verbose=0)  # probes, trains nothing
    messages = [str(w.message) for w in caught if "add_loss" in str(w.message)]
    assert len(messages) == int(warned), messages
    if warned:
        assert re.search(r"adds a loss \(add_loss\) that is not a mean over the batch's rows, so split over devices it "
                         r"differs\. Divide it by the rows, or use one device\. Received: relative difference=", messages[0])


class _Centring(keras.layers.Layer):
    """Subtracts the batch's mean (mixes rows), with a random penalty added."""

    def call(self, t):
        self.add_loss(keras.ops.mean(keras.ops.square(t)) * keras.random.uniform(()))
        return t - keras.ops.mean(t, axis=0, keepdims=True)


def test_a_random_added_loss_does_not_hide_outputs_that_mix_rows():
    # Outputs and added losses were judged together: a random penalty made the probe judge nothing.
    x = np.random.default_rng().normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    parallel = kerasmulti.parallelize(keras.Model(inputs, keras.layers.Dense(2)(_Centring()(inputs))), gpus=2)
    with pytest.warns(UserWarning, match="for a row depend on the other rows of its batch"):
        parallel.predict(x, verbose=0)
