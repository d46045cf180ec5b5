"""How the replicas' metric arguments and logs of a template's own step become one device's.

A step run on every replica (`custom_steps.py`) updates a metric once, with
its replicas' arguments merged: tensors with rows of the batch are joined
in shard order (k rows per batch row too, a GAN's `concat([fake, real])`;
an idle replica's borrowed row left out), a scalar `sample_weight` (Keras
passes the row count) is summed unless it is a variable or a float (one
weight for the batch), any other scalar (a mean loss) is averaged by the
shares, and a value that is not rows of the batch (a weight's) is the first
replica's. The logs the step returns are averaged by the shares where they
are scalars (a metric's result is the same on every replica, and a
per-replica mean loss becomes the batch's), else the first replica's.
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import split as _split


def merged_leaf(values, name, shares, shards):
    """One update argument from every replica's (see the module docstring)."""
    first = values[0]
    if first is None or isinstance(first, (str, bool)):
        return first
    if name == "sample_weight" and isinstance(first, (float, keras.Variable, tf.Variable)):
        return first  # a weight the whole batch shares, not a count of the replica's rows
    if isinstance(first, (int, float)) or rank(first) == 0:
        # Keras passes a sub-batch's row count as the weight of its mean.
        weights = [_split.counts(s) for s in shards] if name == "sample_weight" else shares
        total = _weighted_sum(weights, values)
        dtype = getattr(first, "dtype", None)
        return total if dtype is None else tf.cast(total, dtype)
    if rank(first) is None:
        return first  # of unknown rank: the first replica's
    rows, sliced = first.shape[0], tf.get_static_value(shards[0].sliced)  # known eagerly, also under "auto"
    if rows is None or (sliced is not None and rows == sliced) or _rows_per_batch_row(values, shards):
        # k rows per batch row too (a GAN's concat([fake, real])): one device's rows, in another
        # order, which a metric's result does not depend on.
        return _every_counted_row(values, shards)
    return first  # not rows of the batch (a weight's values): the first replica's


def _every_counted_row(values, shards):
    """The replicas' values joined in order, but an idle replica's (its borrowed row's), with their masks."""
    kept = []
    for value, shard in zip(values, shards):
        if not isinstance(shard.counted, int):  # counted is all the replica's rows, or 0 (idle)
            rows = tf.shape(value)[0] * tf.minimum(shard.counted, 1)
            mask, value = keras_private.get_keras_mask(value), value[:rows]
            if mask is not None:
                keras_private.set_keras_mask(value, mask[:rows])
        kept.append(value)
    return _split.merge(kept, [_split.Shard(0, None, 1)] * len(kept))  # kept whole


def rank(value):
    """The rank of a tensor or array; None where unknown (or not an array)."""
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank if hasattr(shape, "rank") else len(shape)


def _rows_per_batch_row(values, shards) -> bool:
    """Whether each replica's value has the same number k > 1 of rows per row of its shard (all known)."""
    rows = [v.shape[0] for v in values]
    sliced = [tf.get_static_value(s.sliced) for s in shards]
    if not all(isinstance(s.counted, int) for s in shards) or None in rows or any(s is None for s in sliced):
        return False
    k = rows[0] // sliced[0]
    return k > 1 and all(r == k * n for r, n in zip(rows, sliced))


def _weighted_sum(weights, values):
    """Sum of weight x value over the replicas, in float32."""
    return tf.add_n([tf.cast(w, tf.float32) * tf.cast(v, tf.float32) for w, v in zip(weights, values)])


def merged_arguments(signature, gathered, shares, shards) -> inspect.BoundArguments:
    """The first replica's bound arguments, each merged with the others' (`merged_leaf`)."""
    bound = [signature.bind(*args, **kwargs) for args, kwargs in gathered]
    for name, parameter in signature.parameters.items():
        if name not in bound[0].arguments:
            continue
        per_replica = [b.arguments[name] for b in bound]
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            merged = {key: merged_value([d[key] for d in per_replica], key, shares, shards) for key in per_replica[0]}
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            merged = tuple(merged_value(list(v), name, shares, shards) for v in zip(*per_replica))
        else:
            merged = merged_value(per_replica, name, shares, shards)
        bound[0].arguments[name] = merged
    return bound[0]


def merged_value(per_replica, name, shares, shards):
    return tree.map_structure(lambda *values: merged_leaf(values, name, shares, shards), *per_replica)


def merged_logs(logs: list, shares: list):
    """The replicas' logs averaged by their shares (scalars), or the first replica's."""
    if not isinstance(logs[0], dict):
        return logs[0]
    merged = {}
    for key, first in logs[0].items():
        values = [replica.get(key) for replica in logs]
        if all(rank(v) == 0 for v in values):
            merged[key] = _weighted_sum(shares, values)
        elif rank(first) is None and isinstance(first, tf.Tensor) and first.dtype.is_floating:
            # Of unknown rank (tf.numpy_function's): averaged if a scalar when it runs.
            average = lambda: tf.cast(_weighted_sum(shares, values), first.dtype)  # noqa: E731
            merged[key] = tf.cond(tf.equal(tf.rank(first), 0), average, lambda: first)
        else:
            merged[key] = first
    return merged
