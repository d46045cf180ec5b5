"""Checks of user arguments that need no TensorFlow (the launcher uses them too): numbers, and the paths of files to read or write."""

from __future__ import annotations

import math
import numbers
import os
import zipfile

import numpy as np


def is_int(value) -> bool:
    """True for ints, numpy's included; False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_positive_int(value) -> bool:
    """True for an int of at least 1; False for bools, floats and anything else."""
    return is_int(value) and value >= 1


def check_save_freq(save_freq, caller: str) -> None:
    """Refuses a callback's `save_freq` that is neither "epoch" nor a positive int (a bool included)."""
    if not (isinstance(save_freq, str) and save_freq == "epoch") and not is_positive_int(save_freq):
        raise ValueError(f"Invalid value for {caller}'s save_freq: it must be 'epoch' or a positive int. Received: save_freq={save_freq!r}")


def is_real(value) -> bool:
    """True for a finite real number, numpy's included; False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def is_positive_finite(value) -> bool:
    """True for a real number above 0 and below infinity, numpy's included; False for bools."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(value)
        and value > 0
    )


def check_bool(value, caller: str, name: str, meaning: str) -> None:
    """Refuses anything but True or False: a string such as 'no' would count as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{caller}'s {name} must be True or False ({meaning}). Received: {name}={value!r}"
        )


def check_readable_file(filepath, kind: str, not_found: type[Exception] = ValueError) -> None:
    """Says what is wrong with a local file Keras would call "not found", or fail to open with a low-level error.

    `kind` names the file ("model", "weights"); `not_found` is the error a
    missing one raises, as Keras raises it (`load_model` a ValueError,
    `load_weights` a FileNotFoundError).
    """
    if not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath):
        return
    path = str(filepath)
    if not os.path.exists(path):
        raise not_found(f"The {kind} file '{path}' does not exist. Check the path. Received: filepath={path!r}")
    if not os.path.isfile(path):
        return
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise ValueError(
            f"'{path}' is not a readable .keras file: a .keras file is a zip archive, and this one is not. "
            f"Save the {kind} again, or load the original. Received: filepath={path!r}"
        )
    if path.endswith(".h5") and not _opens_as_hdf5(path):
        raise ValueError(
            f"'{path}' is not a readable HDF5 file. Save the {kind} again, or load the original. Received: filepath={path!r}"
        )


def _opens_as_hdf5(path: str) -> bool:
    import h5py  # only where an .h5 file is read

    try:
        with h5py.File(path, "r"):
            return True
    except OSError:
        return False


def check_save_path(method: str, filepath, folder_allowed: bool = False) -> None:
    """Refuses a local path that is a folder, or whose folder does not exist, before anything is written."""
    if not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath):
        return
    path = str(filepath)
    if os.path.isdir(path) and not folder_allowed:
        raise IsADirectoryError(
            f"{method}() cannot write '{path}': it is a folder. Pass a file name. Received: filepath={path!r}"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"{method}() cannot write: its folder '{os.path.dirname(path)}' does not exist. Create it with "
            f"os.makedirs({os.path.dirname(path)!r}, exist_ok=True). Received: filepath={path!r}"
        )
