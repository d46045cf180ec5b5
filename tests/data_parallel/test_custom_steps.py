"""Models with their own train_step, test_step, predict_step or compute_loss, run data-parallel.

Miniatures of the patterns of Keras' guide "Customizing what happens in
fit()" and of keras.io's GAN, WGAN-GP, VAE, distillation and SimSiam
examples. Each trains through `parallelize` and is compared with the same
model on one device, on fresh random data, with a remainder batch (26 rows in
batches of 8: the last, 2 rows, leaves a replica idle) so shards are uneven.
The models are in `tests/workers/custom_models.py`, which the multi-worker
test trains too.
"""

from simulated import DEVICES

import functools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from cases import assert_same_logs, assert_same_weights, worker_model
from workers.custom_models import (
    FEATURES,
    GAN,
    WGANGP,
    BatchNormGAN,
    ConstantWeight,
    ExtraLoss,
    GuideCompiledLoss,
    GuideLowLevel,
    GuideSampleWeights,
    GuideTestStep,
    ListedGAN,
    Mixed,
    Rounded,
    ScoredGAN,
    SubModelGAN,
    distiller,
    distiller_compile,
    functional,
    gan_compile,
    make_gan,
    mlp,
    sgd_compile,
    simsiam,
    standard_compile,
    vae,
)

import kerasmulti
from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.utils import step_ops

ROWS, BATCH = 26, 8


def _data(kind):
    rng = np.random.default_rng()
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    if kind == "xy":
        return dict(x=x, y=y)
    if kind == "weighted":
        return dict(x=x, y=y, sample_weight=rng.uniform(0.1, 2.0, size=(ROWS,)).astype("float32"))
    if kind == "pairs":  # (real, latent), two views: a step's `data` is (x, y)
        return dict(x=x, y=rng.normal(size=(ROWS, FEATURES)).astype("float32"))
    raise AssertionError(kind)


# name: (build(seed), compile(model), data kind)
CASES = {
    "guide compiled loss": (lambda s: functional(GuideCompiledLoss, s), standard_compile, "xy"),
    "guide low level + step counter": (lambda s: functional(GuideLowLevel, s), sgd_compile, "xy"),
    "guide sample weights": (lambda s: functional(GuideSampleWeights, s), standard_compile, "weighted"),
    # A variable's or a float's weight is the batch's, not summed over the replicas as a row count is.
    "metric weights shared": (lambda s: functional(ConstantWeight, s), sgd_compile, "xy"),
    "compute_loss": (lambda s: functional(ExtraLoss, s), standard_compile, "xy"),
    "GAN": (lambda s: make_gan(GAN, s), gan_compile, "pairs"),
    "GAN, optimizers in a list": (lambda s: make_gan(ListedGAN, s), gan_compile, "pairs"),
    # The accuracy took the first replica's rows only (not one row per batch row); the log of
    # unknown rank crashed.
    "GAN scored on fake and real rows": (lambda s: make_gan(ScoredGAN, s), gan_compile, "pairs"),
    # Each replica applied its own gradient with the sub-models' optimizers: 2 updates a step.
    "GAN, optimizers of its sub-models": (lambda s: make_gan(SubModelGAN, s), gan_compile, "pairs"),
    "WGAN-GP": (lambda s: make_gan(WGANGP, s), gan_compile, "pairs"),
    "VAE": (vae, sgd_compile, "vae"),
    "distiller": (distiller, distiller_compile, "labels"),
    "SimSiam": (simsiam, sgd_compile, "pairs"),
}


def _case_data(kind):
    rng = np.random.default_rng()
    if kind == "vae":
        return dict(x=rng.normal(size=(ROWS, FEATURES)).astype("float32"), y=rng.normal(size=(ROWS, 2)).astype("float32"))
    if kind == "labels":
        return dict(x=rng.normal(size=(ROWS, FEATURES)).astype("float32"), y=rng.integers(0, 3, size=(ROWS,)))
    return _data(kind)


def _trained(case, batch_size, wrap, callbacks=(), **options):
    """(reference, template, parallel): the case's model on one device, and wrapped by `wrap`, fitted alike."""
    build, compile_, kind = CASES[case]
    data = _case_data(kind)
    fit = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    reference, template = build(7), build(7)
    compile_(reference)
    expected = reference.fit(**data, **fit).history
    parallel = wrap(template)
    compile_(parallel, **options)
    assert_same_logs(expected, parallel.fit(**data, callbacks=list(callbacks), **fit).history)
    assert_same_weights(reference, template)
    return reference, template, parallel


# 8 rows split 3, 3, 2 (and the last batch, 2 rows, leaves a replica idle); 6 rows split evenly.
# "xla": the model calls in each replica's step compiled (`compiled_calls.py`), against one uncompiled device;
# the GANs that hold their optimizers otherwise compile the GAN's calls again (24 s), so they run uncompiled only.
@pytest.mark.parametrize(
    "case, batch_size, jit_compile",
    [
        pytest.param(case, batch_size, jit_compile, id=f"{case}-{name}")
        for case in CASES
        for name, batch_size, jit_compile in (("uneven", BATCH, "auto"), ("balanced", 2 * DEVICES, "auto"), ("uneven-xla", BATCH, True))
        if jit_compile is not True or case not in ("GAN, optimizers in a list", "GAN, optimizers of its sub-models")
    ],
)
def test_a_custom_step_trains_with_one_devices_numbers(case, batch_size, jit_compile):
    wrap = functools.partial(kerasmulti.parallelize, gpus=DEVICES)
    reference, template, parallel = _trained(case, batch_size, wrap, jit_compile=jit_compile)
    assert parallel.replica_jit_compile is (jit_compile is True)  # "auto": off on CPUs, as Keras
    if case.startswith("guide low level"):
        assert int(template.steps_taken.numpy()) == int(reference.steps_taken.numpy()) == 2 * -(-ROWS // batch_size)
    if case.startswith(("GAN", "WGAN-GP")):
        assert int(template.d_optimizer.iterations.numpy()) == int(reference.d_optimizer.iterations.numpy())


@pytest.mark.parametrize("case", ["GAN", "VAE"])
def test_the_monitor_and_an_auto_split_time_a_custom_step_without_changing_its_numbers(case, monkeypatch):
    # The template's own step is timed as Keras' is: rows and busy time per
    # replica for the monitor, and the speeds "auto" sizes the sub-batches by.
    monkeypatch.setattr(_balance.AutoSplit, "WARMUP", 1)
    monkeypatch.setattr(_balance.AutoSplit, "WINDOW", 3)  # 4 steps an epoch: settled in the second
    monitor = kerasmulti.ThroughputMonitor(verbose=0)
    wrap = functools.partial(kerasmulti.parallelize, gpus=DEVICES, split="auto")
    _, _, parallel = _trained(case, BATCH, wrap, callbacks=[monitor])
    assert parallel._auto_split.settled and sum(parallel.split) == pytest.approx(1.0)
    first, second = monitor.records
    assert first["samples"] == second["samples"] == ROWS
    rows = [d["rows"] for d in first["devices"].values()]  # even in the first epoch
    assert sum(rows) == ROWS and max(rows) - min(rows) <= 4  # 26 rows in batches of 8 (the last 2)
    assert all(d["busy_seconds"] > 0 for d in second["devices"].values())
    assert 0 < second["compute_seconds"] <= second["step_seconds"]
    assert 0 <= second["input_call_seconds"] <= second["step_seconds"]
    parts = sum(second[f"{part}_seconds"] for part in ("compute", "merge_update", "input_call", "loop"))
    assert parts == pytest.approx(second["step_seconds"])


class _MetricFirst(keras.Model):
    """Updates its loss tracker before its backward pass, which runs while it waits at that meeting point."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        self.loss_tracker.update_state(loss)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


@pytest.mark.slow  # wall-clock ratios (sleeps standing for slow devices): not in the fast tier
@pytest.mark.parametrize("kind", ["metrics after apply", "metric before backward"])
def test_an_auto_split_gives_a_slowed_device_fewer_rows_in_a_custom_step(monkeypatch, kind):
    # The replicas meet at `optimizer.apply` and at every metric update: a fast
    # replica waits there for the slow one, and a wait counted as busy time made
    # every replica look as slow as the slowest (imbalance 1.01, split even).
    # Updating a metric first, a fast replica runs its backward pass while it
    # waits there: work that is not booked (docs/limitations.md), so the slowed
    # device gets fewer rows than its speed asks for (0.08 measured for 1/7), never an even third.
    from workers.slow_device import SlowDevice

    monkeypatch.setattr(_balance.AutoSplit, "WINDOW", 4)
    keras.utils.set_random_seed(21)
    inputs = keras.Input((FEATURES,))
    first = kind == "metric before backward"
    load = SlowDevice(2.0 if first else 4.0, (f"CPU:{DEVICES - 1}",), 3.0, backward=first)
    slowed = load(keras.layers.Dense(8, activation="relu")(inputs))
    template = (_MetricFirst if first else GuideLowLevel)(inputs, keras.layers.Dense(1)(slowed))
    parallel = kerasmulti.parallelize(template, gpus=DEVICES, split="auto")
    parallel.compile(optimizer="adam")
    monitor = kerasmulti.ThroughputMonitor(verbose=0)
    rng = np.random.default_rng()
    x, y = rng.normal(size=(480, FEATURES)).astype("float32"), rng.normal(size=(480, 1)).astype("float32")
    parallel.fit(x, y, batch_size=48, epochs=2, verbose=0, callbacks=[monitor])
    before, after = monitor.records
    # 4 ms a row (2 forward and 2 backward), 3x on the slowed device: 3x the others' busy time until "auto"
    # settles, within the first epoch (measured 2.08 over that epoch; 1.0004 before).
    assert before["imbalance"] > 1.5, before["imbalance"]
    fast = 1 / (DEVICES - 1 + 1 / 3)  # speeds 1 : ... : 1/3
    if first:  # the fast replicas' backward passes unbooked: they look faster than they are
        assert 0.02 < parallel.split[-1] < fast / 3 + 0.04
    else:
        assert parallel.split[-1] == pytest.approx(fast / 3, abs=0.04)
        assert after["imbalance"] < 1.5
    rows = [d["rows"] for d in after["devices"].values()]
    assert rows[-1] < rows[0] / 2


def test_a_custom_step_run_eagerly_under_an_auto_split_merges_each_metrics_rows(monkeypatch):
    # Eagerly a sub-batch's row count is known; under "auto" the shard's size is a
    # tensor, and the metric got the first replica's rows only (mae 0.95 for 1.10).
    monkeypatch.setattr(_balance.AutoSplit, "WARMUP", 1)
    monkeypatch.setattr(_balance.AutoSplit, "WINDOW", 2)
    wrap = functools.partial(kerasmulti.parallelize, gpus=DEVICES, split="auto")
    _, _, parallel = _trained("guide low level + step counter", BATCH, wrap, run_eagerly=True)
    assert parallel._auto_split.settled


class _ConstantLogs(keras.Model):
    """A step whose logs hold no tensor of the step, which Keras accepts."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"done": 1.0}


def test_the_monitor_times_a_custom_step_whose_logs_hold_no_tensor_to_its_updated_weights():
    inputs = keras.Input((FEATURES,))
    template = _ConstantLogs(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inputs)))
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd")
    monitor = kerasmulti.ThroughputMonitor(verbose=0)
    data = _data("xy")
    parallel.fit(**data, batch_size=BATCH, epochs=2, verbose=0, callbacks=[monitor])
    for record in monitor.records:  # its end once waited for nothing, and read before its start
        assert all(d["busy_seconds"] > 0 for d in record["devices"].values())
        assert record["compute_seconds"] > 0


@pytest.mark.parametrize("case", ["GAN", "GAN, optimizers in a list", "GAN, optimizers of its sub-models", "VAE", "guide low level + step counter", "compute_loss", "metric weights shared"])
def test_a_workers_several_replicas_run_the_custom_steps_with_one_devices_numbers(case):
    # A worker's GPUs: the strategy runs its replicas on threads, each through `worker_steps`.
    _trained(case, BATCH, worker_model)


def test_a_custom_test_step_evaluates_with_one_devices_numbers():
    data = _data("xy")
    reference, template = functional(GuideTestStep, 3), functional(GuideTestStep, 3)
    standard_compile(reference)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    standard_compile(parallel)
    expected = reference.evaluate(**data, batch_size=BATCH, verbose=0, return_dict=True)
    got = parallel.evaluate(**data, batch_size=BATCH, verbose=0, return_dict=True)
    assert_same_logs(expected, got)


def test_a_custom_predict_step_predicts_with_one_devices_numbers():
    x = _data("xy")["x"]
    reference, template = functional(Rounded, 5), functional(Rounded, 5)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    expected, got = reference.predict(x, batch_size=BATCH, verbose=0), parallel.predict(x, batch_size=BATCH, verbose=0)
    assert sorted(got) == ["score", "sign"]
    for key in expected:
        np.testing.assert_allclose(expected[key], got[key], rtol=1e-5, atol=1e-6)


def test_a_gan_drawing_its_noise_in_the_step_trains_on_every_replica():
    class NoisyGAN(GAN):
        def train_step(self, data):
            latent = keras.random.normal((keras.ops.shape(data)[0], FEATURES))
            return super().train_step((data, latent))

    model = make_gan(NoisyGAN, 1)
    before = [w.copy() for w in model.get_weights()]
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    gan_compile(parallel)
    history = parallel.fit(_data("xy")["x"], batch_size=BATCH, epochs=1, verbose=0).history
    assert sorted(history) == ["d_loss", "g_loss"] and all(np.isfinite(v[0]) for v in history.values())
    assert all(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))
    # Each optimizer stepped once a batch, not once a replica.
    assert int(model.d_optimizer.iterations.numpy()) == int(model.g_optimizer.iterations.numpy()) == 4


def test_a_loaded_compiled_model_trains_without_a_new_compile(tmp_path):
    keras.utils.set_random_seed(2)
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    data = _data("xy")
    model.fit(**data, batch_size=BATCH, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    reference, template = (keras.models.load_model(tmp_path / "m.keras") for _ in range(2))
    expected = reference.fit(**data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    # Compiled already, with the template's optimizer: a guard `if not parallel.compiled:
    # parallel.compile(...)` does not start it over with a fresh optimizer.
    assert parallel.compiled and parallel.optimizer is template.optimizer
    assert_same_logs(expected, parallel.fit(**data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history)
    assert_same_weights(reference, template)
    assert template.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy() == 4 + 8


def test_a_mixed_float16_template_gets_loss_scaling():
    # The template's own policy (not the global one): Keras' compile scales its losses.
    class Mixed(keras.Model):
        def __init__(self):
            super().__init__(dtype="mixed_float16")
            self.hidden, self.out = keras.layers.Dense(6), keras.layers.Dense(1, dtype="float32")

        def call(self, x):
            return self.out(self.hidden(x))

    def build():
        keras.utils.set_random_seed(2)
        model = Mixed()
        model(np.zeros((1, FEATURES), "float32"))
        return model

    reference, template = build(), build()
    reference.compile(optimizer="sgd", loss="mse")
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse")
    assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(parallel.optimizer, keras.optimizers.LossScaleOptimizer)
    assert template.optimizer is parallel.optimizer
    # And it trains as the template does on one device.
    data = _data("xy")
    fit = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    small = dict(x=data["x"], y=1e-6 * data["y"])
    reference.fit(**small, **fit)
    parallel.fit(**small, **fit)
    assert_same_weights(reference, template, atol=1e-3)


def test_a_mixed_float16_step_scales_each_replicas_loss_by_its_share_before_the_tape():
    # The first replica takes the 3 rows whose targets are large. Its gradient of its own mean is 8/3
    # times its part of the batch's; scaled by the loss scale (2**15), that overflows float16
    # (-98304) where one device's does not (-36864), and the step was skipped.
    # `optimizer.scale_loss` multiplies each replica's loss by its share first.
    def fit(parallel):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            inputs = keras.Input((1,))
            template = Mixed(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
            model = kerasmulti.parallelize(template, gpus=DEVICES) if parallel else template
            sgd_compile(model)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        model.fit(np.ones((8, 1), "float32"), y, batch_size=8, verbose=0)
        return template

    y = np.array([[1.5]] * 3 + [[0.0]] * 5, "float32")
    reference, template = fit(False), fit(True)
    assert int(reference.optimizer.iterations.numpy()) == int(template.optimizer.iterations.numpy()) == 1
    assert_same_weights(reference, template, atol=1e-3)  # float16's rounding


def test_a_mixed_float16_models_float32_layers_read_their_weights_in_float32_under_xla():
    # Keras' state scope casts its values to the variables' dtype, float16 in the template's own
    # autocast scope: the compiled call's float32 layers read their weights rounded (4e-4 off).
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(16, activation="tanh", dtype="float32")(inputs)
        template = Rounded(inputs, keras.layers.Dense(3, dtype="float32")(hidden))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = _data("xy")["x"]
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=True)
    got = parallel.predict(x, batch_size=BATCH, verbose=0)
    assert parallel._custom.compiles
    np.testing.assert_allclose(got["score"], template.predict(x, batch_size=BATCH, verbose=0)["score"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 8 s, XLA programs: CI runs it, the fast tier does not
def test_a_float16_layer_of_a_custom_step_trains_under_xla_as_on_one_device():
    # The compiled calls' state scope, built with an autocast scope of None, cast float16 weights
    # to float32 ("Tensor conversion requested dtype float16 for Tensor with dtype float32").
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((FEATURES,))
        outputs = keras.layers.Dense(2, dtype="float16")(keras.layers.Dense(6, activation="relu")(inputs))
        return Mixed(inputs, keras.ops.cast(outputs, "float32"))

    data = _data("xy")
    y = data["y"][:, :1] * np.ones((1, 2), "float32")
    reference, template = build(), build()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    parallel.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    reference.fit(data["x"], y, batch_size=BATCH, shuffle=False, verbose=0)
    parallel.fit(data["x"], y, batch_size=BATCH, shuffle=False, verbose=0)
    assert parallel._custom.compiles
    assert_same_weights(reference, template, atol=2e-3)  # float16's rounding


class _OwnLossScale(keras.Model):
    """A mixed_float16 step with a LossScaleOptimizer of its own, unbuilt until its first `apply`."""

    def __init__(self, gradient_accumulation_steps):
        super().__init__(name="own_loss_scale")
        # float16 kernel, no bias: every gradient that can overflow is a row's own, the same on any replica.
        self.dense = keras.layers.Dense(1, use_bias=False, dtype="mixed_float16")
        inner = keras.optimizers.Adam(0.1, gradient_accumulation_steps=gradient_accumulation_steps)
        self.scaled_optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=2**10)

    def call(self, x):
        return keras.ops.cast(self.dense(x), "float32")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            scaled = self.scaled_optimizer.scale_loss(loss)
        self.scaled_optimizer.apply(tape.gradient(scaled, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("accumulation, jit_compile", [(None, "auto"), (3, True)], ids=["plain", "accumulating-xla"])
def test_an_unbuilt_loss_scale_optimizer_of_the_step_lowers_its_scale_and_trains_as_one_device(accumulation, jit_compile):
    # Built by its first `apply`, inside the step's first trace: that trace scaled by the initial
    # scale, a constant. One device's trace is made again once the optimizer has variables; the
    # replicas built it where `tf.function` did not see it, so every step kept the constant scale
    # (2**10), overflowed and was skipped: 0 steps applied, the scale halved to 2**2.
    rng = np.random.default_rng()
    # Targets near 1000: each row's float16 gradient overflows at scales 2**10 and 2**9 and no longer at 2**8
    # (batches of 8); the small inputs keep the kernel's sum over the rows far from float16's limit.
    x = (0.01 * rng.normal(size=(ROWS, FEATURES))).astype("float32")
    y = (1000 + rng.normal(size=(ROWS, 1))).astype("float32")

    def fit(parallel):
        keras.utils.set_random_seed(5)
        template = _OwnLossScale(accumulation)
        template(x[:1])
        model = kerasmulti.parallelize(template, gpus=DEVICES) if parallel else template
        model.compile(jit_compile=jit_compile if parallel else False)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return template

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, template = fit(False), fit(True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizers = reference.scaled_optimizer, template.scaled_optimizer
    # Skipped: the first two steps (scales 2**10, 2**9) and each epoch's last, of 2 rows (2**8, 2**7).
    assert [float(o.dynamic_scale.numpy()) for o in optimizers] == [2.0**6] * 2
    assert [int(o.iterations.numpy()) for o in optimizers] == [4 // (accumulation or 1)] * 2  # 4 applied
    assert_same_weights(reference, template, atol=1e-3)  # float16's rounding


def test_callbacks_reach_the_templates_own_attributes():
    model = functional(GuideLowLevel, 4)
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    seen = []

    class Counter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(int(self.model.steps_taken.numpy()))

    sgd_compile(parallel)
    parallel.fit(**_data("xy"), batch_size=BATCH, epochs=2, verbose=0, callbacks=[Counter()])
    assert seen == [4, 8]
    with pytest.raises(AttributeError, match=r"kerasmulti.unwrap\(model\).*Received: name='no_such_thing'"):
        parallel.no_such_thing  # noqa: B018


def test_the_documented_gan_example_runs_and_logs_as_one_device():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "data-parallel.md").read_text()
    code = page.split("## Custom training steps", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(code, namespace)
    history = namespace["history"].history
    assert sorted(history) == ["d_loss", "g_loss"] and all(len(v) == 2 and np.all(np.isfinite(v)) for v in history.values())
    assert namespace["parallel"].replica_jit_compile is False
    assert int(namespace["gan"].d_optimizer.iterations.numpy()) == 2 * 4


def test_a_model_without_call_whose_parts_are_unbuilt_is_refused():
    gan = GAN(keras.Sequential([keras.layers.Dense(1)]), mlp(FEATURES))
    with pytest.raises(ValueError, match=r"needs a built model.*Received: model='gan.*' with built=False"):
        kerasmulti.parallelize(gan, gpus=DEVICES)


def _matmuls_outside_xla(parallel, x, y) -> float:
    """Matrix products a training step runs outside XLA (TensorFlow's profiler counts them exactly)."""
    step = parallel.train_function
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    step(batches)
    ran = step_ops.count(lambda: step(batches), steps=2)
    return sum(n for name, n in ran.by_type.items() if "MatMul" in name)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_gans_model_calls_run_in_xla_programs_with_jit_compile(jit_compile):
    data = _data("pairs")
    parallel = kerasmulti.parallelize(make_gan(GAN, 4), gpus=DEVICES)
    gan_compile(parallel, jit_compile=jit_compile)  # GAN.compile takes no jit_compile: kept by the parallel model
    parallel.fit(**data, batch_size=BATCH, epochs=1, verbose=0)
    matmuls = _matmuls_outside_xla(parallel, data["x"][:BATCH], data["y"][:BATCH])
    # Uncompiled, each replica's generator and discriminator run their products op by op.
    assert matmuls == 0 if jit_compile else matmuls >= 2 * DEVICES


def _deep_gan(depth):
    keras.utils.set_random_seed(1)

    def mlp(outputs, name):
        hidden = [keras.layers.Dense(6, activation="tanh") for _ in range(depth)]
        return keras.Sequential([keras.Input((FEATURES,)), *hidden, keras.layers.Dense(outputs)], name=name)

    return GAN(mlp(1, "discriminator"), mlp(FEATURES, "generator"))


def _operations_outside_xla(gan, jit_compile) -> float:
    data = _data("pairs")
    parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
    gan_compile(parallel, jit_compile=jit_compile)
    x, y = data["x"][:BATCH], data["y"][:BATCH]
    parallel.fit(x, y, batch_size=BATCH, verbose=0)
    step = parallel.train_function
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    step(batches)
    return step_ops.count(lambda: step(batches), steps=2).outside_xla


@pytest.mark.slow  # four GANs trained (30-60 s); the fast tier counts Keras' own step (test_packed_step.py)
def test_a_compiled_gan_steps_operations_outside_xla_do_not_grow_with_the_model():
    # Packed reads for each model call and a packed update per optimizer (`packed_apply`); uncompiled,
    # every variable costs reads, sends, sums and updates each step (the control).
    small, large = _deep_gan(1), _deep_gan(6)
    assert len(large.trainable_variables) == len(small.trainable_variables) + 20
    compiled = [_operations_outside_xla(gan, True) for gan in (_deep_gan(1), _deep_gan(6))]
    assert abs(compiled[1] - compiled[0]) <= 10, compiled
    uncompiled = [_operations_outside_xla(gan, False) for gan in (small, large)]
    assert uncompiled[1] > uncompiled[0] + 20 * DEVICES, uncompiled


def test_jit_compile_of_a_custom_step_must_be_true_false_or_auto():
    parallel = kerasmulti.parallelize(functional(GuideCompiledLoss, 2), gpus=DEVICES)
    with pytest.raises(ValueError, match=r"jit_compile must be True, False or 'auto'.*Received: jit_compile='yes'"):
        parallel.compile(optimizer="sgd", loss="mse", jit_compile="yes")


class NoXLA(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


class Watched(keras.layers.Layer):
    """Tracks the mean of its inputs in a metric it updates in `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = keras.metrics.Mean(name="seen")

    def call(self, x):
        self.seen.update_state(x)
        return x


class Counting(keras.layers.Layer):
    """Counts its calls in a variable of another model (held untracked)."""

    def __init__(self, counter, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_counter", counter)

    def call(self, x):
        self._counter.assign_add(1.0)
        return x


class Borrowing(keras.layers.Layer):
    """Adds the mean of a variable of another model (held untracked)."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_other", other)

    def call(self, x):
        return x + keras.ops.mean(self._other)


class TrainingCalls(keras.layers.Layer):
    """Counts its calls in training mode, in a variable of its own."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        return x


class MixedModesGAN(GAN):
    """Calls its generator in training mode and not, in one step: each call assigns its own variables."""

    def train_step(self, data):
        real, latent = data
        self.generator(latent, training=True)
        self.generator(latent, training=False)
        self.generator(latent, training=True)
        return super().train_step(data)


@pytest.mark.slow  # 10 s, XLA programs: CI runs it, the fast tier does not
def test_each_compiled_call_assigns_what_its_own_trace_assigned():
    # A trace for training=False assigns nothing; one list kept for every trace once assigned 8 of 16.
    data = _data("pairs")

    def fitted(parallel_options):
        keras.utils.set_random_seed(6)
        generator = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(FEATURES), TrainingCalls()], name="generator")
        gan = MixedModesGAN(mlp(1, "discriminator"), generator)
        model = gan if parallel_options is None else kerasmulti.parallelize(gan, gpus=DEVICES)
        gan_compile(model, **(parallel_options or {}))
        return model.fit(**data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history, gan

    expected, reference = fitted(None)
    got, template = fitted(dict(jit_compile=True))
    assert float(template.generator.layers[-1].calls.numpy()) == float(reference.generator.layers[-1].calls.numpy()) == 2 * 2 * 4
    assert_same_logs(expected, got)
    assert_same_weights(reference, template)


def _gan_with_generator_layer(make_layer, seed):
    keras.utils.set_random_seed(seed)
    discriminator = mlp(1, "discriminator")
    layer = make_layer(discriminator)
    generator = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(FEATURES), layer], name="generator")
    return BatchNormGAN(discriminator, generator)


FALLBACKS = {
    "BatchNormalization": (lambda _: keras.layers.BatchNormalization(), r"holds BatchNormalization 'batch_normalization.*'"),
    "no XLA": (lambda _: NoXLA(name="no_xla"), r"holds layers that do not support XLA \(no_xla\)"),
    "metric in call": (lambda _: Watched(), r"updates metric 'seen'"),
    "assigns another model's variable": (lambda other: Counting(other.layers[0].bias), r"reaches variable '.*bias', which it does not own"),
    "reads another model's variable": (lambda other: Borrowing(other.layers[0].bias), r"reaches variable '.*bias', which it does not own"),
    "recurrent": (
        lambda _: keras.Sequential([keras.layers.Reshape((FEATURES, 1)), keras.layers.SimpleRNN(FEATURES, name="rnn")]),
        r"holds recurrent layers \(rnn\)",
    ),
}


def _fit_gan_with_generator_layer(make_layer, data, parallel_options=None):
    """(history, template) of a BatchNormGAN fitted on one device, or parallel with `parallel_options`."""
    template = _gan_with_generator_layer(make_layer, 5)
    model = template if parallel_options is None else kerasmulti.parallelize(template, gpus=DEVICES)
    gan_compile(model, **(parallel_options or {}))
    return model.fit(**data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history, template


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_a_model_call_that_cannot_be_one_replicas_program_runs_uncompiled_with_one_warning(case):
    make_layer, reason = FALLBACKS[case]
    data = _data("pairs")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, template = _fit_gan_with_generator_layer(make_layer, data, dict(jit_compile=True))
    messages = [str(w.message) for w in record if "runs uncompiled" in str(w.message)]
    assert len(messages) == 1, messages  # once, for the generator; the discriminator stays compiled
    assert re.search(rf"Model 'generator' runs uncompiled: it {reason}.*Received: model='generator'", messages[0])
    expected, reference = _fit_gan_with_generator_layer(make_layer, data)
    assert_same_logs(expected, got)
    assert_same_weights(reference, template)


def test_a_custom_step_through_batchnormalization_in_training_trains_with_one_devices_numbers():
    # The statistics' gradient sums every replica's upstream; each is weighed by its replica's share, as
    # the step's merge weighs the gradients (unweighted, an idle replica's borrowed row counted: 1e-2 off).
    make_layer = FALLBACKS["BatchNormalization"][0]
    data = _data("pairs")
    expected, reference = _fit_gan_with_generator_layer(make_layer, data)
    got, template = _fit_gan_with_generator_layer(make_layer, data, dict(jit_compile=False))
    assert_same_logs(expected, got)
    assert_same_weights(reference, template)


def test_a_gan_without_call_is_checkpointed_without_marking_it_built(tmp_path):
    # Keras' own callbacks refuse it on one device until `gan.built = True`; its parts hold every weight.
    gan = make_gan(GAN, 1)
    parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
    gan_compile(parallel)
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "gan.weights.h5"), save_weights_only=True)
    parallel.fit(**_data("pairs"), batch_size=BATCH, verbose=0, callbacks=[checkpoint])
    twin = make_gan(GAN, 2)
    twin.built = True
    twin.load_weights(tmp_path / "gan.weights.h5")
    assert_same_weights(gan, twin, atol=0)


@pytest.mark.slow  # a subprocess: CI runs it, the fast tier does not
def test_the_custom_steps_give_one_devices_numbers_on_4_devices_too():
    # The suite runs on 3 simulated devices; this file again on 4, in a process of its own.
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "KERASMULTI_TEST_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    result = subprocess.run(
        # "balanced" (2 x devices rows) is "uneven"'s 8 rows again on 4 devices. Uncompiled only:
        # every XLA case compiles once per device (the GAN and the VAE alone took 40 of 90 s),
        # and the 3 devices' run compiles each case.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "one_devices_numbers and not 4_devices and not several_replicas and not balanced and not xla"],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    # Every case uncompiled, and the other tests of one device's numbers that run uncompiled.
    assert re.search(rf"^{len(CASES) + 3} passed", result.stdout, re.M), result.stdout[-1000:]


def test_a_gans_own_optimizers_resume_from_a_backup_with_their_state(tmp_path):
    # Keras builds d_optimizer and g_optimizer at their first step, after the backup
    # was loaded: they used to start from zero (the resumed run ended elsewhere).
    data = _data("pairs")

    seen = []

    def run(epochs, delete_checkpoint=True):
        gan = make_gan(GAN, 3)
        parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
        gan_compile(parallel)
        backup = kerasmulti.ParallelBackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=delete_checkpoint)
        steps = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(int(gan.d_optimizer.iterations.numpy())))
        parallel.fit(**data, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[backup, steps])
        return gan

    straight = run(2)
    run(1, delete_checkpoint=False)  # the first epoch, backed up; then a new process, as after a kill
    seen.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(2)
    # Keras' "Skipping variable loading" is not given for an optimizer that does resume (nor an unused one).
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    steps = 2 * -(-ROWS // BATCH)  # two epochs of whole and last partial batches
    assert seen == list(range(steps // 2, steps))  # callbacks saw the step count go on from the backup's
    for optimizer in ("d_optimizer", "g_optimizer"):
        assert int(getattr(resumed, optimizer).iterations.numpy()) == int(getattr(straight, optimizer).iterations.numpy()) == steps
        for a, b in zip(getattr(straight, optimizer).variables, getattr(resumed, optimizer).variables):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


@pytest.mark.slow  # 6 s: CI runs it, the fast tier does not
def test_a_gan_loaded_from_its_weights_checkpoint_goes_on_with_its_optimizers_state(tmp_path):
    # A ParallelModelCheckpoint of the weights (a GAN has no get_config, so no
    # whole-model file), loaded into a new process's model: Keras skipped the
    # state of the unbuilt d_optimizer and g_optimizer, which then started from zero.
    data, path = _data("pairs"), str(tmp_path / "gan.weights.h5")
    fit = dict(**data, batch_size=BATCH, shuffle=False, verbose=0)

    def model():
        gan = make_gan(GAN, 4)
        parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
        gan_compile(parallel)
        return gan, parallel

    straight, parallel = model()
    parallel.fit(**fit, epochs=2)
    saved, parallel = model()
    parallel.fit(**fit, epochs=1, callbacks=[kerasmulti.ParallelModelCheckpoint(path, save_weights_only=True)])
    loaded, parallel = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.load_weights(path)
        parallel.load_weights(path)  # twice before the first step (a warm start, then a backup): the latest wins
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert not loaded.d_optimizer.built  # Keras builds it at the first step: its state goes in then
    # Its step count is there already, for a callback before the first step (a schedule, a logger).
    assert int(loaded.d_optimizer.iterations.numpy()) == int(saved.d_optimizer.iterations.numpy()) > 0
    parallel.fit(**fit, epochs=1)
    for a, b in zip(straight.d_optimizer.variables + straight.g_optimizer.variables + straight.weights,
                    loaded.d_optimizer.variables + loaded.g_optimizer.variables + loaded.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_weights_loaded_before_the_first_step_bring_the_compiled_optimizers_state(tmp_path):
    # Keras skips an unbuilt optimizer's saved state ("Skipping variable loading"); a resumed Adam would restart.
    data, path = _data("xy"), str(tmp_path / "model.weights.h5")
    fit = dict(**data, batch_size=BATCH, shuffle=False, verbose=0)

    def model():
        template = functional(keras.Model, 5)
        parallel = kerasmulti.parallelize(template, gpus=DEVICES)
        parallel.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return template, parallel

    straight, parallel = model()
    parallel.fit(**fit, epochs=2)
    saved, parallel = model()
    parallel.fit(**fit, epochs=1)
    parallel.save_weights(path)
    loaded, parallel = model()
    parallel.load_weights(path)
    assert int(parallel.optimizer.iterations.numpy()) == -(-ROWS // BATCH)
    parallel.fit(**fit, epochs=1)
    for a, b in zip(straight.weights, loaded.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7, err_msg=a.path)


def test_a_whole_model_checkpoint_of_a_gan_without_get_config_is_refused_before_training(tmp_path):
    # Keras' save fails on it (NotImplementedError) at the first save, after a whole epoch.
    gan = make_gan(GAN, 6)
    parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
    gan_compile(parallel)
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "gan.keras"))
    with pytest.raises(ValueError, match=r"cannot save the whole '.*': its class has no get_config\(\)\. Pass "
                       r"save_weights_only=True\. Received: save_weights_only=False"):
        parallel.fit(**_data("pairs"), batch_size=BATCH, epochs=1, verbose=0, callbacks=[checkpoint])
    assert not gan.d_optimizer.built  # no step ran


def test_a_gans_optimizer_of_another_class_keeps_its_own_state_as_keras_does(tmp_path):
    # The file holds Adam's state for d_optimizer; the model's is RMSprop: Keras skips it, with its warning.
    path = str(tmp_path / "gan.weights.h5")
    fit = dict(**_data("pairs"), batch_size=BATCH, shuffle=False, verbose=0, epochs=1)
    gan = make_gan(GAN, 4)
    parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
    gan_compile(parallel)
    parallel.fit(**fit)
    parallel.save_weights(path)
    gan = make_gan(GAN, 4)
    parallel = kerasmulti.parallelize(gan, gpus=DEVICES)
    parallel.compile(keras.optimizers.RMSprop(0.5), keras.optimizers.SGD(0.05), keras.losses.BinaryCrossentropy(from_logits=True))
    parallel.load_weights(path)
    with pytest.warns(UserWarning, match=f"Skipping variable loading for optimizer '{re.escape(gan.d_optimizer.name)}'"):
        parallel.fit(**fit)
    assert float(gan.d_optimizer.learning_rate.numpy()) == 0.5
    assert int(gan.d_optimizer.iterations.numpy()) == -(-ROWS // BATCH)  # its own steps, from zero



def test_a_log_of_unknown_rank_is_weighted_as_a_scalar_or_taken_from_the_first_replica_across_workers():
    # `len(shape)` of a tf.numpy_function's log crashed the step of every replica.
    from kerasmulti._src.multi_worker import worker_steps

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def weighted(value):
        return worker_steps._weighted_log(value, share=0.25, first=0.0, replicas=2)

    assert float(weighted(tf.constant(3.0))) == 1.5  # a scalar: times its share, x replicas (Keras averages them)
    np.testing.assert_array_equal(weighted(tf.constant([3.0, 4.0])).numpy(), [0.0, 0.0])  # not the first replica's


class _SumsItsLoss(keras.Model):
    """A loss of its own summed over the rows, divided by a count over the batch (keras_hub's RetinaNet's kind)."""

    def __init__(self, reduction):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(1)(inputs), name="sums_its_loss")
        self.own_loss = keras.losses.MeanSquaredError(reduction=reduction)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return self.own_loss(y, y_pred) / keras.ops.maximum(keras.ops.sum(keras.ops.cast(y > 0, "float32")), 1.0)


def test_a_loss_of_its_own_summed_over_the_rows_is_warned_about(recwarn):
    # Each replica's loss counts by its rows: a sum over a count of the whole batch's is not one device's.
    with pytest.warns(UserWarning, match=r"'sums_its_loss' runs its own steps with \['mean_squared_error'\], sums over the rows.*Received: reduction='sum'$") as record:
        kerasmulti.parallelize(_SumsItsLoss("sum"), gpus=2).compile(optimizer="sgd")
    assert [w.filename for w in record if "sums over" in str(w.message)] == [__file__]  # the user's line
    # Keras' own train step, of a model overriding another step, with a compiled summed loss: the same.
    evaluating = _OwnTestStep()
    with pytest.warns(UserWarning, match=r"'own_test_step' runs its own steps with \['mean_squared_error'\]"):
        kerasmulti.parallelize(evaluating, gpus=2).compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    nested = _SumsItsLoss("sum_over_batch_size")
    nested.heads = {"boxes": {"class": keras.losses.MeanSquaredError(reduction="sum")}}  # two containers deep
    with pytest.warns(UserWarning, match=r"'sums_its_loss' runs its own steps with \['mean_squared_error'\]"):
        kerasmulti.parallelize(nested, gpus=2).compile(optimizer="sgd")
    recwarn.clear()
    kerasmulti.parallelize(_SumsItsLoss("sum_over_batch_size"), gpus=2).compile(optimizer="sgd")
    kerasmulti.parallelize(_SumsItsLoss("sum"), gpus=1).compile(optimizer="sgd")
    holding = _SumsItsLoss("sum_over_batch_size")
    holding.adjacency = tf.sparse.eye(3)  # not a container of losses (before: TypeError, not iterable)
    kerasmulti.parallelize(holding, gpus=2).compile(optimizer="sgd")
    assert not [w for w in recwarn if "sums over the rows" in str(w.message)]


class _CountNormalised(keras.Model):
    """Squared errors summed and divided by the positive targets of the whole batch (a detector's normaliser)."""

    def __init__(self, per_row, noise=0.0):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(1)(inputs), name="count_normalised")
        self.per_row, self.noise = per_row, noise

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        positives = keras.ops.cast(y > 0, "float32")
        if self.per_row:  # each row by its own count: a mean over the rows, with noise drawn as a VAE may draw it
            noise = keras.random.normal(keras.ops.shape(y_pred), seed=7)  # alike for every batch of one shape
            return keras.ops.mean(keras.ops.square(y - y_pred - self.noise * noise) / keras.ops.maximum(positives, 0.5))
        return keras.ops.sum(keras.ops.square(y - y_pred)) / keras.ops.maximum(keras.ops.sum(positives), 1.0)


def test_a_compute_loss_divided_by_a_count_over_the_batch_is_warned_about_at_the_first_fit(recwarn):
    # Each replica divides by its own rows' count: not one device's numbers, and before, no word.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    parallel = kerasmulti.parallelize(_CountNormalised(per_row=False), gpus=DEVICES)
    parallel.compile(optimizer="sgd")
    with pytest.warns(UserWarning, match=r"The compute_loss of 'count_normalised' is not a mean over the batch's rows.*Normalise per row, or use one device\. Received: relative difference=") as record:
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [w.filename for w in record if "compute_loss" in str(w.message)] == [__file__]
    recwarn.clear()
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)  # once per parallel model
    # Normalised row by row it is exact, and draws in the loss (a batch's shape's, alike at each
    # call) are not taken for a count over the batch.
    noisy = kerasmulti.parallelize(_CountNormalised(per_row=True, noise=0.5), gpus=DEVICES)
    noisy.compile(optimizer="sgd")
    noisy.fit(x, y, batch_size=8, epochs=1, verbose=0)
    reference, template = _CountNormalised(per_row=True), _CountNormalised(per_row=True)
    template.set_weights(reference.get_weights())
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer="sgd")
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_same_logs(reference.fit(x, y, **fit).history, parallel.fit(x, y, **fit).history)
    assert_same_weights(reference, template)
    assert not [w for w in recwarn if "compute_loss" in str(w.message)]


class _OwnTestStep(keras.Model):
    def __init__(self):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(1)(inputs), name="own_test_step")

    def test_step(self, data):
        return super().test_step(data)
