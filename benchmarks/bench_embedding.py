"""A large Embedding table: sparse gradients summed as rows against densified.

An `Embedding`'s gradient is sparse (`IndexedSlices`: the rows a batch
touched). `parallelize` joins the replicas' rows and hands the optimizer one
sparse gradient, as one device's step does; before, it converted each
replica's to a dense table-sized tensor and summed those, so every step wrote
the whole table. This script trains, in one process and on the same devices,
a bag-of-words classifier over a `--rows`-row table (200,000 by default, 64
wide), SGD (whose update of a sparse gradient touches only those rows):

- bare: the template on the first device;
- parallelize, sparse: today's gradient sum;
- parallelize, densified: the earlier sum (each replica's gradient made dense).

It prints samples/s (medians of interleaved repeats) and the ratio sparse /
densified, and checks that both parallel variants end with the same weights.

Usage:
    python benchmarks/bench_embedding.py [--devices 2] [--repeats 5] [--rows 200000] [--quick]
"""

from __future__ import annotations

from _common import check, configure_devices, make_parser, median, print_environment, run_reporting, scaled, timed_rounds

import contextlib
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402
from kerasmulti._src.data_parallel import split as _split  # noqa: E402

SEED = 1234
WIDTH, TOKENS = 64, 16
_SPARSE_SUM = _split.sum_gradients


def _densified_sum(gradients):
    """The sum as it was: every replica's sparse gradient converted to a dense tensor first."""
    present = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients if g is not None]
    return tf.add_n(present) if present else None


def build(rows: int) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    return keras.Sequential([
        keras.Input((TOKENS,), dtype="int32"),
        keras.layers.Embedding(rows, WIDTH),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(10, activation="softmax"),
    ])


class Variant:
    def __init__(self, name, model, summing):
        self.name, self.model, self.summing, self.rates = name, model, summing, []


@contextlib.contextmanager
def summing(function):
    """Inside: the parallel model sums gradients with `function` (traced inside)."""
    _split.sum_gradients = function
    try:
        yield
    finally:
        _split.sum_gradients = _SPARSE_SUM


def fit_epoch(variant, x, y, batch_size, record):
    with summing(variant.summing):
        start = time.perf_counter()
        variant.model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        seconds = time.perf_counter() - start
    if record:
        variant.rates.append(len(x) / seconds)


def main(argv=None) -> int:
    parser = make_parser(__doc__, repeats=5, samples=4096, samples_help="samples per epoch",
                         batch_help="global batch size")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the Embedding table")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat, a small table")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.batch_size, args.repeats, args.rows = 512, 64, 1, 5_000
    devices = configure_devices(args.devices)
    print_environment(devices)
    print(f"Model: Embedding({args.rows}, {WIDTH}) over {TOKENS} tokens, mean-pooled, Dense(10); SGD(0.1)")
    print(f"Data: {args.samples} samples, batch {args.batch_size}, {args.repeats} repeat(s)\n")
    rng = np.random.default_rng(SEED)
    x = rng.integers(0, args.rows, size=(args.samples, TOKENS), dtype=np.int32)
    y = rng.integers(0, 10, size=(args.samples,), dtype=np.int32)

    def compiled(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", jit_compile=False)
        return model

    bare = Variant("bare (one device)", compiled(build(args.rows)), _SPARSE_SUM)

    def parallel():
        return compiled(kerasmulti.parallelize(build(args.rows), devices=devices))

    variants = [
        bare,
        Variant(f"parallelize({args.devices}), sparse", parallel(), _SPARSE_SUM),
        Variant(f"parallelize({args.devices}), densified", parallel(), _densified_sum),
    ]
    for variant in variants:  # warm-up: trace, and the first epoch's allocations
        fit_epoch(variant, x, y, args.batch_size, record=False)
    timed_rounds(variants, args.repeats, lambda v: fit_epoch(v, x, y, args.batch_size, record=True))
    sparse, dense = variants[1], variants[2]
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(sparse.model.get_weights(), dense.model.get_weights()))
    print(f"\n{'variant':<34} {'train/s':>9} {'x bare':>7}")
    for variant in variants:
        rate = median(variant.rates)
        print(f"{variant.name:<34} {rate:9.0f} {rate / median(bare.rates):7.2f}")
    print(f"\nSparse / densified: {median(sparse.rates) / median(dense.rates):.2f}x")
    print(f"Weights of the two parallel variants after the same epochs: max |difference| {difference:.1e}")
    print("\nTargets:")
    check("sparse sum >= 1.0x densified", median(sparse.rates), scaled(median(dense.rates), 1.0), "samples/s")
    return 0


if __name__ == "__main__":
    run_reporting(main)
