"""`kerasmulti predict MODEL INPUT --output OUT.h5`: batch inference from files.

INPUT is an HDF5 file (`--dataset NAME` picks the dataset), an `.npy` file
(memory-mapped, so it may exceed memory), or a folder of images, resized to
the model's input and read in name order (with Pillow, as
`keras.utils.load_img` reads them); their file names are stored in the
output's `filenames` dataset. Mistakes a user can fix raise `ValueError`
naming the file at fault, which the command prints as one line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys

import h5py
import keras
import numpy as np

from kerasmulti._src.commands import paths as _paths
from kerasmulti._src.inference import output_file as _output_file
from kerasmulti._src.inference.parallel_predict import parallel_predict
from kerasmulti._src.model_parallel import portable as _portable


def _model_from_file(path: str, imports: list[str], safe_mode: bool):
    for module in imports:
        _import(module)
    try:
        # A placed model keeps its placement; predicting needs no loss or optimizer.
        return _portable.load_model(path, compile=False, safe_mode=safe_mode)
    except Exception as error:  # Keras raises many kinds for a bad file
        message = str(error)
        if isinstance(error, ValueError) and "Received: filepath=" in message:
            raise ValueError(message.replace("Received: filepath=", "Received: model=")) from error  # says it all
        unknown = re.search(r"Could not locate (?:class|function) '([^']+)'", message)
        if unknown:
            raise ValueError(
                f"The model uses '{unknown[1]}', which Keras does not know. Import the module that defines "
                f"it: --import MODULE. Received: model={path!r}"
            ) from error
        if "safe_mode=False" in message:
            raise ValueError(
                "The model holds Python code (a Lambda layer), which Keras loads only from a trusted file. "
                f"If you trust it, add --unsafe-deserialization. Received: model={path!r}"
            ) from error
        # Keras ends a failed rebuild with its cause: "... Exception encountered: <the cause>".
        cause = message.split("Exception encountered:")[-1].strip()
        raise ValueError(
            f"The file could not be loaded as a Keras model ({type(error).__name__}: "
            f"{cause.splitlines()[0][:200] if cause else ''}). Load it in Python with the libraries and "
            f"code it was saved with. Received: model={path!r}"
        ) from error


def _import(name: str) -> None:
    """Runs a module of the user's (`--import`), so that the classes it registers load."""
    try:
        if name.endswith(".py"):  # a file: run as a module of its name, its folder first on the path (its imports)
            folder = os.path.dirname(os.path.abspath(name))
            sys.path.insert(0, folder)
            stem = os.path.splitext(os.path.basename(name))[0]
            stem = stem if stem not in sys.modules else f"kerasmulti_import_{stem}"  # never one already loaded (copy.py)
            spec = importlib.util.spec_from_file_location(stem, name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:  # a module name, found from the working folder first, as `python -m` finds it
            sys.path.insert(0, os.getcwd())
            importlib.import_module(name)
    except Exception as error:  # the user's code may raise anything
        raise ValueError(
            f"--import {name} failed ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}). "
            f"Received: --import={name!r}"
        ) from error


def _hdf5_input(path: str, name: str | None, stack):
    try:
        f = stack.enter_context(h5py.File(path, "r"))
    except OSError as error:
        raise ValueError(
            f"The input is not a readable HDF5 file. Write it again. Received: input={path!r}"
        ) from error
    names = []
    f.visititems(lambda key, item: names.append(key) if isinstance(item, h5py.Dataset) else None)
    if name is None and len(names) == 1:
        name = names[0]
    if name is None or name not in names:
        has = f"has no dataset '{name}'; it holds" if name is not None else "holds the datasets"
        raise ValueError(
            f"'{path}' {has} {names}; pass the one to predict on with "
            f"--dataset NAME. Received: dataset={name!r}"
        )
    return f[name]


def _npy_input(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as error:  # numpy's advises allow_pickle
        if _holds_objects(path):
            # Unpickling can run code.
            raise ValueError(
                f"The input holds Python objects, which are never unpickled. Save numbers instead. "
                f"Received: input={path!r}"
            ) from error
        raise ValueError(
            f"The input is not a readable .npy file. Write it again with numpy.save. "
            f"Received: input={path!r}"
        ) from error


def _holds_objects(path: str) -> bool:
    """Whether an .npy file's header declares an object array."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return read(f)[2].hasobject
    except (ValueError, OSError, EOFError):
        return False


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


class ImageFolder(keras.utils.PyDataset):
    """The images of a folder, sorted by name, resized to `(height, width)` as `keras.utils.load_img` does.

    Not `keras.utils.image_dataset_from_directory`: a tf.data pipeline is read
    whole to count and fingerprint it (every image decoded twice), a resumed
    run would decode the images it skips, and a damaged image fails there
    without its name. Here a batch is read by index, and an error names the file.
    """

    def __init__(self, folder: str, height: int, width: int, channels: int, batch_size: int):
        super().__init__()
        try:
            importlib.import_module("PIL.Image")  # what keras.utils.load_img reads with
        except ImportError as error:
            raise ValueError(
                f"Reading images needs Pillow: pip install 'kerasmulti[images]'. Received: input={folder!r}"
            ) from error
        names = os.listdir(folder)
        # Hidden files are left out: macOS writes `._photo.jpg` beside each image on some drives.
        images = sorted(name for name in names if name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith("."))
        for name in images:
            try:
                name.encode("utf-8")  # the output's `filenames` holds UTF-8 text
            except UnicodeEncodeError:
                raise ValueError(
                    f"An image's file name is not UTF-8 text. Rename it. Received: image={os.fsencode(os.path.join(folder, name))!r}"
                ) from None
        self.paths = [os.path.join(folder, name) for name in images]
        self.left_out = sorted(set(names) - set(images) - {name for name in names if name.startswith(".")})
        if not self.paths:
            raise ValueError(
                f"The folder '{folder}' holds no images ({', '.join(IMAGE_SUFFIXES)}). "
                f"Point INPUT at a folder of images. Received: input={folder!r}"
            )
        self.size, self.batch_size = (height, width), batch_size
        self.color_mode = {1: "grayscale", 3: "rgb", 4: "rgba"}.get(channels, "rgb")

    def __len__(self):
        return -(-len(self.paths) // self.batch_size)

    def __getitem__(self, i):
        paths = self.paths[i * self.batch_size : (i + 1) * self.batch_size]
        return np.stack([self._load(path) for path in paths])

    def _load(self, path: str) -> np.ndarray:
        from PIL import Image

        try:
            # Pillow decodes lazily: an image that needs no resizing is decoded by img_to_array.
            return keras.utils.img_to_array(keras.utils.load_img(path, target_size=self.size, color_mode=self.color_mode))
        except (OSError, ValueError, Image.DecompressionBombError) as error:  # Pillow's names a buffer, not the file
            # Replacing or removing an image changes the input, and an output
            # file begun on the old input is refused (its fingerprint differs).
            raise ValueError(
                f"An image could not be read ({type(error).__name__}). Replace or remove it, and start a new output file. "
                f"Received: image={path!r}"
            ) from error


def _image_input(args, model, extra: dict):
    shapes = [tuple(t.shape[1:]) for t in model.inputs]
    shape = shapes[0]
    # Pillow gives channels last: 1 (grayscale), 3 (RGB) or 4 (RGBA).
    if len(shapes) != 1 or len(shape) != 3 or None in shape[:2] or shape[2] not in (None, 1, 3, 4):
        raise ValueError(
            "A folder of images needs a model of one input (height, width, 1, 3 or 4 channels); "
            f"'{args.model}' takes {shapes[0] if len(shapes) == 1 else shapes}. Received: input={args.input!r}"
        )
    data = ImageFolder(args.input, shape[0], shape[1], shape[2] or 3, args.batch_size)
    if data.left_out:
        print(
            f"kerasmulti predict: left out {len(data.left_out)} entries of the folder that are not "
            f"{'/'.join(IMAGE_SUFFIXES)} images (e.g. {data.left_out[0]!r})",
            file=sys.stderr,
        )
    extra["filenames"] = np.array([os.path.basename(p) for p in data.paths], dtype=h5py.string_dtype())
    return data


def run(args) -> int:
    _paths.check(args)  # the command checked them before TensorFlow loaded; a caller of run() may not have
    model = _model_from_file(args.model, args.imports, safe_mode=not args.unsafe_deserialization)
    rows_before = _rows_done(args.output)
    extra = {}
    with contextlib.ExitStack() as stack:
        if os.path.isdir(args.input):
            data = _image_input(args, model, extra)
        elif args.input.lower().endswith(".npy"):
            data = _npy_input(args.input)
        elif args.input.lower().endswith((".h5", ".hdf5")):
            data = _hdf5_input(args.input, args.dataset, stack)
        else:
            raise ValueError(
                "INPUT must be an .h5/.hdf5 file, an .npy file or a folder of "
                f"images. Received: input={args.input!r}"
            )
        try:
            parallel_predict(model, data, gpus=args.gpus, batch_size=args.batch_size, output=args.output, extra=extra)
        except _output_file.ExtraNameClash as error:  # the user passed no extra=: the command did
            raise ValueError(
                "The model has an output named 'filenames', the dataset that holds the images' names. "
                f"Call parallel_predict() in Python instead. Received: model={args.model!r}"
            ) from error
    rows = _rows_done(args.output)
    if rows_before and rows_before == rows:
        print(f"{args.output} already held predictions for all {rows} rows; nothing was written")
    elif rows_before:
        print(f"resumed at row {rows_before}: wrote predictions for the other {rows - rows_before} of {rows} rows to {args.output}")
    else:
        print(f"wrote predictions for {rows} rows to {args.output}")
    return 0


def _rows_done(path: str) -> int:
    """How many rows the output file holds; 0 where there is none (or it is not ours:
    `parallel_predict` refuses that file, so this number is never printed)."""
    try:
        with h5py.File(path, "r") as f:
            return _output_file.rows_done(f) or 0
    except (OSError, KeyError, ValueError, TypeError):
        return 0
