"""`launch(function, workers=N)`: multi-worker training from a notebook.

In the manner of accelerate's `notebook_launcher`, `launch` forks N workers
that each join one local cluster and call the function, prints their output
prefixed `[worker i]` (`supervisor`), and returns what each returned.
Forking copies the notebook's process, so TensorFlow must not have run
anything in it yet (a cluster can only be joined before TensorFlow's first
op); `launch` refuses, saying so, when it has.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

from kerasmulti._src.multi_worker import parent_death
from kerasmulti._src.multi_worker.supervisor import run_cluster
from kerasmulti._src.multi_worker.tf_config import (
    LaunchError,
    check_restarts,
    check_workers,
    gpus_per_worker,
    physical_gpus,
    worker_environment,
)
from kerasmulti._src.startup import REQUEUE_EXIT_CODE

# A worker's exit code when its function returned a value that cannot be
# pickled (not retried). An uncommon one, since a function's own
# sys.exit(code) ends its worker with that code too; the worker also sends
# an `_Unsendable`, which tells the two apart.
UNSENDABLE = 65


def launch(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    workers: int = 2,
    devices_per_worker: int | None = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Runs `function(*args)` as `workers` processes of one local cluster, from a notebook.

    The notebook counterpart of `kerasmulti launch`, in the manner of
    accelerate's `notebook_launcher`. Each worker is a fork of this process
    with `TF_CONFIG` set and the cluster joined, so inside `function`,
    `kerasmulti.parallelize(model)` trains across all workers. Their output is
    printed here, each line prefixed with `[worker i]`. When one worker fails
    the others are stopped and an error is raised.

    Multi-worker training must be set up before TensorFlow's first op, and
    the workers are copies of this process, so call `launch` before anything
    runs TensorFlow here: build models inside `function`, not in the notebook.
    Imports are fine.

    A `sys.exit(code)` in `function` ends its worker as it ends a script:
    `sys.exit()` or `sys.exit(0)` is a success whose return value is None;
    another int is a failure with that exit code, and anything else (a
    message) is printed and is a failure with exit code 1.

    Args:
        function: What each worker runs. Its return value (which must be
            picklable, e.g. `history.history`) is sent back.
        args: Positional arguments for `function`.
        workers: How many worker processes.
        devices_per_worker: GPUs per worker (worker i sees GPUs i*K to
            i*K+K-1), or None for all of them. Without GPUs each worker is
            one replica on its CPU: more than 1 is refused.
        max_restarts: When a worker fails, stop the others and start all
            workers again, up to this many times (`function` resumes from
            its `ParallelBackupAndRestore` backup). A return value that
            cannot be pickled is not retried.

    Returns:
        The list of the workers' return values, worker 0 first.

    Raises:
        LaunchError: A `ValueError` if `function` is not callable, `args`
            not a tuple or list, `workers` or `devices_per_worker` not a
            positive int, `max_restarts` not an int of 0 or more, or more
            GPUs are asked for than this machine has.
        ClusterError: A `RuntimeError` if TensorFlow already ran in this process, or a worker
            failed (its traceback is printed above the error; the error ends
            with its exit code, e.g. `Received: exitcode=3` for `sys.exit(3)`),
            or SIGTERM stopped the workers after a `ParallelBackupAndRestore`
            backed up their step (`Received: exitcode=42`: call it again).

    Example:

    ```python
    import kerasmulti

    def train():
        import keras, numpy as np
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        parallel = kerasmulti.parallelize(model)  # across both workers
        parallel.compile(optimizer="sgd", loss="mse")
        return parallel.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16, verbose=0).history

    histories = kerasmulti.launch(train, workers=2)
    ```
    """
    if not callable(function):
        raise LaunchError(
            f"launch() needs the function each worker runs, not its result. Received: function={function!r}"
        )
    if not isinstance(args, (tuple, list)):
        raise LaunchError(
            "launch()'s args must be a tuple or list, e.g. args=(x,); the number of workers goes "
            f"in workers=. Received: args={args!r}"
        )
    check_workers(workers, devices_per_worker)
    check_restarts(max_restarts)
    if _tensorflow_started():
        # Workers are forks of this process, and a process can join a
        # cluster only before TensorFlow's first op.
        raise _cluster_error(
            "launch() cannot start workers: TensorFlow already ran here. Restart the kernel, call "
            "launch() first and build models in the function. "
            "Received: TensorFlow initialised=True"
        )
    gpus = gpus_per_worker(workers, devices_per_worker, physical_gpus(fork_safe=True) if devices_per_worker else 0)
    context = multiprocessing.get_context("fork")
    receivers = {}

    def start(hosts, index):
        read_fd, write_fd = os.pipe()
        receiver, sender = context.Pipe(duplex=False)
        arguments = (function, tuple(args), index, hosts, gpus, write_fd, sender, os.getpid())
        process = context.Process(target=_run_forked, args=arguments)
        process.start()
        os.close(write_fd)
        sender.close()
        receivers[index] = _receive(receiver)
        return _Forked(process), os.fdopen(read_fd, "r", errors="replace")

    processes, failed = run_cluster(start, workers, sys.stdout, max_restarts, final=(UNSENDABLE,))
    if failed is not None:
        sent = _received(receivers[failed])
        if isinstance(sent, _Unsendable):
            raise _cluster_error(
                f"Worker {failed} finished, but its return value cannot be pickled to send it back (reason "
                f"above). Return plain data, e.g. history.history, not a model. Received: type={sent.type_name}"
            )
        if processes[failed].returncode == REQUEUE_EXIT_CODE:
            raise _cluster_error(
                "SIGTERM stopped the workers after they backed up the step they reached. Call launch() "
                f"again to go on from there. Received: exitcode={REQUEUE_EXIT_CODE}"
            )
        raise _cluster_error(
            f"Worker {failed} of {workers} failed (output above, as [worker {failed}]); the others were stopped. "
            f"Received: exitcode={processes[failed].returncode}"
        )
    for index in range(workers):
        receiver = receivers[index]
        receiver.join()
        if receiver.error is not None:
            raise _cluster_error(
                f"Worker {index} finished, but its return value cannot be unpickled here "
                f"({type(receiver.error).__name__}: {receiver.error}). Return plain data, e.g. "
                f"history.history. Received: error={type(receiver.error).__name__}"
            )
    return [receivers[index].value for index in range(workers)]


def _cluster_error(message: str) -> Exception:
    # Imported here: cluster.py loads TensorFlow, which the launcher's process must not (its workers are forks).
    from kerasmulti._src.cluster import ClusterError

    return ClusterError(message)


class _Unsendable:
    """What a worker sends instead of a return value that cannot be pickled."""

    def __init__(self, type_name: str):
        self.type_name = type_name


def _received(receiver: threading.Thread):
    """What a worker that has ended sent: its value, an `_Unsendable`, or None."""
    receiver.join()
    return receiver.value


class _Forked:
    """A forked `multiprocessing.Process` with the `subprocess.Popen` methods `supervisor` uses."""

    def __init__(self, process):
        self._process = process

    def poll(self):
        return self._process.exitcode

    @property
    def returncode(self):
        return self._process.exitcode

    def terminate(self):
        self._process.terminate()

    def kill(self):
        self._process.kill()

    @property
    def sentinel(self):
        return self._process.sentinel

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("worker", timeout)
        return self._process.exitcode


def _tensorflow_started() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    from kerasmulti._src import keras_private

    # Finding a GPU starts its driver, which a forked process cannot use.
    return keras_private.tensorflow_started()


def _run_forked(function, args, index, hosts, gpus, output_fd, results, parent: int) -> None:
    # The launcher's handlers (which stop its workers) are not the worker's: with SIGTERM's
    # default, a ParallelBackupAndRestore backs up the step and exits 42, as in a script.
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    parent_death.ask_for_sigterm(parent)  # a killed notebook kernel leaves no worker training
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    for name in (None, "tensorflow"):  # log handlers made before the fork hold the old streams
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
    # In a notebook TensorFlow's logger shows INFO (it does so in interactive
    # sessions), and the strategy logs every all-reduce it builds: workers
    # show warnings and errors, as a script does.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    os.environ.update(worker_environment(hosts, index, gpus))
    from kerasmulti._src import cluster as _cluster

    _cluster.start()  # a worker whose port was taken exits here, to be started again
    try:
        value = function(*args)
    except SystemExit as stop:
        os._exit(_exit_code(stop.code))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    try:
        results.send(value)  # pickled whole before a byte is sent
    except Exception as error:
        print(f"{type(error).__name__}: {error}", flush=True)
        results.send(_Unsendable(type(value).__name__))
        os._exit(UNSENDABLE)
    sys.stdout.flush()
    os._exit(0)


def _exit_code(code) -> int:
    """The exit code of a worker whose function called `sys.exit(code)`, as for a script."""
    if code is None or (isinstance(code, int) and code == 0):
        sys.stdout.flush()
        return 0  # sends nothing: its value is None
    # A script's sys.exit prints nothing for an int; in a notebook, the
    # worker's output is all that shows why it ended.
    print(f"SystemExit: {code}", flush=True)
    # An int past 255 would wrap around (256 to 0, a success): it is a failure.
    return (code % 256 or 1) if isinstance(code, int) else 1


def _receive(connection) -> threading.Thread:
    # Received as it comes: a large result would fill the pipe and block the
    # worker from exiting if nothing read it until then.
    def receive():
        try:
            thread.value = connection.recv()
        except EOFError:
            thread.value = None
        except Exception as error:  # a value this process cannot unpickle
            thread.error = error

    thread = threading.Thread(target=receive, daemon=True)
    thread.value, thread.error = None, None
    thread.start()
    return thread
