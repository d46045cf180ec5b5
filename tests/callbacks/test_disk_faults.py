"""A full disk, a read-only folder, a vanished folder: every save fails clearly and loses nothing.

Each test writes on a small tmpfs of its own (mounting one needs root, as CI
runs; elsewhere they are skipped), fills it or turns it read-only after a
first good save, and checks the error, the previous file, and that the same
call resumes once the disk is fixed.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import contextlib
import errno
import os
import shutil
import subprocess

import keras
import numpy as np
import pytest
from test_callbacks import _no_temporaries, _setup

import kerasmulti


@pytest.fixture
def disk(tmp_path):
    """A 2 MB tmpfs folder; `disk.fill()` takes all its space, `disk.read_only()` remounts it read-only."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root is needed): {mounted.stderr.decode().strip()}")
    try:
        yield _Disk(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


class _Disk:
    def __init__(self, folder):
        self.folder = folder

    def fill(self):
        with open(self.folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)

    def free(self):
        os.remove(self.folder / "filler")

    def read_only(self):
        subprocess.run(["mount", "-o", "remount,ro", str(self.folder)], check=True)

    def writable(self):
        subprocess.run(["mount", "-o", "remount,rw", str(self.folder)], check=True)


class _After(keras.callbacks.Callback):
    """Breaks the disk at the end of the first epoch, after that epoch's save (callbacks run in order)."""

    def __init__(self, action):
        super().__init__()
        self.action = action

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.action()


BROKEN = {
    "full": ("fill", errno.ENOSPC, "No space left on device", "Free some space"),
    "read-only": ("read_only", errno.EROFS, "Read-only file system", "remount it writable"),
}


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"])
def test_a_checkpoint_on_a_broken_disk_fails_clearly_and_keeps_the_last_good_file(disk, broken, name):
    model, parallel, x, y = _setup()
    path = str(disk.folder / "sub" / name)
    saved = []
    checkpoint = kerasmulti.ParallelModelCheckpoint(path, save_weights_only=name.endswith(".weights.h5"))
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: saved.append(model.get_weights()))
    action, code, reason, fix = BROKEN[broken]
    with pytest.raises(OSError) as raised:
        parallel.fit(x, y, epochs=3, verbose=0, callbacks=[checkpoint, record, _After(getattr(disk, action))])
    assert raised.value.errno == code
    message = str(raised.value)
    assert f"ParallelModelCheckpoint could not write '{path}' ({reason})" in message
    assert "kept as it was" in message and fix in message and f"Received: filepath={path!r}" in message
    assert len(saved) == 1  # the second epoch's save failed
    fresh = keras.models.clone_model(model)
    fresh.load_weights(path) if name.endswith(".weights.h5") else fresh.set_weights(keras.models.load_model(path).get_weights())
    for got, expected in zip(fresh.get_weights(), saved[0]):
        np.testing.assert_array_equal(got, expected)
    assert _no_temporaries(disk.folder / "sub")


def test_folders_removed_during_training_are_made_again_at_the_next_save(tmp_path):
    model, parallel, x, y = _setup()
    path, backup_dir = tmp_path / "checkpoints" / "m.keras", tmp_path / "backup"
    removed = _After(lambda: [shutil.rmtree(folder) for folder in (path.parent, backup_dir)])
    callbacks = [
        kerasmulti.ParallelModelCheckpoint(str(path)),
        kerasmulti.ParallelBackupAndRestore(str(backup_dir), delete_checkpoint=False),
        removed,
    ]
    parallel.fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    for got, expected in zip(keras.models.load_model(str(path)).get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)
    assert sorted(os.listdir(backup_dir)) == ["latest.weights.h5", "training_metadata.json"]


@pytest.mark.parametrize("broken", BROKEN)
def test_a_backup_on_a_broken_disk_fails_clearly_and_the_same_fit_resumes_when_fixed(disk, broken):
    backup_dir = str(disk.folder / "backup")
    fit = dict(epochs=3, batch_size=10, shuffle=False, verbose=0)
    model, parallel, x, y = _setup(seed=3)
    uninterrupted = keras.models.clone_model(model)
    uninterrupted.set_weights(model.get_weights())
    uninterrupted.compile(optimizer="adam", loss="mse", metrics=["mae"])
    uninterrupted.fit(x, y, **fit)
    action, code, reason, fix = BROKEN[broken]
    with pytest.raises(OSError) as raised:
        parallel.fit(x, y, callbacks=[kerasmulti.ParallelBackupAndRestore(backup_dir), _After(getattr(disk, action))], **fit)
    assert raised.value.errno == code
    message = str(raised.value)
    assert f"ParallelBackupAndRestore could not write '{backup_dir}/latest.weights.h5' ({reason})" in message
    assert fix in message and "running the same fit() again resumes" in message
    assert f"Received: backup_dir={backup_dir!r}" in message
    disk.free() if broken == "full" else disk.writable()
    # The same call, in a fresh process's place: a new model with other
    # weights, resumed from the first epoch's backup.
    model, parallel, _, _ = _setup(seed=4)
    epochs = []
    started = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs.append(e))
    parallel.fit(x, y, callbacks=[kerasmulti.ParallelBackupAndRestore(backup_dir), started], **fit)
    assert epochs == [1, 2]
    for got, expected in zip(model.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_read_only_file_system_is_named_as_such_at_construction(disk):
    disk.read_only()
    try:
        for make, name in (
            (lambda: kerasmulti.ParallelModelCheckpoint(str(disk.folder / "m.keras")), "filepath"),
            (lambda: kerasmulti.ParallelBackupAndRestore(str(disk.folder / "backup")), "backup_dir"),
        ):
            with pytest.raises(ValueError, match=rf"cannot write into '.*disk': its file system is read-only\. Pick another folder\. Received: {name}="):
                make()
    finally:
        disk.writable()


def _no_file_there(path):
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


def test_a_folder_that_takes_no_file_is_not_said_to_be_removed(tmp_path):
    # /proc, for root (who passes the construction's permission check), refuses a new file with ENOENT.
    from kerasmulti._src.utils import atomic

    target = str(tmp_path / "m.keras")
    with pytest.raises(FileNotFoundError, match=r"\(No such file or directory\).*Its folder takes no new files.*Received: x=1"):
        atomic.write(target, _no_file_there, "ParallelModelCheckpoint", "x=1")

    def removed(path):
        shutil.rmtree(tmp_path)
        _no_file_there(path)

    with pytest.raises(FileNotFoundError, match="Its folder was removed while the file was written"):
        atomic.write(target, removed, "ParallelModelCheckpoint", "x=1")


@pytest.mark.skipif(os.geteuid() != 0, reason="others are refused when the callback is made (test_callbacks.py)")
def test_a_checkpoint_under_proc_fails_at_its_first_save_saying_why():
    model, parallel, x, y = _setup()
    path = f"/proc/kerasmulti-test-{os.getpid()}.keras"
    with pytest.raises(FileNotFoundError, match=f"could not write '{path}'.*Its folder takes no new files"):
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path)])
    assert not os.path.exists(path)
