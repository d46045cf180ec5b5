"""Two workers, different local data, one MultiWorkerMirroredStrategy step loop.

Run by `kerasmulti launch --workers 2`. The template is cloned inside the
strategy's scope (Keras 3 fit under this strategy is broken, FINDINGS.md); a
custom step lets Keras' optimizer all-reduce the gradients. Each worker saves
its final weights to OUT/worker-<index>.npy.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(0)
template = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
with strategy.scope():
    clone = keras.models.clone_model(template)
    clone.set_weights(template.get_weights())
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(clone.trainable_variables)
rng = np.random.default_rng(index)  # each worker has its own rows
x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
loss_fn = keras.losses.MeanSquaredError(reduction="sum")


@tf.function
def step(xb, yb):
    def replica(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, clone(xb, training=True)) / 16.0  # global batch: 2 x 8 rows
        optimizer.apply(tape.gradient(loss, clone.trainable_variables), clone.trainable_variables)
        return loss

    return strategy.reduce("sum", strategy.run(replica, args=(xb, yb)), axis=None)


for _ in range(3):
    step(tf.constant(x), tf.constant(y))
np.save(os.path.join(sys.argv[1], f"worker-{index}.npy"), np.concatenate([w.ravel() for w in clone.get_weights()]))
print("done", flush=True)
