"""A ModelCheckpoint for parallel models: saves the template, atomically.

`ParallelModelCheckpoint` is `keras.callbacks.ModelCheckpoint` with three
changes: it saves the template behind a parallel model (never the wrapper);
every write goes to a temporary file beside the target that is renamed into
place, so a killed process leaves the previous good checkpoint or the new
one; and a target no save could write (a file where a folder must be, a
template Keras cannot fill in, a field the logs never have) is refused at
construction or after the first batch, not after an epoch of training. The
path checks at the bottom serve `backup_and_restore` too.
"""

from __future__ import annotations

import difflib
import glob
import inspect
import os
import string

import keras

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.parallel_model import unwrap
from kerasmulti._src.utils import arguments as _arguments
from kerasmulti._src.utils import atomic as _atomic
from kerasmulti._src.utils import fault_points as _fault_points


class _TemplateFirst(type):
    """Takes the Keras 2 form `ParallelModelCheckpoint(template_model, filepath, ...)`.

    The rule: a `keras.Model` as the first positional argument is the model to
    save. It is taken off before `__init__` binds the rest, so `__init__` keeps
    `ModelCheckpoint`'s exact signature and the old form's keywords
    (`filepath=`, `monitor=`) bind as they did in Keras 2.
    """

    def __call__(cls, *args, **kwargs):
        if not (args and isinstance(args[0], keras.Model)):
            return super().__call__(*args, **kwargs)
        template, args = args[0], args[1:]
        if not args and "filepath" not in kwargs:
            raise TypeError(
                f"{cls.__name__} got a model but no filepath. Pass one: {cls.__name__}(model, 'model.keras'). "
                f"Received: template_model={template!r}"
            )
        callback = super().__call__(*args, **kwargs)
        callback._template = unwrap(template)
        return callback

    @property
    def __signature__(cls):
        # What help() and IDEs show: __init__'s arguments, not __call__'s (*args, **kwargs).
        return inspect.Signature(list(inspect.signature(cls.__init__).parameters.values())[1:])


class ParallelModelCheckpoint(keras.callbacks.ModelCheckpoint, metaclass=_TemplateFirst):
    """A drop-in `ModelCheckpoint` that saves the template model, atomically.

    Every argument means what it means in `keras.callbacks.ModelCheckpoint`,
    and on a plain model it behaves like it. On a model returned by
    `kerasmulti.parallelize` it saves the template, so the file loads with
    `keras.models.load_model` (or `load_weights`) on any number of devices,
    without kerasmulti. Each save is written to a temporary file beside the
    target and renamed into place: a process killed at any moment leaves the
    previous checkpoint or the new one, never a torn file; temporaries left
    by killed processes are removed when training starts. A `filepath` that
    is a link is written through, as Keras does. `callback.model`
    is the model being trained, as in Keras.

    The Keras 2 form `ParallelModelCheckpoint(template_model, filepath, ...)`
    also works: a `keras.Model` as first argument is the model saved, and
    the other arguments follow it as in `ModelCheckpoint`.

    In a multi-worker cluster only the chief (worker 0) writes; the other
    workers hold the same weights and never touch the file.

    Args:
        filepath: Where to save: ends in `.keras`, `.h5` (legacy HDF5) or,
            with `save_weights_only=True`, `.weights.h5`. May hold format
            fields such as `"w-{epoch:02d}-{val_loss:.2f}.keras"`: `epoch`,
            `batch` (with an int `save_freq`) and the names in the logs.
            Missing folders are created at the first save.
        monitor: The metric to monitor for `save_best_only`.
        verbose: 0 is silent, 1 prints a line per save.
        save_best_only: Save only when `monitor` improves.
        save_weights_only: Save only the weights.
        mode: `"auto"`, `"min"` or `"max"`: which way `monitor` improves.
        save_freq: `"epoch"`, or an int: save every that many batches.
        initial_value_threshold: The value `monitor` must beat to be saved.

    Raises:
        TypeError: If `filepath` is not a path, or the Keras 2 form lacks it;
            if `initial_value_threshold` is not a number.
        ValueError: At construction, if `mode` is not "auto", "min" or "max",
            `verbose` not 0 or 1, or `filepath` cannot be filled in (an
            unbalanced brace, a format such as `{loss:d}` that does not fit
            a float), is remote, is an existing folder, or lies under a file
            or a folder this process cannot write; if its suffix does not fit
            `save_weights_only`, or `save_freq` is neither `"epoch"` nor a
            positive int. After the first batch, if `filepath` names a field
            the logs do not have, or `save_best_only` with `mode="auto"`
            monitors a metric the model does not report (with an explicit
            mode, Keras warns at each save instead). When training starts, if
            the whole model is to be saved and its class cannot be written
            (a subclassed model, such as a GAN, without `get_config`).

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

    def __init__(
        self,
        filepath: str | os.PathLike,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
    ):
        if not isinstance(filepath, (str, os.PathLike)):
            raise TypeError(
                "ParallelModelCheckpoint's filepath must be a path (after the model, if any). "
                f"Received: filepath={filepath!r}"
            )
        check_local(filepath, "ParallelModelCheckpoint", "filepath")
        _arguments.check_save_freq(save_freq, "ParallelModelCheckpoint")
        if not isinstance(monitor, str):
            raise TypeError(
                "ParallelModelCheckpoint's monitor must be a metric name, e.g. 'val_loss'. "
                f"Received: monitor={monitor!r}"
            )
        if mode not in ("auto", "min", "max"):
            # Keras warns and falls back to "auto", which may save the worst model as the best.
            raise ValueError(
                f"ParallelModelCheckpoint's mode must be 'min', 'max' or 'auto'. Received: mode={mode!r}"
            )
        if verbose not in (0, 1) or isinstance(verbose, bool):
            # Keras compares it with 0 only once it saves, after the first epoch.
            raise ValueError(
                f"ParallelModelCheckpoint's verbose must be 0 or 1. Received: verbose={verbose!r}"
            )
        _arguments.check_bool(save_best_only, "ParallelModelCheckpoint", "save_best_only", "keep only the best file")
        _arguments.check_bool(save_weights_only, "ParallelModelCheckpoint", "save_weights_only", "save weights only")
        if initial_value_threshold is not None and not _arguments.is_real(initial_value_threshold):
            raise TypeError(
                "ParallelModelCheckpoint's initial_value_threshold must be a finite number or None. "
                f"Received: initial_value_threshold={initial_value_threshold!r}"
            )
        super().__init__(
            filepath, monitor, verbose, save_best_only, save_weights_only, mode, save_freq, initial_value_threshold
        )
        self._names, trial = _fields(self.filepath)
        check_target(trial, "ParallelModelCheckpoint", "filepath", self.filepath)
        self._template = None  # the Keras 2 form's model (see _TemplateFirst)
        self._saved = None
        self._names_checked = False

    def set_model(self, model):
        super().set_model(model)
        # A parallel model's own save() writes its template (with the compile
        # settings); a Keras 2 form's model that is another one is saved as it is.
        template = self._template
        self._saved = model if template is None or template is unwrap(model) else template
        if not _cluster.is_chief():
            self.verbose = 0  # it saves nothing here, so it reports nothing

    def on_train_begin(self, logs=None):
        if _cluster.is_chief():  # another worker's temporary may be the chief's save in flight
            for folder in _folders(self.filepath):
                _atomic.remove_stale_temporaries_in(folder)
        self._names_checked = False
        if not self.save_weights_only:
            _check_serializable(unwrap(self._saved))
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        # Names are known from the first batch's logs: a typo fails after one
        # batch, not with Keras' error after a whole epoch.
        if not self._names_checked and logs:
            self._names_checked = True
            self._check_names(set(logs))
        super().on_train_batch_end(batch, logs)

    def _check_names(self, reported: set) -> None:
        """Refuses a monitor or filepath field that no log of this model will hold."""
        # A fit without validation data reports no val_ names (a plain Keras model: unknown, so allowed).
        validates = getattr(self.model, "_validates", None) is not False
        known = reported | ({f"val_{name}" for name in reported} if validates else set())
        # With an explicit mode, a metric another callback adds to the epoch
        # logs is legitimate; Keras warns at save time if it is missing.
        if self.save_best_only and self.mode == "auto" and self.monitor not in known:
            near = ", ".join(repr(name) for name in difflib.get_close_matches(self.monitor, sorted(known), n=3, cutoff=0))
            near += ", ..." if len(known) > 3 else ""
            raise ValueError(
                f"ParallelModelCheckpoint's monitor is not a metric this model reports ({near}). Name one, or pass "
                f"mode='min' or 'max' if a callback adds it. Received: monitor={self.monitor!r}"
            )
        if self.save_freq != "epoch":  # filled in from the batch's logs, which have no val_ metrics
            self._check_fields(reported | {"batch", "epoch"}, "this model does not report")
        elif "batch" in self._names:  # Keras fills batch in for batch-level saves only
            self._check_fields(known | {"epoch"}, "saves at an epoch's end do not have (save_freq='epoch')")
        # Other fields of an epoch-level save are checked at its end: other callbacks
        # add to the epoch's logs (LearningRateScheduler's learning_rate).

    def _check_fields(self, available: set, why: str) -> None:
        missing = sorted(self._names - available)
        if missing:
            raise ValueError(
                f"ParallelModelCheckpoint's filepath names {missing}, which {why}. Use {sorted(available)}. "
                f"Received: filepath={self.filepath!r}"
            )

    def _save_model(self, epoch, batch, logs):
        # Keras' version, with the save made atomic and errors that name the user's path.
        logs = logs or {}
        given = set(logs) | {"epoch"} | ({"batch"} if batch is not None else set())
        self._check_fields(given, f"this {'epoch' if batch is None else 'batch'}'s logs do not have")
        if self.save_best_only and self.monitor_op is None:  # Keras sets it at an epoch's end: batch saves crashed
            keras_private.set_monitor_op(self)
        filepath = keras_private.checkpoint_file_path(self, epoch, batch, logs)
        if not keras_private.checkpoint_should_save(self, epoch, batch, logs, filepath):
            return
        if _cluster.is_chief():  # every worker holds the same weights
            self._write(filepath)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")

    def _write(self, filepath: str) -> None:
        if os.path.isdir(filepath):
            raise IsADirectoryError(
                f"ParallelModelCheckpoint's filled-in filepath '{filepath}' is a folder. Remove it or change the filepath. "
                f"Received: filepath={self.filepath!r}"
            )
        writer = self._saved.save_weights if self.save_weights_only else self._saved.save

        def save(temporary):
            writer(temporary, overwrite=True)
            _fault_points.reached("checkpoint:write")  # the new file is complete; the old one still in place

        then = (
            "Training stopped at this save; with a ParallelBackupAndRestore in the same fit(), "
            "running it again resumes from its last backup."
        )
        _atomic.write(filepath, save, "ParallelModelCheckpoint", f"filepath={self.filepath!r}", then)


class _TrialValues(dict):
    """What Keras fills a filepath in with, as trial values: epoch and batch ints, every log a float."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __missing__(self, name):
        self.names.add(name)
        return 1 if name in ("epoch", "batch") else 0.5


def _fields(filepath: str) -> tuple[set, str]:
    """The names `filepath` is filled in with, and a path it gives; refuses one Keras could not fill in."""
    trial = _TrialValues()
    try:
        path = filepath.format_map(trial)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
        # Refused here because every save would fail. Python's own error says
        # which field is wrong, e.g. `{loss:d}`: logged values are floats.
        raise ValueError(
            f"ParallelModelCheckpoint cannot fill in its filepath ({error}). Use fields like {{epoch:02d}}. "
            f"Received: filepath={filepath!r}"
        ) from None
    return trial.names, path


def _folders(filepath: str) -> set:
    """The existing folders `filepath` fills in to, and those of the files there that are links."""
    pattern = "".join(
        glob.escape(text) + ("*" if field is not None else "") for text, field, _, _ in string.Formatter().parse(filepath)
    )
    folders = {os.path.realpath(folder) for folder in glob.glob(os.path.dirname(os.path.abspath(pattern)))}
    return folders | {os.path.dirname(os.path.realpath(path)) for path in glob.glob(pattern) if os.path.islink(path)}


def check_local(path, caller: str, name: str) -> None:
    """Refuses remote paths (gs://, s3://, hdfs://), which atomic renames cannot serve."""
    if "://" in str(path):
        # Each save renames a finished temporary over the target, which
        # remote storage cannot do atomically.
        raise ValueError(
            f"{caller} writes local files only. Use a local or mounted folder. Received: {name}={path!r}"
        )


def check_target(path, caller: str, name: str, value, folder: bool = False) -> None:
    """Refuses a file (or, with `folder`, a folder) target that no save could write.

    Missing folders are fine (they are created at the first save); the
    nearest existing one must be a folder this process can write into.
    """
    path = os.path.abspath(path)
    if not folder and os.path.isdir(path):
        raise ValueError(
            f"{caller}'s {name} is an existing folder, where a file must go. Name a file. Received: {name}={value!r}"
        )
    existing = path if folder else os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"{caller} cannot create the folder for its {name}: '{existing}' is a file. Remove it. Received: {name}={value!r}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY
        reason = "its file system is read-only" if read_only else "permission denied"
        raise ValueError(
            f"{caller} cannot write into '{existing}': {reason}. Pick another folder. Received: {name}={value!r}"
        )


def _check_serializable(template) -> None:
    """Refuses, before the first step, a whole-model file Keras would fail to write after an epoch."""
    try:
        template.get_config()
    except NotImplementedError as error:
        raise ValueError(
            f"ParallelModelCheckpoint cannot save the whole '{template.name}': its class has no get_config(). "
            "Pass save_weights_only=True. Received: save_weights_only=False"
        ) from error
