"""Per-output loss metrics that record the whole batch's loss once, not once per replica.

Keras' `CompileLoss` keeps one `Mean` per output (`dense_loss`, ...) and
updates it each time it is called. Each replica computes its part of the
batch's loss (`loss_parts.py`); the parts are collected per replica while the
replicas run and their sum is applied once, after the step, as one device would.
Across workers, where the strategy averages every replica's trackers, each
replica records its part divided by its share instead (`recorded_by_share`).
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import replicas as _replicas
from kerasmulti._src.data_parallel import split as _split


class DeferredLossMetrics:
    """The per-output loss values each replica recorded in one step."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._recorded = {id(m): {} for m in metrics}
        self._lock = threading.Lock()

    def record(self, metric, values, replica):
        with self._lock:
            self._recorded[id(metric)][replica] = values

    def of_replica(self, replica) -> dict:
        """What `replica` recorded, by the metric's index (for a compiled replica to return)."""
        return {k: self._recorded[id(m)][replica] for k, m in enumerate(self.metrics) if replica in self._recorded[id(m)]}

    def put(self, replica, recorded: dict) -> None:
        """Replaces what `replica` recorded, e.g. by a compiled replica's outputs."""
        for k, values in recorded.items():
            self.record(self.metrics[int(k)], values, replica)

    def flush(self, batch, shards):
        """Applies the sum of the replicas' parts once, as one device would."""
        for metric in self.metrics:
            values = self._recorded[id(metric)]
            if not values:
                continue
            parts = [tf.cast(values[i], tf.float32) for i in sorted(values)]
            if parts[0].shape.rank:
                # reduction=None: a loss per row, merged like outputs.
                type(metric).update_state(metric, _split.merge(parts, shards))
                continue
            type(metric).update_state(
                metric, tf.add_n(parts), sample_weight=batch if isinstance(batch, int) else None
            )


@contextlib.contextmanager
def deferred_loss_metrics(model):
    """Per-output loss trackers record the batch's loss once, not per replica.

    Keras' `CompileLoss` updates one Mean per output each time it is called;
    called per shard it would average the shards' values unweighted. Inside
    this context the updates are collected per replica (each is the replica's
    part of the batch's loss, see `loss_parts.py`), and the `DeferredLossMetrics`
    it yields applies their sum once (`flush`; per-row values: merged), as
    one device would.
    """
    deferred = DeferredLossMetrics(_trackers(model))

    def recorder(metric):
        def update_state(values, sample_weight=None):
            deferred.record(metric, values, _replicas.replica_id())

        return update_state

    with _recording(deferred.metrics, recorder):
        yield deferred


@contextlib.contextmanager
def recorded_by_share(model, share, rows, replicas: int):
    """Across workers: per-output loss trackers record this replica's part / `share`, weighted as one device's.

    Under a strategy Keras records each value times the replica count,
    weighted by the batch's rows; recorded so instead, their mean across
    the cluster's replicas is the global batch's value.
    """

    def recorder(tracker):
        def update_state(values, sample_weight=None):
            scale = share * replicas  # Keras multiplied by the count
            # Keras weighs a batch by its rows where their number is static, else each batch alike
            # (`sample_weight` None): one device's mean over batches, with this replica's share of it.
            weight = rows if sample_weight is not None else share
            type(tracker).update_state(tracker, tf.math.divide_no_nan(values, scale), sample_weight=weight)

        return update_state

    with _recording(_trackers(model), recorder):
        yield


def _trackers(model) -> list:
    return list(getattr(keras_private.compiled_loss(model), "metrics", None) or [])


@contextlib.contextmanager
def _recording(trackers: list, recorder):
    """Inside: each tracker's `update_state` is `recorder(tracker)`."""
    for tracker in trackers:
        tracker.update_state = recorder(tracker)
    try:
        yield
    finally:
        for tracker in trackers:
            del tracker.update_state
