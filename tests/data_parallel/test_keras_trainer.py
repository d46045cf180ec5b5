"""Keras' own training tests, ported to run on a parallel model beside a one-device twin.

25 of the 62 tests of Keras 3.15's `keras/src/trainers/trainer_test.py`, under
their names: the fit, evaluate and predict flows (eager, graph, XLA), the
custom steps, metric tracking, loss scaling, compute_loss overrides,
recompiling, the on-batch methods with sample and class weights, callbacks that
update the model or stop the loop, loss weights, constraints and added losses. Keras' models there mix a
`Trainer` into a layer; here they are `keras.Model`s with the same layers,
built on a batch first (`parallelize` needs weights to share). Each test runs
the Keras test's body on `parallelize(model, gpus=3)` and, where Keras checks
a figure, compares it with the same model on one device, on Keras' batch sizes
(which split unevenly over 3 devices).
"""

from simulated import DEVICES

import keras
import numpy as np
import pytest
from cases import assert_same_logs, assert_same_weights

import kerasmulti


class ExampleModel(keras.Model):
    """Keras' `ExampleModel`: a bias-free Dense with a kernel of ones."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, use_bias=False, kernel_initializer="ones")

    def call(self, x):
        return self.dense(x)


class CustomTrainTestStepModel(ExampleModel):
    def train_step(self, data):
        logs = super().train_step(data)
        logs["my_custom_metric"] = 10.0
        return logs

    def test_step(self, data):
        logs = super().test_step(data)
        logs["my_custom_metric"] = 5.0
        return logs


def _built(model, features):
    model(np.zeros((1, features), "float32"))
    return model


def _twins(build, features):
    """A model for one device and one wrapped over DEVICES, built alike."""
    return _built(build(), features), kerasmulti.parallelize(_built(build(), features), gpus=DEVICES)


def _compile_mse(model):
    model.compile(optimizer=keras.optimizers.SGD(), loss=keras.losses.MeanSquaredError(),
                  metrics=[keras.metrics.MeanSquaredError()])


def test_fit_with_custom_train_step():
    reference, parallel = _twins(lambda: CustomTrainTestStepModel(units=3), 4)
    x, y = np.ones((100, 4)), np.zeros((100, 3))
    for model in (reference, parallel):
        _compile_mse(model)
    expected, history = (m.fit(x, y, batch_size=16, verbose=0).history for m in (reference, parallel))
    assert "loss" in history and "mean_squared_error" in history
    np.testing.assert_allclose(history["my_custom_metric"], 10.0)
    assert_same_logs(expected, history)


@pytest.mark.parametrize("return_dict", [False, True], ids=["flat", "dict"])
def test_evaluate_with_custom_test_step(return_dict):
    reference, parallel = _twins(lambda: CustomTrainTestStepModel(units=3), 4)
    x, y = np.ones((100, 4)), np.zeros((100, 3))
    for model in (reference, parallel):
        _compile_mse(model)
    output = parallel.evaluate(x, y, batch_size=16, return_dict=return_dict, verbose=0)
    expected = reference.evaluate(x, y, batch_size=16, return_dict=return_dict, verbose=0)
    assert len(output) == 3
    if return_dict:
        np.testing.assert_allclose(output["my_custom_metric"], 5.0)
        assert_same_logs(expected, output)
    else:
        np.testing.assert_allclose(output[-1], 5.0)  # custom metrics go last
        np.testing.assert_allclose(output, expected, rtol=1e-5)


def test_metric_tracking():
    class ModelWithMetric(ExampleModel):
        def __init__(self, units):
            super().__init__(units)
            self.my_metric = keras.metrics.MeanSquaredError(name="my_metric")

    template = _built(ModelWithMetric(units=3), 4)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    _compile_mse(parallel)
    parallel.fit(np.ones((2, 4)), np.zeros((2, 3)), batch_size=2, epochs=1, verbose=0)
    # Keras: loss tracker, compiled metrics, my_metric.
    assert len(parallel.metrics) == 3
    assert parallel.metrics[2] is template.my_metric
    assert [len(m.variables) for m in parallel.metrics] == [2, 2, 2]


def test_adds_loss_scaling_optimizer():
    class TrainingTestingModel(keras.Model):
        def call(self, x, training=False):
            return x if training else x * 0

    def parallel(dtype, **compile_kwargs):
        template = _built(TrainingTestingModel(dtype=dtype), 1)
        model = kerasmulti.parallelize(template, gpus=DEVICES)
        model.compile(optimizer="rmsprop", loss="mse", **compile_kwargs)
        model.fit(np.ones((128, 1)), np.zeros((128, 1)), batch_size=32, verbose=0)
        return model

    assert isinstance(parallel("mixed_float16").optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(parallel("mixed_float16", auto_scale_loss=False).optimizer, keras.optimizers.RMSprop)
    assert isinstance(parallel("mixed_bfloat16").optimizer, keras.optimizers.RMSprop)


class DeepModel(keras.Model):
    """Keras' test of underflow: 15 sigmoid layers in float16, whose gradient vanishes."""

    def __init__(self):
        super().__init__(dtype="mixed_float16")
        self.stack = [
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", activation="sigmoid", dtype="mixed_float16")
            for _ in range(15)
        ]

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return x


@pytest.mark.parametrize("auto_scale_loss", [True, False])
def test_loss_scaling_prevents_underflow(auto_scale_loss):
    # Keras' test on one row, and on 3 rows (one a replica) so the replicas' path runs.
    for rows in (1, DEVICES):
        template = _built(DeepModel(), 1)
        parallel = kerasmulti.parallelize(template, gpus=DEVICES)
        parallel.compile(keras.optimizers.SGD(learning_rate=1e9), loss=keras.losses.MeanSquaredError(),
                         auto_scale_loss=auto_scale_loss)
        parallel.fit(np.ones((rows, 1)), np.ones((rows, 1)), batch_size=rows, verbose=0)
        moved = not np.array_equal(np.asarray(template.stack[0].kernel), np.ones((1, 1)))
        assert moved == auto_scale_loss, f"rows={rows}"


def test_training_arg():
    class TrainingTestingModel(keras.Model):
        def call(self, x, training=False):
            return x if training else x * 0

    parallel = kerasmulti.parallelize(_built(TrainingTestingModel(), 1), gpus=DEVICES)
    parallel.compile(optimizer="rmsprop", loss="mse")
    x, y = np.ones((128, 1)), np.zeros((128, 1))
    np.testing.assert_allclose(parallel.fit(x, y, batch_size=32, verbose=0).history["loss"], [1.0])
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=32, verbose=0), 0.0)
    np.testing.assert_allclose(parallel.predict(x, verbose=0), np.zeros((128, 1)))


class LossLayer(keras.layers.Layer):
    """Keras' layer that adds a loss of its inputs (a sum there; a mean is one device's exactly)."""

    def __init__(self, reduce=keras.ops.sum, **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce

    def call(self, x):
        self.add_loss(self.reduce(x))
        return x


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_internal_only_loss(reduce):
    def build():
        keras.utils.set_random_seed(5)
        layer = LossLayer(getattr(keras.ops, reduce))
        return keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), layer, keras.layers.Dense(1)])

    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="adam")
    x, y = np.ones((16, 2)), np.zeros((16, 1))
    expected, history = (m.fit(x, y, batch_size=4, shuffle=False, verbose=0).history for m in (reference, parallel))
    assert np.isfinite(history["loss"][0])  # Keras' test: it trains
    if reduce == "mean":
        # Losses a layer adds count as means over rows (docs/data-parallel.md); a sum does not.
        assert_same_logs(expected, history)
        assert_same_weights(reference, template)


def test_recompile():
    parallel = kerasmulti.parallelize(_built(ExampleModel(units=3), 2), gpus=DEVICES)
    x, y = np.ones((3, 2)), np.ones((3, 3))
    parallel.compile(optimizer="sgd", loss="mse", metrics=["mean_squared_error"])
    history_1 = parallel.fit(x, y, verbose=0).history
    eval_1 = parallel.evaluate(x, y, return_dict=True, verbose=0)
    parallel.compile(optimizer="sgd", loss="mse", metrics=["mean_absolute_error"])
    history_2 = parallel.fit(x, y, verbose=0).history
    eval_2 = parallel.evaluate(x, y, return_dict=True, verbose=0)
    assert sorted(history_1) == sorted(eval_1) == ["loss", "mean_squared_error"]
    assert sorted(history_2) == sorted(eval_2) == ["loss", "mean_absolute_error"]


def test_evaluate_return_list_respect_metrics_order():
    def metrics_zero(y_true, y_pred):
        return 0.0

    def metrics_one(y_true, y_pred):
        return 1.0

    parallel = kerasmulti.parallelize(_built(ExampleModel(units=3), 2), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", metrics=[metrics_zero, metrics_one])
    assert parallel.evaluate(np.ones((3, 2)), np.ones((3, 3)), verbose=0)[1:] == [0.0, 1.0]
    parallel.compile(optimizer="sgd", loss="mse", metrics=[metrics_one, metrics_zero])
    assert parallel.evaluate(np.ones((3, 2)), np.ones((3, 3)), verbose=0)[1:] == [1.0, 0.0]


class TwoInputModel(keras.Model):
    """Keras' `ListInputModel` and `StructModel`: two bias-free Dense layers of ones, one per input."""

    def __init__(self, units):
        super().__init__()
        self.dense_1 = keras.layers.Dense(units, use_bias=False, kernel_initializer="ones")
        self.dense_2 = keras.layers.Dense(units, use_bias=False, kernel_initializer="ones")


def test_nested_inputs():
    class ListInputModel(TwoInputModel):
        def call(self, x):
            return self.dense_1(x[0]) + self.dense_2(x[1])

    x, y = [np.ones((3, 2)), np.ones((3, 3))], np.ones((3, 2))
    reference, template = ListInputModel(units=2), ListInputModel(units=2)
    assert tuple(reference(x).shape) == tuple(template(x).shape) == (3, 2)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="sgd", loss="mse", metrics=["mse"])
    np.testing.assert_allclose(parallel.fit(x, y, verbose=0).history["loss"], 16.0)
    reference.fit(x, y, verbose=0)
    # Keras' figure (14.44 in 3.15; 3.14 still averaged in fit's 16.0): the one-device twin's.
    np.testing.assert_allclose(parallel.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-5)
    np.testing.assert_allclose(parallel.evaluate(x, y, verbose=0)[0], 13.0321, rtol=1e-4)
    np.testing.assert_allclose(parallel.test_on_batch(x, y)[0], 13.0321, rtol=1e-4)
    assert parallel.predict(x, verbose=0).shape == parallel.predict_on_batch(x).shape == (3, 2)


def test_constraints_are_applied():
    template = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_constraint="non_neg")])
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="rmsprop", loss="mse")
    parallel.fit(np.ones((2, 3)), np.ones((2, 2)), verbose=0)
    assert np.min(np.asarray(template.layers[0].kernel)) >= 0.0


def test_callbacks_can_update_state_at_batch_boundary():
    class CounterModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.train_counter = self.add_weight(shape=(), initializer="zeros")
            self.test_counter = self.add_weight(shape=(), initializer="zeros")
            self.predict_counter = self.add_weight(shape=(), initializer="zeros")
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    class CounterCallback(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.train = self.test = self.predict = 0

        def on_train_batch_end(self, *args, **kwargs):
            self.model.train_counter.assign_add(1)
            self.train += 1

        def on_test_batch_end(self, *args, **kwargs):
            self.model.test_counter.assign_add(1)
            self.test += 1

        def on_predict_batch_end(self, *args, **kwargs):
            self.model.predict_counter.assign_add(1)
            self.predict += 1

    template = _built(CounterModel(), 3)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", metrics=["mse"], run_eagerly=True)
    counter = CounterCallback()
    parallel.fit(np.ones((4, 3)), np.ones((4, 3)), callbacks=[counter], epochs=3, batch_size=1, verbose=0,
                 validation_data=(np.ones((2, 3)), np.ones((2, 3))))
    assert counter.train == template.train_counter.numpy() == 12
    assert counter.test == template.test_counter.numpy() == 6
    parallel.predict(np.ones((4, 3)), callbacks=[counter], batch_size=1, verbose=0)
    assert counter.predict == template.predict_counter.numpy() == 4


class CustomLossMetric(keras.Model):
    """Keras' MyModel of the compute_loss tests: a metric updated inside compute_loss."""

    def __init__(self, regularised=False, records="loss"):
        super().__init__()
        self.custom_metric = keras.metrics.Mean(name="custom")
        self.dense = keras.layers.Dense(2, activity_regularizer="l2" if regularised else None)
        self.records = records

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom_metric.update_state(loss * 4 if self.records == "loss" else sum(self.losses))
        return loss


def _compute_loss_twins(**kwargs):
    def build():
        keras.utils.set_random_seed(9)
        return CustomLossMetric(**kwargs)

    reference, parallel = _twins(build, 4)
    for model in (reference, parallel):
        model.compile(optimizer="sgd", loss="mse")
    return reference, parallel


# Keras' checks run on its one batch of 32 rows (with batches of unequal sizes a mean of
# batch means is not the mean over rows, on one device too); the twins' on batches of 10.


def test_metric_update_in_compute_loss():
    reference, parallel = _compute_loss_twins()
    x, y = np.random.default_rng().normal(size=(32, 4)), np.ones((32, 2)) * 2
    history = parallel.fit(x, y, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["custom"][0], history["loss"][0] * 4, rtol=1e-5)
    assert_same_logs(reference.fit(x, y, shuffle=False, verbose=0).history, history)
    fit = dict(batch_size=10, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)


def test_fwd_pass_loss_presence_in_compute_loss():
    reference, parallel = _compute_loss_twins(regularised=True, records="added losses")
    x, y = np.ones((32, 4)), np.ones((32, 2)) * 2
    history = parallel.fit(x, y, batch_size=10, shuffle=False, verbose=0).history
    assert history["custom"][0] > 0.0
    assert_same_logs(reference.fit(x, y, batch_size=10, shuffle=False, verbose=0).history, history)


def test_evaluate_with_custom_compute_loss():
    reference, parallel = _compute_loss_twins(regularised=True)
    x, y = np.random.default_rng().normal(size=(32, 4)), np.ones((32, 2)) * 2
    logs = parallel.evaluate(x, y, return_dict=True, verbose=0)
    np.testing.assert_allclose(logs["custom"], logs["loss"] * 4, rtol=1e-5)
    assert_same_logs(reference.evaluate(x, y, return_dict=True, verbose=0), logs)
    evaluate = dict(batch_size=10, return_dict=True, verbose=0)
    assert_same_logs(reference.evaluate(x, y, **evaluate), parallel.evaluate(x, y, **evaluate))


def test_compute_loss_no_training_backwards_compatibility():
    class OldStyle(CustomLossMetric):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            loss = keras.Model.compute_loss(self, x, y, y_pred, sample_weight)
            self.custom_metric.update_state(loss * 4)
            return loss

    parallel = kerasmulti.parallelize(_built(OldStyle(regularised=True), 4), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 4)), np.ones((32, 2)) * 2
    logs = parallel.evaluate(x, y, return_dict=True, verbose=0)
    np.testing.assert_allclose(logs["custom"], logs["loss"] * 4, rtol=1e-5)
    history = parallel.fit(x, y, verbose=0).history
    np.testing.assert_allclose(history["custom"][0], history["loss"][0] * 4, rtol=1e-5)


def test_loss_weights():
    reference, parallel = _twins(lambda: ExampleModel(units=3), 4)
    rng = np.random.default_rng()
    x, y = rng.normal(size=(40, 4)), rng.normal(size=(40, 3))
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(), loss=keras.losses.MeanSquaredError(),
                      metrics=[keras.metrics.MeanSquaredError()], loss_weights=0.2)
    fit = dict(batch_size=20, epochs=3, shuffle=False, verbose=0)
    expected, history = (m.fit(x, y, **fit).history for m in (reference, parallel))
    # Keras: the loss is 0.2 of the unweighted metric.
    np.testing.assert_allclose(history["loss"], np.asarray(history["mean_squared_error"]) * 0.2, rtol=1e-5)
    assert_same_logs(expected, history)


class StructModel(TwoInputModel):
    """Keras' `StructModel`: dict inputs and outputs."""

    def call(self, x):
        return {"y_one": self.dense_1(x["x_one"]), "y_two": self.dense_2(x["x_two"])}


FLOWS = [(True, False), (False, False), (False, True)]
FLOW_IDS = ["eager", "graph_fn", "jit"]


@pytest.mark.parametrize("use_steps_per_epoch", [False, True], ids=["epochs", "steps_per_epoch"])
@pytest.mark.parametrize("run_eagerly, jit_compile", FLOWS, ids=FLOW_IDS)
def test_fit_flow(run_eagerly, jit_compile, use_steps_per_epoch):
    reference, parallel = _twins(lambda: ExampleModel(units=3), 4)
    x, y = np.ones((100, 4)), np.zeros((100, 3))
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(), loss=keras.losses.MeanSquaredError(),
                      metrics=[keras.metrics.MeanSquaredError()], run_eagerly=run_eagerly, jit_compile=jit_compile)
    fit = dict(batch_size=20, steps_per_epoch=7 if use_steps_per_epoch else None, epochs=3, verbose=0)
    expected, history = (m.fit(x, y, **fit).history for m in (reference, parallel))
    np.testing.assert_allclose(history["mean_squared_error"], [14.5, 11.5, 8.5], atol=1.0)  # Keras' figures
    assert_same_logs(expected, history)


@pytest.mark.parametrize("run_eagerly, jit_compile", FLOWS, ids=FLOW_IDS)
def test_evaluate_flow(run_eagerly, jit_compile):
    parallel = kerasmulti.parallelize(_built(ExampleModel(units=3), 4), gpus=DEVICES)
    parallel.compile(optimizer=keras.optimizers.SGD(), loss=keras.losses.MeanSquaredError(),
                     metrics=[keras.metrics.MeanSquaredError()], run_eagerly=run_eagerly, jit_compile=jit_compile)
    x, y = np.ones((100, 4)), np.zeros((100, 3))
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=16, verbose=0), [16.0, 16.0])
    output = parallel.evaluate(x, y, batch_size=16, return_dict=True, verbose=0)
    assert sorted(output) == ["loss", "mean_squared_error"]
    np.testing.assert_allclose(output["mean_squared_error"], 16.0)


@pytest.mark.parametrize("run_eagerly, jit_compile", FLOWS, ids=FLOW_IDS)
def test_predict_flow_struct(run_eagerly, jit_compile):
    template = StructModel(units=3)
    x = {"x_one": np.ones((100, 4)), "x_two": np.ones((100, 4))}
    template(x)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.run_eagerly, parallel.jit_compile = run_eagerly, jit_compile
    outputs = parallel.predict(x, batch_size=16, verbose=0)
    assert sorted(outputs) == ["y_one", "y_two"]
    for key in outputs:
        np.testing.assert_allclose(outputs[key], 4 * np.ones((100, 3)))


@pytest.mark.parametrize("run_eagerly, jit_compile", FLOWS, ids=FLOW_IDS)
def test_on_batch_methods(run_eagerly, jit_compile):
    reference, parallel = _twins(lambda: ExampleModel(units=3), 4)
    x, y = np.ones((100, 4)), np.zeros((100, 3))
    sw = np.arange(100).reshape((100,)).astype("float32") / 50.0
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(), loss=keras.losses.MeanSquaredError(),
                      metrics=[keras.metrics.MeanSquaredError()], run_eagerly=run_eagerly, jit_compile=jit_compile)
    logs = parallel.train_on_batch(x, y)
    assert isinstance(logs, list) and len(logs) == 2
    np.testing.assert_allclose(logs[0], 16.0, rtol=1e-6)
    reference.train_on_batch(x, y)
    # Keras' figures (15.158, 14.360, ... in 3.15; 3.14 averaged the on-batch
    # losses with the previous calls'): the one-device twin's, call by call.
    calls = [
        lambda m: m.train_on_batch(x, y, return_dict=True)["loss"],
        lambda m: m.test_on_batch(x, y)[0],
        lambda m: m.test_on_batch(x, y, return_dict=True)["loss"],
        lambda m: m.predict_on_batch(x),
        # With sample weights, then class weights.
        lambda m: m.train_on_batch(x, y, sw)[0],
        lambda m: m.test_on_batch(x, y, sw)[0],
        lambda m: m.predict_on_batch(x),
        lambda m: m.train_on_batch(x, y, class_weight={1: 0.3, 0: 0.2})[0],
    ]
    for call in calls:
        got, expected = call(parallel), call(reference)
        assert isinstance(got, type(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_fit_and_evaluate_with_different_batch_size_same_loss():
    x, y = np.random.rand(100, 4), np.ones((100, 1))
    template = _built(ExampleModel(units=1), 4)
    template.trainable = False
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(loss="mse")
    losses = [parallel.fit(x, y, batch_size=b, verbose=0).history["loss"] for b in (80, 100)]
    np.testing.assert_allclose(*losses, rtol=1e-6)
    np.testing.assert_allclose(*(parallel.evaluate(x, y, batch_size=b, verbose=0) for b in (80, 100)), rtol=1e-6)


def test_partial_loss_partial_label():
    inputs = keras.Input((2,))
    x = keras.layers.Dense(3, kernel_initializer="ones")(inputs)
    partial = kerasmulti.parallelize(keras.Model(inputs, [x, x, x]), gpus=DEVICES)
    partial.compile(loss=["mse", None, None])
    full = kerasmulti.parallelize(keras.Model(inputs, [x, x, x]), gpus=DEVICES)
    full.compile(loss=["mse", "mse", "mse"])
    eval_x, eval_y = np.ones((32, 2)), np.ones((32, 3))
    partial_logs = partial.evaluate(eval_x, eval_y, return_dict=True, verbose=0)
    logs = full.evaluate(eval_x, [eval_y] * 3, return_dict=True, verbose=0)
    np.testing.assert_allclose(partial_logs["loss"] * 3, logs["loss"], rtol=1e-6)


@pytest.mark.parametrize(
    "method, gerund, on_end", [("fit", "training", "train"), ("evaluate", "evaluating", "test"), ("predict", "predicting", "predict")]
)
def test_stop_loop(method, gerund, on_end):
    parallel = kerasmulti.parallelize(_built(ExampleModel(units=3), 2), gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", metrics=["mse"])

    class Stopper(keras.callbacks.Callback):
        def __init__(self, stop_count):
            super().__init__()
            self.stop_count, self.counter = stop_count, 0
            setattr(self, f"on_{on_end}_batch_end", self.batch_end)

        def batch_end(self, *args, **kwargs):
            self.counter += 1
            if self.counter == self.stop_count:
                setattr(self.model, f"stop_{gerund}", True)

    def infinite():
        while True:
            x, y = np.ones((2, 2)), np.ones((2, 3))
            yield (x,) if method == "predict" else (x, y)

    stopper = Stopper(5)
    getattr(parallel, method)(infinite(), callbacks=[stopper], verbose=0)
    assert stopper.counter == 5
