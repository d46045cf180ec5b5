"""A custom step's `optimizer.apply`, with a few operations whatever the model's size.

In a custom step (`custom_steps.py`) every replica calls `optimizer.apply`
with its gradients; they are scaled by the replica's share, summed, and
applied once. Done tensor by tensor, that is a send, an `AddN` and the
optimizer's update operations per variable and per step. With compiled model
calls (`compiled_calls.py`) the merge is packed as the compiled step's is
(`packing.py`): each replica packs its gradients into one buffer per dtype
inside one XLA program, the buffers cross to the variables' device, and one
XLA program there sums them, takes them apart and runs the optimizer's
update. It is used where it can be: every gradient a dense tensor, and the
variables and the optimizer's own on one device (XLA reads a variable only on
its device); otherwise the update runs tensor by tensor, as before.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasmulti._src.data_parallel import packing as _packing


class PackedApply:
    """One optimizer's `apply` for one list of variables, packed (see the module docstring).

    Args:
        optimizer: The Keras optimizer.
        original: Its own `apply`, which the update program calls.
        variables: The variables the gradients are for.
        gradients: One replica's gradients (their shapes and dtypes fix the layout).
    """

    def __init__(self, optimizer, original, variables, gradients):
        self.original, self.variables = original, list(variables)
        self.layout = _packing.Layout(gradients)
        self.device = _packing.device_of(self.variables[0])
        self.pack = tf.function(self._pack, jit_compile=True, reduce_retracing=True, autograph=False)
        self.update = tf.function(self._update, jit_compile=True, autograph=False)

    @staticmethod
    def usable(optimizer, variables, gradients) -> bool:
        """Whether these gradients and variables can take the packed path (builds the optimizer)."""
        if variables is None or not gradients or any(not isinstance(g, tf.Tensor) for g in gradients):
            return False  # None (not connected) or sparse gradients: tensor by tensor
        build_optimizer(optimizer, variables)  # here: XLA creates no variables
        devices = {_packing.device_of(v) for v in list(variables) + list(optimizer.variables)}
        return len(devices) == 1

    def _pack(self, gradients, share):
        return self.layout.pack([g * tf.cast(share, g.dtype) for g in gradients])

    def _update(self, packed: list):
        self.original(self.layout.unpack(_packing.summed(packed)), self.variables)

    def apply(self, packed: list) -> None:
        """Sums the replicas' packed gradients and applies them, in one program on the variables' device."""
        with tf.device(self.device):
            self.update(packed)


def build_optimizer(optimizer, variables, scope=None) -> None:
    """Builds `optimizer` for `variables` as its `apply` would, if it is not built yet.

    Called before an update program is first traced: built inside that
    trace, the optimizer's new variables would make TensorFlow trace it twice.
    `scope` (default `tf.init_scope()`, outside every trace) is where its
    variables are made.
    """
    if not optimizer.built:
        with scope or tf.init_scope(), keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))
        optimizer.built = True
