"""Starting worker processes for multi-worker training: `kerasmulti launch`.

`TF_CONFIG` tells each TensorFlow process the cluster and its own place in
it. The launcher starts N workers on free localhost ports with `TF_CONFIG`
set, prefixes every line they print with `[worker i]`, and ends all of them
as soon as one fails, exiting with that worker's code; a hung cluster does not
outlive its first failure. For real clusters, `--hosts` and `--index` build
the same `TF_CONFIG` for the one worker started on this machine.

This is the process side of multi-worker training only; the training side
(`parallelize` under `MultiWorkerMirroredStrategy`) is not built yet.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

POLL_S = 0.2


class LaunchError(ValueError):
    """A launch request that cannot be started."""


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


def run_workers(command: list[str], workers: int, devices_per_worker: int | None = None, out=None) -> int:
    """Runs `command` as `workers` local processes of one cluster; returns the exit code.

    0 when every worker succeeded; otherwise the code of the first worker that
    failed, after the others have been stopped.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise LaunchError(f"--workers must be a positive int, the number of worker processes. Received: workers={workers!r}")
    out = out or sys.stdout
    hosts = [f"localhost:{port}" for port in free_ports(workers)]
    processes, pumps = [], []
    for index in range(workers):
        env = {**os.environ, "TF_CONFIG": tf_config(hosts, index)}
        if devices_per_worker:
            env["KERASMULTI_SIMULATE_DEVICES"] = str(devices_per_worker)
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        pump = threading.Thread(target=_pump, args=(process.stdout, f"[worker {index}] ", out), daemon=True)
        pump.start()
        processes.append(process)
        pumps.append(pump)
    failed = None
    try:
        while any(p.poll() is None for p in processes) and failed is None:
            failed = next((i for i, p in enumerate(processes) if p.poll() not in (None, 0)), None)
            time.sleep(POLL_S)
        if failed is None:
            failed = next((i for i, p in enumerate(processes) if p.returncode != 0), None)
    finally:
        for p in processes:
            if p.poll() is None:
                p.terminate()
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pump in pumps:
            pump.join(timeout=5)
    if failed is None:
        return 0
    code = processes[failed].returncode
    out.write(f"kerasmulti launch: worker {failed} failed with exit code {code}; stopped the others.\n")
    return code
