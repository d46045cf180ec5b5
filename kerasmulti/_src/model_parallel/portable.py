"""Placed models that plain Keras loads: `strip_placement`, and `.keras` files.

A `.keras` file names each layer's class, and Keras imports classes only
from its own packages, so a file holding `OnDevice` layers would load only
where kerasmulti's `OnDevice` is registered (`kerasmulti.load_model`, or
`custom_objects`). Keras also finds each layer's weights in the
file by a path built from class names, so a file cannot hold the wrappers
and still load as the model without them.

So `model.save` of a functional or Sequential model with placed layers
saves its plain twin: the same layers, weights, compile settings and
optimizer, called without wrappers (what `strip_placement` returns), whose
config records the device of each placed call beside that call's layer,
under `kerasmulti_devices`, a key Keras does not read. Plain Keras loads the
plain model; `kerasmulti.load_model` wraps the recorded calls again.

Keras has no hook around saving: `install()` replaces
`saving_lib.save_model` and `load_weights_only` (which `Model.save` and
`Model.load_weights` call) by functions that do this for placed models and
otherwise call Keras' own. Importing kerasmulti installs nothing: the first
`OnDevice` layer of the process does, so a process without placed layers
saves and loads exactly as plain Keras; `keras.models.load_model` is never
replaced. The tests of this module fail if Keras stops calling them. A model whose placed
layers sit in a subclassed model or layer is saved with its `OnDevice`
layers, as it only loads with its own code anyway.
"""

from __future__ import annotations

import json
import os
import weakref
import zipfile

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.parallel_model import unwrap
from kerasmulti._src.keras_private import saving_lib
from kerasmulti._src.model_parallel import scopes as _scopes
from kerasmulti._src.model_parallel.on_device import OnDevice
from kerasmulti._src.model_parallel.rebuild import REBUILDABLE, own_calls, rebuilt
from kerasmulti._src.utils.arguments import check_readable_file

RECORD = "kerasmulti_devices"
NAMES = "kerasmulti_names"  # each placed call's wrapper name, beside RECORD; absent from older files
_original_save = saving_lib.save_model
_original_load_weights = saving_lib.load_weights_only
# model -> (its layers when the twin was made, the twin): saving again (each
# epoch of a checkpoint) reuses the twin rather than calling every layer again.
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def strip_placement(model: keras.Model) -> keras.Model:
    """Returns the model without its placement, for serving or for plain Keras.

    The plain model calls the same layers as `model`, without their
    `OnDevice` wrappers: it shares their weights (training one trains the
    other), a layer placed on two devices stays one layer, and sub-models
    are stripped too. It is compiled as `model` is, with the same optimizer.
    `model.save` already writes a file that plain Keras loads; use this to
    serve or export a model with no placement at all.

    Args:
        model: A functional or Sequential model, placed with `device_scope`
            or `on_device`, or a model from `parallelize` around one.

    Returns:
        A new model with no `OnDevice` layer; `model` itself (a parallel
        model's template) if it has none.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If placed layers sit inside a subclassed model or layer,
            whose own code places them.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras, numpy as np
    first, second = kerasmulti.available_devices()[:2]
    inputs = keras.Input((4,))
    with kerasmulti.device_scope(second):
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    plain = kerasmulti.strip_placement(model)
    print([type(layer).__name__ for layer in plain.layers])  # no 'OnDevice'
    x = np.ones((2, 4), "float32")
    assert np.allclose(plain.predict(x), model.predict(x))
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "strip_placement() takes a keras.Model. "
            f"Received: model={type(model).__name__}"
        )
    model = unwrap(model)
    if not _placed(model):
        return model
    if not _rebuildable(model):
        # Only functional and Sequential graphs can be rebuilt without their wrappers.
        raise ValueError(
            "strip_placement() cannot strip layers placed inside a subclassed model or layer. "
            f"Remove on_device() from that class's code instead. Received: model={model.name!r}"
        )
    with _scopes.suspended():
        plain = _plain(model, {}, record=False)
    _compile_like(plain, model)
    return plain


def install() -> None:
    """Routes Keras' `.keras` saving (and `load_weights`) of placed models through this module."""
    saving_lib.save_model = _save_model
    saving_lib.load_weights_only = _load_weights_only


def load_model(filepath, custom_objects: dict | None = None, compile: bool = True, safe_mode: bool = True) -> keras.Model:
    """Loads a model as `keras.models.load_model` does, with its placement back.

    `model.save` of a model placed with `device_scope` or `on_device` writes
    a file that plain Keras loads without its placement (it runs on one
    device); the file also records each placed call's device. This loads
    the model and wraps those calls on their devices again, sharing the
    loaded weights, compiled as saved, with the optimizer's state. Files
    without placement load exactly as Keras loads them.

    Args:
        filepath: A `.keras` file or folder, or anything
            `keras.models.load_model` accepts.
        custom_objects: As in `keras.models.load_model`.
        compile: As in `keras.models.load_model`.
        safe_mode: As in `keras.models.load_model`.

    Returns:
        The loaded `keras.Model`, placed as it was saved.

    Raises:
        ValueError: If a local `filepath` does not exist, or is a `.keras`
            file that is not a zip archive (damaged); else as Keras raises.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras
    first, second = kerasmulti.available_devices()[:2]
    inputs = keras.Input((4,))
    with kerasmulti.device_scope(second):
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
    keras.Model(inputs, keras.layers.Dense(1)(hidden)).save("placed.keras")
    loaded = kerasmulti.load_model("placed.keras")
    print(kerasmulti.placement_summary(loaded))  # 'hidden' on the second device
    ```
    """
    check_readable_file(filepath, "model")
    model = keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode)
    config = _saved_config(filepath)
    if config is None or RECORD not in config or type(model) not in REBUILDABLE:
        return model
    with _scopes.suspended():
        placed = _placed_again(model, json.loads(config)["config"], {})
    _compile_like(placed, model)
    return placed


def _save_model(model, filepath, *args, **kwargs):
    if _saved_plain(model):
        model = _twin(model)
    return _original_save(model, filepath, *args, **kwargs)


def _load_weights_only(model, filepath, *args, **kwargs):
    # `model.load_weights("x.keras")`: a portable file holds the weights of
    # the plain twin, which shares the model's variables.
    if str(filepath).endswith(".keras") and _saved_plain(model) and RECORD in (_saved_config(filepath) or ""):
        model = _twin(model)
    return _original_load_weights(model, filepath, *args, **kwargs)


def _saved_plain(model) -> bool:
    """Whether `model.save` writes `model`'s plain twin rather than `model`."""
    return type(model) in REBUILDABLE and _placed(model) and _rebuildable(model)


def _placed(layer) -> bool:
    if not isinstance(layer, keras.layers.Layer):  # an op such as keras.ops.add
        return False
    return any(isinstance(inner, OnDevice) for inner in keras_private.flatten_layers(layer))


def _rebuildable(layer) -> bool:
    """Whether every placed call inside `layer` is a call of a rebuildable model's graph."""
    if not _placed(layer):
        return True
    if isinstance(layer, OnDevice):
        return _rebuildable(layer.layer)
    return type(layer) in REBUILDABLE and all(_rebuildable(inner) for inner in layer.layers)


def _plain(model, done: dict, record: bool):
    """`model` and its sub-models with each call's wrapper taken off.

    With `record`, each new model's config also records its calls' devices.
    `done` maps a sub-model to its plain version, so a shared one stays shared.
    """
    wrappers = {}  # id(layer) -> the wrapper of each of its calls, None where unplaced

    def choose(layer, node):
        wrapper = layer if isinstance(layer, OnDevice) else None
        target = wrapper.layer if wrapper else layer
        if _placed(target):
            if id(target) not in done:
                done[id(target)] = _plain(target, done, record)
            target = done[id(target)]
        wrappers.setdefault(id(target), []).append(wrapper)
        return target

    plain = rebuilt(model, choose)
    if record:
        # Keras saves what get_config returns: this model's own, plus the record.
        plain.get_config = lambda: _recorded(type(plain).get_config(plain), plain, wrappers)
    return plain


def _recorded(config: dict, model, wrappers: dict) -> dict:
    """Adds to each layer entry of `config` the device of each of the layer's calls."""
    if isinstance(model, keras.Sequential):
        layers = {layer.name: layer for layer in model.layers}
        pairs = [(entry, layers.get(entry["config"].get("name"))) for entry in config["layers"]]
    else:
        pairs = zip(config["layers"], model.operations)  # get_config's own order
    for entry, layer in pairs:
        calls = wrappers.get(id(layer), [])
        if any(calls):
            entry[RECORD] = [wrapper.device if wrapper else None for wrapper in calls]
            entry[NAMES] = [wrapper.name if wrapper else None for wrapper in calls]
    return config


def _twin(model):
    layers = [id(layer) for layer in keras_private.flatten_layers(model, include_self=False)]
    made, twin = _twins.get(model, (None, None))
    if made != layers:
        with _scopes.suspended():
            twin = _plain(model, {}, record=True)
        _twins[model] = layers, twin
    twin.trainable = model.trainable
    _compile_like(twin, model)
    return twin


def _placed_again(model, config: dict, done: dict):
    """`model`, loaded plain, with the calls that `config` records wrapped again."""
    sequential = isinstance(model, keras.Sequential)
    entries = {entry["config"]["name"] if sequential else entry["name"]: entry for entry in config["layers"]}

    def choose(layer, node):
        entry = entries.get(layer.name, {})
        target = layer
        if _records_inside(entry.get("config")):
            if id(layer) not in done:
                done[id(layer)] = _placed_again(layer, entry["config"], done)
            target = done[id(layer)]
        devices = entry.get(RECORD)
        if not devices:
            return target
        call = 0 if sequential else own_calls(model, layer).index(node)
        device = devices[call]
        if not device:
            return target
        # One wrapper per layer and device in this load (a layer called twice there goes through it twice).
        key = ("wrapper", id(target), device)
        if key not in done:
            done[key] = OnDevice(target, device, _validated=True, **_saved_name(entry, call, target, devices))
        return done[key]

    return rebuilt(model, choose)


def _saved_name(entry: dict, call: int, layer, devices: list) -> dict:
    """The name the wrapper of a saved call had, as `OnDevice`'s `name` argument.

    A file from before names were recorded: the layer's name where all its
    calls ran on one device (so the model's outputs keep their names), else
    `OnDevice`'s default, `<layer>_on_<device>`.
    """
    names = entry.get(NAMES)
    if names:
        return {"name": names[call]}
    return {"name": layer.name} if len(set(devices)) == 1 else {}


def _records_inside(config) -> bool:
    """Whether a model config (or any config within it) records placed calls."""
    if isinstance(config, dict):
        return RECORD in config or any(_records_inside(value) for value in config.values())
    if isinstance(config, list):
        return any(_records_inside(value) for value in config)
    return False


def _compile_like(target, source) -> None:
    """Compiles `target` with `source`'s settings and its optimizer object (and its state)."""
    if not source.compiled:
        return
    config = keras.saving.deserialize_keras_object(source.get_compile_config())
    target.compile(**{**config, "optimizer": source.optimizer})


def _saved_config(filepath) -> str | None:
    """The config.json of the `.keras` file or folder that Keras loaded; None from the Hub."""
    path = str(filepath)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            return f.read()
    if path.endswith(".keras") and os.path.isfile(path):
        with zipfile.ZipFile(path) as archive:
            return archive.read("config.json").decode()
    return None
