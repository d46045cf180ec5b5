"""Many tensors as one flat buffer per dtype: what crosses devices in a compiled step.

A step outside XLA pays for every operation it runs: reading a variable,
sending it to a replica, summing a gradient, updating a weight are each one
operation per variable, so a step's fixed cost would grow with the model
(~40 us per variable per step on a CPU, ~4 us per operation on a GPU host).
Instead the compiled step (`compiled.py`) reads every variable of a device in
one XLA call (`DeviceReads`) and packs the values into one buffer per dtype
(one concatenation each), sends the buffers to each replica, which splits
them (one `SplitV` each) and hands the pieces to its own XLA program, and
gets the gradients and new states back packed the same way. Summing,
splitting and applying them is again one XLA call (`compiled.py`). The
pieces enter XLA as separate arguments, reshaped inside (a free bitcast):
XLA's CPU backend compiles slices of one buffer slowly (318 slices: 2 s,
against 0.35 s for the same tensors passed one by one), so buffers are
split and joined outside it, one operation per dtype. The operations a step
runs outside XLA stay the same in number whatever the model's size.
"""

from __future__ import annotations

import tensorflow as tf


class Layout:
    """Where each tensor of a fixed list lies in one flat buffer per dtype.

    Args:
        tensors: The tensors or variables, whose shapes and dtypes (known
            when tracing) fix the layout.

    Example:

    ```python
    layout = Layout([tf.zeros((2, 3)), tf.zeros(4), tf.zeros((), tf.int64)])
    flats = layout.pack([tf.ones((2, 3)), tf.ones(4), tf.constant(7, tf.int64)])
    assert sorted(flats) == ["float32", "int64"] and flats["float32"].shape == (10,)
    ```
    """

    def __init__(self, tensors):
        self.keys = [tf.as_dtype(t.dtype).name for t in tensors]
        self.shapes = [tuple(t.shape) for t in tensors]
        self.sizes = {}
        for key, shape in zip(self.keys, self.shapes):
            self.sizes.setdefault(key, []).append(_elements(shape))

    def __len__(self) -> int:
        return len(self.keys)

    def pack(self, tensors) -> dict:
        """The tensors (in the layout's order) as one flat tensor per dtype name."""
        groups = {}
        for key, t in zip(self.keys, tensors):
            groups.setdefault(key, []).append(tf.reshape(t, [-1]))
        return {key: tf.concat(parts, axis=0) if len(parts) > 1 else parts[0] for key, parts in groups.items()}

    def split(self, flats: dict) -> list:
        """`pack`'s buffers cut into one flat piece per tensor, in the layout's order."""
        pieces = {key: iter(tf.split(flats[key], sizes) if len(sizes) > 1 else [flats[key]]) for key, sizes in self.sizes.items()}
        return [next(pieces[key]) for key in self.keys]

    def shape(self, pieces) -> list:
        """`split`'s pieces with their tensors' shapes (inside XLA: no copy)."""
        return [tf.reshape(piece, shape) for piece, shape in zip(pieces, self.shapes)]

    def unpack(self, flats: dict) -> list:
        """`pack`'s inverse: the tensors, each with its own shape, in the layout's order."""
        return self.shape(self.split(flats))


def _elements(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def device_of(variable) -> str:
    """The device a Keras (or TensorFlow) variable lives on."""
    return getattr(variable, "value", variable).device


class DeviceReads:
    """Reads variables with one XLA call per device they live on.

    XLA reads a resource only on its own device, so each device's variables
    are read by a program of their own, which returns their values.

    Args:
        variables: The variables, in the order `read` returns their values.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self.devices = sorted({device_of(v) for v in self.variables})
        self._reads = []
        for device in self.devices:
            indices = [i for i, v in enumerate(self.variables) if device_of(v) == device]
            read = tf.function(_reader([self.variables[i] for i in indices]), jit_compile=True)
            self._reads.append((device, indices, read))

    def read(self) -> list:
        """The variables' values, in their order."""
        values = [None] * len(self.variables)
        for device, indices, read in self._reads:
            with tf.device(device):
                for i, value in zip(indices, read()):
                    values[i] = value
        return values


def _reader(variables):
    def read():
        return [tf.convert_to_tensor(getattr(v, "value", v)) for v in variables]

    return read
