"""The losses layers add, kept per replica thread while replicas take turns mid-forward.

Keras keeps the losses a layer adds in `call` (activity regularisers,
`add_loss`) on the layer, and each top-level call clears them. Replicas traced
on threads (`replicas.run(..., synchronized=True)`) take turns mid-forward (at
every BatchNormalization), so with one shared list a replica would clear or
count another's losses.
"""

from __future__ import annotations

import contextlib

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import replicas as _replicas


class _PerReplicaLosses:
    """A layer's list of added losses, one per replica thread."""

    def __init__(self):
        self._lists: dict[int, list] = {}

    def _mine(self) -> list:
        return self._lists.setdefault(_replicas.replica_id(), [])

    def extend(self, losses):
        self._mine().extend(losses)

    def append(self, loss):
        self._mine().append(loss)

    def clear(self):
        self._mine().clear()

    def all(self) -> list:
        return [loss for replica in sorted(self._lists) for loss in self._lists[replica]]

    def __getitem__(self, index):
        return self._mine()[index]

    def __setitem__(self, index, loss):
        self._mine()[index] = loss

    def __iter__(self):
        return iter(self._mine())

    def __len__(self):
        return len(self._mine())


@contextlib.contextmanager
def kept_per_replica(model):
    """Inside: every layer of `model` keeps the losses it adds per replica thread.

    (The lists bypass Keras' attribute tracking.) On the way out each layer
    holds the replicas' losses in replica order, as a plain call leaves them.
    """
    layers = keras_private.flatten_layers(model)
    saved = [keras_private.swap_added_losses(layer, _PerReplicaLosses()) for layer in layers]
    try:
        yield
    finally:
        for layer, losses in zip(layers, saved):
            losses.extend(keras_private.swap_added_losses(layer, losses).all())
