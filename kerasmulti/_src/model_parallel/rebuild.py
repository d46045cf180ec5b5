"""A functional or Sequential model rebuilt from its own layers, each call chosen anew.

Placement is a property of each call: a layer shared between two device
scopes is called through two `OnDevice` wrappers. Taking placement off a
model (`strip_placement`, saving) or putting it back (loading) therefore
rebuilds the model's graph with the same layer objects, hence the same
weights, and changes which object each call goes through. Keras'
`clone_model` chooses per layer rather than per call, so this module walks
the graph itself, as Keras' `Functional._run_through_graph` does, through
Keras' private graph attributes (`_nodes_by_depth`, `_inbound_nodes`, a
node's `arguments`): no public API lists a model's calls. The tests of
`strip_placement` and of saving placed models fail if they change.
"""

from __future__ import annotations

from typing import Callable

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.keras_private import Functional, make_node_key

# Only these classes are rebuilt: a subclass would lose its own methods, and
# a subclassed model builds its graph in its own code.
REBUILDABLE = (Functional, keras.Sequential)


def own_calls(model: keras.Model, layer) -> list:
    """The nodes of `layer` that belong to `model`'s graph, in the order they were made.

    This is the order of the layer's `inbound_nodes` in `model`'s config. A
    layer also called in another model has nodes there too.
    """
    keys = keras_private.graph_node_keys(model)
    return [node for i, node in enumerate(keras_private.inbound_nodes(layer)) if make_node_key(layer, i) in keys]


def rebuilt(model: keras.Model, choose: Callable) -> keras.Model:
    """`model` rebuilt, each call going through `choose(layer, node)`.

    `choose` returns the layer to call in place of `layer` for that call
    (`node` is the call's node in `model`; None in a Sequential model, which
    calls each layer once). The new model has `model`'s class, name, inputs
    and trainability, and is not compiled.
    """
    if isinstance(model, keras.Sequential):
        layers = [choose(layer, None) for layer in model.layers]
        first = next(iter(keras_private.sequential_layers(model)), None)
        if isinstance(first, keras.layers.InputLayer):
            layers.insert(0, _input_like(first.output, first.name))
        return keras.Sequential(layers, name=model.name, trainable=model.trainable)
    inputs = keras.tree.map_structure(lambda x: _input_like(x, keras_private.keras_history(x).operation.name), model.input)
    computed = {id(x): y for x, y in zip(keras.tree.flatten(model.input), keras.tree.flatten(inputs))}
    by_depth = keras_private.nodes_by_depth(model)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.is_input or any(id(x) not in computed for x in node.input_tensors):
                continue  # as Keras skips a node that the inputs do not reach
            args, kwargs = node.arguments.fill_in(computed)
            outputs = _call(choose(node.operation, node), args, kwargs)
            for original, new in zip(node.outputs, keras.tree.flatten(outputs)):
                computed[id(original)] = new
    outputs = keras.tree.map_structure(lambda x: computed[id(x)], model.output)
    return keras.Model(inputs, outputs, name=model.name, trainable=model.trainable)


def _call(layer, args, kwargs):
    # Keras recorded the mask (and training) it passes to a layer whose call
    # takes them, such as an OnDevice wrapper; the layer chosen instead may
    # not take them, and then Keras gives it the mask by itself.
    parameters = getattr(layer, "call_signature_parameters", None)
    if parameters is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in parameters or k not in ("mask", "training")}
    return layer(*args, **kwargs)


def _input_like(x, name: str):
    """A new input like `x`, named as its input layer (the name that a config keeps)."""
    return keras.Input(batch_shape=x.shape, dtype=x.dtype, sparse=x.sparse, ragged=x.ragged, name=name)
