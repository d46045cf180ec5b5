"""Balanced splits and step timing: where a parallel step's time goes.

Synchronous data parallelism runs at the pace of the slowest replica. Each
replica's busy time is measured inside the step, by clock readings: one that
its rows wait for before it starts, one that waits for everything it
returns. The step's own time runs from its batch to the updated weights.
(`tf.timestamp` cannot serve: TensorFlow orders stateful ops in program
order, so replica 1's start would wait for replica 0's end; a stateless
`numpy_function` reading the clock runs once its control dependencies are
met.) The figures add up in variables, so reading them costs nothing per
step (`ThroughputMonitor` reads them once per epoch), and they count the
steps that `steps_per_execution` runs too. Under a `tf.distribute` strategy
(workers) the strategy runs the step once per replica: `ReplicaTiming` has
each replica add its figures to its own row of a table in its process, and
gathers every worker's rows when read.

`split="auto"` starts even, measures each replica's rows per second over
`AutoSplit.WINDOW` steps (after `WARMUP` steps whose first runs compile), and
from then on sizes every sub-batch in proportion to those speeds, so the
replicas finish together. The proportions live in a variable the step reads,
so they change without retracing. A replica that waits for another mid-step
(synchronised BatchNormalization, a loss whose totals need the others'
outputs, a custom step's `optimizer.apply`) books its work up to the
meeting point and starts again once every replica's values are there
(`arrive`, `resume`): its wait is not its work, or every replica would look
as slow as the slowest. Work a replica does while it waits (work that needs
nothing of the others', such as a backward pass after a metric's meeting
point) is not booked either, so such a replica looks faster than it is.
Booking it would compare the clock readings on either side of a wait, which
TensorFlow's executor runs up to a millisecond late: a replica whose next
work is shorter than that would book its whole wait (CHANGELOG).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from numbers import Real

import numpy as np
import tensorflow as tf
from keras import tree

from kerasmulti._src.keras_private import get_keras_mask, set_keras_mask


def resolve(split, devices: list[str]):
    """`parallelize`'s `split` as the model keeps it: None, a tuple of proportions, or "auto"."""
    check_split(split)
    if split is None or isinstance(split, str):
        return None if split in (None, "even") else "auto"
    weights = split.tolist() if isinstance(split, np.ndarray) else list(split)
    if len(weights) != len(devices):
        raise ValueError(
            f"split has {len(weights)} weight(s) but the model runs on {len(devices)} "
            f"device(s) ({', '.join(devices)}). Give one per device. "
            f"Received: split={weights}"
        )
    largest = float(max(weights))  # first: a sum of huge weights would overflow to inf
    total = sum(float(w) / largest for w in weights)
    return tuple(float(w) / largest / total for w in weights)


def check_split(split) -> None:
    """Raises unless `split` is a value `parallelize` takes, whatever the devices: "even", "auto" or positive weights."""
    if split is None or isinstance(split, str) and split in ("even", "auto"):
        return
    weights = split.tolist() if isinstance(split, np.ndarray) and split.ndim == 1 else split
    if isinstance(weights, (list, tuple)) and all(_positive_weight(w) for w in weights):
        return
    raise ValueError(
        f"split must be 'even', 'auto' or a list of one positive weight per device. Received: split={split!r}"
    )


def _positive_weight(w) -> bool:
    try:
        return isinstance(w, Real) and not isinstance(w, bool) and math.isfinite(w) and w > 0
    except OverflowError:  # an int past float's range: math.isfinite cannot convert it
        return False


class StepTiming:
    """Per-device busy time and rows, and step time, added up inside the step.

    A device that runs several replicas (a pipeline's micro-batches) books
    per step the smaller of their summed busy times and the span from the
    first one's start to the last one's end: their union where they run in
    turn (the sum) or overlap (the span).

    Args:
        devices: The replicas' devices, in shard order.
    """

    def __init__(self, devices: list[str]):
        self.devices = list(dict.fromkeys(devices))  # each once, in order
        self._device_of = [self.devices.index(d) for d in devices]
        self.replicas = len(devices)
        with tf.init_scope(), tf.device("/cpu:0"):
            self.busy = tf.Variable(tf.zeros(len(self.devices), tf.float64), trainable=False, name="busy_seconds")
            self.rows = tf.Variable(tf.zeros(len(self.devices), tf.float64), trainable=False, name="rows")
            self.slowest = tf.Variable(tf.zeros((), tf.float64), trainable=False, name="slowest_seconds")
            self.step = tf.Variable(tf.zeros((), tf.float64), trainable=False, name="step_seconds")
            self.steps = tf.Variable(tf.zeros((), tf.int64), trainable=False, name="steps")
        self._starts = {}
        self._step_started = None
        self._durations = {}
        self._spans = {}  # replica: its first start and last end this step
        self._lock = threading.Lock()

    def start(self, replica: int, inputs):
        """`inputs`, made to wait for replica `replica`'s start time."""
        start = self._clock_after((inputs, self._step_started))
        with self._lock:
            self._starts[replica] = start
            first, last = self._spans.get(replica, (None, None))  # a replica may run twice a step (a counting pass)
            self._spans[replica] = (start if first is None else tf.minimum(first, start), last)
        with tf.control_dependencies([start]):
            return tree.map_structure(waiting_copy, inputs)

    def end(self, replica: int, outputs) -> None:
        """Notes replica `replica`'s busy time, once `outputs` are computed."""
        with self._lock:
            start = self._starts.pop(replica)
        ended = self._clock_after((outputs, start))  # outputs made before its last meeting point: no work since
        with self._lock:  # a replica may run twice a step (a counting pass)
            self._durations[replica] = self._durations.get(replica, 0.0) + (ended - start)
            first, last = self._spans[replica]
            self._spans[replica] = (first, ended if last is None else tf.maximum(last, ended))

    def arrive(self, replica: int, value) -> None:
        """Books replica `replica`'s work up to its `value` for a meeting point (`replicas._Rendezvous`)."""
        with self._lock:
            start = self._starts.get(replica)
        if start is None or not _waited_for(value):
            return  # not timed here, or nothing to time: its work runs on to the next reading
        arrived = self._clock_after((value, start))  # a value made before the last meeting point: no work since
        with self._lock:
            self._durations[replica] = self._durations.get(replica, 0.0) + (arrived - start)
            self._starts[replica] = arrived

    def resume(self, replica: int, gathered) -> None:
        """Replica `replica` starts again once `gathered` (every replica's values) exists: its wait is not booked."""
        with self._lock:
            start = self._starts.get(replica)
        if start is not None and _waited_for(gathered):
            resumed = self._clock_after((gathered, start))
            with self._lock:
                self._starts[replica] = resumed

    def started(self):
        """This step's start time (`step_start`'s), for what must run after it."""
        return self._step_started

    def step_start(self, batch):
        """The step's start time, once its batch has arrived; replicas start after it."""
        self._step_started = self._clock_after(batch)
        return self._step_started

    def record(self, shards, step_start, done):
        """Adds this step's figures once `done` (the updated weights) exists.

        A step run on one replica (a batch of one row, or one device) counts
        its whole time as that replica's. Returns the replicas' busy times
        and rows.
        """
        with self._lock:
            durations, self._durations = self._durations, {}
            spans, self._spans = self._spans, {}
            self._step_started = None  # belongs to this trace's graph
        step = self._clock_after(done) - step_start
        zero = tf.zeros((), tf.float64)
        if not durations:
            durations = {0: step}
        busy = tf.stack([durations.get(i, zero) for i in range(self.replicas)])
        sizes = tf.stack([tf.cast(shards[i].counted, tf.float64) if i < len(shards) else zero for i in range(self.replicas)])
        per_device = tf.stack([self._device_busy(k, durations, spans) for k in range(len(self.devices))])
        self.busy.assign_add(per_device)
        self.rows.assign_add(tf.math.unsorted_segment_sum(sizes, self._device_of, len(self.devices)))
        self.slowest.assign_add(tf.reduce_max(per_device))
        self.step.assign_add(step)
        self.steps.assign_add(1)
        return busy, sizes

    def _device_busy(self, device: int, durations: dict, spans: dict):
        """Device `device`'s busy time this step: its replicas' summed, or their span where shorter."""
        ran = [i for i, d in enumerate(self._device_of) if d == device and i in durations]
        if not ran:
            return tf.zeros((), tf.float64)
        summed = tf.add_n([durations[i] for i in ran])
        timed = [spans[i] for i in ran if i in spans and spans[i][1] is not None]
        if len(timed) < 2:
            return summed
        span = tf.reduce_max([last for _, last in timed]) - tf.reduce_min([first for first, _ in timed])
        return tf.minimum(summed, span)

    def _clock_after(self, structure):
        return _clock_after(structure, self.steps)

    def take(self) -> dict:
        """The figures added up since the last `take`, as numpy values; starts again at zero."""
        figures = {name: getattr(self, name).numpy() for name in _FIGURES}
        self.reset()
        return figures

    def reset(self) -> None:
        for name in _FIGURES:
            variable = getattr(self, name)
            variable.assign(tf.zeros_like(variable))


_FIGURES = ("busy", "rows", "slowest", "step", "steps")


class ReplicaTiming:
    """`StepTiming`'s figures for a step that a `tf.distribute` strategy runs per replica.

    Each replica adds its busy time (its batch to its gradients, less its
    waits in the collectives that `timed` wraps), rows and step time (its
    batch to the updated weights) to its row of a table held in this
    process; `take` gathers every worker's rows, a collective that every
    worker must run at the same point. Without a per-step collective,
    the slowest replica's compute time is taken as the largest of the
    replicas' total busy times, and the step time likewise.

    Args:
        devices: Every replica's device, in the strategy's replica order.
        gather: Takes this process's table and returns, for each replica,
            the table as its worker holds it (a leading axis of replicas).
    """

    def __init__(self, devices: list[str], gather):
        self.devices = list(devices)
        self._gather = gather
        with tf.init_scope(), tf.device("/cpu:0"):
            # busy seconds, rows, step seconds, steps; one row per replica.
            self.table = tf.Variable(tf.zeros((len(devices), 4), tf.float64), trainable=False, name="replica_timing")
            # Read, never written, in the step: a clock's distinct input that
            # does not order one replica's readings after another's writes.
            self._generation = tf.Variable(tf.zeros((), tf.float64), trainable=False, name="timing_generation")
        self._replica = threading.local()  # the replica traced on this thread: its booked time, its work's start

    def start(self, data):
        """`data`, made to wait for this replica's start time; and the start time."""
        started = _clock_after(data, self._generation)
        self._replica.booked, self._replica.since = tf.zeros((), tf.float64), started  # this replica's trace
        with tf.control_dependencies([started]):
            return tree.map_structure(waiting_copy, data), started

    def timed(self, all_reduce):
        """A replica context's `all_reduce`: the replica's wait for the others is not its busy time.

        As `StepTiming.arrive` and `resume` in one process: the replica's work
        up to its value is booked, and its work starts again once the sum exists.
        """

        def reduce(reduce_op, value, options=None):
            since = getattr(self._replica, "since", None)
            if since is None or not _waited_for(value):
                return all_reduce(reduce_op, value, options)
            arrived = _clock_after((value, since), self._generation)  # value made before: no work since
            self._replica.booked += arrived - since
            result = all_reduce(reduce_op, value, options)
            self._replica.since = _clock_after((result, arrived), self._generation)
            return result

        return reduce

    def record(self, started, computed, updated, rows) -> None:
        """Adds this replica's step once `computed` (its gradients) and `updated` (the weights) exist."""
        since, booked = self._replica.since, self._replica.booked
        self._replica.since = None
        busy = booked + _clock_after((computed, since), self._generation) - since
        step = _clock_after(updated, self._generation) - started
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        row = tf.stack([busy, tf.cast(rows, tf.float64), step, tf.ones((), tf.float64)])
        self.table.scatter_nd_add(tf.reshape(tf.cast(replica, tf.int32), [1, 1]), row[None])

    def take(self) -> dict:
        """Every worker's figures since the last `take`, as `StepTiming.take` gives them."""
        held = np.asarray(self._gather(self.table.read_value()))
        self.reset()
        table = np.stack([held[i, i] for i in range(len(self.devices))])  # each replica's own row
        busy, rows, step, steps = table.T
        return {"busy": busy, "rows": rows, "slowest": busy.max(), "step": step.max(), "steps": steps.max()}

    def reset(self) -> None:
        self.table.assign(tf.zeros_like(self.table))
        self._generation.assign_add(1.0)


def _waited_for(structure) -> list:
    """The tensors and operations in `structure`, which a clock reading can wait for."""
    flat = tf.nest.flatten(tree.flatten(structure), expand_composites=True)
    return [t for t in flat if tf.is_tensor(t) or isinstance(t, tf.Operation)]


def _clock_after(structure, counter):
    """Seconds on the host's clock, read once every tensor (and operation) in `structure` exists."""
    tensors = _waited_for(structure)
    # A distinct, non-constant input: no reading is folded or merged with another.
    distinct = tf.cast(counter.read_value(), tf.float64) + float(next(_readings))
    with tf.control_dependencies(tensors), tf.device("/cpu:0"):
        now = tf.numpy_function(_now, [distinct], tf.float64, stateful=False)
    now.set_shape(())
    return now


class AutoSplit:
    """`split="auto"`: proportions measured from the replicas' speeds, in a variable.

    Args:
        replicas: How many replicas the steps run.
    """

    WARMUP = 2  # steps not measured: their first runs compile
    WINDOW = 10  # steps measured before the proportions are set

    def __init__(self, replicas: int):
        with tf.init_scope(), tf.device("/cpu:0"):
            self.proportions = tf.Variable(
                tf.fill([replicas], 1.0 / replicas), trainable=False, name="split_proportions"
            )
            self._seen = tf.Variable(tf.zeros((), tf.int64), trainable=False, name="split_steps")
            unmeasured = tf.fill((self.WINDOW, replicas), tf.constant(np.nan, tf.float64))
            self._speeds = tf.Variable(unmeasured, trainable=False, name="split_speeds")
            self._settled = tf.Variable(False, trainable=False, name="split_settled")

    @property
    def settled(self) -> bool:
        """Whether the proportions are set from measured speeds (a speed for every replica)."""
        return bool(self._settled.numpy())

    def observe(self, busy, rows) -> None:
        """Notes one step's replica speeds; once the window holds one for every replica, sets the proportions.

        Each replica's speed is its median over the window's steps, so a step
        that compiled (XLA compiles each new sub-batch shape when it first
        runs) or met a busy moment does not skew it. Until every replica has
        a speed the window goes round again, its oldest steps replaced.
        """
        seen = self._seen.assign_add(1)
        slot = seen - self.WARMUP - 1
        measured = tf.logical_and(slot >= 0, tf.logical_not(self._settled))
        # A replica that ran no rows this step (a 1-row batch), or whose clocks
        # gave no positive time, shows no speed.
        timed = tf.logical_and(rows > 0, busy > 0)
        speeds = tf.where(timed, rows / tf.where(timed, busy, 1.0), tf.constant(np.nan, tf.float64))
        index = tf.math.floormod(tf.maximum(slot, 0), self.WINDOW)
        self._speeds.scatter_update(
            tf.IndexedSlices(tf.where(measured, speeds, self._speeds[index])[None], index[None])
        )
        speed = _median(self._speeds.read_value())
        valid = tf.logical_and(tf.math.is_finite(speed), speed > 0)
        proportions = tf.cast(speed / tf.reduce_sum(speed), tf.float32)
        settle = tf.logical_and(measured, tf.logical_and(slot >= self.WINDOW - 1, tf.reduce_all(valid)))
        self.proportions.assign(tf.where(settle, proportions, self.proportions))
        self._settled.assign(tf.logical_or(self._settled, settle))

    def current(self) -> list[float]:
        return [float(p) for p in np.asarray(self.proportions.numpy())]


def _median(speeds):
    """Each column's median, ignoring NaN (steps where that replica ran no rows)."""
    columns = []
    for k in range(speeds.shape[1]):
        column = tf.boolean_mask(speeds[:, k], tf.math.logical_not(tf.math.is_nan(speeds[:, k])))
        ordered = tf.sort(column)
        count = tf.size(ordered)
        middle = tf.cond(
            count > 0,
            lambda: (ordered[(count - 1) // 2] + ordered[count // 2]) / 2,
            lambda: tf.constant(np.nan, tf.float64),
        )
        columns.append(middle)
    return tf.stack(columns)


_readings = itertools.count()


def waiting_copy(t):
    """`t` through an identity, which the surrounding control dependencies hold back; Keras mask kept."""
    if t is None:
        return None
    copy = tf.identity(t)
    mask = get_keras_mask(t)
    if mask is not None:
        set_keras_mask(copy, mask)
    return copy


def _now(_):
    return np.float64(time.perf_counter())
