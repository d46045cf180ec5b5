"""`parallel_predict`: data-parallel inference over data larger than memory.

Batches are read one at a time (a background thread reads the next ones while
the devices work), predicted by a parallel model, and either collected or
streamed into an HDF5 file. The file is crash-safe by construction:

- it is created complete, with every output dataset allocated at full size
  (contiguous, allocated early) and a progress counter, under a temporary name
  that is then renamed into place, so it is valid from the moment it exists;
- afterwards only raw data is written in place (rows, then the counter, each
  followed by a flush): HDF5's structure never changes, so a kill leaves a
  readable file whose counter never exceeds the rows really written;
- the same call again continues from the counter; a file written for another
  model or input is refused.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import h5py
import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti import _atomic, _faults, _sources
from kerasmulti import _cluster
from kerasmulti._parallel import ParallelModel, _warn_overrides, unwrap
from kerasmulti._devices import is_positive_int, resolve_devices
from kerasmulti._parallelize import _check_model, local_parallel

PROGRESS = "kerasmulti_rows_done"
_CACHE = "__kerasmulti_parallel_models"
_STEP = "_kerasmulti_predict"
_PREFETCH = 2


def _prefetch(iterator, depth=_PREFETCH):
    """Yields from `iterator`, read ahead on a thread, holding `depth` batches at most.

    If the consumer stops early (an error while predicting or writing), the
    reader thread notices and ends instead of blocking on a full queue.
    """
    buffer = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read():
        try:
            for item in iterator:
                if not put(item):
                    return
        except BaseException as error:  # re-raised on the consumer's side
            put(error)
            return
        put(done)

    reader = threading.Thread(target=read, daemon=True, name="kerasmulti-reader")
    reader.start()
    try:
        while (item := buffer.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


def _output_names(template, outputs) -> list[str]:
    flat = tree.flatten(outputs)
    if isinstance(outputs, dict):
        names = sorted(outputs)  # tree.flatten orders dict entries by key
    else:
        names = list(getattr(template, "output_names", None) or [])
        if not names and getattr(template, "outputs", None):
            # Sequential has no output_names; its outputs know their layers.
            names = [t._keras_history.operation.name for t in template.outputs]
    if len(names) != len(flat) or len(set(names)) != len(names):
        names = [f"output_{i}" for i in range(len(flat))]
    return names


def _create(path, rows, spec, names, attributes, extra):
    def build(temporary):
        with h5py.File(temporary, "w") as f:
            for name, (shape, dtype) in zip(names, spec):
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                # Early allocation: later writes touch raw data only, never
                # HDF5's structure, so a kill cannot corrupt the file.
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                f.create_dataset(name, shape=(rows, *shape), dtype=dtype, dcpl=dcpl)
            f.create_dataset(PROGRESS, data=np.int64(0))
            for key, value in extra.items():
                f.create_dataset(key, data=value)
            f.attrs.update(attributes)

    _atomic.write(path, build)


def _open_existing(path, attributes):
    try:
        f = h5py.File(path, "r+")
    except OSError as error:
        raise ValueError(
            f"parallel_predict() cannot resume '{path}': it is not a readable "
            "HDF5 file. Delete it or pick another output path. "
            f"Received: output={path!r}"
        ) from error
    for key, value in attributes.items():
        if f.attrs.get(key) != value:
            f.close()
            what = "model" if key == "kerasmulti_model" else "input"
            raise ValueError(
                f"parallel_predict() will not add to '{path}': it holds results "
                f"of a different {what}, and mixing them would silently corrupt "
                "it. Delete the file or choose another output path to start "
                f"over. Received: output={path!r}"
            )
    return f


def parallel_predict(
    model: keras.Model,
    data,
    gpus=None,
    devices=None,
    batch_size: int = 32,
    output: str | None = None,
    verbose="auto",
    extra: dict | None = None,
):
    """Predicts over a data set on several devices, optionally into an HDF5 file.

    Each batch is split across the devices as in `parallelize`; results come
    back in input order and equal `model.predict` row for row. Data is read a
    batch at a time, so with `output` set memory stays flat however large the
    input. With `output="features.h5"` the results stream into an HDF5 file,
    one dataset per model output, named after it; if the process dies, the same
    call continues where the file says it stopped, and every row ends up
    written exactly once. The file's `kerasmulti_rows_done` dataset says how
    many rows are final.

    Args:
        model: A `keras.Model`, or a model from `parallelize` (its devices are
            used unless `gpus` or `devices` is given). Later calls on the same
            devices reuse the compiled step; for a plain model it is kept with
            the model, unseen by Keras (not a layer, not saved).
        data: Numpy arrays (lists or dicts of them for several inputs, a
            memory-mapped `.npy` file), an `h5py.Dataset`, a
            `keras.utils.PyDataset` or a `tf.data.Dataset` (both yield batches).
        gpus: As in `parallelize`: how many devices, a list of ids, or None.
        devices: As in `parallelize`: explicit TensorFlow device names.
        batch_size: Rows per step for arrays and HDF5 datasets.
        output: Path of an HDF5 file to stream results into, or None to return
            them.
        verbose: `"auto"` or 1 shows a progress bar with rows/s, 0 is quiet,
            2 prints one line at the end.
        extra: Arrays stored beside the results (e.g. `{"filenames": names}`),
            one row per input row.

    Returns:
        With `output=None`, the predictions, structured as `model.predict`
        returns them; otherwise the output path.

    Raises:
        ValueError: If the rows do not fit the model, `batch_size` is not a
            positive int, or `output` holds results of another model or input.
        TypeError: If `data` is of a kind it cannot read.

    Example:

    ```python
    import keras, numpy as np, kerasmulti
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="features")])
    x = np.random.rand(1000, 8).astype("float32")
    kerasmulti.parallel_predict(model, x, batch_size=128, output="features.h5")
    ```
    """
    if not is_positive_int(batch_size):
        raise ValueError(
            "parallel_predict() needs batch_size to be a positive int, the rows "
            f"predicted per step. Received: batch_size={batch_size!r}"
        )
    if output is not None and not _cluster.is_chief():
        raise _cluster.ClusterError(
            "parallel_predict() writes its output file on the chief (worker 0) "
            "only: every worker writing the same file would clobber it. Call it "
            "with output= on worker 0 alone, or give each worker its own file "
            "and data. Received: output="
            f"{output!r} on worker {_cluster.config()['task']['index']}"
        )
    if type(model) is ParallelModel and gpus is None and devices is None:
        parallel = model  # its compiled step is reused across calls
    else:
        parallel = _parallel_of(unwrap(model), gpus, devices)
    template = parallel._template
    _warn_overrides(template, ("predict_step",))
    source = _sources.make_source(data, counted=output is not None)
    if source.rows == 0 or source.sample() is None:
        raise ValueError(
            "parallel_predict() got an input with no rows, so there is nothing "
            "to predict. Pass data with at least one row. Received: 0 rows"
        )
    sample = source.sample()
    _sources.check_shapes(template, sample)
    verbose = 1 if verbose == "auto" else verbose
    predict = _predictor(parallel)

    if output is None:
        collected = []
        for batch, _ in _run(predict, source, 0, batch_size, verbose):
            collected.append(batch)
        return tree.map_structure(lambda *parts: np.concatenate(parts), *collected)

    attributes = {
        "kerasmulti_model": _sources.model_fingerprint(template),
        "kerasmulti_input": _sources.fingerprint(source),
        "kerasmulti_rows": source.rows,
    }
    _check_not_input(data, output)
    outputs = predict(sample)
    names = _output_names(template, outputs)
    if not os.path.exists(output):
        spec = [(np.shape(o)[1:], _file_dtype(np.asarray(o).dtype)) for o in tree.flatten(outputs)]
        _create(output, source.rows, spec, names, attributes, extra or {})
    with _open_existing(output, attributes) as f:
        done = int(f[PROGRESS][()])
        for batch, (begin, end) in _run(predict, source, done, batch_size, verbose):
            for name, values in zip(names, tree.flatten(batch)):
                f[name][begin:end] = np.asarray(values).astype(f[name].dtype, copy=False)
            f.flush()
            _faults.reached("predict:rows")
            f[PROGRESS][()] = end  # only after the rows are on disk
            f.flush()
            _faults.reached("predict:counter")
    return output


def _file_dtype(dtype: np.dtype) -> np.dtype:
    # HDF5 has no bfloat16 (mixed_bfloat16 outputs): h5py would store opaque
    # bytes. float32 holds every bfloat16 value exactly.
    return np.dtype("float32") if dtype.name == "bfloat16" else dtype


def _check_not_input(data, output: str) -> None:
    """Refuses an output path that is the input's own file."""
    if not os.path.exists(output):
        return
    for leaf in tree.flatten(data):
        file = getattr(getattr(leaf, "file", None), "filename", None) or getattr(leaf, "filename", None)
        if isinstance(file, (str, os.PathLike)) and os.path.exists(file) and os.path.samefile(file, output):
            raise ValueError(
                f"parallel_predict() would write its results into '{output}', the "
                "file it reads its input from, which would destroy the input. "
                f"Choose another output path. Received: output={output!r}"
            )


def _parallel_of(model, gpus, devices) -> ParallelModel:
    """The parallel model of `model` on these devices, built once and reused.

    One per set of devices, kept in the model's `__dict__` under a name that
    starts with `__`, which Keras' attribute tracking and its saving walk both
    skip: it is no sub-layer and is not saved. It is rebuilt when the model's
    layers or variables are no longer those it was built on (a Sequential grown
    since, variables moved by `cpu_relocation` or by joining a cluster, a
    quantized model). Like `model.predict`'s, its step is traced once: Python
    state that the model's `call` reads is taken as it was then.
    """
    _check_model(model)  # the errors parallelize() gives, in its order
    # In a cluster too, inference runs on this worker's devices alone.
    key = tuple(resolve_devices(gpus, devices))
    # Only outside an autocast scope (as here) is `value` the variable itself.
    built_on = [*model._flatten_layers(include_self=False), *(v.value for v in model.variables)]
    cache = model.__dict__.setdefault(_CACHE, {})
    parallel, cached_on = cache.get(key, (None, []))
    same = len(cached_on) == len(built_on) and all(a is b for a, b in zip(cached_on, built_on))
    if parallel is None or not same:
        parallel = local_parallel(model, gpus=gpus, devices=devices)
        cache[key] = parallel, built_on
    return parallel


def drop_kept_steps(model) -> None:
    """Forgets what `parallel_predict` kept for `model`: its parallel models and predict step."""
    model.__dict__.pop(_CACHE, None)
    model.__dict__.pop(_STEP, None)


def _predictor(parallel):
    # Compiled once per parallel model and reused by later calls. A relaxed
    # signature keeps the first, the full and the last batch to two traces.
    step = getattr(parallel, _STEP, None)
    if step is None:
        step = tf.function(lambda x: parallel(x, training=False), reduce_retracing=True)
        setattr(parallel, _STEP, step)
    return lambda inputs: tree.map_structure(np.asarray, step(tree.map_structure(tf.convert_to_tensor, inputs)))


def _run(predict, source, start, batch_size, verbose):
    """Yields (predictions, (first_row, end_row)) batch by batch from `start`."""
    bar = keras.utils.Progbar(source.rows, verbose=verbose, unit_name="row", stateful_metrics=["rows/s"])
    begin_time, row = time.perf_counter(), start
    if start:
        bar.update(start)
    for inputs in _prefetch(source.batches(start, batch_size)):
        predictions = predict(inputs)
        end = row + len(tree.flatten(predictions)[0])
        if source.rows is not None and end > source.rows:
            row = end  # more rows than counted: reported below
            break
        yield predictions, (row, end)
        rate = (end - start) / max(time.perf_counter() - begin_time, 1e-9)
        bar.update(end, values=[("rows/s", rate)])
        row = end
    if source.rows is not None and row != source.rows:
        raise ValueError(
            f"The input gave {'at least ' if row > source.rows else ''}{row} rows, but "
            f"{source.rows} were counted before predicting: parallel_predict() reads "
            "some inputs more than once, and they must give the same rows each time. "
            f"Received: rows={row}, counted={source.rows}"
        )
