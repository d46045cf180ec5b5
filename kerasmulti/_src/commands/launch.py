"""`kerasmulti launch SCRIPT`: which workers to start, from the command line's options.

- `--workers N`: N workers on this machine, on free ports (`supervisor`),
  with `--devices-per-worker K` GPUs each, started again after a failure up
  to `--max-restarts` times.
- `--hosts h1:port,h2:port --index i`: this machine's worker of a real cluster.
- A `TF_CONFIG` already set: this machine's worker, as it says.
- Under `srun`, one task per worker: this task's worker of the job step,
  placed by TensorFlow's `SlurmClusterResolver`; `--port` moves its ports.

Each worker joins its cluster at `import kerasmulti` (`KERASMULTI_JOIN=1`).
The script is checked first (it exists, is a file, and compiles), so a
mistyped path or a syntax error is one message, not N failed workers.
"""

from __future__ import annotations

import os
import sys
import zipfile

from kerasmulti._src.multi_worker.supervisor import run_one, run_workers
from kerasmulti._src.multi_worker.tf_config import LaunchError, check_restarts, in_slurm_step, parse_hosts, slurm_tf_config, tf_config
from kerasmulti._src.startup import ENV_CONFIG, ENV_JOIN


def run(args) -> int:
    """Runs `kerasmulti launch` as its parsed `args` say; returns the exit code."""
    if args.script is None:
        raise LaunchError(
            "kerasmulti launch needs the script each worker runs, e.g. kerasmulti launch --workers 2 train.py. "
            "Received: script=None"
        )
    command = [sys.executable, args.script, *args.args]
    check_restarts(args.max_restarts)
    _check_combination(args)
    _check_script(args.script)
    if args.workers is not None:
        return run_workers(command, args.workers, args.devices_per_worker, max_restarts=args.max_restarts)
    if args.max_restarts:
        # Each machine runs its own launcher: one alone cannot restart the cluster.
        raise LaunchError(
            "--max-restarts works with --workers only; a cluster's scheduler restarts its workers "
            "(sbatch --requeue). Drop --max-restarts, or use --workers. "
            f"Received: max_restarts={args.max_restarts}"
        )
    if args.devices_per_worker is not None:
        # It splits the GPUs of this machine among the workers --workers starts.
        raise LaunchError(
            "--devices-per-worker works with --workers only. Drop it. "
            f"Received: devices_per_worker={args.devices_per_worker}"
        )
    if args.hosts is not None:
        config = tf_config(parse_hosts(args.hosts, args.index), args.index)
    elif os.environ.get(ENV_CONFIG):
        config = os.environ[ENV_CONFIG]
    elif in_slurm_step():
        config = slurm_tf_config(args.port)
    else:
        raise LaunchError(
            "kerasmulti launch needs to know the workers. Pass --workers N or --hosts with --index, "
            "or use srun or TF_CONFIG. Received: workers=None"
        )
    return run_one(command, {**os.environ, ENV_CONFIG: config, ENV_JOIN: "1"})


def _check_combination(args) -> None:
    if args.hosts is not None and args.workers is not None:
        raise LaunchError(
            f"Pass either --workers or --hosts with --index, not both. Received: workers={args.workers}, hosts={args.hosts!r}"
        )
    if args.index is not None and args.hosts is None:
        raise LaunchError(
            f"--index needs --hosts. Pass --hosts too, or drop --index. Received: index={args.index}"
        )
    slurm = in_slurm_step() and args.workers is None and args.hosts is None and not os.environ.get(ENV_CONFIG)
    if args.port is not None and not slurm:
        # Elsewhere --workers picks free ports and --hosts names them.
        raise LaunchError(
            f"--port sets the first port of a SLURM job step's workers. Run it under srun, or drop --port. "
            f"Received: port={args.port}"
        )
    if args.port is not None:
        # A node's workers listen on --port, --port + 1, ... (SLURM_STEP_TASKS_PER_NODE: "2(x3),1").
        tasks = max(int(part.split("(")[0]) for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(","))
        if not 0 < args.port <= 65536 - tasks:
            raise LaunchError(
                f"--port needs room for a node's {tasks} worker(s), on ports 1 to 65535. "
                f"Pass one from 1 to {65536 - tasks}. Received: port={args.port}"
            )


def _check_script(script: str) -> None:
    """Refuses a script that every worker would fail to start: missing, a folder, or not Python."""
    path = script
    if os.path.isdir(script):
        path = os.path.join(script, "__main__.py")  # as Python runs a folder
        if not os.path.isfile(path):
            raise _script_error(script, "The script is a folder with no __main__.py for Python to run", "Pass the .py file")
    elif not os.path.exists(script):
        raise _script_error(script, f"There is no script at {os.path.abspath(script)}", "Check the path")
    elif not os.path.isfile(script):
        raise _script_error(script, "The script is not a regular file", "Pass the .py file")
    if path.endswith(".ipynb"):  # JSON, which also compiles as Python: it would run and do nothing
        raise _script_error(
            script, "The script is a notebook, which workers cannot run",
            "Export it (jupyter nbconvert --to script), or call kerasmulti.launch() in the notebook",
        )
    if zipfile.is_zipfile(path):  # a zip application, which Python runs too
        return
    try:
        with open(path, "rb") as file:
            source = file.read()
    except OSError as error:
        raise _script_error(script, f"The script cannot be read ({error.strerror})", "Check its permissions") from None
    try:
        # Compiles without running it; `dont_inherit`: not this module's `__future__` flags.
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:
        where = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
        problem = f"The script is not valid Python{where}: {getattr(error, 'msg', None) or error}"
        raise _script_error(script, problem, f"Fix it (`python -m py_compile {path}` shows where)") from None


def _script_error(script: str, problem: str, fix: str) -> LaunchError:
    return LaunchError(f"{problem}; no worker was started. {fix}. Received: script={script!r}")
