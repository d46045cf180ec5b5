"""Supervising workers: woken by the first to end, signals, starting again when a port was taken."""

from simulated import NEEDS_CLUSTER  # first: 3 simulated devices before TensorFlow starts

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from kerasmulti._src import cluster as _cluster
from kerasmulti._src.multi_worker import supervisor as _supervisor


def _python(code):
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "waiting-thread"])
def test_the_first_failure_wakes_the_supervisor_while_the_others_run(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)  # as on macOS
    processes = [_python("import time; time.sleep(300)"), _python("import sys, time; time.sleep(0.5); sys.exit(3)")]
    try:
        assert _supervisor._first_failure(processes) == 1
        # Woken while the other still runs: no clock needed.
        assert processes[0].poll() is None and processes[1].returncode == 3
    finally:
        _supervisor._stop(processes)
    assert processes[0].returncode == -signal.SIGTERM


def test_workers_that_all_succeed_are_no_failure():
    processes = [_python("pass"), _python("import time; time.sleep(0.5)")]
    assert _supervisor._first_failure(processes) is None
    assert [p.returncode for p in processes] == [0, 0]


def test_an_exit_code_reads_as_a_shell_reports_it():
    assert _supervisor.exit_code(3) == 3
    assert _supervisor.exit_code(-signal.SIGKILL) == 128 + 9


def test_an_ignored_hangup_stays_ignored_while_workers_run():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with _supervisor._stopped_with_this_process():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is _supervisor._terminated
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
        signal.signal(signal.SIGTERM, term)


def test_the_handler_a_fit_that_raised_left_counts_as_the_default():
    # Keras calls no on_train_end when fit raises: ParallelBackupAndRestore's
    # SIGTERM handler stays, acting as the default outside fit.
    from kerasmulti._src.callbacks import preemption as _preemption

    term = signal.signal(signal.SIGTERM, _preemption._dispatch)
    try:
        with _supervisor._stopped_with_this_process():
            assert signal.getsignal(signal.SIGTERM) is _supervisor._terminated
        assert signal.getsignal(signal.SIGTERM) is _preemption._dispatch
    finally:
        signal.signal(signal.SIGTERM, term)


JOIN = "import kerasmulti; print('joined', kerasmulti._src.cluster.strategy() is not None, flush=True)"


@pytest.mark.slow
@NEEDS_CLUSTER
def test_a_port_taken_before_its_worker_started_starts_the_workers_again_elsewhere(monkeypatch):
    taken = socket.socket()
    taken.bind(("localhost", 0))  # another process's, between choosing the ports and binding them
    choices, free = [], _supervisor.local_hosts

    def local_hosts(n):
        hosts = free(n)
        if not choices:
            hosts[1] = f"localhost:{taken.getsockname()[1]}"
        choices.append(hosts)
        return hosts

    monkeypatch.setattr(_supervisor, "local_hosts", local_hosts)
    command = [sys.executable, "-c", JOIN]
    try:
        # The control: without another attempt the launch fails on the taken port.
        monkeypatch.setattr(_supervisor, "PORT_ATTEMPTS", 1)
        out = io.StringIO()
        assert _supervisor.run_workers(command, 2, out=out) == _cluster.EXIT_PORT_TAKEN
        assert f"cannot listen on {choices[0][1]}: another process holds the port" in out.getvalue()
        choices.clear()
        monkeypatch.setattr(_supervisor, "PORT_ATTEMPTS", 3)
        out = io.StringIO()
        assert _supervisor.run_workers(command, 2, out=out) == 0, out.getvalue()[-3000:]
    finally:
        taken.close()
    assert len(choices) == 2 and choices[1][1] != choices[0][1]
    assert f"another process took worker 1's port ({choices[0][1]}) before it started" in out.getvalue()
    assert "[worker 0] joined True" in out.getvalue() and "[worker 1] joined True" in out.getvalue()


# A worker that backs up its step when stopped (as ParallelBackupAndRestore does), taking a while.
_BACKING_UP = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(1.0)\n"
    "    sys.exit(42)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)


def _wait_until_it_handles_sigterm(pid: int) -> None:
    """Waits until process `pid` catches SIGTERM (Linux's /proc: the SigCgt mask); generous, not a deadline."""
    status = f"/proc/{pid}/status"
    if not os.path.exists(status):
        pytest.skip("needs Linux's /proc to see the launcher's signal handlers")
    for _ in range(6000):  # 60 s: far beyond a busy machine's scheduling delays
        with open(status) as file:
            caught = next(int(line.split()[1], 16) for line in file if line.startswith("SigCgt:"))
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.01)
    raise AssertionError("the launcher never installed its SIGTERM handler")


_LAUNCHERS = {
    # SLURM's srun, --hosts and TF_CONFIG: one worker per launcher (`run_one`).
    "one worker": "sys.exit(supervisor.run_one([sys.executable, '-c', WORKER], dict(os.environ)))",
    # --workers N: the launcher supervises them all.
    "two workers": "supervisor.supervise([subprocess.Popen([sys.executable, '-c', WORKER]) for _ in range(2)], [], "
                   "supervisor._Relay(sys.stderr))",
}


def _stopped_launcher(launcher: str, worker: str, signals: int = 1) -> tuple[int, str]:
    """Starts `launcher` with `worker`, sends it SIGTERM `signals` times once they are ready; its exit code and stderr."""
    workers = 2 if launcher == "two workers" else 1
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys\nfrom kerasmulti._src.multi_worker import supervisor\n"
         f"WORKER = {worker!r}\n{_LAUNCHERS[launcher]}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = ""  # two workers' lines may interleave on the shared pipe ("readyready\n\n")
        while ready.count("ready") < workers:
            line = launcher.stdout.readline()
            assert line, f"the launcher ended before its workers were ready: {ready!r}"
            ready += line
        _wait_until_it_handles_sigterm(launcher.pid)  # a busy machine may not have run that far yet
        for _ in range(signals):
            launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return launcher.returncode, stderr


@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
@pytest.mark.parametrize("launcher", list(_LAUNCHERS))
def test_a_launcher_stopped_by_sigterm_exits_with_its_workers_requeue_code(launcher, signals):
    # One worker per launcher exited 143, not 42, so a job's requeue never came; `timeout` signals
    # the launcher twice (directly and through its group), and the second signal killed it while
    # its workers were still backing up.
    code, stderr = _stopped_launcher(launcher, _BACKING_UP, signals)
    assert code == 42, stderr[-2000:]
    assert re.search(r"kerasmulti launch: SIGTERM received; (the worker|every worker) backed up the step it reached\. "
                     r"Exiting with code 42 \(requeue\)", stderr)


@pytest.mark.parametrize("launcher", list(_LAUNCHERS))
def test_a_launcher_stopped_by_sigterm_whose_workers_back_up_nothing_says_so_and_exits_143(launcher):
    # It ended with its workers' "stopped" lines only, not saying why (found by review).
    code, stderr = _stopped_launcher(launcher, "import time\nprint('ready', flush=True)\ntime.sleep(300)\n")
    assert code == 128 + signal.SIGTERM, stderr[-2000:]
    assert stderr.splitlines()[-1] == (
        "kerasmulti launch: SIGTERM received; no worker is left running. If the script trains with "
        "ParallelBackupAndRestore, run the same command to resume from its last backup."
    )


def test_a_late_second_sigterm_is_ignored_while_nested_supervision_ends():
    # `run_cluster` supervises inside its own `_stopped_with_this_process`; the inner one set the flag
    # back as it ended, so a second SIGTERM (in the pumps' join, say) replaced the workers' 42 with 143.
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with _supervisor._stopped_with_this_process():
            with pytest.raises(SystemExit) as first, _supervisor._stopped_with_this_process():
                _supervisor._terminated(signal.SIGTERM, None)
            assert first.value.code == 128 + signal.SIGTERM
            assert _supervisor._terminated(signal.SIGTERM, None) is None  # stopping already: ignored
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and _supervisor._stopping == [False]
    finally:
        signal.signal(signal.SIGTERM, term)
