"""Workers end with their launcher, also when it is killed outright (SIGKILL), on Linux."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kerasmulti._src.multi_worker import parent_death

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie no one reaped, as in a container without init, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _killed_with_workers(command: list[str], workers: int = 2) -> list[int]:
    """Starts `command` (a launcher whose workers print `pid=N`), SIGKILLs it, returns the workers' pids."""
    environment = {name: value for name, value in os.environ.items() if name not in ("TF_CONFIG", "KERASMULTI_SIMULATE_DEVICES")}
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**environment, "TF_CPP_MIN_LOG_LEVEL": "3"})
    pids = []
    try:
        while len(pids) < workers:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its workers started"
            if "pid=" in line:
                pids.append(int(line.split("pid=")[1]))
    finally:
        launcher.kill()  # SIGKILL: no handler runs, the launcher stops nothing itself
        launcher.wait()
    return pids


def _wait_until_ended(pids: list[int]) -> list[int]:
    for _ in range(600):  # 60 s: far beyond a busy machine's delays; they end in milliseconds
        if not any(_running(pid) for pid in pids):
            return []
        time.sleep(0.1)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_a_launcher_killed_by_sigkill_leaves_no_worker_running():
    # They went on training unsupervised, racing a re-run of the launcher for the backup.
    pids = _killed_with_workers(
        [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", os.path.join(WORKERS, "sleeper.py")]
    )
    assert _wait_until_ended(pids) == [], "workers outlived their killed launcher"


def test_a_killed_notebook_kernel_leaves_no_forked_worker_running():
    code = (
        "import os, time, kerasmulti\n"
        "def work():\n"
        "    print(f'pid={os.getpid()}', flush=True)\n"
        "    time.sleep(120)\n"
        "kerasmulti.launch(work, workers=2)\n"
    )
    pids = _killed_with_workers([sys.executable, "-c", code])
    assert _wait_until_ended(pids) == [], "forked workers outlived their killed kernel"


def test_a_worker_whose_launcher_ended_before_it_asked_is_stopped_before_it_runs():
    wrapped = parent_death.ended_with([sys.executable, "-c", "print('ran')"])
    assert wrapped[3] == str(os.getpid())  # the launcher: this process
    wrapped[3] = "1"  # one that is not its parent (any more): the launcher ended already
    run = subprocess.run(wrapped, capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGTERM and "ran" not in run.stdout


def test_the_wrapped_command_runs_as_itself_and_keeps_its_exit_code():
    run = subprocess.run(
        parent_death.ended_with([sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a b"]),
        capture_output=True, text=True, timeout=60,
    )
    assert (run.returncode, run.stdout) == (3, "['a b']\n"), run.stderr


def test_a_command_that_cannot_run_is_said_so_with_a_shells_exit_code(tmp_path):
    missing = str(tmp_path / "no-such-program")
    run = subprocess.run(parent_death.ended_with([missing]), capture_output=True, text=True, timeout=60)
    assert run.returncode == 127
    assert run.stderr == f"kerasmulti launch: cannot run {missing}: No such file or directory\n"
