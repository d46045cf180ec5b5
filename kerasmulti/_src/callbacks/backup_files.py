"""The files of a backup: where it resumes (its metadata), and whether a file reads whole.

`ParallelBackupAndRestore` keeps the position (epoch, step, the epochs'
steps, the shuffled order's seed) as JSON inside the weights file
(`METADATA`), and in Keras' `training_metadata.json` beside it; a backup
Keras wrote has only the latter. A file that cannot be read is `Damaged`.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

METADATA = "kerasmulti_training_metadata"


class Damaged(Exception):
    """A backup file that cannot be read; `reason` says why."""

    def __init__(self, path: str, reason: Exception):
        super().__init__(path, reason)
        self.path, self.reason = path, reason


def read_metadata(weights: str, metadata: str) -> dict:
    """Where a backup resumes (`epoch`, `step`, ...): from inside the weights file, else Keras' JSON file."""
    try:
        with h5py.File(weights, "r") as f:
            text, source = f.attrs.get(METADATA), weights
    except OSError as error:
        raise Damaged(weights, error) from error
    if text is None and not os.path.exists(metadata):
        raise Damaged(weights, ValueError(
            "it holds no epoch, and there is no training_metadata.json beside it: a weights file that no "
            "backup callback wrote, or a Keras backup whose first save was cut short"
        ))
    try:
        if text is None:  # a backup Keras wrote
            text, source = _read_text(metadata), metadata
        fields = json.loads(text)
        if not _position(fields):
            raise ValueError(f"it holds no epoch number: {str(text)[:80]!r}")
    except (OSError, ValueError) as error:
        raise Damaged(source, error) from error
    return fields


def unreadable(path: str) -> Exception | None:
    """The error that reading every object of HDF5 file `path` raises; None: the file reads whole."""

    def read(name, item):
        if isinstance(item, h5py.Dataset):
            item[()]

    try:
        with h5py.File(path, "r") as f:
            f.visititems(read)
    except Exception as error:  # h5py raises OSError, KeyError or RuntimeError for a damaged object
        return error
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def scalar_logs(logs: dict | None) -> dict:
    """The numbers among a step's `logs`, as floats (JSON)."""
    arrays = {key: np.asarray(value) for key, value in (logs or {}).items()}
    return {key: float(a.reshape(())) for key, a in arrays.items() if a.size == 1 and np.issubdtype(a.dtype, np.number)}


def _position(fields) -> bool:
    """Whether metadata read from a backup holds an epoch, and its other fields as a backup writes them."""
    if not isinstance(fields, dict) or "epoch" not in fields:
        return False
    logs = fields.get("logs", {})
    return (
        all(_count(fields.get(k, 0)) for k in ("epoch", "step"))
        and (fields.get("steps") is None or _count(fields["steps"]))
        and isinstance(logs, dict)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logs.values())
    )


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
