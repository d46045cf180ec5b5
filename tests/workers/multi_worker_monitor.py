"""ThroughputMonitor across workers: run by `kerasmulti launch --workers 2 multi_worker_monitor.py OUT`.

Worker 1's replica is slowed to half speed. Phases:

- monitored: every worker passes a monitor and a TensorBoard callback (log
  folder OUT/logs), with validation data; each saves its monitor's records
  and the wall clock read by callbacks listed before and after the monitor.
- meetings: the guide's `train_step` (its replicas meet at `optimizer.apply`
  and the metrics), then a BatchNormalization model (its statistics), worker 1
  slowed again; their records.
- refusals: a monitor on the chief only, then another batch size on each
  worker; each worker saves fit's errors.
- devices: what `available_devices()` lists on each worker (its own only).

Each worker writes OUT/worker-<index>.json.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import json
import os
import sys
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
from custom_models import FEATURES, GuideCompiledLoss  # noqa: E402
from slow_device import SlowDevice  # noqa: E402

import kerasmulti  # first: joins the cluster before TensorFlow runs anything

out = sys.argv[1]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
results = {}
rng = np.random.default_rng(7)
x, y = rng.normal(size=(192, 8)).astype("float32"), rng.normal(size=(192, 1)).astype("float32")

keras.utils.set_random_seed(4)
model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
     SlowDevice(1.0, ("task:1/device:CPU:0",), 2.0), keras.layers.Dense(1)]
)
parallel = kerasmulti.parallelize(model)
parallel.compile(optimizer="adam", loss="mse")


class Clock(keras.callbacks.Callback):
    """The wall clock around the monitor: listed before it, `before` sees each
    epoch begin and each step end first; listed after it, `after` sees the last
    step end last. Keras calls callbacks in the order given."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append({"begin": time.perf_counter(), "steps": []})

    def on_train_batch_begin(self, batch, logs=None):
        self.epochs[-1]["steps"].append([time.perf_counter(), None])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1]["steps"][-1][1] = time.perf_counter()


monitor, before, after = kerasmulti.ThroughputMonitor(), Clock(), Clock()
tensorboard = keras.callbacks.TensorBoard(os.path.join(out, "logs"))
# Validation runs its collectives between the last step and the monitor's gather.
parallel.fit(x, y, batch_size=48, epochs=2, verbose=0, callbacks=[before, monitor, after, tensorboard],
             validation_data=(x[:40], y[:40]))
results["records"] = monitor.records
results["clock"] = {"before": before.epochs, "after": after.epochs}

keras.utils.set_random_seed(5)
inputs = keras.Input((FEATURES,))
hidden = SlowDevice(1.0, ("task:1/device:CPU:0",), 2.0)(keras.layers.Dense(8, activation="relu")(inputs))
custom = kerasmulti.parallelize(GuideCompiledLoss(inputs, keras.layers.Dense(1)(hidden)))
custom.compile(optimizer="adam", loss="mse", metrics=["mae"])
monitor = kerasmulti.ThroughputMonitor(verbose=0)
custom.fit(x[:, :FEATURES], y, batch_size=48, epochs=2, verbose=0, callbacks=[monitor])
results["custom_records"] = monitor.records

keras.utils.set_random_seed(6)  # BatchNormalization after the load: its statistics' sums are meeting points
normalized = kerasmulti.parallelize(keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(8), SlowDevice(1.0, ("task:1/device:CPU:0",), 2.0),
     keras.layers.BatchNormalization(), keras.layers.Dense(1)]
))
normalized.compile(optimizer="adam", loss="mse")
monitor = kerasmulti.ThroughputMonitor(verbose=0)
normalized.fit(x, y, batch_size=48, epochs=2, verbose=0, callbacks=[monitor])
results["batchnorm_records"] = monitor.records

try:
    parallel.fit(x, y, batch_size=48, verbose=0, callbacks=[kerasmulti.ThroughputMonitor()] if index == 0 else [])
except ValueError as error:
    results["refusal"] = str(error)

try:  # each worker another global batch size: refused on both, before a step runs
    parallel.fit(x, y, batch_size=8 * (index + 1), verbose=0)
except ValueError as error:
    results["batch_refusal"] = str(error)

try:  # each worker another number of rows
    parallel.fit(x[: len(x) - 8 * index], y[: len(y) - 8 * index], batch_size=16, verbose=0)
except ValueError as error:
    results["rows_refusal"] = str(error)

results["available_devices"] = kerasmulti.available_devices()

with open(os.path.join(out, f"worker-{index}.json"), "w") as file:
    json.dump(results, file)
