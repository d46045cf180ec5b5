"""Gradient accumulation across workers, against one process on the same global batches.

Run by `kerasmulti launch --workers 2 multi_worker_accumulation.py OUT` (each
worker saves OUT/worker-<index>.npz), or as `multi_worker_accumulation.py OUT
--reference` (one process with Keras' own accumulation, OUT/reference.npz).
17 rows in global batches of 4: 5 steps an epoch, the last of one row (one
worker's part is empty). Phases:

- adam: Adam, gradient_accumulation_steps=2, 3 epochs: 15 steps, so the
  accumulations straddle each epoch's end and the last is left unapplied.
- adamw: AdamW with weight decay, global_clipnorm and a learning-rate schedule,
  steps=3, on a BatchNormalization model, 2 epochs then 2 more in a second fit
  call (20 steps): accumulations straddle an epoch's end and the two fit
  calls, and the last two steps' sum is left unapplied. Biases are excluded
  from weight decay (`exclude_from_weight_decay`).
- mixed: a mixed_float16 model (a float32 output layer, BatchNormalization),
  Adam with the loss scale compile adds, steps=2, 2 epochs, on data scaled
  down: one step overflows at 2**15 and is skipped, in both runs. A worker's
  float16 sums cover its rows, one process's the batch's: where only the
  batch's overflows, the two would skip different steps (docs/multi-worker.md).
- refusal: use_ema with accumulation (workers only).

The optimizer's variables (iterations, moments, the accumulators) are saved
beside the weights: one process's state mid-accumulation must match too.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import json
import os
import sys

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasmulti  # first: joins the cluster before TensorFlow runs anything

out = sys.argv[1]
reference = "--reference" in sys.argv
index = 0 if reference else json.loads(os.environ["TF_CONFIG"])["task"]["index"]
results = {}
rng = np.random.default_rng(21)
x, y = rng.normal(size=(17, 5)).astype("float32"), rng.normal(size=(17, 1)).astype("float32")


def model(batchnorm=False, policy="float32"):
    keras.utils.set_random_seed(5)
    keras.mixed_precision.set_global_policy(policy)  # the model's own policy: compile adds a loss scale
    layers = [keras.Input((5,)), keras.layers.Dense(6, activation="relu")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    built = keras.Sequential(layers + [keras.layers.Dense(1, dtype="float32")])
    keras.mixed_precision.set_global_policy("float32")
    return built


def train(phase, template, optimizer, epochs, scale=1.0):
    target = template if reference else kerasmulti.parallelize(template)
    target.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    losses = []
    for count in epochs:  # one fit() call each
        losses += target.fit(x * scale, y * scale, batch_size=4, epochs=count, shuffle=False, verbose=0).history["loss"]
    for i, weight in enumerate(template.get_weights()):
        results[f"{phase}/weight{i}"] = weight
    for variable in target.optimizer.variables:
        # One process names a loss scale's inner optimizer's slots under the scale's name; a worker does not.
        path = variable.path.replace("loss_scale_optimizer/", "", 1) if variable.path.count("/") > 1 else variable.path
        results[f"{phase}/optimizer/{path}"] = np.asarray(variable)
    results[f"{phase}/loss"] = np.asarray(losses)


train("adam", model(), keras.optimizers.Adam(0.05, gradient_accumulation_steps=2), epochs=[3])
schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.8)
adamw = keras.optimizers.AdamW(
    schedule, weight_decay=0.1, global_clipnorm=0.5, gradient_accumulation_steps=3, name="adam_w"  # Keras 3.14 names it "adamw"
)
adamw.exclude_from_weight_decay(var_names=["bias"])  # not in the config: kept when re-created on a worker
train("adamw", model(batchnorm=True), adamw, epochs=[2, 2])
train("mixed", model(batchnorm=True, policy="mixed_float16"), keras.optimizers.Adam(0.05, gradient_accumulation_steps=2), [2], 0.01)

if not reference:
    try:
        kerasmulti.parallelize(model()).compile(
            optimizer=keras.optimizers.Adam(use_ema=True, gradient_accumulation_steps=2), loss="mse"
        )
    except ValueError as error:
        results["refusal/message"] = str(error)

np.savez(os.path.join(out, "reference.npz" if reference else f"worker-{index}.npz"), **results)
