"""Whether the rows of `parallel_predict`'s input fit the model's inputs, before any is predicted."""

from __future__ import annotations

import numpy as np
from keras import tree

from kerasmulti._src.data_parallel.call_checks import check_input_keys, row_shape_fits


def check_inputs(model, sample) -> None:
    """Raises when the input rows do not fit the model's inputs: their shapes, or text for numbers."""
    # A subclassed model has no `inputs`: its rows are checked when it runs.
    inputs = getattr(model, "inputs", None)
    expected = [tuple(t.shape[1:]) for t in inputs] if inputs else None
    if expected is None:
        return
    names = [t.name for t in inputs]
    if isinstance(sample, dict):
        check_input_keys("parallel_predict", model, sample, "data")
    if isinstance(sample, dict) and set(names) <= set(sample):
        sample = [sample[name] for name in names]  # as Keras matches a dict to the inputs (others ignored)
    for index, (tensor, array) in enumerate(zip(inputs, tree.flatten(sample))):
        kind = np.asarray(array).dtype
        if kind.kind in "USO" and tensor.dtype != "string":
            raise ValueError(
                f"Input {index} of model '{model.name}' takes {tensor.dtype} "
                f"numbers, but the data holds {'text' if kind.kind in 'US' else 'Python objects'}. "
                f"Convert it. Received: dtype={kind}"
            )
    got = [tuple(np.shape(a)[1:]) for a in tree.flatten(sample)]
    fits = len(got) == len(expected) and all(row_shape_fits(g, e) for g, e in zip(got, expected))
    if not fits:
        raise ValueError(
            f"The input rows do not fit model '{model.name}', which takes {_shapes(expected)}. "
            f"Reshape the data. Received: row_shapes={_shapes(got)}"
        )


def _shapes(shapes) -> str:
    return ", ".join(str(s) for s in shapes)
