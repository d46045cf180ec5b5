"""What identifies the model and the input of an output file, so that another's are refused.

A file is resumed only by the model (architecture and weights) and the input
(its rows, or rows spread over all of it: `Source.fingerprint_parts`) that
began it; adding rows of another would corrupt it silently.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.inference.sources import Source, values_bytes


def fingerprint(source: Source) -> str:
    """Identifies an input by its size and rows spread over all of it.

    A pipeline (`tf.data`) is hashed whole, as it is read once anyway to
    count its rows; arrays and HDF5 datasets by 16 pairs of rows spread from
    first to last; a PyDataset by its first two and last two rows. An edit
    that misses every sampled row goes unnoticed. Rows, not batches: the same
    data batched differently is the same input (within each kind).
    """
    digest = hashlib.sha256(str(source.rows).encode())
    for part in source.fingerprint_parts():
        for array in tree.flatten(part):
            array = np.ascontiguousarray(array)
            digest.update(f"{array.shape}{array.dtype}".encode())
            digest.update(values_bytes(array))
    return digest.hexdigest()


def model_fingerprint(model) -> str:
    """Identifies a model by its architecture and weights, not by the names Keras made up for its layers.

    The same model built again in one process gets new names (`dense_1`):
    each layer's and operation's name is replaced by its place in the model,
    and the weights are taken in order.
    """
    places = {}  # every layer's, and every operation's of a functional model (`h + 1`: "add")
    for layer in keras_private.flatten_layers(model):
        for operation in [layer, *getattr(layer, "operations", [])]:
            places.setdefault(operation.name, f"operation {len(places)}")
    architecture = _architecture(model, places)
    if architecture is None:  # one layer's config cannot be serialised: every layer's that can, in order
        layers = [_architecture(layer, places) or _class_name(layer) for layer in keras_private.flatten_layers(model, include_self=False)]
        architecture = f"{_class_name(model)}:{json.dumps(layers)}"
    digest = hashlib.sha256(architecture.encode())
    for weight in model.weights:
        digest.update(f"{tuple(weight.shape)}{weight.dtype}".encode())
        digest.update(np.ascontiguousarray(np.asarray(weight)).tobytes())
    return digest.hexdigest()


def _architecture(layer, places: dict) -> str | None:
    """A layer's (or model's) class and config, its layers' names replaced by their places; None if it has none to give."""
    try:
        # Without placement's `layer_id`s: they name layer objects of this
        # process, and a reloaded model must be the same model.
        config = _renamed(_without_key(layer.get_config(), "layer_id"), places)
        return f"{type(layer).__qualname__}:{json.dumps(config, sort_keys=True)}"
    except Exception:  # a subclass whose config cannot be serialised (an argument Keras cannot save)
        return None


def _class_name(layer) -> str:
    return f"{type(layer).__module__}.{type(layer).__qualname__}"


def _renamed(config, places: dict):
    """`config` with every string that names one of the model's layers replaced by its place."""
    if isinstance(config, dict):
        return {k: _renamed(v, places) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_renamed(v, places) for v in config]
    return places.get(config, config) if isinstance(config, str) else config


def _without_key(config, key):
    if isinstance(config, dict):
        return {k: _without_key(v, key) for k, v in config.items() if k != key}
    if isinstance(config, (list, tuple)):
        return [_without_key(v, key) for v in config]
    return config
