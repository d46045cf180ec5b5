"""BatchNormalization: whole-batch statistics, moving averages updated once per step."""

from simulated import DEVICES

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti


def _bn_model(momentum=0.5):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(momentum=momentum)])


@pytest.mark.parametrize("gpus", [2, DEVICES])
def test_moving_statistics_equal_one_device_on_the_whole_batch(gpus):
    # Measured: a naive wrapper updates once per replica and gets 5.0 here.
    x = np.array([[0.0], [0.0], [10.0], [10.0]], "float32")
    reference, template = _bn_model(), _bn_model()
    expected = reference(x, training=True)
    got = kerasmulti.parallelize(template, gpus=gpus)(x, training=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
    bn, ref_bn = template.layers[0], reference.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), [2.5])
    np.testing.assert_allclose(bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(), rtol=1e-5)


def test_fit_updates_moving_statistics_once_per_step():
    rng = np.random.default_rng()
    x = rng.normal(loc=3.0, scale=2.0, size=(12, 1)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    reference, template = _bn_model(0.9), _bn_model(0.9)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for m in (reference, parallel):
        m.compile(optimizer="sgd", loss="mse")
        m.fit(x, y, batch_size=5, epochs=3, shuffle=False, verbose=0)  # 3 steps per epoch, last one of 2 rows
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_inference_uses_moving_statistics_without_updating_them():
    template = _bn_model()
    bn = template.layers[0]
    bn.moving_mean.assign([4.0])
    x = np.arange(6, dtype="float32").reshape(6, 1)
    out = kerasmulti.parallelize(template, gpus=DEVICES).predict(x, batch_size=6, verbose=0)
    np.testing.assert_allclose(out, template.predict(x, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(bn.moving_mean.numpy(), [4.0])


def test_a_replica_that_fails_while_synchronised_raises_instead_of_hanging():
    template = _bn_model()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("replica exploded")
        return type(template.layers[0]).call(template.layers[0], *args, **kwargs)

    from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm

    original = _sync_batchnorm._synchronized_call
    _sync_batchnorm._synchronized_call = lambda layer, call: lambda *a, **k: (failing(*a, **k), original(layer, call)(*a, **k))[1]
    try:
        with pytest.raises(RuntimeError, match="replica exploded"):
            parallel(np.ones((6, 1), "float32"), training=True)
    finally:
        _sync_batchnorm._synchronized_call = original


def test_activity_regularisers_count_each_replica_once():
    # Replicas of a BatchNormalization model are traced on threads; the losses
    # that layers add while tracing must stay with the replica that added them.
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(6, activity_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3, activity_regularizer=keras.regularizers.L1(0.05)),
            keras.layers.Dense(1),
        ])

    rng = np.random.default_rng()
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 1)).astype("float32")
    reference, template = build(), build()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    losses = []
    for m in (reference, parallel):
        m.compile(optimizer="sgd", loss="mse")
        losses.append(m.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_dropout_masks_differ_between_replicas_traced_on_threads():
    # Each replica draws its own Dropout seed, before and after the
    # BatchNormalization where the replica threads meet.
    inputs = keras.Input((256,))
    before = keras.layers.Dropout(0.5)(inputs)
    after = keras.layers.Dropout(0.5)(keras.layers.BatchNormalization(center=False, scale=False)(inputs))
    parallel = kerasmulti.parallelize(keras.Model(inputs, [before, after]), gpus=DEVICES)
    x = np.random.default_rng().normal(loc=3.0, size=(DEVICES, 256)).astype("float32")
    step = tf.function(lambda x: parallel(x, training=True))
    for _ in range(3):
        for output in step(x):
            kept = np.asarray(output) != 0  # one row per replica
            assert 0 < kept.mean() < 1
            assert len({row.tobytes() for row in kept}) == DEVICES


class _OnlyForSeveralRows(keras.layers.Layer):
    """Normalises only sub-batches of more than one row: replicas take two paths."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        return x if x.shape[0] == 1 else self.norm(x, training=training)


def test_replicas_that_take_different_paths_raise_at_once():
    template = keras.Sequential([keras.Input((3,)), _OnlyForSeveralRows(), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    x = np.ones((4, 3), "float32")  # shards of 2, 1 and 1 rows
    with pytest.raises(RuntimeError, match=r"took different paths.*Received: meeting points=\['BatchNormalization statistics', 'the end of its step', 'the end of its step'\]"):
        parallel(x, training=True)


def test_a_replica_that_never_arrives_ends_in_an_error(monkeypatch):
    from kerasmulti._src.data_parallel import replicas as _replicas

    monkeypatch.setattr(_replicas, "RENDEZVOUS_TIMEOUT_S", 0.3)

    def replica(i):
        if i == 1:  # away, without holding up the others' turns
            turn = _replicas.rendezvous().turn
            turn.give()
            try:
                time.sleep(1.0)
            finally:
                turn.take(1)
        return i

    with pytest.raises(RuntimeError, match=r"did not reach the point where the others waited for it.*Received: timeout=0.3 s"):
        _replicas.run(["/cpu:0", "/cpu:1"], replica, synchronized=True)


def test_replicas_trace_in_their_own_order_whichever_thread_runs_first():
    # The order replicas make their operations in fixes which replica draws which Dropout seed:
    # a resumed run must draw what the uninterrupted one drew. A plain lock goes to whoever comes.
    import threading

    from kerasmulti._src.data_parallel import replicas as _replicas

    turn, order = _replicas._Turn(DEVICES), []

    def replica(i):
        for _ in range(2):  # twice around, as between two meeting points
            with turn.of(i):
                order.append(i)

    threads = [threading.Thread(target=replica, args=(i,)) for i in reversed(range(DEVICES))]
    for thread in threads:  # the last replica's thread starts first
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert order == list(range(DEVICES)) * 2


def test_each_replica_draws_the_same_dropout_mask_in_every_trace():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,))
    dropped = keras.layers.Dropout(0.5)(inputs)  # replicas on threads: BatchNormalization meets
    template = keras.Model(inputs, [dropped, keras.layers.BatchNormalization()(dropped)])
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    x = np.ones((DEVICES, 64), "float32")
    seeds = [np.asarray(v).copy() for v in template.non_trainable_variables if "seed" in v.path]
    masks = []
    for _ in range(3):  # a new trace each time, from the same seed state
        for variable, value in zip([v for v in template.non_trainable_variables if "seed" in v.path], seeds):
            variable.assign(value)
        masks.append(np.asarray(tf.function(lambda x: parallel(x, training=True))(x)[0]) != 0)
    assert all(np.array_equal(mask, masks[0]) for mask in masks)
    assert len({row.tobytes() for row in masks[0]}) == DEVICES  # and each replica its own


def _regularised(batch_norm):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(1.0))]
    return keras.Sequential(layers + [keras.layers.BatchNormalization()] * batch_norm + [keras.layers.Dense(1)])


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_plain_call_leaves_the_losses_one_device_adds(batch_norm):
    x = np.random.default_rng().random((7, 3)).astype("float32")
    reference, template = _regularised(batch_norm), _regularised(batch_norm)
    expected = reference(x, training=True)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    np.testing.assert_allclose(np.asarray(parallel(x, training=True)), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert len(parallel.losses) == DEVICES  # one per replica, weighted by its rows
    np.testing.assert_allclose(float(sum(parallel.losses)), float(sum(reference.losses)), rtol=1e-5)


def test_a_custom_training_loop_gets_one_device_gradients_or_a_clear_error():
    x = np.random.default_rng().random((7, 3)).astype("float32")
    reference, template = _regularised(False), _regularised(False)
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    gradients = []
    for model in (reference, parallel):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2) + sum(model.losses)
        gradients.append(tape.gradient(loss, model.trainable_weights))
    for a, b in zip(*gradients):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    # With BatchNormalization the replicas run on threads the tape cannot see.
    parallel = kerasmulti.parallelize(_regularised(True), gpus=DEVICES)
    with tf.GradientTape(), pytest.raises(RuntimeError, match=r"GradientTape cannot train a parallel model with BatchNormalization.*fit\(\).*unwrap.*Received: training=True with 1 BatchNormalization layer\(s\)"):
        parallel(x, training=True)


def _masked_bn(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(9, 3, mask_zero=True)(tokens)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)  # statistics over unmasked steps only
    return keras.Model(tokens, keras.layers.Dense(1)(keras.layers.LSTM(4)(h)))


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_masked_statistics_and_a_wholly_masked_batch_match_one_device():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 6, size=(10, 1))
    x = np.where(np.arange(5) < lengths, rng.integers(1, 9, size=(10, 5)), 0).astype("int32")
    y = rng.normal(size=(10, 1)).astype("float32")
    reference, template = _masked_bn(), _masked_bn()
    parallel = kerasmulti.parallelize(template, gpus=DEVICES)
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(parallel.fit(x, y, **fit).history["loss"], reference.fit(x, y, **fit).history["loss"], rtol=1e-5)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=a.path)
    # Every step masked: one device normalises with zero statistics, not NaN.
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    normalised = keras.layers.BatchNormalization()(keras.layers.Embedding(9, 3, mask_zero=True)(tokens))
    reference = keras.Model(tokens, normalised)
    parallel = kerasmulti.parallelize(keras.models.clone_model(reference), gpus=DEVICES)
    parallel.set_weights(reference.get_weights())
    padding = np.zeros((4, 5), "int32")
    expected = np.asarray(reference(padding, training=True))
    got = np.asarray(parallel(padding, training=True))
    assert np.all(np.isfinite(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _walked_ops(monkeypatch, blocks: int) -> int:
    """Ops TensorFlow's custom gradients walk while a first training step of `blocks` Dense-BN blocks is traced."""
    from tensorflow.python.ops import op_selector

    walked, walk = [], op_selector.get_backward_walk_ops
    monkeypatch.setattr(op_selector, "get_backward_walk_ops", lambda *a, **k: walked.append(len(walk(*a, **k))) or walk(*a, **k))
    layers = [keras.Input((3,))]
    for _ in range(blocks):
        layers += [keras.layers.Dense(3), keras.layers.BatchNormalization()]
    parallel = kerasmulti.parallelize(keras.Sequential(layers), gpus=2)
    parallel.compile(optimizer="sgd", loss="mse", jit_compile=False)
    parallel.fit(np.ones((4, 3), "float32"), np.zeros((4, 3), "float32"), batch_size=4, verbose=0)
    monkeypatch.undo()
    return sum(walked)


@pytest.mark.slow  # 8 s: CI runs it, the fast tier does not
def test_a_first_step_traces_in_time_linear_in_the_batchnorm_layers(monkeypatch):
    # Each synchronised statistic is a custom gradient, whose trace walks back from its outputs to
    # its inputs; through the other replica's values that walk covered that replica's whole graph
    # so far: DenseNet121's first step took 23x one device's. Counted, not timed: ops walked.
    few, many = _walked_ops(monkeypatch, 3), _walked_ops(monkeypatch, 12)
    assert 0 < many <= 4 * few + 40, (few, many)  # 4x the layers: was 12x the walk
