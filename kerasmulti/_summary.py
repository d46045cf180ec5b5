"""`placement_summary`: where each layer of a placed model runs, and what crosses devices."""

from __future__ import annotations

import math

import keras

from kerasmulti._placement import OnDevice


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
    summary = kerasmulti.placement_summary(model)
    print(summary)
    on_gpu1 = [row["layer"] for row in summary.rows if row["device"] == "/device:GPU:1"]
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


def placement_summary(model: keras.Model) -> PlacementSummary:
    """Tabulates the device of each layer and the tensors that cross devices.

    Args:
        model: A built functional or Sequential model, placed with
            `device_scope` or `on_device` (unplaced layers are listed with
            device None: they run wherever the model runs).

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
    rows, crossings, owners = [], [], {}
    for layer in model.layers:
        inner = layer.layer if isinstance(layer, OnDevice) else layer
        # A layer shared by several wrappers counts its weights once.
        owner = owners.setdefault(id(inner), layer.name)
        rows.append(
            {
                "layer": layer.name,
                "type": type(inner).__name__,
                "device": _device_of(layer),
                "params": int(sum(math.prod(w.shape) for w in layer.weights)) if owner == layer.name else 0,
                "shares_weights_with": None if owner == layer.name else owner,
            }
        )
        for node in getattr(layer, "_inbound_nodes", []):
            for tensor in node.input_tensors:
                source = tensor._keras_history.operation
                if _device_of(source) != _device_of(layer):
                    crossings.append(
                        {
                            "tensor": source.name,
                            "from": _device_of(source),
                            "to": _device_of(layer),
                            "shape": tuple(tensor.shape),
                        }
                    )
    return PlacementSummary(rows, crossings)

