"""A BackupAndRestore that resumes a parallel model exactly, and survives a kill.

`ParallelBackupAndRestore` writes the files `keras.callbacks.BackupAndRestore`
writes, in the same folder layout, so either callback resumes from the
other's folder. What differs:

- Each file is replaced atomically (a temporary renamed into place), and
  the position (epoch and step) also travels inside the weights file: Keras
  writes the weights, then the epoch in a JSON file, so a kill in between
  pairs new weights with an old epoch.
- A resumed run is the uninterrupted one, step for step: the backup also
  holds the seed states, the shuffled order's seed and the metrics
  (`training_state.py`), and a run resumed in the middle of an epoch passes
  over the batches already trained instead of starting the epoch over.
- SIGTERM backs up the step in flight and exits 42, "requeue"
  (`preemption.py`).
- A damaged backup falls back to the previous one (`double_checkpoint=True`)
  with a warning, or stops with an error that names the file, where Keras
  would raise h5py's or json's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings

import keras

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import keras_private
from kerasmulti._src.callbacks import backup_files as _files
from kerasmulti._src.callbacks import callback_state as _callback_state
from kerasmulti._src.callbacks import preemption as _preemption
from kerasmulti._src.callbacks import training_state as _training_state
from kerasmulti._src.callbacks.model_checkpoint import check_local, check_target
from kerasmulti._src.data_parallel import persistence as _persistence
from kerasmulti._src.utils import arguments as _arguments
from kerasmulti._src.utils import atomic as _atomic
from kerasmulti._src.utils import fault_points as _fault_points


class ParallelBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that resumes a parallel model exactly, and survives a kill.

    It backs up the whole training state of a parallel model (the template's
    weights and the optimizer, the states of Dropout and other seeded
    layers, the seed of `fit`'s shuffled order, the metrics, and the epoch
    and step), writes it to a temporary file renamed into place (Keras writes
    the weights in place and the epoch in a separate JSON file, so a kill in
    between can tear the backup or pair new weights with an old epoch), and
    restores it when the same training command runs again: the resumed run
    ends with the weights the uninterrupted one would have, with `fit`'s
    defaults (`shuffle=True`), also from a backup written in the middle of an
    epoch, whose batches already trained are passed over. Arguments are those
    of `keras.callbacks.BackupAndRestore`, and the folder holds the same
    files, so either callback resumes from the other's backup.

    SIGTERM while `fit` runs (a preempted machine) ends the step in flight,
    backs it up and exits with code 42 ("requeue"); across workers all stop
    after the same step. Running the same command resumes after that step.

    A damaged backup (a torn weights file, or for a backup Keras wrote, a
    torn epoch file) falls back to the previous one if `double_checkpoint`
    kept it, with a warning; otherwise training stops with an error naming
    the file, before any epoch runs.

    In a multi-worker cluster only the chief writes and deletes the backup;
    every worker restores from it, so `backup_dir` must be a folder all
    workers can read (a shared file system across machines).

    Args:
        backup_dir: Folder for the backup; deleted when training finishes.
        save_freq: `"epoch"`, or an int: back up every that many batches
            too. A run resumed from such a backup goes on from its step (Keras
            starts the interrupted epoch over).
        double_checkpoint: Also keep the previous backup (the `.bkp` files),
            to fall back to if the latest is damaged.
        delete_checkpoint: Delete the backup when training finishes.

    Raises:
        TypeError: If `backup_dir` is not a path, or `double_checkpoint` or
            `delete_checkpoint` is not a bool.
        ValueError: If `backup_dir` is empty, remote, a file, or under a file
            or a folder this process cannot write; if `save_freq` is neither
            `"epoch"` nor a positive int; when training starts, if the backup
            does not fit the model (a changed model), or resumes at a step
            that the model's `steps_per_execution` does not reach (changed
            since the backup was written), or mid-epoch where the epochs
            now have another number of steps (another `batch_size` or data).
        OSError: When training starts, if the backup is damaged and there is
            no previous backup to fall back to, or that is damaged too.

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

    resumes_input_order = True  # `fit` draws shuffled arrays from a seed this backup keeps

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        if backup_dir is None or backup_dir == "":
            raise ValueError(
                "Empty `backup_dir` argument passed: ParallelBackupAndRestore needs a folder to keep its backup in, "
                f"such as 'backup'. Received: backup_dir={backup_dir!r}"
            )
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                "ParallelBackupAndRestore's backup_dir must be a folder path, e.g. 'backup'. "
                f"Received: backup_dir={backup_dir!r}"
            )
        _arguments.check_save_freq(save_freq, "ParallelBackupAndRestore")
        _arguments.check_bool(double_checkpoint, "ParallelBackupAndRestore", "double_checkpoint", "keep the previous backup too")
        _arguments.check_bool(delete_checkpoint, "ParallelBackupAndRestore", "delete_checkpoint", "delete the backup at the end")
        super().__init__(backup_dir, save_freq, double_checkpoint, delete_checkpoint)
        check_local(backup_dir, "ParallelBackupAndRestore", "backup_dir")
        check_target(backup_dir, "ParallelBackupAndRestore", "backup_dir", backup_dir, folder=True)

    def on_train_begin(self, logs=None):
        paths = keras_private.backup_paths(self)
        if _cluster.is_chief():
            _atomic.remove_stale_temporaries(paths["weights"])
        self._position, self._resumed, self._metrics, self._scalars, self._callbacks = (0, 0), (0, 0), None, [], None
        self._logs = None
        late = _callback_state.after(self, getattr(self.model, "_fit_callbacks", None)) if self.save_freq == "epoch" else []
        if late:
            warnings.warn(
                f"ParallelBackupAndRestore backs up at an epoch's end before {late} update their state, so a "
                f"resumed run misses that epoch's. Put it after them in callbacks. Received: callbacks={late}",
                stacklevel=2,
            )
        try:
            fields = self._restore(paths["weights"], paths["metadata"])
        except _files.Damaged as damaged:
            fields = self._restore_previous(damaged)
        if fields is not None:
            self._resumed = (fields["epoch"], fields.get("step", 0))
            keras_private.set_initial_epoch(self.model, fields["epoch"])
            order = getattr(self.model, "_input_order", None)
            if order is not None and "order_seed" in fields:
                order.seed.assign(fields["order_seed"])
            if self._resumed[1]:
                self._scalars = _training_state.optimizer_scalars(self.model)
                logs = None if self._metrics else fields.get("logs")  # across workers no metric is saved
                _training_state.skip_steps(self.model, self._resumed[1], self._restore_metrics, logs)
        self._watch = _preemption.Watch(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._position = (epoch, 0)
        if self._callbacks is not None:  # after every callback's on_train_begin, which resets them
            _callback_state.restore(getattr(self.model, "_fit_callbacks", None), *self._callbacks)
            self._callbacks = None

    def _restore_metrics(self, batch) -> None:
        # The epoch's start ran again: its callbacks may have set the learning rate once more.
        for variable, value in self._scalars:
            variable.assign(value)
        # Keras reset the metrics as the epoch began; they go on from the backup's.
        if self._metrics is not None:
            try:
                _training_state.restore_metrics(self.model, self._metrics, batch)
            except ValueError as error:
                self._refuse(self._weights_read, str(error))

    def on_train_batch_end(self, batch, logs=None):
        epoch = self._position[0]
        self._position, self._logs = (epoch, batch + 1), logs
        due = keras_private.backup_due(self, batch)
        stop = self._watch.agreed()
        # Batches a resumed epoch passes over: the weights are already those of a later step.
        passing_over = (epoch, batch + 1) < self._resumed
        if (due or stop) and not passing_over:
            self._save_model()
        if stop:
            self._leave(saved=not passing_over)

    def on_epoch_end(self, epoch, logs=None):
        self._position = (epoch + 1, 0)
        super().on_epoch_end(epoch, logs)  # saves when save_freq="epoch"
        if self._watch.agreed():
            if self.save_freq != "epoch":
                self._save_model()
            self._leave(saved=True)

    def _leave(self, saved: bool) -> None:
        epoch, step = self._position if saved else self._resumed
        where = f"after step {step} of epoch {epoch + 1}" if step else f"at the start of epoch {epoch + 1}"
        if epoch == (self.params or {}).get("epochs"):
            where = "at the end of training, with nothing left to train"
        _preemption.leave(
            self.model,
            _cluster.is_chief()
            and f"kerasmulti: SIGTERM received; the backup in '{self.backup_dir}' resumes {where}. Exiting with "
            f"code {_preemption.REQUEUE_EXIT_CODE} (requeue): run the same command to go on from there.",
        )

    def _restore_previous(self, damaged: _files.Damaged):
        """Resumes from the `.bkp` files, as Keras does, and says so."""
        paths = keras_private.backup_paths(self)
        latest, previous = paths["weights"], paths["previous_weights"]
        if not os.path.exists(previous):
            raise OSError(
                f"ParallelBackupAndRestore cannot resume: '{damaged.path}' is damaged ({damaged.reason}) "
                f"and there is no previous backup. Delete backup_dir to start over. "
                f"Received: backup_dir={self.backup_dir!r}"
            ) from damaged.reason
        warnings.warn(
            f"The backup '{damaged.path}' is damaged ({damaged.reason}); resuming from the previous one. "
            f"Received: backup_dir={self.backup_dir!r}",
            stacklevel=3,
        )
        try:
            epoch = self._restore(previous, paths["previous_metadata"])
        except _files.Damaged as too:
            raise OSError(
                f"ParallelBackupAndRestore cannot resume: '{damaged.path}' and the previous backup are both "
                f"damaged ({too.reason}). Delete backup_dir to start over. "
                f"Received: backup_dir={self.backup_dir!r}"
            ) from too.reason
        if _cluster.is_chief():
            # The previous backup becomes the latest, as in Keras, so that the
            # next save keeps it as `.bkp` instead of the damaged file.
            pairs = ((previous, latest), (paths["previous_metadata"], paths["metadata"]))
            for source, target in pairs:
                if os.path.exists(source):
                    self._write(target, lambda tmp, source=source: shutil.copyfile(source, tmp))
                elif os.path.exists(target):
                    os.remove(target)
        return epoch

    def _restore(self, weights: str, metadata: str):
        """Loads `weights` and returns the backup's metadata (None: no backup)."""
        if not os.path.exists(weights):
            return None
        fields = _files.read_metadata(weights, metadata)
        self._check_steps(fields)  # before the model is touched
        try:
            with tempfile.TemporaryDirectory() as folder:
                source = weights
                if not weights.endswith(".weights.h5"):  # Keras reads the format from the suffix, which `.bkp` hides
                    source = os.path.join(folder, "previous.weights.h5")
                    shutil.copyfile(weights, source)
                # A parallel model's load_weights fills its optimizers too; a plain model's (Keras') does not.
                fills = isinstance(self.model, _persistence.TemplatePersistence)
                with contextlib.nullcontext() if fills else _persistence.optimizers_loaded(self.model, source):
                    self.model.load_weights(source)
            state = _training_state.read(weights)
        except OSError as error:
            raise _files.Damaged(weights, error) from error
        except ValueError as error:
            unreadable = _files.unreadable(weights)  # Keras reports a damaged object as one that does not fit
            if unreadable is not None:
                raise _files.Damaged(weights, unreadable) from error
            # Keras' own reason (the parallel model's load_weights wraps it).
            keras_error = error.__cause__ if isinstance(error.__cause__, ValueError) else error
            self._refuse(weights, _persistence.keras_load_reason(keras_error))
        self._weights_read = weights
        if state is not None:
            self._fit_state(_training_state.seed_states(self.model), state["seeds"], "seed states", weights)
            self._metrics = state["metrics"] if fields.get("step") else None
            self._callbacks = state["callbacks"]  # given back as the first epoch begins (`on_epoch_begin`)
        return fields

    def _check_steps(self, fields: dict) -> None:
        """Refuses to resume mid-epoch where the epochs have other steps: the backup's step names other rows."""
        step, steps, now = fields.get("step"), fields.get("steps"), (self.params or {}).get("steps")
        if step and steps is not None and now is not None and steps != now:
            raise ValueError(
                f"ParallelBackupAndRestore cannot resume after step {step} of {steps}: this fit's epochs have {now} "
                "steps. Fit with the batch_size and data of the backup, or delete backup_dir. "
                f"Received: steps={now}"
            )

    def _fit_state(self, variables, values, what: str, weights: str) -> None:
        try:
            _training_state.assign(variables, values, what)
        except ValueError as error:
            self._refuse(weights, str(error))

    def _refuse(self, weights: str, reason: str):
        raise ValueError(
            f"ParallelBackupAndRestore cannot resume from '{weights}': it does not fit the model being trained "
            f"({reason}). Build the model as it was, or delete backup_dir to start over. Received: backup_dir={self.backup_dir!r}"
        ) from None

    def _save_model(self):
        # Keras writes the weights, then the epoch in a JSON file: a kill in
        # between pairs new weights with an old epoch. Here the epoch also
        # travels inside the weights file, which is replaced atomically.
        if not _cluster.is_chief():
            return
        paths = keras_private.backup_paths(self)
        if self.double_checkpoint:
            pairs = ((paths["weights"], paths["previous_weights"]), (paths["metadata"], paths["previous_metadata"]))
            for source, target in pairs:
                if os.path.exists(source):
                    self._write(target, lambda tmp, source=source: shutil.copyfile(source, tmp))
        epoch, step = self._position
        # "batch" is Keras' (the last batch trained, 0 at an epoch's end; it
        # resumes at the epoch's start); "step" is the batches done in it.
        fields = {"epoch": epoch, "batch": max(step - 1, 0), "step": step, "steps": (self.params or {}).get("steps")}
        if step:  # the epoch's logs so far: what an epoch resumed with no batch left logs across workers
            fields["logs"] = _files.scalar_logs(self._logs)
        order = getattr(self.model, "_input_order", None)
        if order is not None:
            fields["order_seed"] = int(order.seed.numpy())
        metadata = json.dumps(fields)

        def save(tmp):
            self.model.save_weights(tmp)
            _training_state.write(self.model, tmp, {_files.METADATA: metadata})

        self._write(paths["weights"], save)
        _fault_points.reached("backup:weights")
        self._write(paths["metadata"], lambda tmp: _files.write_text(tmp, metadata))

    def _write(self, target: str, save) -> None:
        then = (
            "Training stopped; once that is fixed, running the same fit() again resumes from the "
            "last backup written (or starts over where there is none)."
        )
        _atomic.write(target, save, "ParallelBackupAndRestore", f"backup_dir={self.backup_dir!r}", then)

    def on_train_end(self, logs=None):
        if self._watch.agreed():
            # SIGTERM after this callback's last look (during another callback's epoch end): training is
            # over (also where EarlyStopping ended it), so the backup of its end stays, and a requeued run
            # resumes there, training nothing.
            self._watch.stop()
            self._position = ((self.params or {}).get("epochs", self._position[0]), 0)
            self._save_model()
            self._leave(saved=True)
        self._watch.stop()
        if _cluster.is_chief():
            super().on_train_end(logs)
