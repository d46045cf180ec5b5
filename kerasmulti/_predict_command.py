"""`kerasmulti predict MODEL INPUT --output OUT.h5`: batch inference from files.

INPUT is an HDF5 file (`--dataset NAME` picks the dataset), an `.npy` file
(memory-mapped, so it may exceed memory), or a folder of images, resized to
the model's input and read in name order; their file names are stored in the
output's `filenames` dataset. Mistakes a user can fix raise `ValueError`,
which the command prints as one line.
"""

from __future__ import annotations

import os

import h5py
import keras
import numpy as np

from kerasmulti import _sources
from kerasmulti._inference import parallel_predict


def _load_model(path: str):
    if not os.path.isfile(path):
        raise ValueError(f"The model file '{path}' does not exist. Received: model={path!r}")
    try:
        return keras.models.load_model(path)
    except Exception as error:  # Keras raises many kinds for a bad file
        raise ValueError(
            f"'{path}' could not be loaded as a Keras model ({type(error).__name__}: "
            f"{error}). Pass a .keras or .h5 model file. Received: model={path!r}"
        ) from error


def _hdf5_input(path: str, name: str | None, stack):
    f = stack.enter_context(h5py.File(path, "r"))
    names = []
    f.visititems(lambda key, item: names.append(key) if isinstance(item, h5py.Dataset) else None)
    if name is None and len(names) == 1:
        name = names[0]
    if name is None or name not in names:
        raise ValueError(
            f"'{path}' holds the datasets {names}; pass the one to predict on with "
            f"--dataset NAME. Received: dataset={name!r}"
        )
    return f[name]


def run(args) -> int:
    import contextlib

    model = _load_model(args.model)
    if not os.path.exists(args.input):
        raise ValueError(f"The input '{args.input}' does not exist. Received: input={args.input!r}")
    extra = {}
    with contextlib.ExitStack() as stack:
        if os.path.isdir(args.input):
            shape = tuple(model.inputs[0].shape[1:])
            if len(shape) != 3 or None in shape[:2]:
                raise ValueError(
                    f"A folder of images needs a model with one image input of known "
                    f"height and width; '{args.model}' takes {shape}. "
                    f"Received: input={args.input!r}"
                )
            data = _sources.ImageFolder(args.input, shape[0], shape[1], shape[2] or 3, args.batch_size)
            extra["filenames"] = np.array([os.path.basename(p) for p in data.paths], dtype=h5py.string_dtype())
        elif args.input.endswith(".npy"):
            data = np.load(args.input, mmap_mode="r")
        elif args.input.endswith((".h5", ".hdf5")):
            data = _hdf5_input(args.input, args.dataset, stack)
        else:
            raise ValueError(
                "INPUT must be an .h5/.hdf5 file, an .npy file or a folder of "
                f"images. Received: input={args.input!r}"
            )
        parallel_predict(
            model, data, gpus=args.gpus, batch_size=args.batch_size, output=args.output, extra=extra
        )
    print(f"wrote predictions for {_rows(args.output)} rows to {args.output}")
    return 0


def _rows(path: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f["kerasmulti_rows_done"][()])
