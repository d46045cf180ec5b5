"""How long a preempted job takes to stop: from SIGTERM to its exit code 42.

A spot instance, Kubernetes or SLURM sends SIGTERM and, some seconds later,
SIGKILL. With `ParallelBackupAndRestore` the job ends the step in flight,
backs it up, and exits with 42; this measures that time, the process's own
exit included, for the tests' two jobs (tiny models):

- one process on 2 simulated devices (tests/workers/preempted_fit.py), which
  sends itself SIGTERM as a given step begins;
- 2 workers under `kerasmulti launch` (tests/workers/multi_worker_resume.py),
  worker 1 sending itself SIGTERM; timed until the launcher exits.

Each job prints the time it sent the signal; the time is read against the
moment the parent sees the exit. A real model adds one step and one backup
write. Usage: python benchmarks/bench_preemption.py
"""

import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _seconds_to_exit(command) -> tuple[int, float]:
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    ended = time.time()
    sent = float(re.search(r"sent at ([0-9.]+)", result.stdout).group(1))
    return result.returncode, ended - sent


def main() -> None:
    for step in (3, 8, 14):
        code, seconds = _seconds_to_exit(
            [sys.executable, os.path.join(WORKERS, "preempted_fit.py"), tempfile.mkdtemp(), "--strike", str(step)]
        )
        print(f"one process, SIGTERM at step {step}: exit {code} {seconds:.2f} s after SIGTERM")
    for step in (5, 10):
        launch = [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2"]
        script = [os.path.join(WORKERS, "multi_worker_resume.py"), tempfile.mkdtemp(), "--shuffle", "--dropout"]
        code, seconds = _seconds_to_exit([*launch, *script, "--victim", "1", "--strike", str(step)])
        print(f"2 workers, SIGTERM to worker 1 at step {step}: launcher exit {code} {seconds:.2f} s after SIGTERM")


if __name__ == "__main__":
    main()
