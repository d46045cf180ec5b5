"""Throughput of `kerasmulti.parallelize` against one device and MirroredStrategy.

Measures samples/s of `fit` (one epoch) and `predict` for one small CNN in four
variants (five with GPUs), all in one process and on the same devices:

- bare: the plain Keras model on the first device;
- parallelize(gpus=1): the one-device pass-through wrapper, whose overhead
  should be negligible;
- parallelize(gpus=N): the data-parallel wrapper over N devices;
- MirroredStrategy: `tf.distribute.MirroredStrategy` over the same N devices,
  the reference a user would otherwise reach for;
- with GPUs, parallelize(gpus=N, cpu_merge=False): outputs merged and
  gradients summed on the first GPU instead of the CPU.

Without GPUs the CPU is split into N logical devices (`simulate_devices`) with
one intra-op thread each and N inter-op threads, so N replicas can keep N
cores busy: the speed-up shows whether the replicas really run concurrently.
The bare model is not held to one core, though: its independent ops (the two
gradients of a convolution, the input pipeline) overlap on the N inter-op
threads, so its training already uses more than one core. On GPUs the script
uses the first N GPUs (with fewer, the first split in N logical GPUs, which
share its compute) and leaves TensorFlow's threading alone.

Each variant is warmed up first (one epoch and one predict), so tracing is not
timed. The timed runs are interleaved: every repeat runs each variant once in
turn, so a burst of load from other processes slows all variants alike instead
of skewing one of them; the median over repeats is reported. The script prints
whether the targets are met but always exits 0: a benchmark reports, it does
not fail.

Last, "plain arrays": the bare model and parallelize(gpus=N) trained with
`fit(x, y)` on numpy arrays, as users call it, interleaved: Keras' own array
pipeline for the bare model, the parallel model's steady one for it.

Usage:
    python benchmarks/bench_data_parallel.py [--devices 2] [--repeats 3] [--quick]
"""

from __future__ import annotations

# First: _common sets TensorFlow's environment defaults before TensorFlow loads.
from _common import (
    Sizes,
    TrainPredictVariant,
    build_variants,
    check,
    configure_devices,
    make_parser,
    median,
    print_environment,
    print_train_predict_table,
    run_once,
    run_reporting,
    scaled,
    timed_rounds,
    warn_missing_devices,
)

import argparse
import contextlib
import time

# Importing these does not initialise TensorFlow's devices; creating a tensor does.
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

SEED = 1234
INPUT_SHAPE = (32, 32, 3)
CLASSES = 10


Variant = TrainPredictVariant


def build_model() -> keras.Model:
    # Same seed for every variant, so all start from identical weights.
    keras.utils.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input(INPUT_SHAPE),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ],
        name="cnn",
    )


def compile_model(model):
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def make_data(samples: int):
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((samples, *INPUT_SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(samples,), dtype=np.int32)
    return x, y


def make_variants(devices: list[str], n: int) -> list[Variant]:
    """Builds every variant; a variant whose setup fails is kept, with its error."""

    def bare():
        return compile_model(build_model()), lambda: tf.device(devices[0])

    def wrapper(gpus, cpu_merge=True):
        # Each wrapper gets its own template: wrappers train the template they
        # share weights with, and the variants must not train each other's.
        return lambda: (
            compile_model(kerasmulti.parallelize(build_model(), gpus=gpus, cpu_merge=cpu_merge)),
            contextlib.nullcontext,
        )

    def mirrored():
        if len(devices) < n:
            raise kerasmulti.DeviceError(f"{n} devices asked, {len(devices)} available")
        template = build_model()
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        # MirroredStrategy cannot adopt a model built outside its scope (its
        # fit fails with a bare AssertionError): clone it inside, copy the weights.
        with strategy.scope():
            model = keras.models.clone_model(template)
            model.set_weights(template.get_weights())
            compile_model(model)
        return model, contextlib.nullcontext

    builders = [
        ("bare (1 device)", bare),
        ("parallelize(gpus=1)", wrapper(1)),
        (f"parallelize(gpus={n})", wrapper(n)),
        (f"MirroredStrategy ({n})", mirrored),
    ]
    if tf.config.list_physical_devices("GPU"):
        builders.append((f"parallelize(gpus={n}, cpu_merge=False)", wrapper(n, cpu_merge=False)))
    return build_variants(builders)


def benchmark(variants: list[Variant], sizes: Sizes) -> None:
    x, y = make_data(sizes.samples)
    # Warm-up: tracing and the first-call setup of each variant stay untimed.
    for variant in variants:
        run_once(variant, x, y, sizes.batch_size, record=False)
    # Timed: interleaved repeats (see timed_rounds); the tables show their median.
    timed_rounds(variants, sizes.repeats, lambda v: run_once(v, x, y, sizes.batch_size, record=True))


def time_fit_on_arrays(variant: Variant, x, y, batch_size: int) -> float:
    """One epoch of `fit(x, y)` on numpy arrays, as users call it."""
    with variant.scope():
        start = time.perf_counter()
        history = variant.model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
        float(history.history["loss"][-1])
        return len(x) / (time.perf_counter() - start)


def benchmark_arrays(variants: list[Variant], sizes: Sizes, n: int) -> None:
    """Bare against parallelize(gpus=N), both fed numpy arrays directly.

    Keras' autotuned array pipeline stalls at random epoch ends (see
    `kerasmulti._src.data_parallel.feeding`); a parallel model feeds arrays without autotuning.
    The bare model gets Keras' own pipeline: this is what users see.
    """
    pair = [variants[0], variants[2]]
    if any(v.error for v in pair):
        print("\nPlain arrays: skipped (a variant failed)")
        return
    x, y = make_data(sizes.samples)
    speeds = {v.name: [] for v in pair}
    for v in pair:  # warm-up: Keras' array pipeline traces its own step once
        time_fit_on_arrays(v, x, y, sizes.batch_size)
    timed_rounds(pair, sizes.repeats, lambda v: speeds[v.name].append(time_fit_on_arrays(v, x, y, sizes.batch_size)))
    bare, many = speeds[pair[0].name], speeds[pair[1].name]
    ratios = [m / b for m, b in zip(many, bare)]
    print(f"\nPlain arrays, fit(x, y), samples/s: bare {median(bare):.0f}, "
          f"parallelize(gpus={n}) {median(many):.0f}, {median(many) / median(bare):.2f}x")
    print("  per repeat, x bare: " + " ".join(f"{r:.2f}" for r in ratios))
    check(f"{n}-device fit on arrays >= 1.25x bare", median(many), scaled(median(bare), 1.25), "samples/s")
    print(f"  every repeat >= 1.1x: {'met' if min(ratios) >= 1.1 else 'not met'} (lowest {min(ratios):.2f}x)")


def print_table(variants: list[Variant]) -> None:
    print_train_predict_table(variants, "x bare", 24)


def print_checks(variants: list[Variant], n: int) -> None:
    bare, one, many, mirrored = ((median(v.train), median(v.predict)) for v in variants[:4])
    print("\nTargets:")
    unit = "samples/s"
    check(f"{n}-device train >= 1.3x bare", many[0], scaled(bare[0], 1.3), unit)
    check(f"{n}-device train >= MirroredStrategy", many[0], mirrored[0], unit)
    check(f"{n}-device predict >= 1.5x bare", many[1], scaled(bare[1], 1.5), unit)
    check("1-device wrapper train >= 0.97x bare", one[0], scaled(bare[0], 0.97), unit)
    check("1-device wrapper predict >= 0.97x bare", one[1], scaled(bare[1], 0.97), unit)


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    parser = make_parser(__doc__, repeats=3, samples=2048,
                         samples_help="samples per epoch", batch_help="global batch size")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.repeats < 1:
        parser.error("--devices and --repeats must be at least 1")
    if args.quick:
        args.samples, args.batch_size, args.repeats = 64, 32, 1
    # MirroredStrategy.fit crashes when the first global batch does not split
    # evenly across replicas (TensorFlow 2.21); keep every batch a whole multiple.
    batch = max(args.devices, args.batch_size - args.batch_size % args.devices)
    samples = max(batch, args.samples - args.samples % batch)
    return args, Sizes(samples, batch, args.repeats)


def print_setup(devices: list[str], n: int, sizes: Sizes) -> None:
    print_environment(devices)
    print(f"Data: {sizes.samples} samples of {INPUT_SHAPE}, batch {sizes.batch_size}, "
          f"{sizes.repeats} repeat(s)\n")
    warn_missing_devices(devices, n, "multi-device")


def main(argv=None) -> int:
    args, sizes = parse_args(argv)
    devices = configure_devices(args.devices)  # first: before any tensor exists
    print_setup(devices, args.devices, sizes)
    variants = make_variants(devices, args.devices)
    benchmark(variants, sizes)
    print()
    print_table(variants)
    print_checks(variants, args.devices)
    benchmark_arrays(variants, sizes, args.devices)
    return 0

if __name__ == "__main__":
    run_reporting(main)
