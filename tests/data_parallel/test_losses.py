"""Losses whose batch total is not a plain mean over rows, split exactly.

Keras divides a loss by a per-batch total: the element count, the number of
unmasked steps (masked sequence losses), the sum of sample weights
(`reduction="mean_with_sample_weight"`), or nothing (`reduction="sum"`). A
replica computing its sub-batch's loss divides by its own total; each must
instead contribute its part of the whole batch's loss. Fit and evaluate are
compared with the template on one device, on fresh random data, with uneven
sub-batches and a remainder batch (10 samples in batches of 4 over 3 devices).
"""

from simulated import DEVICES

import warnings

import keras
import numpy as np
import pytest
from cases import assert_same_logs, assert_same_weights

import kerasmulti

SAMPLES, STEPS = 10, 5


def _dense(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def _tagger(seed, mask_zero=True, recurrent=True):
    """Per-step outputs of a masked sequence: padding must not count.

    `recurrent=False` steps through a Dense layer, which passes the mask on as
    the LSTM does: the loss's weighting is the same, and an XLA program with
    no loop compiles in a fraction of the time (the masked LSTM under XLA is
    the "masked" case's).
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(12, 4, mask_zero=mask_zero)(tokens)
    h = keras.layers.LSTM(3, return_sequences=True)(h) if recurrent else keras.layers.Dense(3, activation="tanh")(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h))


def _two_heads(seed):
    """A masked per-step head and a summed per-row head, weighted."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(12, 4, mask_zero=True)(tokens)
    steps = keras.layers.Dense(3, activation="tanh")(h)  # passes the mask on (see _tagger)
    tags = keras.layers.Dense(2, name="tags")(steps)
    score = keras.layers.Dense(1, name="score")(keras.layers.GlobalAveragePooling1D()(steps))
    return keras.Model(tokens, {"tags": tags, "score": score})


def _two_dense(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    return keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(2, name="b")(inputs)})


def _two_rows(rng):
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    return x, {"a": rng.normal(size=(SAMPLES, 1)).astype("float32"), "b": rng.normal(size=(SAMPLES, 2)).astype("float32")}


def _rows(rng):
    return rng.normal(size=(SAMPLES, 4)).astype("float32"), rng.normal(size=(SAMPLES, 1)).astype("float32")


def _padded(rng):
    tokens = rng.integers(1, 12, size=(SAMPLES, STEPS))
    lengths = rng.integers(1, STEPS + 1, size=(SAMPLES, 1))
    x = np.where(np.arange(STEPS) < lengths, tokens, 0).astype("int32")
    return x, rng.normal(size=(SAMPLES, STEPS, 2)).astype("float32")


def _padded_two_heads(rng):
    x, tags = _padded(rng)
    return x, {"tags": tags, "score": rng.normal(size=(SAMPLES, 1)).astype("float32")}


def _mse(reduction):
    return lambda: keras.losses.MeanSquaredError(reduction=reduction)


def _mean_of_squares(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))  # already a scalar


def _token_loss(y_true, y_pred):
    # Flattens rows and steps into one axis, as sequence losses often do.
    return keras.losses.mean_squared_error(keras.ops.reshape(y_true, (-1, 2)), keras.ops.reshape(y_pred, (-1, 2)))


def _row_weights(rng):
    return rng.uniform(0.2, 2.0, size=SAMPLES).astype("float32")


def _step_weights(rng):
    # A masked per-step loss takes per-step weights (Keras cannot broadcast
    # per-row ones against the mask).
    return rng.uniform(0.2, 2.0, size=(SAMPLES, STEPS)).astype("float32")


def _head_weights(rng):
    return {"tags": _step_weights(rng), "score": _row_weights(rng)}


class Endpoint(keras.layers.Layer):
    """Keras' "endpoint layer": a loss object called in call(), added with add_loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loss_fn = keras.losses.MeanSquaredError()

    def call(self, targets, predictions):
        self.add_loss(self.loss_fn(targets, predictions))
        return predictions


class Regularised(keras.Model):
    """Weight and activity regularisers and an add_loss mean, subclassed."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(
            3, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
            activity_regularizer=keras.regularizers.L1(0.05),
        )
        self.out = keras.layers.Dense(1)

    def call(self, x):
        h = self.hidden(x)
        self.add_loss(0.5 * keras.ops.mean(keras.ops.square(h)))
        return self.out(h)


def _endpoint(seed):
    keras.utils.set_random_seed(seed)
    x, targets = keras.Input((4,)), keras.Input((1,))
    predictions = keras.layers.Dense(1)(keras.layers.Dense(3, activation="tanh")(x))
    return keras.Model([x, targets], Endpoint()(targets, predictions))


def _regularised(seed):
    keras.utils.set_random_seed(seed)
    model = Regularised()
    model(np.zeros((1, 4), "float32"))
    return model


def _endpoint_rows(rng):
    x, y = _rows(rng)
    return [x, y], y


# name, model, data, loss (a factory: each model gets its own), sample weights
CASES = [
    ("none", _dense, _rows, _mse(None), None),
    ("none_heads", _two_dense, _two_rows,
     lambda: {"a": keras.losses.MeanSquaredError(reduction=None), "b": keras.losses.MeanAbsoluteError(reduction=None)}, None),
    ("endpoint_layer", _endpoint, _endpoint_rows, lambda: None, None),
    ("added_losses", _regularised, _rows, lambda: "mse", None),
    ("sum", _dense, _rows, _mse("sum"), None),
    ("mean_with_sample_weight", _dense, _rows, _mse("mean_with_sample_weight"), _row_weights),
    ("scalar_function", _dense, _rows, lambda: _mean_of_squares, None),
    ("flattened_function", lambda seed: _tagger(seed, mask_zero=False), _padded, lambda: _token_loss, None),
    ("masked", _tagger, _padded, lambda: "mse", None),
    ("masked_sample_weight", lambda seed: _tagger(seed, recurrent=False), _padded, lambda: "mse", _step_weights),
    ("masked_mean_with_sample_weight", lambda seed: _tagger(seed, recurrent=False), _padded, _mse("mean_with_sample_weight"), _step_weights),
    ("masked_and_sum_heads", _two_heads, _padded_two_heads,
     lambda: {"tags": "mse", "score": keras.losses.MeanSquaredError(reduction="sum")}, _head_weights),
]


# Each loss at a batch of 2 (an idle replica in every step) and 4 (uneven
# shards, and an idle replica in the last step), uncompiled; under XLA per
# replica at 4, which meets both.
@pytest.mark.parametrize(
    "name,build,data,loss,weights,batch_size,jit",
    [
        pytest.param(*case, batch_size, jit, id=f"{case[0]}-{batch_size}-{'xla' if jit else 'plain'}")
        for case in CASES
        for batch_size, jit in ((DEVICES - 1, False), (4, False), (4, True))
    ],
)
def test_fit_and_evaluate_match_one_device(name, build, data, loss, weights, batch_size, jit):
    reference, template = build(5), build(5)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    rng = np.random.default_rng()
    x, y = data(rng)
    sample_weight = weights(rng) if weights else None
    for model in (reference, parallel):
        loss_weights = {"tags": 1.0, "score": 0.5} if name == "masked_and_sum_heads" else None
        extra = dict(jit_compile=jit) if model is parallel else {}
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss(), loss_weights=loss_weights, **extra)
    fit = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0, sample_weight=sample_weight)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)
    evaluate = dict(batch_size=batch_size, verbose=0, return_dict=True, sample_weight=sample_weight)
    assert_same_logs(reference.evaluate(x, y, **evaluate), parallel.evaluate(x, y, **evaluate))


def test_reduction_none_mixed_with_reduced_losses_is_refused():
    parallel = kerasmulti.parallelize(_two_dense(5), gpus=DEVICES)
    with pytest.raises(ValueError, match=r"cannot mix reduction=None with reduced losses.*Received: reductions=\['None', 'sum_over_batch_size'\]"):
        parallel.compile(optimizer="sgd", loss={"a": keras.losses.MeanSquaredError(reduction="none"), "b": "mse"})


def test_a_scalar_loss_with_sample_weights_is_warned_about():
    # Keras multiplies an already averaged loss by the mean weight: each
    # replica's mean weight is all a replica has.
    parallel = kerasmulti.parallelize(_dense(5), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss=_mean_of_squares)
    x, y = _rows(np.random.default_rng())
    with pytest.warns(UserWarning, match="returned a scalar with sample_weight or class_weight set.*one loss per sample.*Received: a scalar loss"):
        parallel.fit(x, y, sample_weight=np.linspace(0.5, 2.0, SAMPLES), batch_size=4, verbose=0)


def test_a_scalar_loss_on_masked_outputs_is_warned_about_as_such():
    parallel = kerasmulti.parallelize(_tagger(5), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss=_mean_of_squares)
    x, y = _padded(np.random.default_rng())
    with pytest.warns(UserWarning, match="returned a scalar with masked outputs.*one loss per sample.*Received: a scalar loss"):
        parallel.fit(x, y, batch_size=4, verbose=0)


def test_incoming_masks_reach_every_replica():
    # A parallel model called on a masked tensor, as a layer would be.
    keras.utils.set_random_seed(5)
    template = keras.Sequential([keras.Input((STEPS, 2)), keras.layers.LSTM(3)])
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    x = np.random.default_rng().normal(size=(SAMPLES, STEPS, 2)).astype("float32")
    x[:, 3:] = 0.0
    masked = keras.layers.Masking()(x)
    np.testing.assert_allclose(np.asarray(parallel(masked)), np.asarray(template(masked)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(template(masked)), np.asarray(template(x)), atol=1e-3)


def test_the_padding_matters_here():
    # Without the mask the tagger's loss would count the padded steps, whose
    # targets are made huge here, so the masked cases can fail.
    rng = np.random.default_rng()
    x, y = _padded(rng)
    assert (x == 0).any()
    y[x == 0] = 100.0
    masked, unmasked = _tagger(5), _tagger(5, mask_zero=False)
    for model in (masked, unmasked):
        model.compile(loss="mse")
    assert masked.evaluate(x, y, verbose=0) < 10 < 100 < unmasked.evaluate(x, y, verbose=0)


def test_parallel_predict_warns_that_it_does_not_run_the_templates_predict_step():
    class Labels(keras.Model):
        def predict_step(self, data):
            return keras.ops.argmax(self(data, training=False), axis=-1)

    inputs = keras.Input((4,))
    template = Labels(inputs, keras.layers.Dense(3)(inputs))
    x = np.random.default_rng().normal(size=(7, 4)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # parallelize runs it: nothing to warn about
        parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    np.testing.assert_array_equal(parallel.predict(x, batch_size=4, verbose=0), template.predict(x, batch_size=4, verbose=0))
    with pytest.warns(UserWarning, match=r"does not run predict_step of the template.*Received: overrides=\['predict_step'\]") as record:
        kerasmulti.parallel_predict(template, x, verbose=0)
    assert record[0].filename == __file__  # the warning points at the user's line


def test_auto_scale_loss_reaches_the_template_so_they_share_one_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        template = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, dtype="float32")])
        parallel = kerasmulti.parallelize(template, gpus=DEVICES)
        parallel.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert template.optimizer is parallel.optimizer
    assert type(template.optimizer).__name__ == "SGD"
