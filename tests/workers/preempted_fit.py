"""A job that SIGTERM preempts in the middle of an epoch, for the step-exact resume tests.

    python preempted_fit.py FOLDER [--strike STEP [--signal KILL]] [--keras-backup] [--save-freq N] [--reseed]
                            [--pipeline]

Trains a model with Dropout data-parallel on 2 simulated devices for 3
epochs of 6 batches, with fit's defaults (shuffle=True), and a
ParallelBackupAndRestore in FOLDER/backup (--keras-backup: Keras' own
BackupAndRestore, the control). With --reseed the order's seed is not the
program's: the script reseeds Python's `random` from its process id after
building the model, so only a backup that keeps the order's seed can resume
it (the resumed run passes it). With
--strike STEP the process sends itself SIGTERM (--signal KILL: SIGKILL) as
global step STEP (counted from 0) begins. A finished run writes FOLDER/final.npz and, per
epoch, FOLDER/epoch-E.json with the epoch's logs. Every run appends one line
per batch its callbacks see begin to FOLDER/batches.txt: the epoch, the
batch and the optimizer's iterations.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import argparse
import json
import os
import random
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import kerasmulti  # noqa: E402

kerasmulti.simulate_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("folder")
parser.add_argument("--strike", type=int)
parser.add_argument("--signal", default="TERM")
parser.add_argument("--keras-backup", action="store_true")
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--reseed", action="store_true")
parser.add_argument("--pipeline", action="store_true")
args = parser.parse_args()

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3), keras.layers.Dense(2)]
)
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 8)).astype("float32")
y = rng.normal(size=(48, 2)).astype("float32")
# --pipeline: the model cut into 2 stages, run on 4 micro-batches, instead of 2 replicas.
parallel = kerasmulti.pipeline(model, gpus=2, microbatches=4) if args.pipeline else kerasmulti.parallelize(model, gpus=2)
parallel.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
if args.reseed:
    random.seed(os.getpid())

steps = []


def on_batch_begin(batch, logs):
    steps.append(batch)
    with open(os.path.join(args.folder, "batches.txt"), "a") as f:
        f.write(f"{epochs[-1]} {batch} {int(parallel.optimizer.iterations)}\n")
    if args.strike is not None and len(steps) - 1 == args.strike:
        print(f"signal sent at {time.time():.3f}", flush=True)  # the grace a preemption needs, measured
        os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))


epochs = []


def on_epoch_end(epoch, logs):
    with open(os.path.join(args.folder, f"epoch-{epoch}.json"), "w") as f:
        json.dump({k: float(v) for k, v in logs.items()}, f)
    print(f"epoch {epoch} done", flush=True)


save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
kind = keras.callbacks.BackupAndRestore if args.keras_backup else kerasmulti.ParallelBackupAndRestore
callbacks = [
    kind(os.path.join(args.folder, "backup"), save_freq=save_freq),
    keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epochs.append(epoch), on_train_batch_begin=on_batch_begin, on_epoch_end=on_epoch_end
    ),
]
parallel.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks, verbose=0)
np.savez(os.path.join(args.folder, "final.npz"), *[np.asarray(w) for w in model.weights])
print("done", flush=True)
