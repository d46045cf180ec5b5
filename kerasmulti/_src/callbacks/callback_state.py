"""The state of Keras' callbacks that decide from past epochs, kept in a backup.

`ReduceLROnPlateau` and `EarlyStopping` count the epochs without improvement
and keep the best value (`EarlyStopping(restore_best_weights=True)` the best
epoch's weights too). Keras' `BackupAndRestore` keeps none of it, so a
resumed run started their patience afresh: it reduced the learning rate and
stopped later than the run it continues. A backup keeps their state as it is
when it is written, and the resumed run's first epoch starts with it (their
`on_train_begin` has reset them by then). A backup written at an epoch's end
sees their update of that epoch only if they come before it in `callbacks`.
"""

from __future__ import annotations

import json

import keras

# What each class keeps from epoch to epoch (EarlyStopping's best weights: `best_weights`).
FIELDS = {
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.EarlyStopping: ("wait", "best", "best_epoch"),
}


def kept(callbacks) -> list:
    """The callbacks among `callbacks` whose state a backup keeps, in order."""
    return [c for c in callbacks or [] if isinstance(c, tuple(FIELDS))]


def _fields(callback) -> tuple:
    return next(names for cls, names in FIELDS.items() if isinstance(callback, cls))


def state(callbacks) -> tuple[str, list]:
    """The kept callbacks' state (JSON) and their best weights (a list of arrays, or None, each)."""
    fields = [
        {name: None if getattr(c, name) is None else float(getattr(c, name)) for name in _fields(c)}
        for c in kept(callbacks)
    ]
    return json.dumps(fields), [getattr(c, "best_weights", None) for c in kept(callbacks)]


def restore(callbacks, saved: str, best_weights: list) -> bool:
    """Gives the kept callbacks the state of a backup; False where they are not those it kept."""
    callbacks, fields = kept(callbacks), json.loads(saved)
    if [sorted(f) for f in fields] != [sorted(_fields(c)) for c in callbacks]:
        return False
    for callback, values, weights in zip(callbacks, fields, best_weights):
        for name, value in values.items():
            setattr(callback, name, value if name == "best" or value is None else int(value))
        if hasattr(callback, "best_weights"):
            callback.best_weights = weights
    return True


def after(backup, callbacks) -> list[str]:
    """The kept callbacks that come after `backup` in `callbacks` (their epoch's end is not in its epoch-end backup)."""
    callbacks = list(callbacks or [])
    if backup not in callbacks:
        return []
    return [type(c).__name__ for c in kept(callbacks[callbacks.index(backup) + 1:])]
