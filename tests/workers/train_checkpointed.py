"""A training job for the kill and resume tests, run as a separate process.

    python train_checkpointed.py FOLDER EPOCHS [--backup | --keras-backup] [--out weights.npz]

Trains a seeded model data-parallel on 2 simulated devices with a
ParallelModelCheckpoint saving FOLDER/ckpt.keras after every batch and, with
--backup, a ParallelBackupAndRestore in FOLDER/backup (--keras-backup: Keras'
own BackupAndRestore, the control of the crash tests, with the same crash
point after its weights file). Prints one line per epoch so the parent knows
how far it got.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import kerasmulti  # noqa: E402

kerasmulti.simulate_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("folder")
parser.add_argument("epochs", type=int)
parser.add_argument("--backup", action="store_true")
parser.add_argument("--keras-backup", action="store_true")
parser.add_argument("--out")
args = parser.parse_args()

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((16,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(256), keras.layers.Dense(4)]
)
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 16)).astype("float32")
y = rng.normal(size=(96, 4)).astype("float32")
parallel = kerasmulti.parallelize(model, gpus=2)
parallel.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
callbacks = [kerasmulti.ParallelModelCheckpoint(os.path.join(args.folder, "ckpt.keras"), save_freq=1)]
if args.backup:
    callbacks.append(kerasmulti.ParallelBackupAndRestore(os.path.join(args.folder, "backup")))
if args.keras_backup:
    from kerasmulti import _faults

    class KerasBackup(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            # Keras writes the weights, then the epoch's JSON: the crash point between them.
            save_weights = self.model.save_weights

            def then_crash(*a, **k):
                save_weights(*a, **k)
                _faults.reached("backup:weights")

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
