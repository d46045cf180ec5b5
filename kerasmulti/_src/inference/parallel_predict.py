"""`parallel_predict`: data-parallel inference over data larger than memory.

Batches are read one at a time (a background thread reads the next ones while
the devices work), predicted by a parallel model, and either collected (into
arrays, or `tf.RaggedTensor`s where batches differ in shape, as
`model.predict` returns them) or streamed into an HDF5 file that a killed
run resumes (`output_file`). The same call again continues from the file's
counter; a file written for another model or input is refused, and so is an
input whose outputs change shape between batches, before the file is touched
where the input's batches are known in advance.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.call_checks import check_batched, check_indices
from kerasmulti._src.data_parallel.custom_steps import warn_not_run
from kerasmulti._src.data_parallel.local_model import LocalParallelModel
from kerasmulti._src.data_parallel.parallel_model import unwrap
from kerasmulti._src.data_parallel.split import not_one_row_per_input
from kerasmulti._src.data_parallel.wrap import check_model, local_parallel
from kerasmulti._src.devices import resolve_devices
from kerasmulti._src.inference import fingerprints as _fingerprints
from kerasmulti._src.inference import output_file as _output_file
from kerasmulti._src.inference import sources as _sources
from kerasmulti._src.inference.input_checks import check_inputs
from kerasmulti._src.utils import fault_points as _fault_points
from kerasmulti._src.utils.arguments import is_positive_int

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
            names = [keras_private.keras_history(t).operation.name for t in template.outputs]
    usable = all(isinstance(name, str) and name not in ("", ".") and "/" not in name for name in names)  # '/': an HDF5 group
    if len(names) != len(flat) or len(set(names)) != len(names) or not usable:
        names = [f"output_{i}" for i in range(len(flat))]
    return names


def parallel_predict(
    model: keras.Model,
    data,
    gpus=None,
    devices=None,
    batch_size: int = 32,
    output: str | os.PathLike | None = None,
    verbose="auto",
    extra: dict | None = None,
    steps: int | None = None,
):
    """Predicts over a data set on several devices, optionally into an HDF5 file.

    Each batch is split across the devices as in `parallelize`; results come
    back in input order and equal `model.predict` row for row. Data is read a
    batch at a time, so with `output` set memory stays flat however large the
    input. With `output="features.h5"` the results stream into an HDF5 file,
    one dataset per model output, named after it; if the process dies, the same
    call continues where the file says it stopped, and every row ends up
    written exactly once. The file's attribute `kerasmulti_rows_done` says how
    many rows are final.

    Args:
        model: A `keras.Model`, or a model from `parallelize` (its devices are
            used unless `gpus` or `devices` is given). Later calls on the same
            devices reuse the compiled step; for a plain model it is kept with
            the model, unseen by Keras (not a layer, not saved).
        data: Numpy arrays (lists or dicts of them for several inputs, a
            memory-mapped `.npy` file), an `h5py.Dataset`, a
            `keras.utils.PyDataset` or a `tf.data.Dataset` (both yield batches;
            a Python generator goes in `tf.data.Dataset.from_generator`).
        gpus: As in `parallelize`: how many devices, a list of ids, or None.
        devices: As in `parallelize`: explicit TensorFlow device names.
        batch_size: Rows per step for arrays and HDF5 datasets.
        output: Path of an HDF5 file to stream results into (its folder is
            made if missing), or None to return them.
        verbose: `"auto"` or 1 shows a progress bar with rows/s, 0 is quiet,
            2 prints one line at the end.
        extra: A dict of arrays stored beside the results in `output` (e.g.
            `{"filenames": names}`), one row per input row, each a dataset
            named after its key (not an output's name). Needs `output`.
        steps: As in `model.predict`: how many batches to predict, or None
            for all of them. Needed for an endless input (`.repeat()`).

    Returns:
        With `output=None`, the predictions, structured as `model.predict`
        returns them (a `tf.RaggedTensor` for an output whose batches differ
        in shape); otherwise the output path.

    Raises:
        ValueError: If the rows do not fit the model, `batch_size` or `steps`
            is not a positive int, `verbose` is not 0, 1, 2 or `"auto"`,
            `output` cannot be written or holds results of another model or
            input, `extra` is given without `output`, lacks one row per input
            row or takes an output's name, or, with `output` set, an output's
            rows change shape between batches or a `tf.data.Dataset` gives
            other batches when read again (a reshuffling `shuffle()`).
        TypeError: If `model` is not a `keras.Model`, `data` is of a kind it
            cannot read (a Python generator), or `extra` is not a dict.

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
            "parallel_predict() needs batch_size as a positive int. "
            f"Received: batch_size={batch_size!r}"
        )
    if steps is not None and not is_positive_int(steps):
        raise ValueError(
            f"parallel_predict() needs steps as a positive int or None (all). Received: steps={steps!r}"
        )
    # As model.predict takes it; True and False too, which it reads as 1 and 0.
    if not (verbose == "auto" if isinstance(verbose, str) else isinstance(verbose, (int, np.integer)) and verbose in (0, 1, 2)):
        raise ValueError(
            f"parallel_predict() takes verbose as in model.predict: 'auto', 0, 1 or 2. Received: verbose={verbose!r}"
        )
    if output is not None:
        output = _output_file.check_path(output)
        _refuse_on_other_workers(output)
    extra = _output_file.check_extra(extra, output)
    if not isinstance(model, keras.Model):
        shown = repr(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__
        raise TypeError(
            "parallel_predict() predicts with a keras.Model. Load a saved one with keras.models.load_model. "
            f"Received: model={shown}"
        )
    if type(model) is LocalParallelModel and gpus is None and devices is None:
        parallel = model  # its compiled step is reused across calls
    else:
        parallel = _parallel_of(unwrap(model), gpus, devices)
    template = parallel._template
    warn_not_run(template, ("predict_step",))
    check_batched("parallel_predict", template, data)
    if isinstance(data, keras.utils.PyDataset) and hasattr(data, "on_epoch_begin"):  # as model.predict (not in Keras 3.14)
        data.on_epoch_begin()
    sample_rows = min(batch_size, 2 * len(parallel.replica_devices))  # 1 row, squeeze()d, would be none
    source = _sources.make_source(data, counted=output is not None, steps=steps, batch_size=batch_size, sample_rows=sample_rows)
    if source.rows == 0 or source.sample() is None:
        raise ValueError(
            "parallel_predict() got an input with no rows. Pass data with at least one row. Received: rows=0"
        )
    check_inputs(template, source.sample())
    verbose = 1 if verbose == "auto" else verbose
    predict = _predictor(parallel)
    if output is None:
        collected = [batch for batch, _ in _predicted_batches(predict, template, source, 0, batch_size, verbose)]
        result = tree.map_structure(lambda *parts: _concatenate(parts), *collected)
    else:
        _output_file.check_not_input(data, output)
        _output_file.check_extra_rows(extra, source.rows)
        _stream(predict, template, source, output, batch_size, verbose, extra)
        result = output
    if isinstance(data, keras.utils.PyDataset):
        data.on_epoch_end()
    return result


def _refuse_on_other_workers(output: str) -> None:
    if not _cluster.is_chief():
        # Every worker writing one file would clobber it.
        raise _cluster.ClusterError(
            "parallel_predict() writes output= on the chief (worker 0) only. Pass output= there "
            "alone, or give each worker its own file. "
            f"Received: output={output!r} on worker {_cluster.config()['task']['index']}"
        )


def _concatenate(parts):
    """Joins batches as `model.predict` does: one array, or a `tf.RaggedTensor` where their row shapes differ."""
    shapes = [np.shape(part)[1:] for part in parts]
    if all(shape == shapes[0] for shape in shapes):
        return np.concatenate(parts)
    # Ragged up to the last dimension that differs, as Keras makes it.
    ragged_rank = max(d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1) + 1
    return tf.concat([tf.RaggedTensor.from_tensor(part, ragged_rank=ragged_rank) for part in parts], axis=0)


def _stream(predict, template, source, output, batch_size, verbose, extra) -> None:
    """Predicts into the HDF5 file `output`, creating it or resuming it."""
    attributes = {
        _output_file.MODEL: _fingerprints.model_fingerprint(template),
        "kerasmulti_input": _fingerprints.fingerprint(source),
        "kerasmulti_rows": source.rows,
    }
    sample = source.sample()
    outputs = _sample_outputs(predict, template, sample)
    names = _output_names(template, outputs)
    spec = [(np.shape(o)[1:], _output_file.file_dtype(np.asarray(o).dtype, name))
            for o, name in zip(tree.flatten(outputs), names)]
    _check_row_shapes(template, source, sample, names, spec, output)
    _output_file.check_extra_names(extra, names)
    resumed = not _output_file.absent(output)
    if not resumed:
        _output_file.create(output, source.rows, spec, names, attributes, extra)
    with _output_file.open_existing(output, attributes) as f:
        if resumed:
            names = _output_file.resumed_names(f, output, names, extra)
        done = _output_file.rows_done(f)
        for batch, (begin, end) in _predicted_batches(predict, template, source, done, batch_size, verbose):
            values = [np.asarray(v) for v in tree.flatten(batch)]
            for name, value in zip(names, values):  # all checked before any is written
                if value.shape[1:] != f[name].shape[1:]:
                    raise _row_shape_changed(name, f[name].shape[1:], value.shape[1:], begin, output)
            for name, value in zip(names, values):
                f[name][begin:end] = value.astype(f[name].dtype, copy=False)
            f.flush()
            _fault_points.reached("predict:rows")
            _output_file.set_rows_done(f, end)  # only after the rows are on disk
            f.flush()
            _fault_points.reached("predict:counter")


def _sample_outputs(predict, template, sample):
    """The outputs of the sample rows, which the file's layout is made from.

    A model that holds a stateful layer (an RNN on one device) is run
    symbolically: running it would move its state on before the first batch.
    """
    if any(getattr(layer, "stateful", False) for layer in keras_private.flatten_layers(template)):
        with contextlib.suppress(Exception):  # a model Keras cannot run symbolically is run
            symbolic = tree.map_structure(lambda a: keras.KerasTensor((None, *np.shape(a)[1:]), dtype=np.asarray(a).dtype.name), sample)
            outputs = template.compute_output_spec(symbolic)
            if all(None not in tuple(t.shape[1:]) for t in tree.flatten(outputs)):
                return tree.map_structure(lambda t: np.zeros((1, *t.shape[1:]), dtype=t.dtype), outputs)
    return _one_row_per_input(predict(sample), sample)


def _one_row_per_input(predictions, inputs):
    """`predictions`, refused where an output lacks one row per input row (a step traced for any batch size cannot tell)."""
    rows = int(np.shape(tree.flatten(inputs)[0])[0])
    for value in tree.flatten(predictions):
        if np.ndim(value) == 0 or len(value) != rows:
            raise not_one_row_per_input("A batch", rows, np.shape(value), "its rows are not the input's", "use model.predict")
    return predictions


def _check_row_shapes(template, source, sample, names, spec, output) -> None:
    """Refuses, before the file is touched, an input whose outputs would change row shape.

    The input row shapes known in advance (every batch of a tf.data
    pipeline, the first and last of a PyDataset) are run through the model
    symbolically; other batches are checked as they come, before they are
    written.
    """
    row_shapes = source.row_shapes()
    if len(row_shapes) < 2:
        return
    leaves = tree.flatten(sample)
    for shapes, row in row_shapes.items():
        try:
            symbolic = [keras.KerasTensor((None, *s), dtype=a.dtype.name) for s, a in zip(shapes, leaves)]
            outputs = tree.flatten(template.compute_output_spec(tree.pack_sequence_as(sample, symbolic)))
        except Exception:  # a model Keras cannot run symbolically: checked batch by batch
            return
        for name, (first, _), tensor in zip(names, spec, outputs):
            shape = tuple(tensor.shape[1:])
            if None not in shape and shape != tuple(first):
                raise _row_shape_changed(name, first, shape, row, output)


def _row_shape_changed(name, first, shape, row, output) -> ValueError:
    # With output=None the batches are joined into a tf.RaggedTensor, as
    # model.predict joins them.
    return ValueError(
        f"Output '{name}' has rows of shape {tuple(first)} in the first batch but {tuple(shape)} "
        f"from row {row}, and an HDF5 output holds one row shape. Pad the input to one shape, or "
        f"pass output=None. Received: output={output!r}"
    )


def _parallel_of(model, gpus, devices) -> LocalParallelModel:
    """The parallel model of `model` on these devices, built once and reused.

    One per set of devices, kept in the model's `__dict__` under a name that
    starts with `__`, which Keras' attribute tracking and its saving walk both
    skip: it is no sub-layer and is not saved. It is rebuilt when the model's
    layers or variables are no longer those it was built on (a Sequential grown
    since, variables moved by `cpu_relocation` or by joining a cluster, a
    quantized model). Like `model.predict`'s, its step is traced once: Python
    state that the model's `call` reads is taken as it was then.
    """
    # In a cluster too, inference runs on this worker's devices alone.
    key = tuple(resolve_devices(gpus, devices, caller="parallel_predict()"))
    check_model(model, "parallel_predict()", replicas=len(key))  # the errors parallelize() gives, in its order
    # Only outside an autocast scope (as here) is `value` the variable itself.
    built_on = [*keras_private.flatten_layers(model, include_self=False), *(v.value for v in model.variables)]
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
        step = tf.function(lambda x: parallel(x, training=False), reduce_retracing=True, autograph=False)
        setattr(parallel, _STEP, step)
    return lambda inputs: tree.map_structure(np.asarray, step(tree.map_structure(tf.convert_to_tensor, inputs)))


def _predicted_batches(predict, template, source, start, batch_size, verbose):
    """Yields (predictions, (first_row, end_row)) batch by batch from `start`."""
    bar = keras.utils.Progbar(source.rows, verbose=verbose, unit_name="row", stateful_metrics=["rows/s"])
    begin_time, row = time.perf_counter(), start
    if start:
        bar.update(start)
    for inputs in _prefetch(source.batches(start, batch_size)):
        check_indices("parallel_predict", template, inputs, "data")
        predictions = _one_row_per_input(predict(inputs), inputs)
        end = row + len(tree.flatten(predictions)[0])
        if source.rows is not None and end > source.rows:
            row = end  # more rows than counted: reported below
            break
        yield predictions, (row, end)
        rate = (end - start) / max(time.perf_counter() - begin_time, 1e-9)
        bar.update(end, values=[("rows/s", rate)])
        row = end
    if source.rows is not None and row != source.rows:
        # Some inputs are read twice: once to count their rows, then to predict.
        raise _sources.reread_error(row, source.rows)
