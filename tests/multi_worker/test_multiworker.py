"""parallelize() across real worker processes on localhost, against one process.

Each test starts 2 TensorFlow processes (several seconds of import each), so
they are marked slow; they still run in CI.
"""

from simulated import NEEDS_CLUSTER  # first: 3 simulated devices before TensorFlow starts

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from kerasmulti._src.multi_worker import tf_config as _tf_config

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
ENV.pop("KERASMULTI_SIMULATE_DEVICES", None)
ENV.pop("TF_CONFIG", None)

pytestmark = [pytest.mark.slow, NEEDS_CLUSTER]


def _launch_workers(script, *args, timeout=300, launcher=()):
    result = subprocess.run(
        [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", *launcher, os.path.join(WORKERS, script), *args],
        capture_output=True, text=True, env=ENV, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result


def _one_process(script, *args):
    result = subprocess.run(
        [sys.executable, os.path.join(WORKERS, script), *args],
        capture_output=True, text=True, env=ENV, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_two_workers_train_evaluate_and_predict_as_one_process_on_the_global_batch(tmp_path):
    result = _launch_workers("multi_worker_fit.py", str(tmp_path))
    _assert_no_retracing(result)
    _one_process("multi_worker_fit.py", str(tmp_path), "--reference")
    reference = np.load(tmp_path / "reference.npz")
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    for key in reference.files:  # arrays, dataset, per-worker data, classifier, losses, statistics, float64
        if reference[key].dtype.kind != "U":  # float64/dtypes: names, below
            np.testing.assert_allclose(workers[0][key], reference[key], rtol=1e-5, atol=1e-5, err_msg=key)
        np.testing.assert_array_equal(workers[1][key], workers[0][key], err_msg=key)
    assert {k.split("/")[0] for k in reference.files} == {"arrays", "dataset", "local", "classifier", "losses", "statistics", "float64"}
    # Shuffled arrays: the workers see complementary halves of the 15 training
    # rows, together each once per epoch, in a new order each epoch; the last
    # 6 rows are for validation.
    once = np.tile([1.0] * 15 + [0.0] * 6, (2, 1))
    for worker in workers:
        np.testing.assert_array_equal(worker["coverage/seen"], once)  # a metric covers the cluster
    here = [w["coverage/seen_here"] for w in workers]
    np.testing.assert_array_equal(here[0] + here[1], once)
    assert here[0].sum(axis=1).tolist() == [8, 8]
    assert not np.array_equal(here[0][0], here[0][1])
    np.testing.assert_array_equal(workers[0]["coverage/val_loss"], workers[1]["coverage/val_loss"])
    assert workers[0]["coverage/val_loss"].shape == (2,)
    assert set(reference["float64/dtypes"].tolist()) == set(workers[0]["float64/dtypes"].tolist()) == {"float64"}
    # Inference runs on the worker's own devices; only the chief writes files.
    assert workers[0]["inference/difference"] < 1e-5
    assert "writes output= on the chief (worker 0) only" in str(workers[1]["inference/refusal"])
    assert "Received: output=" in str(workers[1]["inference/refusal"])
    assert not os.path.exists(tmp_path / "clobbered.h5")


def _assert_no_retracing(result):
    # TensorFlow warns when a tf.function retraces often (kerasmulti's barrier
    # and gather run after every fit, evaluate and predict).
    retraced = [line for line in (result.stdout + result.stderr).splitlines() if "retracing" in line]
    assert not retraced, retraced


def test_inputs_callbacks_and_optimizers_of_multi_worker_fit(tmp_path):
    _assert_no_retracing(_launch_workers("multi_worker_inputs.py", str(tmp_path)))
    _one_process("multi_worker_inputs.py", str(tmp_path), "--reference")
    reference = np.load(tmp_path / "reference.npz")
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    # TFRecord files (fit, predict in row order), schedules, positional arguments
    assert {k.split("/")[0] for k in reference.files} == {"files", "schedule", "callable", "positional"}
    for key in reference.files:
        np.testing.assert_allclose(workers[0][key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in set(workers[0].files) - {"refit/seen_here"}:  # weights agree across workers
        np.testing.assert_array_equal(workers[1][key], workers[0][key], err_msg=key)
    # A shuffled PyDataset: every sample once per epoch across the cluster.
    np.testing.assert_array_equal(workers[0]["pydataset/seen"], np.ones((3, 16)))
    # Two fit() calls on shuffled arrays: this worker's half differs between them.
    halves = [w["refit/seen_here"] for w in workers]
    np.testing.assert_array_equal(halves[0] + halves[1], np.ones((2, 16)))
    assert not np.array_equal(halves[0][0], halves[0][1])
    assert "Leave steps_per_execution at 1. Received: steps_per_execution=2" in str(workers[1]["refusal/message"])
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("epoch,")  # one header, two epochs: the chief's alone


def _start_worker(hosts, index, log, *args):
    env = {**ENV, "TF_CONFIG": _tf_config.tf_config(hosts, index)}
    return subprocess.Popen(
        [sys.executable, os.path.join(WORKERS, "multi_worker_resume.py"), *args],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
    )


@pytest.fixture(scope="module")
def resume_reference(tmp_path_factory):
    """The weights multi_worker_resume.py ends with, trained in one process without interruption."""
    out = tmp_path_factory.mktemp("reference")
    _one_process("multi_worker_resume.py", str(out), "--reference")
    return np.load(out / "final-reference.npz")


def _killed_at_epoch_1(out, *args):
    """Two workers, worker 1 killed at the end of epoch 1: (chief, doomed, seconds the chief went on)."""
    hosts = [f"localhost:{port}" for port in _tf_config.free_ports(2)]
    logs = [open(out / f"log-{i}.txt", "w") for i in range(2)]
    chief, doomed = (_start_worker(hosts, i, logs[i], str(out), "--die-at-epoch", "1", *args) for i in range(2))
    try:
        doomed.wait(timeout=240)
        died = time.monotonic()
        chief.wait(timeout=120)
    finally:
        chief.kill()
        doomed.kill()
        for log in logs:
            log.close()
    return chief, doomed, time.monotonic() - died


def test_a_killed_worker_stops_the_others_and_a_restart_resumes_with_nothing_lost(tmp_path, resume_reference):
    chief, doomed, stopped = _killed_at_epoch_1(tmp_path)
    output = (tmp_path / "log-0.txt").read_text()
    assert doomed.returncode == -9
    print(f"survivor stopped {stopped:.1f} s after the kill")
    assert stopped < 60  # the survivor did not wait forever (about 9 s measured)
    assert chief.returncode != 0
    assert "stopped: a worker is gone" in output and "Start the whole job again" in output, output[-3000:]
    assert not os.path.exists(tmp_path / "final-0.npz")
    assert os.path.exists(tmp_path / "backup")  # the chief's backup of an epoch

    restarted = _launch_workers("multi_worker_resume.py", str(tmp_path))
    assert "[worker 0] epoch 0 done" not in restarted.stdout  # resumed, not started over
    assert "[worker 0] epoch 3 done" in restarted.stdout
    assert "[worker 0] 4/4 - " in restarted.stdout  # progress lines: the chief's only
    assert "[worker 1] 4/4 - " not in restarted.stdout
    reference = resume_reference
    for index in range(2):
        final = np.load(tmp_path / f"final-{index}.npz")
        for key in reference.files:
            np.testing.assert_allclose(final[key], reference[key], rtol=1e-5, atol=1e-6)
    assert not os.path.exists(tmp_path / "model-1.keras")  # worker 1 never wrote
    saved = keras.models.load_model(tmp_path / "model-0.keras")
    np.testing.assert_allclose(saved.get_weights()[0], reference["arr_0"], rtol=1e-5, atol=1e-6)
    assert not os.path.exists(tmp_path / "backup")  # deleted once training finished
    assert not [name for name in os.listdir(tmp_path) if "tmp" in name]
    assert "4/4 - " not in (tmp_path / "log-1.txt").read_text()


def test_ctrl_c_stops_launch_and_its_workers_and_the_same_command_resumes(tmp_path, resume_reference):
    # A terminal's Ctrl-C reaches the launcher and its workers alike (one
    # process group), at a random moment of training here.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", os.path.join(WORKERS, "multi_worker_resume.py"), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a suite in the background ignores it
    )
    try:
        for line in launcher.stdout:  # the backup of epoch 0 is written before its line
            if line.startswith("[worker 0] epoch 0 done"):
                break
        time.sleep(np.random.default_rng().uniform(0, 0.5))
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("kerasmulti:")] == [
        "kerasmulti: interrupted; no worker is left running. If the script trains with ParallelBackupAndRestore, "
        "run the same command to resume from its last backup."
    ]
    time.sleep(0.5)  # a worker the launcher had not reaped would still be in its group
    with pytest.raises(ProcessLookupError):
        os.killpg(launcher.pid, 0)
    result = _launch_workers("multi_worker_resume.py", str(tmp_path))
    assert "epoch 0 done" not in result.stdout  # resumed, not started over
    expected, got = resume_reference, np.load(tmp_path / "final-0.npz")
    for key in expected.files:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def uninterrupted_workers(tmp_path_factory):
    """The folder of 2 workers' run, shuffling, with Dropout, uninterrupted (Dropout differs from one process's)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _launch_workers("multi_worker_resume.py", str(out), *STRUCK_RUN)
    return out


STRUCK_RUN = ("--shuffle", "--dropout")  # 4 epochs of 4 steps


def _assert_weights_equal(folder, uninterrupted):
    expected = np.load(uninterrupted / "final-0.npz")
    for index in range(2):
        with np.load(folder / f"final-{index}.npz") as got:
            for key in expected.files:
                np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=0, err_msg=key)


def _assert_each_step_shown_once(folder, restarted_at=None):
    """Callbacks saw every step under its own batch number, none passed over; killed, the restart repeats from `restarted_at`."""
    for index in range(2):
        with open(folder / f"batches-{index}.txt") as f:
            seen = [tuple(int(n) for n in line.split()) for line in f]
        assert all(steps == epoch * 4 + batch for epoch, batch, steps in seen), seen
        steps = [steps for _, _, steps in seen]
        if restarted_at is not None:  # the steps the killed run began, then the restart's from its backup
            again = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
            assert steps[:again] == list(range(again)) and restarted_at < again, seen
            steps = steps[again:]
        assert steps == list(range(restarted_at or 0, 16)), seen


def _strike(rng, victim=None, epoch_end=False, first=1):
    victim = int(rng.integers(0, 2)) if victim is None else victim
    step = 4 * int(rng.integers(0, 3)) + 3 if epoch_end else int(rng.integers(first, 15))
    print(f"worker {victim} gets the signal as step {step} begins")
    return ("--victim", str(victim), "--strike", str(step)), victim, step


@pytest.mark.parametrize("signal_name", ["KILL", "TERM"])
def test_with_max_restarts_a_worker_stopped_mid_epoch_restarts_the_job_which_ends_as_the_uninterrupted_one(
    tmp_path, uninterrupted_workers, signal_name
):
    # SIGKILL leaves no chance to save: the restarted job resumes at the last
    # epoch's backup (there is one: the strike comes after epoch 0), drawing
    # that epoch's shuffled order and Dropout masks again.
    # SIGTERM: every worker backs up the step and exits 42, restarted at once.
    strike, victim, step = _strike(np.random.default_rng(), first=4 if signal_name == "KILL" else 1)
    result = _launch_workers(
        "multi_worker_resume.py", str(tmp_path), *STRUCK_RUN, *strike, "--signal", signal_name, launcher=("--max-restarts", "1")
    )
    stopped = (
        f"worker {victim} failed with exit code 137 (killed by SIGKILL)" if signal_name == "KILL"
        else "SIGTERM stopped the workers after they backed up the step they reached (worker "
    )
    assert f"kerasmulti launch: {stopped}" in result.stdout
    assert "Starting all 2 workers again (restart 1 of 1): they resume from their last backup." in result.stdout
    assert result.stdout.splitlines()[-1] == "kerasmulti launch: all 2 workers finished, after 1 restart(s)."
    _assert_weights_equal(tmp_path, uninterrupted_workers)
    _assert_each_step_shown_once(tmp_path, restarted_at=step // 4 * 4 if signal_name == "KILL" else None)


def test_a_worker_killed_after_a_mid_epoch_backup_restarts_the_job_from_that_step(tmp_path, uninterrupted_workers):
    # save_freq=3: the last backup before the kill (as step 10 begins) is after step 9, in
    # epoch 3; the restarted job goes on from there and ends as the uninterrupted one.
    result = _launch_workers(
        "multi_worker_resume.py", str(tmp_path), *STRUCK_RUN, "--victim", "1", "--strike", "10", "--signal", "KILL",
        "--save-freq", "3", launcher=("--max-restarts", "1"),
    )
    assert result.stdout.splitlines()[-1] == "kerasmulti launch: all 2 workers finished, after 1 restart(s)."
    _assert_weights_equal(tmp_path, uninterrupted_workers)
    _assert_each_step_shown_once(tmp_path, restarted_at=9)


@pytest.mark.parametrize("victim", [0, 1], ids=["chief", "worker 1"])
def test_sigterm_to_a_worker_mid_epoch_backs_up_that_step_on_every_worker_and_the_rerun_ends_as_the_uninterrupted_one(
    tmp_path, uninterrupted_workers, victim
):
    # The chief's strike ends an epoch: the rerun resumes into an epoch with no batch left to train.
    strike, victim, step = _strike(np.random.default_rng(), victim, epoch_end=victim == 0)
    command = [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", os.path.join(WORKERS, "multi_worker_resume.py")]
    stopped = subprocess.run(
        [*command, str(tmp_path), *STRUCK_RUN, *strike], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert stopped.returncode == 42, stopped.stdout[-4000:]
    assert "kerasmulti launch: SIGTERM stopped the workers after they backed up the step they reached (worker " in stopped.stdout
    assert f"[worker {victim}] SIGTERM at step {step}" in stopped.stdout
    # Every worker ends the step in flight, the signalled one's, and backs it up.
    where = f"after step {step % 4 + 1} of epoch {step // 4 + 1}"
    assert f"[worker 0] kerasmulti: SIGTERM received; the backup in '{tmp_path / 'backup'}' resumes {where}." in stopped.stdout
    _launch_workers("multi_worker_resume.py", str(tmp_path), *STRUCK_RUN)
    _assert_weights_equal(tmp_path, uninterrupted_workers)
    _assert_each_step_shown_once(tmp_path)
    # The epochs the rerun ran log as the uninterrupted run's; across workers a resumed epoch's metrics
    # cover its batches after the resume, and one with none left logs its last step's (it logged 0.0).
    with open(uninterrupted_workers / "history-0.json") as f, open(tmp_path / "history-0.json") as g:
        expected, got = json.load(f)["loss"], json.load(g)["loss"]
    resumed = step // 4  # the epoch the rerun began with
    assert len(got) == 4 - resumed
    first = resumed if step % 4 == 3 else resumed + 1  # the first epoch it logs as the uninterrupted run
    np.testing.assert_allclose(got[first - resumed:], expected[first:], rtol=1e-5)


def test_sigterm_to_the_launcher_leaves_every_worker_backed_up_and_exits_42(tmp_path, uninterrupted_workers):
    command = [sys.executable, "-m", "kerasmulti", "launch", "--workers", "2", os.path.join(WORKERS, "multi_worker_resume.py")]
    launcher = subprocess.Popen(
        [*command, str(tmp_path), *STRUCK_RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        for line in launcher.stdout:
            if "[worker 0] epoch 0 done" in line:
                launcher.send_signal(signal.SIGTERM)
                break
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 42, out[-3000:] + err[-3000:]
    assert "kerasmulti launch: SIGTERM received; every worker backed up the step it reached. Exiting with code 42" in err
    _launch_workers("multi_worker_resume.py", str(tmp_path), *STRUCK_RUN)
    _assert_weights_equal(tmp_path, uninterrupted_workers)


def test_gradient_accumulation_across_workers_gives_the_weights_of_one_process(tmp_path):
    """Keras' accumulation crashes across workers (keras-team/keras#20582); kerasmulti's is exact."""
    _launch_workers("multi_worker_accumulation.py", str(tmp_path))
    _one_process("multi_worker_accumulation.py", str(tmp_path), "--reference")
    reference = np.load(tmp_path / "reference.npz")
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    # weights, losses and every optimizer variable: iterations, moments, accumulators
    assert {k.split("/")[0] for k in reference.files} == {"adam", "adamw", "mixed"}
    assert any("gradient_accumulator" in k for k in reference.files)
    for key in reference.files:
        # mixed_float16: each worker's float16 sums cover its rows (rounding, not another algorithm)
        tolerance = dict(rtol=1e-3, atol=1e-3) if key.startswith("mixed/") else dict(rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(workers[0][key], reference[key], **tolerance, err_msg=key)
        np.testing.assert_array_equal(workers[1][key], workers[0][key], err_msg=key)
    # the runs end mid-accumulation: 15 steps with k=2, 20 with k=3
    assert int(reference["adam/optimizer/adam/iteration"]) == 15
    assert int(reference["adamw/optimizer/adam_w/iteration"]) == 20
    for phase in ("adam", "adamw"):
        pending = [reference[k] for k in reference.files if k.startswith(phase + "/") and "accumulator" in k]
        assert max(np.abs(value).max() for value in pending) > 0, phase
    # mixed_float16: compile's loss scale, halved where a step overflowed (the same steps as one process)
    assert float(reference["mixed/optimizer/loss_scale_optimizer/dynamic_scale"]) == 2.0**14  # one step skipped
    assert int(reference["mixed/optimizer/adam_1/iteration"]) == 9  # of 10
    message = str(workers[1]["refusal/message"])
    assert "does not keep use_ema's moving averages" in message and message.endswith("Received: use_ema=True")


def test_models_with_steps_of_their_own_train_across_workers_with_one_processs_numbers(tmp_path):
    """A GAN (two optimizers; a normalising generator too), a VAE, the guide's steps and compute_loss; with XLA,
    clipped gradients and mixed precision too (before: per-replica clipping; a hang on an overflow on one worker)."""
    _launch_workers("multi_worker_custom_steps.py", str(tmp_path))
    _one_process("multi_worker_custom_steps.py", str(tmp_path), "--reference")
    reference = np.load(tmp_path / "reference.npz")
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    phases = {
        "gan", "gan_batchnorm", "vae", "counter", "logging", "listed_optimizers", "clipnorm", "global_clipnorm",
        "keras_step_clipnorm", "mixed_float16", "compute_loss", "test_step", "predict_step",
    }
    assert {k.split("/")[0] for k in reference.files} == phases
    compiled = {k for k in workers[0].files if k.split("/")[0] in ("gan_xla", "vae_xla")}
    assert set(workers[0].files) == set(reference.files) | compiled | {"draws", "unseeded"}
    for key in reference.files:  # weights, each epoch's logs, evaluate's and predict's results
        atol = 1e-3 if key.startswith("mixed_float16/") else 1e-6  # float16's rounding: replicas compute other sums
        np.testing.assert_allclose(workers[0][key], reference[key], rtol=1e-5, atol=atol, err_msg=key)
        np.testing.assert_array_equal(workers[1][key], workers[0][key], err_msg=key)
    # 4 steps an epoch, 2 epochs: each optimizer and the step's own counter step once a step.
    assert reference["gan/iterations"].tolist() == [8, 8]
    assert reference["gan_batchnorm/iterations"].tolist() == [0, 8]  # its step trains the generator only
    assert int(reference["counter/steps_taken"]) == 8
    assert {k for k in reference.files if "/history/" in k and k.startswith("gan/")} == {"gan/history/d_loss", "gan/history/g_loss"}
    # jit_compile=True: the model calls are XLA programs on every replica (no matrix product
    # outside XLA; 64 in an uncompiled epoch), with the uncompiled reference's numbers.
    for phase in ("gan", "vae"):
        assert workers[0][f"{phase}_xla/replica_jit_compile"] and not workers[0][f"{phase}_xla/uncompiled_warnings"].size
        assert workers[0][f"{phase}_xla/matmuls_outside_xla"] == 0
        for key in reference.files:
            if key.startswith(f"{phase}/") and key != "gan/iterations":
                np.testing.assert_allclose(workers[0][key.replace("/", "_xla/", 1)], reference[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert workers[0]["gan_xla/matmuls_outside_xla_uncompiled"] > 0
    # Each replica draws numbers of its own (with tf.distribute the workers' halves of a batch are equal).
    for batch in workers[0]["draws"].reshape(2, 2, 2):  # batches, workers, rows
        assert not np.allclose(batch[0], batch[1])
    message = str(workers[1]["unseeded"])
    assert "an unseeded keras.random draw" in message and message.endswith("Received: step='train_step'")


def test_the_throughput_monitor_gathers_every_worker_and_prints_on_the_chief(tmp_path):
    result = _launch_workers("multi_worker_monitor.py", str(tmp_path))
    workers = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    chief, other = (w["records"] for w in workers)
    assert [r["epoch"] for r in chief] == [1, 2]
    record = chief[-1]
    devices = record["devices"]
    assert [name.split("/device:")[0][-6:] for name in devices] == ["task:0", "task:1"]
    assert [d["rows"] for d in devices.values()] == [96, 96] and record["samples"] == 192
    # Worker 1 at half speed, seen from either worker: figures gathered from both.
    speeds = [d["samples_per_second"] for d in devices.values()]
    assert speeds[1] / speeds[0] == pytest.approx(0.5, rel=0.15)
    assert record["imbalance"] == pytest.approx(2.0, rel=0.15)
    assert other[-1]["devices"] == devices
    # Replicas that meet mid-step (a custom step's `optimizer.apply` and metrics,
    # BatchNormalization's statistics): a replica's wait there is not its work,
    # or both workers would look as slow as the slowest.
    for phase in ("custom_records", "batchnorm_records"):
        meeting = workers[0][phase][-1]["devices"]
        assert [d["rows"] for d in meeting.values()] == [96, 96]
        speeds = [d["samples_per_second"] for d in meeting.values()]
        assert speeds[1] / speeds[0] == pytest.approx(0.5, rel=0.15), phase
        assert workers[1][phase][-1]["devices"] == meeting
    # The headline figures are each worker's wall clock, as Keras' progress bar
    # (it was the replicas' compute alone, several times smaller, on a small
    # model). Bounds that hold on any machine, busy or not: the monitor's span
    # lies between the clocks read around it, and holds every step.
    for worker in workers:
        for record, before, after in zip(worker["records"], worker["clock"]["before"], worker["clock"]["after"]):
            spanned = after["steps"][-1][1] - before["begin"]
            stepped = sum(end - begin for begin, end in before["steps"])
            assert stepped <= record["seconds"] <= spanned
            assert record["samples_per_second"] == pytest.approx(192 / record["seconds"])
            assert record["step_seconds"] == pytest.approx(record["seconds"] / 4)
            parts = sum(record[f"{part}_seconds"] for part in ("compute", "merge_update", "input_call", "loop"))
            assert parts == pytest.approx(record["step_seconds"])
    printed = [line for line in result.stdout.splitlines() if "samples/s; step" in line]
    assert len(printed) == 2 and all(line.startswith("[worker 0]") for line in printed), result.stdout[-3000:]
    # Shuffled arrays keep their length through the workers' pipeline.
    assert "ran out of data" not in result.stdout + result.stderr
    # The TensorBoard scalars: the chief's only (worker 1 writes to a temporary folder).
    assert len(list((tmp_path / "logs" / "throughput").glob("events.out.tfevents.*"))) == 1
    for worker in workers:
        assert "passed to fit() on some workers only" in worker["refusal"]
        assert worker["refusal"].endswith("Received: workers_with_monitor=1 of 2")
        # A cryptic collective error before ("expected ... data_type 9 but got ... 1"), or other numbers.
        assert worker["batch_refusal"] == (
            "fit() got a different batch_size on each worker; every worker passes the same global data. "
            "Pass the same on all. Received: batch_size=[8, 16] (by worker)"
        )
        assert worker["rows_refusal"] == (
            "fit() got a different number of rows on each worker; every worker passes the same global data. "
            "Pass the same on all. Received: rows=[192, 184] (by worker)"
        )
        # TensorFlow lists every task's devices in a cluster; a worker's own are one CPU.
        assert worker["available_devices"] == ["/device:CPU:0"]
