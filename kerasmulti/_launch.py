"""Starting worker processes for multi-worker training: `kerasmulti launch`.

`TF_CONFIG` tells each TensorFlow process the cluster and its own place in
it. The launcher starts N workers on free localhost ports with `TF_CONFIG`
set, prefixes every line they print with `[worker i]`, and ends all of them
as soon as one fails, exiting with that worker's code; a hung cluster does not
outlive its first failure. For real clusters, `--hosts` and `--index` build
the same `TF_CONFIG` for the one worker started on this machine.

`launch(function, workers=N)` does the same from a notebook, in the manner of
accelerate's `notebook_launcher`: it forks N workers that each join the
cluster and call the function, prints their output with the same prefixes,
and returns what each returned. Forking copies the notebook's process, so
TensorFlow must not have run anything in it yet (a cluster can only be joined
before TensorFlow's first op); `launch` refuses, saying so, when it has.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from kerasmulti._cluster import ENV_JOIN
from kerasmulti._devices import is_positive_int

POLL_S = 0.2


class LaunchError(ValueError):
    """A launch request that cannot be started: bad workers, devices or hosts.

    Raised by `launch()` and by `kerasmulti launch` before any worker starts.
    A `ValueError`, so `except ValueError` keeps working; the message says what
    to change and ends with `Received: ...`.

    Example:

    ```python
    import kerasmulti
    try:
        kerasmulti.launch(print, workers=0)
    except kerasmulti.LaunchError as error:
        print(error)
    ```
    """


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on localhost (free when asked; bound later by the workers)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(hosts: list[str], index: int) -> str:
    """The `TF_CONFIG` of worker `index` in a cluster of `hosts` ("host:port")."""
    return json.dumps({"cluster": {"worker": list(hosts)}, "task": {"type": "worker", "index": index}})


def parse_hosts(text: str, index: int | None) -> list[str]:
    """Validates `--hosts host1:port,host2:port` and `--index i`."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"--hosts takes host:port pairs separated by commas, e.g. "
                f"'10.0.0.1:2222,10.0.0.2:2222'; '{host}' is not one. Received: hosts={text!r}"
            )
    if len(set(hosts)) != len(hosts):
        raise LaunchError(f"--hosts lists the same worker twice. Received: hosts={text!r}")
    if index is None or not 0 <= index < len(hosts):
        raise LaunchError(
            f"--index must say which of the {len(hosts)} hosts this machine is, "
            f"0 to {len(hosts) - 1}. Received: index={index!r}"
        )
    return hosts


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def _check_workers(workers, devices_per_worker=None) -> None:
    if not is_positive_int(workers):
        raise LaunchError(f"workers must be a positive int, the number of worker processes. Received: workers={workers!r}")
    if devices_per_worker is not None and not is_positive_int(devices_per_worker):
        raise LaunchError(
            "devices_per_worker must be a positive int, the GPUs (or simulated "
            f"devices) each worker gets, or None. Received: devices_per_worker={devices_per_worker!r}"
        )


def run_workers(command: list[str], workers: int, devices_per_worker: int | None = None, out=None) -> int:
    """Runs `command` as `workers` local processes of one cluster; returns the exit code.

    0 when every worker succeeded; otherwise the code of the first worker that
    failed, after the others have been stopped.
    """
    _check_workers(workers, devices_per_worker)
    out = out or sys.stdout
    hosts = [f"localhost:{port}" for port in free_ports(workers)]
    _worker_environment(hosts, 0, devices_per_worker)  # a bad request fails before any worker starts
    processes, pumps = [], []
    try:
        for index in range(workers):
            env = {**os.environ, **_worker_environment(hosts, index, devices_per_worker)}
            process = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            processes.append(process)
            pumps.append(_start_pump(process.stdout, index, out))
    except BaseException:
        _stop(processes)  # a worker left alone would wait for its peers forever
        raise
    failed = _supervise(processes, pumps)
    for process in processes:
        process.stdout.close()
    if failed is None:
        return 0
    code = _exit_code(processes[failed].returncode)
    out.write(f"kerasmulti launch: worker {failed} failed with exit code {code}; stopped the others.\n")
    return code


def _exit_code(returncode: int) -> int:
    # A worker killed by signal N reports -N; a shell reports 128 + N.
    return 128 - returncode if returncode < 0 else returncode


def _worker_environment(hosts: list[str], index: int, devices_per_worker: int | None) -> dict:
    # KERASMULTI_JOIN: the worker joins its cluster at `import kerasmulti`.
    env = {"TF_CONFIG": tf_config(hosts, index), ENV_JOIN: "1"}
    if devices_per_worker:
        # With GPUs: worker i gets its own K of them (of those already visible,
        # if CUDA_VISIBLE_DEVICES is set), not all of them. Without GPUs: K
        # simulated CPU devices for single-machine code in the worker.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(len(hosts) * devices_per_worker)]
        if len(ids) < len(hosts) * devices_per_worker:
            raise LaunchError(
                f"{len(hosts)} workers with {devices_per_worker} GPUs each need "
                f"{len(hosts) * devices_per_worker} GPUs, but CUDA_VISIBLE_DEVICES "
                f"makes {len(ids)} visible ({visible}). Lower --workers or "
                "--devices-per-worker, or make more GPUs visible. "
                f"Received: devices_per_worker={devices_per_worker}"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * devices_per_worker:(index + 1) * devices_per_worker])
        env["KERASMULTI_SIMULATE_DEVICES"] = str(devices_per_worker)
    return env


def _start_pump(stream, index: int, out) -> threading.Thread:
    pump = threading.Thread(target=_pump, args=(stream, f"[worker {index}] ", out), daemon=True)
    pump.start()
    return pump


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # runs the `finally` that stops the workers


@contextlib.contextmanager
def _stopped_with_this_process():
    """Inside: SIGTERM and SIGHUP end this process through Python, so its workers are stopped too.

    By default they end it at once, leaving the workers running, each
    waiting for its peers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    # Only where the signal would end this process: an ignored one (nohup)
    # or one the program handles stays as it is.
    previous = {s: signal.signal(s, _terminated) for s in signals if signal.getsignal(s) is signal.SIG_DFL}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_one(command: list[str], env: dict) -> int:
    """Runs one worker's `command` and returns its exit code; stopping this stops it."""
    process = subprocess.Popen(command, env=env)
    try:
        with _stopped_with_this_process():
            return process.wait()
    finally:
        _stop([process])


def _supervise(processes, pumps) -> int | None:
    """Waits for all processes; on the first failure stops the rest. Returns its index or None."""
    failed = None
    try:
        with _stopped_with_this_process():
            failed = _first_failure(processes)
    finally:
        _stop(processes)
        for pump in pumps:
            pump.join(timeout=5)
    return failed


def _first_failure(processes) -> int | None:
    failed = None
    while any(p.poll() is None for p in processes) and failed is None:
        failed = next((i for i, p in enumerate(processes) if p.poll() not in (None, 0)), None)
        time.sleep(POLL_S)
    if failed is None:
        failed = next((i for i, p in enumerate(processes) if p.returncode != 0), None)
    return failed


def _stop(processes) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Forked:
    """A forked `multiprocessing.Process` with the `subprocess.Popen` methods `_supervise` uses."""

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

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("worker", timeout)


def _tensorflow_started() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context

    # Finding a GPU starts its driver, which a forked process cannot use.
    started = context.context()
    listed = started._physical_devices or []
    return started._initialized or any(device.device_type == "GPU" for device in listed)


def _run_forked(function, args, index, hosts, devices_per_worker, output_fd, results) -> None:
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
    os.environ.update(_worker_environment(hosts, index, devices_per_worker))
    from kerasmulti import _cluster, _devices

    _devices._simulate_from_environment()
    _cluster.start()
    try:
        value = function(*args)
        results.send(value)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def launch(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    workers: int = 2,
    devices_per_worker: int | None = None,
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

    Args:
        function: What each worker runs. Its return value (which must be
            picklable, e.g. `history.history`) is sent back.
        args: Positional arguments for `function`.
        workers: How many worker processes.
        devices_per_worker: GPUs per worker (worker i sees GPUs i*K to
            i*K+K-1); without GPUs, simulated CPU devices per worker (as
            `KERASMULTI_SIMULATE_DEVICES`), for single-machine code in it.

    Returns:
        The list of the workers' return values, worker 0 first.

    Raises:
        LaunchError: A `ValueError` if `workers` is not a positive int,
            `function` is not callable, or more GPUs are asked for than
            `CUDA_VISIBLE_DEVICES` makes visible.
        RuntimeError: If TensorFlow already ran in this process, or a worker
            failed (its traceback is printed above the error).

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
            "launch() runs a function in every worker; pass the function itself, "
            f"not its result. Received: function={function!r}"
        )
    _check_workers(workers, devices_per_worker)
    if _tensorflow_started():
        raise RuntimeError(
            "launch() cannot start workers from this process: TensorFlow has "
            "already run here, and a worker (a copy of this process) can only "
            "join a cluster before TensorFlow's first op. Restart the kernel, "
            "then call launch() before building any model or tensor: put that "
            "code inside the function. Received: TensorFlow initialised=True"
        )
    context = multiprocessing.get_context("fork")
    hosts = [f"localhost:{port}" for port in free_ports(workers)]
    _worker_environment(hosts, 0, devices_per_worker)  # a bad request fails here, not in every worker
    processes, pumps, receivers, streams = [], [], [], []
    try:
        for index in range(workers):
            read_fd, write_fd = os.pipe()
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_run_forked, args=(function, tuple(args), index, hosts, devices_per_worker, write_fd, sender)
            )
            process.start()
            os.close(write_fd)
            sender.close()
            streams.append(os.fdopen(read_fd, "r", errors="replace"))
            processes.append(_Forked(process))
            pumps.append(_start_pump(streams[-1], index, sys.stdout))
            receivers.append(_receive(receiver))
    except BaseException:
        _stop(processes)  # a worker left alone would wait for its peers forever
        raise
    failed = _supervise(processes, pumps)
    for stream in streams:
        stream.close()
    if failed is not None:
        raise RuntimeError(
            f"Worker {failed} of {workers} failed (its output is above, prefixed "
            f"[worker {failed}]); the others were stopped. "
            f"Received: exitcode={processes[failed].returncode}"
        )
    for index, receiver in enumerate(receivers):
        receiver.join()
        if receiver.error is not None:
            raise RuntimeError(
                f"Worker {index} finished, but what its function returned cannot be "
                "rebuilt in this process (it is unpickled here, and "
                f"{type(receiver.error).__name__}: {receiver.error}). Return plain "
                "data: numbers, arrays, dicts and lists, e.g. history.history rather "
                f"than the History object. Received: error={type(receiver.error).__name__}"
            )
    return [receiver.value for receiver in receivers]


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
