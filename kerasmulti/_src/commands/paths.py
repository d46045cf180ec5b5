"""`kerasmulti predict`'s paths, checked before TensorFlow loads: a mistyped one answers at once.

Nothing here imports TensorFlow or Keras; the loading and reading that need
them (`predict.py`) come after.
"""

from __future__ import annotations

import os

from kerasmulti._src.inference.output_path import other_format, path_problem

MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")  # the files Keras' load_model reads, by their names


def check(args) -> None:
    """Refuses an --output, MODEL or INPUT path that cannot work, naming it (a `ValueError`, one line)."""
    _check_output(args.output)
    _check_model(args.model)
    if not os.path.exists(args.input):
        raise ValueError(f"The input '{args.input}' does not exist. Received: input={args.input!r}")
    if not (os.path.isfile(args.input) or os.path.isdir(args.input)):  # reading a pipe would wait for a writer
        raise ValueError(f"The input is not a regular file or a folder (a pipe or a device). Received: input={args.input!r}")
    kind = "a folder of images" if os.path.isdir(args.input) else "a .npy file" if args.input.lower().endswith(".npy") else None
    if kind is not None and args.dataset is not None:
        raise ValueError(f"--dataset is for HDF5 inputs, but '{args.input}' is {kind}. Drop it. Received: dataset={args.dataset!r}")
    for module in args.imports:
        if module.endswith(".py") and not os.path.isfile(module):
            raise ValueError(f"The file to import, '{module}', does not exist or is a folder. Received: --import={module!r}")


def _check_model(path: str) -> None:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            raise ValueError(
                "The model is a TensorFlow SavedModel folder, which Keras 3 cannot load. Save it as .keras "
                "or use keras.layers.TFSMLayer. "
                f"Received: model={path!r}"
            )
        raise ValueError(f"'{path}' is a folder, not a model file. Pass a .keras or .h5 model file. Received: model={path!r}")
    if not os.path.exists(path):
        raise ValueError(f"The model file '{path}' does not exist. Received: model={path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"The model is not a regular file (a pipe or a device). Received: model={path!r}")
    if not path.endswith(MODEL_SUFFIXES):  # as Keras tells them apart; its refusal is a paragraph
        raise ValueError(f"MODEL is not a model file: pass a .keras or .h5 file, as model.save() writes. Received: model={path!r}")


def _check_output(path: str) -> None:
    """Refuses an --output that names no HDF5 file, in the command's words (parallel_predict() says output=)."""
    problem = path_problem(path)
    if problem == "empty":
        raise ValueError("--output is empty. Name the HDF5 file for the results, e.g. --output features.h5. Received: --output=''")
    if problem == "format":
        raise ValueError(
            f"--output is an HDF5 file, not {other_format(path)}. Name it e.g. --output {os.path.splitext(path)[0]}.h5. "
            f"Received: --output={path!r}"
        )
    if problem == "folder":
        raise ValueError(
            f"--output is a folder. Name an HDF5 file in it, e.g. --output {os.path.join(path, 'features.h5')}. "
            f"Received: --output={path!r}"
        )
    if problem == "special":
        raise ValueError(f"--output is not a regular file (a pipe or a device). Name an HDF5 file. Received: --output={path!r}")
