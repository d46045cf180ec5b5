"""Throughput of model parallelism (`kerasmulti.device_scope`) against one device.

Measures samples/s of `fit` (one epoch) and `predict` for a model with N
independent, equally heavy branches (N = `--devices`, default 2): each branch
is a small CNN (three Conv2D, 32/64/64 filters) on its own 32x32x3 image input,
and a softmax head on their concatenated features. The model is built twice
from the same seed, in one process and on the same devices:

- one device: no placement; fit and predict run under `tf.device(<first device>)`;
- N devices (device_scope): branch i is built under
  `kerasmulti.device_scope(<device i>)`; the head is unplaced (default device).

The weights of the first are copied into the second, and their predictions
must agree (allclose) before anything is timed; after the warm-up epoch (same
data, unshuffled) their weights are compared again. The script also prints the
devices that the convolutions of one traced training step ask for, forward
and backward (`OnDevice` takes each branch's gradients on its device).

Both variants are compiled with `jit_compile=False`: a placed model runs
without XLA (XLA would compile the step for one device), so this compares
placement alone. With GPUs Keras would give the one-device model XLA by
default, so there a third row, "one device (XLA)", shows what that gives.

Caveat, as for `bench_data_parallel.py` (see README.md): without GPUs the CPU
is split into N logical devices (`simulate_devices`) with one intra-op thread
each and N inter-op threads. The one-device model is not held to one core,
though: its branches are independent ops, and TensorFlow's executor overlaps
them on the N inter-op threads whatever device they are on (logical CPU
devices share one thread pool). So on CPU the one-device model already runs
its branches side by side, and this benchmark shows only the cost (or not) of
splitting the step across devices. On GPUs the script uses the first N GPUs
(with fewer, the first split in N logical GPUs, which share its compute) and
leaves TensorFlow's threading alone. A GPU runs one device's kernels in one
stream, so there the branches can overlap only when placed apart; on one H100
split in two they did not gain (see benchmarks/README.md), with the GPU far
from busy.

Each variant is warmed up first (one epoch and one predict), so tracing is not
timed. The timed runs are interleaved: every repeat runs each variant once in
turn, the starting variant rotating, so a burst of load from other processes
slows both alike; the median over repeats is reported. The script prints
whether the targets are met (N-branch model on N devices >= 1.3x one device,
for training and for predict) but always exits 0: a benchmark reports, it
does not fail.

Usage:
    python benchmarks/bench_model_parallel.py [--devices 2] [--repeats 5] [--quick]
"""

from __future__ import annotations

# First: _common sets TensorFlow's environment defaults before TensorFlow loads.
from _common import (
    Sizes,
    TrainPredictVariant,
    check,
    configure_devices,
    error_summary,
    make_parser,
    median,
    print_environment,
    print_train_predict_table,
    record_failure,
    run_once,
    run_reporting,
    scaled,
    timed_rounds,
    warn_missing_devices,
)

import argparse
import contextlib
from collections import Counter

# Importing these does not initialise TensorFlow's devices; creating a tensor does.
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

SEED = 1234
INPUT_SHAPE = (32, 32, 3)
CLASSES = 10
BRANCH_LETTERS = "abcdefghijklmnopqrstuvwxyz"
CONVOLUTIONS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")


Variant = TrainPredictVariant


# --------------------------------------------------------------------- model


def branch(x, prefix: str):
    """One branch: as heavy as the whole CNN of bench_data_parallel.py."""
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name=f"{prefix}_conv1")(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name=f"{prefix}_conv2")(x)
    x = keras.layers.MaxPooling2D(name=f"{prefix}_pool")(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name=f"{prefix}_conv3")(x)
    return keras.layers.GlobalAveragePooling2D(name=f"{prefix}_features")(x)


def build_model(branches: int, devices: list[str] | None, jit_compile: bool = False) -> keras.Model:
    """N branches, each under `device_scope(devices[i])` if devices are given.

    Same seed and layer names for every variant, so both start from identical
    weights (they are copied anyway) and layers can be matched by name.
    """
    keras.utils.set_random_seed(SEED)
    inputs, features = [], []
    for i in range(branches):
        prefix = BRANCH_LETTERS[i]
        image = keras.Input(INPUT_SHAPE, name=f"image_{prefix}")
        placement = kerasmulti.device_scope(devices[i]) if devices else contextlib.nullcontext()
        with placement:
            features.append(branch(image, prefix))
        inputs.append(image)
    merged = keras.layers.Concatenate(name="concat")(features)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="head")(merged)
    model = keras.Model(inputs, outputs, name="placed" if devices else "one_device")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
    return model


def _inner(layer):
    """The layer an `OnDevice` wrapper runs; any other layer itself."""
    return layer.layer if isinstance(layer, kerasmulti.OnDevice) else layer


def _weights_by_layer(model: keras.Model) -> dict[str, list[np.ndarray]]:
    return {_inner(layer).name: _inner(layer).get_weights() for layer in model.layers if layer.weights}


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Copies weights layer by layer, matched by the (wrapped) layer's name."""
    weights = _weights_by_layer(source)
    for layer in target.layers:
        if layer.weights:
            _inner(layer).set_weights(weights[_inner(layer).name])


def max_weight_difference(a: keras.Model, b: keras.Model) -> float:
    wa, wb = _weights_by_layer(a), _weights_by_layer(b)
    if wa.keys() != wb.keys():
        raise ValueError(f"the models' layers differ: {sorted(wa)} vs {sorted(wb)}")
    return max(
        float(np.max(np.abs(x - y)))
        for name in wa
        for x, y in zip(wa[name], wb[name], strict=True)
    )


def step_placement(model: keras.Model, branches: int) -> str:
    """The devices that one traced training step's convolutions ask for.

    Traces (without running) a GradientTape step like Keras' own train step
    and counts its convolution ops by requested device; "none" means the op
    runs on the default device.
    """
    spec = [tf.TensorSpec((2, *INPUT_SHAPE), tf.float32) for _ in range(branches)]

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(labels, model(images, training=True))
        return tape.gradient(loss, model.trainable_weights)

    graph = step.get_concrete_function(spec, tf.TensorSpec((2,), tf.int32)).graph
    counts = {"forward": Counter(), "backward": Counter()}
    for op in graph.get_operations():
        if op.type in CONVOLUTIONS:
            device = op.device.replace("/device:", "") or "none"
            counts["forward" if op.type == "Conv2D" else "backward"][device] += 1
    return "; ".join(
        f"{phase} " + ", ".join(f"{d} x{c}" for d, c in sorted(per_device.items()))
        for phase, per_device in counts.items()
    )


def make_data(samples: int, branches: int):
    rng = np.random.default_rng(SEED)
    x = [rng.standard_normal((samples, *INPUT_SHAPE), dtype=np.float32) for _ in range(branches)]
    y = rng.integers(0, CLASSES, size=(samples,), dtype=np.int32)
    return x, y


# ----------------------------------------------------------------- variants


def make_variants(devices: list[str], n: int) -> list[Variant]:
    """Builds both variants; a variant whose setup fails is kept, with its error."""
    variants = [Variant("one device"), Variant(f"{n} devices (device_scope)")]
    one, placed = variants
    try:
        one.model = build_model(n, None)
        one.scope = lambda: tf.device(devices[0])
    except Exception as error:  # reported in the table, never raised
        record_failure(one, error)
    try:
        placed.model = build_model(n, devices[:n])
        if one.model is not None:
            copy_weights(one.model, placed.model)
    except Exception as error:  # reported in the table, never raised
        record_failure(placed, error)
    if tf.config.list_physical_devices("GPU"):
        xla = Variant("one device (XLA)")
        try:
            xla.model = build_model(n, None, jit_compile=True)
            copy_weights(one.model, xla.model)
            xla.scope = one.scope
        except Exception as error:  # reported in the table, never raised
            record_failure(xla, error)
        variants.append(xla)
    return variants


def describe_placement(variants: list[Variant], n: int) -> None:
    placed = variants[1]
    if placed.error:
        return
    placements = Counter(
        getattr(layer, "device", "(default)").replace("/device:", "")
        for layer in placed.model.layers
        if layer.weights
    )
    print("Placed model, layers with weights by device: "
          + ", ".join(f"{d} x{c}" for d, c in sorted(placements.items())))
    try:
        print(f"Training step, convolution ops by requested device: {step_placement(placed.model, n)}")
    except Exception as error:  # informative only
        print(f"Training step placement: unknown ({error_summary(error)})")


def check_predictions(variants: list[Variant], x) -> None:
    """Both variants must predict the same before anything is timed."""
    if any(v.error for v in variants):
        return
    sample = [part[:256] for part in x]
    results = []
    for variant in variants:
        try:
            with variant.scope():
                results.append(variant.model.predict(sample, batch_size=64, verbose=0))
        except Exception as error:  # reported in the table, never raised
            record_failure(variant, error)
            return
    difference = float(np.max(np.abs(results[0] - results[1])))
    same = np.allclose(results[0], results[1], rtol=1e-4, atol=1e-5)
    verdict = "equal (allclose)" if same else "DIFFERENT"
    print(f"Predictions of the two models before training: {verdict}, "
          f"max |difference| {difference:.2e}")


def check_weights_after_warmup(variants: list[Variant]) -> None:
    if any(v.error for v in variants):
        return
    difference = max_weight_difference(variants[0].model, variants[1].model)
    verdict = "equal (allclose)" if difference <= 1e-4 else "DIFFERENT"
    print(f"Weights after the warm-up epoch (same batches): {verdict}, "
          f"max |difference| {difference:.2e}")


# -------------------------------------------------------------------- timing


def benchmark(variants: list[Variant], sizes: Sizes, n: int) -> None:
    x, y = make_data(sizes.samples, n)
    check_predictions(variants, x)
    # Warm-up: tracing and the first-call setup of each variant stay untimed.
    for variant in variants:
        # Unshuffled, so both variants see the same batches and stay comparable.
        run_once(variant, x, y, sizes.batch_size, record=False, shuffle=False)
    check_weights_after_warmup(variants)
    print()
    # Timed: interleaved repeats (see timed_rounds); the table shows their median.
    timed_rounds(variants, sizes.repeats, lambda v: run_once(v, x, y, sizes.batch_size, record=True, shuffle=False))


# ------------------------------------------------------------------- report


def print_table(variants: list[Variant]) -> None:
    print_train_predict_table(variants, "x one", 28)


def print_checks(variants: list[Variant], n: int) -> None:
    one, placed = ((median(v.train), median(v.predict)) for v in variants[:2])
    print("\nTargets:")
    unit = "samples/s"
    label = f"{n}-branch model on {n} devices >= 1.3x one device"
    check(f"training: {label}", placed[0], scaled(one[0], 1.3), unit)
    check(f"predict: {label}", placed[1], scaled(one[1], 1.3), unit)


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    parser = make_parser(__doc__, repeats=5, samples=2048,
                         samples_help="samples per epoch (default 2048)",
                         batch_help="batch size (default 256)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.devices > len(BRANCH_LETTERS):
        parser.error(f"--devices must be 2 to {len(BRANCH_LETTERS)} (one branch per device)")
    if args.repeats < 1 or args.samples < 1 or args.batch_size < 1:
        parser.error("--repeats, --samples and --batch-size must be at least 1")
    if args.quick:
        args.samples, args.batch_size, args.repeats = 64, 32, 1
    return args, Sizes(args.samples, args.batch_size, args.repeats)


def print_setup(devices: list[str], n: int, sizes: Sizes) -> None:
    print_environment(devices)
    print(f"Model: {n} branches of 3 Conv2D (32/64/64 filters), each on its own "
          f"{INPUT_SHAPE} input, softmax head on the concatenated features")
    print(f"Data: {sizes.samples} samples, batch {sizes.batch_size}, "
          f"{sizes.repeats} repeat(s)\n")
    warn_missing_devices(devices, n, "placed")


def main(argv=None) -> int:
    args, sizes = parse_args(argv)
    devices = configure_devices(args.devices)  # first: before any tensor exists
    print_setup(devices, args.devices, sizes)
    variants = make_variants(devices, args.devices)
    describe_placement(variants, args.devices)
    benchmark(variants, sizes, args.devices)
    print()
    print_table(variants)
    print_checks(variants, args.devices)
    return 0


if __name__ == "__main__":
    run_reporting(main)
