"""Whether a path can name an output file: answered without loading TensorFlow (the command asks first)."""

from __future__ import annotations

import os

# Formats an output gets named for that it would not be in: written anyway, it would be an
# HDF5 file under that name, which np.load, a CSV reader or a JSON parser cannot read.
_OTHER_FORMATS = {
    ".npy": "numpy's format", ".npz": "numpy's format", ".csv": "CSV", ".tsv": "CSV", ".txt": "text",
    ".json": "JSON", ".parquet": "Parquet", ".pkl": "a pickle", ".pickle": "a pickle",
}


def other_format(path: str) -> str | None:
    """The format `path`'s extension names, where it is not HDF5 ("numpy's format", "CSV", ...), or None."""
    return _OTHER_FORMATS.get(os.path.splitext(path)[1].lower())


def path_problem(path: str) -> str | None:
    """Why `path` cannot name the output file ("empty", "format", "folder", "special"), or None; callers say it in their words."""
    if not path:
        return "empty"
    if other_format(path):
        return "format"
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return "folder"
    if os.path.exists(path) and not os.path.isfile(path):
        return "special"  # a pipe, a device or a socket: opening a pipe would wait for a writer forever
    return None
