"""Checkpoint callbacks for parallel models: save the template, atomically.

`ParallelModelCheckpoint` is `keras.callbacks.ModelCheckpoint` with two
changes: it saves the template behind a parallel model (never the wrapper),
and every write goes to a temporary file beside the target that is renamed
into place, so a killed process leaves the previous good checkpoint or the new
one. `ParallelBackupAndRestore` is `keras.callbacks.BackupAndRestore` that also
keeps the optimizer state of a parallel model (which lives on the wrapper, not
the template), so an interrupted run resumes exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import h5py
import keras

from kerasmulti import _atomic, _cluster, _faults
from kerasmulti._parallel import unwrap


class _AtomicSaver:
    """Stands in for the model inside a callback: atomic saves of `target`.

    Everything but saving is forwarded to the model being trained.
    """

    _OWN = ("_trained", "_target")

    def __init__(self, trained, target):
        self._trained = trained
        self._target = target

    def __setattr__(self, name, value):
        # Callbacks set training state on their model (`_initial_epoch`,
        # `stop_training`): it belongs to the model being trained.
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._trained, name, value)

    def save(self, filepath, overwrite=True, **kwargs):
        if not _cluster.is_chief():
            return  # in a cluster only the chief writes (every worker holds the same weights)
        _atomic.write(filepath, lambda tmp: self._target.save(tmp, overwrite=True, **kwargs))

    def save_weights(self, filepath, overwrite=True, **kwargs):
        if not _cluster.is_chief():
            return
        _atomic.write(filepath, lambda tmp: self._target.save_weights(tmp, overwrite=True, **kwargs))

    def load_weights(self, filepath, *args, **kwargs):
        return self._target.load_weights(filepath, *args, **kwargs)

    def __getattr__(self, name):
        if name in self._OWN:  # not yet set (e.g. while copying)
            raise AttributeError(name)
        return getattr(self._trained, name)


class ParallelModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A drop-in `ModelCheckpoint` that saves the template model, atomically.

    Every argument means what it means in `keras.callbacks.ModelCheckpoint`,
    and on a plain model it behaves like it. On a model returned by
    `kerasmulti.parallelize` it saves the template, so the file loads with
    `keras.models.load_model` (or `load_weights`) on any number of devices,
    without kerasmulti. Each save is written to a temporary file beside the
    target and renamed into place: a process killed at any moment leaves the
    previous checkpoint or the new one, never a torn file; temporaries left
    by killed processes are removed when training starts.

    The Keras 2 form `ParallelModelCheckpoint(template_model, filepath, ...)`
    also works: `template_model` is then the model saved.

    In a multi-worker cluster only the chief (worker 0) writes; the other
    workers hold the same weights and never touch the file.

    Args:
        filepath: Where to save: ends in `.keras`, `.h5` (legacy HDF5) or,
            with `save_weights_only=True`, `.weights.h5`. May hold format
            fields such as `"w-{epoch:02d}-{val_loss:.2f}.keras"`.
        monitor: The metric to monitor for `save_best_only`.
        verbose: 0 is silent, 1 prints a line per save.
        save_best_only: Save only when `monitor` improves.
        save_weights_only: Save only the weights.
        mode: `"auto"`, `"min"` or `"max"`: which way `monitor` improves.
        save_freq: `"epoch"`, or an int: save every that many batches.
        initial_value_threshold: The value `monitor` must beat to be saved.

    Raises:
        ValueError: If the suffix of `filepath` does not fit
            `save_weights_only`, or its folder cannot be created or written;
            after the first batch, if `save_best_only` with `mode="auto"`
            monitors a metric the model does not report (with an explicit
            mode, Keras warns at each save instead).

    Example:

    ```python
    import keras, numpy as np, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model)
    parallel.compile(optimizer="adam", loss="mse")
    checkpoint = kerasmulti.ParallelModelCheckpoint("best.keras", monitor="loss", save_best_only=True)
    parallel.fit(np.ones((32, 4)), np.ones((32, 1)), epochs=2, callbacks=[checkpoint], verbose=0)
    reloaded = keras.models.load_model("best.keras")  # the template
    ```
    """

    def __init__(self, filepath, *args, **kwargs):
        template = None
        if isinstance(filepath, keras.Model):
            template, filepath = filepath, (args[0] if args else kwargs.pop("filepath"))
            args = args[1:]
        super().__init__(filepath, *args, **kwargs)
        self._explicit_template = unwrap(template) if template is not None else None
        _check_writable(self.filepath)

    def set_model(self, model):
        # A parallel model's own save() writes its template (with the compile
        # settings); an explicit, different template is saved as it is.
        explicit = self._explicit_template
        target = model if explicit is None or explicit is unwrap(model) else explicit
        super().set_model(_AtomicSaver(model, target))
        if not _cluster.is_chief():
            self.verbose = 0  # it saves nothing here, so it reports nothing

    def on_train_begin(self, logs=None):
        if _cluster.is_chief():  # another worker's temporary may be the chief's save in flight
            _atomic.remove_stale_temporaries(self.filepath)
        # With an explicit mode, a metric that another callback adds to the
        # epoch logs is legitimate; Keras warns at save time if it is missing.
        self._monitor_checked = not (self.save_best_only and self.mode == "auto")
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        # Metric names are known from the first batch's logs: a typo in
        # `monitor` fails after one batch, not with Keras' error after a whole
        # epoch (mode="auto" cannot tell which way an unknown metric improves).
        if not self._monitor_checked:
            self._monitor_checked = True
            known = set(logs or {}) | {f"val_{name}" for name in logs or {}}
            if known and self.monitor not in known:
                raise ValueError(
                    f"ParallelModelCheckpoint(save_best_only=True) monitors "
                    f"'{self.monitor}', but this model does not report it, so "
                    f"no checkpoint could ever be judged best. It reports "
                    f"{sorted(known)} (val_ ones only with validation data). "
                    f"Pass monitor= one of those. Received: monitor={self.monitor!r}"
                )
        super().on_train_batch_end(batch, logs)


def _check_local(path, caller: str, name: str) -> None:
    """Refuses remote paths (gs://, s3://, hdfs://), which atomic renames cannot serve."""
    if "://" in str(path):
        raise ValueError(
            f"{caller} writes local files only: it replaces them by renaming a "
            "finished temporary file, which remote storage cannot do atomically. "
            "Write to a local or mounted folder and copy the files to remote "
            f"storage from there. Received: {name}={path!r}"
        )


def _check_writable(filepath: str) -> None:
    _check_local(filepath, "ParallelModelCheckpoint", "filepath")
    folder = os.path.dirname(os.path.abspath(filepath)) or "."
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise ValueError(
            f"ParallelModelCheckpoint cannot write checkpoints to '{folder}': "
            f"'{existing}' is not a writable folder, so every save would fail "
            "after training time had been spent. Pick a folder you can write "
            f"to, or fix its permissions. Received: filepath={filepath!r}"
        )


class ParallelBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that resumes a parallel model exactly, and survives a kill.

    It backs up the whole training state of a parallel model (the template's
    weights and the optimizer), writes it to a temporary file renamed into
    place, with the epoch stored inside that file (Keras writes the weights in
    place and the epoch in a separate JSON file, so a kill in between can
    tear the backup or pair new weights with an old epoch), and restores it
    when the same training command runs again: epoch, weights and optimizer
    state continue where the interrupted run stopped. Arguments are those of
    `keras.callbacks.BackupAndRestore`.

    In a multi-worker cluster only the chief writes and deletes the backup;
    every worker restores from it, so `backup_dir` must be a folder all
    workers can read (a shared file system across machines).

    Args:
        backup_dir: Folder for the backup; deleted when training finishes.
        save_freq: `"epoch"`, or an int: back up every that many batches.
            With an int, a resumed run starts the interrupted epoch over (as
            Keras does), so only `"epoch"` resumes exactly.
        double_checkpoint: Also keep the previous backup.
        delete_checkpoint: Delete the backup when training finishes.

    Example:

    ```python
    import keras, numpy as np, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model)
    parallel.compile(optimizer="adam", loss="mse")
    backup = kerasmulti.ParallelBackupAndRestore("backup")  # same line on restart
    parallel.fit(np.ones((32, 4)), np.ones((32, 1)), epochs=3, callbacks=[backup], verbose=0)
    ```
    """

    def __init__(self, backup_dir, *args, **kwargs):
        _check_local(backup_dir, "ParallelBackupAndRestore", "backup_dir")
        super().__init__(backup_dir, *args, **kwargs)

    def set_model(self, model):
        # A parallel model's weights file is its template's, which carries the
        # shared optimizer (see ParallelModel.compile): the full training state.
        super().set_model(_AtomicSaver(model, model))

    def _save_model(self):
        # Keras writes the weights, then the epoch in a JSON file: a kill in
        # between pairs new weights with an old epoch. Here the epoch also
        # travels inside the weights file, which is replaced atomically.
        if not _cluster.is_chief():
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        metadata = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
        if self.double_checkpoint and os.path.exists(self._weights_path):
            _atomic.write(self._prev_weights_path, lambda tmp: shutil.copyfile(self._weights_path, tmp))

        def save(tmp):
            self.model.save_weights(tmp)
            with h5py.File(tmp, "a") as f:
                f.attrs[_METADATA] = metadata

        _atomic.write(self._weights_path, save)
        _faults.reached("backup:weights")
        _atomic.write(self._training_metadata_path, lambda tmp: _write_text(tmp, metadata))

    def on_train_end(self, logs=None):
        if _cluster.is_chief():
            super().on_train_end(logs)

    def _load_model(self):
        if _cluster.is_chief():
            _atomic.remove_stale_temporaries(self._weights_path)
        super()._load_model()
        if os.path.exists(self._weights_path):
            with h5py.File(self._weights_path, "r") as f:
                metadata = f.attrs.get(_METADATA)
            if metadata is not None:
                self.model._initial_epoch = json.loads(metadata)["epoch"]


_METADATA = "kerasmulti_training_metadata"


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
