"""Each replica's part of the batch's loss, for every Keras loss reduction.

Keras divides a loss by a total of the batch it sees: its element count
(`"sum_over_batch_size"`), the number of unmasked elements (a masked
sequence), the sum of the sample weights (`"mean_with_sample_weight"`), or
nothing (`"sum"`). A replica that computes the loss of its sub-batch divides
by its own total, so weighting replicas by their share of the rows is exact
only for the first. While a training or test step computes its loss,
`replica_part` makes Keras' loss reduction return this replica's *part* of
the batch's loss instead: the sum of its weighted losses divided by the whole
batch's total, which the replicas add up (`replicas.cross_replica_sum`, or a
worker's all-reduce). The parts sum to the one-device loss, and so do their
gradients. A loss function that returns a scalar has reduced already: its
part is its value times the replica's share of the rows (exact without
sample weights, approximate with them, which is warned about), and so is a
loss that layers add (regularisers, `add_loss`, a loss object called inside
a layer). Losses with `reduction=None` stay per row and are merged like
outputs.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable

import keras
import numpy as np
from keras import ops

from kerasmulti._src import keras_private
from kerasmulti._src.keras_private import global_state, loss_module

_local = threading.local()
_original = loss_module.reduce_weighted_values
_installed = 0
_install_lock = threading.Lock()


class _Part:
    def __init__(self, share, valid, rows, total: Callable):
        self.share, self.valid, self.rows, self.total = share, valid, rows, total


def _elements(values):
    """How many loss values there are, as Keras counts them for the mean.

    From the static shape where it is fully known, else read from `values`.
    Not from the sub-batch's rows: a loss may flatten its values (a token
    loss over `reshape(y, (-1,))`), and its batch axis then holds rows times
    tokens. The count is still a whole multiple of the rows, so a replica
    turns it into the batch's by itself (`counted_or_summed`), without
    waiting for the others' forward passes.
    """
    shape = tuple(values.shape)
    if None not in shape:
        return ops.cast(int(np.prod(shape, dtype=np.int64)), values.dtype)
    return ops.cast(ops.size(values), values.dtype)


def _part_of_batch(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
    """Keras' `reduce_weighted_values`, as this replica's part of the batch's.

    Every reduction meets the other replicas exactly once (`part.total`),
    whatever its shapes, so no replica waits for one that took another path.
    """
    part = getattr(_local, "part", None)
    if part is None or _in_layer_call():
        # A loss object called inside a layer (Keras' "endpoint layer") goes
        # to add_loss, and added losses are weighted as a whole.
        return _original(values, sample_weight, mask, reduction, dtype)
    reduction = loss_module.standardize_reduction(reduction)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if reduction in (None, "none"):
        # One loss per row: a borrowed row's must not reach the gradient.
        unreduced = _original(values, sample_weight, mask, reduction, dtype)
        return unreduced * ops.cast(part.valid, unreduced.dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.cast(mask, values.dtype)
    # Sample weight times mask, not rescaled (that is what "sum" asks Keras for).
    weights = loss_module.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    valid = ops.cast(part.valid, values.dtype)
    if len(values.shape) == 0:  # reduced already by the loss function
        if weights is None:
            # Count it by the replica's rows.
            rows = ops.cast(part.rows, values.dtype) * valid
            return ops.divide_no_nan(values * rows, ops.stop_gradient(part.total(rows, True)))
        # Keras multiplies the scalar by the mean weight, which a replica can
        # only approximate from its rows.
        warnings.warn(
            "A loss function returned a scalar with "
            + ("sample_weight or class_weight set" if sample_weight is not None else "masked outputs")
            + ", so parallelize() weights it approximately. Return one loss per sample "
            "to split it exactly. Received: a scalar loss",
            stacklevel=2,
        )
    if weights is not None:
        values, weights = loss_module.squeeze_or_expand_to_same_rank(values, ops.cast(weights, values.dtype))
        values = values * weights
    total = ops.sum(values) * valid
    elements = _elements(values)
    if reduction == "mean_with_sample_weight" and weights is not None:
        count = ops.sum(weights)
    elif mask is not None:
        # Keras rescales the mask by all/unmasked: the mean over unmasked elements.
        count = elements * ops.sum(mask) / ops.cast(ops.size(mask), values.dtype)
    else:
        count = elements
    # Proportional to the rows unless weights or a mask decide the count.
    by_rows = mask is None and not (reduction == "mean_with_sample_weight" and weights is not None)
    batch_count = ops.stop_gradient(part.total(count * valid, by_rows))
    return total if reduction == "sum" else ops.divide_no_nan(total, batch_count)


def _in_layer_call() -> bool:
    return global_state.get_global_attribute("current_call_ctx") is not None


def additional_part(loss):
    """A loss a layer added (regulariser, `add_loss`): the replica's share of it."""
    part = getattr(_local, "part", None)
    if part is None:
        return loss
    # Under a tf.distribute strategy Keras has divided it by the replica count.
    return loss_module.unscale_loss_for_distribution(loss) * ops.cast(part.share, loss.dtype)


@contextlib.contextmanager
def added_losses_scaled(model, share):
    """Inside: losses that `model`'s layers add are scaled by the replica's share.

    For a plain call of the parallel model (its train and test steps weight
    them in `additional_part`): a layer adds the mean over the rows it sees,
    so the shares make their sum over replicas the whole batch's mean.
    """
    lists = [keras_private.added_losses(layer) for layer in keras_private.flatten_layers(model)]
    before = [len(losses) for losses in lists]
    yield
    for losses, start in zip(lists, before):
        for k in range(start, len(losses)):
            losses[k] = losses[k] * ops.cast(share, losses[k].dtype)


def counted_or_summed(rows, batch, summed: Callable) -> Callable:
    """A `total` for `replica_part`: proportional totals counted, others `summed`.

    A total proportional to the rows is this replica's count over its rows
    times the batch's rows, exact in floating point (the count is a whole
    multiple of the rows), so the replica need not wait for the others'
    forward passes: a slow replica then delays only the gradient sum.
    """

    def total(value, by_rows: bool):
        return proportional_total(value, rows, batch) if by_rows else summed(value, by_rows)

    return total


def proportional_total(value, rows, batch):
    """The batch's total of a count proportional to the rows, from one replica's `value` over its `rows`."""
    # value / rows is what one row contributes, the same on every replica.
    return ops.divide_no_nan(value, ops.cast(rows, value.dtype)) * ops.cast(batch, value.dtype)


@contextlib.contextmanager
def replica_part(share, valid, rows, total: Callable):
    """Inside: Keras losses return this replica's part of the batch's loss.

    Args:
        share: The replica's share of the batch's rows.
        valid: 1 if its rows count, 0 if it computes on a borrowed row.
        rows: The rows it computes on (a borrowed one included).
        total: `total(value, by_rows)` sums a scalar over all replicas of
            the step; `by_rows` says the value is proportional to the rows.
    """
    global _installed
    with _install_lock:
        if _installed == 0:
            loss_module.reduce_weighted_values = _part_of_batch
        _installed += 1
    _local.part = _Part(share, valid, rows, total)
    try:
        yield
    finally:
        _local.part = None
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                loss_module.reduce_weighted_values = _original


def check_reductions(loss) -> None:
    """Refuses per-output losses that mix reduction=None with reduced ones.

    Keras adds a reduced loss (a scalar) to per-row losses by broadcasting;
    each replica holds only its part of the scalar, so merging the per-row
    sums would be wrong.
    """
    if not isinstance(loss, (dict, list, tuple)):
        return
    reductions = {
        str(getattr(leaf, "reduction", "sum_over_batch_size")).replace("none", "None")
        for leaf in keras.tree.flatten(loss)
        if leaf is not None
    }
    if "None" in reductions and len(reductions) > 1:
        raise ValueError(
            "parallelize() cannot mix reduction=None with reduced losses. Give every output's loss "
            f"the same kind of reduction. Received: reductions={sorted(reductions)}"
        )
