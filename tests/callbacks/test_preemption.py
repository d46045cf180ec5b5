"""SIGTERM in the middle of an epoch: a backup of that step, exit 42, and a re-run that loses no step.

Each run is a process of its own (tests/workers/preempted_fit.py: Dropout,
fit's default shuffle=True, 2 simulated devices), compared with one run
that nothing interrupted. The multi-worker cases are in
tests/multi_worker/test_preemption_workers.py.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "preempted_fit.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
ENV.pop("KERASMULTI_SIMULATE_DEVICES", None)
STEPS = 18  # 3 epochs of 6 batches
REQUEUE = 42


def _run(folder, *args):
    return subprocess.run(
        [sys.executable, WORKER, str(folder), *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def _ran(folder, *args):
    result = _run(folder, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _final(folder):
    with np.load(os.path.join(folder, "final.npz")) as weights:
        return [weights[k] for k in sorted(weights.files, key=lambda k: int(k.split("_")[1]))]


def _batches(folder):
    """The (epoch, batch, optimizer iterations) of each batch the runs in `folder` showed callbacks, in order."""
    with open(os.path.join(folder, "batches.txt")) as f:
        return [tuple(int(n) for n in line.split()) for line in f]


def _logs(folder):
    return [json.load(open(os.path.join(folder, f"epoch-{e}.json"))) for e in range(3)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    _ran(folder)
    assert [steps for _, _, steps in _batches(folder)] == list(range(STEPS))
    return _final(folder), _logs(folder), _batches(folder)


def _strike_step(rng) -> int:
    step = int(rng.integers(1, STEPS - 1))
    print(f"SIGTERM as step {step} begins")
    return step


def test_sigterm_mid_epoch_backs_up_that_step_and_the_rerun_ends_as_the_uninterrupted_run(tmp_path, uninterrupted):
    step = _strike_step(np.random.default_rng())
    stopped = _run(tmp_path, "--strike", str(step))
    assert stopped.returncode == REQUEUE, stopped.stderr[-3000:]
    epoch, done = step // 6, step % 6 + 1  # the step in flight ends and is backed up
    where = f"after step {done} of epoch {epoch + 1}"
    assert f"kerasmulti: SIGTERM received; the backup in '{tmp_path / 'backup'}' resumes {where}. " in stopped.stderr
    assert "Exiting with code 42 (requeue): run the same command to go on from there." in stopped.stderr
    assert not os.path.exists(tmp_path / "final.npz")
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        fields = json.load(f)
        assert {k: v for k, v in fields.items() if k not in ("order_seed", "logs")} == {
            "epoch": epoch, "batch": done - 1, "step": done, "steps": 6
        }
        assert set(fields["logs"]) == {"loss", "mae"}  # the epoch's logs so far
    # Another seed for Python's `random`: only the backup knows the epochs' order.
    _ran(tmp_path, "--reseed")
    weights, logs, batches = uninterrupted
    for got, expected in zip(_final(tmp_path), weights):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    assert _logs(tmp_path) == logs  # also the resumed epoch's: its metrics went on from the backup's
    # Callbacks saw each step once, under its own batch number: none passed over.
    assert _batches(tmp_path) == batches
    assert not os.path.exists(tmp_path / "backup")  # done: deleted, as Keras does


@pytest.mark.slow  # 6-10 s: the fast tier keeps the SIGTERM resume above
def test_a_periodic_backup_killed_mid_epoch_resumes_at_its_step(tmp_path, uninterrupted):
    # save_freq=4 and SIGKILL (no chance to save): the re-run resumes at the
    # last backup, in the middle of an epoch, and repeats only what came after it.
    _run(tmp_path, "--strike", "10", "--signal", "KILL", "--save-freq", "4")
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        assert json.load(f)["step"] == 2  # after global step 8: epoch 1, 2 batches done
    _ran(tmp_path, "--save-freq", "4", "--reseed")
    for got, expected in zip(_final(tmp_path), uninterrupted[0]):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    # The killed run began steps 0-10; the re-run's callbacks see steps 8-17 only, each once.
    assert _batches(tmp_path) == uninterrupted[2][:11] + uninterrupted[2][8:]


@pytest.mark.slow  # 9-18 s: the fast tier keeps the plain model's resumes
def test_a_pipelined_run_killed_mid_epoch_resumes_to_an_uninterrupted_runs_weights(tmp_path_factory):
    # kerasmulti.pipeline: 2 stages, 4 micro-batches; SIGKILL after a backup every 4 steps.
    straight, killed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("killed")
    _ran(straight, "--pipeline")
    stopped = _run(killed, "--pipeline", "--strike", "10", "--signal", "KILL", "--save-freq", "4")
    assert stopped.returncode == -signal.SIGKILL
    _ran(killed, "--pipeline", "--save-freq", "4", "--reseed")
    for got, expected in zip(_final(killed), _final(straight)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    assert _batches(killed) == _batches(straight)[:11] + _batches(straight)[8:]


@pytest.mark.slow  # 9-18 s: the fast tier keeps the plain model's resumes
def test_control_keras_backup_and_restore_loses_the_interrupted_epoch(tmp_path, uninterrupted):
    # Keras' own callback: SIGTERM ends the process, and the re-run starts the
    # epoch over with other Dropout masks and another order.
    stopped = _run(tmp_path, "--strike", "8", "--keras-backup")
    assert stopped.returncode == -signal.SIGTERM
    _ran(tmp_path, "--keras-backup", "--reseed")
    assert any(not np.allclose(got, expected, rtol=1e-6, atol=0) for got, expected in zip(_final(tmp_path), uninterrupted[0]))


SIGTERM_AFTER_FIT = """
import os, signal, sys
import kerasmulti
kerasmulti.simulate_devices(2)
import keras, numpy as np

class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if sys.argv[2].startswith("raises") and not getattr(self, "done", False):
            self.done = True
            raise RuntimeError("stop")

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
parallel = kerasmulti.parallelize(model, gpus=2)
parallel.compile(optimizer="sgd", loss="mse")
backup = kerasmulti.ParallelBackupAndRestore(sys.argv[1])
try:
    parallel.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, callbacks=[backup, Fail()], verbose=0)
except RuntimeError:
    pass
print("after fit", flush=True)
if sys.argv[2] == "raises-then-fits":  # the handler the first fit left serves the second
    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    parallel.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, epochs=2, callbacks=[backup, Stop()], verbose=0)
os.kill(os.getpid(), signal.SIGTERM)
print("still running", flush=True)
"""


@pytest.mark.slow  # 8 s a case, a process of its own: CI runs it, the fast tier does not
@pytest.mark.parametrize("fit", ["returns", "raises"])
def test_after_fit_sigterm_ends_the_process_as_without_kerasmulti(tmp_path, fit):
    result = subprocess.run(
        [sys.executable, "-c", SIGTERM_AFTER_FIT, str(tmp_path / "backup"), fit],
        capture_output=True, text=True, env=ENV, timeout=300,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    assert "after fit" in result.stdout and "still running" not in result.stdout


@pytest.mark.slow  # 9 s, a process of its own: the fast tier keeps the SIGTERM resume above
def test_a_fit_after_one_that_raised_still_backs_up_on_sigterm(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SIGTERM_AFTER_FIT, str(tmp_path / "backup"), "raises-then-fits"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )
    assert result.returncode == REQUEUE, result.stderr[-3000:]
    assert "resumes after step 2 of epoch 1" in result.stderr


SIGTERM_IN_A_LATER_CALLBACK = """
import os, signal, sys
import kerasmulti
kerasmulti.simulate_devices(2)
import keras, numpy as np

class SlowLastEpochEnd(keras.callbacks.Callback):  # a checkpoint saving, say, after the backup's look
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and sys.argv[2] == "strike":
            if sys.argv[3] == "stopped early":
                self.model.stop_training = True  # as EarlyStopping does: the last of 4 epochs is epoch 1
            os.kill(os.getpid(), signal.SIGTERM)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
parallel = kerasmulti.parallelize(model, gpus=2)
parallel.compile(optimizer="sgd", loss="mse")
backup = kerasmulti.ParallelBackupAndRestore(sys.argv[1])
epochs = 4 if sys.argv[3] == "stopped early" else 2
fit = parallel.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=epochs, callbacks=[backup, SlowLastEpochEnd()], verbose=0)
print("steps", int(parallel.optimizer.iterations.numpy()), "epochs run", len(fit.epoch), flush=True)
"""


@pytest.mark.slow  # 17 s a case, two processes: the fast tier keeps the SIGTERM resume above
@pytest.mark.parametrize("end", ["last epoch", "stopped early"])
def test_sigterm_in_another_callbacks_last_epoch_end_is_not_swallowed_and_the_rerun_trains_nothing(tmp_path, end):
    # The flag was raised after the backup's last look: fit returned, the backup was deleted, exit 0.
    # (Stopped early, the backup first said "the start of epoch 3", and the rerun trained epochs 3 and 4.)
    run = [sys.executable, "-c", SIGTERM_IN_A_LATER_CALLBACK, str(tmp_path / "backup")]
    struck = subprocess.run([*run, "strike", end], capture_output=True, text=True, env=ENV, timeout=300)
    assert struck.returncode == REQUEUE, struck.stdout + struck.stderr[-3000:]
    assert "the backup in" in struck.stderr and "resumes at the end of training, with nothing left to train" in struck.stderr
    assert "steps" not in struck.stdout
    again = subprocess.run([*run, "rerun", end], capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "steps 4 epochs run 0" in again.stdout  # 2 epochs of 2 steps, all before the SIGTERM
    assert not os.path.exists(tmp_path / "backup" / "latest.weights.h5")  # done: deleted as Keras does
