"""The demo: data-parallel training of a small convnet on scikit-learn's digits.

Runs on every GPU, or on simulated CPU devices without GPUs (the CLI sets them
up before TensorFlow starts). It prints the devices and shard sizes, the loss
per epoch, test accuracy, throughput against one device, then saves the
template, reloads it on one device and checks that its predictions match.
The file holds the model whose accuracy was printed: the throughput's timed
epochs train the model on, so it is saved before them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.inference import sources as _sources
from kerasmulti._src.parallelize import parallelize
from kerasmulti._src.utils.machine_load import LoadMeter

# Other processes' load above which the throughput is said to be unreliable.
BUSY_CORES = 0.25


def _digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise SystemExit(
            "The demo needs scikit-learn's digits, but scikit-learn is not installed. "
            "Run pip install 'kerasmulti[demo]'. Received: scikit-learn=None"
        ) from error
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def _convnet(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_convnet",
    )


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def _throughputs(single, parallel, device: str, batches, rows: int, rounds: int = 5):
    """Samples/s of one epoch of each model per round, the two taking turns.

    Returns the two lists and the cores other processes kept busy meanwhile
    (None where unknown).
    """
    rates = {"single": [], "parallel": []}
    load = None
    for timed in [False] + [True] * rounds:  # the first round traces, untimed
        load = load or (LoadMeter() if timed else None)
        for name, model in (("single", single), ("parallel", parallel)):
            with tf.device(device) if model is single else contextlib.nullcontext():
                start = time.perf_counter()
                # The pipeline's order is fixed; Keras would warn that shuffle=True is ignored.
                model.fit(batches, epochs=1, verbose=0, shuffle=False)
                if timed:
                    rates[name].append(rows / (time.perf_counter() - start))
    return rates["single"], rates["parallel"], load.others()


def _report_throughput(one: list, many: list, devices: int, others) -> None:
    ratios = [m / o for m, o in zip(many, one)]
    print(
        f"throughput: {statistics.median(many):,.0f} samples/s on {devices} device(s), "
        f"{statistics.median(one):,.0f} samples/s on one: {statistics.median(many) / statistics.median(one):.2f}x "
        f"(median of {len(ratios)} epochs each; per epoch {min(ratios):.2f}x to {max(ratios):.2f}x)"
    )
    if others is not None and others > BUSY_CORES:
        print(
            f"  note: other processes kept {others:.1f} of {os.cpu_count()} cores busy meanwhile, "
            "so these figures are lower and noisier than on an idle machine."
        )


def _sub_batches(batch_size: int, rows: int, devices: list) -> str:
    """How a batch is split, for the batch the data really gives: no more rows than it has."""
    batch = min(batch_size, rows)
    clipped = f" (the batch size {batch_size} clipped to the {rows} training rows)" if batch < batch_size else ""
    shards = _split.plan(batch, len(devices))
    return f"Each batch of {batch}{clipped} is split into sub-batches of " + ", ".join(
        f"{s.counted} on {d}" for s, d in zip(shards, devices)
    )


def run(gpus=None, epochs: int = 5, batch_size: int = 128, output: str = "kerasmulti-demo") -> int:
    """Runs the demo; returns the process exit code."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(
            f"demo --output must be a folder for the trained model, but it is a file. "
            f"Pass a folder (it is made if missing). Received: output={output!r}"
        )
    try:
        os.makedirs(output, exist_ok=True)  # before training: a folder it cannot make fails now
    except OSError as error:
        raise ValueError(
            f"demo --output must be a folder for the trained model, but it cannot be made "
            f"({error.strerror}). Pass a folder this user can write. Received: output={output!r}"
        ) from error
    (x_train, y_train), (x_test, y_test) = _digits()
    model = _convnet(seed=42)
    parallel = parallelize(model, gpus=gpus)
    devices = parallel.replica_devices
    print(f"Devices ({len(devices)}): {', '.join(devices)}")
    print(_sub_batches(batch_size, len(x_train), devices))
    print(f"Training on {len(x_train)} digits, testing on {len(x_test)}.")
    _compile(parallel)
    report = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: print(
            f"epoch {epoch + 1}/{epochs}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.4f}"
        )
    )
    parallel.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[report])
    test = parallel.evaluate(x_test, y_test, batch_size=batch_size, verbose=0, return_dict=True)
    print(f"test accuracy: {test['accuracy']:.4f} (loss {test['loss']:.4f})")
    # Saved now: the throughput's epochs train the model on, and the file is the model just evaluated.
    path = os.path.join(output, "digits_convnet.keras")
    parallel.save(path)
    got = parallel.predict(x_test, batch_size=batch_size, verbose=0)

    single = _convnet(seed=42)
    _compile(single)
    # Not the arrays: fit's autotuned pipeline stalls about a second per epoch,
    # inside some timed epochs and not others (the ratio swung 0.78x to 1.24x).
    batches = _sources.batched(tf.data.Dataset.from_tensor_slices((x_train, y_train)), batch_size)
    one, many, others = _throughputs(single, parallel, devices[0], batches, len(x_train))
    _report_throughput(one, many, len(devices), others)

    reloaded = keras.models.load_model(path)
    with tf.device(devices[0]):
        expected = reloaded.predict(x_test, batch_size=batch_size, verbose=0)
    difference = float(np.max(np.abs(expected - got)))
    matches = np.allclose(expected, got, rtol=1e-5, atol=1e-5)
    print(f"saved the template to {path}")
    print(
        f"reloaded on one device: predictions {'match' if matches else 'DO NOT match'} "
        f"(max difference {difference:.2e})"
    )
    return 0 if matches else 1
