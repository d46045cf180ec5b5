"""Splitting a batch into per-replica shards and merging what they return.

A batch of B rows over n devices becomes min(n, B) shards, in order, whose
sizes differ by at most one, or follow the proportions `split` gives (one per
device: fixed numbers, or a tensor that `balance.AutoSplit` updates from
measured speeds); proportional sizes give every device at least one row
while the batch has a row per device. When B and the proportions are known
while tracing (eager calls, the first compiled step), idle replicas are simply
not run. When B is only known at run time (a `tf.data` batch, a compiled step
retraced for a smaller last batch, or measured proportions), the same sizes
come from TensorFlow ops and every replica is traced; a replica whose shard is
empty (fewer rows than devices) computes on one borrowed row and gets weight zero, so no device ever
sees an empty tensor and nothing it computes reaches the result. Gradients are summed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import tensorflow as tf
from keras import tree

from kerasmulti._src.keras_private import get_keras_mask, set_keras_mask


class Shard(NamedTuple):
    begin: Any  # first row taken (int or scalar tensor)
    sliced: Any  # rows sliced, >= 1 (an idle replica borrows one)
    counted: Any  # rows that count; 0 for an idle replica


def counts(shard: Shard):
    """1 if the shard's rows count, 0 for an idle replica's borrowed row (a float, or a float32 tensor)."""
    return float(shard.counted > 0) if isinstance(shard.counted, int) else tf.cast(shard.counted > 0, tf.float32)


def _first_dims(structure) -> list:
    dims = []
    for t in tree.flatten(structure):
        if t is None:
            continue
        if len(t.shape) == 0:
            raise ValueError(
                "A parallel model splits every input along axis 0, but one input is a "
                f"scalar. Give it a leading batch dimension. Received: input with shape {t.shape}"
            )
        dims.append(t.shape[0])
    return dims


def batch_size(structure, what: str = "inputs"):
    """The batch size of a nested structure: an int when static, else a tensor.

    Raises ValueError when the inputs' batch sizes disagree.
    """
    flat = [t for t in tree.flatten(structure) if t is not None]
    if not flat:
        raise ValueError(
            f"A parallel model needs at least one input tensor to split. "
            f"Received: {what}={structure!r}"
        )
    dims = _first_dims(structure)
    static = {d for d in dims if d is not None}
    if len(static) > 1:
        raise ValueError(
            f"All {what} of a parallel model must have the same batch size (axis 0). "
            f"Make them equal. Received: batch sizes {dims}"
        )
    if static and None not in dims:
        return static.pop()
    sizes = [tf.cast(t.dense_shape[0], tf.int32) if isinstance(t, tf.SparseTensor) else tf.shape(t)[0] for t in flat]
    for other in sizes[1:]:
        tf.debugging.assert_equal(
            sizes[0],
            other,
            message=f"All {what} of a parallel model must have the same batch "
            "size (axis 0). Received: different batch sizes",
        )
    return sizes[0]


def plan(batch, replicas: int, split=None) -> list[Shard]:
    """Shards for `batch` rows over at most `replicas` devices.

    `split`: None for sizes that differ by at most one; else one proportion
    per device, a tuple of floats summing to 1 (sizes known while tracing
    when `batch` is) or a float tensor (sizes known at run time).
    """
    if isinstance(batch, int) and not tf.is_tensor(split):
        sizes = _even_sizes(batch, replicas) if split is None else _proportional_sizes(batch, split)
        shards, begin = [], 0
        for size in sizes:
            shards.append(Shard(begin, size, size))
            begin += size
        return shards
    batch = tf.convert_to_tensor(batch, tf.int32)
    base, extra = batch // replicas, batch % replicas
    sizes = [base + tf.cast(i < extra, tf.int32) for i in range(replicas)]
    if split is not None:
        sizes = tf.unstack(tf.where(batch < replicas, tf.stack(sizes), _run_time_proportional_sizes(batch, split, replicas)))
    shards, begin = [], tf.constant(0, tf.int32)
    for size in sizes:
        shards.append(Shard(tf.where(size > 0, begin, 0), tf.maximum(size, 1), size))
        begin = begin + size
    return shards


def _even_sizes(batch: int, replicas: int) -> list[int]:
    used = max(1, min(replicas, batch))
    base, extra = divmod(batch, used)
    return [base + (1 if i < extra else 0) for i in range(used)]


def _proportional_sizes(batch: int, split) -> list[int]:
    """Sizes in proportion to `split`, each at least one row while rows last.

    Largest remainders round the ideal sizes, so the sizes sum to `batch`.
    """
    if batch < len(split):
        return _even_sizes(batch, len(split))
    ideal = [batch * p for p in split]
    sizes = [max(1, int(x)) for x in ideal]
    while sum(sizes) < batch:
        sizes[max(range(len(sizes)), key=lambda i: ideal[i] - sizes[i])] += 1
    while sum(sizes) > batch:
        sizes[max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: sizes[i] - ideal[i])] -= 1
    return sizes


def _run_time_proportional_sizes(batch, split, replicas: int):
    """`_proportional_sizes` in TensorFlow ops, for a batch or proportions known at run time (a batch of at least `replicas` rows).

    The same steps: each at least one row, then a row at a time to the largest
    remainder, or from the largest excess (ties to the first), at most `replicas` each way.
    """
    total = tf.cast(batch, tf.float64)
    if tf.is_tensor(split):  # measured float32 proportions: their sum may miss 1 by more than a row's worth
        split = tf.cast(split, tf.float64) / tf.reduce_sum(tf.cast(split, tf.float64))
    ideal = total * tf.convert_to_tensor(split, tf.float64)  # fixed proportions as Python has them, not via float32
    sizes = tf.maximum(tf.floor(ideal), 1.0)

    def first_largest(values):
        return tf.one_hot(tf.argsort(values, direction="DESCENDING", stable=True)[0], replicas, dtype=tf.float64)

    for _ in range(replicas):
        sizes += tf.where(tf.reduce_sum(sizes) < total, first_largest(ideal - sizes), 0.0)
    for _ in range(replicas):
        excess = tf.where(sizes > 1, sizes - ideal, -math.inf)
        sizes -= tf.where(tf.reduce_sum(sizes) > total, first_largest(excess), 0.0)
    return tf.cast(sizes, tf.int32)


def take(structure, shard: Shard):
    """The rows of `shard` from every tensor in `structure`, Keras masks included."""
    if structure is None:
        return None

    def rows(t):
        if t is None:
            return None
        if isinstance(t, tf.SparseTensor):  # not sliceable with []
            start = tf.concat([[tf.cast(shard.begin, tf.int64)], tf.zeros_like(t.dense_shape[1:])], 0)
            size = tf.concat([[tf.cast(shard.sliced, tf.int64)], t.dense_shape[1:]], 0)
            return tf.sparse.slice(t, start, size)
        piece = t[shard.begin : shard.begin + shard.sliced]
        mask = get_keras_mask(t)
        if mask is not None:
            set_keras_mask(piece, mask[shard.begin : shard.begin + shard.sliced])
        return piece

    return tree.map_structure(rows, structure)


def shares(shards: list[Shard], batch) -> list:
    """Each shard's share of the batch, as float32 scalars summing to 1."""
    total = tf.cast(batch, tf.float32)
    return [tf.cast(s.counted, tf.float32) / total for s in shards]


def merge(outputs: list, shards: list[Shard]):
    """Concatenates replica outputs in order, dropping borrowed rows.

    Keras masks on the outputs (a masked sequence) are merged alike, so a loss
    computed on the merged output skips the same elements as on one device.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree.flatten(out) for out in outputs]
    merged = []
    for pieces in zip(*flat):
        masks = [get_keras_mask(t) for t in pieces]
        tensor = _concat(pieces, shards)
        if all(m is not None for m in masks):
            set_keras_mask(tensor, _concat(masks, shards))
        merged.append(tensor)
    return tree.pack_sequence_as(outputs[0], merged)


def check_batch_axis(outputs, inputs) -> None:
    """Refuses a replica's output that lost or changed its batch axis.

    Replica outputs are joined along axis 0, so each must keep one row per
    input row; a squeeze without an axis drops it on a 1-row sub-batch.
    Checked on static shapes, where the trace knows them.
    """
    rows = next((d for d in _first_dims(inputs) if d is not None), None)
    for t in tree.flatten(outputs):
        _check_rows(t, rows)


def _check_rows(t, rows) -> None:
    shape = getattr(t, "shape", None)
    if shape is None or shape.rank is None:
        return  # unknown rank (a compiled replica's trace): merge checks it
    if shape.rank == 0 or (isinstance(rows, int) and shape[0] is not None and shape[0] != rows):
        raise not_one_row_per_input("A sub-batch", rows, shape)


def not_one_row_per_input(what: str, rows, shape, why="the replicas' outputs cannot be joined", other="use one device"):
    """The error (a ValueError) for an output whose rows are not the input's (`what`: "A sub-batch", "A batch")."""
    return ValueError(
        f"{what} of {rows if rows is not None else 'unknown'} row(s) gave an output "
        f"without one row per input row, so {why}. Keep "
        f"axis 0 in every output (squeeze(x, axis=-1), not squeeze(x)), or {other}. "
        f"Received: output shape {tuple(shape)}"
    )


def _concat(pieces, shards):
    for t, s in zip(pieces, shards):
        _check_rows(t, s.sliced)
    trimmed = [t if isinstance(s.counted, int) else t[: s.counted] for t, s in zip(pieces, shards)]
    return tf.concat(trimmed, axis=0)


def sum_gradients(gradients):
    """Sums one variable's gradients from all replicas (None where none has one).

    Sparse gradients (`IndexedSlices`) stay sparse, so a large table gets no
    dense update a step, and keep the rows one device's gradient lists
    (`row_kind`): an `Embedding`'s lists a row once per lookup, so the
    replicas' rows are joined and repeat as one device's do; a sparse input's
    matmul lists each row once (its rows come out of a `tf.unique`), so the
    joined rows that repeat are summed into one; rows that do not depend on
    the batch are every replica's alike, and their values are added. The
    difference shows with optimizers that are not linear in the gradient
    (Adagrad and Adam square each listed row).
    """
    present = [g for g in gradients if g is not None]
    if not present:
        return None
    if all(isinstance(g, tf.IndexedSlices) for g in present):
        if len(present) == 1:
            return present[0]
        kinds = {row_kind(g.indices) for g in present}
        if kinds == {"shared"}:
            return shared_rows(present)
        return joined_rows(present, kinds == {"unique"})
    return tf.add_n([tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in present])


def joined_rows(gradients: list, once: bool) -> tf.IndexedSlices:
    """The replicas' sparse gradients of one variable as one: rows joined, summed where `once` (`sum_gradients`)."""
    values = tf.concat([g.values for g in gradients], axis=0)
    indices = tf.concat([g.indices for g in gradients], axis=0)
    if once:
        indices, position = tf.unique(indices)
        values = tf.math.unsorted_segment_sum(values, position, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradients[0].dense_shape)


def shared_rows(gradients: list) -> tf.IndexedSlices:
    """Rows every replica lists alike (`row_kind` "shared"): one replica's, the values added.

    One device lists them as each replica does, repeats included (T5's
    relative-position buckets: one lookup per pair of positions), and Adam
    squares each listed row, so the replicas' values are added row for row.
    Where the replicas' rows are not known alike when traced (a count of
    `None`), that is checked when the step runs; rows that differ after all
    (they follow the batch's shape, not its rows) are joined and summed into one each.
    """
    first = gradients[0]
    counts = {g.indices.shape[0] for g in gradients}
    if len(counts) == 1 and None not in counts:
        return tf.IndexedSlices(tf.add_n([g.values for g in gradients]), first.indices, first.dense_shape)

    def alike():
        return tf.reduce_all([tf.reduce_all(tf.equal(g.indices, first.indices)) for g in gradients[1:]])

    def joined():
        rows = joined_rows(gradients, once=True)
        return rows.values, rows.indices

    same_count = tf.reduce_all([tf.equal(tf.size(g.indices), tf.size(first.indices)) for g in gradients[1:]])
    values, indices = tf.cond(
        tf.cond(same_count, alike, lambda: tf.constant(False)),
        lambda: (tf.add_n([tf.reshape(g.values, tf.shape(first.values)) for g in gradients]), first.indices),
        joined,
    )
    return tf.IndexedSlices(values, indices, first.dense_shape)


def row_kind(indices) -> str:
    """How one device's sparse gradient lists these rows, read from the graph being traced.

    "unique": they come out of a `tf.unique` (a sparse input's matmul), each
    once. "shared": they do not depend on the batch's rows (a position
    embedding looked up at `arange(length)`: one lookup for the whole batch),
    so every replica lists the same ones. "lookup" otherwise (an `Embedding`'s,
    a row per lookup), and where the graph cannot be read (a step run eagerly).
    """
    try:
        op = indices.op
    except AttributeError:  # an eager tensor
        return "lookup"
    while op.type in ("Reshape", "Identity", "Cast") and op.inputs:
        op = op.inputs[0].op
    if op.type == "Unique":
        return "unique"
    return "lookup" if _reads_rows(indices.op) else "shared"


def _captured(op):
    """The outside tensor a function's placeholder `op` stands for (an eager constant, the outer graph's), or None."""
    for outside, inside in getattr(op.graph, "captures", ()):
        if inside.op is op:
            return outside
    return None


def dense_unless_per_lookup(gradient):
    """`gradient`, made dense if it is sparse with rows one device lists once or alike (`row_kind`).

    A strategy's all-reduce joins sparse rows as they are; dense, the sum keeps
    one device's numbers (where "shared" rows do not repeat, as positions do not).
    """
    if isinstance(gradient, tf.IndexedSlices) and row_kind(gradient.indices) != "lookup":
        return tf.convert_to_tensor(gradient)
    return gradient


def _reads_rows(op, limit: int = 5000) -> bool:
    """Whether `op`'s output may depend on the batch's rows: not only on their shape, constants and variables."""
    seen, stack = set(), [op]
    while stack:
        op = stack.pop()
        if op.name in seen or op.type in ("Shape", "ShapeN", "Size", "Rank", "Const", "ReadVariableOp"):
            continue
        seen.add(op.name)
        if len(seen) > limit or "Random" in op.type:  # random rows differ on every replica
            return True
        if not op.inputs:  # a source: the batch (a placeholder, an iterator), a variable's handle, a constant
            if op.type == "VarHandleOp" or (op.type == "Placeholder" and op.outputs[0].dtype == tf.resource):
                continue
            captured = _captured(op)  # a tensor from outside the function: a constant, or the outer graph's
            if captured is not None and (not tf.is_symbolic_tensor(captured) or not _reads_rows(captured.op, limit)):
                continue
            return True
        stack.extend(t.op for t in op.inputs)
    return False
