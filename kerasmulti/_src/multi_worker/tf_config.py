"""The `TF_CONFIG` each worker starts with: from free local ports, `--hosts`, or SLURM.

`TF_CONFIG` tells each TensorFlow process the cluster and its own place in
it. `kerasmulti launch --workers N` and `launch()` give N local workers free
localhost ports; `--hosts` and `--index` describe one worker of a real
cluster; under `srun`, TensorFlow's `SlurmClusterResolver` reads the step's
nodes and tasks (one worker per task). Local workers can also be given their
own GPUs (`devices_per_worker`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from kerasmulti._src.startup import ENV_JOIN
from kerasmulti._src.utils.arguments import is_int, is_positive_int

SLURM_PORTS_PER_JOB = 8


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
    """n distinct free TCP ports on localhost (free when asked; bound later by the workers).

    Another process can take one before its worker binds it; the launchers
    then start the workers again on other ports (`supervisor.run_cluster`).
    """
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


def local_hosts(n: int) -> list[str]:
    """Addresses for n workers on this machine, on free ports."""
    return [f"localhost:{port}" for port in free_ports(n)]


def tf_config(hosts: list[str], index: int) -> str:
    """The `TF_CONFIG` of worker `index` in a cluster of `hosts` ("host:port")."""
    return json.dumps({"cluster": {"worker": list(hosts)}, "task": {"type": "worker", "index": index}})


def parse_hosts(text: str, index: int | None) -> list[str]:
    """Validates `--hosts host1:port,host2:port` and `--index i`."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise LaunchError(f"--hosts names no worker. List each as host:port, e.g. --hosts a:2222,b:2222. Received: hosts={text!r}")
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"--hosts takes comma-separated host:port pairs, e.g. 'a:1,b:1'; '{host}' is not one. "
                f"Received: hosts={text!r}"
            )
    if len(set(hosts)) != len(hosts):
        raise LaunchError(f"--hosts lists the same worker twice. Received: hosts={text!r}")
    if index is None or not 0 <= index < len(hosts):
        raise LaunchError(
            f"--index must say which of the {len(hosts)} hosts this machine is, "
            f"0 to {len(hosts) - 1}. Received: index={index!r}"
        )
    return hosts


def check_workers(workers, devices_per_worker=None) -> None:
    """Refuses a `workers` or `devices_per_worker` that is not a positive int (None allowed for the latter)."""
    if not is_positive_int(workers):
        raise LaunchError(f"workers must be a positive int, the number of worker processes. Received: workers={workers!r}")
    if devices_per_worker is not None and not is_positive_int(devices_per_worker):
        raise LaunchError(
            f"devices_per_worker must be a positive int or None. Received: devices_per_worker={devices_per_worker!r}"
        )


def check_restarts(max_restarts) -> None:
    """Refuses a `max_restarts` that is not an int of 0 or more."""
    if not (is_int(max_restarts) and max_restarts >= 0):
        raise LaunchError(
            f"max_restarts must be an int of 0 or more. Received: max_restarts={max_restarts!r}"
        )


def physical_gpus(fork_safe: bool = False) -> int:
    """How many GPUs TensorFlow finds here (of those `CUDA_VISIBLE_DEVICES` shows).

    Finding one starts its driver, which a process forked afterwards cannot
    use: with `fork_safe`, a child process looks instead (one TensorFlow
    import, a few seconds).
    """
    if not fork_safe:
        import tensorflow as tf  # here: the launcher loads TensorFlow only where it must

        return len(tf.config.list_physical_devices("GPU"))
    code = "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return int(result.stdout.split()[-1])


def gpus_per_worker(workers: int, devices_per_worker: int | None, gpus: int) -> list[str] | None:
    """Each local worker's `CUDA_VISIBLE_DEVICES`: its own K of the `gpus` GPUs here.

    Worker i gets the i-th K of the GPUs already visible. None leaves the
    workers' devices alone: no `devices_per_worker`, or 1 without GPUs (on
    the CPU a worker is one replica anyway).
    """
    if devices_per_worker is None or (devices_per_worker == 1 and gpus == 0):
        return None
    needed = workers * devices_per_worker
    if gpus == 0:
        # Without GPUs, MultiWorkerMirroredStrategy trains one replica per worker.
        raise LaunchError(
            f"devices_per_worker needs GPUs, and this machine has none: start more workers instead (workers={needed}). "
            f"Received: devices_per_worker={devices_per_worker}"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",")[:gpus] if visible else [str(i) for i in range(gpus)]
    if len(ids) < needed:
        has = f"CUDA_VISIBLE_DEVICES makes {len(ids)} visible ({visible})" if visible else f"this machine has {gpus}"
        raise LaunchError(
            f"{workers} workers with {devices_per_worker} GPUs each need {needed} GPUs, "
            f"but {has}. Lower them, or make more GPUs visible. "
            f"Received: devices_per_worker={devices_per_worker}"
        )
    k = devices_per_worker
    return [",".join(ids[i * k:(i + 1) * k]) for i in range(workers)]


def worker_environment(hosts: list[str], index: int, gpus: list[str] | None = None) -> dict:
    """What worker `index` of a local cluster adds to its environment.

    `TF_CONFIG`, `KERASMULTI_JOIN=1` (it joins the cluster at `import
    kerasmulti`) and, with `gpus` (from `gpus_per_worker`), its GPUs.
    """
    env = {"TF_CONFIG": tf_config(hosts, index), ENV_JOIN: "1"}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index]
    return env


def in_slurm_step() -> bool:
    """Whether this process is a task of a SLURM job step (started by `srun`)."""
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def slurm_port() -> int:
    """The first port of this SLURM job's workers on each of its nodes.

    Jobs that share a node must not share ports, so each job takes
    `SLURM_PORTS_PER_JOB` of its own from its id (its workers per node, at
    most), below Linux's ephemeral range (32768 up), from which outgoing
    connections draw ports.
    """
    job = os.environ.get("SLURM_JOB_ID", "")
    return 15000 + SLURM_PORTS_PER_JOB * (int(job) % 2000 if job.isdigit() else 0)


def slurm_tf_config(port: int | None = None) -> str:
    """The `TF_CONFIG` of this SLURM task, one worker per task of the job step.

    TensorFlow's `SlurmClusterResolver` reads the step's nodes and its tasks
    per node; the workers of a node listen on `port`, `port + 1`, ...
    (default `slurm_port()`). This task is the worker at its node's address
    for its local id.
    """
    port = slurm_port() if port is None else port
    try:
        import tensorflow as tf

        tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
        # The resolver pairs each task of a node with a slot of GPUs and drops
        # the tasks beyond the node's GPUs (it zips them). One slot per task
        # keeps every task; each uses the GPUs srun gave it (--gpus-per-task).
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port, gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False
        )
        hosts = resolver.cluster_spec().job_tasks("worker")
    except (RuntimeError, ValueError) as error:
        raise LaunchError(
            f"SLURM's environment does not describe this job step ({error}). Run under srun. Received: "
            f"SLURM_STEP_NODELIST={os.environ.get('SLURM_STEP_NODELIST')!r}"
        ) from None
    if not isinstance(resolver.task_id, int) or not 0 <= resolver.task_id < len(hosts):
        # The resolver gives no index to a rank outside the step's tasks.
        raise LaunchError(
            f"This SLURM task's rank is not one of the job step's {len(hosts)} task(s) (0 to {len(hosts) - 1}). "
            f"Run under srun. Received: SLURM_PROCID={os.environ.get('SLURM_PROCID')!r}"
        )
    node, local = os.environ.get("SLURMD_NODENAME"), os.environ.get("SLURM_LOCALID")
    if node is None or local is None:
        return tf_config(hosts, resolver.task_id)
    # The resolver takes the nodes in name order (node10 before node9) and
    # gives ranks in that order, which is not always where srun placed them
    # (--distribution=cyclic, or names of several lengths): a task's place
    # is its node's address for its local id.
    return tf_config(hosts, hosts.index(_slurm_address(hosts, node, local, port)))


def _slurm_address(hosts: list[str], node: str, local: str, port: int) -> str:
    """This task's address among the step's `hosts`: its node's port for its local id."""
    here = sum(h.rpartition(":")[0] == node for h in hosts)  # the step's tasks on this node
    if not here:
        raise LaunchError(
            f"This SLURM task's node is not among the job step's nodes "
            f"({', '.join(sorted({h.rpartition(':')[0] for h in hosts}))}). Run in that step. Received: SLURMD_NODENAME={node!r}"
        )
    if not (local.isdecimal() and int(local) < here):
        # SLURM numbers a node's tasks 0 to n-1: another value came from
        # another step's environment, or was set by hand.
        raise LaunchError(
            f"This SLURM task's local id on {node} is not one of the step's {here} task(s) there (0 to {here - 1}). "
            f"Run directly under srun. Received: SLURM_LOCALID={local!r}"
        )
    return f"{node}:{port + int(local)}"
