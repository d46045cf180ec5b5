"""Input sources for batch inference: row counts, row slices, fingerprints.

Every source is read a batch at a time, so memory stays flat however large the
input: numpy arrays (also memory-mapped `.npy` files and lists/dicts of
arrays for multi-input models), `h5py.Dataset`, `keras.utils.PyDataset` and
`tf.data.Dataset` (both yield batches: `x` or `(x, y, ...)`, of which only `x`
is used). Also `batched`, the pipeline that training input without a given
dataset is fed through (multi-worker fit, the demo, the benchmarks).
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import keras
import numpy as np
import tensorflow as tf
from keras import tree


def batched(dataset: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
    """Batches and prefetches `dataset` with tf.data autotuning off.

    `fit` on arrays builds an autotuned pipeline, and TensorFlow 2.21 waits
    about a second at every epoch's end for its iterator to be destroyed (the
    main thread joins the autotuning thread; benchmarks/README.md). Without
    autotuning the wait is gone and epochs are steady.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.batch(batch_size).prefetch(2).with_options(options)


class Source:
    """A resumable row stream: `rows` in total, `batches(start, size)` from row `start`."""

    rows: int

    def batches(self, start: int, size: int) -> Iterator:
        raise NotImplementedError

    def sample(self):
        """The first rows, for shape checks and the fingerprint."""
        return next(iter(self.batches(0, 2)))

    def last(self):
        """The last rows, for the fingerprint."""
        return next(iter(self.batches(max(0, self.rows - 2), 2)))


class ArraySource(Source):
    def __init__(self, data):
        self.data = data
        sizes = {len(a) for a in tree.flatten(data)}
        if len(sizes) != 1:
            raise ValueError(
                "All input arrays must have the same number of rows, one per "
                f"sample. Received: rows per input {sorted(sizes)}"
            )
        self.rows = sizes.pop()

    def batches(self, start, size):
        for begin in range(start, self.rows, size):
            yield tree.map_structure(lambda a: np.asarray(a[begin : begin + size]), self.data)


class BatchedSource(Source):
    """A PyDataset or a tf.data.Dataset: a sequence of batches of any size."""

    def __init__(self, data):
        self.data = data
        if isinstance(data, tf.data.Dataset):
            # A pipeline's batch sizes are unknown until read: count them once.
            self.rows, self._last = 0, None
            for batch in self._raw():
                self.rows += _rows(batch)
                self._last = batch
        else:
            # PyDataset batches are full but for the last one (Keras' contract).
            n = len(data)
            self.rows = 0 if n == 0 else (n - 1) * _rows(_inputs_of(data[0])) + _rows(_inputs_of(data[n - 1]))

    def _raw(self, first_batch=0):
        if isinstance(self.data, tf.data.Dataset):
            for batch in self.data.skip(first_batch).as_numpy_iterator():
                yield _inputs_of(batch)
        else:
            for i in range(first_batch, len(self.data)):
                yield _inputs_of(self.data[i])

    def batches(self, start, size):
        # Batches come as the source makes them, all of one size but the
        # last; rows already done are skipped without reading their batches.
        if start >= self.rows:
            return
        if start == 0:
            yield from self._raw()
            return
        per_batch = _rows(self.sample())
        first, skip = divmod(start, per_batch)
        for batch in self._raw(first):
            yield tree.map_structure(lambda a: np.asarray(a)[skip:], batch)
            skip = 0

    def sample(self):
        return next(self._raw())

    def last(self):
        if isinstance(self.data, tf.data.Dataset):
            return self._last
        return _inputs_of(self.data[len(self.data) - 1])


def _inputs_of(batch):
    if isinstance(batch, tuple) and 1 <= len(batch) <= 3:
        return batch[0]
    return batch


def _rows(batch) -> int:
    return len(tree.flatten(batch)[0])


def make_source(data) -> Source:
    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        return BatchedSource(data)
    leaves = tree.flatten(data)
    if not leaves or not all(hasattr(a, "shape") and hasattr(a, "__getitem__") for a in leaves):
        raise TypeError(
            "parallel_predict() reads numpy arrays (or lists/dicts of them), an "
            "h5py.Dataset, a keras.utils.PyDataset or a tf.data.Dataset. "
            f"Received: data={type(data).__name__}"
        )
    return ArraySource(data)


def fingerprint(source: Source, sample) -> str:
    """Identifies an input by its size and the bytes of its first and last two rows.

    `sample` is `source.sample()`, already read by the caller.
    """
    digest = hashlib.sha256(str(source.rows).encode())
    # Rows, not batches: the same data batched differently is the same input.
    first = tree.map_structure(lambda a: np.asarray(a)[:2], sample)
    last = tree.map_structure(lambda a: np.asarray(a)[-2:], source.last())
    for part in (first, last):
        for array in tree.flatten(part):
            array = np.ascontiguousarray(array)
            digest.update(f"{array.shape}{array.dtype}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def model_fingerprint(model) -> str:
    """Identifies a model by its architecture and weights."""
    digest = hashlib.sha256(model.to_json().encode())
    for weight in model.weights:
        digest.update(np.ascontiguousarray(np.asarray(weight)).tobytes())
    return digest.hexdigest()


def check_shapes(model, sample) -> None:
    """Raises when the input rows do not fit the model's inputs."""
    # A subclassed model has no `inputs`: its rows are checked when it runs.
    inputs = getattr(model, "inputs", None)
    expected = [tuple(t.shape[1:]) for t in inputs] if inputs else None
    if expected is None:
        return
    got = [tuple(np.shape(a)[1:]) for a in tree.flatten(sample)]
    fits = len(got) == len(expected) and all(
        len(g) == len(e) and all(x is None or x == y for x, y in zip(e, g)) for g, e in zip(got, expected)
    )
    if not fits:
        raise ValueError(
            f"The input rows do not fit model '{model.name}': it expects rows of "
            f"shape {_shapes(expected)}, the data has rows of shape {_shapes(got)}. "
            f"Reshape or resize the data to the model's input. Received: row shapes {_shapes(got)}"
        )


def _shapes(shapes) -> str:
    return ", ".join(str(s) for s in shapes)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


class ImageFolder(keras.utils.PyDataset):
    """The images of a folder, sorted by name, resized to `(height, width)`."""

    def __init__(self, folder: str, height: int, width: int, channels: int, batch_size: int):
        super().__init__()
        import os

        self.paths = sorted(
            os.path.join(folder, name)
            for name in os.listdir(folder)
            if name.lower().endswith(IMAGE_SUFFIXES)
        )
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
        return np.stack(
            [
                keras.utils.img_to_array(keras.utils.load_img(p, target_size=self.size, color_mode=self.color_mode))
                for p in paths
            ]
        )
