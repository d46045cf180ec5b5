"""A GAN's own `train_step`, data-parallel with and without XLA, side by side.

keras.io's DCGAN (a convolutional generator and discriminator, two
optimizers, its latent vectors drawn in the step), shrunk to 28x28 images,
trained four ways in one process, each built from the same seed:

- one device, uncompiled (`jit_compile=False`);
- one device with XLA (Keras compiles the whole step: its default on a GPU);
- `parallelize`, uncompiled replicas;
- `parallelize` with `jit_compile=True`: each replica's model calls run as XLA
  programs on its device (`compiled_calls.py`), the glue between them as before.

Without GPUs the CPU is split into logical devices with one intra-op thread
each (`_common.configure_devices`); the one-device variants run on the first.
The timed epochs are interleaved and the median over repeats is reported, as
samples per second and as ratios to one device with XLA, beside the time of
each variant's first two steps (tracing and compiling included). The script always
exits 0.

Usage:
    python benchmarks/bench_custom_steps.py [--devices 2] [--repeats 3] [--quick]
"""

from __future__ import annotations

from _common import (
    Sizes,
    TrainPredictVariant,
    configure_devices,
    fmt,
    make_parser,
    median,
    print_environment,
    ratio,
    record_failure,
    run_reporting,
    timed_rounds,
)

import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

LATENT = 32


class GAN(keras.Model):
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.seed = keras.random.SeedGenerator(1)
        self.d_loss_tracker, self.g_loss_tracker = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        rows = keras.ops.shape(real)[0]
        fake = self.generator(keras.random.normal((rows, LATENT), seed=self.seed))
        images = keras.ops.concatenate([fake, real], axis=0)
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            fooled = self.discriminator(self.generator(keras.random.normal((rows, LATENT), seed=self.seed)))
            g_loss = self.loss_fn(keras.ops.zeros((rows, 1)), fooled)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def build_gan(seed: int = 0) -> GAN:
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    discriminator = keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(32, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.Conv2D(64, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.GlobalMaxPooling2D(), layers.Dense(1),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input((LATENT,)), layers.Dense(7 * 7 * 64), layers.LeakyReLU(0.2), layers.Reshape((7, 7, 64)),
        layers.Conv2DTranspose(64, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.Conv2DTranspose(32, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.Conv2D(1, 5, padding="same", activation="sigmoid"),
    ], name="generator")
    return GAN(discriminator, generator)


def make_variants(devices: list[str]) -> list[TrainPredictVariant]:
    ways = [
        ("one device, XLA", None, True),
        ("one device, uncompiled", None, False),
        (f"parallelize({len(devices)}), uncompiled replicas", devices, False),
        (f"parallelize({len(devices)}), XLA model calls", devices, True),
    ]
    variants = []
    for name, on, jit_compile in ways:
        variant = TrainPredictVariant(name)
        try:
            gan = build_gan()
            model = gan if on is None else kerasmulti.parallelize(gan, devices=on)
            # The one-device GAN passes jit_compile on to Keras' compile; the parallel one keeps it.
            model.compile(keras.optimizers.Adam(1e-4), keras.optimizers.Adam(1e-4),
                          keras.losses.BinaryCrossentropy(from_logits=True), jit_compile=jit_compile)
            variant.model = model
        except Exception as error:  # reported in the table, never raised
            record_failure(variant, error)
        variants.append(variant)
    return variants


def time_epoch(variant, images, batch_size: int, record: bool) -> None:
    if variant.error:
        return
    try:
        placement = _placement(variant)
        with placement:
            start = time.perf_counter()
            history = variant.model.fit(images, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
            float(history.history["d_loss"][-1])
            elapsed = time.perf_counter() - start
    except Exception as error:  # reported in the table, never raised
        record_failure(variant, error)
        return
    if record:
        variant.train.append(len(images) / elapsed)


def _placement(variant):
    """The one-device variants run on the first replica device (one intra-op thread, as each replica)."""
    if isinstance(variant.model, kerasmulti.ParallelModel):
        return tf.device(None)
    return tf.device(_DEVICES[0])


_DEVICES: list[str] = []


def main(argv=None) -> None:
    parser = make_parser(__doc__, repeats=3, samples=1024, samples_help="images per epoch (default 1024)",
                         batch_help="batch size (default 64)")
    parser.add_argument("--quick", action="store_true", help="a short run: 256 images, 1 repeat")
    parser.set_defaults(batch_size=64)
    args = parser.parse_args(argv)
    sizes = Sizes(256, args.batch_size, 1) if args.quick else Sizes(args.samples, args.batch_size, args.repeats)
    _DEVICES[:] = configure_devices(args.devices)
    print_environment(_DEVICES)
    images = np.random.default_rng(0).uniform(size=(sizes.samples, 28, 28, 1)).astype("float32")
    variants = make_variants(_DEVICES)
    first = {}
    for variant in variants:  # trace and compile before timing
        started = time.perf_counter()
        time_epoch(variant, images[: 2 * sizes.batch_size], sizes.batch_size, record=False)
        first[variant.name] = time.perf_counter() - started
    timed_rounds(variants, sizes.repeats, lambda v: time_epoch(v, images, sizes.batch_size, record=True))
    base, plain = median(variants[0].train), median(variants[1].train)
    print(f"\n{'variant':<44}{'train/s':>10}{'vs XLA':>8}{'vs uncompiled':>15}{'first 2 steps':>15}")
    for v in variants:
        value = median(v.train)
        print(f"{v.name:<44}{fmt(value, '.0f'):>10}{fmt(ratio(value, base), '.2f'):>8}{fmt(ratio(value, plain), '.2f'):>15}"
              f"{first[v.name]:>14.2f}s" + (f"  ({v.error})" if v.error else ""))


if __name__ == "__main__":
    run_reporting(main)
