"""ParallelModelCheckpoint and ParallelBackupAndRestore on parallel models."""

import glob
import os
import random
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import kerasmulti
from kerasmulti import _faults
from conftest import DEVICES

WORKER = os.path.join(os.path.dirname(__file__), "workers", "train_checkpointed.py")


def _setup(seed=0, outputs=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(outputs)], name="template")
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng()
    x, y = rng.normal(size=(30, 5)).astype("float32"), rng.normal(size=(30, outputs)).astype("float32")
    return model, parallel, x, y


def _no_temporaries(folder):
    return not glob.glob(os.path.join(str(folder), ".*kerasmulti-tmp*"))


@pytest.mark.parametrize("name", ["m.keras", "m.h5"])
def test_saves_the_template_not_the_wrapper(tmp_path, name):
    model, parallel, x, y = _setup()
    path = str(tmp_path / name)
    parallel.fit(x, y, epochs=2, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path, monitor="loss")])
    loaded = keras.models.load_model(path)
    assert loaded.name == "template"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert _no_temporaries(tmp_path)


def test_weights_only_loads_into_a_plain_model(tmp_path):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "m.weights.h5")
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path, save_weights_only=True)])
    plain = keras.models.clone_model(model)
    plain.load_weights(path)
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_filepath_templates_and_batch_level_save_freq(tmp_path):
    _, parallel, x, y = _setup()
    pattern = str(tmp_path / "w-{epoch:02d}-{batch:02d}-{loss:.2f}.keras")
    parallel.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(pattern, save_freq=2)])
    names = sorted(os.listdir(tmp_path))
    # 3 batches an epoch, a save every 2nd batch: after batch 2 of epoch 1, batch 1 and 3 of epoch 2.
    assert [n[:7] for n in names] == ["w-01-02", "w-02-01", "w-02-03"], names
    for name in names:
        keras.models.load_model(str(tmp_path / name))


@pytest.mark.parametrize("mode, monitor", [("min", "loss"), ("max", "neg"), ("auto", "loss"), ("auto", "val_mae")])
def test_save_best_only_keeps_the_best_epoch_in_every_mode(tmp_path, mode, monitor):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "best.keras")
    history, snapshots = [], []

    class Recorder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["neg"] = -logs["loss"]  # a metric that improves upwards
            history.append(logs[monitor])
            snapshots.append(model.predict(x, verbose=0))

    checkpoint = kerasmulti.ParallelModelCheckpoint(path, monitor=monitor, mode=mode, save_best_only=True)
    # Adam with a large rate oscillates, so the best epoch is not always the last.
    parallel.optimizer.learning_rate.assign(0.3)
    parallel.fit(x, y, epochs=6, verbose=0, validation_data=(x[:10], y[:10]), callbacks=[Recorder(), checkpoint])
    best = int(np.argmax(history) if (mode == "max") else np.argmin(history))
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), snapshots[best], rtol=1e-5, atol=1e-6)


def test_initial_value_threshold_blocks_saves_that_do_not_beat_it(tmp_path):
    _, parallel, x, y = _setup()
    path = str(tmp_path / "never.keras")
    checkpoint = kerasmulti.ParallelModelCheckpoint(path, monitor="loss", save_best_only=True, initial_value_threshold=1e-9)
    parallel.fit(x, y, epochs=2, verbose=0, callbacks=[checkpoint])
    assert not os.path.exists(path)


def test_keras2_form_with_the_template_first(tmp_path):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "old.keras")
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(model, path, monitor="loss")])
    assert keras.models.load_model(path).name == "template"


def test_behaves_like_model_checkpoint_on_a_plain_model(tmp_path):
    model, _, x, y = _setup()
    model.compile(optimizer="sgd", loss="mse")
    ours, theirs = str(tmp_path / "ours.keras"), str(tmp_path / "theirs.keras")
    model.fit(
        x, y, epochs=2, verbose=0,
        callbacks=[kerasmulti.ParallelModelCheckpoint(ours), keras.callbacks.ModelCheckpoint(theirs)],
    )
    np.testing.assert_allclose(
        keras.models.load_model(ours).predict(x, verbose=0), keras.models.load_model(theirs).predict(x, verbose=0)
    )


def test_unwritable_folder_is_refused_before_training(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(str(locked), os.W_OK):
            pytest.skip("running as a user that can write anywhere (root)")
        with pytest.raises(ValueError, match=r"cannot write checkpoints.*Received: filepath="):
            kerasmulti.ParallelModelCheckpoint(str(locked / "m.keras"))
    finally:
        locked.chmod(0o700)


def test_folder_that_is_a_file_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"cannot write checkpoints.*is not a writable folder.*Received: filepath="):
        kerasmulti.ParallelModelCheckpoint(str(blocker / "sub" / "m.keras"))


def test_weights_only_with_wrong_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must end in `.weights.h5`.*Received: filepath="):
        kerasmulti.ParallelModelCheckpoint(str(tmp_path / "m.keras"), save_weights_only=True)


def test_unknown_monitored_metric_is_refused_when_training_starts(tmp_path):
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "m.keras"), monitor="val_acuracy", save_best_only=True)
    with pytest.raises(ValueError, match=r"does not report it.*'loss', 'mae'.*Received: monitor='val_acuracy'"):
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "m.keras")
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path)])
    good = keras.models.load_model(path).predict(x, verbose=0)

    def broken_save(filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path)])
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), good)
    assert _no_temporaries(tmp_path)


@pytest.mark.parametrize("devices", [1, 3])
def test_checkpoint_from_two_devices_loads_into_other_device_counts(tmp_path, devices):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    parallel = kerasmulti.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng().normal(size=(20, 5)).astype("float32")
    path = str(tmp_path / "w.weights.h5")
    parallel.fit(x, x[:, :2], epochs=2, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path, save_weights_only=True)])
    other = kerasmulti.parallelize(keras.models.clone_model(model), gpus=devices)
    other.load_weights(path)
    np.testing.assert_allclose(other.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_other_keras_callbacks_work_on_parallel_models(tmp_path):
    model, parallel, x, y = _setup()
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.setdefault("lr", []).append(float(parallel.optimizer.learning_rate))

    callbacks = [
        keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True, min_delta=10.0),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, factor=0.5, min_delta=10.0),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        Spy(),
    ]
    start = [np.asarray(w) for w in model.weights]
    parallel.fit(x, y, epochs=10, verbose=0, callbacks=callbacks)
    assert len(seen["lr"]) == 2  # stopped after patience
    assert seen["lr"][1] < seen["lr"][0]  # the plateau lowered the rate
    # restore_best_weights put back the first epoch's weights: they moved from the start.
    assert any(not np.allclose(a, np.asarray(b)) for a, b in zip(start, model.weights))
    assert (tmp_path / "log.csv").read_text().count("\n") == 3
    assert glob.glob(str(tmp_path / "tb" / "train" / "events.out.tfevents.*"))


def _start_worker(folder, epochs, *extra, fault=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **({_faults.ENV: fault} if fault else {})}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    return subprocess.Popen(
        [sys.executable, WORKER, str(folder), str(epochs), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def _wait_for(process, line, timeout=120):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        text = process.stdout.readline()
        if not text:
            break
        seen.append(text)
        if text.strip() == line:
            return
    process.kill()
    raise AssertionError(f"worker never printed {line!r}; it printed:\n{''.join(seen)[-3000:]}")


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_torn_checkpoint(tmp_path):
    path = tmp_path / "ckpt.keras"
    rng = random.Random()
    loaded = 0
    for attempt in range(8):
        process = _start_worker(tmp_path, 1000)
        _wait_for(process, "checkpointed")
        time.sleep(rng.uniform(0.0, 1.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        temporaries = glob.glob(str(tmp_path / ".*kerasmulti-tmp*"))
        assert len(temporaries) <= 1, temporaries  # at most the write in flight
        if path.exists():
            keras.models.load_model(str(path))  # raises on a torn file
            loaded += 1
    assert loaded == 8  # every kill came after a first checkpoint, which must survive it
    process = _start_worker(tmp_path, 1)
    assert process.wait(timeout=180) == 0
    assert _no_temporaries(tmp_path), "stale temporaries were not cleaned up"
    keras.models.load_model(str(path))


@pytest.mark.slow
def test_killed_training_resumes_and_ends_with_an_uninterrupted_runs_weights(tmp_path):
    epochs = 6
    straight = tmp_path / "straight"
    process = _start_worker(straight, epochs, "--backup", "--out", str(tmp_path / "straight.npz"))
    assert process.wait(timeout=300) == 0

    resumed = tmp_path / "resumed"
    process = _start_worker(resumed, epochs, "--backup")
    _wait_for(process, "epoch 3 done")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (resumed / "backup").exists()
    process = _start_worker(resumed, epochs, "--backup", "--out", str(tmp_path / "resumed.npz"))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert "epoch 1 done" not in output and f"epoch {epochs} done" in output  # it continued, not restarted
    expected, got = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    for key in expected.files:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("backup, resumes_exactly", [("--backup", True), ("--keras-backup", False)])
def test_a_crash_between_the_backups_writes_resumes_exactly_unlike_keras(tmp_path, backup, resumes_exactly):
    # The process ends (as under SIGKILL) after epoch 2's weights are written
    # and before its epoch is recorded. ParallelBackupAndRestore keeps the
    # epoch inside the weights file; Keras' own (the control) pairs the new
    # weights with the old epoch, trains epoch 2 twice and ends elsewhere.
    epochs = 4
    straight = _start_worker(tmp_path / "straight", epochs, backup, "--out", str(tmp_path / "straight.npz"))
    assert straight.wait(timeout=300) == 0
    crashed = _start_worker(tmp_path / "resumed", epochs, backup, fault="backup:weights:2")
    output, _ = crashed.communicate(timeout=300)
    assert crashed.returncode == _faults.EXIT_CODE and "epoch 2 done" not in output, output
    resumed = _start_worker(tmp_path / "resumed", epochs, backup, "--out", str(tmp_path / "resumed.npz"))
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    expected, got = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    same = all(np.allclose(got[key], expected[key], rtol=1e-6, atol=1e-7) for key in expected.files)
    assert same is resumes_exactly


@pytest.mark.parametrize("make", [
    lambda: kerasmulti.ParallelModelCheckpoint("gs://bucket/model.keras"),
    lambda: kerasmulti.ParallelBackupAndRestore("s3://bucket/backup"),
])
def test_remote_paths_are_refused_before_training(make):
    with pytest.raises(ValueError, match=r"writes local files only.*mounted folder.*Received: (filepath|backup_dir)='(gs|s3)://"):
        make()


def test_only_this_hosts_dead_writers_temporaries_are_removed(tmp_path):
    from kerasmulti import _atomic

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid names a writer that is gone
    target = str(tmp_path / "m.keras")
    here = _atomic.temporary_path(target).replace(f"{os.getpid()}@", f"{finished.pid}@")
    elsewhere = here.replace(f"@{socket.gethostname()}-", "@another-machine-")
    running = _atomic.temporary_path(target)
    dashed = _atomic.temporary_path(str(tmp_path / "ckpt.v-2")).replace(f"{os.getpid()}@", f"{finished.pid}@")
    older = str(tmp_path / f".m.keras.kerasmulti-tmp-{finished.pid}-0123abcd.keras")  # before hosts were named
    for path in (here, elsewhere, running, dashed, older):
        open(path, "w").close()
    assert sorted(_atomic.remove_stale_temporaries(target)) == sorted([here, dashed, older])
    assert os.path.exists(elsewhere) and os.path.exists(running)
