"""Model parallelism: run chosen layers (or sub-models) on chosen devices.

Keras 3 ignores a `tf.device` scope around model construction: a functional
model re-runs its layers when it is called, outside that scope. Placement
must therefore live in the model itself. `on_device(layer, device)` returns an
`OnDevice` layer that calls `layer` inside `tf.device(device)` at call time,
so fit, evaluate, predict, plain calls and `tf.function` traces all honour it.
`device_scope(device)` does the same for every layer called inside the
`with` block while the model is built. A layer called under two scopes gets
two `OnDevice` wrappers around the same layer object: one set of weights,
each call on its own device. The wrapper computes the layer's gradients on
its device too, passes Keras masks in and out, and keeps XLA off (Keras'
`jit_compile="auto"` reads `supports_jit`), since XLA compiles a whole step
for one device.

`OnDevice` serialises like Keras' own wrappers (the inner layer through
Keras' object sharing, so shared layers stay shared in a `.keras` file). A
model loaded on a machine without a named device runs that layer wherever
the model runs, after one warning; `remap_devices(model, mapping)` moves the
placement explicitly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import Mapping

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

from kerasmulti import _inference
from kerasmulti._devices import _canonical, known_devices, resolve_device

_local = threading.local()
_warned: set[str] = set()
_original_call = keras.layers.Layer.__call__
_original_sequential_build = keras.Sequential.build
_installed = 0
_install_lock = threading.Lock()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def _suspended():
    """Inside a wrapper, its layer's own sub-layers are not wrapped again."""
    saved = _stack()[:]
    _stack().clear()
    try:
        yield
    finally:
        _stack().extend(saved)


def _is_symbolic(args, kwargs) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten((args, kwargs)))


_DESERIALISING = frozenset({"from_config", "functional_from_config", "deserialize_keras_object"})


def _deserialising() -> bool:
    """Whether Keras is rebuilding a model from its config (loading, cloning).

    A model loaded inside a scope keeps the placement it was saved with:
    wrapping its layers again would rename them, and its weights would no
    longer match.
    """
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _DESERIALISING and f"{os.sep}keras{os.sep}" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _scoped_call(self, *args, **kwargs):
    stack = _stack()
    if stack and not isinstance(self, OnDevice) and _is_symbolic(args, kwargs) and not _deserialising():
        return OnDevice(self, stack[-1], _validated=True)(*args, **kwargs)
    return _original_call(self, *args, **kwargs)


def _scoped_sequential_build(self, input_shape=None):
    """A Sequential built inside a scope places its layers, in its own layer list.

    Placed only in the graph it builds, they would run placed but be saved,
    summarised and cloned without their placement.
    """
    stack = _stack()
    if stack and not _deserialising():
        self._layers = [
            layer if isinstance(layer, (OnDevice, keras.layers.InputLayer)) else OnDevice(layer, stack[-1], _validated=True)
            for layer in self._layers
        ]
    with _suspended():
        return _original_sequential_build(self, input_shape)


@keras.saving.register_keras_serializable(package="kerasmulti")
class OnDevice(keras.layers.Layer):
    """Runs a layer (or sub-model) on one device; made by `on_device`.

    Its weights are the wrapped layer's. `device` holds the canonical device
    name; `remap_devices` changes it.

    Example:

    ```python
    import keras, kerasmulti
    wrapped = kerasmulti.on_device(keras.layers.Dense(4), "/cpu:0")
    print(wrapped.device)  # /device:CPU:0
    ```
    """

    def __init__(self, layer, device: str, _validated: bool = False, **kwargs):
        kwargs.setdefault("name", f"{layer.name}_on_{_short(device)}")
        super().__init__(**kwargs)
        self.layer = layer
        self.device = device if _validated else _canonical(device)
        parameters = getattr(layer, "call_signature_parameters", [])
        self._call_has_training = "training" in parameters
        self._call_has_mask = "mask" in parameters
        # XLA compiles a whole step for one device: placement would be lost,
        # and a fit step reading weights on another device fails. Keras'
        # jit_compile="auto" (on with a GPU) reads this and stays off.
        self.supports_jit = False

    def build(self, *args, **kwargs):
        self.built = True

    def _scope(self):
        known = known_devices()
        if self.device in known:
            return tf.device(self.device)
        if self.device not in _warned:
            _warned.add(self.device)
            warnings.warn(
                f"Layer '{self.layer.name}' is placed on {self.device}, which this "
                f"machine does not have (it has {', '.join(sorted(known))}); it "
                "runs where the rest of the model runs. To choose, call "
                "kerasmulti.remap_devices(model, {'" + self.device + "': '/cpu:0'}).",
                stacklevel=3,
            )
        return contextlib.nullcontext()

    def _layer_kwargs(self, kwargs, training, mask):
        if self._call_has_training:
            kwargs["training"] = training
        if self._call_has_mask and mask is not None:
            kwargs["mask"] = mask
        return kwargs

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._layer_kwargs(kwargs, training, mask)
        scope = self._scope()
        if isinstance(scope, contextlib.nullcontext):
            with _suspended():
                return self.layer(inputs, *args, **kwargs)
        return _on_device_with_gradients(self.layer, self.device, inputs, args, kwargs)

    def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
        # A symbolic call, not compute_output_spec: it also builds the layer,
        # so its weights exist when the model is built, saved or loaded.
        # Under the device scope: a layer built here creates its weights on
        # its device, so placement also splits the memory of the weights.
        with _suspended(), self._scope():
            return self.layer(inputs, *args, **self._layer_kwargs(kwargs, training, mask))

    def compute_mask(self, inputs, previous_mask):
        # Used only when the wrapped call left no mask on its outputs.
        if self.layer.supports_masking:
            return self.layer.compute_mask(inputs, previous_mask)
        return None

    def get_config(self):
        return {
            **super().get_config(),
            "layer": keras.saving.serialize_keras_object(self.layer),
            "device": self.device,
            # Which wrappers share one layer object, within one saved model.
            "layer_id": id(self.layer),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layer = _shared_layer(config.pop("layer"), config.pop("layer_id", None))
        # Devices are not checked here: the file may come from another machine.
        return cls(layer, config.pop("device"), _validated=True, **config)


def _on_device_with_gradients(layer, device, inputs, args, kwargs):
    """Calls `layer` on `device`, and computes its gradients there too.

    A gradient tape builds the backward pass under the device scope active
    when the gradient is taken (Keras' train step: none), not where the
    forward ops ran. This call records its own forward pass and, in its
    custom gradient, takes the gradient inside `tf.device(device)`, so the
    backward pass of the branch runs on the branch's device. Every tensor the
    call receives (`inputs`, and tensors among the other arguments, such as
    `MultiHeadAttention`'s `value`) goes through the custom gradient, so
    gradients reach all of them.
    """
    inputs = keras.tree.map_structure(tf.convert_to_tensor, inputs)
    leaves = keras.tree.flatten((inputs, args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]
    results = {}

    @tf.custom_gradient
    def forward(*tensors):
        call_leaves = list(leaves)
        for i, tensor in zip(positions, tensors):
            call_leaves[i] = tensor
        call_inputs, call_args, call_kwargs = keras.tree.pack_sequence_as((inputs, args, kwargs), call_leaves)
        with tf.GradientTape() as tape, _suspended(), tf.device(device):
            tape.watch([t for t in tensors if t.dtype.is_floating])
            outputs = layer(call_inputs, *call_args, **call_kwargs)
        results["outputs"] = outputs
        flat_outputs = keras.tree.flatten(outputs)

        def grad(*upstream, variables=None):
            variables = list(variables or [])
            with tf.device(device):
                gradients = tape.gradient(
                    flat_outputs, list(tensors) + variables, output_gradients=list(upstream),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            input_gradients = [
                g if t.dtype.is_floating else None for g, t in zip(gradients[: len(tensors)], tensors)
            ]
            return input_gradients, gradients[len(tensors):]

        return flat_outputs, grad

    flat_outputs = forward(*[leaves[i] for i in positions])
    # The custom gradient returns new tensors: carry the layer's output masks
    # over (boolean, so they need no gradient).
    for inner, outer in zip(keras.tree.flatten(results["outputs"]), flat_outputs):
        mask = get_keras_mask(inner)
        if mask is not None:
            set_keras_mask(outer, mask)
    return keras.tree.pack_sequence_as(results["outputs"], list(flat_outputs))


def _shared_layer(layer_config, layer_id):
    """Deserialises a wrapped layer once per model, however many wrappers share it.

    Keras marks shared objects only on their second appearance in a saved
    config, so the first wrapper's copy is unmarked. Each wrapper's config
    therefore names its layer object (`layer_id`, unique within one saved
    model; two sub-models may hold different layers of the same name), and
    within one load (Keras' object-sharing map exists then) wrappers with the
    same `layer_id` get the same layer. Files from before `layer_id` match by
    layer name.
    """
    shared = global_state.get_global_attribute("shared_objects/id_to_obj_map")
    if layer_id is None:
        layer_id = layer_config.get("config", {}).get("name")
    key = ("kerasmulti.OnDevice", layer_id)
    if shared is not None and key in shared:
        return shared[key]
    layer = keras.saving.deserialize_keras_object(layer_config)
    if shared is not None:
        shared[key] = layer
    return layer


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type.lower()}{spec.device_index}"


@contextlib.contextmanager
def device_scope(device: str):
    """Places every layer called inside the block on `device`, at run time.

    Use it while building a functional model: each layer call inside the
    `with` block becomes an `OnDevice` layer, so the model runs that call on
    `device` whenever it runs (fit, evaluate, predict, a plain call, inside
    `tf.function`). A layer called under two scopes keeps one set of weights
    and runs each call on its own scope's device. A `Sequential` model built
    inside the block places its layers in its own layer list. Scopes nest;
    the innermost wins. Device names are checked like `parallelize`'s.

    Args:
        device: A TensorFlow device name, such as `"/gpu:1"` (or a simulated
            `"/cpu:1"`).

    Raises:
        DeviceError: If the device does not exist on this machine.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras
    first, second = kerasmulti.available_devices()[:2]  # "/gpu:0", "/gpu:1" on GPUs
    tweet_a, tweet_b = keras.Input((280, 256)), keras.Input((280, 256))
    shared_lstm = keras.layers.LSTM(64)
    with kerasmulti.device_scope(first):
        encoded_a = shared_lstm(tweet_a)
    with kerasmulti.device_scope(second):
        encoded_b = shared_lstm(tweet_b)
    merged = keras.layers.concatenate([encoded_a, encoded_b], axis=-1)
    model = keras.Model([tweet_a, tweet_b], keras.layers.Dense(1)(merged))
    ```
    """
    global _installed
    name = resolve_device(device, "device_scope()")
    with _install_lock:
        if _installed == 0:
            keras.layers.Layer.__call__ = _scoped_call
            keras.Sequential.build = _scoped_sequential_build
        _installed += 1
    _stack().append(name)
    try:
        yield name
    finally:
        _stack().pop()
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                keras.layers.Layer.__call__ = _original_call
                keras.Sequential.build = _original_sequential_build


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
        TypeError: If `layer` is not a Keras layer.
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
            "on_device() places a Keras layer or model; wrap plain functions in "
            f"keras.layers.Lambda first. Received: layer={type(layer).__name__}"
        )
    return OnDevice(layer, resolve_device(device, "on_device()"), _validated=True)


def remap_devices(model: keras.Model, mapping: Mapping[str, str]) -> keras.Model:
    """Moves a model's placed layers to other devices, e.g. after loading it elsewhere.

    Args:
        model: A model holding `OnDevice` layers (from `device_scope` or
            `on_device`), for instance one loaded with `keras.models.load_model`,
            or a model from `parallelize` around one.
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
    model = keras.models.load_model("two_tower.keras")  # on a machine with one device:
    kerasmulti.remap_devices(model, {second: first})   # the tower runs on the first
    ```
    """
    moves = {_canonical(old): resolve_device(new, "remap_devices()") for old, new in mapping.items()}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, OnDevice) and layer.device in moves:
            layer.device = moves[layer.device]
    # Traced steps keep the old devices: fit/evaluate/predict's, and
    # parallel_predict's (kept with the model, or with a parallel model).
    template = getattr(model, "_template", None)  # a model from parallelize
    for traced in [model] + ([template] if template is not None else []):
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(traced, name, None) is not None:
                setattr(traced, name, None)
        _inference.drop_kept_steps(traced)
    return model

