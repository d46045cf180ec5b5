"""Checkpointed multi-worker training that a killed worker interrupts and a restart resumes.

`multi_worker_resume.py OUT [--die-at-epoch K] [--reference] [--shuffle]`: trains for 4
epochs with ParallelBackupAndRestore (OUT/backup) and ParallelModelCheckpoint
(OUT/model-<index>.keras: only the chief's may appear), with progress lines
(only the chief's may appear). With --die-at-epoch K, worker 1 kills itself (SIGKILL) at
the end of epoch K. Each worker that finishes saves OUT/final-<index>.npz;
--reference trains the plain template in one process (OUT/final-reference.npz).
--shuffle passes fit's default shuffle=True (otherwise False).
"""

import json
import os
import signal
import sys

import kerasmulti  # noqa: E402

kerasmulti.initialize()  # first: joins TF_CONFIG's cluster before TensorFlow runs anything

import keras  # noqa: E402
import numpy as np  # noqa: E402

out = sys.argv[1]
reference = "--reference" in sys.argv
die_at = int(sys.argv[sys.argv.index("--die-at-epoch") + 1]) if "--die-at-epoch" in sys.argv else None
shuffle = "--shuffle" in sys.argv
index = 0 if reference else json.loads(os.environ["TF_CONFIG"])["task"]["index"]

keras.utils.set_random_seed(0)
template = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
target = template if reference else kerasmulti.parallelize(template)
target.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
rng = np.random.default_rng(3)
x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch} done", flush=True)
        if die_at is not None and index == 1 and epoch == die_at:
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [Die()]
if not reference:
    callbacks = [
        kerasmulti.ParallelBackupAndRestore(os.path.join(out, "backup")),
        kerasmulti.ParallelModelCheckpoint(os.path.join(out, f"model-{index}.keras")),
        *callbacks,
    ]
target.fit(x, y, batch_size=16, epochs=4, shuffle=shuffle, callbacks=callbacks, verbose=2)
np.savez(os.path.join(out, f"final-{'reference' if reference else index}.npz"), *template.get_weights())
print("done", flush=True)
