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
