"""A training job for the kill and resume tests, run as a separate process.

    python train_checkpointed.py FOLDER EPOCHS [--backup | --keras-backup] [--keras-checkpoint]
                                 [--snapshots] [--pipeline] [--out weights.npz]

Trains a seeded model data-parallel on 2 simulated devices with a
ParallelModelCheckpoint saving FOLDER/ckpt.keras after every batch
(--keras-checkpoint: Keras' own ModelCheckpoint, the control of the
checkpoint crash test, with the crash point `checkpoint:write` reached in the
middle of its write, after each Dense layer's weights) and, with --backup, a
ParallelBackupAndRestore in FOLDER/backup (--keras-backup: Keras' own
BackupAndRestore, the control of the backup crash tests, with the same crash
point after its weights file). --snapshots writes the weights after each
batch's checkpoint to FOLDER/snapshot-N.npz (N counts batches from 1).
--pipeline trains the model cut into 2 pipeline stages of 4 micro-batches
(`kerasmulti.pipeline(model, gpus=2, microbatches=4)`) instead.
Prints one line per epoch so the parent knows how far it got.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import kerasmulti  # noqa: E402
from kerasmulti._src.utils import fault_points as _fault_points  # noqa: E402

kerasmulti.simulate_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("folder")
parser.add_argument("epochs", type=int)
parser.add_argument("--backup", action="store_true")
parser.add_argument("--keras-backup", action="store_true")
parser.add_argument("--keras-checkpoint", action="store_true")
parser.add_argument("--snapshots", action="store_true")
parser.add_argument("--pipeline", action="store_true")
parser.add_argument("--out")
args = parser.parse_args()

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((16,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(256), keras.layers.Dense(4)]
)
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 16)).astype("float32")
y = rng.normal(size=(96, 4)).astype("float32")
parallel = kerasmulti.pipeline(model, gpus=2, microbatches=4) if args.pipeline else kerasmulti.parallelize(model, gpus=2)
parallel.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
checkpoint = os.path.join(args.folder, "ckpt.keras")
if args.keras_checkpoint:
    save_own_variables = keras.layers.Dense.save_own_variables

    def save_then_crash(self, store):
        save_own_variables(self, store)
        _fault_points.reached("checkpoint:write")  # Keras writes the file in place: this is mid-write

    keras.layers.Dense.save_own_variables = save_then_crash
    callbacks = [keras.callbacks.ModelCheckpoint(checkpoint, save_freq=1)]
else:
    callbacks = [kerasmulti.ParallelModelCheckpoint(checkpoint, save_freq=1)]
if args.snapshots:
    seen = []

    def snapshot(batch, logs):
        seen.append(batch)
        np.savez(os.path.join(args.folder, f"snapshot-{len(seen)}.npz"), *[np.asarray(w) for w in model.weights])

    callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=snapshot))
if args.backup:
    callbacks.append(kerasmulti.ParallelBackupAndRestore(os.path.join(args.folder, "backup")))
if args.keras_backup:
    class KerasBackup(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            # Keras writes the weights, then the epoch's JSON: the crash point between them.
            save_weights = self.model.save_weights

            def then_crash(*a, **k):
                save_weights(*a, **k)
                _fault_points.reached("backup:weights")

            self.model.save_weights = then_crash
            try:
                super()._save_model()
            finally:
                del self.model.save_weights

    callbacks.append(KerasBackup(os.path.join(args.folder, "backup")))
callbacks.append(
    keras.callbacks.LambdaCallback(
        # Printed after the checkpoint callback (earlier in the list) has saved.
        on_train_batch_end=lambda batch, logs: batch == 0 and print("checkpointed", flush=True),
        on_epoch_end=lambda epoch, logs: print(f"epoch {epoch + 1} done", flush=True),
    )
)
parallel.fit(x, y, batch_size=16, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
if args.out:
    np.savez(args.out, *[np.asarray(w) for w in model.weights])
print("finished", flush=True)
sys.exit(0)
