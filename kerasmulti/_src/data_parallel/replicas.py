"""Running one function per replica device, on threads that can meet.

Replicas are traced under their own `tf.device` scopes; TensorFlow's executor
then runs the independent replica graphs concurrently. Forward passes (predict)
are traced one after another on the calling thread. Training and evaluation
steps need values of the whole batch while a replica is being traced: the batch's totals that
its loss divides by (`loss_parts`), and the statistics of every
BatchNormalization layer, which must normalise with the *whole* batch, as one
device would. Such steps trace each replica on its own thread (as
`tf.distribute.MirroredStrategy` does, one thread tracing at a time), and the
threads meet where they need each other's values (`cross_replica_sum`).

Synchronised BatchNormalization (`sync_batchnorm.py`) and the per-replica
loss lists (`replica_losses.py`) are built on these meetings.

While replicas are traced, Keras' TensorFlow `conv` reads its kernel before
its XLA path (grouped convolutions: ConvNeXt), which XLA would refuse to read
from another device (`kernels_read_on_the_replica`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable

import tensorflow as tf

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


class _Turn:
    """The right to trace, passed from replica to replica in their order: 0, 1, ..., n - 1, 0, ...

    The order in which the replicas make their operations is then the same in
    every process: stateful operations on one variable (a Dropout's seed,
    drawn by each replica) run in the order they were made, so each replica
    draws the same numbers on a re-run, as a resumed run must.
    """

    def __init__(self, n: int):
        self._n, self._next, self._broken = n, 0, False
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def of(self, i: int):
        self.take(i)
        try:
            yield
        finally:
            self.give()

    def take(self, i: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._next == i or self._broken, RENDEZVOUS_TIMEOUT_S):
                raise threading.BrokenBarrierError
            if self._broken:
                raise threading.BrokenBarrierError

    def give(self) -> None:
        with self._changed:
            self._next = (self._next + 1) % self._n
            self._changed.notify_all()

    def abort(self) -> None:
        with self._changed:
            self._broken = True
            self._changed.notify_all()


class _Rendezvous:
    """Lets n replica threads swap one value each, as often as they need.

    Building a graph is not thread-safe (name scopes, captures, op
    registration), so, as in MirroredStrategy, only one replica thread runs at
    a time: it holds the `turn` while it traces and hands it to the next
    replica only while it waits for the others at `all_gather`.
    """

    def __init__(self, n: int):
        self._slots = [None] * n
        self._barrier = threading.Barrier(n, timeout=RENDEZVOUS_TIMEOUT_S)
        self.turn = _Turn(n)

    def all_gather(self, value, where: str, merged=None):
        """Every replica's `value`; all must call it at the same point, `where`.

        `merged`: what this replica did for all since the last meeting point
        (replica 0's optimizer update), which the others wait for. A timed
        replica (`set_timing`) books its work up to `value`, and starts again
        once every value and `merged` exist: its wait is not its work.
        """
        timing = getattr(_local, "timing", None)
        if timing is not None:
            timing.arrive(replica_id(), value)
        self._slots[replica_id()] = (where, value, merged)
        self._wait()
        gathered = list(self._slots)
        self._wait()  # nobody overwrites a slot before all have read
        if timing is not None:
            timing.resume(replica_id(), [(value, merged) for _, value, merged in gathered])
        places = [place for place, _, _ in gathered]
        if len(set(places)) > 1:
            # E.g. a squeeze() that also drops the batch axis of a 1-row
            # sub-batch sends one replica down another path.
            raise RuntimeError(
                "The replicas took different paths through the model. Make it compute the same for every "
                f"batch size, or use one device. Received: meeting points={places}"
            )
        return [value for _, value, _ in gathered]

    def _wait(self):
        self.turn.give()
        try:
            self._barrier.wait()
        finally:
            self.turn.take(replica_id())

    def abort(self):
        self._barrier.abort()
        self.turn.abort()


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
        _local.replica, _local.sync, _local.gradient_share, _local.timing = 0, None, 1.0, None


class _KernelsReadOnTheReplica:
    """Keras' TensorFlow `conv`, reading a variable kernel before it calls the original.

    Installed while any replicas are traced (counted, as replicas nest and
    run on threads), and Keras' own function put back after the last.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._original = None

    def _conv(self, inputs, kernel, *args, **kwargs):
        return self._original(inputs, tf.convert_to_tensor(kernel), *args, **kwargs)

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._users == 0:
                self._original = keras_private.tensorflow_nn.conv
                keras_private.tensorflow_nn.conv = self._conv
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    keras_private.tensorflow_nn.conv = self._original


kernels_read_on_the_replica = _KernelsReadOnTheReplica()


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
    with kernels_read_on_the_replica(), _warnings_once():
        return _run(devices, fn, synchronized, variables)


@contextlib.contextmanager
def _warnings_once():
    """Inside: a warning every replica gives (Keras' about an input's structure) is shown once.

    Keras' messages name the replica's tensors, so Python's own once-per-place
    rule would show one per replica. Warnings are recorded while the
    replicas run and shown afterwards, each first line once, where it was given.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # recorded here; the user's filters apply when shown
        try:
            yield
        finally:
            given = list(caught)
    shown = set()
    for warning in given:
        key = (warning.category, str(warning.message).split("\n", 1)[0])
        if key not in shown:
            shown.add(key)
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _run(devices: list[str], fn: Callable, synchronized: bool, variables) -> list:
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
            with rendezvous.turn.of(i), scope:
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
            "A replica did not reach the point where the others waited for it while tracing the step. "
            f"Retry on an idle machine, or report it. Received: timeout={RENDEZVOUS_TIMEOUT_S} s"
        )
    return results


def seed_of_replica(seed, replica):
    """A seed generator's state (or a seed drawn from it) for replica `replica`: its index added to the seed.

    The replicas share one generator's state; from it, each draws a stream of its own.
    """
    return seed + tf.cast(tf.stack([replica, 0]), seed.dtype)


def cross_replica_sum(value, by_rows=False):
    """`value` summed over the replicas of a synchronised run (not differentiated).

    `by_rows` (whether the value is proportional to the rows) is `loss_parts`'
    hint for compiled replicas, which sum without meeting; here every sum meets.
    """
    rendezvous = getattr(_local, "sync", None)
    if rendezvous is None:
        return value
    return tf.add_n(rendezvous.all_gather(tf.stop_gradient(value), "a loss total"))


def rendezvous():
    """The meeting place of the synchronised run this thread traces a replica of; None outside one."""
    return getattr(_local, "sync", None)


def set_timing(timing) -> None:
    """Has this replica book its waits at meeting points apart from its work (`balance.StepTiming`)."""
    _local.timing = timing


def timed() -> bool:
    """Whether this replica's meeting points are timed (`set_timing`)."""
    return getattr(_local, "timing", None) is not None


def valid():
    """1 if this replica's rows count, 0 if it computes on a borrowed row."""
    return getattr(_local, "valid", 1.0)


def set_valid(size) -> None:
    """Records whether this replica's rows count (1) or are borrowed (0)."""
    _local.valid = tf.cast(size > 0, tf.float32) if not isinstance(size, int) else float(size > 0)


def gradient_share():
    """What this replica's gradients are multiplied by before they are summed: 1, or (a custom step) its share."""
    return getattr(_local, "gradient_share", 1.0)


def set_gradient_share(share) -> None:
    """Records that this replica's gradients will be multiplied by `share` (a custom step's merge)."""
    _local.gradient_share = share
