"""Arrays in, steady speed out: the parallel model's own input pipeline.

Keras feeds numpy arrays to `fit`, `evaluate` and `predict` through an
autotuned `tf.data` pipeline. In TensorFlow 2.21, when such a pipeline's
iterator is torn down at the end of an epoch, the main thread waits for its
autotuning thread (about a second on 2 busy CPU cores), and whether that
wait lands inside the next timed epoch is chance: epochs ran at one of two
speeds, and a parallel model's speed-up over one device read anywhere from
0.7x to 2x (benchmarks/README.md). A parallel model builds the very same
pipeline (Keras' own `ArrayDataAdapter`: the same batches, shuffling, class
weights and float casting) with autotuning off, and hands Keras the dataset.

Only arrays are converted (numpy, lists and dicts of them, what Keras'
array adapter takes), and only where Keras would feed them through that
pipeline unchanged: not with `steps_per_epoch` or `steps`. A `PyDataset`,
a generator or a `tf.data` pipeline reaches Keras as given.
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import call_checks as _call_checks
from kerasmulti._src.data_parallel import epoch_order as _epoch_order
from kerasmulti._src.keras_private import array_data_adapter, array_slicing


def bound(method, args, kwargs) -> dict:
    """`args` and `kwargs` of a call to `method` as keywords, defaults filled in."""
    bound_arguments = inspect.signature(method).bind(None, *args, **kwargs)
    bound_arguments.apply_defaults()
    arguments = dict(bound_arguments.arguments)
    arguments.pop(next(iter(arguments)))  # self
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def endless(data) -> bool:
    """Whether `data` is a `tf.data.Dataset` certain never to end, also behind an op that hides its length.

    TensorFlow's count is UNKNOWN behind `filter`, and INFINITE for some
    pipelines that end (`sample_from_datasets(..., stop_on_empty_dataset=True)`
    over one endless input): where it is not finite, the pipeline's ops decide.
    """
    if not isinstance(data, tf.data.Dataset):
        return False
    return int(data.cardinality()) < 0 and _never_ends(data)


def _never_ends(dataset: tf.data.Dataset) -> bool:
    """Whether a `repeat()` without a count, or an endless source, feeds `dataset` with nothing that can end it."""
    kind, count = type(dataset).__name__, keras_private.dataset_count(dataset)
    inputs = keras_private.dataset_inputs(dataset)
    bounded = kind == "_TakeDataset" and count is not None and count >= 0
    if bounded or kind == "_TakeWhileDataset" or (kind == "_RepeatDataset" and count == 0):
        return False  # ends, or may (take_while): Keras reads it as it would
    if kind == "_RepeatDataset" and count is not None and count < 0:
        return int(inputs[0].cardinality()) != 0  # an empty input repeated ends at once
    if not inputs:
        return int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY)  # Dataset.random(), a counter
    if kind == "_ConcatenateDataset":
        return any(_never_ends(d) for d in inputs)
    if kind == "_DirectedInterleaveDataset":  # sample_from_datasets, choose_from_datasets
        selector, *data = inputs
        # Past an empty input it draws on from the others, unless told to stop there.
        drawn_from = all if keras_private.stops_on_empty(dataset) is not False else any
        return _never_ends(selector) and drawn_from(_never_ends(d) for d in data)
    # zip ends with its shortest input; map, filter, batch and the like go on as long as their input.
    return all(_never_ends(d) for d in inputs)


def check_ends(method: str, arguments: dict, steps: str, data: str = "x") -> None:
    """Refuses an endless dataset without `steps`: Keras would read its first epoch forever."""
    if arguments[steps] is None and endless(arguments[data]):
        raise ValueError(
            f"{method}() got a tf.data.Dataset as {data} that never ends. Pass {steps}=, or give "
            f"`.repeat()` a count. Received: {steps}=None"
        )


def _arrays(*structures) -> bool:
    present = [s for s in structures if s is not None]
    return bool(present) and array_data_adapter.can_convert_arrays(present)


def pipeline(x, y=None, sample_weight=None, batch_size=None, shuffle=False, class_weight=None) -> tf.data.Dataset:
    """Keras' pipeline for arrays, with autotuning off and its length known."""
    adapter = array_data_adapter.ArrayDataAdapter(
        x, y, sample_weight=sample_weight, batch_size=batch_size or 32, shuffle=shuffle, class_weight=class_weight
    )
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = adapter.get_tf_dataset().apply(tf.data.experimental.assert_cardinality(adapter.num_batches))
    return dataset.with_options(options)


def fit_arguments(arguments: dict, seed: int | None = None, model=None) -> dict:
    """`fit`'s keyword arguments, with arrays (and validation arrays) as pipelines.

    With `seed`, shuffled arrays come in an order drawn from it and the
    epoch's number (`epoch_order`), which a backup can resume exactly. With
    `model`, the arguments are first checked against it (`call_checks`).
    """
    if model is not None:
        _call_checks.check_fit(model, arguments)
    check_ends("fit", arguments, "steps_per_epoch")
    check_ends("fit", arguments, "validation_steps", "validation_data")
    x, y, sample_weight = arguments["x"], arguments["y"], arguments["sample_weight"]
    if seed is not None and arguments["shuffle"] is True and _epoch_order.resumable(x, arguments["steps_per_epoch"]):
        # Keras would shuffle its batches with no seed: a backup could not resume the order.
        order = _epoch_order.EpochOrder(seed)
        callbacks = _epoch_order.with_callback(arguments["callbacks"], order)
        return dict(arguments, x=_epoch_order.OrderedBatches(x, order), shuffle=False, callbacks=callbacks)
    if arguments["steps_per_epoch"] is not None or not _arrays(x, y, sample_weight):
        return arguments
    arguments = dict(arguments)
    validation_data, split = arguments["validation_data"], arguments["validation_split"]
    if split and validation_data is None:
        # As Keras splits arrays: the last rows, before any shuffling.
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=split
        )
    batch_size = arguments["batch_size"]
    if seed is not None and arguments["shuffle"] is True and _split_rows(x):
        order = _epoch_order.EpochOrder(seed)
        data = _epoch_order.shuffled(x, y, sample_weight, batch_size, arguments["class_weight"], order)
        arguments["callbacks"] = _epoch_order.with_callback(arguments["callbacks"], order)
    else:
        data = pipeline(x, y, sample_weight, batch_size, arguments["shuffle"], arguments["class_weight"])
    arguments.update(
        x=data,
        y=None, sample_weight=None, class_weight=None, batch_size=None, shuffle=False, validation_split=0.0,
    )
    if validation_data is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
        if _arrays(val_x, val_y, val_weight):
            # Batched as Keras batches them: the fit's batch size went with the training arrays.
            validation_batch_size = arguments["validation_batch_size"] or batch_size
            if arguments["validation_steps"] is None:
                validation_data = pipeline(val_x, val_y, val_weight, validation_batch_size)
                validation_batch_size = None
            arguments["validation_batch_size"] = validation_batch_size
    arguments["validation_data"] = validation_data
    return arguments


def _split_rows(x) -> int:
    return int(next(iter(keras.tree.flatten(x))).shape[0])


def evaluate_arguments(arguments: dict, model=None) -> dict:
    """`evaluate`'s keyword arguments, with arrays as a pipeline; checked against `model` if given."""
    if model is not None:
        _call_checks.check_evaluate(model, arguments)
    check_ends("evaluate", arguments, "steps")
    x, y, sample_weight = arguments["x"], arguments["y"], arguments["sample_weight"]
    if arguments["steps"] is not None or not _arrays(x, y, sample_weight):
        return arguments
    data = pipeline(x, y, sample_weight, arguments["batch_size"])
    return dict(arguments, x=data, y=None, sample_weight=None, batch_size=None)


def predict_arguments(arguments: dict, model=None) -> dict:
    """`predict`'s keyword arguments, with arrays as a pipeline; checked against `model` if given."""
    if model is not None:
        _call_checks.check_predict(model, arguments)
    check_ends("predict", arguments, "steps")
    if arguments["steps"] is not None or not _arrays(arguments["x"]):
        return arguments
    return dict(arguments, x=pipeline(arguments["x"], batch_size=arguments["batch_size"]), batch_size=None)
