"""A placed chain of layers' stages as one XLA program each.

With XLA, a pipeline compiles each placed layer's call as a program on its
stage's device (`compiled_calls.CompiledCall`): a stage of six layers is six
programs per micro-batch, each with its own launch, variable reads and
gradient program, so a step's work outside XLA grows with the layers. A
Sequential model, or a functional one whose layers form a chain, each layer
placed (by the cut, `pipeline(gpus=N)`, or `device_scope`), runs instead as
segments: the longest runs of consecutive layers on one device, each a
`Segment` compiled as one program and called under its device with its
gradient there too (`on_device`'s rule). A
BatchNormalization layer, whose statistics are the whole batch's (it meets
the other micro-batches), and a layer XLA cannot compile (an Embedding, a
recurrent layer) are runs of their own, uncompiled, as before. Other placed
models (branching graphs, subclassed models) keep one program per placed
layer.
"""

from __future__ import annotations

import contextlib

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.keras_private import Functional, get_keras_mask, set_keras_mask
from kerasmulti._src.model_parallel.on_device import OnDevice, call_on_device


class Segment(keras.layers.Layer):
    """Consecutive layers of one stage, called in turn: one unit for XLA to compile.

    Args:
        layers: The layers, in the order they run; they keep their weights.
    """

    def __init__(self, layers, **kwargs):
        super().__init__(**kwargs)
        self.chain = list(layers)
        self.built = True
        self.supports_masking = True  # the mask goes in as `mask`, and out on the last layer's outputs

    def compute_mask(self, inputs, previous_mask):
        return None  # only where the last layer left none (a pooling that drops it)

    def call(self, x, training=None, mask=None):
        if mask is not None:
            set_keras_mask(x, mask)  # a mask crosses a program's boundary as an argument
        for layer in self.chain:
            x = layer(x)  # `training` reaches it through Keras' call context
        return x


def runs(template) -> list | None:
    """`(device, Segment)` or `(None, wrapper)` per run of `template`'s layers; None if it is not such a model."""
    wrappers = _chain(template)
    if not wrappers or not all(isinstance(w, OnDevice) for w in wrappers):
        return None
    found, current = [], []

    def close():
        if current:
            found.append((current[0].device, Segment([w.layer for w in current], name=f"segment_{len(found)}")))
            current.clear()

    for wrapper in wrappers:
        if _holds_batchnorm(wrapper) or _compiled_calls.not_compilable(wrapper.layer):
            close()
            found.append((None, wrapper))
        else:
            if current and current[0].device != wrapper.device:
                close()
            current.append(wrapper)
    close()
    return found


@contextlib.contextmanager
def compiled(template, found: list):
    """Inside: `template`'s call runs `found` (`runs`), each segment as one XLA program."""

    def call(inputs, training=None, mask=None):
        x = inputs
        if mask is not None:
            set_keras_mask(x, mask)
        for device, unit in found:
            if device is None:
                x = unit(x, training=training)
            else:
                x = call_on_device(unit, device, x, (), {"training": training, "mask": get_keras_mask(x)})
        return x

    # A layer XLA cannot compile runs as before: its wrapper calls it, and it warns once why.
    alone = [unit.layer for device, unit in found if device is None and not _batchnorm(unit)]
    with _compiled_calls.compiled([unit for device, unit in found if device is not None] + alone):
        object.__setattr__(template, "call", call)
        try:
            yield
        finally:
            object.__delattr__(template, "call")


def _batchnorm(wrapper) -> bool:
    return isinstance(wrapper.layer, keras.layers.BatchNormalization)


def _holds_batchnorm(wrapper) -> bool:
    # A sub-model holding one runs alone too, as a placed layer: it warns, naming itself.
    return any(isinstance(layer, keras.layers.BatchNormalization) for layer in keras_private.flatten_layers(wrapper.layer))


def _chain(template) -> list | None:
    """The layers a Sequential model, or a functional one that is a chain, calls in turn; None otherwise.

    A chain: one input, one output, every call taking the previous call's
    output alone, with no arguments of its own.
    """
    if isinstance(template, keras.Sequential):
        return [layer for layer in template.layers if not isinstance(layer, keras.layers.InputLayer)]
    if not isinstance(template, Functional) or len(template.inputs) != 1 or len(template.outputs) != 1:
        return None
    by_depth = keras_private.nodes_by_depth(template)
    layers, previous = [], template.inputs[0]
    for depth in sorted(by_depth, reverse=True):
        (node, *others) = by_depth[depth]
        if node.is_input and not others:
            continue
        inputs = list(node.input_tensors)
        if others or len(inputs) != 1 or inputs[0] is not previous or len(node.outputs) != 1:
            return None  # (`is`: a symbolic tensor's `==` is an operation)
        if any(value is not None for value in node.arguments.kwargs.values()) or len(node.arguments.args) != 1:
            return None
        layers.append(node.operation)
        previous = node.outputs[0]
    return layers if previous is template.outputs[0] else None
