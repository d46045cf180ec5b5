"""A model whose output for a row depends on other rows, found at its first parallel call.

Splitting a batch gives one device's numbers only if each row's output
depends on that row alone (BatchNormalization aside, which replicas
synchronise). A layer that computes statistics over the batch, or compares
rows, sees only its replica's sub-batch. Such layers cannot be recognised by
their type, so the first `fit`, `evaluate` or `predict` of a parallel model
runs the template on a few rows, whole and split in two, and warns if the
outputs differ: a few small forward passes more, once per parallel model.

The rows are the first few of `x` where `x` is arrays; otherwise (a
`tf.data.Dataset`, a generator) rows made up from the template's inputs,
which any model whose rows stay apart maps alike whole and split, so the
input itself is never read. `fit` probes in training mode too, where a layer
may mix rows only while training, unless the template holds layers that are
meant to differ there (BatchNormalization, synchronised across replicas;
Dropout and other seeded layers, random). A model whose outputs change from
one call to the next (a VAE's sampling layer draws at prediction time) is not
judged: its rows differ by chance, not by each other. Whatever the probe's
calls move (a layer's counter or running statistics, seed states, a weight
it assigns) is put back, in every mode: the user's model is left as it was.
A model that assigns its weights in a training call (SpectralNormalization)
is warned about: every replica would assign them; so is a loss a layer adds
(`add_loss`) that is not a mean over the rows (a sum): each replica's counts
by its share of the rows. For the same reason the first `fit` on arrays
tries a `compute_loss` of the model's own (`probe_loss_once`).
"""

from __future__ import annotations

import contextlib
import random
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.call_checks import numpy_arrays
from kerasmulti._src.utils.patching import patched

PROBE_ROWS = 4
LOSS_PROBE_ROWS = 8
# Relative to the outputs' size: float sums in another order differ by about 1e-7.
TOLERANCE = 1e-3
# Smaller outputs count as this size: ones that cancel to ~1e-8 (GroupNormalization, then
# GlobalAveragePooling2D) differ by the rounding of the values they came from (~4e-8).
SMALLEST_SCALE = 1e-3
MADE_UP_LENGTH = 3  # for an input axis of unknown length


def probe_once(parallel, x, stacklevel: int, training: bool = False) -> None:
    """Warns if `parallel`'s template mixes the rows of a batch; once per parallel model.

    With `training`, also in training mode (see the module's docstring).
    """
    if parallel._rows_probed or len(parallel.replica_devices) < 2:
        return
    parallel._rows_probed = True
    template = parallel._template
    if numpy_arrays(x):
        count = len(tree.flatten(x)[0])
        if count < 2:
            return
        rows = min(count, PROBE_ROWS)
    else:
        rows, x = PROBE_ROWS, _made_up_rows(template, PROBE_ROWS)
        if x is None:
            return
    modes = [False] + ([True] if training and _alike_in_training(template) else [])
    assigned = {}  # the weights the calls assigned, each with its value before
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real call gives Keras' warnings, once
            differences = [_difference(template, x, rows, mode, assigned) for mode in modes]
    except Exception:
        return  # the call itself will say what is wrong
    if assigned:
        # Each replica would assign them (docs/limitations.md, "Custom steps and layer metrics").
        names = sorted(variable.path for variable, _ in assigned.values())
        warnings.warn(
            f"'{template.name}' assigns weights in its call (as SpectralNormalization does): every replica "
            f"would, so split over devices they differ. Train it on one device. Received: assigned={names}",
            stacklevel=stacklevel + 1,
        )
    added = max(loss for _, loss, _ in differences)
    if added > TOLERANCE:
        # Each replica's added loss counts by its share of the rows (docs/data-parallel.md, "Training").
        warnings.warn(
            f"'{template.name}' adds a loss (add_loss) that is not a mean over the batch's rows, so split over "
            f"devices it differs. Divide it by the rows, or use one device. Received: relative difference={added:.1e}",
            stacklevel=stacklevel + 1,
        )
    difference = max(outputs for outputs, _, _ in differences)
    reshaped = next((shapes[0] for _, _, shapes in differences if shapes), None)
    if reshaped is not None:
        # An axis as long as the batch (a similarity matrix, CLIP's logits): the replicas' joined are not one device's.
        whole, joined = reshaped
        warnings.warn(
            f"The outputs of '{template.name}' change shape with the batch's rows (an axis as long as the batch), "
            f"so split over devices they are not one device's. Run it on one device. Received: output shape "
            f"{whole}, joined from two halves {joined}",
            stacklevel=stacklevel + 1,
        )
    elif difference > TOLERANCE:
        # Why, and what to do: docs/data-parallel.md, "Models that look across rows".
        mode = " in training mode" if differences[0][0] <= TOLERANCE else ""
        warnings.warn(
            f"The outputs of '{template.name}' for a row depend on the other rows of its batch{mode}, "
            "so split over devices they differ. Run it on one device "
            f"(docs/data-parallel.md). Received: relative difference={difference:.1e}",
            stacklevel=stacklevel + 1,
        )


def probe_loss_once(parallel, arguments: dict, stacklevel: int) -> None:
    """Warns if the template's own `compute_loss` is not a mean over the rows; at its first `fit` on arrays.

    Each replica's loss counts by its share of the rows, so a loss divided by
    a count over the whole batch (RetinaNet-style positive anchors, DETR's
    `num_boxes`) is each replica's own count's. The first rows' loss, whole,
    is compared with their halves' weighted by their rows, in inference mode
    (no draws), and whatever the calls move is put back; a loss that changes
    with the rows' order (draws in the loss) is not judged.
    """
    if parallel._loss_probed or len(parallel.replica_devices) < 2:
        return
    parallel._loss_probed = True
    template = parallel._template
    x, y, sample_weight = (arguments.get(name) for name in ("x", "y", "sample_weight"))
    if type(template).compute_loss is keras.Model.compute_loss or not (numpy_arrays(x) and numpy_arrays(y)):
        return  # Keras' own loss is split exactly; a dataset is not read here
    if sample_weight is not None and not numpy_arrays(sample_weight):
        return
    count = len(tree.flatten(x)[0])
    # Rows spread over the data, cut a third of the way: the first rows, cut in halves, can hold
    # as many boxes each (a detector's), and then a count over the batch splits exactly.
    rows = np.unique(np.linspace(0, count - 1, min(count, LOSS_PROBE_ROWS)).astype(int))
    if len(rows) < 2:
        return
    cut = max(1, len(rows) // 3)

    def loss(taken):
        part = [None if d is None else tree.map_structure(lambda a: a[taken], d) for d in (x, y, sample_weight)]
        y_pred = template(part[0], training=False)
        return np.float64(np.asarray(keras_private.compute_loss(template, *part[:2], y_pred, part[2], False)))

    try:
        with warnings.catch_warnings(), _put_back(template, {}):
            warnings.simplefilter("ignore")  # the real step gives the model's warnings
            # Again in reverse: seeded draws come alike for a batch's shape but land on other rows.
            whole, again, first, second = loss(rows), loss(rows[::-1]), loss(rows[:cut]), loss(rows[cut:])
    except Exception:
        return  # the step itself will say what is wrong
    parts = (first * cut + second * (len(rows) - cut)) / len(rows)
    if _relative([whole], [again]) > TOLERANCE:
        return  # a loss that changes with the rows' order (draws) is not judged
    difference = _relative([whole], [parts])
    if difference > TOLERANCE:
        # docs/limitations.md, "Custom steps and layer metrics".
        warnings.warn(
            f"The compute_loss of '{template.name}' is not a mean over the batch's rows (divided by a count over "
            "the batch?), so split over devices it differs. Normalise per row, or use one device. "
            f"Received: relative difference={difference:.1e}",
            stacklevel=stacklevel + 1,
        )


def _difference(template, x, rows: int, training: bool, assigned: dict) -> tuple[float, float, list]:
    """How far the outputs for `rows` rows of `x`, whole, are from the same rows in two halves; the losses added;
    and the first output whose halves joined have another shape (its whole shape and theirs), if any.

    The halves' added losses count by their shares of the rows, as the
    replicas' do. Either is 0 where it changes from one call of the whole
    rows to the next (random draws).
    """
    half = rows // 2

    def run(begin, end):
        part = tree.map_structure(lambda a: a[begin:end], x)
        outputs = [np.asarray(o) for o in tree.flatten(template(part, training=training))]
        return outputs, float(sum(np.sum(np.asarray(loss)) for loss in template.losses))

    with _put_back(template, assigned):
        (whole, loss), (again, loss_again) = run(0, rows), run(0, rows)
        (first, first_loss), (second, second_loss) = run(0, half), run(half, rows)
    halves = [np.concatenate([a, b]) if _one_row_each(a, b, rows) else None for a, b in zip(first, second)]
    parts = (first_loss * half + second_loss * (rows - half)) / rows
    loss, loss_again, parts = ([np.float64(v)] for v in (loss, loss_again, parts))
    # Each judged apart: random outputs say nothing of the added losses, and the other way round.
    outputs = 0.0 if _relative(whole, again) > TOLERANCE else _relative(whole, halves)
    shapes = [(tuple(w.shape), tuple(h.shape)) for w, h in zip(whole, halves) if h is not None and w.shape != h.shape]
    return outputs, 0.0 if _relative(loss, loss_again) > TOLERANCE else _relative(loss, parts), shapes[:1]


@contextlib.contextmanager
def _put_back(template, assigned: dict):
    """Puts back what calls of `template` move: its variables and the unseeded draws' state.

    The non-trainable variables are a layer's own counters, statistics and
    seed states, and its metrics' variables; a weight a layer assigns in `call` (SpectralNormalization's
    kernel) is listed in `assigned` (id: (variable, value before)) as it is
    assigned. A layer calling `keras.random` without a seed draws from Keras'
    global generator, which its first draw makes from Python's `random`.
    """
    # A layer's own metric (a Mean it updates in `call`) is moved too.
    moved = list({id(v): v for v in [*template.non_trainable_variables, *template.metrics_variables]}.values())
    kept = [v.numpy() for v in moved]
    generator = keras_private.global_state.get_global_attribute(keras_private.GLOBAL_SEED_GENERATOR)
    state = generator.state.numpy() if generator is not None else None
    python_state = random.getstate()
    try:
        with patched([(v, name, _recording(v, getattr(v, name), assigned))
                      for v in template.trainable_variables for name in ("assign", "assign_add", "assign_sub")]):
            yield
    finally:
        for variable, value in [*zip(moved, kept), *assigned.values()]:
            variable.assign(value)
        keras_private.global_state.set_global_attribute(keras_private.GLOBAL_SEED_GENERATOR, generator)
        if generator is not None:
            generator.state.assign(state)
        random.setstate(python_state)


def _recording(variable, original, assigned: dict):
    def assign(value, *args, **kwargs):
        if id(variable) not in assigned:
            with tf.init_scope():  # its value now, also where the call is traced
                assigned[id(variable)] = (variable, variable.numpy())
        return original(value, *args, **kwargs)

    return assign


def _one_row_each(first, second, rows: int) -> bool:
    # Otherwise not one output row per input row: the parallel call will refuse it.
    half = rows // 2
    return first.shape[:1] == (half,) and second.shape[:1] == (rows - half,) and first.shape[1:] == second.shape[1:]


def _relative(outputs, others) -> float:
    """The largest difference between float outputs and others of their shape, relative to the outputs' size."""
    difference = 0.0
    for w, o in zip(outputs, others):
        if o is None or not w.size or not np.issubdtype(w.dtype, np.floating) or w.shape != o.shape:
            continue
        scale = max(float(np.max(np.abs(w))), SMALLEST_SCALE)
        difference = max(difference, float(np.max(np.abs(w - o))) / scale)
    return difference


def _made_up_rows(template, rows: int):
    """Rows for the template's inputs (normal floats, integers 0 and 1), or None where it has none known."""
    try:
        structure = template.input
    except (AttributeError, ValueError):
        return None  # a subclassed model: its inputs are what it is called with
    rng = np.random.default_rng(0)  # its own generator: the user's random state is left alone

    def make(tensor):
        shape = (rows,) + tuple(MADE_UP_LENGTH if d is None else d for d in tensor.shape[1:])
        dtype = np.dtype(keras.backend.standardize_dtype(tensor.dtype))
        if dtype.kind == "f":
            return rng.standard_normal(shape).astype(dtype)
        if dtype.kind in "iub":
            return rng.integers(0, 2, shape).astype(dtype)
        raise TypeError(f"no rows made up for {dtype}")

    try:
        return tree.map_structure(make, structure)
    except TypeError:
        return None  # text inputs: not probed


def _alike_in_training(template) -> bool:
    """Whether the template's rows would map alike whole and split in training mode, if rows stay apart."""
    for layer in keras_private.flatten_layers(template):
        if isinstance(layer, keras.layers.BatchNormalization) or keras_private.seed_generators(layer):
            return False
    return True
