"""`placement_summary`: where each layer of a placed model runs, and what crosses devices."""

from __future__ import annotations

import math

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.parallel_model import unwrap
from kerasmulti._src.keras_private import make_node_key
from kerasmulti._src.model_parallel.on_device import OnDevice


class PlacementSummary:
    """Where each layer of a model runs; `print()` it, or read `rows` and `crossings`.

    Made by `placement_summary(model)`.

    Attributes:
        rows: One dict per layer: `layer`, `type`, `device` (None where the
            layer runs wherever the model runs), `params` and
            `shares_weights_with` (the row that counts a shared layer's
            weights; its own `params` is then 0).
        crossings: One dict per tensor that moves between devices: `tensor`
            (the producing layer), `from` and `to` devices, and `shape`.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras
    first, second = kerasmulti.available_devices()[:2]
    inputs = keras.Input((8,))
    with kerasmulti.device_scope(first):
        hidden = keras.layers.Dense(16, name="hidden")(inputs)
    with kerasmulti.device_scope(second):
        outputs = keras.layers.Dense(1, name="head")(hidden)
    summary = kerasmulti.placement_summary(keras.Model(inputs, outputs))
    print(summary)
    on_second = [row["layer"] for row in summary.rows if row["device"] == second]
    ```
    """

    def __init__(self, rows: list[dict], crossings: list[dict]):
        self.rows = rows
        self.crossings = crossings

    def __str__(self) -> str:
        lines = [f"{'layer':<28}{'type':<20}{'device':<18}{'params':>10}"]
        lines.append("-" * len(lines[0]))
        for row in self.rows:
            shared = f"  (weights of {row['shares_weights_with']})" if row["shares_weights_with"] else ""
            lines.append(
                f"{row['layer']:<28}{row['type']:<20}{row['device'] or '(default)':<18}{row['params']:>10,}{shared}"
            )
        lines.append("")
        if self.crossings:
            lines.append("tensors crossing devices:")
            for c in self.crossings:
                lines.append(f"  {c['tensor']} {c['shape']}: {c['from'] or '(default)'} -> {c['to'] or '(default)'}")
        else:
            lines.append("no tensor crosses devices")
        return "\n".join(lines)

    __repr__ = __str__


def _device_of(layer) -> str | None:
    return layer.device if isinstance(layer, OnDevice) else None


def _source_device(tensor) -> str | None:
    """The device that makes `tensor`: inside a sub-model that is not wrapped, its layer's."""
    operation, _, index = keras_private.keras_history(tensor)
    while isinstance(operation, keras.Model) and _own_nodes(operation) is not None:
        tensor = keras.tree.flatten(operation.outputs)[index]
        operation, _, index = keras_private.keras_history(tensor)
    return _device_of(operation)


def _called_in(layer, nodes: set | None) -> bool:
    """Whether `layer` itself is called in the graph of `nodes` (None: a subclassed model's, which has none)."""
    return nodes is not None and any(make_node_key(layer, i) in nodes for i in range(len(keras_private.inbound_nodes(layer))))


def _own_nodes(model) -> set | None:
    """Keys of the nodes that belong to `model`'s graph (a layer may be in others too)."""
    return keras_private.graph_node_keys(model)


def _add_rows(model, prefix: str, rows: list, crossings: list, owners: dict) -> None:
    """Adds a row per layer of `model`, and its crossings; sub-models are opened.

    A sub-model that is not wrapped as a whole is listed layer by layer
    (`tower/dense`), since placement may sit inside it; a wrapped one is one
    row, on its wrapper's device.
    """
    nodes = _own_nodes(model)
    wrapped = {id(layer.layer) for layer in model.layers if isinstance(layer, OnDevice)}
    for layer in model.layers:
        if id(layer) in wrapped and not _called_in(layer, nodes):
            continue  # tracked beside its wrapper (`self.a = on_device(self.a, ...)`), never called unwrapped
        if isinstance(layer, keras.Model) and _own_nodes(layer) is not None:
            _add_rows(layer, f"{prefix}{layer.name}/", rows, crossings, owners)
            continue
        inner = layer.layer if isinstance(layer, OnDevice) else layer
        name = prefix + layer.name
        # A layer shared by several wrappers counts its weights once.
        owner = owners.setdefault(id(inner), name)
        rows.append(
            {
                "layer": name,
                "type": type(inner).__name__,
                "device": _device_of(layer),
                "params": int(sum(math.prod(w.shape) for w in layer.weights)) if owner == name else 0,
                "shares_weights_with": None if owner == name else owner,
            }
        )
        for index, node in enumerate(keras_private.inbound_nodes(layer)):
            if nodes is not None and make_node_key(layer, index) not in nodes:
                continue  # the layer called in another model
            for tensor in node.input_tensors:
                source = keras_private.keras_history(tensor).operation
                if _source_device(tensor) != _device_of(layer):
                    crossings.append(
                        {
                            "tensor": prefix + source.name,
                            "from": _source_device(tensor),
                            "to": _device_of(layer),
                            "shape": tuple(tensor.shape),
                        }
                    )


def placement_summary(model: keras.Model) -> PlacementSummary:
    """Tabulates the device of each layer and the tensors that cross devices.

    Args:
        model: A built functional or Sequential model, placed with
            `device_scope` or `on_device` (unplaced layers are listed with
            device None: they run wherever the model runs), or a `pipeline`
            or parallel model of one (its template's placement).

    Returns:
        A `PlacementSummary`: printable, with the data in `.rows` and
        `.crossings`.

    Raises:
        TypeError: If `model` is not a `keras.Model`.

    Example:

    ```python
    import keras, kerasmulti
    inputs = keras.Input((8,))
    with kerasmulti.device_scope("/cpu:0"):
        hidden = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    print(kerasmulti.placement_summary(model))
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "placement_summary() describes a keras.Model. "
            f"Received: model={type(model).__name__}"
        )
    rows, crossings = [], []
    _add_rows(unwrap(model), "", rows, crossings, {})  # a pipeline's (or parallel model's) template
    return PlacementSummary(rows, crossings)

