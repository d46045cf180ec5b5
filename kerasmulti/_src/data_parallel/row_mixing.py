"""A model whose output for a row depends on other rows, found at its first parallel call.

Splitting a batch gives one device's numbers only if each row's output
depends on that row alone (BatchNormalization aside, which replicas
synchronise). A layer that computes statistics over the batch, or compares
rows, sees only its replica's sub-batch. Such layers cannot be recognised by
their type, so the first `fit`, `evaluate` or `predict` of a parallel model
on arrays runs the template on its first few rows, whole and split in two,
in inference mode, and warns if the outputs differ: one small forward pass
more, once per parallel model.
"""

from __future__ import annotations

import warnings

import numpy as np
from keras import tree

PROBE_ROWS = 4
# Relative to the outputs' size: float sums in another order differ by about 1e-7.
TOLERANCE = 1e-3


def probe_once(parallel, x, stacklevel: int) -> None:
    """Warns if `parallel`'s template mixes the rows of `x`'s first few; once per parallel model."""
    if parallel._rows_probed or len(parallel.replica_devices) < 2 or parallel._custom is not None:
        return
    parallel._rows_probed = True
    leaves = tree.flatten(x) if x is not None else []
    if not leaves or not all(isinstance(a, np.ndarray) and a.ndim > 0 for a in leaves) or len(leaves[0]) < 2:
        return  # only arrays can be read again at no cost
    rows = min(len(leaves[0]), PROBE_ROWS)
    half = rows // 2

    def run(begin, end):
        return [np.asarray(o) for o in tree.flatten(parallel._template(tree.map_structure(lambda a: a[begin:end], x), training=False))]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real call gives Keras' warnings, once
            whole, first, second = run(0, rows), run(0, half), run(half, rows)
    except Exception:
        return  # the call itself will say what is wrong
    difference = 0.0
    for w, a, b in zip(whole, first, second):
        one_row_each = w.shape[:1] == (rows,) and a.shape[:1] == (half,) and b.shape[:1] == (rows - half,)
        if not np.issubdtype(w.dtype, np.floating) or not one_row_each or not a.shape[1:] == b.shape[1:] == w.shape[1:]:
            continue  # not one output row per input row: the parallel call will refuse it
        scale = float(np.max(np.abs(w))) + 1e-6
        difference = max(difference, float(np.max(np.abs(w - np.concatenate([a, b])))) / scale)
    if difference > TOLERANCE:
        warnings.warn(
            f"The outputs of '{parallel._template.name}' for a row depend on the other rows of its batch: "
            f"its first {rows} rows, predicted whole and in two halves, differ by {difference:.1e} of the "
            "outputs' size. On several devices each replica sees only its sub-batch, so the results will "
            "differ from one device's. A layer that computes batch statistics of its own or compares rows "
            "does this: run such a model on one device, or move that computation out of the model "
            "(docs/data-parallel.md, 'Models that look across rows'). "
            f"Received: relative difference={difference:.1e}",
            stacklevel=stacklevel + 1,
        )
