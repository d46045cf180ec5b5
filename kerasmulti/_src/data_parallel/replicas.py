"""Running one function per replica device, and synchronised BatchNormalization.

Replicas are traced under their own `tf.device` scopes; TensorFlow's executor
then runs the independent replica graphs concurrently. Forward passes (predict)
are traced one after another on the calling thread. Training and evaluation
steps need values of the whole batch while a replica is being traced: the batch's totals that
its loss divides by (`_losses`), and the statistics of every
BatchNormalization layer, which must normalise with the *whole* batch, as one
device would. Such steps trace each replica on its own thread (as
`tf.distribute.MirroredStrategy` does, one thread tracing at a time), and the
threads meet where they need each other's values (`cross_replica_sum`).

At every BatchNormalization call the replicas sum per channel their row counts
and sums (for the mean), then their squared deviations from it (for the
variance), exactly as one device would compute them. The sums are
differentiable all-reduces, so gradients flowing through the statistics reach
every replica. Only replica 0 updates the moving statistics, once per step.
The cost is two small all-reduces per BatchNormalization layer forward and two
backward per step, and a synchronisation point at each: replicas wait for the
slowest one. While replicas take turns mid-forward, the losses layers add in
`call` (activity regularisers) are kept per replica thread, so each replica's
loss counts its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import keras
import tensorflow as tf
from keras import layers, ops
from kerasmulti._src import keras_private

_local = threading.local()

# Generous: tracing a large model on a busy machine can take minutes, but a
# replica that never arrives must end in an error, not a hang.
RENDEZVOUS_TIMEOUT_S = 600


def replica_id() -> int:
    """The replica being traced on this thread (0 outside replicas)."""
    return getattr(_local, "replica", 0)


@contextlib.contextmanager
def as_replica(i: int):
    """Inside: `replica_id()` is `i` on this thread (a compiled replica's trace)."""
    _local.replica = i
    try:
        yield
    finally:
        _local.replica = 0


class _Rendezvous:
    """Lets n replica threads swap one value each, as often as they need.

    Building a graph is not thread-safe (name scopes, captures, op
    registration), so, as in MirroredStrategy, only one replica thread runs at
    a time: it holds `turn` while it traces and hands it over only while it
    waits for the others at `all_gather`.
    """

    def __init__(self, n: int):
        self._slots = [None] * n
        self._barrier = threading.Barrier(n, timeout=RENDEZVOUS_TIMEOUT_S)
        self.turn = threading.Lock()

    def all_gather(self, value, where: str):
        """Every replica's `value`; all must call it at the same point, `where`."""
        self._slots[replica_id()] = (where, value)
        self._wait()
        gathered = list(self._slots)
        self._wait()  # nobody overwrites a slot before all have read
        places = [place for place, _ in gathered]
        if len(set(places)) > 1:
            # E.g. a squeeze() that also drops the batch axis of a 1-row
            # sub-batch sends one replica down another path.
            raise RuntimeError(
                "The replicas took different paths through the model for their "
                "sub-batches, so they cannot share BatchNormalization statistics or loss "
                "totals. Make the computation the same for every batch size, or use one "
                f"device. Received: meeting points={places}"
            )
        return [value for _, value in gathered]

    def _wait(self):
        self.turn.release()
        try:
            self._barrier.wait()
        finally:
            self.turn.acquire()

    def abort(self):
        self._barrier.abort()


def _run_one(i: int, device: str, fn: Callable, sync):
    _local.replica, _local.sync = i, sync
    try:
        with tf.device(device), tf.name_scope(f"replica_{i}"):
            result = fn(i)
        if sync is not None:
            # A replica that skipped a meeting point is caught here, not after a timeout.
            sync.all_gather(None, "the end of its step")
        return result
    finally:
        _local.replica, _local.sync = 0, None


def run(
    devices: list[str], fn: Callable, synchronized: bool = False, variables=()
) -> list:
    """Calls `fn(i)` under `tf.device(devices[i])` for every replica i.

    With `synchronized=True` the replicas are traced on parallel threads that
    can meet in `_Rendezvous.all_gather` (BatchNormalization statistics, the
    batch's loss totals), and must meet at the same points. The
    `variables` they read are captured into the graph beforehand: a function
    graph's capture bookkeeping is not thread-safe, and two threads capturing
    one variable at once leave an unfed placeholder behind.
    """
    if not synchronized or len(devices) == 1:
        return [_run_one(i, d, fn, None) for i, d in enumerate(devices)]
    rendezvous = _Rendezvous(len(devices))
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if graph is not None and hasattr(graph, "capture"):
        for variable in variables:
            graph.capture(variable.value.handle)
    results, errors = [None] * len(devices), [None] * len(devices)

    def target(i):
        try:
            scope = graph.as_default() if graph is not None else contextlib.nullcontext()
            with rendezvous.turn, scope:
                results[i] = _run_one(i, devices[i], fn, rendezvous)
        except BaseException as error:  # re-raised on the calling thread
            errors[i] = error
            rendezvous.abort()

    threads = [
        threading.Thread(target=target, args=(i,), name=f"kerasmulti-replica-{i}")
        for i in range(len(devices))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failures = [e for e in errors if e is not None]
    if failures:
        # A BrokenBarrierError only says that another replica failed first.
        cause = next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), None)
        if cause is not None:
            raise cause
        # Tracing a very large model on a busy machine can take that long.
        raise RuntimeError(
            "A replica did not reach the point where the others waited for it while "
            "the step was traced. If the model is very large, retry on an idle machine; "
            f"otherwise please report it with the model. Received: timeout={RENDEZVOUS_TIMEOUT_S} s"
        )
    return results


def batchnorm_layers(model) -> list:
    return [
        layer
        for layer in keras_private.flatten_layers(model, include_self=False)
        if isinstance(layer, layers.BatchNormalization)
    ]


def _synchronized_call(layer, original):
    """A BatchNormalization `call` that normalises with whole-batch statistics."""

    def call(inputs, training=None, mask=None):
        rendezvous = getattr(_local, "sync", None)
        if rendezvous is None or not (training and layer.trainable):
            return original(inputs, training=training, mask=mask)
        x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        axes = [a for a in range(len(x.shape)) if a != layer.axis % len(x.shape)]  # all but the features
        valid = ops.cast(_local.valid, x.dtype)
        # As Keras' _moments: masked elements are left out (`where`, so that
        # whatever they hold cannot reach the sums), and a masked count gets
        # epsilon, so a wholly masked batch gives zeros, not NaN.
        if mask is None:
            kept, epsilon = None, 0.0
        else:
            kept = ops.cast(ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(x)), "bool")
            epsilon = keras.backend.epsilon()

        def masked(values):
            return values if kept is None else ops.where(kept, values, 0)

        w = masked(ops.ones_like(x))
        totals = _all_reduce_sum(
            rendezvous,
            ops.stack([ops.stop_gradient(ops.sum(w, axes)), ops.sum(masked(x), axes)]) * valid,
        )
        count = totals[0] + epsilon
        global_mean = totals[1] / count
        deviations = ops.sum(masked(ops.square(x - _expand(global_mean, x, axes))), axes)
        variance = _all_reduce_sum(rendezvous, deviations * valid) / count
        if replica_id() == 0:
            momentum = layer.momentum
            layer.moving_mean.assign(
                ops.cast(layer.moving_mean, x.dtype) * momentum
                + global_mean * (1.0 - momentum)
            )
            layer.moving_variance.assign(
                ops.cast(layer.moving_variance, x.dtype) * momentum
                + variance * (1.0 - momentum)
            )
        outputs = ops.batch_normalization(
            x=x,
            mean=global_mean,
            variance=variance,
            axis=layer.axis,
            offset=ops.cast(layer.beta, x.dtype) if layer.center else None,
            scale=ops.cast(layer.gamma, x.dtype) if layer.scale else None,
            epsilon=layer.epsilon,
        )
        return ops.cast(outputs, layer.compute_dtype)

    return call


def _all_reduce_sum(rendezvous, value):
    """Sum over replicas, differentiable: its gradient is the sum of upstreams.

    Replica j's loss depends on replica i's activations through the shared
    statistics; summing the upstream gradients carries those cross terms back
    to every replica, as `tf.distribute`'s all-reduce does.
    """

    @tf.custom_gradient
    def reduce(local):
        def grad(upstream):
            return tf.add_n(rendezvous.all_gather(upstream, "a BatchNormalization gradient"))

        return tf.add_n(rendezvous.all_gather(local, "BatchNormalization statistics")), grad

    return reduce(value)


def _expand(stat, x, axes):
    for axis in sorted(a % len(x.shape) for a in axes):
        stat = ops.expand_dims(stat, axis)
    return stat


class _PerReplicaLosses:
    """A layer's `_losses` list, one per replica thread.

    Keras keeps the losses a layer adds in `call` (activity regularisers,
    `add_loss`) on the layer, and each top-level call clears them. Replicas
    traced on threads take turns mid-forward (at every BatchNormalization),
    so with one shared list a replica would clear or count another's losses.
    """

    def __init__(self):
        self._lists: dict[int, list] = {}

    def _mine(self) -> list:
        return self._lists.setdefault(replica_id(), [])

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
def synchronized(model, bn_layers: list):
    """Sets up `run(..., synchronized=True)` for `model`'s replicas.

    `bn_layers` use whole-batch statistics, and every layer keeps the losses
    it adds per replica. (The lists bypass Keras' attribute tracking.)
    """
    layers = keras_private.flatten_layers(model)
    saved = [keras_private.swap_added_losses(layer, _PerReplicaLosses()) for layer in layers]
    for layer in bn_layers:
        layer.call = _synchronized_call(layer, type(layer).call.__get__(layer))
    try:
        yield
    finally:
        for layer in bn_layers:
            del layer.call
        for layer, losses in zip(layers, saved):
            # The replicas' losses, in replica order, as a plain call leaves them.
            losses.extend(keras_private.swap_added_losses(layer, losses).all())


def cross_replica_sum(value, by_rows=False):
    """`value` summed over the replicas of a synchronised run (not differentiated).

    `by_rows` (whether the value is proportional to the rows) is `_losses`'
    hint for compiled replicas, which sum without meeting; here every sum meets.
    """
    rendezvous = getattr(_local, "sync", None)
    if rendezvous is None:
        return value
    return tf.add_n(rendezvous.all_gather(tf.stop_gradient(value), "a loss total"))


def valid():
    """1 if this replica's rows count, 0 if it computes on a borrowed row."""
    return getattr(_local, "valid", 1.0)


def set_valid(size) -> None:
    """Records whether this replica's rows count (1) or are borrowed (0)."""
    _local.valid = tf.cast(size > 0, tf.float32) if not isinstance(size, int) else float(size > 0)
