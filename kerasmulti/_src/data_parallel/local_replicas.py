"""This process's replicas: a step's plan, its pieces, running them, merging their outputs.

A step is planned once (`StepPlan`): which rows each replica takes, which of
them count, each replica's share of the batch, and the devices that run.
Every executor of a `LocalParallelModel` carries out that plan: Keras' step
on threads (`threaded.py`, through `run` here), the replicas' XLA programs
(`compiled.py`) and the template's own steps (`custom_steps.py`). The split it follows is even, fixed
proportions, or measured ones (`balance.AutoSplit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import keras
import tensorflow as tf

from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import replica_losses as _replica_losses
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm


@dataclasses.dataclass
class StepPlan:
    """One step's plan: the batch's rows, one shard per replica that runs, and their devices."""

    batch: Any  # rows in the batch (int, or a scalar tensor when known at run time)
    shards: list  # `split.Shard` per replica, in order
    devices: list  # the device of each shard's replica

    @functools.cached_property
    def shares(self) -> list:
        """Each replica's share of the batch's rows (float32 scalars summing to 1)."""
        return _split.shares(self.shards, self.batch)


class LocalReplicas:
    """The replicas of one model on this process's devices.

    Args:
        model: The `keras.Model` the replicas run for: its layers keep the
            losses they add per replica, its variables are read by them.
        devices: The replicas' devices, in shard order.
        merge_device: Where batches are sliced and outputs merged.
        split: None (even sizes), one proportion per device, or "auto".
        batchnorm: The BatchNormalization layers synchronised while the
            replicas train (`sync_batchnorm.py`).
    """

    def __init__(self, model: keras.Model, devices: list[str], merge_device: str, split=None, batchnorm=()):
        self._model = model
        self._batchnorm = list(batchnorm)
        self.devices = list(devices)
        self.merge_device = merge_device
        self.auto_split = _balance.AutoSplit(len(devices)) if split == "auto" else None
        self.split = None if split == "auto" else split

    def proportions(self):
        """The proportions the next step's plan follows: None (even), numbers, or the measured variable."""
        return self.split if self.auto_split is None else self.auto_split.proportions.read_value()

    def plan(self, batch) -> StepPlan:
        """The plan for a batch of `batch` rows: at most one shard per device."""
        shards = _split.plan(batch, len(self.devices), self.proportions())
        return StepPlan(batch, shards, self.devices[: len(shards)])

    def pieces(self, structure, plan: StepPlan) -> list:
        """Each replica's rows of `structure`, sliced where the batch arrives.

        (The host, for a `tf.data` pipeline: each device receives its own
        rows, not a copy of the whole batch.)
        """
        with tf.device(self.merge_device):
            return [_split.take(structure, shard) for shard in plan.shards]

    def run(self, plan: StepPlan, fn: Callable, synchronized: bool = False) -> list:
        """Calls `fn(i)` on every replica's device, on threads that can meet where `synchronized`.

        Synchronised, the layers keep the losses they add per replica, and
        BatchNormalization uses the whole batch's statistics.
        """
        with self._synchronized(synchronized):
            return _replicas.run(plan.devices, fn, synchronized, self._model.variables if synchronized else ())

    def _synchronized(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(_replica_losses.kept_per_replica(self._model))
        stack.enter_context(_sync_batchnorm.synchronized(self._batchnorm))
        return stack

    def merge(self, outputs: list, plan: StepPlan):
        """The replicas' outputs joined in row order, on the merge device."""
        with tf.device(self.merge_device):
            return _split.merge(outputs, plan.shards)
