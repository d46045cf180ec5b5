"""`on_device` and `remap_devices`: place a layer, and move placed layers.

`on_device(layer, device)` wraps one layer or sub-model in an `OnDevice`
layer; `device_scope` does the same for every layer called in a block.
`remap_devices` moves the placed layers of a model, for instance one loaded
on a machine with other devices.
"""

from __future__ import annotations

from collections.abc import Mapping

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.devices import _canonical, resolve_device
from kerasmulti._src.inference import parallel_predict as _parallel_predict
from kerasmulti._src.model_parallel.on_device import OnDevice, placed
from kerasmulti._src.model_parallel.pipeline import PipelineModel


def on_device(layer: keras.layers.Layer, device: str) -> OnDevice:
    """Wraps a layer or sub-model so that its calls run on `device`.

    The wrapper shares the layer's weights and can be used in functional,
    Sequential and subclassed models; it is saved and loaded with the model.

    Args:
        layer: A Keras layer or model.
        device: A TensorFlow device name, checked like `parallelize`'s.

    Returns:
        An `OnDevice` layer.

    Raises:
        TypeError: If `layer` is not a Keras layer, or `device` not a string.
        ValueError: If `layer` is an `OnDevice` layer already.
        DeviceError: If the device does not exist on this machine.

    Example:

    ```python
    import keras, kerasmulti
    tower = keras.Sequential([keras.layers.Dense(32, activation="relu")])
    inputs = keras.Input((16,))
    outputs = kerasmulti.on_device(tower, "/cpu:0")(inputs)
    model = keras.Model(inputs, outputs)
    ```
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            "on_device() places a Keras layer or model; wrap functions in a Lambda layer. "
            f"Received: layer={type(layer).__name__}"
        )
    # One wrapper per layer and device, as device_scope's: a layer wrapped twice for one
    # device is one layer called twice, where two wrappers of one name would be refused.
    return placed(layer, resolve_device(device, "on_device()"))


def remap_devices(model: keras.Model, mapping: Mapping[str, str]) -> keras.Model:
    """Moves a model's placed layers to other devices, e.g. after loading it elsewhere.

    Args:
        model: A model holding `OnDevice` layers (from `device_scope` or
            `on_device`), for instance one loaded with `kerasmulti.load_model`
            (Keras' own `load_model` returns it without its placement), or a
            model from `parallelize` around one.
        mapping: Old device name to new one, e.g. `{"/gpu:1": "/gpu:0"}`. The
            new names are checked like `parallelize`'s.

    Only the computation moves: weights stay where they were created. The
    model's compiled fit/evaluate/predict steps (and `parallel_predict`'s)
    are dropped, so the next call traces them again with the new devices. A
    model from `parallelize` keeps its own steps: pass it here instead of its
    template, and both drop theirs.

    Returns:
        The same model, for chaining.

    Raises:
        TypeError: If `model` is not a `keras.Model`, `mapping` not a
            mapping, or a device name in it not a string.
        ValueError: If `model` comes from `pipeline` (remap its template and
            pipeline it again), an old device name is not a device name, or
            the mapping names none of the devices the model's layers run on.
        DeviceError: If a new device does not exist on this machine.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras
    first, second = kerasmulti.available_devices()[:2]
    inputs = keras.Input((4,))
    with kerasmulti.device_scope(second):
        tower = keras.layers.Dense(2)(inputs)
    keras.Model(inputs, tower).save("two_tower.keras")
    model = kerasmulti.load_model("two_tower.keras")  # on a machine with one device:
    kerasmulti.remap_devices(model, {second: first})  # the tower runs on the first
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "remap_devices() moves the placed layers of a keras.Model; pass the model that holds them. "
            f"Received: model={type(model).__name__}"
        )
    if not isinstance(mapping, Mapping):
        raise TypeError(
            "remap_devices() takes a dict from old device names to new ones. "
            f"Received: mapping={mapping!r}"
        )
    if isinstance(model, PipelineModel):  # its micro-batches and schedule are planned for its stages
        raise ValueError(
            "remap_devices() cannot move a pipeline's stages. Remap its template, "
            f"kerasmulti.unwrap(model), then call pipeline() again. Received: model={model.name!r}"
        )
    moves = {_old_device(old): resolve_device(new, "remap_devices()") for old, new in mapping.items()}
    wrappers = [layer for layer in keras_private.flatten_layers(model, include_self=False) if isinstance(layer, OnDevice)]
    if not wrappers:
        raise ValueError(
            "remap_devices() found no placed layer in the model; keras.models.load_model drops placement, "
            f"kerasmulti.load_model keeps it. Received: mapping={mapping!r}"
        )
    if not any(layer.device in moves for layer in wrappers):
        on = ", ".join(sorted({layer.device for layer in wrappers}))
        raise ValueError(
            f"remap_devices() found no layer to move: the model's placed layers run on {on}. "
            f"Map those devices. Received: mapping={mapping!r}"
        )
    for layer in wrappers:
        if layer.device in moves:
            layer.device = moves[layer.device]
    # Traced steps keep the old devices: fit/evaluate/predict's, and
    # parallel_predict's (kept with the model, or with a parallel model).
    template = getattr(model, "_template", None)  # a model from parallelize
    for traced in [model] + ([template] if template is not None else []):
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(traced, name, None) is not None:
                setattr(traced, name, None)
        _parallel_predict.drop_kept_steps(traced)
    return model


def _old_device(name) -> str:
    """A device the model was placed on; it need not exist on this machine."""
    if not isinstance(name, str):
        raise TypeError(
            "remap_devices() takes device names as strings, such as '/gpu:1'. "
            f"Received: device={name!r}"
        )
    try:
        spec = tf.DeviceSpec.from_string(name)
    except ValueError:
        spec = None
    if spec is None or spec.device_type is None or spec.device_index is None:
        raise ValueError(
            "remap_devices() got an old device that is not a TensorFlow device name, e.g. '/gpu:1'. "
            f"Received: device={name!r}"
        )
    return _canonical(name)
