"""parallelize() in a TF_CONFIG cluster, against one process on the same global batches.

Run by `kerasmulti launch --workers 2 multi_worker_fit.py OUT` (each worker
saves OUT/worker-<index>.npz), or without a cluster as `multi_worker_fit.py OUT
--reference`, which trains the plain template on the same global batches and
saves OUT/reference.npz. Phases:

- arrays: a BatchNormalization model on numpy arrays, 21 rows in batches of 4
  (the last global batch has one row, so one replica gets none); fit, evaluate,
  predict, and the logs callbacks get after each batch. Each worker builds its model with its own seed: the chief's weights
  win.
- dataset: the same through a tf.data.Dataset batched globally, the template
  compiled before parallelize (the parallel model is compiled at once).
- local: each worker reads different rows, and a different number of them,
  through a per-worker dataset function; one process trains on the
  concatenation of the workers' batches (the shorter worker's end empty).
- classifier: AUC and accuracy objects made before compile, on rows whose
  halves (one per worker) differ: their results cover both workers.
- losses: a masked per-step head and a summed per-row head (loss weights,
  per-step sample weights, a weight and an activity regulariser), whose batch
  totals are not row counts; fit with a remainder batch, with even batches
  (per-output losses), evaluate.
- statistics: BatchNormalization of features whose mean is 50 times their
  spread, and of masked steps.
- coverage: shuffled arrays with validation_split=0.25 (the last 6 rows); a
  metric counts how often each sample was seen, across the cluster and (with
  a plain variable) by each worker.
- inference: parallel_predict runs on the worker's own devices; only the chief
  may write an output file.
- float64, last (it sets Keras' floatx): the arrays' model with float64 weights.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import json
import os
import sys

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from seen import Seen  # noqa: E402

import kerasmulti  # first: joins the cluster before TensorFlow runs anything

out = sys.argv[1]
reference = "--reference" in sys.argv
index = 0 if reference else json.loads(os.environ["TF_CONFIG"])["task"]["index"]
WORKERS = 2
results = {}


def model(seed, batchnorm=True):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if batchnorm:
        hidden = keras.layers.BatchNormalization()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, name="y")(hidden))


def trainable(template):
    target = template if reference else kerasmulti.parallelize(template)
    target.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return target


def save(phase, template, **values):
    for i, weight in enumerate(template.get_weights()):
        results[f"{phase}/weight{i}"] = weight
    for key, value in values.items():
        results[f"{phase}/{key}"] = np.asarray(value)


rng = np.random.default_rng(7)
x, y = rng.normal(size=(21, 4)).astype("float32"), rng.normal(size=(21, 1)).astype("float32")

class BatchLogs(keras.callbacks.Callback):
    """The logs callbacks get after each batch: the batches so far, on every worker."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append([logs["loss"], logs["mae"]])

    on_test_batch_end = on_train_batch_end


# arrays
template = model(seed=0 if reference else index)
target = trainable(template)
fit_logs, evaluate_logs = BatchLogs(), BatchLogs()  # the last batch of 4 has 1 row: one replica gets none
history = target.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[fit_logs]).history
evaluation = target.evaluate(x, y, batch_size=4, verbose=0, callbacks=[evaluate_logs])
prediction = target.predict(x, batch_size=4, verbose=0)
on_batch = target.predict_on_batch(x[:5])  # Keras' across workers: every row once per worker
save("arrays", template, loss=history["loss"], mae=history["mae"], evaluation=evaluation, prediction=prediction,
     on_batch=on_batch, fit_batch_logs=fit_logs.logs, evaluate_batch_logs=evaluate_logs.logs)

# dataset, on a template compiled before parallelize (as one loaded from a .keras file)
template = model(seed=0, batchnorm=False)
template.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
target = template if reference else kerasmulti.parallelize(template)
compiled = target.compiled  # before any fit: the template's compile is adopted at once
history = target.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(6), epochs=2, verbose=0).history
save("dataset", template, loss=history["loss"], compiled=int(compiled))


# local: worker w holds LOCAL_ROWS[w] rows of its own; per-replica batches of 2
LOCAL_ROWS = (9, 6)


def local_data(worker):
    local = np.random.default_rng(100 + worker)
    return local.normal(size=(LOCAL_ROWS[worker], 4)).astype("float32"), local.normal(size=(LOCAL_ROWS[worker], 1)).astype("float32")


template = model(seed=0, batchnorm=False)
target = trainable(template)
if reference:
    parts = [local_data(w) for w in range(WORKERS)]
    steps = max(-(-rows // 2) for rows in LOCAL_ROWS)
    for _ in range(2):
        for step in range(steps):
            batch = [np.concatenate([p[k][2 * step: 2 * step + 2] for p in parts]) for k in (0, 1)]
            target.train_on_batch(*batch)
else:
    mine = local_data(index)
    target.fit(lambda context: tf.data.Dataset.from_tensor_slices(mine).batch(2), epochs=2, verbose=0)
save("local", template)

# classifier: metric objects made before compile (AUC keeps vectors of counts);
# the second half of the rows, worker 1's part, is shifted
template = model(seed=0, batchnorm=False)
target = template if reference else kerasmulti.parallelize(template)
target.compile(optimizer="sgd", loss=keras.losses.BinaryCrossentropy(from_logits=True),
               metrics=[keras.metrics.AUC(name="auc", from_logits=True), keras.metrics.BinaryAccuracy(threshold=0.0)])
labels = (x[:, :1] > 0).astype("float32")
shifted = np.concatenate([x[:12], x[12:] + 1.0])
history = target.fit(shifted, labels, batch_size=24, epochs=2, shuffle=False, verbose=0).history
evaluation = target.evaluate(shifted, labels, batch_size=24, verbose=0)
save("classifier", template, auc=history["auc"], accuracy=history["binary_accuracy"], evaluation=evaluation)

# losses: a masked per-step head and a summed per-row head with weights and
# regularisers, whose batch totals (unmasked steps, none) are not row counts
def tagger(seed):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    steps = keras.layers.LSTM(3, return_sequences=True)(keras.layers.Embedding(12, 4, mask_zero=True)(tokens))
    tags = keras.layers.Dense(2, name="tags", kernel_regularizer=keras.regularizers.L2(0.05))(steps)
    pooled = keras.layers.GlobalAveragePooling1D()(steps)
    score = keras.layers.Dense(1, name="score", activity_regularizer=keras.regularizers.L1(0.05))(pooled)
    return keras.Model(tokens, {"tags": tags, "score": score})


padded = np.where(np.arange(5) < rng.integers(1, 6, size=(22, 1)), rng.integers(1, 12, size=(22, 5)), 0).astype("int32")
targets = {"tags": rng.normal(size=(22, 5, 2)).astype("float32"), "score": rng.normal(size=(22, 1)).astype("float32")}
weights = {"tags": rng.uniform(0.2, 2.0, size=(22, 5)).astype("float32"), "score": rng.uniform(0.2, 2.0, size=22).astype("float32")}
first = lambda rows, tree: {k: v[:rows] for k, v in tree.items()}  # noqa: E731
template = tagger(0)
target = template if reference else kerasmulti.parallelize(template)
target.compile(optimizer=keras.optimizers.SGD(0.1), loss={"tags": "mse", "score": keras.losses.MeanSquaredError(reduction="sum")},
               loss_weights={"tags": 1.0, "score": 0.5})
# A remainder batch of 2 rows, which Keras' per-output logs weigh as much as a
# batch of 4 (the traced shapes leave the rows unknown); then even batches; then
# one global batch.
names = ("loss", "tags_loss", "score_loss")
uneven = target.fit(padded, targets, sample_weight=weights, batch_size=4, epochs=1, shuffle=False, verbose=0).history
even = target.fit(padded[:16], first(16, targets), sample_weight=first(16, weights), batch_size=8, epochs=1, shuffle=False, verbose=0).history
evaluation = target.evaluate(padded, targets, sample_weight=weights, batch_size=22, verbose=0, return_dict=True)
save("losses", template, uneven=[uneven[k] for k in names], even=[even[k] for k in names],
     evaluation=[evaluation[k] for k in names])

# statistics: BatchNormalization of features whose mean is 50 times their spread (E[x²] - E[x]², Keras'
# own synchronized=True, lost the variance's digits) and of masked steps (it left the mask out)
def normalised(seed):
    keras.utils.set_random_seed(seed)
    tokens, far = keras.Input((5,), dtype="int32", name="tokens"), keras.Input((3,), name="far")
    steps = keras.layers.BatchNormalization(name="steps")(keras.layers.Embedding(12, 4, mask_zero=True)(tokens))
    features = [keras.layers.GlobalAveragePooling1D()(steps), keras.layers.BatchNormalization(name="far_features")(far)]
    return keras.Model([tokens, far], keras.layers.Dense(1)(keras.layers.Concatenate()(features)))


offset = (100.0 + rng.normal(scale=2.0, size=(22, 3))).astype("float32")
template = normalised(0)
target = template if reference else kerasmulti.parallelize(template)
target.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
history = target.fit([padded, offset], targets["score"], batch_size=6, epochs=2, shuffle=False, verbose=0).history
save("statistics", template, loss=history["loss"])

# coverage: the metric counts each sample's id (y) as it is seen
if not reference:

    template = model(seed=0, batchnorm=False)
    target = kerasmulti.parallelize(template)
    target.compile(optimizer="sgd", loss="mse", metrics=[Seen(21), Seen(21, here=True)])
    ids = np.arange(21, dtype="float32")[:, None]
    history = target.fit(x, ids, batch_size=4, epochs=2, shuffle=True, validation_split=0.25, verbose=0).history
    results["coverage/seen"] = np.stack(history["seen"])
    results["coverage/seen_here"] = np.stack(history["seen_here"])
    results["coverage/val_loss"] = np.asarray(history["val_loss"])

# inference
if not reference:
    if index == 0:
        expected = template.predict(x, verbose=0)
        results["inference/difference"] = np.abs(kerasmulti.parallel_predict(template, x, batch_size=4) - expected).max()
    else:
        try:
            kerasmulti.parallel_predict(template, x, output=os.path.join(out, "clobbered.h5"))
        except RuntimeError as error:
            results["inference/refusal"] = np.asarray(str(error))

# float64, last: Keras' floatx for every model made after it (a float64 loss was divided by a float32 share)
keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")  # the layers' (the policy in use was made from floatx before)
template = model(4)
target = trainable(template)
history = target.fit(x.astype("float64"), y.astype("float64"), batch_size=6, epochs=2, shuffle=False, verbose=0).history
save("float64", template, loss=history["loss"], dtypes=[str(w.dtype) for w in template.weights])

np.savez(os.path.join(out, "reference.npz" if reference else f"worker-{index}.npz"), **results)
print("done", flush=True)
