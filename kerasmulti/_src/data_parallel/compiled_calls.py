"""A custom step's model calls, each compiled with XLA on its replica's device.

A template's own `train_step` runs on every replica with meeting points in the
middle (`optimizer.apply`, `metric.update_state`: `custom_steps.py`), so the
step cannot be one XLA program per replica. Its model calls can, and they do
the work: inside the replica context, a call of the template or of one of its
sub-models (a GAN's generator and discriminator, a VAE's encoder and decoder)
runs as one `tf.function(jit_compile=True)` on the replica's device. The
call's variables are read by one program on their own device, packed into one
buffer per dtype (`packing.DeviceReads`: XLA cannot reach a variable on another
device), and cut into the program's arguments on the replica's device (one
split per dtype), so a call runs a few operations outside XLA whatever its
size; it runs in a `keras.StatelessScope`, and what it assigns (a Dropout's
seed, BatchNormalization's moving statistics) is assigned after it, through
the replica context's rules. TensorFlow differentiates a function call as a
whole: the step's `tape.gradient` runs the call's backward pass as a second
compiled program, and a nested tape (a gradient penalty) differentiates that
one in turn.

A call that reaches a meeting point (a metric updated inside `call`,
BatchNormalization whose statistics are the whole batch's) cannot be one
replica's program: the meeting point raises `NotCompilable` while the call is
traced, and that model's calls run uncompiled, after one warning. So do
models with layers that Keras marks as not supporting XLA, and recurrent
layers: a loop's forward program would hand TensorLists to its gradient's.
"""

from __future__ import annotations

import inspect
import os
import threading
import warnings

import keras
import tensorflow as tf
from keras import tree

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import packing as _packing
from kerasmulti._src.keras_private import get_keras_mask, set_keras_mask
from kerasmulti._src.utils.nesting import Nesting
from kerasmulti._src.utils.patching import patched

_tracing = Nesting()  # per replica thread: inside the trace of a compiled call
_local = threading.local()  # per replica thread: why the last trace stopped
_warned: set = set()


class NotCompilable(Exception):
    """Raised while a call is traced for XLA when it reaches a point that spans the replicas."""


def inside() -> bool:
    """Whether this thread is tracing a compiled call (its inner calls then run as they are)."""
    return _tracing.inside()


def refuse(reason: str) -> None:
    """Stops the trace of a compiled call that reached `reason` (a meeting point of the replicas)."""
    if inside():
        _stop(reason)


def _stop(reason: str):
    _local.reason = reason  # TensorFlow and Keras add their traces to the exception's message
    raise NotCompilable(reason)


def units(template: keras.Model) -> list:
    """The models a custom step calls: the template, if it has a `call`, and its sub-models."""
    found = [template] if type(template).call is not keras.Model.call and template.built else []
    return found + [layer for layer in template.layers if isinstance(layer, keras.Model) and layer.built]


class CompiledCall:
    """`unit.call` as an XLA program per replica device; set as the unit's `call` in a replica context."""

    def __init__(self, unit: keras.Model):
        self.unit = unit
        self.original = type(unit).call.__get__(unit)
        self.variables = list(unit.variables)
        self.reads = _packing.DeviceReads(self.variables)  # one program per device reads them all
        self.failed = not_compilable(unit)
        self._program = tf.function(self._stateless, jit_compile=True, reduce_retracing=True, autograph=False)

    def __call__(self, *args, **kwargs):
        if inside() or self.failed:
            self._warn()
            return self.original(*args, **kwargs)
        try:
            outputs, updates, losses, masks = self._program(self.reads.split(self.reads.read()), args, kwargs)
        except NotCompilable:
            self.failed = _local.reason
            self._warn()
            return self.original(*args, **kwargs)
        # The trace that ran says which variables it assigned (each trace its own: training or not).
        for i, value in updates.items():
            self.variables[int(i)].assign(value)
        for loss in losses:
            self.unit.add_loss(loss)
        for output, mask in zip(tree.flatten(outputs), masks):
            if mask is not None:
                set_keras_mask(output, mask)
        return outputs

    def _stateless(self, read, args, kwargs):
        values = self.reads.values(read)
        with _tracing, _WatchedScope(list(zip(self.variables, values)), collect_losses=True) as scope:
            given = [scope.get_current_value(v) for v in self.variables]
            outputs = self.original(*args, **kwargs)
        own = {id(v) for v in self.variables}
        foreign = [v for v in scope.missed + scope.assigned if id(v) not in own]
        if foreign:
            # A variable built by this call, or another model's: XLA would reach its device.
            _stop(f"reaches variable '{foreign[0].path}', which it does not own when the step starts")
        updates = {str(i): scope.get_current_value(v) for i, v in enumerate(self.variables) if scope.get_current_value(v) is not given[i]}
        return outputs, updates, list(scope.losses), [get_keras_mask(o) for o in tree.flatten(outputs)]

    def _warn(self):
        if self.failed is None or inside() or (id(self.unit), self.failed) in _warned:
            return
        _warned.add((id(self.unit), self.failed))
        kind = "model" if isinstance(self.unit, keras.Model) else "layer"
        warnings.warn(
            f"{kind.capitalize()} '{self.unit.name}' runs uncompiled: it {self.failed}. "
            f"Pass jit_compile=False to compile() to silence this. Received: {kind}={self.unit.name!r}",
            stacklevel=_outside_libraries(),
        )


def _outside_libraries() -> int:
    """`warnings.warn`'s stack level, from its caller, of the innermost frame outside the libraries (a step's line)."""
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and _in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _in_library(filename: str) -> bool:
    # A replica thread's stack starts in `threading`; the step's own code is the user's.
    folders = (f"{os.sep}{name}{os.sep}" for name in ("kerasmulti", "keras", "tensorflow"))
    return any(folder in filename for folder in folders) or filename.endswith(f"{os.sep}threading.py")


class _WatchedScope(_packing.StoredScope):
    """A `StatelessScope` that notes the variables read without a value of its own, and those assigned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.missed, self.assigned = [], []

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None:
            self.missed.append(variable)
        return value

    def add_update(self, update):
        self.assigned.append(update[0])
        super().add_update(update)


def calls(template: keras.Model) -> list:
    """(unit, "call", compiled call) for every unit of `template`, to set in a replica context."""
    return [(unit, "call", CompiledCall(unit)) for unit in units(template)]


def not_compilable(unit) -> str | None:
    """Why `unit`'s calls cannot be XLA programs, known before they are traced; None if they can."""
    layers = keras_private.flatten_layers(unit)
    unsupported = [layer.name for layer in layers if not layer.supports_jit]
    if unsupported:
        return f"holds layers that do not support XLA ({', '.join(unsupported)})"
    # A loop's forward program hands its per-step values (TensorLists) to the gradient program,
    # which TensorFlow does not do across XLA's boundary ("UNIMPLEMENTED" when the step runs).
    recurrent = [layer.name for layer in layers if isinstance(layer, keras.layers.RNN)]
    if recurrent:
        return f"holds recurrent layers ({', '.join(recurrent)}), whose loops XLA cannot hand to a gradient"
    # Its gradient is sparse (the rows looked up); out of an XLA program it would be a dense table.
    tables = [layer.name for layer in layers if isinstance(layer, keras.layers.Embedding)]
    if tables:
        return f"holds Embedding layers ({', '.join(tables)}), whose sparse gradients XLA would make dense"
    return None


def compiled(layers: list):
    """Inside: each of `layers` runs its calls as XLA programs (`CompiledCall`)."""
    return patched([(layer, "call", CompiledCall(layer)) for layer in layers])
