"""Keras' step on threads: the executor of a step whose replicas run uncompiled.

Each replica's forward pass, its part of the batch's loss (`loss_parts.py`)
and its gradients are traced on a thread of its own, under its device's scope;
the replicas meet where the batch's totals or BatchNormalization's statistics
need them all (`replicas.py`). The gradients are summed per variable and
applied with the model's optimizer. `compiled.CompiledReplicas` carries out
the same plan as XLA programs, behind the same `run`.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split


class ThreadedReplicas:
    """Runs a parallel model's replicas as Keras' step, traced on threads; one per model.

    Args:
        model: The parallel model, whose loss and optimizer the replicas use.
        template: The model the replicas run.
        replicas: This process's replicas (`local_replicas.LocalReplicas`).
        order: Called at each training step: which replica waits for which
            (a pipeline's 1F1B bound, `schedules.InFlight`), or None.
        sum_device: The device where a variable's gradients are summed.
    """

    def __init__(self, model, template, replicas, order: Callable, sum_device: Callable):
        self._model = model
        self._template = template
        self._replicas = replicas
        self._order = order
        self._sum_device = sum_device

    def run(self, plan, pieces, training, deferred, timing=None) -> list:
        """Every replica's step under `plan` (`local_replicas.StepPlan`); returns `(y_pred, loss)` per replica.

        A training step also sums the replicas' gradients and applies them
        with the model's optimizer. The loss trackers record into `deferred`
        (`loss_metrics.DeferredLossMetrics`) as the replicas run; their busy
        times go to `timing` (`balance.StepTiming`), if given.
        """
        model, batch, shards, shares = self._model, plan.batch, plan.shards, plan.shares
        order = self._order() if training else None
        trainable = model.trainable_weights if training else []

        def replica(i):
            _replicas.set_valid(shards[i].counted)
            x_i, y_i, sw_i = timing.start(i, pieces[i]) if timing else pieces[i]
            _replicas.set_timing(timing)  # its waits at meeting points apart from its work
            if order is not None:
                x_i, y_i, sw_i = order.start(i, (x_i, y_i, sw_i))
            total = _loss_parts.counted_or_summed(shards[i].sliced, batch, _replicas.cross_replica_sum)
            part = _loss_parts.replica_part(shares[i], _replicas.valid(), shards[i].sliced, total)
            # Timed, its weights are read after the step's start: the replica's time, not the loop's.
            with tf.GradientTape() as tape, tf.control_dependencies([timing.started()] if timing else []):
                y_pred = self._template(x_i, training=training)
                _split.check_batch_axis(y_pred, x_i)
                with part:
                    loss = keras_private.compute_loss(model, x_i, y_i, y_pred, sw_i, training)
                scaled = model.optimizer.scale_loss(loss) if training and model.optimizer else loss
            gradients = tape.gradient(scaled, trainable) if trainable else []
            if timing:
                timing.end(i, (y_pred, loss, gradients))
            if order is not None:
                order.done(i, gradients)
            return y_pred, loss, gradients

        # Synchronised: the replicas' losses need the whole batch's totals
        # (`loss_parts.py`), and BatchNormalization its statistics.
        results = self._replicas.run(plan, replica, synchronized=True)
        if trainable:
            summed = [self._summed(list(g), v) for g, v in zip(zip(*[r[2] for r in results]), trainable)]
            model.optimizer.apply_gradients(zip(summed, trainable))
        return [(y_pred, loss) for y_pred, loss, _ in results]

    def _summed(self, gradients: list, variable):
        """The replicas' gradients of `variable`, summed on `sum_device(variable)`."""
        with tf.device(self._sum_device(variable)):
            return _split.sum_gradients(gradients)
