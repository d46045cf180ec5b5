"""`OnDevice`: the layer that runs another layer (or sub-model) on one device.

Keras 3 ignores a `tf.device` scope around model construction: a functional
model re-runs its layers when it is called, outside that scope. Placement
must therefore live in the model itself. An `OnDevice` layer calls its layer
inside `tf.device(device)` at call time, so fit, evaluate, predict, plain
calls and `tf.function` traces all honour it. It computes the layer's
gradients on its device too, passes Keras masks in and out, and keeps XLA
off (Keras' `jit_compile="auto"` reads `supports_jit`), since XLA compiles a
whole step for one device. A model loaded on a machine without the named
device runs that layer wherever the model runs, after one warning.

Its config (`get_config`) names the wrapped layer so that wrappers sharing
one layer share it again within one load. `model.save` of a functional or
Sequential model writes no `OnDevice` config at all (see `portable`); this
form serves models Keras rebuilds from their own code, `get_config` and
`clone_model`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref

import keras
import tensorflow as tf

from kerasmulti._src.devices import _canonical, known_devices
from kerasmulti._src.keras_private import get_keras_mask, global_state, inbound_nodes, keras_history, record, set_keras_mask
from kerasmulti._src.model_parallel import scopes as _scopes

_warned: set[str] = set()
# Keys of the entries OnDevice adds to Keras' object-sharing maps; Keras' own
# keys are object ids (ints), so these tuples never collide with them.
_SHARING = "kerasmulti.OnDevice"


def _readable(layer, device) -> str:
    """`device`'s canonical name; wrong types and names TensorFlow cannot read are refused (a missing device is warned about)."""
    if not isinstance(layer, keras.layers.Layer) or not isinstance(device, str):
        raise TypeError(
            "OnDevice places a Keras layer on a device named by a string, such as '/gpu:0'. "
            f"Received: layer={type(layer).__name__}, device={device!r}"
        )
    try:
        return _canonical(device)
    except ValueError as error:  # TensorFlow's "Unknown attribute 'nonsense' is encountered ..."
        raise ValueError(
            f"OnDevice cannot read the device name {device!r}. Pass one such as '/gpu:1' or '/cpu:0'. "
            f"Received: device={device!r}"
        ) from error


@keras.saving.register_keras_serializable(package="kerasmulti")
class OnDevice(keras.layers.Layer):
    """Runs a layer (or sub-model) on one device; made by `on_device`.

    Its weights, dtype policy and name are the wrapped layer's, so a model's
    `output_names` are those it has without placement; a layer already called
    unplaced, or placed on another device, gets `<layer>_on_<device>`. It
    casts nothing: the layer casts its inputs by its own policy. `device`
    holds the canonical device name; `remap_devices` changes it.

    Example:

    ```python
    import keras, kerasmulti
    wrapped = kerasmulti.on_device(keras.layers.Dense(4), "/cpu:0")
    print(wrapped.name, wrapped.device)  # the Dense layer's name, /device:CPU:0
    ```
    """

    def __init__(self, layer, device: str, _validated: bool = False, **kwargs):
        if isinstance(layer, OnDevice):
            raise ValueError(
                f"Layer '{layer.layer.name}' is placed on {layer.device} already. Place the layer itself, "
                f"once per device. Received: layer={layer.name!r}"
            )
        device = device if _validated else _readable(layer, device)
        if "name" not in kwargs:  # a pipeline's cut and a reload name their wrappers themselves
            kwargs["name"] = _free_name(layer, device)
        # The layer casts its inputs by its own policy, as without the wrapper: a
        # wrapper that casts (by the global policy) first would change its numbers.
        kwargs.setdefault("autocast", False)
        if layer.dtype_policy.quantization_mode is None:  # a quantized policy would make Keras call quantized_call
            kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(**kwargs)
        _live[id(self)] = self
        # The process has a placed layer now: `model.save` of a placed model
        # writes its plain twin from here on (not from `import kerasmulti`).
        from kerasmulti._src.model_parallel import portable

        portable.install()
        self.layer = layer
        self.device = device
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
                f"Layer '{self.name}' is placed on {self.device}, which this machine does not "
                f"have (it has {', '.join(sorted(known))}); it runs with the rest of the model. Move it with "
                "kerasmulti.remap_devices(model, {'" + self.device + "': '/cpu:0'}). "
                f"Received: device={self.device!r}",
                stacklevel=3,
            )
        return contextlib.nullcontext()

    def _layer_kwargs(self, kwargs, training, mask):
        if self._call_has_training:
            kwargs["training"] = training
        if self._call_has_mask and mask is not None:
            kwargs["mask"] = mask
        return kwargs

    def __call__(self, *args, **kwargs):
        if not args:  # the layer's first input given by its name (`mha(query=q, value=v)`): `inputs` here
            first = next(iter(inspect.signature(self.layer.call).parameters), None)
            if first in kwargs:
                args = (kwargs.pop(first),)
        return super().__call__(*args, **kwargs)

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._layer_kwargs(kwargs, training, mask)
        scope = self._scope()
        if isinstance(scope, contextlib.nullcontext):
            with _scopes.suspended():
                return self.layer(inputs, *args, **kwargs)
        return call_on_device(self.layer, self.device, inputs, args, kwargs)

    def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
        # A symbolic call, not compute_output_spec: it also builds the layer,
        # so its weights exist when the model is built, saved or loaded.
        # Under the device scope: a layer built here creates its weights on
        # its device, so placement also splits the memory of the weights.
        with _scopes.suspended(), self._scope():
            return self.layer(inputs, *args, **self._layer_kwargs(kwargs, training, mask))

    def compute_mask(self, inputs, previous_mask):
        # Used only when the wrapped call left no mask on its outputs.
        if self.layer.supports_masking:
            return self.layer.compute_mask(inputs, previous_mask)
        return None

    def get_config(self):
        config = {**super().get_config(), "device": self.device}
        layer_id, first = _layer_id(self.layer)
        # The layer's config once per file: a second copy would load as a
        # second layer, with its own weights.
        config["layer"] = keras.saving.serialize_keras_object(self.layer) if first else None
        if layer_id is not None:
            config["layer_id"] = layer_id
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layer = _shared_layer(config.pop("layer"), config.pop("layer_id", None))
        # Devices are not checked here: the file may come from another machine.
        return cls(layer, config.pop("device"), _validated=True, **config)


_wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (id(layer), device): its wrapper
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(wrapper): every wrapper in use


def _free_name(layer, device: str) -> str:
    """The layer's own name for its wrapper, unless another call of the layer may hold it.

    A functional model names its outputs after the layers that make them, so a
    wrapper named as its layer keeps `output_names` (dict losses, history keys)
    those of the model without placement. Keras refuses two layers of one name in
    a model: a layer already called without a wrapper, or placed on another
    device, gets `<layer>_on_<device>`.
    """
    # A call through a wrapper leaves the wrapper, not the layer, as its outputs' maker.
    unplaced = any(_maker(tensor) is layer for node in inbound_nodes(layer) for tensor in node.outputs)
    elsewhere = any(wrapper.layer is layer and wrapper.device != device for wrapper in list(_live.values()))
    return f"{layer.name}_on_{_short(device)}" if unplaced or elsewhere else layer.name


def placed(layer, device: str) -> OnDevice:
    """`layer`'s wrapper for `device` (a canonical name), one per pair while it is in use.

    `device_scope`'s: a layer called twice on one device (`d(d(x))`) goes
    through one wrapper, called twice, since Keras refuses two layers of one
    name in a model; models built from that layer share the wrapper (and
    `remap_devices` moves it in each). A wrapper holds its layer, so the
    layer's id stays its own while the entry lives.
    """
    key = (id(layer), device)
    wrapper = _wrappers.get(key)
    if wrapper is None or wrapper.layer is not layer or wrapper.device != device:  # moved by `remap_devices`
        wrapper = _wrappers[key] = OnDevice(layer, device, _validated=True)
    return wrapper


def _maker(tensor):
    """The operation that made a symbolic tensor; None for one Keras keeps no history of (`record_history=False`)."""
    try:
        return keras_history(tensor).operation
    except AttributeError:
        return None


def _layer_id(layer) -> tuple[int | None, bool]:
    """A number for `layer` within the file being saved, and whether this wrapper writes it.

    Keras saves inside its object-sharing scope. There, wrappers of one
    layer get the same number, counted in the order Keras serialises them
    (and later loads them), so a file is the same each time the model is
    saved; the first of them writes the layer. Outside that scope
    (`get_config`, `clone_model`) each wrapper writes its layer and no number.
    """
    numbers = global_state.get_global_attribute("shared_objects/id_to_config_map")
    if numbers is None:
        return None, True
    key = (_SHARING, id(layer))
    if key in numbers:
        return numbers[key], False
    numbers[key] = sum(1 for k in numbers if isinstance(k, tuple) and k[0] == _SHARING)
    return numbers[key], True


def _shared_layer(layer_config, layer_id):
    """Deserialises a wrapped layer once per load, however many wrappers share it.

    Within one load (Keras' object-sharing map exists then) wrappers with
    the same `layer_id` get the same layer; the first of them in the file
    holds its config. A config made outside a save (`get_config`, cloning)
    has no number: its wrappers are matched by layer name.
    """
    loaded = global_state.get_global_attribute("shared_objects/id_to_obj_map")
    if layer_id is None and layer_config is not None:
        layer_id = layer_config.get("config", {}).get("name")
    key = (_SHARING, layer_id)
    if loaded is not None and key in loaded:
        return loaded[key]
    if layer_config is None:
        raise ValueError(
            "This OnDevice layer shares its layer with a wrapper that was not loaded first. Load "
            f"the whole model with keras.models.load_model. Received: layer_id={layer_id!r}"
        )
    layer = keras.saving.deserialize_keras_object(layer_config)
    if loaded is not None:
        loaded[key] = layer
    return layer


def call_on_device(layer, device, inputs, args, kwargs):
    """Calls `layer` on `device`, and computes its gradients there too.

    A gradient tape builds the backward pass under the device scope active
    when the gradient is taken (Keras' train step: none), not where the
    forward ops ran. This call records its own forward pass and, in its
    custom gradient, takes the gradient inside `tf.device(device)`, so the
    backward pass of the branch runs on the branch's device. Every tensor the
    call receives (`inputs`, and tensors among the other arguments, such as
    `MultiHeadAttention`'s `value`) goes through the custom gradient, so
    gradients reach all of them. Its tape is persistent: a persistent outer
    tape, or a gradient penalty (a gradient of a gradient), asks it again.
    Where no tape records (predict), the layer is just called on `device`.
    """
    if not record.could_possibly_record():
        with _scopes.suspended(), tf.device(device):
            return layer(inputs, *args, **kwargs)
    inputs = keras.tree.map_structure(lambda t: t if _composite(t) else tf.convert_to_tensor(t), inputs)
    leaves = keras.tree.flatten((inputs, args, kwargs))
    # A sparse or ragged input (the batch itself) reaches the layer as it is: no gradient is asked of it.
    positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf) and not _composite(leaf)]
    results = {}

    @tf.custom_gradient
    def forward(*tensors):
        # One tensor passed twice (`Add()([h, h])`, self-attention's `mha(h, h)`) is two tensors
        # here: the tape would give each position the whole gradient, and the sum would double it.
        with tf.device(device):  # where the layer reads them (run eagerly, a copy would go to the default device)
            tensors = [_same_mask(tf.identity(t), t) for t in tensors]
        call_leaves = list(leaves)
        for i, tensor in zip(positions, tensors):
            call_leaves[i] = tensor
        call_inputs, call_args, call_kwargs = keras.tree.pack_sequence_as((inputs, args, kwargs), call_leaves)
        with tf.GradientTape(persistent=True) as tape, _scopes.suspended(), tf.device(device):
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


def _composite(value) -> bool:
    return isinstance(value, (tf.SparseTensor, tf.RaggedTensor))


def _same_mask(tensor, like):
    """`tensor`, with the Keras mask `like` carries (a layer reads its input's mask from it)."""
    mask = get_keras_mask(like)
    if mask is not None:
        set_keras_mask(tensor, mask)
    return tensor


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type.lower()}{spec.device_index}"
