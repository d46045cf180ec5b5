"""Balancing replicas of unequal speed: `split="auto"` against `split="even"`.

Synchronous data parallelism runs at the pace of the slowest replica. Here one
of two simulated devices runs at half speed, by a load this script controls:
a layer that, besides the model's real work (a dense network), holds each
replica for `--ms-per-row` milliseconds per row of its sub-batch, twice as
long on the slowed device (a sleep, so the load is exact and takes no core
from the real work). With `split="even"` the fast device waits half of every
step; `split="auto"` measures both devices' speeds over its first steps and
then gives the fast one twice the rows. Ideal gain: 1.5x. The same again for a
model with its own `train_step` (Keras' guide's), whose replicas meet at its
`optimizer.apply` and metric updates, where the fast one waits for the slow one.

All variants run in one process, built from the same seed, their timed fit
epochs interleaved (`_common.timed_rounds`); each is warmed up first with one
epoch, long enough for "auto" to settle its proportions. Reported: samples/s
(median), the ratio auto/even, and what `ThroughputMonitor` saw in each:
per-device samples/s, their ratio against the imposed 0.5, and the imbalance
(slowest replica's busy time over the fastest's).

Last, the monitor's overhead: the data-parallel benchmark's CNN
(`bench_data_parallel.py`), even split, trained with and without a monitor,
interleaved; the target is at most 2 %.

Usage:
    python benchmarks/bench_balance.py [--repeats 5] [--quick]
"""

from __future__ import annotations

from _common import check, make_parser, median, print_environment, run_reporting, timed_rounds

import os
import sys
import time

import kerasmulti  # noqa: E402

DEVICES = 2
SLOW_DEVICE = f"CPU:{DEVICES - 1}"
# The load blocks a thread of TensorFlow's inter-op pool while it holds a
# replica, so the pool gets room for the real work beside it.
kerasmulti.simulate_devices(DEVICES)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# The load the tests slow devices with, also across workers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "workers"))
from custom_models import GuideCompiledLoss  # noqa: E402  (Keras' guide's first train_step)
from slow_device import SlowDevice  # noqa: E402

# One intra-op thread per op, as the other CPU benchmarks (`_common.configure_devices`).
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2 * DEVICES + 2)

SEED = 1234
FEATURES = 64


def build_model(ms_per_row: float, factor: float, own_step: bool = False) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(256, activation="relu")(inputs)
    h = SlowDevice(ms_per_row, (SLOW_DEVICE,), factor)(h)
    h = keras.layers.Dense(256, activation="relu")(h)
    return (GuideCompiledLoss if own_step else keras.Model)(inputs, keras.layers.Dense(10, activation="softmax")(h))


class Variant:
    def __init__(self, name, model):
        self.name, self.model = name, model
        self.monitor = kerasmulti.ThroughputMonitor(verbose=0)
        self.rates: list[float] = []


def fit_epoch(variant, data, record: bool, monitor: bool = True) -> None:
    start = time.perf_counter()
    history = variant.model.fit(data.batches, epochs=1, verbose=0, callbacks=[variant.monitor] if monitor else [])
    float(history.history["loss"][-1])
    rate = data.rows / (time.perf_counter() - start)
    if record:
        variant.rates.append(rate)


class Data:
    """Batches of random rows as a tf.data pipeline (no autotuning: see _common.dataset)."""

    def __init__(self, samples: int, batch_size: int, shape=(FEATURES,), classes=10):
        rng = np.random.default_rng(SEED)
        x = rng.standard_normal((samples, *shape), dtype=np.float32)
        y = rng.integers(0, classes, size=(samples,), dtype=np.int32)
        from _common import dataset

        self.rows = samples
        self.batches = dataset(x, y, batch_size)



def balance(args, own_step: bool) -> None:
    print("A model with its own train_step:" if own_step else "Keras' train_step:")
    data = Data(args.samples, args.batch_size)
    variants = []
    for split in ("even", "auto"):
        model = kerasmulti.parallelize(build_model(args.ms_per_row, 2.0, own_step), gpus=DEVICES, split=split)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        variants.append(Variant(f'split="{split}"', model))
    for variant in variants:  # warm-up: traces, and lets "auto" settle
        fit_epoch(variant, data, record=False)
    while not variants[1].model._auto_split.settled:
        fit_epoch(variants[1], data, record=False)
    print(f"  auto settled on proportions {[round(p, 3) for p in variants[1].model.split]}")
    timed_rounds(variants, args.repeats, lambda v: fit_epoch(v, data, record=True))
    even, auto = (median(v.rates) for v in variants)
    print(f"\n{'variant':<16} {'samples/s':>10}   per device (samples/s, rows/epoch)   imbalance")
    for variant in variants:
        record = variant.monitor.records[-1]
        devices = ", ".join(
            f"{d} {f['samples_per_second']:.0f} ({f['rows']})" for d, f in record["devices"].items()
        )
        print(f"{variant.name:<16} {median(variant.rates):>10.0f}   {devices}   {record['imbalance']:.2f}x")
    ratio = auto / even
    print(f"\nsplit='auto' / split='even': {ratio:.2f}x (ideal 1.50x)")
    check("auto >= 1.3x even", ratio * 100, 130, "% of even")
    speeds = [f["samples_per_second"] for f in variants[0].monitor.records[-1]["devices"].values()]
    seen = speeds[1] / speeds[0]
    print(f"  monitor: slowed device at {seen:.2f}x the fast one's speed (imposed 0.50x)")
    check("monitor within 15 % of the imposed imbalance", 100 - abs(seen / 0.5 - 1) * 100, 85, "% agreement")


def overhead(args) -> None:
    """The monitor's cost on the data-parallel benchmark's CNN, even split."""
    from bench_data_parallel import build_model as cnn
    from bench_data_parallel import compile_model

    data = Data(args.samples // 2, args.batch_size, shape=(32, 32, 3))
    plain = Variant("without monitor", compile_model(kerasmulti.parallelize(cnn(), gpus=DEVICES)))
    watched = Variant("with monitor", compile_model(kerasmulti.parallelize(cnn(), gpus=DEVICES)))
    for variant, monitor in ((plain, False), (watched, True)):
        fit_epoch(variant, data, record=False, monitor=monitor)
    timed_rounds([plain, watched], args.repeats, lambda v: fit_epoch(v, data, True, v is watched))
    cost = 1 - median(watched.rates) / median(plain.rates)
    print(f"\nCNN, samples/s: without monitor {median(plain.rates):.0f}, with {median(watched.rates):.0f}: "
          f"overhead {cost:+.1%} (target at most 2 %)")
    check("monitor overhead <= 2 %", 100 - cost * 100, 98, "% of unmonitored")


def main(argv=None) -> None:
    parser = make_parser(
        __doc__, repeats=5, samples=4096, samples_help="rows per epoch (default 4096)",
        batch_help="global batch (default 256)",
    )
    parser.add_argument("--ms-per-row", type=float, default=0.25,
                        help="the load per row on the fast device, ms (default 0.25; twice on the slow one)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1024 rows")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.samples = 1, 1024
    print_environment(kerasmulti.available_devices()[:DEVICES])
    print(f"{DEVICES} devices, {args.samples} rows an epoch in batches of {args.batch_size}; "
          f"load {args.ms_per_row} ms a row, {SLOW_DEVICE} at half speed; {args.repeats} repeats\n")
    balance(args, own_step=False)
    print()
    balance(args, own_step=True)
    print()
    overhead(args)


if __name__ == "__main__":
    run_reporting(main)
