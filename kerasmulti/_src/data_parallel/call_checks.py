"""Wrong arguments to a parallel model's calls, refused before anything runs.

Keras checks much of what `compile`, `fit`, `evaluate` and `predict` are
given only inside the traced step, where its error names a graph node (on a
parallel model, one replica's thread) rather than the argument, and some of
it not at all: `batch_size=0` trains with 32, a label past the last class
is NaN on a GPU. These checks run first, on what is cheap and certain: the
numbers, the arrays' rows, structure, shapes and dtypes against the
template's inputs and output, labels against the classes of a sparse
crossentropy and the rows of a first `Embedding` (the paths `save` and
`load_weights` are given: `persistence`). A `tf.data.Dataset` is judged by its
`element_spec` alone, a generator or `PyDataset` not at all, and a template
with steps of its own only by the numbers: what is not certain is Keras'.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.utils.arguments import is_int, is_positive_int, is_real


def check_compile(args, kwargs) -> None:
    """Refuses an optimizer or loss name Keras does not know, and `steps_per_execution` below 1."""
    arguments = inspect.signature(keras.Model.compile).bind(None, *args, **kwargs).arguments
    loss, optimizer = arguments.get("loss"), arguments.get("optimizer", "rmsprop")
    _loss_parts.check_reductions(loss)
    if isinstance(optimizer, str):
        try:
            keras.optimizers.get(optimizer)
        except ValueError:
            raise ValueError(
                f"compile() does not know this optimizer. Pass e.g. 'adam' or an object. "
                f"Received: optimizer={optimizer!r}"
            ) from None
    for name in tree.flatten(loss):
        if isinstance(name, str) and name.lower() not in ("crossentropy", "ce"):
            try:
                keras.losses.get(name)
            except ValueError:
                raise ValueError(
                    f"compile() does not know this loss. Pass a Keras name ('mse'), object or function. "
                    f"Received: loss={name!r}"
                ) from None
    steps = arguments.get("steps_per_execution", 1)
    if not is_positive_int(steps):
        raise ValueError(
            "compile() needs steps_per_execution as a positive int. "
            f"Received: steps_per_execution={steps!r}"
        )


def check_fit(model, arguments: dict) -> None:
    """Refuses what `fit` would fail on inside its step, or train wrongly on."""
    _check_compiled("fit", model)
    epochs = arguments["epochs"]
    if not (is_int(epochs) and epochs >= 0):
        raise ValueError(
            "fit() needs epochs as an int >= 0, the epoch to stop at. "
            f"Received: epochs={epochs!r}"
        )
    split = arguments["validation_split"]
    if split and not (is_real(split) and 0 <= split < 1):
        raise ValueError(
            f"fit() needs validation_split as a fraction in [0, 1). Received: validation_split={split!r}"
        )
    _check_arrays("fit", model, arguments, "validation_batch_size")
    validation = arguments["validation_data"]
    if isinstance(validation, (tuple, list)) and 2 <= len(validation) <= 3:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(tuple(validation))
        _check_data("fit", model, dict(x=val_x, y=val_y, sample_weight=val_weight), "validation_data")
    classes = _classes(model)
    for key in arguments["class_weight"] or {}:
        if classes and is_int(key) and not 0 <= key < classes:
            raise ValueError(
                f"fit() got class_weight for class {key}, but '{model._template.name}' has classes "
                f"0 to {classes - 1}. Received: class_weight keys={sorted(arguments['class_weight'])}"
            )


def check_evaluate(model, arguments: dict) -> None:
    """Refuses what `evaluate` would fail on inside its step."""
    _check_compiled("evaluate", model)
    _check_arrays("evaluate", model, arguments)


def check_predict(model, arguments: dict) -> None:
    """Refuses what `predict` would fail on inside its step, or answer wrongly."""
    _check_arrays("predict", model, arguments)


def check_batch(method: str, model, x, y=None, sample_weight=None) -> None:
    """Refuses what `train_on_batch`, `test_on_batch` or `predict_on_batch` would fail on in a replica."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, Iterator)):
        whole = {"train_on_batch": "fit", "test_on_batch": "evaluate"}.get(method, "predict")
        raise ValueError(
            f"{method}() takes one batch of arrays, not a dataset or generator. Pass arrays, or give it "
            f"to {whole}(). Received: x={type(x).__name__}"
        )
    _check_data(method, model, dict(x=x, y=y, sample_weight=sample_weight), "x")


def _check_compiled(method: str, model) -> None:
    if not model.compiled:
        raise ValueError(
            f"{method}() needs a compiled model. Call compile() first. Received: compiled=False"
        )


def _check_arrays(method: str, model, arguments: dict, *sizes: str) -> None:
    """The checks of `fit`, `evaluate` and `predict` alike: a dataset's rank, the batch sizes and arrays."""
    data = {name: arguments.get(name) for name in ("x", "y", "sample_weight")}
    check_batched(method, model._template, data["x"])
    if not numpy_arrays(data["x"]):
        return
    for name in ("batch_size", *sizes):
        size = arguments[name]
        if size is not None and not is_positive_int(size):
            raise ValueError(
                f"{method}() needs {name} as a positive int or None. Received: {name}={size!r}"
            )
    _check_data(method, model, data, "x")


def numpy_arrays(structure) -> bool:
    """Whether `structure` is numpy arrays with a row axis, and nothing else."""
    leaves = tree.flatten(structure) if structure is not None else []
    return bool(leaves) and all(isinstance(a, np.ndarray) and a.ndim > 0 for a in leaves)


def _check_data(method: str, model, data: dict, argument: str) -> None:
    """Numpy `x`, `y` and `sample_weight` against each other and the template."""
    present = {name: value for name, value in data.items() if numpy_arrays(value)}
    if "x" not in present:
        return
    rows = {name: [len(a) for a in tree.flatten(value)] for name, value in present.items()}
    if len({n for counts in rows.values() for n in counts}) > 1:
        sizes = {name: counts[0] if len(counts) == 1 else counts for name, counts in rows.items()}
        where = "validation_data's" if argument == "validation_data" else "the"
        raise ValueError(
            f"{method}() got {where} {', '.join(sizes)} arrays with different numbers of rows. Give one per sample. "
            f"Received: rows={sizes}"
        )
    if rows["x"][0] == 0:
        raise ValueError(f"{method}() got {argument} arrays with no rows. Pass at least one row. Received: rows=0")
    template = model._template
    if model._custom is not None:
        return  # its own steps read the data as they please
    for name, tensor, array in _paired(method, template, data["x"], argument):
        _check_input(method, template, name, tensor, array, argument)
    if not method.startswith("predict"):
        _check_targets(method, model, data["x"], data["y"], argument)


def _inputs(template) -> list | None:
    """The template's input tensors, or None where it has none (a subclassed model)."""
    try:
        return list(template.inputs) or None
    except (AttributeError, ValueError):
        return None


def _named_inputs(template) -> tuple[dict, bool] | None:
    """The template's input tensors by the names a dict of inputs uses, and whether it takes a dict."""
    inputs = _inputs(template)
    if inputs is None:
        return None
    structure = inputs[0] if isinstance(template, keras.Sequential) else template.input
    if isinstance(structure, dict):
        return dict(structure), True
    return {t.name: t for t in tree.flatten(structure)}, False


def _paired(method: str, template, x, argument: str) -> list:
    """(name, input tensor, array) for each input, as Keras matches `x` to them; refuses a missing one."""
    named = _named_inputs(template)
    if named is None:
        return []
    named, takes_dict = named
    if isinstance(x, dict):
        check_input_keys(method, template, x, argument)
        return [(name, tensor, x[name]) for name, tensor in named.items()]
    if takes_dict:
        return []  # matched by sorted names where Keras can; Keras says where not
    arrays = tree.flatten(x)
    if len(arrays) != len(named):
        raise ValueError(
            f"{method}() got {len(arrays)} arrays as {argument}, but model '{template.name}' takes "
            f"{', '.join(named)}. Pass one per input. Received: {argument} with {len(arrays)} arrays"
        )
    return [(name, tensor, array) for (name, tensor), array in zip(named.items(), arrays)]


def check_input_keys(method: str, template, x: dict, argument: str = "x") -> None:
    """Refuses a dict of inputs without an array for each of the template's inputs."""
    named = _named_inputs(template)
    missing = [name for name in named[0] if name not in x] if named else []
    if missing:
        raise ValueError(
            f"{method}() got {argument} without the input(s) {missing} of model '{template.name}'. "
            f"Add them by name. Received: {argument} keys={sorted(x, key=str)}"
        )


def _check_input(method: str, template, name: str, tensor, array: np.ndarray, argument: str) -> None:
    if array.dtype.kind in "US" and tensor.dtype != "string":
        raise ValueError(
            f"{method}() got text as {argument} for input '{name}' of dtype {tensor.dtype}. "
            f"Convert it (StringLookup). Received: dtype={array.dtype}"
        )
    expected, got = tuple(tensor.shape[1:]), array.shape[1:]
    if not row_shape_fits(got, expected):
        raise ValueError(
            f"{method}() got {argument} rows of shape {got} for input '{name}', which takes {expected}. "
            f"Reshape it. Received: {argument}.shape={array.shape}"
        )
    if np.issubdtype(array.dtype, np.integer) and array.size:
        _check_indices(method, template, tensor, array, argument)


def row_shape_fits(got: tuple, expected: tuple) -> bool:
    """Whether rows of shape `got` fit an input taking `expected` (None: any size), as Keras takes them."""
    if len(got) == len(expected) + 1 and got[-1:] == (1,):  # Keras squeezes a last axis of 1 itself
        got = got[:-1]
    elif len(got) + 1 == len(expected) and expected[-1:] == (1,):  # or adds one
        expected = expected[:-1]
    return len(got) == len(expected) and all(e is None or e == g for e, g in zip(expected, got))


def check_indices(method: str, template, x, argument: str) -> None:
    """Refuses a batch's integers past the rows of an `Embedding` that reads them (TensorFlow's error names a replica's row)."""
    try:
        paired = _paired(method, template, x, argument)
    except ValueError:
        return  # a batch that does not fit the inputs: the model's own call says so
    for _, tensor, array in paired:
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.integer) and array.size:
            _check_indices(method, template, tensor, array, argument)


def _check_indices(method: str, template, tensor, array: np.ndarray, argument: str) -> None:
    """Refuses indices past the rows of an `Embedding` that reads the input as given."""
    for layer in template.layers:
        reads = any(
            [id(t) for t in node.input_tensors] == [id(tensor)] for node in keras_private.inbound_nodes(layer)
        )
        if not (isinstance(layer, keras.layers.Embedding) and reads):
            continue
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= layer.input_dim:
            bad = low if low < 0 else high
            raise ValueError(
                f"{method}() got index {bad} for Embedding '{layer.name}' (rows 0 to {layer.input_dim - 1}). "
                f"Raise input_dim. Received: {argument} values {low} to {high}"
            )


def _output(model):
    """The template's one output tensor, or None (several, or a subclassed model)."""
    try:
        outputs = model._template.outputs
    except (AttributeError, ValueError):
        return None
    return outputs[0] if outputs and len(outputs) == 1 else None


def _output_keys(model) -> list | None:
    """The names `y` is matched to outputs by: a dict of outputs' keys (Keras' own), else the output layers' names.

    None where neither is known (a subclassed model's outputs are known only once it runs).
    """
    try:
        structure = model._template.output
    except (AttributeError, ValueError):
        structure = None  # a subclassed model
    if isinstance(structure, dict):
        return sorted(structure)
    names = getattr(model, "output_names", None)
    return None if names is None else list(names)


def _classes(model) -> int | None:
    """The classes a one-output template predicts (2 for one unit), or None where unknown."""
    output = _output(model)
    units = output.shape[-1] if output is not None and len(output.shape) > 1 else None
    return None if units is None else max(int(units), 2)


def _check_targets(method: str, model, x, y, argument: str) -> None:
    loss = keras_private.compile_arguments(model).get("loss")
    if not any(item is not None for item in tree.flatten(loss)):
        return  # no compiled loss: the model adds its own, and reads no y
    if y is None:
        if argument == "x":
            raise ValueError(
                f"{method}() got x without y, but model '{model._template.name}' has a loss. "
                "Pass y or use loss=None. Received: y=None"
            )
        return
    if isinstance(y, dict) and not isinstance(loss, (list, tuple)):
        names = _output_keys(model) or []
        needed = [n for n in names if loss.get(n) is not None] if isinstance(loss, dict) else names
        missing = [n for n in needed if n not in y]
        if missing:
            raise ValueError(
                f"{method}() got no target for output(s) {missing}, which have a loss. Pass one for each. "
                f"Received: y keys={sorted(y)}"
            )
    output, builtin = _output(model), _builtin_loss(loss)
    if output is None or builtin is None or not isinstance(y, np.ndarray):
        return
    _check_target_shape(method, model, y, output, argument)
    if builtin is keras.losses.sparse_categorical_crossentropy or isinstance(
        builtin, keras.losses.SparseCategoricalCrossentropy
    ):
        _check_labels(method, model, y, output, builtin, argument)


def _builtin_loss(loss):
    """The one Keras loss `loss` names or is, or None (the user's own, several, or "crossentropy")."""
    if isinstance(loss, (list, tuple, dict)):
        loss = tree.flatten(loss)[0] if len(tree.flatten(loss)) == 1 else None
    if isinstance(loss, str):
        loss = None if loss.lower() in ("crossentropy", "ce") else keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        owners = [type(loss), getattr(loss, "fn", type(loss))]  # a wrapped function is the user's own
    else:
        owners = [loss]
    return loss if loss is not None and all(str(getattr(o, "__module__", "")).startswith("keras.") for o in owners) else None


def _check_target_shape(method: str, model, y: np.ndarray, output, argument: str) -> None:
    """A Keras loss compares targets and predictions element by element, the last axis broadcast from 1."""
    target, predicted = y.shape[-1] if y.ndim > 1 else 1, output.shape[-1]
    if y.ndim == len(output.shape) and predicted is not None and 1 not in (target, predicted) and target != predicted:
        name = "y" if argument == "x" else argument
        raise ValueError(
            f"{method}() got {target} target values per row, but the output has {predicted}. "
            f"Use shape {tuple(output.shape[1:])}. Received: {name}.shape={y.shape}"
        )


def _check_labels(method: str, model, y: np.ndarray, output, loss, argument: str) -> None:
    """Sparse crossentropy reads the prediction at each label: one past the classes is an error on a CPU, NaN on a GPU."""
    classes = output.shape[-1]
    if classes is None or y.dtype.kind not in "iuf" or not y.size:
        return
    ignored = None if callable(loss) and not isinstance(loss, keras.losses.Loss) else loss.get_config().get("ignore_class")
    labels = y[y != ignored] if ignored is not None else y
    name = "y" if argument == "x" else argument
    if labels.size and y.dtype.kind == "f" and not np.array_equal(labels, np.round(labels)):
        raise ValueError(
            f"{method}() got labels that are not class indices, for a sparse crossentropy. Pass ints, or use "
            f"categorical_crossentropy for one-hot or soft targets. Received: {name}.dtype={y.dtype}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        low, high = labels.min(), labels.max()
        fix = f"Remap, or use {int(high) + 1} units" if low >= 0 else "Remap them"
        raise ValueError(
            f"{method}() got labels outside classes 0 to {classes - 1}. {fix}. "
            f"Received: {name}.min()={low:g}, {name}.max()={high:g}"
        )


def check_batched(method: str, template, data) -> None:
    """Refuses a dataset of single rows for a model with one input: Keras would read each row as a batch."""
    if not isinstance(data, tf.data.Dataset):
        return
    spec, inputs = data.element_spec, _inputs(template)
    if isinstance(spec, tuple) and 1 <= len(spec) <= 3:
        spec = spec[0]
    if not inputs or len(inputs) != 1 or not isinstance(spec, tf.TensorSpec):
        return
    row = tuple(inputs[0].shape[1:])
    # With a last axis of 1, a batch of rows Keras squeezes can have the same shape.
    if row and row[-1] != 1 and tuple(spec.shape) == row:
        raise ValueError(
            f"{method}() got a Dataset of single rows. Batch it: dataset.batch(32). "
            f"Received: element shape={tuple(spec.shape)}"
        )
