"""The HDF5 file that `parallel_predict` streams results into, crash-safe by construction.

- It is created complete, with every output dataset allocated at full size
  (contiguous, allocated early), under a temporary name that is then renamed
  into place (`atomic`), so it is valid from the moment it exists. A missing
  folder is made first, as Keras' `ModelCheckpoint` makes it.
- Its top level holds the outputs (and the caller's `extra` datasets, checked
  before anything is written: a dict, one row per input row, no output's name) only.
  What kerasmulti keeps for itself is in attributes of the root: the model's
  and the input's fingerprints, the row count, the outputs' names, and
  `kerasmulti_rows_done`, the rows that are final.
- Its blocks are reserved on disk when it is made and when it is resumed
  (`posix_fallocate`): HDF5's early allocation only sets the file's size, and
  a file system short of space would fail the writes of a later batch (h5py
  then crashes the process in its flush). A full disk thus fails before the
  first row, with an error, and the file is never left half-written by it.
- Afterwards only values are written in place, rows then counter, each
  followed by a flush: HDF5's structure never changes, and the counter is a
  fixed-size attribute rewritten where it lies (its 8 bytes change, nothing
  else), so a kill leaves a readable file whose counter never exceeds the
  rows really written.
- Files of an earlier kerasmulti keep the counter in a `kerasmulti_rows_done`
  dataset beside the outputs: they are resumed as they are.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

import h5py
import numpy as np
from keras import tree

from kerasmulti._src.inference.output_path import other_format, path_problem
from kerasmulti._src.utils import atomic as _atomic

PROGRESS = "kerasmulti_rows_done"
MODEL = "kerasmulti_model"
OUTPUTS = "kerasmulti_outputs"  # the output datasets' names, in the model's order
_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the first bytes of every HDF5 file h5py writes (no user block)


def check_path(output) -> str:
    """The output path as a string; refuses what cannot name a file to write."""
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(
            f"parallel_predict()'s output must be an HDF5 file path or None. Received: output={output!r}"
        )
    path = os.fspath(output)
    problem = path_problem(path)
    if problem == "empty":
        raise ValueError(
            "parallel_predict() got an empty output path. Pass e.g. 'features.h5', or None. Received: output=''"
        )
    if problem == "format":
        stem = os.path.splitext(path)[0]
        raise ValueError(
            f"parallel_predict() writes an HDF5 file, not {other_format(path)}. Name it e.g. {stem + '.h5'!r}. "
            f"Received: output={path!r}"
        )
    if problem == "folder":
        raise ValueError(
            f"parallel_predict()'s output is a folder. Name an HDF5 file, e.g. "
            f"output={os.path.join(path, 'features.h5')!r}. Received: output={path!r}"
        )
    if problem == "special":
        raise ValueError(
            f"parallel_predict()'s output is not a regular file (a pipe or a device). Name an HDF5 file. "
            f"Received: output={path!r}"
        )
    return path


def check_not_input(data, output: str) -> None:
    """Refuses an output path that is the input's own file."""
    if not os.path.exists(output):
        return
    for leaf in tree.flatten(data):
        file = getattr(getattr(leaf, "file", None), "filename", None) or getattr(leaf, "filename", None)
        if isinstance(file, (str, os.PathLike)) and os.path.exists(file) and os.path.samefile(file, output):
            raise ValueError(
                f"parallel_predict() would overwrite its input file. Choose another output. "
                f"Received: output={output!r}"
            )


def check_extra(extra, output) -> dict:
    """`extra` as a dict of arrays; refuses what is not one, or has no file to go in."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"parallel_predict()'s extra must be a dict of arrays, one row per input row. Received: extra={extra!r}"
        )
    if output is None and extra:
        # With the results returned in memory, extra= would be dropped unseen.
        raise ValueError(
            "parallel_predict() stores extra= in the output file only. Pass output='features.h5' or drop extra=. "
            f"Received: output=None, extra={_keys(extra)}"
        )
    for key in extra:
        if not isinstance(key, str) or key in ("", ".") or "/" in key:
            raise ValueError(
                f"parallel_predict()'s extra= keys must be non-empty strings without '/'. Received: extra={{{key!r}: ...}}"
            )
    return dict(extra)


def check_extra_rows(extra: dict, rows: int) -> None:
    """Refuses an `extra` array without one row per input row."""
    for key, value in extra.items():
        array = np.asarray(value)
        texts = array.ravel()
        if array.dtype.kind == "O" and not (all(isinstance(v, str) for v in texts) or all(isinstance(v, bytes) for v in texts)):
            raise ValueError(
                f"parallel_predict()'s extra '{key}' holds Python objects, which HDF5 cannot store. Pass numbers "
                f"or text (str or bytes, not both). Received: extra[{key!r}].dtype=object"
            )
        got = len(value) if np.ndim(value) else None
        if got != rows:
            raise ValueError(
                f"parallel_predict()'s extra '{key}' has {'no rows' if got is None else f'{got} rows'}, "
                f"but {rows} rows are predicted. Pass {rows} rows. "
                f"Received: extra[{key!r}].shape={np.shape(value)}, rows={rows}"
            )


class ExtraNameClash(ValueError):
    """An `extra` key that is also the name of an output dataset (`kerasmulti predict` says it in its words)."""


def check_extra_names(extra: dict, names) -> None:
    """Refuses an `extra` key that is also the name of an output dataset."""
    clashes = sorted(set(extra) & set(names))
    if clashes:
        raise ExtraNameClash(
            f"parallel_predict()'s extra {clashes} has the name of a model output ({list(names)}). Rename it. "
            f"Received: extra={_keys(extra)}"
        )


def _storable(value):
    """`value` as HDF5 stores it: numpy's fixed-width text (`<U`), which h5py refuses, as UTF-8 strings."""
    array = np.asarray(value)
    if array.dtype.kind == "U":
        return array.astype(h5py.string_dtype("utf-8"))
    return value


def _keys(extra) -> str:
    """`extra` as its keys, without its (long) arrays."""
    return "{" + ", ".join(f"{key!r}: ..." for key in extra) + "}"


def file_dtype(dtype: np.dtype, name: str) -> np.dtype:
    """The dtype output `name` is stored as; refuses text, whose writes would change the file's structure."""
    # HDF5 has no bfloat16 (mixed_bfloat16 outputs): h5py would store opaque
    # bytes. float32 holds every bfloat16 value exactly.
    if dtype.name == "bfloat16":
        return np.dtype("float32")
    if dtype.kind not in "biufc":
        # Variable-length strings live in HDF5's heap: writing them is not the
        # in-place write that keeps a killed file readable (module docstring).
        raise ValueError(
            f"parallel_predict() writes numbers to its file, but output '{name}' holds text. Pass output=None. "
            f"Received: dtype={dtype}"
        )
    return dtype


def create(path: str, rows: int, spec, names, attributes: dict, extra: dict) -> None:
    """Creates the file whole: a dataset per output (`spec`: row shape and dtype), `extra`, attributes."""

    def build(temporary):
        with h5py.File(temporary, "w") as f:
            for name, (shape, dtype) in zip(names, spec):
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                # Early allocation: later writes touch raw data only, never
                # HDF5's structure, so a kill cannot corrupt the file.
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                f.create_dataset(name, shape=(rows, *shape), dtype=dtype, dcpl=dcpl)
            for key, value in extra.items():
                f.create_dataset(key, data=_storable(value))
            f.attrs.update(attributes)
            f.attrs[OUTPUTS] = np.array(names, dtype=h5py.string_dtype())
            f.attrs[PROGRESS] = np.int64(0)
        reserve(temporary)

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _atomic.remove_stale_temporaries(path)  # a full-size file left by a run killed while it made one
        _atomic.write(path, build, "parallel_predict()", f"output={path!r}")
    except OSError as error:
        # Not h5py's message: it names the temporary, not the user's path.
        # makedirs says EEXIST where a file stands in place of the folder.
        code = errno.ENOTDIR if error.errno == errno.EEXIST else _atomic.error_code(error)
        reason = os.strerror(code) if code else "it could not be written"
        raise ValueError(
            f"parallel_predict() could not create '{path}' ({reason}). {_atomic.fix_for(code)} "
            f"Or choose another path. Received: output={path!r}"
        ) from error


def reserve(path: str) -> None:
    """Makes the file system give the file all its blocks now (see the module docstring).

    Raises OSError (ENOSPC) when they do not fit. File systems that cannot
    reserve space are left to allocate as they write.
    """
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        except AttributeError:  # no posix_fallocate on this system (macOS)
            pass


def absent(path: str) -> bool:
    """Whether there is nothing to resume at `path`: no file, or an empty one (reserved by `touch`)."""
    return not os.path.exists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0)


def open_existing(path: str, attributes: dict) -> h5py.File:
    """Opens a file to resume, refusing one that is damaged, not kerasmulti's, or another run's."""
    with open(path, "rb") as file:  # before anything opens it for writing: it may not be ours
        if file.read(len(_SIGNATURE)) != _SIGNATURE:
            raise ValueError(
                f"'{path}' is not an HDF5 file, so parallel_predict() did not write it. Choose another output path. "
                f"Received: output={path!r}"
            )
    try:
        reserve(path)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            finished = _finished(path, attributes)
            if finished is not None:  # nothing is left to write: read it as it is
                return finished
            raise ValueError(
                f"parallel_predict() cannot resume '{path}': it cannot be written ({os.strerror(error.errno)}). "
                f"Make it writable, or choose another path; written rows stay. Received: output={path!r}"
            ) from error
        raise ValueError(
            f"parallel_predict() cannot resume: the disk is full ({os.strerror(error.errno) if error.errno else error}). "
            f"Free space and rerun; written rows stay. Received: output={path!r}"
        ) from error
    try:
        f = h5py.File(path, "r+")
    except OSError as error:
        if "unable to lock file" in str(error) or "file is already open" in str(error):  # another process, this one
            raise ValueError(
                f"'{path}' is open elsewhere (another process, or a handle of this one), so parallel_predict() "
                f"cannot resume it. Close it there and rerun. Received: output={path!r}"
            ) from error
        raise _damaged(path) from error
    try:
        _check_resumable(f, path, attributes)
    except BaseException:
        f.close()
        raise
    return f


def _finished(path: str, attributes: dict) -> h5py.File | None:
    """The file opened read-only if it holds this run's rows, all of them; else None."""
    try:
        f = h5py.File(path, "r")
    except OSError:
        return None
    try:
        _check_resumable(f, path, attributes)
        if rows_done(f) == attributes.get("kerasmulti_rows"):
            return f
    except ValueError:
        pass  # refused below as it would be writable: that it cannot be written comes first
    f.close()
    return None


def _check_resumable(f: h5py.File, path: str, attributes: dict) -> None:
    try:
        ours = MODEL in f.attrs and (PROGRESS in f.attrs or isinstance(f.get(PROGRESS), h5py.Dataset))
        written = {key: f.attrs.get(key) for key in attributes}
        done = rows_done(f) if ours else 0
    except OSError as error:
        raise _damaged(path) from error
    if not ours:
        raise ValueError(
            f"parallel_predict() did not write this HDF5 output file. Choose another path. "
            f"Received: output={path!r}"
        )
    for key, value in attributes.items():
        if written[key] != value:
            what = "model" if key == MODEL else "input"
            # Adding rows of another model or input would corrupt it silently.
            raise ValueError(
                f"parallel_predict() will not add to results of a different {what}. Delete the file or choose another. "
                f"Received: output={path!r}"
            )
    if done is None:
        raise _damaged(path, "its row counter is not a whole number")  # no write of ours leaves it
    if not 0 <= done <= written.get("kerasmulti_rows", done):
        raise _damaged(path, f"its row counter, {done}, is out of range")  # no write of ours leaves it


def resumed_names(f: h5py.File, path: str, names: list, extra: dict) -> list:
    """The output datasets a resumed file holds, in the outputs' order; refuses another `extra` than its own.

    The names the file was begun with: the same model rebuilt in one
    process gets new layer names (`dense_1`), not new outputs.
    """
    if OUTPUTS in f.attrs:
        names = [str(name) for name in f.attrs[OUTPUTS]]
    missing = [name for name in names if not isinstance(f.get(name), h5py.Dataset)]
    if missing:
        raise _damaged(path, f"output '{missing[0]}' is missing")
    rows = f.attrs.get("kerasmulti_rows")
    resized = [name for name in names if rows is not None and len(f[name]) != rows]
    if resized:  # no write of ours resizes one: edited by hand
        raise _damaged(path, f"output '{resized[0]}' has {len(f[resized[0]])} rows, not {rows}")
    for key, value in extra.items():
        stored = f.get(key)
        if not isinstance(stored, h5py.Dataset) or not _same(stored, value):
            # Resumed, the file keeps the extra it began with: another would be dropped unseen.
            begun = "another" if isinstance(stored, h5py.Dataset) else "no"
            raise ValueError(
                f"'{path}' was begun with {begun} extra '{key}'. Pass the same extra=, or delete the file. "
                f"Received: extra={_keys(extra)}"
            )
    return names


def _same(stored: h5py.Dataset, value) -> bool:
    given = np.asarray(_storable(value))
    kept = stored.asstr()[()] if h5py.check_string_dtype(stored.dtype) else stored[()]
    if h5py.check_string_dtype(stored.dtype) or given.dtype.kind == "O":
        given = np.asarray([v.decode() if isinstance(v, bytes) else v for v in given.ravel()], dtype=object)
        kept = np.asarray(kept, dtype=object).ravel()
        return np.shape(kept) == np.shape(given) and bool(np.all(kept == given))
    # Missing values (NaN) are the same in both.
    return np.array_equal(kept, given, equal_nan=given.dtype.kind in "fc" and np.asarray(kept).dtype.kind in "fc")


def _damaged(path: str, reason: str = "not a readable HDF5 file") -> ValueError:
    return ValueError(
        f"'{path}' is damaged ({reason}), so parallel_predict() cannot resume it. "
        f"Delete or move it to start over. Received: output={path!r}"
    )


def rows_done(f: h5py.File) -> int | None:
    """The rows that are final."""
    done = f.attrs[PROGRESS] if PROGRESS in f.attrs else f[PROGRESS][()]  # the latter: an earlier kerasmulti's file
    if not np.issubdtype(np.asarray(done).dtype, np.integer) or np.ndim(done):
        return None  # edited by hand (`_check_resumable` refuses it)
    return int(done)


def set_rows_done(f: h5py.File, rows: int) -> None:
    """Records that the rows below `rows` are final, rewriting the counter in place."""
    if PROGRESS in f.attrs:
        # modify, not assignment: it writes into the attribute as it is.
        f.attrs.modify(PROGRESS, np.int64(rows))
    else:
        f[PROGRESS][()] = rows
