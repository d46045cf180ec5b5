"""kerasmulti launch: workers on free localhost ports, TF_CONFIG, first failure wins."""

import os
import signal
import subprocess
import sys
import time

import pytest

import kerasmulti
from kerasmulti import _launch

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def _kerasmulti(*args, env=None, timeout=180):
    environment = dict(os.environ)
    for name in ("KERASMULTI_SIMULATE_DEVICES", "CUDA_VISIBLE_DEVICES", "TF_CONFIG"):
        environment.pop(name, None)
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "kerasmulti._cli", "launch", *args],
        capture_output=True, text=True, env=environment, timeout=timeout,
    )


def test_workers_get_their_tf_config_and_prefixed_output():
    result = _kerasmulti("--workers", "3", "--devices-per-worker", "2", os.path.join(WORKERS, "cluster_info.py"), "a", "--b")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[worker"))
    gpus = ["0,1", "2,3", "4,5"]  # each worker its own 2
    assert lines == [f"[worker {i}] index={i} workers=3 devices=2 gpus={gpus[i]} args=['a', '--b']" for i in range(3)]


def test_devices_per_worker_splits_the_visible_gpus():
    result = _kerasmulti("--workers", "2", "--devices-per-worker", "1", os.path.join(WORKERS, "cluster_info.py"),
                         env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[worker 0] index=0 workers=2 devices=1 gpus=3 " in result.stdout
    assert "[worker 1] index=1 workers=2 devices=1 gpus=5 " in result.stdout


def test_devices_per_worker_beyond_the_visible_gpus_is_refused():
    result = _kerasmulti("--workers", "2", "--devices-per-worker", "2", os.path.join(WORKERS, "cluster_info.py"),
                         env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert result.returncode == 2
    assert "need 4 GPUs, but CUDA_VISIBLE_DEVICES makes 2 visible (3,5)" in result.stderr
    assert "Received: devices_per_worker=2" in result.stderr


def test_first_failure_stops_the_others_and_sets_the_exit_code():
    start = time.monotonic()
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "fail-1", "hang-0")
    assert result.returncode == 3
    assert time.monotonic() - start < 60  # the hanging worker did not keep it waiting
    assert "worker 1 failed with exit code 3; stopped the others" in result.stdout


def test_a_worker_killed_by_a_signal_exits_as_a_shell_would():
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "kill-1", "hang-0")
    assert result.returncode == 128 + 9
    assert "worker 1 failed with exit code 137; stopped the others" in result.stdout


def test_hosts_and_index_build_tf_config_for_this_machine():
    result = _kerasmulti("--hosts", "10.0.0.1:2222,10.0.0.2:2222", "--index", "1", os.path.join(WORKERS, "cluster_info.py"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "index=1 workers=2" in result.stdout


def test_an_existing_tf_config_is_used_as_it_is():
    config = _launch.tf_config(["localhost:1", "localhost:2", "localhost:3"], 2)
    result = _kerasmulti(os.path.join(WORKERS, "cluster_info.py"), env={"TF_CONFIG": config})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "index=2 workers=3" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hosts", "a:1,b", "--index", "0"], "'b' is not one. Received: hosts='a:1,b'"),
        (["--hosts", "a:1,a:1", "--index", "0"], "same worker twice. Received: hosts='a:1,a:1'"),
        (["--hosts", "a:1,b:2", "--index", "2"], "0 to 1. Received: index=2"),
        (["--hosts", "a:1,b:2"], "Received: index=None"),
        (["--hosts", "a:1", "--index", "0", "--workers", "2"], "not both. Received: workers=2, hosts='a:1'"),
        (["--workers", "0"], "positive int, the number of worker processes. Received: workers=0"),
        (["--workers", "2", "--index", "1"], "without --hosts it means nothing. Pass --hosts with it, or drop it"),
        (["--workers", "2", "--devices-per-worker", "0"], "Received: devices_per_worker=0"),
        (["--hosts", "a:1,b:2", "--index", "0", "--devices-per-worker", "2"],
         "Drop --devices-per-worker. Received: devices_per_worker=2"),
    ],
)
def test_bad_cluster_requests_are_refused(args, message):
    result = _kerasmulti(*args, os.path.join(WORKERS, "cluster_info.py"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_free_ports_are_distinct():
    ports = _launch.free_ports(5)
    assert len(set(ports)) == 5


def test_the_notebook_launcher_refuses_once_tensorflow_ran():
    # The test process has run TensorFlow (its devices are simulated).
    with pytest.raises(RuntimeError, match="Restart the kernel.*Received: TensorFlow initialised=True"):
        kerasmulti.launch(print, workers=2)


@pytest.mark.parametrize(
    "function, workers, message",
    [
        (print, 0, "Received: workers=0"),
        (print, 1.5, "Received: workers=1.5"),
        (print, 2, "Received: devices_per_worker=-1"),
        ("train()", 2, r"not its result. Received: function='train\(\)'"),
    ],
)
def test_the_notebook_launcher_refuses_bad_arguments(function, workers, message):
    with pytest.raises(kerasmulti.LaunchError, match=message):
        kerasmulti.launch(function, workers=workers, devices_per_worker=-1 if "devices" in message else None)


def _notebook_launch(mode):
    return subprocess.run(
        [sys.executable, os.path.join(WORKERS, "notebook_launch.py"), mode],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300,
    )


@pytest.mark.slow
def test_the_notebook_launcher_trains_across_workers_and_returns_their_results():
    result = _notebook_launch("ok")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[worker 0] training in worker 0" in result.stdout
    assert "[worker 1] training in worker 1" in result.stdout
    assert "same weights" in result.stdout


@pytest.mark.slow
def test_the_notebook_launcher_reports_a_failed_worker():
    result = _notebook_launch("fail")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[worker 1] ValueError: worker 1 broke on purpose" in result.stdout
    assert "launch raised: Worker 1 of 2 failed" in result.stdout
    assert "the others were stopped. Received: exitcode=1" in result.stdout


def test_a_value_the_launcher_cannot_unpickle_is_a_clear_error():
    result = _notebook_launch("unloadable")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "launch raised: Worker 0 finished, but what its function returned cannot be rebuilt" in result.stdout
    assert "this value cannot be rebuilt" in result.stdout and "Received: error=ValueError" in result.stdout


def test_stopping_the_launcher_stops_its_workers():
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    environment.pop("TF_CONFIG", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kerasmulti._cli", "launch", "--workers", "2", os.path.join(WORKERS, "sleeper.py")],
        stdout=subprocess.PIPE, text=True, env=environment,
    )
    pids = []
    try:
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its workers started"
            if "pid=" in line:
                pids.append(int(line.split("pid=")[1]))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped by the launcher


def test_an_ignored_hangup_stays_ignored_while_workers_run():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with _launch._stopped_with_this_process():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is _launch._terminated
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
