"""The multi-worker cluster this process belongs to, read from `TF_CONFIG`.

`MultiWorkerMirroredStrategy` (collective all-reduce across worker processes)
configures TensorFlow's collective ops, which TensorFlow allows only before it
runs its first op, and creating it waits until every worker of `TF_CONFIG`
has started. Joining is therefore explicit, as `keras.distribution.initialize()`
is: `kerasmulti.initialize()`, first thing in a script, or `import kerasmulti`
in a worker that `kerasmulti launch` (or `launch()`) started, which marks its
workers with `KERASMULTI_JOIN=1`. A `TF_CONFIG` that a training platform set
for its own purposes never makes `import kerasmulti` wait; `parallelize` then
trains on this process's devices, after a warning that says how to join.

Faults are bounded by the coordination service the strategy starts: a worker
that stops sending heartbeats (killed, crashed, unreachable) makes the
others' collectives fail with an error after TensorFlow's heartbeat timeout
(seconds), instead of waiting forever; `WorkerModel` turns that error into
one that says what to do. Joining is bounded too: TensorFlow would wait an
hour for workers that never start (holding the GIL, so no Python timer can
interrupt it), so the service is configured as the strategy would configure
it, plus a registration barrier with a deadline (`KERASMULTI_JOIN_TIMEOUT`,
600 s by default). The strategy's SIGTERM handler, which only logs, is
replaced by the previous one, so that a launcher can stop its workers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import warnings
import weakref

import tensorflow as tf

from kerasmulti._src import startup

ENV_CONFIG = startup.ENV_CONFIG
ENV_JOIN = startup.ENV_JOIN
ENV_JOIN_TIMEOUT = "KERASMULTI_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT_S = 600.0
EXIT_PORT_TAKEN = startup.EXIT_PORT_TAKEN

_strategy = None
_start_error: Exception | None = None
_join_requested = False
_warned_unjoined = False


class ClusterError(RuntimeError):
    """Multi-worker training cannot go on: the cluster could not be joined, or a worker is gone.

    A `RuntimeError`, so `except RuntimeError` keeps working. Its message says
    what to do (import kerasmulti first; start the job again, which resumes
    from a `ParallelBackupAndRestore` backup) and ends with `Received: ...`.

    Example:

    ```python
    import kerasmulti  # first, in a script started by `kerasmulti launch`
    import keras, numpy as np
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model)
    parallel.compile(optimizer="sgd", loss="mse")
    try:
        parallel.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16, verbose=0)
    except kerasmulti.ClusterError as error:
        print(error)  # e.g. a worker was killed: restart the job
    ```
    """


def config() -> dict | None:
    """`TF_CONFIG` as TensorFlow's `TFConfigClusterResolver` reads it, if it names several tasks.

    Returns `{"cluster": {job: [address, ...]}, "task": {"type": ..., "index": ...}}`,
    or None without a cluster of more than one chief or worker task.
    """
    text = os.environ.get(ENV_CONFIG)
    if not text:
        return None
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    try:
        spec = resolver.cluster_spec()
        task = {"type": resolver.task_type, "index": resolver.task_id}
        if None in task.values():
            raise KeyError("task")
    except (ValueError, KeyError, TypeError) as error:
        raise ClusterError(
            f"TF_CONFIG does not describe a cluster ({type(error).__name__}: {error}). Let "
            "`kerasmulti launch` write it (docs/multi-worker.md). "
            f"Received: TF_CONFIG={text!r}"
        ) from None
    tasks = sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs)
    return {"cluster": {job: spec.job_tasks(job) for job in spec.jobs}, "task": task} if tasks > 1 else None


def is_chief() -> bool:
    """Whether this process is the one that writes files and prints logs.

    In a cluster (`TF_CONFIG`) that is the `chief` task, or worker 0 when there
    is none; kerasmulti's checkpoints, `save()` and progress bars write there
    only, and a script's own files and prints should too. Outside a cluster
    it is always True.

    Returns:
        True on the chief or outside a cluster, False on the other workers.

    Raises:
        ClusterError: If `TF_CONFIG` is set but malformed.

    Example:

    ```python
    import kerasmulti
    if kerasmulti.is_chief():
        print("results go here")  # printed once, not once per worker
    ```
    """
    parsed = config()
    if parsed is None:
        return True
    task = parsed["task"]
    if "chief" in parsed["cluster"]:
        return task["type"] == "chief"
    return task["type"] == "worker" and int(task["index"]) == 0


def start(requested: bool | None = None) -> None:
    """Creates this process's `MultiWorkerMirroredStrategy` if asked to and `TF_CONFIG` names a cluster.

    Called by `import kerasmulti`, where joining is asked for by the
    launcher's `KERASMULTI_JOIN=1` (`requested=None`), and by `initialize()`
    (`requested=True`). A failure is kept and reported by `strategy()`,
    where the cluster is needed, unless TensorFlow itself failed to join (a
    worker never started, a port is taken): TensorFlow is then unusable in
    this process, and the `ClusterError` is raised at once. A launched
    worker whose port another process took prints it and exits with
    `EXIT_PORT_TAKEN` instead, so that its launcher starts the cluster again
    on other ports.
    """
    global _strategy, _start_error, _join_requested
    launched = requested is None and os.environ.get(ENV_JOIN) == "1"
    if not (requested or launched) or _strategy is not None or startup.started_by_command_line():
        return
    _join_requested = True
    try:
        if config() is None:
            return
        _strategy = _join(join_timeout())
    except Exception as error:  # reported where the cluster is first needed
        _start_error = error
        if type(error).__module__.startswith("tensorflow"):
            # The join itself failed: TensorFlow's next op in this process
            # would fail to start the gRPC server, so the reason is raised
            # here rather than where the cluster is first needed.
            failure = _start_failure(config())
            if launched and _port_taken(error):
                print(f"kerasmulti.ClusterError: {failure}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_PORT_TAKEN) from None
            raise failure from None


def initialize() -> bool:
    """Joins the multi-worker cluster that `TF_CONFIG` names.

    Call it first thing in a training script started by anything other than
    `kerasmulti launch` (a training platform, a SLURM job, your own
    `TF_CONFIG`), before any model or tensor exists: TensorFlow allows
    joining only before its first op. It waits until every worker has
    started (`KERASMULTI_JOIN_TIMEOUT` seconds, 600 by default). Afterwards
    `parallelize` trains across all workers. Workers started by
    `kerasmulti launch` or `kerasmulti.launch()` join at `import kerasmulti`;
    calling it there too does nothing more. Without a cluster of several
    tasks in `TF_CONFIG` it does nothing.

    Returns:
        True if this process is a worker of a cluster, False if `TF_CONFIG`
        names none.

    Raises:
        ClusterError: If `TF_CONFIG` is malformed, TensorFlow already ran, or
            the cluster could not be joined (the reason, e.g. workers that
            never started).

    Example:

    ```python
    import kerasmulti
    kerasmulti.initialize()  # first: joins the cluster of TF_CONFIG, if any
    import keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model)  # across all workers in a cluster
    ```
    """
    start(requested=True)
    return strategy() is not None


def join_timeout() -> float:
    """Seconds to wait for every worker of `TF_CONFIG` to start."""
    text = os.environ.get(ENV_JOIN_TIMEOUT)
    if text is None:
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ClusterError(
            f"{ENV_JOIN_TIMEOUT} must be a positive number of seconds to wait for the workers, "
            f"e.g. {ENV_JOIN_TIMEOUT}=600. Received: {ENV_JOIN_TIMEOUT}={text!r}"
        )
    return seconds


def _join(timeout_s: float):
    from kerasmulti._src import keras_private
    from kerasmulti._src.keras_private import coordination_config_pb2, multi_worker_util
    from kerasmulti._src.keras_private import eager_context as context

    if coordination_config_pb2 is None:  # a TensorFlow newer than those declared
        raise ClusterError(
            "This TensorFlow is unknown to kerasmulti, so it cannot join a cluster: use a TensorFlow that "
            "setup.cfg declares. "
            f"Received: tensorflow={tf.version.VERSION}"
        )
    if keras_private.tensorflow_version() < keras_private.CLUSTER_TENSORFLOW:
        # Without the registration barrier a missing worker would block the others for an hour.
        needed = ".".join(map(str, keras_private.CLUSTER_TENSORFLOW))
        raise ClusterError(
            f"Training across workers needs TensorFlow {needed} or later. Run pip install "
            f"'tensorflow>={needed}', or train in one process. Received: tensorflow={tf.version.VERSION}"
        )

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    # As the strategy does: only chief and worker tasks take part (not an evaluator).
    if context.context().coordination_service is None and resolver.task_type in ("chief", "worker"):
        # What the strategy configures itself when none is set, plus the deadline:
        # without the barrier the leader would wait an hour whatever the timeout.
        context.context().configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(spec),
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
                for job in ("chief", "worker")
                if job in spec.jobs
            ],
            cluster_register_timeout_in_ms=int(timeout_s * 1000),
        )
        context.context().coordination_service.cluster_register_with_barrier = True
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def worker_count(strategy) -> int:
    """The workers (the chief included) that `strategy` trains on; 1 outside a cluster."""
    return _place(strategy)[0]


def worker_index(strategy) -> int:
    """This worker's place among `worker_count`'s: the chief is 0, then the workers in order."""
    return _place(strategy)[1]


# strategy -> (worker count, this worker's index), read from its cluster
# resolver once, as the strategy fixes them when it is made: the resolver
# reads TF_CONFIG again at every call, and a script may change it afterwards.
_places: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _place(strategy) -> tuple[int, int]:
    if strategy not in _places:
        resolver = strategy.cluster_resolver
        spec = resolver.cluster_spec().as_dict()
        chiefs, workers = len(spec.get("chief", [])), len(spec.get("worker", []))
        if not spec or resolver.task_type == "chief":
            index = 0
        else:
            index = chiefs + int(resolver.task_id)
        _places[strategy] = (chiefs + workers or 1, index)
    return _places[strategy]


def strategy():
    """The process's `MultiWorkerMirroredStrategy`, or None outside a cluster.

    Raises:
        ClusterError: Joining was asked for and `TF_CONFIG` names a cluster,
            but the strategy could not be created (TensorFlow ran first, or
            `TF_CONFIG` was set after the import).
    """
    global _warned_unjoined
    if _strategy is not None:
        return _strategy
    parsed = config()
    if parsed is None:
        return None
    if not _join_requested and _start_error is None and not startup.started_by_command_line():
        if not _warned_unjoined:
            _warned_unjoined = True
            warnings.warn(
                "This process did not join the TF_CONFIG cluster; parallelize() uses its own devices. "
                "Call kerasmulti.initialize() first thing, or use `kerasmulti launch`. "
                f"Received: TF_CONFIG task={parsed['task']}",
                stacklevel=3,
            )
        return None
    raise _start_failure(parsed)


def _start_failure(parsed: dict) -> ClusterError:
    # TensorFlow sets up multi-worker collectives only before its first op,
    # so a process joins at `import kerasmulti` or `initialize()`, not later.
    if isinstance(_start_error, RuntimeError) and "program startup" in str(_start_error):
        return ClusterError(
            "TensorFlow ran before this worker joined its TF_CONFIG cluster. Call "
            "kerasmulti.initialize() at the top of the script, before any model or tensor. "
            f"Received: TF_CONFIG task={parsed['task']}"
        )
    if _start_error is None:
        return ClusterError(
            "TF_CONFIG was set after kerasmulti was imported, too late to join its cluster. "
            f"Set it before Python starts, e.g. with `kerasmulti launch`. Received: TF_CONFIG task={parsed['task']}"
        )
    if isinstance(_start_error, ClusterError):
        return _start_error
    if _port_taken(_start_error):
        task = parsed["task"]
        return ClusterError(
            f"This worker cannot listen on {parsed['cluster'][task['type']][task['index']]}: another "
            "process holds the port. Free it, or give the worker another port (under SLURM: "
            f"kerasmulti launch --port). Received: TF_CONFIG task={task}"
        )
    # TensorFlow's messages run long (gRPC's details on lines of their own): their first sentence says what happened.
    text = str(_start_error).strip()
    reason = text.split("\n")[0].split(". ")[0].rstrip(".") or type(_start_error).__name__
    waited = ""
    if type(_start_error).__name__ in ("DeadlineExceededError", "AbortedError"):
        waited = (
            f" Not every worker joined within {join_timeout():g} s{_missing(text, parsed)} "
            f"(set {ENV_JOIN_TIMEOUT} to wait longer)."
        )
    return ClusterError(
        f"Joining the TF_CONFIG cluster failed: {reason}.{waited} Check that every worker was started "
        f"and can reach the others. Received: TF_CONFIG={os.environ[ENV_CONFIG]!r}"
    )


def _missing(text: str, parsed: dict) -> str:
    """Whom a join that timed out waited for, from TensorFlow's message: ": worker 1 (host:port), ..." or ""."""
    cluster = parsed["cluster"]

    def named(job, index):
        return f"{job} {index} ({cluster[job][index]})"

    if "timed out task names:" in text:  # the coordination leader's barrier lists the tasks it waited for
        listed = text.split("timed out task names:", 1)[1].split("\n\n")[0]
        late = sorted({(job, int(i)) for job, i in re.findall(r"/job:(\w+)/replica:0/task:(\d+)", listed)})
        late = [named(job, i) for job, i in late if i < len(cluster.get(job, []))]
        return ": " + ", ".join(late) if late else ""
    leader = "chief" if cluster.get("chief") else "worker"
    if "RegisterTask" in text and cluster.get(leader):  # this task could not register with the leader
        return f": {named(leader, 0)} did not answer"
    return ""


def _port_taken(error) -> bool:
    # What TensorFlow 2.21 raises when its server cannot bind the port.
    return isinstance(error, tf.errors.UnknownError) and "Could not start gRPC server" in str(error)


def _cause(error) -> str:
    lines = [line.strip() for line in error.message.splitlines() if line.strip()]
    useful = [line for line in lines if "abort" in line or "unhealthy" in line or "down" in line]
    return (useful or lines or [""])[0]


@contextlib.contextmanager
def lost_workers_explained(what: str):
    """Inside: TensorFlow's errors of a lost worker become a `ClusterError` saying to restart the job."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as error:
        # The others cannot go on without its part of every step.
        raise ClusterError(
            f"Multi-worker {what} stopped: a worker is gone (killed, crashed, unreachable, or its script ended). Start "
            "the whole job again; ParallelBackupAndRestore resumes it. "
            f"Received: error={type(error).__name__}({_cause(error)!r})"
        ) from error
