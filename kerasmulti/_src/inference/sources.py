"""Input sources for batch inference: row counts, row slices, what identifies them.

Every source is read a batch at a time, so memory stays flat however large the
input: numpy arrays (also memory-mapped `.npy` files and lists/dicts of
arrays for multi-input models), `h5py.Dataset`, `keras.utils.PyDataset` and
`tf.data.Dataset` (both yield batches: `x` or `(x, y, ...)`, of which only `x`
is used). `steps`, as in Keras' `predict`, reads that many batches and no
more, so an endless pipeline can be predicted on. Also `batched`, the
pipeline that training input without a given dataset is fed through
(multi-worker fit, the demo, the benchmarks).
"""

from __future__ import annotations

import collections.abc
import hashlib
import json
import os
from typing import Iterator

import h5py
import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src.data_parallel import feeding as _feeding


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
        """The first rows, for shape checks (each source reads them its own way)."""
        raise NotImplementedError

    def fingerprint_parts(self) -> Iterator:
        """Pieces of the input that identify it (with `rows`), for the fingerprint."""
        raise NotImplementedError

    def row_shapes(self) -> dict:
        """Row shapes of the inputs (a tuple per input) known before predicting, each with its first row.

        Those of the batches read to count the rows; empty where all rows
        have one shape (arrays) or nothing was read (a streamed pipeline).
        """
        return {}


class ArraySource(Source):
    """Arrays and HDF5 datasets, of which the first `limit` rows (all where None)."""

    def __init__(self, data, limit: int | None = None, sample_rows: int = 2):
        self.data, self.sample_rows, self._sample = data, sample_rows, None
        for array in tree.flatten(data):
            if len(array.shape) == 0:
                raise ValueError(
                    "parallel_predict() got a 0-d array. Add a batch axis: np.expand_dims(x, 0). "
                    f"Received: shape={array.shape}"
                )
        sizes = {len(a) for a in tree.flatten(data)}
        if len(sizes) != 1:
            raise ValueError(
                "All input arrays must have the same number of rows, one per "
                f"sample. Received: rows per input {sorted(sizes)}"
            )
        rows = sizes.pop()
        self.rows = rows if limit is None else min(rows, limit)

    def batches(self, start, size):
        for begin in range(start, self.rows, size):
            end = min(begin + size, self.rows)
            yield tree.map_structure(lambda a: _read(a, begin, end), self.data)

    def sample(self):
        # `sample_rows`: 1 row on a replica could be squeeze()d into none, where the batches predict.
        if self._sample is None:
            self._sample = next(iter(self.batches(0, self.sample_rows)), None)
        return self._sample

    def fingerprint_parts(self):
        for begin in _sampled_rows(self.rows):
            yield tree.map_structure(lambda a: _read(a, begin, min(begin + 2, self.rows)), self.data)


def _read(array, begin: int, end: int) -> np.ndarray:
    """Rows `begin:end` of an array; for an HDF5 dataset that fails, an error naming its file."""
    try:
        return np.asarray(array[begin:end])
    except OSError as error:  # h5py's, naming neither the file nor the rows
        file = getattr(getattr(array, "file", None), "filename", None)
        if file is None:
            raise
        raise ValueError(
            f"Rows {begin} to {end} of '{array.name}' could not be read: damaged file ({error}). "
            f"Rewrite it. Received: input={file!r}"
        ) from error


class BatchedSource(Source):
    """A PyDataset or a tf.data.Dataset: a sequence of batches.

    The rows of every batch are known before predicting starts, so that a
    resumed call finds the batch to start from. A pipeline is read once to
    count them (and hashed whole meanwhile); a PyDataset's are taken from
    its first and last batch, as Keras' contract says every batch but the
    last is full. Every batch read later is checked against that count, and
    a pipeline's against the values it had when counted (a reshuffled one
    would otherwise be written in another order, unnoticed).
    """

    def __init__(self, data, steps: int | None = None):
        self.data = data
        self._row_shapes, self._sample = {}, None
        if isinstance(data, tf.data.Dataset):
            _refuse_endless(data)
            self.sizes, self._digests, hashes, row = [], [], None, 0
            for batch in self._raw():
                leaves = [np.ascontiguousarray(a) for a in tree.flatten(batch)]
                self._note_row_shapes(batch, row)
                self.sizes.append(_row_count(batch))
                self._digests.append(_batch_digest(leaves))
                row += self.sizes[-1]
                hashes = hashes or [hashlib.sha256(f"{a.shape[1:]}{a.dtype}".encode()) for a in leaves]
                for digest, array in zip(hashes, leaves):
                    digest.update(values_bytes(array))
            self._hashes = [d.digest() for d in hashes or []]
        else:
            n = data.num_batches
            if steps is not None:
                n = steps if n is None else min(n, steps)
            if n is None:
                raise ValueError(
                    "parallel_predict() got a PyDataset without a length. Give it `__len__` or pass steps=. "
                    "Received: data.num_batches=None"
                )
            first = _inputs_of(data[0]) if n else None
            last = _inputs_of(data[n - 1]) if n > 1 else first
            full = _row_count(first) if n else 0
            self.sizes = [full] * (n - 1) + ([_row_count(last)] if n else [])
            if n:
                self._note_row_shapes(first, 0)
                self._note_row_shapes(last, full * (n - 1))
        self.rows = sum(self.sizes)
        self._starts = np.cumsum([0, *self.sizes])

    def _note_row_shapes(self, batch, row: int) -> None:
        self._row_shapes.setdefault(tuple(np.shape(a)[1:] for a in tree.flatten(batch)), row)

    def _raw(self, first_batch=0):
        if isinstance(self.data, tf.data.Dataset):
            for batch in self.data.skip(first_batch).as_numpy_iterator():
                yield _inputs_of(batch)
        else:
            for i in range(first_batch, len(self.sizes)):  # PyDataset: sizes come first
                yield _inputs_of(self.data[i])

    def batches(self, start, size):
        # Batches come as the source makes them; rows already done are
        # skipped without reading their batches.
        if start >= self.rows:
            return
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        skip = start - int(self._starts[first])
        for index, batch in enumerate(self._raw(first), first):
            self._check_batch(index, batch)
            yield tree.map_structure(lambda a: np.asarray(a)[skip:], batch)
            skip = 0

    def _check_batch(self, index, batch) -> None:
        """Refuses a batch unlike the one counted: other rows, or (for a pipeline) other values."""
        rows = _row_count(batch)
        expected = self.sizes[index] if index < len(self.sizes) else 0
        if rows != expected:
            raise ValueError(self._changed_batch(index, rows, expected))
        if isinstance(self.data, tf.data.Dataset) and index < len(self._digests):
            leaves = [np.ascontiguousarray(a) for a in tree.flatten(batch)]
            if _batch_digest(leaves) != self._digests[index]:
                # Written, its rows would sit in another order than the input's (or
                # be others), and the file's fingerprint would not match its rows.
                raise ValueError(
                    f"The tf.data.Dataset gave other batches when read again: batch {index} holds other values. "
                    f"Use reshuffle_each_iteration=False and no random ops, or output=None. Received: batch={index}"
                )

    def _changed_batch(self, index, rows, expected) -> str:
        if isinstance(self.data, tf.data.Dataset):
            # A pipeline is read twice: to count its rows, then to predict.
            return (
                f"The tf.data.Dataset gave other batches when read again: batch {index} has {rows} "
                f"rows now and had {expected}. Make it repeatable (reshuffle_each_iteration=False). "
                f"Received: batch={index}, rows={rows}"
            )
        # A PyDataset's rows are counted from its first and last batch, as
        # Keras' contract says every batch but the last is full.
        last = len(self.sizes) - 1
        fix = (f"Make __len__ count only batches that hold rows (batch {last} holds none)" if last > index and not self.sizes[-1]
               else "Make every batch but the last as large as the first")
        return (
            f"PyDataset batch {index} has {rows} rows, but parallel_predict() expects {expected}. "
            f"{fix}. Received: batch={index}, rows={rows}"
        )

    def sample(self):
        # Read afresh and checked, so that a pipeline that reshuffles is
        # refused before the output file is made.
        if self._sample is None:
            self._sample = next(self._raw(), None)
            if self._sample is None:  # a one-shot generator behind Dataset.from_generator
                raise reread_error(0, self.rows)
            self._check_batch(0, self._sample)
        return self._sample

    def row_shapes(self):
        # A pipeline's batches, all read to count them; a PyDataset's first and last.
        return self._row_shapes

    def fingerprint_parts(self):
        if isinstance(self.data, tf.data.Dataset):
            yield [np.frombuffer(d, np.uint8) for d in self._hashes]
            return
        # Its first two and last two rows: their batches are read anyway (for
        # the row count), where reading more could cost as much as a pass
        # (images decoded, files fetched) and fail before predicting starts.
        for begin in sorted({0, max(0, self.rows - 2)}):
            yield _head(self.batches(begin, 2), 2)


class StreamedSource(Source):
    """A tf.data pipeline read once, batch by batch, when nothing needs its rows counted first.

    With results returned in memory there is no file to resume and no
    fingerprint to take, so, as in Keras' `predict`, the pipeline is read
    once: `rows` is None, and the first batch (the sample) is read as part
    of that one pass.
    """

    def __init__(self, data: tf.data.Dataset):
        _refuse_endless(data)
        self.data, self.rows = data, None
        self._iterator = (_inputs_of(batch) for batch in data.as_numpy_iterator())
        self._first = next(self._iterator, None)

    def batches(self, start, size):
        if start or self._first is None:
            return
        yield self._first
        yield from self._iterator

    def sample(self):
        return self._first


def _refuse_endless(data: tf.data.Dataset) -> None:
    if not _feeding.endless(data):  # TensorFlow counts some that end INFINITE (sample_from_datasets, stopping)
        return
    if int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError(
            "parallel_predict() got a tf.data.Dataset that never ends. Pass steps= or drop `.repeat()`. "
            "Received: data.cardinality()=INFINITE"
        )
    # `repeat().filter(...)`: TensorFlow cannot tell it is endless, and it would be read forever.
    raise ValueError(
        "parallel_predict() got a tf.data.Dataset that repeats forever. Pass steps=, or give `.repeat()` a count. "
        "Received: data.cardinality()=UNKNOWN with an endless .repeat()"
    )


FINGERPRINT_SAMPLES = 16


def _sampled_rows(rows: int) -> list[int]:
    """First rows of the pairs that identify an array input, spread from first to last.

    Pairs of rows, not the whole input: reading it all would cost a pass over
    data larger than memory.
    """
    return sorted({int(i) for i in np.linspace(0, max(0, rows - 2), FINGERPRINT_SAMPLES)})


def _inputs_of(batch):
    # As Keras unpacks a batch: a tuple or list of 1 to 3 is (x, y, sample_weight).
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3:
        return batch[0]
    return batch


def _batch_digest(leaves) -> bytes:
    """Identifies a batch's values (contiguous arrays), to recognise it when read again."""
    digest = hashlib.blake2b(digest_size=16)
    for array in leaves:
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(values_bytes(array))
    return digest.digest()


def values_bytes(array: np.ndarray) -> bytes:
    """A contiguous array's values as bytes: Python objects (text, as tf.data gives it) by their reprs, not their addresses."""
    if array.dtype.kind == "O":
        return json.dumps([repr(v) for v in array.ravel()]).encode()
    return array.tobytes()


def _row_count(batch) -> int:
    """The rows in `batch`: the length of its first array."""
    first = tree.flatten(batch)[0]
    if np.ndim(first) == 0:  # an unbatched pipeline of single values
        raise ValueError(
            "parallel_predict() got a batch that is a single value. Batch the input: dataset.batch(32). "
            f"Received: batch shape={np.shape(first)}"
        )
    return len(first)


def _head(batches: Iterator, n: int):
    """The first `n` rows of a stream of batches, reading no batch past them."""
    parts, got = [], 0
    for batch in batches:
        parts.append(tree.map_structure(lambda a: np.asarray(a)[: n - got], batch))
        got += _row_count(parts[-1])
        if got >= n:
            break
    return tree.map_structure(lambda *pieces: np.concatenate(pieces), *parts)


def make_source(data, counted: bool = True, steps: int | None = None, batch_size: int = 32, sample_rows: int = 2) -> Source:
    """The source for `data`, limited to `steps` batches of `batch_size` rows (for arrays), sampled by `sample_rows`.

    `counted=False` lets a tf.data pipeline be read once, uncounted.
    """
    if isinstance(data, tf.data.Dataset) and steps is not None:
        data = data.take(steps)
    if isinstance(data, tf.data.Dataset) and not counted:
        return StreamedSource(data)
    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        return BatchedSource(data, steps)
    if isinstance(data, collections.abc.Iterator):
        raise TypeError(
            "parallel_predict() cannot read a Python generator twice. Wrap it in Dataset.from_generator "
            f"or a PyDataset (docs/inference.md). Received: data={type(data).__name__}"
        )
    leaves = tree.flatten(data)
    for leaf in leaves:
        if isinstance(leaf, h5py.Dataset) and not leaf.id.valid:
            raise ValueError(
                "parallel_predict() got an h5py.Dataset whose file is closed. Keep the file open while it "
                f"runs. Received: data={leaf!r}"
            )
    if isinstance(data, (str, bytes, os.PathLike)):
        raise TypeError(
            "parallel_predict() reads arrays, not files. Open it first: np.load(path, mmap_mode='r') for .npy "
            f"(docs/inference.md). Received: data={os.fspath(data)!r}"
        )
    arrays = [hasattr(a, "shape") and hasattr(a, "__getitem__") for a in leaves]
    if not leaves or not all(arrays):
        nested = leaves and isinstance(data, (list, tuple, dict))
        held = f" holding {type(leaves[arrays.index(False)]).__name__}" if nested else ""
        raise TypeError(
            "parallel_predict() reads numpy arrays (or a list or dict of them), an h5py.Dataset, a PyDataset "
            f"or a tf.data.Dataset. Convert lists with np.asarray(...). Received: data={type(data).__name__}{held}"
        )
    return ArraySource(data, None if steps is None else steps * batch_size, sample_rows=sample_rows)


def reread_error(rows: int, counted: int) -> ValueError:
    """The error for an input that gave other rows when read again than when its rows were counted."""
    return ValueError(
        f"The input gave {'at least ' if rows > counted else ''}{rows} rows, but {counted} "
        "were counted before. Make it give the same rows on each read. "
        f"Received: rows={rows}, counted={counted}"
    )
