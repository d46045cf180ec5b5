"""Throughput and memory of `kerasmulti.parallel_predict` against `model.predict`.

Measures two things for one small VGG-style CNN (random weights, 32x32x3 input,
a 128-wide Dense "features" output):

1. Throughput, rows/s, all in one process and on the same devices:

   - model.predict: the plain Keras model on the first device;
   - parallel_predict(gpus=N): returning arrays;
   - parallel_predict(gpus=N, output=.h5): streaming into an HDF5 file (a
     fresh file each call: an existing one would be resumed, i.e. skipped).

   Each variant is warmed up first (and checked against model.predict), then
   the timed runs are interleaved: every repeat runs each variant once in
   turn, the starting variant rotating, so a burst of load from other processes
   slows all variants alike; the median over repeats is reported.
   parallel_predict keeps the parallel model it builds for a plain model, and
   its traced step, so like model.predict it traces in the warm-up only.

2. Memory as the input grows 10x: an input of R rows and one of 10R rows (by
   default 2,000 and 20,000 rows of 32x32x3 float32, 24.6 and 246 MB) are
   written to a temporary folder; each size is then predicted in a fresh
   subprocess (same devices, same model), so the peak RSS is that of one
   size alone. The peak is read from /proc/self/status (VmHWM), not from
   `resource.getrusage(...).ru_maxrss`: Linux carries `ru_maxrss` across
   exec, so every child would report at least this parent's RSS at the fork
   (about 740 MB here, more than the smaller children reach), hiding them;
   `ru_maxrss` is the fallback where /proc is missing. The goal: the peak RSS of
   parallel_predict with `output=` stays near 1.0x (<= 1.1x) while the input
   grows 10x. The input is read as an `h5py.Dataset`, not as a memory-mapped
   `.npy`: pages of a memory-mapped file count toward a process's RSS on
   Linux once read, and the kernel leaves them mapped while memory is plentiful,
   so a memory-mapped input makes the RSS grow with the input even though the
   process holds only a few batches of its own (the page cache, not the
   process, holds the file; on the development machine the peak grew by about
   the input's size, 1.27x). The memory-mapped `.npy` is measured too, to show
   this, and plain `model.predict` on the fully loaded array for contrast.
   Besides the peak, each child reports its RSS just before it opens the data
   (TensorFlow and the model already loaded): peak minus that is what the
   prediction itself added.

Without GPUs the CPU is split into N logical devices (`simulate_devices`) with
one intra-op thread each and N inter-op threads, so N replicas can keep N
cores busy while model.predict gets about one; on GPUs the script uses the
first N GPUs (with fewer, the first split in N logical GPUs, which share its
compute) and leaves TensorFlow's threading alone.

Noise: `model.predict` is fed a tf.data pipeline without autotuning (see
`_common.dataset`), which removed the iterator teardown stall that once made
whole calls run at one of two speeds; the per-repeat numbers are printed to
show the spread. The script prints whether the targets are met but always exits 0: a
benchmark reports, it does not fail.

Usage:
    python benchmarks/bench_inference.py [--devices 2] [--repeats 5] [--quick]
"""

from __future__ import annotations

# First: _common sets TensorFlow's environment defaults before TensorFlow loads.
from _common import (
    check,
    configure_devices,
    dataset,
    error_summary,
    fmt,
    make_parser,
    median,
    print_environment,
    ratio,
    record_failure,
    run_reporting,
    scaled,
    timed_rounds,
    warn_missing_devices,
)

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

# Importing these does not initialise TensorFlow's devices; creating a tensor does.
import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402

SEED = 1234
INPUT_SHAPE = (32, 32, 3)
FEATURES = 128
GROWTH = 10  # the memory test's large input has GROWTH times the rows
RSS_TARGET = 1.1  # peak RSS growth allowed for GROWTH times the input
MB = 1e6


@dataclass
class Sizes:
    samples: int
    batch_size: int
    repeats: int
    memory_rows: int  # R: the memory test runs R and GROWTH * R rows


@dataclass
class Variant:
    name: str
    run: Callable[[np.ndarray], object]  # predicts, returns what it made
    rates: list = field(default_factory=list)  # rows/s per repeat
    error: str | None = None


def build_model() -> keras.Model:
    # Seeded, so the parent and every child process predict with the same weights.
    keras.utils.set_random_seed(SEED)
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(INPUT_SHAPE),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(128, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(FEATURES, activation="relu", name="features"),
        ],
        name="vgg_small",
    )


def make_data(samples: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return rng.standard_normal((samples, *INPUT_SHAPE), dtype=np.float32)


# ---------------------------------------------------------------- throughput


def make_variants(model, devices: list[str], n: int, batch_size: int, folder: str) -> list[Variant]:
    output = os.path.join(folder, "features.h5")

    def plain(x):
        # Through a pipeline without autotuning, as in the other benchmarks:
        # on arrays, TensorFlow 2.21 stalls at random tearing down the
        # autotuned iterator (see `dataset`), which would flatter the ratio.
        with tf.device(devices[0]):
            return model.predict(dataset(x, None, batch_size, shuffle=False), verbose=0)

    def parallel(x):
        return kerasmulti.parallel_predict(model, x, gpus=n, batch_size=batch_size, verbose=0)

    def to_file(x):
        # An existing file would be resumed from its counter: start afresh.
        if os.path.exists(output):
            os.remove(output)
        return kerasmulti.parallel_predict(
            model, x, gpus=n, batch_size=batch_size, output=output, verbose=0
        )

    return [
        Variant("model.predict (1 device)", plain),
        Variant(f"parallel_predict(gpus={n})", parallel),
        Variant(f"parallel_predict(gpus={n}, .h5)", to_file),
    ]


def run_once(variant: Variant, x, record: bool):
    """One timed predict; a failure disables the variant. Returns its result."""
    if variant.error:
        return None
    try:
        start = time.perf_counter()
        result = variant.run(x)  # arrays come back as numpy: the work is done
        elapsed = time.perf_counter() - start
    except Exception as error:  # reported in the table, never raised
        record_failure(variant, error)
        return None
    if record:
        variant.rates.append(len(x) / elapsed)
    return result


def _as_array(result):
    if isinstance(result, str):  # the .h5 path
        with h5py.File(result, "r") as f:
            return f["features"][:]
    return np.asarray(result)


def check_results(variants: list[Variant], results: list) -> None:
    """Says whether the warm-up results of every variant equal model.predict's."""
    reference = results[0]
    if reference is None:
        return
    for variant, result in zip(variants[1:], results[1:]):
        if result is None:
            continue
        same = np.allclose(_as_array(result), reference, rtol=1e-4, atol=1e-4)
        print(f"  {variant.name}: results {'equal' if same else 'DIFFER FROM'} model.predict's")


def benchmark(variants: list[Variant], sizes: Sizes) -> None:
    x = make_data(sizes.samples)
    # Warm-up: tracing stays untimed (parallel_predict keeps its parallel
    # model and traced step from one call to the next, as model.predict does).
    results = [run_once(v, x, record=False) for v in variants]
    check_results(variants, results)
    del results
    # Timed: interleaved repeats (see timed_rounds); the tables show their median.
    timed_rounds(variants, sizes.repeats, lambda variant: run_once(variant, x, record=True))


def print_throughput(variants: list[Variant]) -> None:
    base = median(variants[0].rates)
    header = f"{'variant':<32}{'rows/s':>10}{'x predict':>11}"
    print(header)
    print("-" * len(header))
    for v in variants:
        rate = median(v.rates)
        print(f"{v.name:<32}{fmt(rate, '.0f'):>10}{fmt(ratio(rate, base), '.2f'):>11}")
    print("\nPer-repeat rows/s, to judge the noise:")
    for v in variants:
        runs = " ".join(f"{r:.0f}" for r in v.rates)
        print(f"  {v.name:<32}" + (f"FAILED: {v.error}" if v.error else runs))


# -------------------------------------------------------------------- memory


@dataclass
class MemoryCase:
    name: str
    child: str  # the --child mode that runs it
    suffix: str  # the input file it reads
    peaks: dict = field(default_factory=dict)  # rows -> (RSS before, peak RSS) in KiB
    error: str | None = None


def memory_cases() -> list[MemoryCase]:
    return [
        MemoryCase("parallel_predict, h5py.Dataset", "parallel", ".h5"),  # the target
        MemoryCase("parallel_predict, mmap .npy", "parallel", ".npy"),
        MemoryCase("model.predict, loaded array", "loaded", ".npy"),
    ]


def write_inputs(folder: str, rows: int) -> str:
    """Writes `rows` random rows as <stem>.npy and <stem>.h5 (dataset "x"); returns the stem."""
    stem = os.path.join(folder, f"x{rows}")
    rng = np.random.default_rng(SEED)
    npy = np.lib.format.open_memmap(stem + ".npy", mode="w+", dtype=np.float32, shape=(rows, *INPUT_SHAPE))
    with h5py.File(stem + ".h5", "w") as f:
        dataset = f.create_dataset("x", shape=(rows, *INPUT_SHAPE), dtype=np.float32)
        for begin in range(0, rows, 1000):  # a chunk at a time: the parent stays small too
            chunk = rng.standard_normal((min(1000, rows - begin), *INPUT_SHAPE), dtype=np.float32)
            npy[begin : begin + len(chunk)] = chunk
            dataset[begin : begin + len(chunk)] = chunk
    npy.flush()
    del npy
    return stem


def _status_kib(key: str) -> int | None:
    """The `key:` line of /proc/self/status, in KiB (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_kib() -> int | None:
    """This process's current RSS in KiB (Linux), None elsewhere."""
    return _status_kib("VmRSS")


def _peak_rss_kib() -> int:
    """This process's peak RSS in KiB: VmHWM on Linux, else `ru_maxrss`.

    Not `ru_maxrss` on Linux: it survives exec, so a child started by a large
    parent reports at least the parent's RSS at the fork (the copied address
    space counts), and every case would show the parent's size instead of its own.
    """
    peak = _status_kib("VmHWM")
    if peak is not None:
        return peak
    import resource  # not on Windows: there the child fails and the case is reported

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB elsewhere


def child_main(args) -> None:
    """Runs one memory case in this (fresh) process and prints its RSS."""
    mode, path, output = args.child
    devices = configure_devices(args.devices)  # first: before any tensor exists
    model = build_model()
    before = _rss_kib()
    if mode == "loaded":
        x = np.load(path)  # the whole array in memory, as model.predict needs it
        with tf.device(devices[0]):
            model.predict(x, batch_size=args.batch_size, verbose=0)
    elif path.endswith(".h5"):
        with h5py.File(path, "r") as f:
            kerasmulti.parallel_predict(
                model, f["x"], gpus=args.devices, batch_size=args.batch_size, output=output, verbose=0
            )
    else:
        x = np.load(path, mmap_mode="r")
        kerasmulti.parallel_predict(
            model, x, gpus=args.devices, batch_size=args.batch_size, output=output, verbose=0
        )
    print(f"RSS_KIB before={before if before is not None else -1} peak={_peak_rss_kib()}", flush=True)


def run_child(case: MemoryCase, stem: str, rows: int, n: int, batch_size: int, folder: str) -> None:
    output = os.path.join(folder, f"out-{case.child}-{case.suffix[1:]}-{rows}.h5")
    command = [
        sys.executable, os.path.abspath(__file__), "--devices", str(n),
        "--batch-size", str(batch_size), "--child", case.child, stem + case.suffix, output,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RSS_KIB ")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise RuntimeError(f"child exited {done.returncode}: {tail[:200]}")
        values = dict(part.split("=") for part in lines[-1].split()[1:])
        before = int(values["before"])
        case.peaks[rows] = (before if before >= 0 else None, int(values["peak"]))
    except Exception as error:  # reported in the table, never raised
        print(f"{case.name} ({rows} rows) failed:", file=sys.stderr)
        traceback.print_exc()
        case.error = error_summary(error)
    finally:
        if os.path.exists(output):
            os.remove(output)


def benchmark_memory(cases: list[MemoryCase], sizes: Sizes, n: int, folder: str) -> list[int]:
    row_counts = [sizes.memory_rows, GROWTH * sizes.memory_rows]
    stems = {rows: write_inputs(folder, rows) for rows in row_counts}
    for rows in row_counts:
        for case in cases:
            if case.error is None:
                run_child(case, stems[rows], rows, n, sizes.batch_size, folder)
        print(f"  {rows} rows done", flush=True)
    return row_counts


def _mb(kib: int | None) -> float | None:
    return None if kib is None else kib * 1024 / MB


def print_memory(cases: list[MemoryCase], row_counts: list[int]) -> None:
    header = f"{'case':<32}{'rows':>7}{'input MB':>10}{'RSS before MB':>15}{'peak RSS MB':>13}{'added MB':>10}"
    print(header)
    print("-" * len(header))
    row_bytes = int(np.prod(INPUT_SHAPE)) * 4
    for case in cases:
        for rows in row_counts:
            before, peak = case.peaks.get(rows, (None, None))
            added = None if before is None or peak is None else peak - before
            print(
                f"{case.name:<32}{rows:>7}{rows * row_bytes / MB:>10.1f}{fmt(_mb(before), '.0f'):>15}"
                f"{fmt(_mb(peak), '.0f'):>13}{fmt(_mb(added), '.0f'):>10}"
            )
    small, large = row_counts
    print(f"\nPeak RSS growth, {large} vs {small} rows (input {large / small:.0f}x):")
    for case in cases:
        if case.error:
            print(f"  {case.name:<32}FAILED: {case.error}")
            continue
        print(f"  {case.name:<32}{fmt(growth(case, row_counts), '.2f')}x")


def growth(case: MemoryCase, row_counts: list[int]) -> float | None:
    small, large = (case.peaks.get(rows, (None, None))[1] for rows in row_counts)
    return ratio(large, small)


# -------------------------------------------------------------------- report


def print_checks(variants: list[Variant], cases: list[MemoryCase], row_counts, n: int) -> None:
    bound = scaled(median(variants[0].rates), 1.5)
    print("\nTargets:")
    for variant, label in zip(variants[1:], ("", " to .h5")):
        check(f"{n}-device parallel_predict{label} >= 1.5x model.predict",
              median(variant.rates), bound, "rows/s")
    value = growth(cases[0], row_counts)
    verdict = "not met (a run failed)" if value is None else ("met" if value <= RSS_TARGET else "not met")
    print(f"  peak RSS of parallel_predict (h5py input) <= {RSS_TARGET}x at {GROWTH}x the input: "
          f"{verdict} ({fmt(value, '.2f')}x)")


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    parser = make_parser(__doc__, repeats=5, samples=4096,
                         samples_help="rows per throughput run", batch_help="rows per step")
    parser.add_argument("--memory-rows", type=int, default=2000,
                        help=f"R: the memory test predicts R and {GROWTH}R rows (default 2000)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, 1 repeat")
    # Internal: one memory case in a fresh process (MODE INPUT OUTPUT).
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices < 1 or args.repeats < 1 or args.batch_size < 1:
        parser.error("--devices, --repeats and --batch-size must be at least 1")
    if args.quick:
        args.samples, args.batch_size, args.repeats, args.memory_rows = 64, 32, 1, 64
    return args, Sizes(args.samples, args.batch_size, args.repeats, max(1, args.memory_rows))


def print_setup(devices: list[str], n: int, sizes: Sizes) -> None:
    print_environment(devices)
    print(f"Throughput: {sizes.samples} rows of {INPUT_SHAPE}, batch {sizes.batch_size}, "
          f"{sizes.repeats} repeat(s)")
    print(f"Memory: {sizes.memory_rows} and {GROWTH * sizes.memory_rows} rows, "
          f"each size in a fresh process\n")
    warn_missing_devices(devices, n, "parallel")


def main(argv=None) -> int:
    args, sizes = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    devices = configure_devices(args.devices)  # first: before any tensor exists
    print_setup(devices, args.devices, sizes)
    with tempfile.TemporaryDirectory(prefix="kerasmulti-bench-") as folder:
        print("Throughput:")
        variants = make_variants(build_model(), devices, args.devices, sizes.batch_size, folder)
        benchmark(variants, sizes)
        print("Memory:")
        cases = memory_cases()
        row_counts = benchmark_memory(cases, sizes, args.devices, folder)
    print()
    print_throughput(variants)
    print()
    print_memory(cases, row_counts)
    print_checks(variants, cases, row_counts, args.devices)
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.exit(main())  # a child's failure must show in its exit status
    run_reporting(main)
