"""ParallelBackupAndRestore: Keras' files, damaged backups, and Keras' own tests as a drop-in.

The kill-and-resume tests are in test_callbacks.py, beside the worker they share.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import json
import os
import re
import warnings
from unittest import mock

import h5py
import keras
import numpy as np
import pytest

try:
    from keras.src.callbacks import backup_and_restore_test as keras_tests
except ImportError:  # Keras' wheels ship their tests from 3.15 on
    keras_tests = None
from cases import StopAfterBatches, worker_model
from test_callbacks import _setup

import kerasmulti

FILES = ["latest.weights.h5", "latest.weights.h5.bkp", "training_metadata.json", "training_metadata.json.bkp"]


class _Interrupt(keras.callbacks.Callback):
    """Ends training with an error after `epochs` epochs (after the backup, which comes first)."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            raise RuntimeError("interrupted")


def _interrupted(backup, epochs=2, seed=0):
    """Trains a parallel model with `backup` until it is interrupted after `epochs`; returns the weights after each epoch."""
    model, parallel, x, y = _setup(seed)
    weights = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: weights.append([np.asarray(w) for w in model.weights]))
    with pytest.raises(RuntimeError, match="interrupted"):
        parallel.fit(x, y, epochs=10, verbose=0, callbacks=[backup, record, _Interrupt(epochs)])
    return weights


def _resume(backup, seed=1):
    """A fresh parallel model (other initial weights) resumed with `backup`: (first epoch run, weights at the start)."""
    model, parallel, x, y = _setup(seed)
    start = {}
    begin = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: start or start.update(epoch=e, weights=[np.asarray(w) for w in model.weights])
    )
    parallel.fit(x, y, epochs=4, verbose=0, callbacks=[backup, begin])
    return start["epoch"], start["weights"]


def _assert_weights(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def _damage(path):
    with open(path, "w") as f:
        f.write("0")  # as Keras' own test damages a backup


def _damage_inside(path):
    """Zeroes a weight's object header, as a failing disk might: the file still opens.

    (Bytes in the middle of the file may be slack, which nothing reads: the layout decides.)
    """
    with h5py.File(path, "r") as f:
        weights = []
        f["layers"].visititems(lambda name, item: weights.append(item) if isinstance(item, h5py.Dataset) else None)
        address = h5py.h5o.get_info(weights[0].id).addr
    with open(path, "r+b") as f:
        f.seek(address)
        f.write(b"\0" * 64)


@pytest.mark.parametrize("make", [keras.callbacks.BackupAndRestore, kerasmulti.ParallelBackupAndRestore])
def test_double_checkpoint_writes_the_files_keras_writes(tmp_path, make):
    _interrupted(make(str(tmp_path), double_checkpoint=True))
    assert sorted(os.listdir(tmp_path)) == FILES
    with open(tmp_path / "training_metadata.json.bkp") as f:
        assert json.load(f)["epoch"] == 1


def test_callback_model_is_the_model_being_trained(tmp_path):
    _, parallel, x, y = _setup()
    backup = kerasmulti.ParallelBackupAndRestore(str(tmp_path / "backup"))
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[backup])
    assert backup.model is parallel


@pytest.mark.parametrize("damaged, damage", [
    ("latest.weights.h5", _damage), ("training_metadata.json", _damage),
    # Keras reads it as weights that do not fit the model: it is damage all the same.
    ("latest.weights.h5", _damage_inside),
])
def test_a_damaged_backup_falls_back_to_the_previous_one_with_a_warning(tmp_path, damaged, damage):
    if damaged == "training_metadata.json":
        # ParallelBackupAndRestore reads the epoch from inside its weights file;
        # Keras' weights file has none, so Keras' JSON file is what counts.
        weights = _interrupted(keras.callbacks.BackupAndRestore(str(tmp_path), double_checkpoint=True))
    else:
        weights = _interrupted(kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True))
    damage(tmp_path / damaged)
    backup = kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True, delete_checkpoint=False)
    with pytest.warns(UserWarning, match=rf"The backup '.*{damaged}' is damaged .*resuming from the previous one\. Received: backup_dir="):
        epoch, start = _resume(backup)
    assert epoch == 1  # the previous backup: after the first epoch
    _assert_weights(start, weights[0])
    assert sorted(os.listdir(tmp_path)) == FILES


@pytest.mark.parametrize("fields, valid", [
    ({"epoch": 1, "step": 2, "steps": 10, "logs": {"loss": 0.5}}, True),
    ({"epoch": 1, "step": 2, "steps": "10"}, False),
    ({"epoch": 1, "step": 2, "logs": {"loss": "0.5"}}, False),
    ({"epoch": 1, "logs": [0.5]}, False),
])
def test_a_position_whose_steps_or_logs_are_not_what_a_backup_writes_is_damage(tmp_path, fields, valid):
    from kerasmulti._src.callbacks import backup_files

    weights, metadata = str(tmp_path / "latest.weights.h5"), str(tmp_path / "training_metadata.json")
    with h5py.File(weights, "w") as f:
        f.attrs[backup_files.METADATA] = json.dumps(fields)
    if valid:
        assert backup_files.read_metadata(weights, metadata) == fields
        return
    with pytest.raises(backup_files.Damaged, match=r"it holds no epoch number"):
        backup_files.read_metadata(weights, metadata)


def test_a_damaged_epoch_file_beside_intact_weights_costs_nothing(tmp_path):
    # Ours carry the epoch inside the weights file, replaced atomically: the JSON (for Keras) is not needed.
    weights = _interrupted(kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True))
    _damage(tmp_path / "training_metadata.json")
    epoch, start = _resume(kerasmulti.ParallelBackupAndRestore(str(tmp_path)))
    assert epoch == 2
    _assert_weights(start, weights[1])


@pytest.mark.parametrize("damaged, writer", [
    ("latest.weights.h5", kerasmulti.ParallelBackupAndRestore),
    ("training_metadata.json", keras.callbacks.BackupAndRestore),
])
def test_a_damaged_backup_without_a_previous_one_stops_naming_the_file(tmp_path, damaged, writer):
    _interrupted(writer(str(tmp_path)))
    _damage(tmp_path / damaged)
    match = rf"cannot resume: '.*{damaged}' is damaged \(.*\) and there is no previous backup\. Delete backup_dir to start over\. Received: backup_dir='{re.escape(str(tmp_path))}'"
    with pytest.raises(OSError, match=match):
        _resume(kerasmulti.ParallelBackupAndRestore(str(tmp_path)))


def test_resuming_a_changed_model_is_refused_naming_the_backup_and_the_fix(tmp_path):
    folder = str(tmp_path / "backup")
    _interrupted(kerasmulti.ParallelBackupAndRestore(folder))
    before = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
    _, changed, x, y = _setup(outputs=2)  # the last layer has 2 units now, not 1
    with pytest.raises(ValueError) as raised:
        changed.fit(x, y, epochs=2, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(folder)])
    message = str(raised.value)
    assert "cannot resume from" in message and "latest.weights.h5" in message
    assert "variable.shape=(8, 2), Received: value.shape=(8, 1)" in message
    assert "delete backup_dir to start over" in message and message.endswith(f"Received: backup_dir={folder!r}")
    assert "Target variable" not in message  # Keras' dump of the values is left out
    assert {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)} == before


def test_both_backups_damaged_stops_naming_both(tmp_path):
    _interrupted(kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True))
    _damage(tmp_path / "latest.weights.h5")
    _damage(tmp_path / "latest.weights.h5.bkp")
    with pytest.warns(UserWarning, match="resuming from the previous one"):
        with pytest.raises(OSError, match=r"'.*latest.weights.h5' and the previous backup are both damaged.*Delete backup_dir.*Received: backup_dir="):
            _resume(kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True))


def test_plain_keras_resumes_from_the_previous_backup_after_damage(tmp_path):
    # Needs training_metadata.json.bkp: without it Keras drops the epoch and starts over from epoch 0.
    model, parallel, x, y = _setup()
    weights = _interrupted(kerasmulti.ParallelBackupAndRestore(str(tmp_path), double_checkpoint=True))
    _damage(tmp_path / "latest.weights.h5")
    plain = keras.models.clone_model(model)
    plain.compile(optimizer="adam", loss="mse", metrics=["mae"])
    start = {}
    begin = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: start or start.update(epoch=e, weights=[np.asarray(w) for w in plain.weights])
    )
    plain.fit(x, y, epochs=4, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), double_checkpoint=True), begin])
    assert start["epoch"] == 1
    _assert_weights(start["weights"], weights[0])


def test_resumes_from_a_backup_plain_keras_wrote(tmp_path):
    weights = _interrupted(keras.callbacks.BackupAndRestore(str(tmp_path)))
    epoch, start = _resume(kerasmulti.ParallelBackupAndRestore(str(tmp_path)))
    assert epoch == 2
    _assert_weights(start, weights[1])


@pytest.mark.parametrize("backup_dir, error, message", [
    (3, TypeError, r"must be a folder path.*Received: backup_dir=3"),
    ("", ValueError, r"Empty `backup_dir` argument passed: .*needs a folder to keep its backup in, such as 'backup'.*Received: backup_dir=''"),
    (None, ValueError, r"needs a folder to keep its backup in.*Received: backup_dir=None"),
    ("s3://bucket/backup", ValueError, r"writes local files only.*Received: backup_dir='s3://bucket/backup'"),
])
def test_bad_backup_dirs_are_refused_at_construction(backup_dir, error, message):
    with pytest.raises(error, match=message):
        kerasmulti.ParallelBackupAndRestore(backup_dir)


@pytest.mark.parametrize("keywords, error, message", [
    ({"save_freq": 0}, ValueError, r"save_freq: it must be 'epoch' or a positive int.*Received: save_freq=0"),
    ({"save_freq": -3}, ValueError, r"Received: save_freq=-3"),
    ({"double_checkpoint": "no"}, TypeError, r"double_checkpoint must be True or False.*Received: double_checkpoint='no'"),
    ({"delete_checkpoint": 1}, TypeError, r"delete_checkpoint must be True or False.*Received: delete_checkpoint=1"),
])
def test_bad_options_are_refused_at_construction(keywords, error, message):
    with pytest.raises(error, match=message):
        kerasmulti.ParallelBackupAndRestore("backup", **keywords)


def test_a_weights_file_that_no_backup_wrote_is_refused_saying_so(tmp_path):
    model, *_ = _setup(0)
    model.save_weights(str(tmp_path / "latest.weights.h5"))
    with pytest.raises(OSError, match=r"'.*latest.weights.h5' is damaged \(it holds no epoch, and there is no "
                       r"training_metadata.json beside it: a weights file that no backup callback wrote"):
        _resume(kerasmulti.ParallelBackupAndRestore(str(tmp_path)))


@pytest.mark.parametrize("save_freq", ["batch", 1.5, None, True, False])
def test_a_save_freq_that_is_neither_epoch_nor_a_positive_int_is_refused(save_freq):
    # Keras' own says only "Invalid value", and takes a bool as 0 or 1 batches.
    with pytest.raises(ValueError, match=rf"save_freq: it must be 'epoch' or a positive int\. Received: save_freq={re.escape(repr(save_freq))}$"):
        kerasmulti.ParallelBackupAndRestore("backup", save_freq=save_freq)


@pytest.mark.filterwarnings("ignore:The backup '.*' is damaged:UserWarning")  # test_backup_corrupted's
@pytest.mark.skipif(keras_tests is None, reason="this Keras wheel ships no keras/src/callbacks/backup_and_restore_test.py")
class TestKerasOwnTestsOnParallelBackupAndRestore(keras_tests.BackupAndRestoreCallbackTest if keras_tests else object):
    """Keras' BackupAndRestore tests, run with ParallelBackupAndRestore in its place: a drop-in."""

    def setUp(self):
        super().setUp()
        swap = mock.patch.object(keras_tests.callbacks, "BackupAndRestore", kerasmulti.ParallelBackupAndRestore)
        swap.start()
        self.addCleanup(swap.stop)

    def test_best_case_step(self):
        # Keras' test expects the interrupted epoch run again from its first
        # batch (17 steps counted); ParallelBackupAndRestore resumes at the
        # step after the backup, so each of the 3 + 4 * 3 steps counts once.
        backup_dir = os.path.join(self.get_temp_dir(), "subdir")
        model = self.make_model()
        backup = kerasmulti.ParallelBackupAndRestore(backup_dir, save_freq=1)
        x, y = np.random.random((10, 3)), np.random.random((10, 1))
        with pytest.raises(RuntimeError, match="StepsInterruption"):
            stop = keras_tests.InterruptingCallback(steps_int=2, epoch_int=None)
            model.fit(x, y, batch_size=4, callbacks=[backup, stop], epochs=2, verbose=0)
        assert int(model.layers[0].counter.value) == 2
        history = model.fit(x, y, batch_size=4, callbacks=[backup], epochs=5, verbose=0)
        assert history.epoch == [0, 1, 2, 3, 4]
        assert int(model.layers[0].counter.value) == 15


def test_a_backup_whose_seed_states_do_not_fit_the_model_is_refused(tmp_path):
    # Weights that still load (Dropout has none), seeded layers that changed.
    def build(dropout):
        keras.utils.set_random_seed(0)
        extra = [keras.layers.Dropout(0.5)] if dropout else []
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), *extra, keras.layers.Dense(1)])
        parallel = kerasmulti.parallelize(model, gpus=2)
        parallel.compile(optimizer="sgd", loss="mse")
        return parallel

    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(RuntimeError, match="interrupted"):
        build(False).fit(x, y, epochs=3, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(str(tmp_path)), _Interrupt(1)])
    with pytest.raises(ValueError, match=r"does not fit the model being trained.*\(its seed states do not match the "
                       r"model's \(0 saved, 1 now\)\)\. Build the model as it was, or delete backup_dir to start over\. Received: backup_dir="):
        build(True).fit(x, y, epochs=3, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(str(tmp_path))])


@pytest.mark.parametrize("save_freq, stop, calls_before, steps_seen", [
    (1, dict(steps_int=2, epoch_int=None), 2 * 3, list(range(2, 15))),  # resumes at step 3 of 15
    ("epoch", dict(steps_int=None, epoch_int=2), 6 * 3, list(range(6, 15))),  # resumes at epoch 3
], ids=["step", "epoch"])
@pytest.mark.skipif(keras_tests is None, reason="this Keras wheel ships no keras/src/callbacks/backup_and_restore_test.py")
def test_keras_own_counter_tests_on_a_parallel_model(tmp_path, save_freq, stop, calls_before, steps_seen):
    # Keras' test_best_case_step and test_best_case_epoch, on parallelize(model, gpus=3): its
    # CanaryLayer counts calls, 3 a step (one per replica; the step is traced for any batch
    # size, so the last batch's 2 rows leave one replica an empty part), none from the
    # row-mixing probe; the counter is restored with the weights; callbacks see each step once.
    template = keras.Sequential([keras.Input((3,)), keras_tests.CanaryLayer(), keras.layers.Dense(1)])
    model = kerasmulti.parallelize(template, gpus=3)
    model.compile(loss="mse", optimizer="sgd", metrics=["mse"])
    backup = kerasmulti.ParallelBackupAndRestore(str(tmp_path / "subdir"), save_freq=save_freq)
    x, y = np.random.default_rng().random((10, 3)), np.random.default_rng().random((10, 1))
    with pytest.raises(RuntimeError, match="Interruption"):
        model.fit(x, y, batch_size=4, callbacks=[backup, keras_tests.InterruptingCallback(**stop)], epochs=6, verbose=0)
    assert int(template.layers[0].counter.value) == calls_before
    seen = []
    steps = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(int(model.optimizer.iterations.numpy())))
    history = model.fit(x, y, batch_size=4, callbacks=[backup, steps], epochs=5, verbose=0)
    assert history.epoch[-1] == 4 and seen == steps_seen
    assert int(template.layers[0].counter.value) == 15 * 3  # every step of 5 epochs, once


def _two_fits(tmp_path, make, stop_after, save_freq=5, others=list, between=None, **fit):
    """An uninterrupted fit's history and weights, and those of one stopped after `stop_after` batches and resumed.

    `others()`: the other callbacks of each fit; `between(backup_dir)` runs before the resumed one.
    """
    x, y = np.random.default_rng().normal(size=(40, 5)), np.random.default_rng().normal(size=(40, 1))
    fit = dict(x=x, y=y, batch_size=4, epochs=3, shuffle=False, verbose=0, **fit)
    straight = make()
    history = straight.fit(**fit, callbacks=others()).history
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped"):
        make().fit(**fit, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=save_freq), *others(),
                                     StopAfterBatches(stop_after)])
    if between is not None:
        between(backup)
    resumed = make()
    callbacks = [kerasmulti.ParallelBackupAndRestore(backup, save_freq=save_freq), *others()]
    resumed_history = resumed.fit(**fit, callbacks=callbacks).history
    return (history, straight), (resumed_history, resumed)


def test_a_learning_rate_set_from_its_value_as_an_epoch_begins_is_set_once_in_a_resumed_epoch(tmp_path):
    # The resumed epoch's on_epoch_begin ran again after the backup was read: halved twice (0.00625, not 0.0125).
    halving = lambda: [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)]  # noqa: E731
    # 10 batches an epoch, a backup every 5: resumed in the middle of the second epoch.
    (history, straight), (resumed_history, resumed) = _two_fits(tmp_path, _parallel, stop_after=17, others=halving)
    assert float(resumed.optimizer.learning_rate.numpy()) == float(straight.optimizer.learning_rate.numpy())
    assert float(straight.optimizer.learning_rate.numpy()) == pytest.approx(0.01 / 8)
    assert resumed_history["loss"] == pytest.approx(history["loss"][1:], rel=1e-6)
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def _plain(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _parallel(seed=3):
    return kerasmulti.parallelize(_plain(seed), gpus=2)


def test_a_backup_of_an_epochs_last_batch_resumes_with_that_epochs_metrics_as_its_logs(tmp_path):
    # The resumed epoch passes over all its batches and runs no step; its logs are the saved metrics.
    (history, straight), (resumed_history, resumed) = _two_fits(tmp_path, _parallel, stop_after=10)
    assert resumed_history["loss"] == pytest.approx(history["loss"], rel=1e-6)
    assert resumed_history["mae"] == pytest.approx(history["mae"], rel=1e-6)
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_a_backup_without_metrics_resumes_an_epoch_with_no_batch_left_with_its_last_steps_logs(tmp_path):
    # Across workers no metric is saved (each worker holds its part of one): the resumed epoch logged
    # loss 0.0, a value EarlyStopping would take for the best (found by review across 2 workers).
    def as_across_workers(backup):
        with h5py.File(os.path.join(backup, "latest.weights.h5"), "a") as f:
            metrics = f["kerasmulti_state/metrics"]
            assert len(metrics)
            for name in list(metrics):
                del metrics[name]

    (history, _), (resumed_history, _) = _two_fits(tmp_path, _parallel, stop_after=10, between=as_across_workers)
    assert resumed_history["loss"] == pytest.approx(history["loss"], rel=1e-6)
    assert resumed_history["mae"] == pytest.approx(history["mae"], rel=1e-6)


def test_a_plain_keras_model_resumes_its_optimizers_state_from_a_parallel_backup(tmp_path):
    # Keras' load_weights skips an optimizer it has not built; the backup builds it first.
    (history, straight), (resumed_history, resumed) = _two_fits(tmp_path, _plain, stop_after=6)
    assert int(resumed.optimizer.iterations.numpy()) == int(straight.optimizer.iterations.numpy()) == 30
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_a_backup_between_two_calls_of_a_new_steps_per_execution_is_refused(tmp_path):
    x, y = np.random.default_rng().normal(size=(40, 5)), np.random.default_rng().normal(size=(40, 1))
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped"):
        _parallel().fit(x, y, batch_size=4, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=3), StopAfterBatches(4)])
    model = _plain()
    model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    parallel = kerasmulti.parallelize(model, gpus=2)
    with pytest.raises(ValueError, match=r"resumes after step 3, which steps_per_execution=2 does not reach.*"
                       r"Received: steps_per_execution=2"):
        parallel.fit(x, y, batch_size=4, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=3)])


def test_a_mid_epoch_backup_resumed_with_another_batch_size_is_refused_before_the_model_is_touched(tmp_path):
    # Step 6 of 10 batches of 4 is row 24; with batches of 8 it would have named row 48 (found by review:
    # an epoch of 5 steps passed over all of them, and 24 of its 40 rows were never trained).
    x, y = np.random.default_rng().normal(size=(40, 5)), np.random.default_rng().normal(size=(40, 1))
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped"):
        _parallel().fit(x, y, batch_size=4, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=3), StopAfterBatches(7)])
    parallel = _parallel(seed=4)
    before = [np.array(w) for w in parallel.weights]
    with pytest.raises(ValueError, match=r"^ParallelBackupAndRestore cannot resume after step 6 of 10: this fit's epochs "
                       r"have 5 steps\. Fit with the batch_size and data of the backup, or delete backup_dir\. Received: steps=5$"):
        parallel.fit(x, y, batch_size=8, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=3)])
    for a, b in zip(before, parallel.weights):
        np.testing.assert_array_equal(np.asarray(b), a)
    # The batch size it was written with resumes from it.
    resumed = _parallel(seed=4)
    resumed.fit(x, y, batch_size=4, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=3)])
    assert int(resumed.optimizer.iterations.numpy()) == 10


class _Batches(keras.utils.PyDataset):
    """10 batches of 4 rows, each always the same."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x) // 4

    def __getitem__(self, index):
        self.read.append(index)
        return self.x[4 * index: 4 * index + 4], self.y[4 * index: 4 * index + 4]


@pytest.mark.parametrize("kind", ["one process", "a worker's replicas"])
def test_a_pydataset_that_fit_shuffles_resumes_exactly(tmp_path, kind):
    # Keras shuffles a PyDataset's batches with no seed: the resumed epoch read other batches (0.038 off);
    # across workers each worker counted its epochs from 0 again.
    x, y = np.random.default_rng().normal(size=(40, 5)), np.random.default_rng().normal(size=(40, 1))
    fit = dict(epochs=3, verbose=0)  # shuffle=True, fit's default
    make = _parallel if kind == "one process" else (lambda: worker_model(_plain()))
    straight, batches = make(), _Batches(x, y)
    straight.fit(batches, callbacks=[kerasmulti.ParallelBackupAndRestore(str(tmp_path / "straight"))], **fit)
    epochs = [batches.read[-30:][i:i + 10] for i in range(0, 30, 10)]  # (Keras reads a batch or two first, for its spec)
    assert all(sorted(e) == list(range(10)) for e in epochs) and len({tuple(e) for e in epochs}) == 3  # shuffled anew
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped"):
        make().fit(_Batches(x, y), callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=5),
                                                   StopAfterBatches(17)], **fit)
    resumed = make()
    resumed.fit(_Batches(x, y), callbacks=[kerasmulti.ParallelBackupAndRestore(backup, save_freq=5)], **fit)
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def _deciders():
    """Callbacks that decide from past epochs; no epoch improves on the first by 10."""
    return [keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=10.0, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=10.0)]


def test_early_stopping_and_reduce_lr_on_plateau_resume_with_their_patience(tmp_path):
    # Their counters started afresh in the resumed run: it reduced later and stopped later (2 epochs more).
    x, y = np.random.default_rng().normal(size=(40, 5)), np.random.default_rng().normal(size=(40, 1))
    fit = dict(x=x, y=y, batch_size=8, epochs=10, shuffle=False, verbose=0)
    straight = _parallel()
    epochs = straight.fit(**fit, callbacks=_deciders()).epoch
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _parallel().fit(**fit, callbacks=[*_deciders(), kerasmulti.ParallelBackupAndRestore(backup), _Interrupt(2)])
    resumed = _parallel()
    deciders = _deciders()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = resumed.fit(**fit, callbacks=[*deciders, kerasmulti.ParallelBackupAndRestore(backup)]).epoch
    assert not [w for w in caught if "backs up at an epoch's end" in str(w.message)]  # the backup after them
    assert epochs == [0, 1, 2, 3] and rest == [2, 3]  # stopped where the uninterrupted run stopped
    assert deciders[0].best_epoch == 0 and deciders[0].best_weights is not None  # restored at the end, as straight
    assert float(resumed.optimizer.learning_rate.numpy()) == pytest.approx(float(straight.optimizer.learning_rate.numpy()))
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_a_backup_before_callbacks_whose_state_it_keeps_is_warned_about(tmp_path):
    x, y = np.ones((8, 5)), np.ones((8, 1))
    with pytest.warns(UserWarning, match=r"backs up at an epoch's end before \['EarlyStopping'\] update their state, "
                                         r"so a resumed run misses that epoch's\. Put it after them in callbacks\. "
                                         r"Received: callbacks=\['EarlyStopping'\]"):
        _parallel().fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelBackupAndRestore(str(tmp_path / "b")),
                                                              keras.callbacks.EarlyStopping(monitor="loss")])


def test_a_pydataset_read_in_part_each_epoch_keeps_kerass_own_order():
    # With fewer steps_per_epoch Keras goes on with one iterator across epochs: an order drawn anew
    # each epoch mixed two orders in one pass (one batch twice, another never).
    from kerasmulti._src.data_parallel import epoch_order

    batches = _Batches(np.zeros((24, 5)), np.zeros((24, 1)))
    assert epoch_order.resumable(batches) and epoch_order.resumable(batches, 6)
    assert not epoch_order.resumable(batches, 3)
