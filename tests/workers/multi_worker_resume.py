"""Checkpointed multi-worker training that a killed worker interrupts and a restart resumes.

`multi_worker_resume.py OUT [--die-at-epoch K] [--reference] [--shuffle] [--dropout]
[--strike STEP --victim I --signal TERM|KILL] [--save-freq N]`: trains for 4
epochs with ParallelBackupAndRestore (OUT/backup) and ParallelModelCheckpoint
(OUT/model-<index>.keras: only the chief's may appear), with progress lines
(only the chief's may appear). With --die-at-epoch K, worker 1 kills itself (SIGKILL) at
the end of epoch K. Each worker that finishes saves OUT/final-<index>.npz and its history, OUT/history-<index>.json;
--reference trains the plain template in one process (OUT/final-reference.npz).
--shuffle passes fit's default shuffle=True (otherwise False); --dropout adds a
Dropout layer. With --strike, worker I sends itself the signal as global step STEP
(from 0) begins, once: OUT/struck marks that it did, so a resumed run goes on.
--save-freq N backs up every N steps instead of every epoch.
Each worker appends one line per batch its callbacks see begin to
OUT/batches-<index>.txt: the epoch, the batch and the optimizer's iterations.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import json
import os
import signal
import sys
import time

import kerasmulti  # noqa: E402

kerasmulti.initialize()  # first: joins TF_CONFIG's cluster before TensorFlow runs anything

import keras  # noqa: E402
import numpy as np  # noqa: E402

out = sys.argv[1]
reference = "--reference" in sys.argv
die_at = int(sys.argv[sys.argv.index("--die-at-epoch") + 1]) if "--die-at-epoch" in sys.argv else None
shuffle = "--shuffle" in sys.argv
strike = int(sys.argv[sys.argv.index("--strike") + 1]) if "--strike" in sys.argv else None
victim = int(sys.argv[sys.argv.index("--victim") + 1]) if "--victim" in sys.argv else None
strike_with = sys.argv[sys.argv.index("--signal") + 1] if "--signal" in sys.argv else "TERM"
save_freq = int(sys.argv[sys.argv.index("--save-freq") + 1]) if "--save-freq" in sys.argv else "epoch"
index = 0 if reference else json.loads(os.environ["TF_CONFIG"])["task"]["index"]

keras.utils.set_random_seed(0)
dropout = [keras.layers.Dropout(0.25)] if "--dropout" in sys.argv else []
template = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), *dropout, keras.layers.Dense(1)])
target = template if reference else kerasmulti.parallelize(template)
target.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
rng = np.random.default_rng(3)
x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch} done", flush=True)
        if die_at is not None and index == 1 and epoch == die_at:
            os.kill(os.getpid(), signal.SIGKILL)


class Strike(keras.callbacks.Callback):
    steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        with open(os.path.join(out, f"batches-{index}.txt"), "a") as f:
            f.write(f"{self.epoch} {batch} {int(self.model.optimizer.iterations.numpy())}\n")
        marker = os.path.join(out, "struck")
        if strike == self.steps and index == victim and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"SIG{strike_with} at step {self.steps}, sent at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{strike_with}"))
        self.steps += 1


callbacks = [Die(), Strike()]
if not reference:
    callbacks = [
        kerasmulti.ParallelBackupAndRestore(os.path.join(out, "backup"), save_freq=save_freq),
        kerasmulti.ParallelModelCheckpoint(os.path.join(out, f"model-{index}.keras")),
        *callbacks,
    ]
history = target.fit(x, y, batch_size=16, epochs=4, shuffle=shuffle, callbacks=callbacks, verbose=2)
with open(os.path.join(out, f"history-{'reference' if reference else index}.json"), "w") as f:
    json.dump(history.history, f)
np.savez(os.path.join(out, f"final-{'reference' if reference else index}.npz"), *template.get_weights())
print("done", flush=True)
