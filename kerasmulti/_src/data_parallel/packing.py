"""Many tensors as one flat buffer per dtype: what crosses devices in a compiled step.

A step outside XLA pays for every operation it runs: reading a variable,
sending it to a replica, summing a gradient, updating a weight are each one
operation per variable, so a step's fixed cost would grow with the model
(~40 us per variable per step on a CPU, ~4 us per operation on a GPU host).
Instead the compiled step (`compiled.py`) reads every variable of a device
into one buffer per dtype inside one XLA call (`DeviceReads`), sends the
buffers to each replica, where one split per dtype cuts them into the
arguments of the replica's XLA program, and gets the gradients and new states
back packed the same way. Summing, taking apart and applying them is again
one XLA call (`compiled.py`). The operations a step runs outside XLA stay the
same in number whatever the model's size.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasmulti._src import keras_private


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
        with keras_private.without_autocast():  # a variable's dtype as stored, also inside a mixed model's call
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
            groups.setdefault(key, []).append(_shaped(t, [-1]))
        return {key: _joined(parts) for key, parts in groups.items()}

    def unpack(self, flats: dict) -> list:
        """`pack`'s inverse: the tensors, each with its own shape, in the layout's order."""
        return [_shaped(piece, shape) for piece, shape in zip(self.split(flats), self.shapes)]

    def split(self, flats: dict) -> list:
        """`pack`'s buffers cut into flat pieces, in the layout's order: one split per dtype."""
        pieces = {key: iter(tf.split(flats[key], sizes)) for key, sizes in self.sizes.items()}
        return [next(pieces[key]) for key in self.keys]


_JOINED = 16  # flat pieces one concatenation takes (see `_joined`)


def _joined(parts: list):
    """Flat pieces joined into one, at most `_JOINED` by one concatenation.

    XLA's CPU compiler takes time superlinear in a concatenation's operands
    (214 pieces: 1.3 s; 14 concatenations of 16 and one of 14: 0.3 s). Each
    level of the tree joins along an axis of its own: concatenations of
    concatenations along one axis would be merged back into one by XLA.
    """
    return _shaped(_tree(parts), [-1])


def _tree(parts: list):
    if len(parts) <= _JOINED:
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
    size = _JOINED
    while size * _JOINED < len(parts):
        size *= _JOINED
    children = [_tree(parts[i : i + size]) for i in range(0, len(parts), size)]
    rank = 1 + max(child.shape.rank for child in children)
    return tf.concat([tf.reshape(child, [1] * (rank - 1) + [-1]) for child in children], axis=rank - 1)


def _shaped(tensor, shape):
    """`tf.reshape`, left out where `tensor` has that shape already (a vector: many of a model's weights)."""
    known = tensor.shape
    if known.rank == 1 and len(shape) == 1 and (shape[0] == -1 or known[0] == shape[0]) and known.is_fully_defined():
        return tensor
    return tf.reshape(tensor, shape)


def summed(buffers: list) -> dict:
    """The replicas' packed buffers (`{dtype name: flat}` each) added, one buffer per dtype."""
    return {key: tf.add_n([flats[key] for flats in buffers]) for key in buffers[0]}


def _elements(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def device_of(variable) -> str:
    """The device a Keras (or TensorFlow) variable lives on."""
    with keras_private.without_autocast():  # an autocast read would be a cast tensor's device
        return getattr(variable, "value", variable).device


class DeviceReads:
    """Reads variables into flat buffers with one XLA call per device they live on.

    XLA reads a resource only on its own device, so each device's variables
    are read, and packed one buffer per dtype, by a program of their own;
    a replica gets every device's buffers, cut (`split`) and shaped (`values`).

    Args:
        variables: The variables, in the order `values` returns their values.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self.devices = sorted({device_of(v) for v in self.variables})
        self._order = [device_of(v) for v in self.variables]
        self._reads = {}
        for device in self.devices:
            on_device = [v for v, d in zip(self.variables, self._order) if d == device]
            layout = Layout(on_device)
            self._reads[device] = (layout, tf.function(_reader(layout, on_device), jit_compile=True, autograph=False))

    def read(self) -> list:
        """Each device's buffers, as `{dtype name: flat}` dicts in `devices` order."""
        read = []
        for device in self.devices:
            with tf.device(device):
                read.append(self._reads[device][1]())
        return read

    def split(self, read: list) -> list:
        """`read`'s buffers cut into flat pieces, in the variables' order (outside XLA: see `values`)."""
        pieces = {d: iter(self._reads[d][0].split(flats)) for d, flats in zip(self.devices, read)}
        return [next(pieces[device]) for device in self._order]

    def values(self, pieces: list) -> list:
        """The variables' values, inside a replica's program, from `split`'s pieces.

        The pieces come in as the program's arguments, cut outside it: cut
        inside, each piece would lie at its own offset of one buffer, and XLA
        compiles every kernel that reads one anew, where the same layer shapes
        repeated (ResNet's blocks) otherwise share their kernels.
        """
        return [_shaped(piece, variable.shape) for piece, variable in zip(pieces, self.variables)]


class StoredScope(keras.StatelessScope):
    """A `keras.StatelessScope` whose values keep their variables' own dtypes.

    Keras casts each value to its variable's `dtype`, which in an autocast
    scope (a mixed_float16 model's call) is float16: a float32 layer of that
    model would then read its weights rounded. Read in the scope, a value is
    cast as the reading layer's own scope says, as it is on one device.
    """

    def __init__(self, *args, **kwargs):
        with keras_private.without_autocast():
            super().__init__(*args, **kwargs)


def _reader(layout: Layout, variables):
    def read():
        with keras_private.without_autocast():  # as stored: a mixed model's call would read them as float16
            return layout.pack([tf.convert_to_tensor(getattr(v, "value", v)) for v in variables])

    return read
