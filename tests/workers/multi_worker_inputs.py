"""Inputs and callbacks of multi-worker fit, against one process where it applies.

Run by `kerasmulti launch --workers 2 multi_worker_inputs.py OUT` (each worker
saves OUT/worker-<index>.npz), or as `multi_worker_inputs.py OUT --reference`
(one process, OUT/reference.npz). Phases:

- files: a pipeline reading two TFRecord files (TensorFlow would shard it by
  file): fit and predict equal one process, predictions in order.
- schedule: a custom LearningRateSchedule class and a callable learning rate.
- positional: evaluate(x, y, batch_size, verbose) with positional arguments.
- lists: a two-input model fed a list of arrays, shuffled (fit's default).
- pydataset: a shuffled PyDataset; a metric counts each sample seen.
- refit: two fit() calls on shuffled arrays draw different orders.
- padded: per-worker datasets of variable-length rows (padded_batch), uneven.
- logs: a CSVLogger, appending, is written by the chief alone.
- refusal: steps_per_execution=2.
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
results = {}
rng = np.random.default_rng(11)
x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


def dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def wrapped(template):
    return template if reference else kerasmulti.parallelize(template)


def save(phase, template, **values):
    for i, weight in enumerate(template.get_weights()):
        results[f"{phase}/weight{i}"] = weight
    for key, value in values.items():
        results[f"{phase}/{key}"] = np.asarray(value)


# files: two TFRecord files of 8 rows each, written by each process for itself
folder = os.path.join(out, f"records-{'reference' if reference else index}")
os.makedirs(folder, exist_ok=True)
paths = [os.path.join(folder, f"part-{k}.tfrecord") for k in range(2)]
for k, path in enumerate(paths):
    with tf.io.TFRecordWriter(path) as writer:
        for row in range(8 * k, 8 * k + 8):
            features = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x[row])),
                        "y": tf.train.Feature(float_list=tf.train.FloatList(value=y[row]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
spec = {"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([1], tf.float32)}
records = tf.data.TFRecordDataset(paths).map(lambda r: tf.io.parse_single_example(r, spec)).map(lambda e: (e["x"], e["y"]))
template = dense()
target = wrapped(template)
target.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
history = target.fit(records.batch(4), epochs=2, verbose=0).history
prediction = target.predict(records.map(lambda a, b: a).batch(4), verbose=0)
save("files", template, loss=history["loss"], prediction=prediction)


class Halving(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, rate):
        self.rate = rate

    def __call__(self, step):
        return self.rate / (1.0 + keras.ops.cast(step, "float32"))

    def get_config(self):
        return {"rate": self.rate}


# schedule
for name, optimizer in (("schedule", keras.optimizers.SGD(Halving(0.2))), ("callable", keras.optimizers.SGD(lambda: 0.05))):
    template = dense()
    target = wrapped(template)
    target.compile(optimizer=optimizer, loss="mse")
    history = target.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    save(name, template, loss=history["loss"])

# positional: batch_size and verbose given by position
template = dense()
target = wrapped(template)
target.compile(optimizer="sgd", loss="mse")
save("positional", template, evaluation=target.evaluate(x, y, 6, 0))

if not reference:
    # lists: two inputs as a list, fit's default shuffle
    left, right = keras.Input((4,)), keras.Input((2,))
    keras.utils.set_random_seed(0)
    template = keras.Model([left, right], keras.layers.Dense(1)(keras.layers.concatenate([left, right])))
    target = kerasmulti.parallelize(template)
    target.compile(optimizer="sgd", loss="mse")
    target.fit([x, x[:, :2]], y, batch_size=4, epochs=1, verbose=0)
    save("lists", template)

    # pydataset and refit: coverage of the samples
    ids = np.arange(16, dtype="float32")[:, None]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[4 * i: 4 * i + 4], ids[4 * i: 4 * i + 4]

    template = dense()
    target = kerasmulti.parallelize(template)
    target.compile(optimizer="sgd", loss="mse", metrics=[Seen(16), Seen(16, here=True)])
    history = target.fit(Batches(), epochs=3, verbose=0).history
    results["pydataset/seen"] = np.stack(history["seen"])
    here = [target.fit(x, ids, batch_size=4, epochs=1, verbose=0).history["seen_here"][0] for _ in range(2)]
    results["refit/seen_here"] = np.stack(here)

    # padded: rows of varying length, padded per batch; worker 1 has fewer
    def sequences(context):
        lengths = [3, 5, 2, 4, 1, 5, 3] if context.input_pipeline_id == 0 else [2, 4, 3]
        rows = [np.full((n, 2), float(n), "float32") for n in lengths]
        dataset = tf.data.Dataset.from_generator(
            lambda: ((r, np.ones(1, "float32")) for r in rows),
            output_signature=(tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((1,), tf.float32)),
        )
        return dataset.padded_batch(2).apply(tf.data.experimental.assert_cardinality(-(-len(rows) // 2)))

    keras.utils.set_random_seed(0)
    template = keras.Sequential([keras.Input((None, 2)), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    target = kerasmulti.parallelize(template)
    target.compile(optimizer="sgd", loss="mse")
    target.fit(sequences, epochs=2, verbose=0)
    save("padded", template)

    # logs: one CSV, written by the chief
    template = dense()
    target = kerasmulti.parallelize(template)
    target.compile(optimizer="sgd", loss="mse")
    target.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[keras.callbacks.CSVLogger(os.path.join(out, "log.csv"), append=True)])

    # refusal
    try:
        kerasmulti.parallelize(dense()).compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    except ValueError as error:
        results["refusal/message"] = np.asarray(str(error))

np.savez(os.path.join(out, "reference.npz" if reference else f"worker-{index}.npz"), **results)
print("done", flush=True)
