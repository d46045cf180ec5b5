"""Pipelining (`kerasmulti.pipeline`) against naive placement, side by side.

A model of two equal stages (each `--layers` Dense layers of `--width` units)
is placed with `device_scope` on two devices and run two ways, built from the
same seed, in one process:

- naive placement: the placed model itself; stage 2 waits for stage 1, and
  stage 1 for stage 2's backward pass, so one device idles at a time;
- pipeline, M micro-batches (M in `--microbatches`, default 1 2 4 8):
  `kerasmulti.pipeline(model, microbatches=M)`, the same stages working on
  different micro-batches at once. The ideal idle share is 1/(M+1) with two
  stages, so predict can reach 2M/(M+1) times naive placement.

Both compile with `jit_compile=False`; one more variant (M in
`--xla-microbatches`, default 2) compiles each placed layer's call as an XLA
program on its stage's device (`jit_compile=True`), and another (M in
`--1f1b-microbatches`, default 8) runs the 1F1B schedule (`schedule="1f1b"`:
at most one micro-batch per stage in flight). Their predictions must agree
before anything is timed. Last, the memory a training step takes above what
was held before it (the allocator's peak on the first stage's device, a
batch of 16 times `--batch-size` rows, median of the repeats), GPipe's
schedule against 1F1B's at the 1F1B variants' M: memory, not a timing.

First the machine is checked: two independent chains of matmuls, one per
device, must run at least 1.8 times as fast as one chain (two cores free).
Otherwise there is nothing to overlap on, and the targets get "no verdict".
Without GPUs the CPU is split into two logical devices with one intra-op
thread each and two inter-op threads (`_common.configure_devices`). On one
GPU split in two the stages share its compute: the figures then show overlap
only, not what two GPUs give.

Targets (the issue's, for an idle 2-core machine): training >= 1.2x naive
placement, predict >= 1.5x, and M=1 >= 0.97x (the pipeline's own cost). The
timed runs are interleaved and the median over repeats is reported; the
script always exits 0.

Usage:
    python benchmarks/bench_pipeline.py [--repeats 5] [--microbatches 1 2 4 8] [--quick]
"""

from __future__ import annotations

# First: _common sets TensorFlow's environment defaults before TensorFlow loads.
from _common import (
    Sizes,
    TrainPredictVariant,
    check,
    configure_devices,
    fmt,
    make_parser,
    median,
    print_environment,
    print_train_predict_table,
    ratio,
    record_failure,
    run_once,
    run_reporting,
    scaled,
    timed_rounds,
)

import argparse
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

SEED = 1234


def build_model(devices: list[str], layers: int, width: int) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((width,))
    hidden = inputs
    for stage, device in enumerate(devices):
        with kerasmulti.device_scope(device):
            for i in range(layers):
                hidden = keras.layers.Dense(width, activation="relu", name=f"stage{stage}_dense{i}")(hidden)
    with kerasmulti.device_scope(devices[-1]):
        outputs = keras.layers.Dense(10, name="head")(hidden)
    return keras.Model(inputs, outputs)


def free_cores(devices: list[str], width: int) -> float:
    """How many chains of matmuls run at once: two (one per device) against one, in seconds' ratio."""
    x = tf.random.normal((256, width))
    w = tf.random.normal((width, width)) / width ** 0.5

    def chain(device):
        with tf.device(device):
            y = x
            for _ in range(40):
                y = tf.tanh(y @ w)
            return tf.reduce_sum(y)

    one = tf.function(lambda: chain(devices[0]))
    two = tf.function(lambda: (chain(devices[0]), chain(devices[1])))

    def best(fn):
        fn()  # traced, untimed
        times = []
        for _ in range(7):
            start = time.perf_counter()
            [float(v) for v in tf.nest.flatten(fn())]
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    return 2 * best(one) / best(two)


def make_variants(devices, microbatches, layers, width, xla, one_f_one_b) -> list[TrainPredictVariant]:
    variants = [TrainPredictVariant("naive placement")]
    try:
        variants[0].model = build_model(devices, layers, width)
        variants[0].model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
    except Exception as error:  # reported in the table, never raised
        record_failure(variants[0], error)
    settings = [(m, False, "gpipe") for m in microbatches] + [(m, True, "gpipe") for m in xla]
    for m, jit_compile, schedule in settings + [(m, False, "1f1b") for m in one_f_one_b]:
        suffix = (", XLA stages" if jit_compile else "") + (", 1F1B" if schedule == "1f1b" else "")
        variant = TrainPredictVariant(f"pipeline, M={m}{suffix}")
        try:
            variant.model = kerasmulti.pipeline(build_model(devices, layers, width), microbatches=m, schedule=schedule)
            variant.model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
        except Exception as error:  # reported in the table, never raised
            record_failure(variant, error)
        variants.append(variant)
    return variants


def check_predictions(variants, x) -> None:
    results = [v.model.predict(x[:256], batch_size=64, verbose=0) for v in variants if not v.error]
    difference = max(float(np.max(np.abs(r - results[0]))) for r in results)
    verdict = "equal (allclose)" if all(np.allclose(r, results[0], rtol=1e-4, atol=1e-5) for r in results) else "DIFFERENT"
    print(f"Predictions of every variant before training: {verdict}, max |difference| {difference:.2e}\n")


def print_checks(variants, cores: float) -> None:
    naive = (median(variants[0].train), median(variants[0].predict))
    by_m = {int(v.name.split("=")[1]): v for v in variants[1:] if "," not in v.name.split("=")[1]}
    for v in variants[1:]:
        if "," in v.name.split("=")[1] and int(v.name.split("=")[1].split(",")[0]) in by_m:
            plain = by_m[int(v.name.split("=")[1].split(",")[0])]
            print(f"{v.name} against the same M, GPipe, uncompiled: training {fmt(ratio(median(v.train), median(plain.train)), '.2f')}x, "
                  f"predict {fmt(ratio(median(v.predict), median(plain.predict)), '.2f')}x")
    best_train = max((median(v.train) or 0 for m, v in by_m.items() if m > 1), default=None)
    best_predict = max((median(v.predict) or 0 for m, v in by_m.items() if m > 1), default=None)
    print(f"\nTwo independent chains ran {cores:.2f}x one chain (two free cores: >= 1.8).")
    if cores < 1.8:
        print("Targets: no verdict (the machine does not give two chains two cores; nothing to overlap on).")
        return
    print("Targets (best M > 1):")
    check("training: pipeline >= 1.2x naive placement", best_train, scaled(naive[0], 1.2), "samples/s")
    check("predict: pipeline >= 1.5x naive placement", best_predict, scaled(naive[1], 1.5), "samples/s")
    if 1 in by_m:
        check("training: M=1 >= 0.97x naive placement", median(by_m[1].train), scaled(naive[0], 0.97), "samples/s")


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    parser = make_parser(__doc__, repeats=5, samples=4096,
                         samples_help="samples per epoch (default 4096)", batch_help="batch size (default 256)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--xla-microbatches", type=int, nargs="*", default=[2],
                        help="M of the variants with XLA stages (jit_compile=True; default 2; none: no such variant)")
    parser.add_argument("--1f1b-microbatches", dest="one_f_one_b", type=int, nargs="*", default=[8],
                        help="M of the variants with the 1F1B schedule (default 8; none: no such variant)")
    parser.add_argument("--layers", type=int, default=4, help="Dense layers per stage (default 4)")
    parser.add_argument("--width", type=int, default=512, help="units per Dense layer (default 512)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat")
    args = parser.parse_args(argv)
    if args.devices != 2:
        parser.error("--devices: the model has two stages; leave it at 2")
    if min(args.microbatches) < 1 or args.layers < 1 or args.width < 1:
        parser.error("--microbatches, --layers and --width must be at least 1")
    if args.quick:
        args.samples, args.batch_size, args.repeats, args.width = 128, 32, 1, 64
    return args, Sizes(args.samples, args.batch_size, args.repeats)


def main(argv=None) -> int:
    args, sizes = parse_args(argv)
    devices = configure_devices(2)  # first: before any tensor exists
    print_environment(devices)
    print(f"Model: 2 stages of {args.layers} Dense({args.width}) each, on {', '.join(devices)}; "
          f"data: {sizes.samples} samples, batch {sizes.batch_size}, {sizes.repeats} repeat(s)")
    cores = free_cores(devices, args.width)
    variants = make_variants(devices, args.microbatches, args.layers, args.width, args.xla_microbatches, args.one_f_one_b)
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((sizes.samples, args.width), dtype=np.float32)
    y = rng.integers(0, 10, size=(sizes.samples,), dtype=np.int32)
    check_predictions(variants, x)
    for variant in variants:  # warm-up: tracing stays untimed
        run_once(variant, x, y, sizes.batch_size, record=False, shuffle=False)
    timed_rounds(variants, sizes.repeats, lambda v: run_once(v, x, y, sizes.batch_size, record=True, shuffle=False))
    print()
    print_train_predict_table(variants, "x naive", 24)
    print_checks(variants, cores)
    print_memory(devices, args, sizes, rng)
    return 0


def print_memory(devices, args, sizes, rng) -> None:
    """A training step's memory above what was held before it: GPipe's schedule against 1F1B's."""
    rows = 16 * sizes.batch_size
    x = rng.standard_normal((rows, args.width), dtype=np.float32)
    y = rng.integers(0, 10, size=(rows,), dtype=np.int32)
    device = tf.DeviceSpec.from_string(devices[0])
    name = f"{device.device_type}:{device.device_index or 0}"
    for m in args.one_f_one_b:
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            model = kerasmulti.pipeline(build_model(devices, args.layers, args.width), microbatches=m, schedule=schedule)
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
            model.train_on_batch(x, y)  # traced
            peaks[schedule] = []
            for _ in range(sizes.repeats):
                held = tf.config.experimental.get_memory_info(name)["current"]
                tf.config.experimental.reset_memory_stats(name)
                model.train_on_batch(x, y)
                peaks[schedule].append((tf.config.experimental.get_memory_info(name)["peak"] - held) / 2**20)
        gpipe, one = median(peaks["gpipe"]), median(peaks["1f1b"])
        print(f"\nMemory of a training step of {rows} rows above what was held (peak on {name}, M={m}, "
              f"median of {sizes.repeats}): GPipe {gpipe:.1f} MB, 1F1B {one:.1f} MB ({fmt(ratio(one, gpipe), '.2f')}x); "
              f"runs: GPipe {[round(p, 1) for p in peaks['gpipe']]}, 1F1B {[round(p, 1) for p in peaks['1f1b']]}")


if __name__ == "__main__":
    run_reporting(main)
