"""SIGTERM during `fit`: back up at the current step, then exit so the job is requeued.

A preemptible machine (a spot instance, a SLURM job with `--requeue`, a
Kubernetes pod) gets SIGTERM and, some seconds later, SIGKILL. While a
`ParallelBackupAndRestore` trains, SIGTERM only raises a flag; at the end
of the step in flight the callback writes a backup at that step and the
process exits with `REQUEUE_EXIT_CODE` (42, TensorFlow's own
`PreemptionCheckpointHandler` code), which `kerasmulti launch` and a SLURM
recipe read as "run again": the run resumes at the next step.

Across workers every worker must stop after the same step: one worker's
flag reaches all through a one-number all-reduce after each step
(`agree`), so all back up the same step, and leave together.

The handler is installed only where SIGTERM would end the process (its
default disposition) and only in the main thread. Once `fit` has ended (also
by an exception, when Keras calls no `on_train_end`) a SIGTERM ends the
process as it would without kerasmulti.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from kerasmulti._src.startup import REQUEUE_EXIT_CODE


class Watch:
    """Raises a flag on SIGTERM while `model.fit` runs; `stop()` puts the default back."""

    def __init__(self, model):
        global _watching
        self.model, self.received, self._installed = model, False, False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _dispatch):
            return  # ignored (nohup) or handled by the program: left as it is
        _watching = self
        signal.signal(signal.SIGTERM, _dispatch)
        self._installed = True

    def _fitting(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is self.model:
                return True
            frame = frame.f_back
        return False

    def stop(self) -> None:
        global _watching
        if self._installed and signal.getsignal(signal.SIGTERM) is _dispatch:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._installed = False
        if _watching is self:
            _watching = None

    def agreed(self) -> bool:
        """Whether any worker received SIGTERM; the same answer on every worker, after the same step."""
        agree = getattr(self.model, "_any_worker", None)
        return bool(agree(self.received)) if agree is not None else self.received


_watching: Watch | None = None


def _dispatch(signum, frame):
    """The SIGTERM handler: a flag while the watched `fit` runs; else SIGTERM's default.

    Keras calls no `on_train_end` when `fit` raises, so the handler can
    outlive its `fit`: it then ends the process as SIG_DFL would. The
    launcher takes it for the default (`acts_as_default`).
    """
    watch = _watching
    if watch is not None and watch._fitting(frame):
        watch.received = True
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_dispatch.acts_as_default = True


def leave(model, message: str) -> None:
    """Waits for every worker, says `message` (chief), and exits with `REQUEUE_EXIT_CODE`."""
    wait = getattr(model, "_wait_for_all", None)
    if wait is not None:
        wait()  # the chief's backup is whole before any worker leaves
    if message:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    raise SystemExit(REQUEUE_EXIT_CODE)
