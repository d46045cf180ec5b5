"""Gradient accumulation: Keras' `gradient_accumulation_steps` on a parallel model.

The optimizer sums (averages) the gradients of k steps and applies them on
every k-th; the parallel model hands it the one-device gradient of each step,
so the weights equal one device's, remainder batches included.
"""

from simulated import DEVICES

import keras
import numpy as np
import pytest
from cases import assert_same_weights, worker_model

import kerasmulti


def _model(batchnorm):
    layers = [keras.Input((5,)), keras.layers.Dense(6, activation="relu")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def _pair(batchnorm, seed=5):
    keras.utils.set_random_seed(seed)
    reference = _model(batchnorm)
    keras.utils.set_random_seed(seed)
    return reference, _model(batchnorm)


def _compile(model, steps, **kwargs):
    optimizer = keras.optimizers.Adam(learning_rate=0.05, gradient_accumulation_steps=steps)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], **kwargs)


@pytest.mark.parametrize(
    "batchnorm,jit", [(False, False), (True, False), (False, True)], ids=["dense", "batchnorm", "dense-xla"]
)
@pytest.mark.parametrize("steps", [2, 3])
def test_accumulated_gradients_give_one_device_weights(batchnorm, jit, steps):
    rng = np.random.default_rng(21)
    # 22 rows in batches of 4: 6 steps a epoch, the last of 2 rows (a remainder),
    # and with steps=3 or 2 an accumulation that spans the epoch boundary or not.
    x = rng.normal(size=(22, 5)).astype("float32")
    y = rng.normal(size=(22, 1)).astype("float32")
    reference, template = _pair(batchnorm)
    initial = [np.asarray(w) for w in template.weights]
    _compile(reference, steps)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    _compile(parallel, steps, jit_compile=jit)
    fit = dict(batch_size=4, epochs=3, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **fit).history
    got = parallel.fit(x, y, **fit).history
    assert_same_weights(reference, template)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert any(not np.allclose(np.asarray(w), w0) for w, w0 in zip(template.weights, initial))


def test_accumulation_applies_only_every_kth_step():
    """The control: with k=3, two steps leave the weights where they were."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    _, template = _pair(False)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    _compile(parallel, 3)
    before = [np.asarray(w) for w in template.trainable_weights]
    parallel.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # 2 steps
    for w, w0 in zip(template.trainable_weights, before):
        np.testing.assert_array_equal(np.asarray(w), w0)
    parallel.fit(x[:4], y[:4], batch_size=4, epochs=1, shuffle=False, verbose=0)  # the 3rd
    assert any(not np.allclose(np.asarray(w), w0) for w, w0 in zip(template.trainable_weights, before))


def test_multi_worker_accumulation_gives_one_device_weights_and_state():
    # 17 rows in batches of 4: 5 steps an epoch; with k=3, 10 steps end with an
    # accumulation pending and one that spans the epoch boundary.
    rng = np.random.default_rng(8)
    x = rng.normal(size=(17, 5)).astype("float32")
    y = rng.normal(size=(17, 1)).astype("float32")
    reference, template = _pair(False)
    _compile(reference, 3)
    parallel = worker_model(template)
    _compile(parallel, 3)
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **fit).history
    got = parallel.fit(x, y, **fit).history
    assert_same_weights(reference, template, atol=1e-7)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    for a, b in zip(reference.optimizer.variables, parallel.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7, err_msg=a.path)
        copies = [np.asarray(v) for v in b.value.values]  # each replica's copy
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=a.path)
    assert int(np.asarray(parallel.optimizer._iterations)) == 10
    assert any(np.abs(np.asarray(a)).max() > 0 for a in parallel.optimizer._accumulated_gradients)


def test_keras_own_accumulation_still_crashes_under_the_strategy(monkeypatch):
    """Why kerasmulti accumulates itself (keras-team/keras#20582): if this
    starts passing, Keras fixed it and `accumulation` may go."""
    from kerasmulti._src.multi_worker import accumulation as _accumulation

    monkeypatch.setattr(_accumulation, "accumulates", lambda optimizer: False)
    _, template = _pair(False)
    parallel = worker_model(template)
    _compile(parallel, 2)
    with pytest.raises(RuntimeError, match="merge_call"):
        parallel.fit(np.ones((8, 5), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)


def test_multi_worker_accumulation_refuses_use_ema():
    _, template = _pair(False)
    parallel = worker_model(template)
    optimizer = keras.optimizers.Adam(use_ema=True, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"does not keep use_ema's moving averages.*Received: use_ema=True$"):
        parallel.compile(optimizer=optimizer, loss="mse")


def _loss_scaled(initial_scale, growth):
    inner = keras.optimizers.Adam(learning_rate=0.05, gradient_accumulation_steps=3)
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale, dynamic_growth_steps=growth)


@pytest.mark.parametrize(
    "initial_scale,growth,overflow",
    [(2.0**4, 2, False), (2.0**15, 2000, True)],
    ids=["growing-scale", "non-finite-steps-skipped"],
)
def test_multi_worker_accumulation_under_loss_scaling_gives_one_process_weights_and_state(
    initial_scale, growth, overflow
):
    """Mixed precision's LossScaleOptimizer around an accumulating optimizer:
    a step whose global-batch gradient is not finite is skipped and halves the
    scale (here one replica's half of a batch overflows, the other's does not),
    every `growth` finite steps double it, as on one process."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(17, 5)).astype("float32")
    y = rng.normal(size=(17, 1)).astype("float32")
    if overflow:
        x[6] = 1e30  # the 2nd batch's 3rd row: its loss and gradient overflow to inf
    reference, template = _pair(False)
    reference.compile(optimizer=_loss_scaled(initial_scale, growth), loss="mse")
    parallel = worker_model(template)
    parallel.compile(optimizer=_loss_scaled(initial_scale, growth), loss="mse")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **fit).history
    got = parallel.fit(x, y, **fit).history
    assert_same_weights(reference, template, atol=1e-7)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    for a, b in zip(reference.optimizer.variables, parallel.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7, err_msg=a.path)
        copies = [np.asarray(v) for v in b.value.values]
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=a.path)
    inner = parallel.optimizer.inner_optimizer
    scale = float(np.asarray(parallel.optimizer.dynamic_scale))
    if overflow:  # 2 of the 10 steps skipped: not counted, the scale halved twice
        assert int(np.asarray(inner._iterations)) == 8 and scale == initial_scale / 4
    else:
        assert int(np.asarray(inner._iterations)) == 10 and scale > initial_scale
    assert np.isfinite([np.asarray(w) for w in template.weights][0]).all()


def test_multi_worker_accumulation_under_mixed_float16_matches_one_process():
    """The common case: compile wraps the optimizer in a LossScaleOptimizer itself."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, template = _pair(False)
        _compile(reference, 2)
        parallel = worker_model(template)
        _compile(parallel, 2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(parallel.optimizer, keras.optimizers.LossScaleOptimizer)
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, **fit)
    parallel.fit(x, y, **fit)
    # float16 sums half batches then adds them: rounding, not a different algorithm
    assert_same_weights(reference, template, atol=1e-3)
    # 2**15 overflows float16 at first: both skip the same steps, end on the same scale
    for name in ("iterations", "dynamic_scale"):
        got, expected = (np.asarray(getattr(m.optimizer, name)) for m in (parallel, reference))
        assert got == expected, name
    assert int(np.asarray(parallel.optimizer.inner_optimizer._iterations)) > 1


def test_multi_worker_accumulation_refuses_variables_overwritten_with_their_gradient():
    """Keras' float8 layers keep their scales in variables the optimizer overwrites
    with their "gradient"; summed across replicas that would be wrong."""
    _, template = _pair(False)
    template.layers[0].quantize("float8")
    parallel = worker_model(template)
    with pytest.raises(
        ValueError, match=r"cannot overwrite variables with their gradient.*Received: overwrite_with_gradient=True$"
    ):
        _compile(parallel, 2)


def _decaying(steps, scaled):
    optimizer = keras.optimizers.AdamW(learning_rate=0.05, weight_decay=0.5, gradient_accumulation_steps=steps)
    return keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=4.0) if scaled else optimizer


@pytest.mark.parametrize("steps", [None, 2], ids=["apply", "accumulated"])
@pytest.mark.parametrize("by", ["var_names", "var_list", "loss-scaled"])
def test_multi_worker_optimizer_keeps_its_weight_decay_exclusions(by, steps):
    """`exclude_from_weight_decay` is not in an optimizer's config: the one
    re-created in the strategy's scope must keep it (before: bias decayed).
    `var_list` names the template's variables before `parallelize` re-creates them."""
    rng = np.random.default_rng(13)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    reference, template = _pair(False)
    optimizers = [_decaying(steps, by == "loss-scaled") for _ in range(2)]
    for model, optimizer in zip((reference, template), optimizers):
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if by == "var_list":
            inner.exclude_from_weight_decay(var_list=[layer.bias for layer in model.layers])
        else:
            inner.exclude_from_weight_decay(var_names=["bias"])
    parallel = worker_model(template)
    reference.compile(optimizer=optimizers[0], loss="mse")
    parallel.compile(optimizer=optimizers[1], loss="mse")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, **fit)
    parallel.fit(x, y, **fit)
    assert_same_weights(reference, template, atol=1e-6)


def test_multi_worker_accumulation_resets_every_accumulator_on_an_update():
    """As Keras: an update step empties the accumulators of variables it left
    out (a layer frozen meanwhile), which then start afresh when it trains again."""
    rng = np.random.default_rng(17)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    reference, template = _pair(False)
    parallel = worker_model(template)
    fit = dict(batch_size=4, shuffle=False, verbose=0)
    for target, model in ((reference, reference), (parallel, template)):
        _compile(target, 3)
        optimizer = target.optimizer
        target.fit(x, y, **fit)  # 4 steps: an update, then one accumulated for both layers
        model.layers[0].trainable = False
        target.compile(optimizer=optimizer, loss="mse")
        target.fit(x[:8], y[:8], **fit)  # the update at step 6 leaves the first layer out
        model.layers[0].trainable = True
        target.compile(optimizer=optimizer, loss="mse")
        target.fit(x[:12], y[:12], **fit)  # one more update of both
    assert_same_weights(reference, template, atol=1e-6)
    for a, b in zip(reference.optimizer.variables, parallel.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7, err_msg=a.path)


class _AppliesGradientsOnly(keras.Model):
    """A custom step that, once `bare`, calls `optimizer.apply(grads)` on the built optimizer, a form Keras documents."""

    def __init__(self, gradients=None):
        super().__init__()
        self.net = _model(False)
        self.tracker = keras.metrics.Mean(name="loss")
        self.bare, self.gradients = False, gradients  # how many gradients to pass (all: None)

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self.net(x) - y))
        grads = tape.gradient(loss, self.net.trainable_variables)
        if self.bare:
            self.optimizer.apply(grads[: self.gradients])
        else:  # builds the optimizer
            self.optimizer.apply(grads, self.net.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def _fit_bare(target, model, x, y):
    """Fits `target` one epoch with variables passed (building the optimizer), then one with gradients only."""
    target.compile(optimizer=keras.optimizers.Adam(learning_rate=0.05, gradient_accumulation_steps=3))
    fit = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    losses = target.fit(x, y, **fit).history["loss"]
    model.bare, target.train_function = True, None
    return losses + target.fit(x, y, **fit).history["loss"]


def test_multi_worker_accumulation_applies_gradients_without_variables():
    """`optimizer.apply(grads)`: the variables the optimizer was built for (before: TypeError)."""
    rng = np.random.default_rng(19)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    keras.utils.set_random_seed(5)
    reference = _AppliesGradientsOnly()
    keras.utils.set_random_seed(5)
    template = _AppliesGradientsOnly()
    expected = _fit_bare(reference, reference, x, y)
    got = _fit_bare(worker_model(template), template, x, y)
    assert_same_weights(reference, template, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_multi_worker_accumulation_refuses_too_few_gradients_without_variables():
    template = _AppliesGradientsOnly(gradients=1)
    data = np.ones((8, 5), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=r"needs a gradient for each of the 4 variables.*Received: len\(grads\)=1$"):
        _fit_bare(worker_model(template), template, *data)


def test_multi_worker_refuses_gradients_without_variables_on_an_unbuilt_optimizer():
    """Keras' `apply(grads)` refuses an unbuilt optimizer too (before: TypeError from its build)."""
    template = _AppliesGradientsOnly()
    template.bare = True
    template.compile(optimizer=keras.optimizers.SGD(0.1))
    data = np.ones((8, 5), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=r"is not built: pass apply\(\) the variables, or build it first\. Received: trainable_variables=None$"):
        worker_model(template).fit(*data, batch_size=4, verbose=0)
    assert not template.optimizer.built
