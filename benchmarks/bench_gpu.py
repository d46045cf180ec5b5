"""On GPUs: `parallelize` against one GPU running Keras' default XLA step.

Keras compiles a training step with XLA on a GPU by default, and for a
convolutional network that is worth 1.8x-2.4x. A data-parallel wrapper that
turns XLA off must beat that, not the uncompiled model. This script trains,
in one process and on the same devices, for each model and precision policy:

- bare, jit off: the plain model, `jit_compile=False`, on the first GPU;
- bare, XLA: the plain model with Keras' default (`jit_compile="auto"`);
- parallelize(gpus=1): the one-device wrapper (Keras' default too);
- parallelize(gpus=N), jit off: uncompiled replicas (exact BatchNormalization);
- parallelize(gpus=N), XLA: each replica's step compiled on its device;
- the same with `cpu_merge=False`: gradients summed on the first GPU;
- MirroredStrategy (N), the model rebuilt in its scope.

Models: ResNet50 (`keras.applications`, `weights=None`, 128x128x3, 1000
classes) and a small Transformer encoder (token and position embeddings, 4
blocks of MultiHeadAttention and a feed-forward layer, a classifier on the
mean). It prints fit and predict samples/s (medians of interleaved repeats),
each against bare XLA, and the first epoch's time (build, trace and compile)
against bare XLA's first epoch. With one physical GPU, it is split into N
logical GPUs, which share its compute: then "N GPUs" shows the wrapper's
overhead and placement, and about 0.8x of bare XLA on a split GPU is what
1.6x on N real GPUs looks like. It says so in its output.

Without a GPU it runs on N simulated CPU devices (for a smoke test,
`--quick`); its figures then say nothing about GPUs.

Usage:
    python benchmarks/bench_gpu.py [--devices 2] [--repeats 3] [--samples 2048]
        [--batch-size 256] [--models resnet50,encoder] [--policies float32,mixed_float16] [--quick]
        [--variants bare-xla,xla,xla-gpu-merge]
"""

from __future__ import annotations

# First: _common sets TensorFlow's environment defaults before TensorFlow loads.
from _common import (
    Sizes,
    TrainPredictVariant,
    build_variants,
    check,
    configure_devices,
    fmt,
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

import contextlib
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

SEED = 1234
_STRATEGIES = {}


class Variant(TrainPredictVariant):
    first_epoch_s: float | None = None


def resnet50(size: int, classes: int) -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=classes)


def encoder(length: int, vocabulary: int = 8000, width: int = 256, blocks: int = 4, classes: int = 10) -> keras.Model:
    tokens = keras.Input((length,), dtype="int32")
    positions = keras.ops.arange(length)
    h = keras.layers.Embedding(vocabulary, width)(tokens) + keras.layers.Embedding(length, width)(positions)
    for _ in range(blocks):
        attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=width // 4)(h, h)
        h = keras.layers.LayerNormalization()(h + attended)
        fed = keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + fed)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(classes, activation="softmax", dtype="float32")(pooled)
    return keras.Model(tokens, outputs, name="encoder")


def model_spec(name: str, quick: bool):
    """(builder, data maker) for a model name; smaller inputs with --quick."""
    if name == "resnet50":
        size, classes = (32, 10) if quick else (128, 1000)

        def data(samples, rng):
            x = rng.standard_normal((samples, size, size, 3), dtype=np.float32)
            return x, rng.integers(0, classes, size=(samples,), dtype=np.int32)

        return lambda: resnet50(size, classes), data
    if name == "encoder":
        length = 16 if quick else 128

        def data(samples, rng):
            x = rng.integers(0, 8000, size=(samples, length), dtype=np.int32)
            return x, rng.integers(0, 10, size=(samples,), dtype=np.int32)

        return lambda: encoder(length), data
    raise SystemExit(f"unknown model {name!r}: use resnet50 or encoder")


VARIANT_KEYS = ("bare-jit-off", "bare-xla", "wrapper-1", "jit-off", "xla", "xla-gpu-merge", "mirrored")


def make_variants(build, devices: list[str], n: int, keys: tuple[str, ...] = VARIANT_KEYS) -> list[Variant]:
    """The variants named by `keys` (all by default), in the order above, each
    with its own copy of the model built from one seed."""

    def seeded():
        keras.utils.set_random_seed(SEED)
        return build()

    def compiled(model, **kwargs):
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", **kwargs)
        return model

    def bare(jit):
        return lambda: (compiled(seeded(), jit_compile=jit), lambda: tf.device(devices[0]))

    def wrapper(gpus, jit="auto", cpu_merge=True):
        return lambda: (
            compiled(kerasmulti.parallelize(seeded(), gpus=gpus, cpu_merge=cpu_merge), jit_compile=jit),
            contextlib.nullcontext,
        )

    def mirrored():
        # One strategy for the whole run: a second one in the same process
        # reuses the first one's collective keys, and its all-reduce fails.
        strategy = _STRATEGIES.setdefault(tuple(devices), tf.distribute.MirroredStrategy(devices=devices))
        template = seeded()
        with strategy.scope():
            model = keras.models.clone_model(template)
            model.set_weights(template.get_weights())
            compiled(model, jit_compile=False)
        return model, contextlib.nullcontext

    builders = [
        ("bare, jit off", bare(False)),
        (BARE_XLA, bare("auto" if tf.config.list_physical_devices("GPU") else True)),
        (WRAPPER_1, wrapper(1)),
        (f"parallelize(gpus={n}), jit off", wrapper(n, jit=False)),
        (f"parallelize(gpus={n}), XLA", wrapper(n, jit=True)),
        (f"parallelize(gpus={n}), XLA, cpu_merge=False", wrapper(n, jit=True, cpu_merge=False)),
        (f"MirroredStrategy ({n})", mirrored),
    ]
    chosen = [entry for key, entry in zip(VARIANT_KEYS, builders) if key in keys]
    return build_variants(chosen, Variant)


BARE_XLA, WRAPPER_1 = "bare, XLA (Keras' default)", "parallelize(gpus=1)"


def parse_variants(text: str) -> tuple[str, ...]:
    """`--variants`: comma-separated keys, bare XLA always among them (the ratios' base)."""
    keys = tuple(key.strip() for key in text.split(",") if key.strip())
    unknown = [key for key in keys if key not in VARIANT_KEYS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANT_KEYS)}. "
                         f"Received: variants={text!r}")
    return tuple(dict.fromkeys(("bare-xla",) + keys))


def first_epochs(variants: list[Variant], x, y, batch_size: int) -> None:
    """The untimed warm-up, timed: build, trace and XLA compilation included."""
    for variant in variants:
        start = time.perf_counter()
        run_once(variant, x, y, batch_size, record=False)
        if not variant.error:
            variant.first_epoch_s = time.perf_counter() - start


def named(variants: list[Variant], name: str) -> Variant | None:
    return next((v for v in variants if v.name == name), None)


def print_first_epochs(variants: list[Variant]) -> None:
    base = named(variants, BARE_XLA).first_epoch_s
    print("\nFirst epoch and first predict (build, trace, compile), seconds, x bare XLA:")
    for v in variants:
        if v.first_epoch_s is None:
            print(f"  {v.name:<44} failed")
            continue
        times = f"{v.first_epoch_s / base:.2f}x" if base else "-"
        print(f"  {v.name:<44} {v.first_epoch_s:7.1f} s  {times}")


def print_checks(variants: list[Variant], policy: str, n: int) -> None:
    xla, one = named(variants, BARE_XLA), named(variants, WRAPPER_1)
    compiled = named(variants, f"parallelize(gpus={n}), XLA")
    bar = 0.8 if policy == "mixed_float16" else 0.85
    if one is None and compiled is None:
        return  # --variants left out every variant a target speaks of
    print("\nTargets (those whose variants ran):")
    unit = "samples/s"
    if one is not None:
        check("parallelize(gpus=1) fit >= 0.97x bare XLA", median(one.train), scaled(median(xla.train), 0.97), unit)
        check("parallelize(gpus=1) predict >= 0.97x bare XLA", median(one.predict), scaled(median(xla.predict), 0.97), unit)
    if compiled is None:
        return
    check(f"parallelize(gpus={n}) XLA fit >= {bar}x bare XLA", median(compiled.train), scaled(median(xla.train), bar), unit)
    first, bound = compiled.first_epoch_s, scaled(xla.first_epoch_s, 1.5)
    verdict = "not met (a variant failed)" if first is None or bound is None else "met" if first <= bound else "not met"
    print(f"  parallelize(gpus={n}) XLA first epoch <= 1.5x bare XLA's: {verdict} "
          f"({fmt(first, '.1f')} vs {fmt(bound, '.1f')} s)")


def run_one(name: str, policy: str, devices: list[str], n: int, sizes: Sizes, quick: bool,
            keys: tuple[str, ...] = VARIANT_KEYS) -> None:
    keras.mixed_precision.set_global_policy(policy)
    build, data = model_spec(name, quick)
    print(f"\n=== {name}, {policy}: {sizes.samples} samples, batch {sizes.batch_size}, "
          f"{sizes.repeats} repeat(s) ===", flush=True)
    x, y = data(sizes.samples, np.random.default_rng(SEED))
    variants = make_variants(build, devices, n, keys)
    # The one-device variants read the batch on the first GPU, the others as fit does.
    first_epochs(variants, x, y, sizes.batch_size)
    timed_rounds(variants, sizes.repeats, lambda v: run_once(v, x, y, sizes.batch_size, record=True))
    print()
    print_train_predict_table(variants, "x bare", 46)
    # The ratios the targets speak of are against bare XLA.
    base = named(variants, BARE_XLA)
    base_train, base_predict = median(base.train), median(base.predict)
    print("\nAgainst bare XLA (train | predict):")
    for v in variants:
        t, p = median(v.train), median(v.predict)
        ratios = f"{t / base_train:.2f} | {p / base_predict:.2f}" if t and p and base_train and base_predict else "-"
        print(f"  {v.name:<44} {ratios}")
    print_first_epochs(variants)
    print_checks(variants, policy, n)
    keras.mixed_precision.set_global_policy("float32")


def main(argv=None) -> int:
    parser = make_parser(__doc__, repeats=3, samples=2048, samples_help="samples per epoch",
                         batch_help="global batch size")
    parser.add_argument("--models", default="resnet50,encoder", help="comma-separated: resnet50, encoder")
    parser.add_argument("--policies", default="float32,mixed_float16", help="comma-separated Keras dtype policies")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat, small inputs")
    parser.add_argument("--variants", default=",".join(VARIANT_KEYS),
                        help=f"comma-separated, a subset of: {', '.join(VARIANT_KEYS)} (bare-xla always runs)")
    args = parser.parse_args(argv)
    keys = parse_variants(args.variants)
    if args.quick:
        args.samples, args.batch_size, args.repeats = 64, 32, 1
    batch = max(args.devices, args.batch_size - args.batch_size % args.devices)
    sizes = Sizes(max(batch, args.samples - args.samples % batch), batch, args.repeats)
    devices = configure_devices(args.devices)  # first: before any tensor exists
    print_environment(devices)
    warn_missing_devices(devices, args.devices, "multi-GPU")
    for name in args.models.split(","):
        for policy in args.policies.split(","):
            run_one(name.strip(), policy.strip(), devices, args.devices, sizes, args.quick, keys)
    return 0


if __name__ == "__main__":
    run_reporting(main)
