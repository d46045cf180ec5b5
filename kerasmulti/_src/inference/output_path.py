"""Whether a path can name an output file: answered without loading TensorFlow (the command asks first)."""

from __future__ import annotations

import os


def path_problem(path: str) -> str | None:
    """Why `path` cannot name the output file ("empty", "numpy", "folder", "special"), or None; callers say it in their words."""
    if not path:
        return "empty"
    if path.lower().endswith((".npy", ".npz")):
        return "numpy"  # written anyway, it would be an HDF5 file that np.load cannot read
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return "folder"
    if os.path.exists(path) and not os.path.isfile(path):
        return "special"  # a pipe, a device or a socket: opening a pipe would wait for a writer forever
    return None
