"""`device_scope`: every layer called inside the block runs on one device.

Keras offers no hook on a layer call, so while at least one scope is open
(in any thread) `keras.layers.Layer.__call__` and `keras.Sequential.build`
are replaced by versions that wrap the layer in an `OnDevice` layer for the
innermost scope of the calling thread; the last scope to close puts Keras'
own back. Only symbolic calls are wrapped (a model being built), and none
while Keras rebuilds a model from its config, whose placement was saved
with it. A call on tensors (a subclassed model's `call()`, a `tf.function`)
runs unplaced, after one warning: its layer has no functional graph to hold
a wrapper.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.devices import resolve_device
from kerasmulti._src.model_parallel import scopes as _scopes
from kerasmulti._src.model_parallel.on_device import OnDevice, placed

# Keras' own, which the scope's hooks call; and what `Layer.__call__` and `Sequential.build`
# were when the first open scope installed its hooks (a user's patch, made since kerasmulti
# was imported), put back when the last closes. The hooks call Keras' own, not the patch:
# a patch made inside a scope calls the hook, and would call itself through it.
_original_call = keras.layers.Layer.__call__
_original_sequential_build = keras.Sequential.build
_found_call, _found_sequential_build = _original_call, _original_sequential_build
_installed = 0
_install_lock = threading.Lock()
_warned: list[str] = []


def _is_symbolic(args, kwargs) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten((args, kwargs)))


def _scoped_call(self, *args, **kwargs):
    device = _scopes.innermost()
    if device and not isinstance(self, OnDevice):
        if not _is_symbolic(args, kwargs):
            if not _warned and _meant_to_place(self):  # once: a model run eagerly in the block calls layers each step
                _warn_unplaced(self)
        # A model loaded (or cloned) inside a scope keeps the placement it was
        # saved with: wrapping its layers again would rename them, and its
        # weights would no longer match.
        elif not keras_private.keras_is_deserialising(skip=2):
            return placed(self, device)(*args, **kwargs)
    return _original_call(self, *args, **kwargs)


def _meant_to_place(layer) -> bool:
    """Whether a call on tensors inside a scope is one the scope was opened for.

    Not a placed model run inside the block (fit, predict, a call), nor the
    layers such a run calls: only a layer called on its own, or inside the
    call that opened the scope (a subclassed model's `call()`).
    """
    outer = _scopes.calling()
    if outer is None:
        return not any(isinstance(inner, OnDevice) for inner in keras_private.flatten_layers(layer))
    return outer is _scopes.opened_in()


def _warn_unplaced(layer) -> None:
    """Once per process: a call on tensors (a subclassed model's `call()`, a `tf.function`) is not placed."""
    _warned.append(layer.name)
    warnings.warn(
        f"device_scope() places layers called on Keras inputs; '{layer.name}' got tensors and runs unplaced. "
        f"Use kerasmulti.on_device in a subclassed model. Received: layer={layer.name!r}",
        stacklevel=3,
    )


def _scoped_sequential_build(self, input_shape=None):
    """A Sequential built inside a scope places its layers, in its own layer list.

    Placed only in the graph it builds, they would run placed but be saved,
    summarised and cloned without their placement.
    """
    device = _scopes.innermost()
    if device and not keras_private.keras_is_deserialising(skip=2):
        keras_private.set_sequential_layers(self, [
            layer if isinstance(layer, (OnDevice, keras.layers.InputLayer)) else placed(layer, device)
            for layer in keras_private.sequential_layers(self)
        ])
    with _scopes.suspended():
        return _original_sequential_build(self, input_shape)


@contextlib.contextmanager
def _layer_calls_placed():
    global _installed, _found_call, _found_sequential_build
    with _install_lock:
        if _installed == 0:
            _found_call, _found_sequential_build = keras.layers.Layer.__call__, keras.Sequential.build
            keras.layers.Layer.__call__ = _scoped_call
            keras.Sequential.build = _scoped_sequential_build
        _installed += 1
    try:
        yield
    finally:
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                if keras.layers.Layer.__call__ is _scoped_call:  # not patched again inside the block
                    keras.layers.Layer.__call__ = _found_call
                if keras.Sequential.build is _scoped_sequential_build:
                    keras.Sequential.build = _found_sequential_build


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
    A layer called on tensors inside the block (in a subclassed model's
    `call()`, or a `tf.function`) is not placed, after one warning: wrap it
    with `on_device` in the model's `__init__` instead.

    Args:
        device: A TensorFlow device name, such as `"/gpu:1"` (or a simulated
            `"/cpu:1"`).

    Raises:
        TypeError: If `device` is not a string.
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
    name = resolve_device(device, "device_scope()")
    with _layer_calls_placed(), _scopes.opened(name):
        yield name
