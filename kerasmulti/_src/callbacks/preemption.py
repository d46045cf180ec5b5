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
        self.model, self.received, self._installed = model, False, False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # ignored (nohup) or handled by the program: left as it is
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum, frame):
        if not self._fitting(frame):
            self.stop()
            os.kill(os.getpid(), signum)  # as without this handler
            return
        self.received = True

    def _fitting(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is self.model:
                return True
            frame = frame.f_back
        return False

    def stop(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False

    def agreed(self) -> bool:
        """Whether any worker received SIGTERM; the same answer on every worker, after the same step."""
        agree = getattr(self.model, "_any_worker", None)
        return bool(agree(self.received)) if agree is not None else self.received


def leave(model, message: str) -> None:
    """Waits for every worker, says `message` (chief), and exits with `REQUEUE_EXIT_CODE`."""
    wait = getattr(model, "_wait_for_all", None)
    if wait is not None:
        wait()  # the chief's backup is whole before any worker leaves
    if message:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    raise SystemExit(REQUEUE_EXIT_CODE)
