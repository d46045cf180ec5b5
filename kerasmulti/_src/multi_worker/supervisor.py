"""Supervising worker processes: prefixed output, first failure wins, nothing outlives the launcher.

The launcher starts the workers of one cluster, prefixes every line they
print with `[worker i]`, and ends all of them as soon as one fails, exiting
with that worker's code: a hung cluster does not outlive its first failure,
and stopping the launcher (SIGTERM, SIGHUP) stops its workers. What the
workers it stops print from then on (the tracebacks of their interrupted
training) is held back, one `stopped` line each instead, so that the failing
worker's own traceback and the launcher's line, last, stand out. It sleeps
until a worker ends, waiting on each process's sentinel (a pidfd on Linux)
with `multiprocessing.connection.wait`.

Local ports are chosen free, but another process can bind one before its
worker does; that worker then exits with `EXIT_PORT_TAKEN`, and the cluster
is started again on other ports. With `max_restarts` K, a failed cluster is
started again whole, up to K times, as torchrun does: the script resumes from
its own backup (`ParallelBackupAndRestore`), so no finished epoch is lost. A
stopped launcher (Ctrl-C, SIGTERM) never restarts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import connection
from typing import Callable

from kerasmulti._src.multi_worker.parent_death import ended_with
from kerasmulti._src.multi_worker.tf_config import (
    check_restarts,
    check_workers,
    gpus_per_worker,
    local_hosts,
    physical_gpus,
    worker_environment,
)
from kerasmulti._src.startup import EXIT_PORT_TAKEN, REQUEUE_EXIT_CODE

PORT_ATTEMPTS = 3


def run_workers(
    command: list[str], workers: int, devices_per_worker: int | None = None, out=None, max_restarts: int = 0
) -> int:
    """Runs `command` as `workers` local processes of one cluster; returns the exit code.

    0 when every worker succeeded (after up to `max_restarts` restarts of the
    whole cluster); otherwise the code of the first worker that failed, after
    the others have been stopped.
    """
    check_workers(workers, devices_per_worker)
    check_restarts(max_restarts)
    out = out or sys.stdout
    gpus = gpus_per_worker(workers, devices_per_worker, physical_gpus() if devices_per_worker else 0)

    def start(hosts, index):
        env = {**os.environ, **worker_environment(hosts, index, gpus)}
        process = subprocess.Popen(ended_with(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        return process, process.stdout

    processes, failed = run_cluster(start, workers, out, max_restarts)
    if failed is None:
        return 0
    code = exit_code(processes[failed].returncode)
    out.write(f"kerasmulti launch: {_failure(processes, failed)}; stopped the others. {RESUME_HINT}\n")
    return code


# Said when a job ends early: ParallelBackupAndRestore makes a re-run go on.
RESUME_HINT = "If the script trains with ParallelBackupAndRestore, run the same command to resume from its last backup."


def run_cluster(start: Callable, workers: int, out, max_restarts: int = 0, final: tuple = ()) -> tuple[list, int | None]:
    """Starts `workers` workers on free localhost ports and waits until they end.

    `start(hosts, index)` starts worker `index` of `hosts` and returns the
    process (a `subprocess.Popen`, or an object with its methods and a
    `sentinel`) and the stream of its output. Returns the processes and the
    index of the first that failed, or None. When a worker fails, all start
    again, up to `max_restarts` times, unless its exit code is in `final`
    (a failure that another try would repeat).
    """
    with _stopped_with_this_process():  # also while workers start, and between restarts
        for restart in range(max_restarts + 1):
            processes, failed = _run_on_free_ports(start, workers, out)
            if failed is None and restart:  # last, where a reader of the log looks for how it ended
                out.write(f"kerasmulti launch: all {workers} workers finished, after {restart} restart(s).\n")
            if failed is None or restart == max_restarts or processes[failed].returncode in final:
                return processes, failed
            _say_restart(out, processes, failed, workers, restart, max_restarts)


def _say_restart(out, processes, failed: int, workers: int, restart: int, max_restarts: int) -> None:
    out.write(
        f"kerasmulti launch: {_failure(processes, failed)}; stopped the others. Starting all {workers} "
        f"workers again (restart {restart + 1} of {max_restarts}): they resume from their last backup.\n"
    )
    out.flush()


def _failure(processes, failed: int) -> str:
    """What ended worker `failed`, as the launcher says it."""
    returncode = processes[failed].returncode
    if returncode == REQUEUE_EXIT_CODE:
        return (
            f"SIGTERM stopped the workers after they backed up the step they reached (worker {failed} exited "
            f"with code {REQUEUE_EXIT_CODE}, requeue)"
        )
    cause = f" (killed by {_signal_name(-returncode)})" if returncode < 0 else ""
    # A worker whose script ended early leaves the others waiting for it in a step, which then fails.
    ended = [i for i, p in enumerate(processes) if p.returncode == 0]
    cause += f" (worker {ended[0]} had already exited with code 0)" if ended else ""
    return f"worker {failed} failed with exit code {exit_code(returncode)}{cause}"


def _run_on_free_ports(start: Callable, workers: int, out) -> tuple[list, int | None]:
    """One run of the cluster; when a worker found its port taken, all start again on other ports."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        hosts = local_hosts(workers)
        processes, streams, pumps = [], [], []
        relay = _Relay(out)
        try:
            for index in range(workers):
                process, stream = start(hosts, index)
                processes.append(process)
                streams.append(stream)
                pumps.append(_start_pump(stream, index, relay))
        except BaseException:
            _stop(processes)  # a worker left alone would wait for its peers forever
            raise
        failed = supervise(processes, pumps, relay)
        for stream in streams:
            stream.close()
        if failed is None or processes[failed].returncode != EXIT_PORT_TAKEN or attempt == PORT_ATTEMPTS:
            return processes, failed
        out.write(
            f"kerasmulti launch: another process took worker {failed}'s port ({hosts[failed]}) "
            "before it started; starting the workers again on other ports.\n"
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unknown signal"


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_one(command: list[str], env: dict) -> int:
    """Runs one worker's `command` and returns its exit code; stopping this stops it.

    Stopped by SIGTERM (SLURM's preemption), this process exits with the
    worker's `REQUEUE_EXIT_CODE` once the worker backed up its step and exited with it.
    """
    process = subprocess.Popen(ended_with(command), env=env)
    try:
        with _stopped_with_this_process():
            try:
                returncode = process.wait()
            except SystemExit as stop:  # stopped: the worker backs up its step first
                _stop([process])
                _say_stopped(stop, process.returncode == REQUEUE_EXIT_CODE, "the worker")
                if process.returncode != REQUEUE_EXIT_CODE:
                    raise
                raise SystemExit(REQUEUE_EXIT_CODE) from None
    finally:
        _stop([process])
    if returncode < 0:  # exited as a shell reports it (137 for SIGKILL), not 256 - N
        sys.stderr.write(
            f"kerasmulti launch: the worker was killed by signal {-returncode} ({_signal_name(-returncode)}). "
            f"{RESUME_HINT}\n"
        )
    return exit_code(returncode)


def supervise(processes, pumps, relay) -> int | None:
    """Waits for all processes; on the first failure stops the rest. Returns its index or None.

    When this process is stopped (SIGTERM) its workers get SIGTERM; if all of
    them then back up their step and exit with `REQUEUE_EXIT_CODE`, so does
    this process. What the workers it stops print from then on is held back
    by `relay` (a `_Relay`), which says which were stopped, before the launcher's own line.
    """
    failed, requeue, stopped = None, False, None
    try:
        with _stopped_with_this_process():
            try:
                failed = _first_failure(processes)
            except SystemExit as stop:  # stopped: the workers back up their step first
                stopped = stop
                relay.hold_back(processes)
                _stop(processes)
                requeue = all(p.returncode == REQUEUE_EXIT_CODE for p in processes)
                if requeue:
                    raise SystemExit(REQUEUE_EXIT_CODE) from None
                raise
        if failed is not None:
            relay.hold_back(processes, keep=failed)
    except SystemExit:  # stopped, and its workers with it (above)
        raise
    except BaseException:  # Ctrl-C
        relay.hold_back(processes)
        raise
    finally:
        # A worker that found its port taken: the cluster never formed, no peer trains.
        port_taken = failed is not None and processes[failed].returncode == EXIT_PORT_TAKEN
        _stop(processes, grace=UNFORMED_GRACE_SECONDS if port_taken else STOP_GRACE_SECONDS)
        for pump in pumps:
            pump.join(timeout=5)
        relay.say_stopped()
        if stopped is not None:
            _say_stopped(stopped, requeue, "every worker")
    return failed


def _say_stopped(stop: SystemExit, requeue: bool, workers: str) -> None:
    """The launcher's line once a signal (`_terminated`'s `stop`) stopped it and `workers` ("every worker")."""
    end = (f"{workers} backed up the step it reached. Exiting with code {REQUEUE_EXIT_CODE} (requeue): run the same "
           "command to go on from there." if requeue else f"no worker is left running. {RESUME_HINT}")
    sys.stderr.write(f"kerasmulti launch: {_signal_name(stop.code - 128)} received; {end}\n")


class _Relay:
    """The workers' output, each line prefixed with its worker; held back for the workers the launcher stops."""

    def __init__(self, out):
        self.out, self.lock = out, threading.Lock()
        self.muted, self.running, self.held = set(), set(), {}

    def write(self, index: int, line: str) -> None:
        with self.lock:
            if index in self.muted:
                self.held[index] = self.held.get(index, 0) + 1
                return
            self.out.write(f"[worker {index}] {line}")
            self.out.flush()

    def hold_back(self, processes, keep: int | None = None) -> None:
        """From now on only worker `keep`'s lines are shown (no worker's where None)."""
        with self.lock:
            self.muted = {i for i in range(len(processes)) if i != keep}
            self.running = {i for i in self.muted if processes[i].poll() is None}

    def say_stopped(self) -> None:
        """One line for each worker held back: stopped, or ended with lines not shown."""
        with self.lock:
            for index in sorted(self.running | set(self.held)):
                held = self.held.get(index, 0)
                what = "stopped" if index in self.running else "ended"
                more = f"; {held} line(s) it printed since were not shown" if held else ""
                self.out.write(f"[worker {index}] {what}{more}\n")
            self.out.flush()


def _first_failure(processes) -> int | None:
    with _sentinels(processes) as sentinels:
        running = dict(zip(sentinels, range(len(processes))))
        while running:
            for ready in sorted(connection.wait(list(running)), key=running.get):
                index = running.pop(ready)
                if processes[index].wait() != 0:
                    return index
    return None


@contextlib.contextmanager
def _sentinels(processes):
    """Inside: a file descriptor per process that becomes readable when it ends."""
    opened = []
    try:
        yield [_sentinel(process, opened) for process in processes]
    finally:
        for descriptor in opened:
            os.close(descriptor)


def _sentinel(process, opened: list) -> int:
    if hasattr(process, "sentinel"):  # a multiprocessing.Process has one
        return process.sentinel
    try:
        descriptor = os.pidfd_open(process.pid)  # Linux 5.3 and later
    except (AttributeError, OSError):
        descriptor = _closed_at_exit(process)
    opened.append(descriptor)
    return descriptor


def _closed_at_exit(process) -> int:
    """Where there are no pidfds: a pipe that a thread waiting for `process` closes."""
    read, write = os.pipe()

    def wait():
        process.wait()
        os.close(write)

    threading.Thread(target=wait, daemon=True).start()
    return read


# How long stopped workers get after SIGTERM before SIGKILL: a worker
# training with ParallelBackupAndRestore ends its step and backs it up.
STOP_GRACE_SECONDS = 30
# ... and before the cluster formed, where a worker waits for its peers inside
# TensorFlow, out of reach of SIGTERM, with nothing to back up.
UNFORMED_GRACE_SECONDS = 2


def _stop(processes, grace: float | None = None) -> None:
    """Stops `processes` (SIGTERM, then SIGKILL after `grace` seconds); a SIGTERM or SIGHUP meanwhile is ignored.

    Stopping already, this process must not die of a second signal (`timeout`
    sends one to it and one to its group) before its workers have backed up.
    """
    if all(p.poll() is not None for p in processes):
        return
    main = threading.current_thread() is threading.main_thread()  # where Python handles signals
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS} if main else {}
    try:
        _stop_now(processes, grace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop_now(processes, grace: float | None) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    try:
        for p in processes:
            try:
                p.wait(timeout=STOP_GRACE_SECONDS if grace is None else grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    except BaseException:  # a second Ctrl-C while waiting: none is left running
        for p in processes:
            if p.poll() is None:
                p.kill()
        raise


def _pump(stream, index: int, relay: _Relay) -> None:
    for line in iter(stream.readline, ""):
        relay.write(index, line)


def _start_pump(stream, index: int, relay: _Relay) -> threading.Thread:
    pump = threading.Thread(target=_pump, args=(stream, index, relay), daemon=True)
    pump.start()
    return pump


def _default(handler) -> bool:
    return handler is signal.SIG_DFL or getattr(handler, "acts_as_default", False)


def _terminated(signum, frame):
    if _stopping[0]:
        return  # a second signal (`timeout` sends one to this process and one to its group): stopping already
    _stopping[0] = True
    raise SystemExit(128 + signum)  # runs the `finally` that stops the workers


_stopping = [False]  # whether `_terminated` ran inside the current `_stopped_with_this_process`
_STOP_SIGNALS = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


@contextlib.contextmanager
def _stopped_with_this_process():
    """Inside: SIGTERM and SIGHUP end this process through Python, so its workers are stopped too.

    By default they end it at once, leaving the workers running, each
    waiting for its peers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Only where the signal would end this process: an ignored one (nohup)
    # or one the program handles stays as it is.
    # (A ParallelBackupAndRestore's handler left by a fit that raised acts as the default.)
    previous = {s: signal.signal(s, _terminated) for s in _STOP_SIGNALS if _default(signal.getsignal(s))}
    if previous:  # the outermost: a nested one (`run_cluster`'s `supervise`) leaves the flag to it
        _stopping[0] = False
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if previous:
            _stopping[0] = False
