"""`ThroughputMonitor`: where a parallel model's training time goes, per epoch.

The figures come from the step itself (`balance.StepTiming`, or across
workers `balance.ReplicaTiming`): each replica's busy time and rows, the
slowest replica's time per step, and the step's time from its batch to the
updated weights. The monitor reads them once per epoch, so watching costs
no synchronisation per step (across workers, one gather per epoch).

The headline figures are the wall clock's, as Keras' progress bar shows them:
samples per second are rows over the epoch's training time (the epoch's start
to its last batch's end, validation excluded), and the step time is that time
over the steps. The clocks inside the step split it into the replicas'
compute and the merge and update. The monitor times each call of the step
function (wrapping `model.train_function` for the time of `fit`): the call
around the step is passing the function the model's variables (which bare
Keras' step pays too), its wait for the batch (the input pipeline) and
returning its logs; the rest is Keras' loop between the calls (callbacks,
the progress bar, making an epoch's iterator). On a small, fast model the
last two can be most of the step.
"""

from __future__ import annotations

import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from kerasmulti._src import cluster as _cluster
from kerasmulti._src.utils.arguments import is_positive_finite


class ThroughputMonitor(keras.callbacks.Callback):
    """Measures a parallel model's throughput per epoch, overall and per device.

    Each epoch it records samples per second overall and per replica device,
    the mean step time split into the replicas' compute (the slowest
    replica's) and the rest (merging outputs, summing gradients, the
    update), the imbalance between replicas (slowest busy time over
    fastest), and, given the samples per second of one device, the scaling
    efficiency. It prints one line per epoch (on the chief only in a
    cluster), keeps the figures in `records` (a list of dicts, one per
    epoch, for a notebook to plot), and, with a `keras.callbacks.TensorBoard`
    in the same `fit`, writes them as scalars under its `log_dir`, in
    `throughput/` (TensorBoard must be installed: `pip install tensorboard`).
    Samples per second and the step time are the wall clock's, as in Keras'
    progress bar; the step time is split into the replicas' compute
    (`compute_seconds`), the merge and update (`merge_update_seconds`), the
    call of the step function with its wait for the batch
    (`input_call_seconds`), and Keras' loop between the calls, callbacks
    included (`loop_seconds`). The figures are added
    up inside the step and read once per epoch. The first epoch includes
    tracing and compiling.

    Args:
        baseline: Samples per second of the model on one device, e.g. a
            monitor's figure for `parallelize(model, gpus=1)`; with it the
            records hold `scaling_efficiency`: samples per second over
            `baseline` times the number of devices.
        verbose: 1 prints one line per epoch, 0 is silent.

    Across workers it covers every worker's replicas: pass it to `fit` on
    every worker; each gathers the others' figures at an epoch's end.

    Raises:
        TypeError: At the start of `fit`, if the model is not a model
            returned by `kerasmulti.parallelize`.
        ValueError: At the start of `fit`, if it holds two monitors, or
            across workers if some workers pass none.

    Example:

    ```python
    import keras, kerasmulti, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    parallel = kerasmulti.parallelize(model)
    parallel.compile(optimizer="adam", loss="mse")
    monitor = kerasmulti.ThroughputMonitor()
    parallel.fit(np.ones((64, 8)), np.ones((64, 3)), batch_size=16, epochs=2, callbacks=[monitor], verbose=0)
    print(monitor.records[-1]["samples_per_second"])
    ```
    """

    def __init__(self, baseline: float | None = None, verbose: int = 1):
        super().__init__()
        if baseline is not None and not is_positive_finite(baseline):
            raise ValueError(
                "baseline must be a positive number of samples per second on one device. "
                f"Received: baseline={baseline!r}"
            )
        self.baseline = None if baseline is None else float(baseline)
        if verbose not in (0, 1) or isinstance(verbose, bool):
            raise ValueError(
                f"ThroughputMonitor's verbose must be 1 or 0. Received: verbose={verbose!r}"
            )
        self.verbose = verbose
        self.records: list[dict] = []
        self._log_dir = None  # set by the parallel model's fit when a TensorBoard callback is given
        self._writer = None

    def on_train_begin(self, logs=None):
        timing = getattr(self.model, "_timing", None)
        if timing is None:
            raise TypeError(
                "ThroughputMonitor measures models from kerasmulti.parallelize() (gpus=1 for one device). "
                f"Received: model={type(self.model).__name__}"
            )
        # Keras made the step function just before; its calls are timed until the end of fit.
        step = self.model.train_function
        step = getattr(step, _UNTIMED, step)  # a wrapper an interrupted fit left behind

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._called += time.perf_counter() - started

        setattr(timed, _UNTIMED, step)
        self.model.train_function = timed

    def on_epoch_begin(self, epoch, logs=None):
        self.model._timing.reset()  # the epoch's figures start from zero
        self._first, self._last = time.perf_counter(), None  # as Keras' progress bar
        self._called = 0.0  # in the calls of the step function

    def on_train_batch_end(self, batch, logs=None):
        self._last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        figures = self.model._timing.take()  # across workers, a collective each one runs
        if self._last is None:  # no batch ran (the data ran out)
            return
        record = self._record(epoch, figures, self._last - self._first, self._called)
        self.records.append(record)
        if self.verbose and _cluster.is_chief():
            # On a line of its own, as Keras' ModelCheckpoint prints: the progress bar's last update comes after.
            print(("\n" if (self.params or {}).get("verbose") in (1, "auto") else "") + _line(record))
        if self._log_dir is not None and _cluster.is_chief():
            self._write(record)

    def on_train_end(self, logs=None):
        self.model.train_function = getattr(self.model.train_function, _UNTIMED, self.model.train_function)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _record(self, epoch, figures, seconds, called) -> dict:
        devices = self.model._timing.devices
        steps = max(int(figures["steps"]), 1)
        rows, busy = figures["rows"], figures["busy"]
        slowest, step = max(float(figures["slowest"]), 0.0), max(float(figures["step"]), 0.0)
        used = rows > 0
        record = {
            "epoch": epoch + 1,
            "samples": int(rows.sum()),
            "seconds": seconds,
            "samples_per_second": float(rows.sum() / seconds) if seconds > 0 else float("nan"),
            "step_seconds": seconds / steps,
            # The replicas' clocks run on their own threads: on a busy machine their
            # total can pass the step's by a fraction of a percent; they are part of it.
            "compute_seconds": min(slowest, step) / steps,
            "merge_update_seconds": max(step - slowest, 0.0) / steps,
            "devices": {
                device: {
                    "rows": int(r),
                    "busy_seconds": float(b),
                    # A device that got no rows (batches smaller than the devices): 0, not NaN.
                    "samples_per_second": float(r / b) if b > 0 else 0.0 if r == 0 else float("nan"),
                }
                for device, r, b in zip(devices, rows, busy)
            },
            "imbalance": float(busy[used].max() / busy[used].min()) if used.any() and busy[used].min() > 0 else 1.0,
            "split": self.model.split,
        }
        inside = record["compute_seconds"] + record["merge_update_seconds"]
        outside = max(record["step_seconds"] - inside, 0.0)
        record["input_call_seconds"] = min(max(called / steps - inside, 0.0), outside)
        record["loop_seconds"] = outside - record["input_call_seconds"]
        if self.baseline is not None:
            record["scaling_efficiency"] = record["samples_per_second"] / (self.baseline * len(devices))
        return record

    def _write(self, record) -> None:
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self._log_dir, "throughput"))
        scalars = {
            key: record[key]
            for key in (
                "samples_per_second",
                "step_seconds",
                "compute_seconds",
                "merge_update_seconds",
                "input_call_seconds",
                "loop_seconds",
                "imbalance",
                "scaling_efficiency",
            )
            if key in record
        }
        for device, figures in record["devices"].items():
            scalars[f"samples_per_second/{_tag(device)}"] = figures["samples_per_second"]
        with self._writer.as_default():
            for name, value in scalars.items():
                if np.isfinite(value):
                    tf.summary.scalar(name, value, step=record["epoch"])
        self._writer.flush()


_UNTIMED = "_kerasmulti_untimed"  # on the monitor's wrapper of a step function: the function it wraps


def _tag(device: str) -> str:
    return device.strip("/").replace("device:", "").replace(":", "_")


def _line(record) -> str:
    per_device = ", ".join(
        f"{device} {figures['samples_per_second']:.0f}/s ({figures['rows']} rows)"
        for device, figures in record["devices"].items()
    )
    line = (
        f"Epoch {record['epoch']}: {record['samples_per_second']:.0f} samples/s; step "
        f"{record['step_seconds'] * 1e3:.1f} ms = replicas {record['compute_seconds'] * 1e3:.1f} ms + "
        f"merge/update {record['merge_update_seconds'] * 1e3:.1f} ms + "
        f"input/call {record['input_call_seconds'] * 1e3:.1f} ms + loop {record['loop_seconds'] * 1e3:.1f} ms; "
        f"{per_device}; "
        f"imbalance {record['imbalance']:.2f}x"
    )
    if "scaling_efficiency" in record:
        line += f"; scaling efficiency {record['scaling_efficiency']:.0%}"
    return line


def monitors(callbacks) -> list[ThroughputMonitor]:
    """The `ThroughputMonitor`s among `fit`'s callbacks (a list or a `CallbackList`)."""
    callbacks = getattr(callbacks, "callbacks", callbacks) or []
    return [c for c in callbacks if isinstance(c, ThroughputMonitor)]


def warn_if_given(method: str, callbacks, stacklevel: int) -> None:
    """Warns that a `ThroughputMonitor` given to `evaluate` or `predict` records nothing there.

    (fit's validation passes its own `CallbackList`, monitor included: not warned about.)
    """
    if isinstance(callbacks, (list, tuple)) and monitors(callbacks):
        warnings.warn(
            f"ThroughputMonitor times fit()'s training steps only; in {method}() it records nothing. "
            f"Pass it to fit(). Received: callbacks={[type(c).__name__ for c in callbacks]}",
            stacklevel=stacklevel + 1,
        )


def attach(model, callbacks) -> None:
    """Prepares `model`'s fit for the `ThroughputMonitor`s among `callbacks`.

    Turns on the step's timing (its step is traced again once) and gives each
    monitor the `log_dir` of a `TensorBoard` callback in the same list.
    """
    found = monitors(callbacks)
    if not found:
        return
    callbacks = getattr(callbacks, "callbacks", callbacks)
    if len(found) > 1:
        # Each would reset the figures the other reads.
        raise ValueError(
            "fit() takes one ThroughputMonitor; each resets the same figures. Pass one. "
            f"Received: callbacks={[type(c).__name__ for c in callbacks]}"
        )
    model._time_steps()
    log_dir = next((c.log_dir for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)), None)
    if log_dir is not None and not _tensorboard_installed():
        # tf.summary's scalars come from the tensorboard package, which TensorFlow
        # 2.21 no longer installs: Keras' own callback fails at the first epoch's end.
        warnings.warn(
            "TensorBoard is not installed, so neither keras.callbacks.TensorBoard nor ThroughputMonitor "
            f"can write logs. Install it: pip install tensorboard. Received: log_dir={log_dir!r}",
            stacklevel=3,
        )
        log_dir = None
    found[0]._log_dir = log_dir


def _tensorboard_installed() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
