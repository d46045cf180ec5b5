"""Checks that need a GPU, run as a separate process by tests/test_gpu.py.

    python gpu_checks.py

Splits the first GPU into 2 logical GPUs (before TensorFlow starts, which the
test process has already done on its CPU) and compares, with fresh random data:

- `parallelize(gpus=2)` training and predict of a dense model (Keras' default
  `jit_compile="auto"`: XLA per replica on GPUs), and of one with
  BatchNormalization on the exact path (`jit_compile=False`, and
  `BatchNormalization(synchronized=True)` under `"auto"`), with the template
  trained on one GPU. Under XLA per replica BatchNormalization uses each
  replica's statistics (docs/data-parallel.md, "Which numbers are exact"), so
  one GPU's numbers are not expected there;
- the shared-LSTM example of the README placed on the two GPUs by
  `device_scope`, compiled with Keras' default `jit_compile="auto"`, with the
  same model unplaced;
- a GAN's own `train_step` under "auto" (its model calls in XLA per GPU), and a
  pipeline of two stages on the two GPUs under "auto" (XLA stages), each with
  the same model on one GPU.

Prints one line per check and exits 1 if any fails.
"""

import contextlib
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

GPU = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(GPU, [tf.config.LogicalDeviceConfiguration(memory_limit=2048)] * 2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasmulti  # noqa: E402

rng = np.random.default_rng()


def max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def data_parallel(batch_norm: str | None, jit_compile="auto") -> str:
    """batch_norm: None, "plain" or "synchronized"."""

    def build():
        keras.utils.set_random_seed(3)
        layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization(synchronized=batch_norm == "synchronized"))
        return keras.Sequential(layers + [keras.layers.Dense(3, activation="softmax")])

    x, y = rng.standard_normal((96, 12)).astype("float32"), rng.integers(0, 3, 96)
    reference = build()
    reference.compile("sgd", "sparse_categorical_crossentropy")
    with tf.device("/gpu:0"):
        reference.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    template = build()
    parallel = kerasmulti.parallelize(template, gpus=2)
    parallel.compile("sgd", "sparse_categorical_crossentropy", jit_compile=jit_compile)
    parallel.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    weights = max_difference(reference.get_weights(), template.get_weights())
    predictions = max_difference([reference.predict(x, verbose=0)], [parallel.predict(x, verbose=0)])
    if not (weights < 1e-4 and predictions < 1e-4):
        raise AssertionError(f"differs from one GPU: weights {weights:.1e}, predictions {predictions:.1e} "
                             f"(replica_jit_compile={parallel.replica_jit_compile})")
    return f"weights {weights:.1e}, predictions {predictions:.1e}, replica_jit_compile={parallel.replica_jit_compile}"


def shared_lstm() -> str:
    def build(placed: bool):
        keras.utils.set_random_seed(5)
        tweet_a, tweet_b = keras.Input((6, 4)), keras.Input((6, 4))
        shared = keras.layers.LSTM(8)
        scope = kerasmulti.device_scope if placed else (lambda device: contextlib.nullcontext())
        with scope("/gpu:0"):
            encoded_a = shared(tweet_a)
        with scope("/gpu:1"):
            encoded_b = shared(tweet_b)
        merged = keras.layers.concatenate([encoded_a, encoded_b])
        model = keras.Model([tweet_a, tweet_b], keras.layers.Dense(1)(merged))
        model.compile("adam", "mse")  # jit_compile="auto", Keras' default
        return model

    x = [rng.standard_normal((64, 6, 4)).astype("float32") for _ in range(2)]
    y = rng.standard_normal((64, 1)).astype("float32")
    unplaced, placed = build(False), build(True)
    placed.set_weights(unplaced.get_weights())
    for model in (unplaced, placed):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    devices = {row["device"] for row in kerasmulti.placement_summary(placed).rows if row["type"] == "LSTM"}
    weights = max_difference(unplaced.get_weights(), placed.get_weights())
    if weights > 1e-3 or devices != {"/device:GPU:0", "/device:GPU:1"}:
        raise AssertionError(f"weights differ by {weights:.1e} from unplaced; LSTM calls on {sorted(devices)}")
    return f"weights {weights:.1e}, LSTM calls on {sorted(devices)}"


class GAN(keras.Model):
    """keras.io's GAN, its latent vectors given with the data (so one GPU's numbers can be expected)."""

    def __init__(self):
        super().__init__()

        def mlp(inputs, outputs, name):
            dense = keras.layers.Dense
            return keras.Sequential([keras.Input((inputs,)), dense(16, activation="relu"), dense(outputs)], name=name)

        self.discriminator, self.generator = mlp(8, 1, "discriminator"), mlp(4, 8, "generator")
        self.tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer, self.g_optimizer = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real, latent = data
        rows = keras.ops.shape(real)[0]
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0)
        with tf.GradientTape() as tape:
            images = keras.ops.concatenate([self.generator(latent), real], axis=0)
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(keras.ops.zeros((rows, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.tracker.update_state(g_loss)
        return {"g_loss": self.tracker.result()}


def gan_with_xla_model_calls() -> str:
    """A GAN's own train_step: "auto" compiles its model calls per GPU (`compiled_calls.py`)."""
    real, latent = rng.standard_normal((96, 8)).astype("float32"), rng.standard_normal((96, 4)).astype("float32")
    models = []
    for parallel in (False, True):
        keras.utils.set_random_seed(4)
        gan = GAN()
        model = kerasmulti.parallelize(gan, gpus=2) if parallel else gan
        model.compile()  # jit_compile="auto", Keras' default
        with tf.device("/gpu:0") if not parallel else contextlib.nullcontext():
            model.fit(real, latent, batch_size=32, epochs=2, verbose=0, shuffle=False)
        models.append((gan, model))
    weights = max_difference(models[0][0].get_weights(), models[1][0].get_weights())
    compiled = models[1][1].replica_jit_compile
    if weights > 1e-4 or not compiled:
        raise AssertionError(f"weights differ by {weights:.1e} from one GPU; model calls in XLA: {compiled}")
    return f"weights {weights:.1e}, model calls in XLA: {compiled}"


def pipeline_with_xla_stages() -> str:
    """Two stages on the two GPUs: "auto" compiles each placed layer's call on its GPU."""

    def build():
        keras.utils.set_random_seed(6)
        inputs = keras.Input((12,))
        with kerasmulti.device_scope("/gpu:0"):
            hidden = keras.layers.Dense(32, activation="relu")(inputs)
        with kerasmulti.device_scope("/gpu:1"):
            outputs = keras.layers.Dense(3)(keras.layers.Dense(32, activation="tanh")(hidden))
        return keras.Model(inputs, outputs)

    x, y = rng.standard_normal((96, 12)).astype("float32"), rng.standard_normal((96, 3)).astype("float32")
    reference, template = build(), build()
    reference.compile("adam", "mse")
    reference.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    piped = kerasmulti.pipeline(template, microbatches=4)
    piped.compile("adam", "mse")  # jit_compile="auto": XLA stages where every stage is a GPU
    piped.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    weights = max_difference(reference.get_weights(), template.get_weights())
    if weights > 1e-4 or not piped.replica_jit_compile:
        raise AssertionError(f"weights differ by {weights:.1e}; XLA stages: {piped.replica_jit_compile}")
    return f"weights {weights:.1e}, XLA stages: {piped.replica_jit_compile}"


failed = False
for name, check in [("data parallel, dense", lambda: data_parallel(None)),
                    ("data parallel, BatchNormalization, jit off", lambda: data_parallel("plain", jit_compile=False)),
                    ("data parallel, synchronized BatchNormalization", lambda: data_parallel("synchronized")),
                    ("model parallel, shared LSTM", shared_lstm),
                    ("a GAN's own train_step, XLA model calls", gan_with_xla_model_calls),
                    ("pipeline, XLA stages", pipeline_with_xla_stages)]:
    try:
        print(f"ok {name}: {check()}", flush=True)
    except Exception:
        failed = True
        print(f"FAILED {name}", flush=True)
        traceback.print_exc()
sys.exit(1 if failed else 0)
