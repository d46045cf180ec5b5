"""A pipeline's schedules: GPipe's, and 1F1B's bound on the micro-batches in flight.

GPipe's schedule is the dataflow's: every micro-batch's forward pass runs as
soon as its inputs are ready, and its activations are kept until its
backward pass, so all M micro-batches' are held at once. 1F1B
(PipeDream-Flush) holds at most S, one per stage: micro-batch m starts only
once micro-batch m - S has its gradients (`InFlight`), which gives the same
numbers, since each micro-batch's work is unchanged.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from kerasmulti._src.data_parallel import balance as _balance
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm

SCHEDULES = ("gpipe", "1f1b")


def check(schedule, template: keras.Model) -> None:
    """Refuses an unknown schedule, and 1F1B where every micro-batch must pass a point first."""
    if not isinstance(schedule, str):
        raise TypeError(f"pipeline() takes schedule as a string, 'gpipe' or '1f1b'. Received: schedule={schedule!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline() takes schedule='gpipe' or '1f1b'. Received: schedule={schedule!r}")
    if schedule == "gpipe":
        return
    batchnorm = [layer.name for layer in _sync_batchnorm.batchnorm_layers(template)]
    if batchnorm:
        raise ValueError(
            "pipeline(schedule='1f1b') cannot keep BatchNormalization's whole-batch statistics: every "
            f"micro-batch must pass it first. Use schedule='gpipe'. Received: BatchNormalization={batchnorm}"
        )
    overrides = _custom_steps.overridden(template)
    if overrides:
        raise ValueError(
            "pipeline(schedule='1f1b') schedules Keras' own train_step. Use schedule='gpipe' for a model "
            f"with steps of its own. Received: overrides={overrides}"
        )


class InFlight:
    """1F1B's bound, for one traced step: micro-batch m starts once micro-batch m - `limit` has its gradients.

    The micro-batches are traced in order, each whole unless it meets the
    others mid-step (`replicas._Turn`), so an earlier one's gradients exist
    when a later one starts. A loss that needs every micro-batch's totals (a
    masked loss) meets them in the forward pass: every forward pass must run
    first, and such a step keeps GPipe's schedule, after a warning.
    """

    def __init__(self, limit: int, name: str, warned: list):
        # `warned`: the model's, so that it warns once, not at every trace.
        self.limit, self.name, self.warned = limit, name, warned
        self._gradients = {}

    def start(self, i: int, inputs):
        """Micro-batch `i`'s inputs, held back until micro-batch `i - limit` has its gradients."""
        if i < self.limit:
            return inputs
        earlier = self._gradients.get(i - self.limit)
        if earlier is None:
            if not self.warned:
                self.warned.append(self.name)
                warnings.warn(
                    f"The loss of '{self.name}' needs every micro-batch's totals first, so its steps run "
                    "GPipe's schedule, keeping every micro-batch's activations. Received: schedule='1f1b'",
                    stacklevel=2,
                )
            return inputs
        with tf.control_dependencies(earlier):
            return keras.tree.map_structure(_balance.waiting_copy, inputs)

    def done(self, i: int, gradients: list) -> None:
        """Notes micro-batch `i`'s gradients, which micro-batch `i + limit` waits for."""
        self._gradients[i] = [t for g in gradients if g is not None for t in tf.nest.flatten(g, expand_composites=True)]
