"""What the benchmark scripts share: devices, timing, failures and reporting.

Imported by `bench_data_parallel.py`, `bench_inference.py` and
`bench_model_parallel.py` (their folder is on `sys.path` when they run as
`python benchmarks/<script>.py`, in the child processes of `bench_inference.py`
too). It holds:

- the TensorFlow environment defaults, set on import, before TensorFlow loads;
- `configure_devices`: the N replica devices (GPUs, the first GPU split in N
  when there are fewer, or logical CPU devices with one intra-op thread each),
  `print_environment`, the versions and devices,
  and `warn_missing_devices`;
- `timed_rounds`: the interleaved timed repeats, starting variant rotating,
  with `LoadMeter`, the CPU that other processes took meanwhile;
- `record_failure` and `error_summary`: a failing variant is reported, not raised;
- `median`, `ratio`, `scaled`, `fmt` and `check`: the numbers of the tables and
  the "met / not met" lines of the targets;
- `make_parser`: the options every script takes (`--devices`, `--repeats`,
  `--samples`, `--batch-size`; each script adds `--quick` after its own);
- `run_reporting`: runs a script's main and exits 0 whatever happens, since a
  benchmark reports problems, it does not fail.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, ContextManager

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# Importing these does not initialise TensorFlow's devices; creating a tensor does.
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasmulti  # noqa: E402
from kerasmulti._src.inference import sources as _sources  # noqa: E402
from kerasmulti._src.utils.machine_load import LoadMeter  # noqa: E402,F401  (bench_multi_worker imports it from here)

# ------------------------------------------------------------------- devices

SPLIT_GPU_MEMORY_MB = 8192


def configure_devices(n: int) -> list[str]:
    """Picks N replica devices; must run before TensorFlow initialises devices.

    With GPUs: the first N. With fewer GPUs than N, the first GPU is split into
    N logical GPUs (TensorFlow's virtual devices, each with its own streams and
    a memory limit of `SPLIT_GPU_MEMORY_MB`): they share the GPU's compute, so
    they show what running the parts side by side gives, not what N GPUs give.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if 0 < len(gpus) < n:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=SPLIT_GPU_MEMORY_MB)
                      for _ in range(n)])
    if gpus:
        return kerasmulti.available_devices()[:n]
    # One thread per op and N concurrent ops: the one-device baseline gets one
    # core, N replicas get N, as N GPUs would give N times the compute.
    # TensorFlow fixes threading when it starts, so it is set here, first.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(n)
    return kerasmulti.simulate_devices(n)[:n]


def print_environment(devices: list[str]) -> None:
    """Prints the versions in use and the replica devices."""
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"kerasmulti {kerasmulti.__version__}")
    gpus = tf.config.list_physical_devices("GPU")
    note = ""
    if not gpus:
        note = " (logical CPU devices, 1 intra-op thread each)"
    elif len(gpus) < len(devices):
        note = f" (logical GPUs, all on the first physical GPU, {SPLIT_GPU_MEMORY_MB} MiB each)"
    print(f"Devices: {', '.join(devices)}{note}")


def warn_missing_devices(devices: list[str], n: int, which: str) -> None:
    """Says, if fewer than N devices were found, that the `which` variants will fail."""
    if len(devices) < n:
        print(f"Only {len(devices)} device(s), {n} asked: the {which} variants will fail.\n")


# -------------------------------------------------------------------- timing


def timed_rounds(variants: list, repeats: int, run: Callable[[object], None]) -> None:
    """Calls `run(variant)` for every variant, `repeats` times, interleaved.

    Every repeat runs each variant once in turn, so a burst of load from other
    processes slows all variants alike instead of skewing one of them; then
    prints how much CPU other processes took meanwhile.
    """
    load = LoadMeter()
    for repeat in range(repeats):
        # Rotate the starting variant, so none is always first after a pause.
        start = repeat % len(variants)
        for variant in variants[start:] + variants[:start]:
            run(variant)
        print(f"  repeat {repeat + 1}/{repeats} done", flush=True)
    print(load.report())


# ------------------------------------------------------------------ failures


def build_variants(builders, variant_class=None) -> list:
    """One variant per `(name, builder)`; `builder()` returns `(model, scope)`.

    A variant whose setup fails is kept, with its error, for the table.
    """
    variants = []
    for name, builder in builders:
        variant = (variant_class or TrainPredictVariant)(name)
        try:
            variant.model, variant.scope = builder()
        except Exception as error:  # reported in the table, never raised
            record_failure(variant, error)
        variants.append(variant)
    return variants


def error_summary(error: Exception) -> str:
    """The error's type and the first line of its message, for a table cell."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:200]}"


def record_failure(variant, error: Exception) -> None:
    """Reports a variant's failure (traceback on stderr) and disables it.

    Call it from the `except` block that caught `error`; the variant needs a
    `name` and an `error` attribute.
    """
    print(f"{variant.name} failed; it is left out from here on:", file=sys.stderr)
    traceback.print_exc()
    variant.error = error_summary(error)


# ------------------------------------------------------------------- numbers


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def check(label: str, value: float | None, bound: float | None, unit: str) -> None:
    """Prints whether a rate reaches its lower bound (`value >= bound`)."""
    if value is None or bound is None:
        verdict = "not met (a variant failed)"
    else:
        verdict = "met" if value >= bound else "not met"
    print(f"  {label}: {verdict} ({fmt(value, '.0f')} vs {fmt(bound, '.0f')} {unit})")


# -------------------------------------------------------------------- script


def make_parser(
    doc: str, *, repeats: int, samples: int, samples_help: str, batch_help: str
) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes; a script adds its own.

    `--quick` is left to the script, so that `--help` lists it after the
    script's own options, where it always stood.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="replica devices (default 2)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed rounds (default {repeats})")
    parser.add_argument("--samples", type=int, default=samples, help=samples_help)
    parser.add_argument("--batch-size", type=int, default=256, help=batch_help)
    return parser


def run_reporting(main: Callable[[], object]) -> None:
    """Runs `main` and exits 0: a benchmark reports problems, it does not fail."""
    try:
        main()
    except Exception:  # printed, never raised
        traceback.print_exc()
    sys.exit(0)



@dataclass
class Sizes:
    samples: int
    batch_size: int
    repeats: int


@dataclass
class TrainPredictVariant:
    """One model variant timed for fit and predict (data- and model-parallel scripts)."""

    name: str
    model: keras.Model | None = None  # compiled; None if setup failed
    scope: Callable[[], ContextManager] = contextlib.nullcontext  # around fit/predict
    train: list = field(default_factory=list)  # samples/s per repeat
    predict: list = field(default_factory=list)
    error: str | None = None



def _rows(x) -> int:
    return len(keras.tree.flatten(x)[0])


def dataset(x, y, batch_size: int, shuffle: bool = True):
    """The arrays (y None for predict) as a tf.data pipeline without autotuning, for every variant alike.

    `fit` on arrays would build an autotuned pipeline, whose teardown stall
    (see `kerasmulti._src.inference.sources.batched`) fell inside some timed epochs and not
    others, which made whole epochs run at one of two speeds.
    """
    # A list would be stacked into one tensor; a tuple stays one input each.
    x = tuple(x) if isinstance(x, list) else x
    # (x,) for predict: Keras would read a tuple of inputs as (x, y).
    pipeline = tf.data.Dataset.from_tensor_slices((x,) if y is None else (x, y))
    if shuffle:
        pipeline = pipeline.shuffle(_rows(x), reshuffle_each_iteration=True)
    return _sources.batched(pipeline, batch_size)


def time_fit(variant: TrainPredictVariant, x, y, batch_size: int, shuffle: bool = True) -> float:
    batches = dataset(x, y, batch_size, shuffle)
    with variant.scope():
        start = time.perf_counter()
        # The pipeline shuffles (or not); Keras would warn that shuffle=True is ignored.
        history = variant.model.fit(batches, epochs=1, verbose=0, shuffle=False)
        # Reading the loss waits for the device, so GPU work is not left out.
        float(history.history["loss"][-1])
        elapsed = time.perf_counter() - start
    return _rows(x) / elapsed


def time_predict(variant: TrainPredictVariant, x, batch_size: int) -> float:
    batches = dataset(x, None, batch_size, shuffle=False)
    with variant.scope():
        start = time.perf_counter()
        variant.model.predict(batches, verbose=0)
        elapsed = time.perf_counter() - start
    return _rows(x) / elapsed


def run_once(variant: TrainPredictVariant, x, y, batch_size: int, record: bool, shuffle: bool = True) -> None:
    """One fit epoch and one predict; a failure disables the variant."""
    if variant.error:
        return
    try:
        train = time_fit(variant, x, y, batch_size, shuffle)
        predict = time_predict(variant, x, batch_size)
    except Exception as error:  # reported in the table, never raised
        record_failure(variant, error)
        return
    if record:
        variant.train.append(train)
        variant.predict.append(predict)


def print_train_predict_table(variants, label: str, width: int) -> None:
    """Median train and predict samples/s per variant, the ratio to the first
    variant (`label` heads the ratio columns), then the per-repeat numbers.
    The name column is `width` wide, or wider where a name needs it."""
    width = max(width, 2 + max(len(v.name) for v in variants))
    base_train, base_predict = median(variants[0].train), median(variants[0].predict)
    header = f"{'variant':<{width}}{'train/s':>10}{label:>8}{'predict/s':>11}{label:>8}"
    print(header)
    print("-" * len(header))
    for v in variants:
        train, predict = median(v.train), median(v.predict)
        print(
            f"{v.name:<{width}}{fmt(train, '.0f'):>10}{fmt(ratio(train, base_train), '.2f'):>8}"
            f"{fmt(predict, '.0f'):>11}{fmt(ratio(predict, base_predict), '.2f'):>8}"
        )
    print("\nPer-repeat samples/s (train | predict), to judge the noise:")
    for v in variants:
        runs = " ".join(f"{t:.0f}" for t in v.train)
        preds = " ".join(f"{p:.0f}" for p in v.predict)
        print(f"  {v.name:<{width}}" + (f"FAILED: {v.error}" if v.error else f"{runs} | {preds}"))
