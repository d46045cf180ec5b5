"""The TensorFlow operations a training step runs outside XLA, and how they grow with the model.

A data-parallel step's fixed cost is paid per operation its executor runs
outside XLA (a few microseconds each on a GPU host). This script counts them
with TensorFlow's profiler (`kerasmulti._src.utils.step_ops`: exact, whatever
the machine's load) for one `train_on_batch` step, averaged over a few:

- a model with ResNet50's variable structure (53 x (Dense(8) +
  BatchNormalization) + Dense(8): 214 trainable and 106 non-trainable
  variables), bare Keras with `jit_compile=True` against `parallelize` over
  `--devices` devices with XLA per replica, in float32 and mixed_float16,
  with SGD and Adam, and with the uncompiled replicas (`jit_compile=False`);
- one layer holding 50, then 600 weight vectors: the count per variable
  (the slope), which a packed step holds at zero;
- a GAN's own `train_step` (`bench_custom_steps.GAN`, Adam) with 1 and 10 hidden
  layers per network: uncompiled replicas against XLA model calls, whose packed
  reads and update hold the count flat;
- the first step (trace and XLA compile) of bare XLA and of XLA per replica
  on the ResNet50-shaped model;
- the step time of bare XLA and of the parallel step on those two models,
  interleaved repeats (a timing: it does depend on the machine's load);
- where `ThroughputMonitor`'s time outside the step goes as the variables
  grow: its `loop_seconds` (Keras' loop between the calls of the step) and
  `input_call_seconds` (the call itself) at 50 and 600 vectors, beside the
  call of an XLA function that only reads every variable (what passing them
  to a step costs; bare Keras' step pays it too) and of one that reads one.

Targets (issue "one step engine"): at most 100 operations per step outside
XLA for 2 devices on the ResNet50-shaped model, float32 and mixed_float16,
SGD and Adam, and the same count (+-10) at 50 and 600 variables; a first
step (trace and XLA compile) at most 1.5x bare XLA's.

Usage:
    python benchmarks/bench_step_ops.py [--devices 2] [--repeats 5] [--quick]
"""

from __future__ import annotations

from _common import configure_devices, make_parser, median, print_environment, run_reporting, timed_rounds

import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_custom_steps import GAN, LATENT  # noqa: E402

import kerasmulti  # noqa: E402
from kerasmulti._src.utils import step_ops  # noqa: E402

SEED = 1234
WIDTH = 8


def resnet50_shaped(blocks: int = 53) -> keras.Model:
    """53 x (Dense + BatchNormalization) + Dense: ResNet50's count of variables, tiny."""
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(blocks):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(WIDTH)(h))
    return keras.Model(inputs, keras.layers.Dense(WIDTH)(h))


class ManyWeights(keras.layers.Layer):
    """Adds `count` weight vectors to its input: a model of `count` variables and little compute."""

    def __init__(self, count, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def build(self, input_shape):
        self.vectors = [self.add_weight(shape=(input_shape[-1],), initializer="zeros") for _ in range(self.count)]

    def call(self, x):
        for v in self.vectors:
            x = x + v
        return x


def many_weights(count: int) -> keras.Model:
    return keras.Sequential([keras.Input((WIDTH,)), ManyWeights(count), keras.layers.Dense(WIDTH)])


def build(make, devices, *, parallel: bool, policy="float32", optimizer="sgd", jit_compile=True):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(SEED)
    try:
        model = make()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if parallel:
        model = kerasmulti.parallelize(model, devices=devices)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return model


class Step:
    """One model's `train_on_batch` on a fixed batch, warmed up (traced and compiled) once."""

    def __init__(self, name, model, batch):
        self.name, self.model, self.times = name, model, []
        self.x, self.y = batch
        started = time.perf_counter()
        self()
        self.first = time.perf_counter() - started
        self()  # a function that generalises its shapes traces again on its second call

    def __call__(self):
        return self.model.train_on_batch(self.x, self.y)

    def timed(self, steps):
        started = time.perf_counter()
        for _ in range(steps):
            self()
        self.times.append((time.perf_counter() - started) / steps)


def build_gan(depth: int, devices, jit_compile: bool):
    """`bench_custom_steps.GAN` with `depth` hidden Dense layers in each network, parallel."""
    keras.utils.set_random_seed(SEED)

    def network(inputs, outputs, name):
        hidden = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(depth)]
        return keras.Sequential([keras.Input((inputs,)), *hidden, keras.layers.Dense(outputs)], name=name)

    gan = kerasmulti.parallelize(GAN(network(WIDTH, 1, "discriminator"), network(LATENT, WIDTH, "generator")), devices=devices)
    gan.compile(keras.optimizers.Adam(), keras.optimizers.Adam(), keras.losses.BinaryCrossentropy(from_logits=True),
                jit_compile=jit_compile)
    return gan


class GANStep(Step):
    """A GAN's training step on a fixed batch of real rows (its data has no labels)."""

    def __init__(self, model, x):
        model.fit(x, batch_size=len(x), epochs=1, verbose=0)  # makes its train_function
        self.batches = iter(tf.data.Dataset.from_tensors(x).repeat())
        super().__init__("", model, (x, None))

    def __call__(self):
        return self.model.train_function(self.batches)


def loop_time(devices, batch, repeats: int) -> None:
    """The monitor's loop time at 50 and 600 vectors, beside the call of functions that read the variables."""
    rows = {}
    for count in (50, 600):
        model = build(lambda: many_weights(count), devices, parallel=True)
        monitor = kerasmulti.ThroughputMonitor(verbose=0)
        data = tf.data.Dataset.from_tensors(batch).repeat(50)
        model.fit(data, epochs=1 + repeats, callbacks=[monitor], verbose=0)  # the first epoch compiles
        variables = kerasmulti.unwrap(model).variables
        reads = tf.function(lambda: tf.add_n([tf.reduce_sum(v) for v in variables]), jit_compile=True)
        first = tf.function(lambda: tf.reduce_sum(variables[0]), jit_compile=True)
        rows[count] = {
            "monitor's loop_seconds": median([r["loop_seconds"] for r in monitor.records[1:]]),
            "monitor's input_call_seconds": median([r["input_call_seconds"] for r in monitor.records[1:]]),
            "XLA function reading every variable": _per_call(reads),
            "XLA function reading one": _per_call(first),
        }
    for name in rows[50]:
        a, b = rows[50][name] * 1e3, rows[600][name] * 1e3
        print(f"  {name:<38}{a:7.3f} ms at 50, {b:7.3f} ms at 600: {(b - a) / 550 * 1e3:5.2f} us a variable")


def _per_call(function, calls: int = 200) -> float:
    function()
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls


def print_counts(rows):
    print(f"{'step':<58}{'outside XLA':>12}{'XLA runs':>10}   most frequent")
    for name, ops in rows:
        print(f"{name:<58}{ops.outside_xla:>12.0f}{ops.xla_programs:>10.0f}   {ops.top(4)}")


def main(argv=None) -> int:
    parser = make_parser(__doc__, repeats=5, samples=64, samples_help="rows per batch",
                         batch_help="(unused: one batch of --samples rows)")
    parser.add_argument("--quick", action="store_true", help="fewer variants, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    devices = configure_devices(args.devices)
    print_environment(devices)
    rng = np.random.default_rng(SEED)
    batch = (rng.random((args.samples, WIDTH), dtype=np.float32), rng.random((args.samples, WIDTH), dtype=np.float32))
    n = args.devices

    print("\nResNet50-shaped model (214 trainable, 106 non-trainable variables), one train_on_batch step:")
    settings = [("float32", "sgd")] if args.quick else [
        ("float32", "sgd"), ("mixed_float16", "sgd"), ("float32", "adam"), ("mixed_float16", "adam")]
    rows, firsts = [], []
    for policy, optimizer in settings:
        bare = Step("", build(resnet50_shaped, devices, parallel=False, policy=policy, optimizer=optimizer), batch)
        if not rows:
            rows.append(("bare Keras, jit_compile=True", step_ops.count(bare)))
        model = build(resnet50_shaped, devices, parallel=True, policy=policy, optimizer=optimizer)
        parallel = Step("", model, batch)
        rows.append((f"parallelize({n}), XLA per replica, {policy}, {optimizer}", step_ops.count(parallel)))
        firsts.append((f"{policy}, {optimizer}", bare.first, parallel.first))
    if not args.quick:
        model = build(resnet50_shaped, devices, parallel=True, jit_compile=False)
        rows.append((f"parallelize({n}), uncompiled replicas, float32, sgd", step_ops.count(Step("", model, batch))))
    print_counts(rows)
    compiled = [ops for name, ops in rows if "XLA per replica" in name]
    print("\nFirst step (trace, XLA compile), ResNet50-shaped, bare XLA against XLA per replica:")
    for name, bare_first, parallel_first in firsts:
        print(f"  {name:<24} bare {bare_first:6.2f} s, parallelize({n}) {parallel_first:6.2f} s: "
              f"{parallel_first / bare_first:.2f}x")

    print("\nOne layer holding 50 and 600 weight vectors (+ Dense), float32, SGD:")
    steps, grown = [], []
    for count in (50, 600):
        bare = Step(f"bare XLA, {count} vectors", build(lambda: many_weights(count), devices, parallel=False), batch)
        parallel = Step(f"parallelize({n}) XLA, {count} vectors", build(lambda: many_weights(count), devices, parallel=True), batch)
        grown.append((parallel.name, step_ops.count(parallel)))
        steps += [bare, parallel]
    print_counts(grown)
    slope = (grown[1][1].outside_xla - grown[0][1].outside_xla) / 550
    print(f"Operations per step per variable (slope, 50 -> 600): {slope:+.3f}")

    print("\nA GAN's own train_step (keras.io's: two optimizers, latent vectors drawn in the step), Adam:")
    gan_rows = []
    for depth in (1, 10):
        for jit_compile in (False, True):
            gan = build_gan(depth, devices, jit_compile)
            way = "XLA model calls" if jit_compile else "uncompiled replicas"
            trainable = len(kerasmulti.unwrap(gan).trainable_variables)
            gan_rows.append((f"parallelize({n}), {way}, {trainable} variables", step_ops.count(GANStep(gan, batch[0]))))
    print_counts(gan_rows)

    print(f"\nStep time (median of {args.repeats} interleaved repeats of 20 steps; first step: trace and compile):")
    timed_rounds(steps, args.repeats, lambda s: s.timed(20))
    for s in steps:
        print(f"  {s.name:<36}{median(s.times) * 1e3:8.2f} ms   first step {s.first:6.2f} s")
    for i in (0, 2):
        bare, parallel = steps[i], steps[i + 1]
        print(f"  {parallel.name}: {median(bare.times) / median(parallel.times):.2f}x bare XLA's step rate")

    print(f"\nWhere the monitor's loop time goes, parallelize({n}) with XLA, 50 and 600 vectors (median of {args.repeats} epochs):")
    loop_time(devices, batch, args.repeats)

    worst = max(ops.outside_xla for ops in compiled)
    spread = abs(grown[1][1].outside_xla - grown[0][1].outside_xla)
    print("\nTargets:")
    print(f"  <= 100 ops outside XLA per step, every compiled variant: {'met' if worst <= 100 else 'not met'} (worst {worst:.0f})")
    print(f"  the same count (+-10) at 50 and 600 variables: {'met' if spread <= 10 else 'not met'} ({spread:.0f} apart)")
    slowest = max(parallel_first / bare_first for _, bare_first, parallel_first in firsts)
    print(f"  first step <= 1.5x bare XLA's, ResNet50-shaped: {'met' if slowest <= 1.5 else 'not met'} (worst {slowest:.2f}x)")
    return 0


if __name__ == "__main__":
    run_reporting(main)
