"""`kerasmulti launch SCRIPT`: which workers to start, from the command line's options.

- `--workers N`: N workers on this machine, on free ports (`_supervisor`),
  with `--devices-per-worker K` GPUs each.
- `--hosts h1:port,h2:port --index i`: this machine's worker of a real cluster.
- A `TF_CONFIG` already set: this machine's worker, as it says.
- Under `srun`, one task per worker: this task's worker of the job step,
  placed by TensorFlow's `SlurmClusterResolver`; `--port` moves its ports.

Each worker joins its cluster at `import kerasmulti` (`KERASMULTI_JOIN=1`).
"""

from __future__ import annotations

import os
import sys

from kerasmulti._cluster import ENV_CONFIG, ENV_JOIN
from kerasmulti._supervisor import run_one, run_workers
from kerasmulti._tf_config import LaunchError, in_slurm_step, parse_hosts, slurm_tf_config, tf_config


def run(args) -> int:
    """Runs `kerasmulti launch` as its parsed `args` say; returns the exit code."""
    command = [sys.executable, args.script, *args.args]
    _check_combination(args)
    if args.workers is not None:
        return run_workers(command, args.workers, args.devices_per_worker)
    if args.devices_per_worker is not None:
        raise LaunchError(
            "--devices-per-worker splits this machine's GPUs among the workers "
            "--workers starts here; one worker of a real cluster uses the GPUs it "
            "sees (set CUDA_VISIBLE_DEVICES; under srun, --gpus-per-task). Drop "
            f"--devices-per-worker. Received: devices_per_worker={args.devices_per_worker}"
        )
    if args.hosts is not None:
        config = tf_config(parse_hosts(args.hosts, args.index), args.index)
    elif os.environ.get(ENV_CONFIG):
        config = os.environ[ENV_CONFIG]
    elif in_slurm_step():
        config = slurm_tf_config(args.port)
    else:
        raise LaunchError(
            "kerasmulti launch needs to know the workers: pass --workers N for N on "
            "this machine, or --hosts with --index for one of a real cluster, or run "
            "it under srun (one task per worker) or with TF_CONFIG set. Received: workers=None"
        )
    return run_one(command, {**os.environ, ENV_CONFIG: config, ENV_JOIN: "1"})


def _check_combination(args) -> None:
    if args.hosts is not None and args.workers is not None:
        raise LaunchError(
            "Pass either --workers (local processes) or --hosts with --index (one "
            f"worker of a real cluster), not both. Received: workers={args.workers}, hosts={args.hosts!r}"
        )
    if args.index is not None and args.hosts is None:
        raise LaunchError(
            "--index says which of the --hosts this machine is; without --hosts it "
            "means nothing. Pass --hosts with it, or drop it (--workers numbers the "
            f"local workers itself). Received: index={args.index}"
        )
    slurm = in_slurm_step() and args.workers is None and args.hosts is None and not os.environ.get(ENV_CONFIG)
    if args.port is not None and not (slurm and 0 < args.port < 65536):
        raise LaunchError(
            "--port sets the first port of a SLURM job step's workers on each node, "
            "from 1 to 65535; elsewhere --workers picks free ports and --hosts names "
            f"them. Run it under srun, or drop --port. Received: port={args.port}"
        )
