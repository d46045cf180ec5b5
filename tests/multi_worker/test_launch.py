"""kerasmulti launch and launch(): local workers, --hosts, TF_CONFIG, SLURM, first failure wins."""

from simulated import NEEDS_CLUSTER  # first: 3 simulated devices before TensorFlow starts

import os
import re
import signal
import socket
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import kerasmulti
from kerasmulti._src.commands import launch as _launch_command
from kerasmulti._src.multi_worker import launch as _launch
from kerasmulti._src.multi_worker import tf_config as _tf_config

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")


def _environment(**env):
    environment = {name: value for name, value in os.environ.items() if not name.startswith("SLURM")}
    for name in ("KERASMULTI_SIMULATE_DEVICES", "CUDA_VISIBLE_DEVICES", "TF_CONFIG"):
        environment.pop(name, None)
    return {**environment, "TF_CPP_MIN_LOG_LEVEL": "3", **env}


def _kerasmulti(*args, env=None, timeout=180, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kerasmulti", "launch", *args],
        capture_output=True, text=True, env=_environment(**(env or {})), timeout=timeout, cwd=cwd,
    )


def test_workers_get_their_tf_config_and_prefixed_output():
    result = _kerasmulti("--workers", "3", os.path.join(WORKERS, "cluster_info.py"), "a", "--b")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[worker"))
    assert lines == [f"[worker {i}] index={i} workers=3 devices=None gpus=None args=['a', '--b']" for i in range(3)]


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_devices_per_worker_without_gpus_is_refused_before_any_worker_starts():
    # A worker without GPUs is one replica whatever its devices: more would do nothing.
    result = _kerasmulti("--workers", "2", "--devices-per-worker", "2", os.path.join(WORKERS, "cluster_info.py"))
    assert result.returncode == 2
    assert "start more workers instead (workers=4)" in result.stderr
    assert "Received: devices_per_worker=2" in result.stderr and "index=" not in result.stdout


def test_first_failure_stops_the_others_and_sets_the_exit_code():
    # Worker 0 hangs forever: had it kept the launcher waiting, the run's
    # timeout (180 s, far past a busy machine's start-up) would fail the test.
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "fail-1", "hang-0")
    assert result.returncode == 3
    assert "worker 1 failed with exit code 3; stopped the others" in result.stdout


def test_a_failing_workers_traceback_shows_once_the_others_one_line_each_and_the_launchers_line_last(tmp_path):
    # The last argument: the file worker 0 makes once its noisy SIGTERM handler is set.
    ready = str(tmp_path / "ready")
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "raise-1", "hang-0", "noisy-0", ready)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines.count("[worker 1] RuntimeError: worker 1's own failure") == 1
    assert "[worker 1] Traceback (most recent call last):" in lines
    # Worker 0's 40 lines of stopping are held back: one line says it was stopped.
    assert not [line for line in lines if "stopping, line" in line]
    assert lines[-2:] == [
        "[worker 0] stopped; 40 line(s) it printed since were not shown",
        "kerasmulti launch: worker 1 failed with exit code 1; stopped the others. If the script trains with "
        "ParallelBackupAndRestore, run the same command to resume from its last backup.",
    ]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the worker reads /proc to see the other one ended")
def test_a_failure_after_another_worker_ended_says_so(tmp_path):
    # A script that skips fit on one worker: the others fail in the step that waits for it.
    ended = str(tmp_path / "ended")
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "end-1-then-fail-0", ended)
    assert result.returncode == 1
    assert ("kerasmulti launch: worker 0 failed with exit code 1 (worker 1 had already exited with code 0); "
            "stopped the others.") in result.stdout, result.stdout


def test_a_cluster_that_keeps_failing_is_restarted_max_restarts_times_then_fails():
    result = _kerasmulti("--workers", "2", "--max-restarts", "2", os.path.join(WORKERS, "cluster_info.py"), "fail-1")
    assert result.returncode == 3
    restarts = [line for line in result.stdout.splitlines() if "Starting all 2 workers again" in line]
    # Worker 0 prints and ends (code 0) before worker 1 fails, or as it does.
    ended = r"( \(worker 0 had already exited with code 0\))?"
    assert len(restarts) == 2 and all(
        re.fullmatch(rf"kerasmulti launch: worker 1 failed with exit code 3{ended}; stopped the others\. Starting all 2 "
                     rf"workers again \(restart {n} of 2\): they resume from their last backup\.", line)
        for n, line in zip((1, 2), restarts)
    ), restarts
    assert result.stdout.count("[worker 1] index=1") == 3  # started 3 times in all (it prints, then fails)
    assert re.search(rf"worker 1 failed with exit code 3{ended}; stopped the others\. If the script", result.stdout)


def test_a_worker_killed_by_a_signal_exits_as_a_shell_would():
    result = _kerasmulti("--workers", "2", os.path.join(WORKERS, "cluster_info.py"), "kill-1", "hang-0")
    assert result.returncode == 128 + 9
    assert "worker 1 failed with exit code 137 (killed by SIGKILL); stopped the others" in result.stdout
    assert "run the same command to resume from its last backup" in result.stdout


def test_a_killed_worker_of_a_real_cluster_exits_as_a_shell_would():
    # One worker's launcher (--hosts/--index, or srun): 137, not 247 (Python's exit(-9)).
    result = _kerasmulti("--hosts", "localhost:1,localhost:2", "--index", "0", os.path.join(WORKERS, "cluster_info.py"), "kill-0")
    assert result.returncode == 128 + 9
    assert "the worker was killed by signal 9 (SIGKILL)" in result.stderr
    assert "run the same command to resume from its last backup" in result.stderr


def test_hosts_and_index_build_tf_config_for_this_machine():
    result = _kerasmulti("--hosts", "10.0.0.1:2222,10.0.0.2:2222", "--index", "1", os.path.join(WORKERS, "cluster_info.py"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "index=1 workers=2" in result.stdout


def test_an_existing_tf_config_is_used_as_it_is():
    config = _tf_config.tf_config(["localhost:1", "localhost:2", "localhost:3"], 2)
    result = _kerasmulti(os.path.join(WORKERS, "cluster_info.py"), env={"TF_CONFIG": config})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "index=2 workers=3" in result.stdout


def _consecutive_free_ports():
    """A port that is free with the next one: the ports of two SLURM tasks on one node."""
    while True:
        port = _tf_config.free_ports(1)[0]
        with socket.socket() as probe:
            try:
                probe.bind(("localhost", port + 1))
                return port
            except OSError:
                continue


@pytest.mark.slow
@NEEDS_CLUSTER
def test_a_slurm_job_step_trains_as_local_workers_do(tmp_path):
    """Two tasks of `srun --ntasks=2 kerasmulti launch`, as SLURM starts them on one node."""
    script = os.path.join(WORKERS, "multi_worker_resume.py")
    local, slurm = tmp_path / "local", tmp_path / "slurm"
    local.mkdir()
    slurm.mkdir()
    result = _kerasmulti("--workers", "2", script, str(local), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURMD_NODENAME": "localhost"}
    port = str(_consecutive_free_ports())
    tasks = [
        subprocess.Popen(
            [sys.executable, "-m", "kerasmulti", "launch", "--port", port, script, str(slurm)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_environment(**step, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
        )
        for rank in range(2)
    ]
    try:
        outputs = [task.communicate(timeout=600)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "epoch 3 done" in outputs[0] and "4/4 - " not in outputs[1]  # worker 1 is not the chief
    for index in range(2):
        expected, got = np.load(local / f"final-{index}.npz"), np.load(slurm / f"final-{index}.npz")
        for key in expected.files:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert os.path.exists(slurm / "model-0.keras") and not os.path.exists(slurm / "model-1.keras")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hosts", "a:1,b", "--index", "0"], "'b' is not one. Received: hosts='a:1,b'"),
        (["--hosts", "a:1,a:1", "--index", "0"], "same worker twice. Received: hosts='a:1,a:1'"),
        (["--hosts", "a:1,b:2", "--index", "2"], "0 to 1. Received: index=2"),
        (["--hosts", "a:1,b:2"], "Received: index=None"),
        (["--hosts", "a:1", "--index", "0", "--workers", "2"], "not both. Received: workers=2, hosts='a:1'"),
        (["--workers", "0"], "argument --workers: must be a positive int. Received: '0'"),  # the flag, not workers=
        (["--workers", "2", "--index", "1"], "--index needs --hosts. Pass --hosts too, or drop --index. Received: index=1"),
        (["--workers", "2", "--devices-per-worker", "0"], "argument --devices-per-worker: must be a positive int. Received: '0'"),
        (["--hosts", "a:1,b:2", "--index", "0", "--devices-per-worker", "2"],
         "--devices-per-worker works with --workers only. Drop it. Received: devices_per_worker=2"),
        ([], "needs to know the workers. Pass --workers N"),
        (["--workers", "2", "--port", "2222"], "Run it under srun, or drop --port. Received: port=2222"),
        (["--workers", "2", "--max-restarts", "-1"], "argument --max-restarts: must be 0 or more. Received: '-1'"),
        (["--workers", "abc"], "argument --workers: must be a positive int. Received: 'abc'"),
        (["--workers", "2", "--max-restarts", "x"], "argument --max-restarts: must be an int. Received: 'x'"),
        (["--hosts", "a:1,b:2", "--index", "0", "--max-restarts", "1"],
         "--max-restarts works with --workers only; a cluster's scheduler restarts its workers (sbatch --requeue). "
         "Drop --max-restarts, or use --workers. Received: max_restarts=1"),
    ],
)
def test_bad_cluster_requests_are_refused(args, message):
    result = _kerasmulti(*args, os.path.join(WORKERS, "cluster_info.py"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, script, message",
    [
        (["--workers", "2"], "nope.py", r"There is no script at \S*nope.py; no worker was started\. Check the path\."),
        (["--hosts", "a:1,b:2", "--index", "0"], "nope.py", r"There is no script at .*"),
        (["--workers", "2"], ".", r"The script is a folder with no __main__.py for Python to run; no worker was started\. "
                                  r"Pass the .py file\."),
        (["--workers", "2"], "broken.py", r"The script is not valid Python at line 2: '\(' was never closed; no worker "
                                          r"was started\. Fix it \(`python -m py_compile broken.py` shows where\)\."),
    ],
)
def test_a_script_no_worker_could_run_is_refused_before_any_worker_starts(tmp_path, args, script, message):
    (tmp_path / "broken.py").write_text("import os\nx = (\n")
    result = _kerasmulti(*args, script, cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(f"{message} Received: script='{re.escape(script)}'$", result.stderr.strip()), result.stderr
    assert "[worker" not in result.stdout and "resume" not in result.stdout + result.stderr


def test_a_missing_script_is_named_alone():
    # argparse said "the following arguments are required: script, args"; the args are optional.
    result = _kerasmulti("--workers", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kerasmulti launch needs the script each worker runs, e.g. kerasmulti launch --workers 2 train.py. " \
           "Received: script=None" in result.stderr


def test_a_notebook_is_refused_saying_how_to_run_one(tmp_path):
    # Its JSON compiles as Python: the workers ran it, did nothing, and the launcher exited 0.
    (tmp_path / "train.ipynb").write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}\n')
    result = _kerasmulti("--workers", "2", "train.ipynb", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        "The script is a notebook, which workers cannot run; no worker was started. Export it (jupyter nbconvert "
        "--to script), or call kerasmulti.launch() in the notebook. Received: script='train.ipynb'"
    ), result.stderr


@pytest.mark.parametrize("port, tasks, message", [
    (70000, "2", "--port needs room for a node's 2 worker(s), on ports 1 to 65535. Pass one from 1 to 65534. Received: port=70000"),
    (65535, "2(x2)", "Pass one from 1 to 65534. Received: port=65535"),  # its second worker would get 65536
    (0, "1", "Pass one from 1 to 65535. Received: port=0"),
])
def test_a_slurm_port_with_no_room_for_a_nodes_workers_is_refused(port, tasks, message):
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURMD_NODENAME": "localhost"}
    result = _kerasmulti("--port", str(port), os.path.join(WORKERS, "cluster_info.py"), env=step)
    assert result.returncode == 2
    assert message in result.stderr and "Received: port" in result.stderr.strip().splitlines()[-1], result.stderr


def test_what_python_runs_is_a_script_the_launcher_accepts(tmp_path):
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "__main__.py").write_text("print('a folder')\n")
    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as app:
        app.writestr("__main__.py", "print('a zip application')\n")
    (tmp_path / "latin.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'café'\n".encode("latin-1"))
    for script in ("package", "app.pyz", "latin.py"):
        _launch_command._check_script(str(tmp_path / script))  # no error


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda path: path.write_bytes(b"a = 1\0\n"), "The script is not valid Python: source code string cannot contain null bytes"),
        (lambda path: os.mkfifo(path), "The script is not a regular file; no worker was started. Pass the .py file"),
    ],
)
def test_a_script_that_is_not_python_source_is_refused(tmp_path, make, message):
    script = tmp_path / "train.py"
    make(script)
    with pytest.raises(kerasmulti.LaunchError, match=re.escape(f"{message}") + f".*Received: script='{re.escape(str(script))}'"):
        _launch_command._check_script(str(script))


def test_a_script_that_cannot_be_read_is_refused(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_launch_command, "open", refuse, raising=False)  # as for a file of another user
    message = r"The script cannot be read \(Permission denied\); no worker was started\. Check its permissions\."
    with pytest.raises(kerasmulti.LaunchError, match=f"{message} Received: script='{re.escape(str(script))}'"):
        _launch_command._check_script(str(script))


def test_the_notebook_launcher_refuses_once_tensorflow_ran():
    import tensorflow as tf

    tf.constant(1.0)  # TensorFlow runs here, whichever tests ran before
    with pytest.raises(kerasmulti.ClusterError, match="Restart the kernel.*Received: TensorFlow initialised=True"):
        kerasmulti.launch(print, workers=2)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"workers": 0}, "Received: workers=0"),
        ({"workers": 1.5}, "Received: workers=1.5"),
        ({"workers": "2"}, "Received: workers='2'"),
        ({"devices_per_worker": -1}, "Received: devices_per_worker=-1"),
        ({"devices_per_worker": True}, "Received: devices_per_worker=True"),
        ({"function": "train()"}, r"not its result. Received: function='train\(\)'"),
        ({"args": 2}, r"args must be a tuple or list, e.g. args=\(x,\); the number of workers goes in workers=\. Received: args=2"),
        ({"args": "data.csv"}, "Received: args='data.csv'"),
        ({"args": None}, "Received: args=None"),
        ({"args": {"epochs": 2}}, "Received: args={'epochs': 2}"),
        ({"max_restarts": -1}, "max_restarts must be an int of 0 or more.*Received: max_restarts=-1"),
        ({"max_restarts": "3"}, "Received: max_restarts='3'"),
        ({"max_restarts": True}, "Received: max_restarts=True"),
    ],
)
def test_the_notebook_launcher_refuses_bad_arguments(arguments, message):
    arguments = {"function": print, **arguments}
    with pytest.raises(kerasmulti.LaunchError, match=message):
        kerasmulti.launch(**arguments)


def _notebook_launch(mode, *args):
    return subprocess.run(
        [sys.executable, os.path.join(WORKERS, "notebook_launch.py"), mode, *args],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300,
    )


@pytest.mark.slow
@NEEDS_CLUSTER
def test_the_notebook_launcher_trains_across_workers_and_returns_their_results():
    result = _notebook_launch("ok")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[worker 0] training in worker 0" in result.stdout
    assert "[worker 1] training in worker 1" in result.stdout
    assert "same weights" in result.stdout


@pytest.mark.slow
@NEEDS_CLUSTER
def test_the_notebook_launchers_workers_back_up_their_step_on_sigterm(tmp_path):
    # Forked, they kept the launcher's SIGTERM handler (stop the workers): exit 143 and no backup.
    result = _notebook_launch("sigterm", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumes after step 3 of epoch 1. Exiting with code 42" in result.stdout
    assert ("launch raised: SIGTERM stopped the workers after they backed up the step they reached. Call launch() "
            "again to go on from there. Received: exitcode=42") in result.stdout
    assert "latest.weights.h5" in os.listdir(tmp_path)


@pytest.mark.slow
@NEEDS_CLUSTER
def test_the_notebook_launcher_reports_a_failed_worker():
    result = _notebook_launch("fail")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[worker 1] ValueError: worker 1 broke on purpose" in result.stdout
    assert "launch raised: Worker 1 of 2 failed" in result.stdout
    assert "the others were stopped. Received: exitcode=1" in result.stdout


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
@NEEDS_CLUSTER
def test_a_value_the_launcher_cannot_unpickle_is_a_clear_error():
    result = _notebook_launch("unloadable")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "launch raised: Worker 0 finished, but its return value cannot be unpickled here" in result.stdout
    assert "this value cannot be rebuilt" in result.stdout and "Received: error=ValueError" in result.stdout


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
@NEEDS_CLUSTER
def test_a_value_a_worker_cannot_pickle_is_a_clear_error():
    result = _notebook_launch("unpicklable")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "launch raised: Worker " in result.stdout
    assert "finished, but its return value cannot be pickled to send it back" in result.stdout
    assert "Received: type=function" in result.stdout and "pickle" in result.stdout.split("launch raised")[0].lower()


EXITING = """
import sys

import kerasmulti
from kerasmulti._src import cluster


def stop(code):
    if cluster.config()["task"]["index"] == 0:
        sys.exit(code)
    return "returned"


for code in (3, 0, %d):
    try:
        print("launch returned", kerasmulti.launch(stop, args=(code,), workers=2), flush=True)
    except kerasmulti.ClusterError as error:  # a RuntimeError
        print("launch raised", error, flush=True)
""" % _launch.UNSENDABLE


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
@NEEDS_CLUSTER
def test_a_function_that_calls_sys_exit_ends_its_worker_as_a_script(tmp_path):
    (tmp_path / "exiting.py").write_text(EXITING)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "exiting.py")], capture_output=True, text=True,
        env=_environment(), timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    raised = [line for line in result.stdout.splitlines() if line.startswith("launch")]
    assert raised == [
        "launch raised Worker 0 of 2 failed (output above, as [worker 0]); the others were stopped. "
        "Received: exitcode=3",
        "launch returned [None, 'returned']",  # sys.exit(0) is a success, with no value
        # The launcher's own code for an unpicklable value, when a function exits with it.
        f"launch raised Worker 0 of 2 failed (output above, as [worker 0]); the others were stopped. "
        f"Received: exitcode={_launch.UNSENDABLE}",
    ]
    assert "[worker 0] SystemExit: 3" in result.stdout and "Traceback" not in result.stdout + result.stderr


def test_sys_exit_codes_in_a_worker_are_those_of_a_script(capsys):
    assert [_launch._exit_code(code) for code in (None, 0, False, 3, 255, 256, -1)] == [0, 0, 0, 3, 255, 1, 255]
    assert capsys.readouterr().out.splitlines()[0] == "SystemExit: 3"  # nothing printed for a success
    assert _launch._exit_code("bad config") == 1
    assert capsys.readouterr().out == "SystemExit: bad config\n"


def test_stopping_the_launcher_stops_its_workers():
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    environment.pop("TF_CONFIG", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", os.path.join(WORKERS, "sleeper.py")],
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
