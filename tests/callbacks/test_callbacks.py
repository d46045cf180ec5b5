"""ParallelModelCheckpoint and ParallelBackupAndRestore on parallel models."""

from simulated import DEVICES

import glob
import inspect
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import kerasmulti
from kerasmulti._src.utils import fault_points as _fault_points

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "train_checkpointed.py")


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
    checkpoint = kerasmulti.ParallelModelCheckpoint(path, monitor="loss")
    parallel.fit(x, y, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.model is parallel  # Keras' convention: the model being trained
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


@pytest.mark.parametrize("form", ["positional", "keywords", "parallel first"])
def test_keras2_form_with_the_template_first(tmp_path, form):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "old.keras")
    checkpoint = {
        "positional": lambda: kerasmulti.ParallelModelCheckpoint(model, path, "loss", 0, True),
        "keywords": lambda: kerasmulti.ParallelModelCheckpoint(model, filepath=path, monitor="loss", save_best_only=True),
        "parallel first": lambda: kerasmulti.ParallelModelCheckpoint(parallel, path, monitor="loss", save_best_only=True),
    }[form]()
    assert (checkpoint.filepath, checkpoint.monitor, checkpoint.save_best_only) == (path, "loss", True)
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
    assert checkpoint.model is parallel
    assert keras.models.load_model(path).name == "template"


def test_keras2_form_saves_another_model_as_it_is(tmp_path):
    model, parallel, x, y = _setup()
    body = keras.Model(model.inputs, model.layers[0].output, name="body")  # shares the first layer
    path = str(tmp_path / "body.keras")
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(body, path, monitor="loss")])
    loaded = keras.models.load_model(path)
    assert loaded.name == "body"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), body.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


class _NoConfig(keras.Model):
    """A subclassed model Keras cannot write whole: an argument it cannot serialise leaves it without get_config()."""

    def __init__(self, body, extra):
        super().__init__(name="no_config")  # Keras' default, "__no_config", is no valid name scope
        self.body, self.head, self.extra = body, keras.layers.Dense(1), extra

    def call(self, x):
        return self.head(self.body(x))


def test_keras2_form_saves_a_functional_sub_model_of_a_model_without_get_config(tmp_path):
    # Only the model saved must be writable whole: here the sub-model, not the model trained.
    keras.utils.set_random_seed(0)
    body = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)], name="body")
    trained = _NoConfig(body, extra=object())
    trained(np.zeros((1, 5), "float32"))
    with pytest.raises(NotImplementedError):
        trained.get_config()
    parallel = kerasmulti.parallelize(trained, gpus=DEVICES)
    parallel.compile(optimizer="adam", loss="mse")
    x, y = np.random.default_rng().normal(size=(2, 12, 5)).astype("float32")
    path = str(tmp_path / "body.keras")
    parallel.fit(x, y[:, :1], epochs=2, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(body, path, monitor="loss")])
    loaded = keras.models.load_model(path)
    assert loaded.name == "body"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), body.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"cannot save the whole 'no_config': its class has no get_config\(\)"):  # the model trained, whole
        parallel.fit(x, y[:, :1], epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(str(tmp_path / "all.keras"))])


def _optimizer_values(optimizer):
    return [np.asarray(v) for v in optimizer.variables]


def test_two_parallel_models_of_one_template_each_save_their_own_compile(tmp_path):
    # p2.compile recompiles the shared template: p1's files still hold what p1 trains with, Adam and mse.
    model, p1, x, y = _setup()
    p2 = kerasmulti.parallelize(model, gpus=DEVICES)
    p2.compile(optimizer=keras.optimizers.SGD(0.01), loss="mae")
    model.evaluate(x, y, verbose=0)  # the template's own traced step, which must outlive the saves
    sgd, config, step = model.optimizer, model.get_compile_config(), model.test_function
    path = str(tmp_path / "p1.keras")
    with pytest.warns(UserWarning, match=r"compiled after the parallel model, directly or through another parallel model: this one trains and saves with its own compile;.*Received: template.optimizer=SGD$"):
        p1.fit(x, y, epochs=2, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path, monitor="loss")])
    p1.save(str(tmp_path / "saved.keras"))
    for name in ("p1.keras", "saved.keras"):
        loaded = keras.models.load_model(str(tmp_path / name))
        assert isinstance(loaded.optimizer, keras.optimizers.Adam) and loaded.loss == "mse"
        assert int(loaded.optimizer.iterations) == int(p1.optimizer.iterations) > 0
        for a, b in zip(_optimizer_values(loaded.optimizer), _optimizer_values(p1.optimizer)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    p2.save(str(tmp_path / "p2.keras"))
    loaded = keras.models.load_model(str(tmp_path / "p2.keras"))
    assert isinstance(loaded.optimizer, keras.optimizers.SGD) and loaded.loss == "mae"
    # Weights files and load_weights (what backups use) are p1's too; the template is left as p2 compiled it.
    weights = str(tmp_path / "p1.weights.h5")
    p1.save_weights(weights)
    adam = _optimizer_values(p1.optimizer)
    p1.fit(x, y, epochs=1, verbose=0)
    p1.load_weights(weights)
    for a, b in zip(_optimizer_values(p1.optimizer), adam):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert model.optimizer is sgd and model.loss == "mae" and model.get_compile_config() == config
    assert model.test_function is step is not None and int(sgd.iterations) == 0
    model.fit(x, y, epochs=1, verbose=0)
    assert int(sgd.iterations) > 0


def test_the_signature_is_model_checkpoints():
    def described(cls):
        return [(p.name, p.default, p.kind) for p in inspect.signature(cls).parameters.values()]

    assert described(kerasmulti.ParallelModelCheckpoint) == described(keras.callbacks.ModelCheckpoint)
    assert described(kerasmulti.ParallelBackupAndRestore) == described(keras.callbacks.BackupAndRestore)


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


@pytest.mark.parametrize("real", [True, False], ids=["chmod", "os.access"])
def test_unwritable_folder_is_refused_before_training(tmp_path, monkeypatch, real):
    locked = tmp_path / "locked"
    locked.mkdir()
    if real:
        locked.chmod(0o500)
        if os.access(str(locked), os.W_OK):
            locked.chmod(0o700)
            pytest.skip("running as a user that can write anywhere (root)")
    else:  # what a non-root user sees, for a root test run
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and path != str(locked))
    try:
        for make in (
            lambda: kerasmulti.ParallelModelCheckpoint(str(locked / "sub" / "m.keras")),
            lambda: kerasmulti.ParallelBackupAndRestore(str(locked / "backup")),
        ):
            with pytest.raises(ValueError, match=rf"cannot write into '{re.escape(str(locked))}': .*permission.*Received: (filepath|backup_dir)="):
                make()
    finally:
        locked.chmod(0o700)


def test_folder_that_is_a_file_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for make, name in (
        (lambda: kerasmulti.ParallelModelCheckpoint(str(blocker / "sub" / "m.keras")), "filepath"),
        (lambda: kerasmulti.ParallelBackupAndRestore(str(blocker / "backup")), "backup_dir"),
        (lambda: kerasmulti.ParallelBackupAndRestore(str(blocker)), "backup_dir"),
    ):
        with pytest.raises(ValueError, match=rf"cannot create the folder for its {name}: '{re.escape(str(blocker))}' is a file.*Received: {name}="):
            make()


def test_existing_folder_as_filepath_is_refused_before_training(tmp_path):
    folder = tmp_path / "model.keras"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"filepath is an existing folder, where a file must go.*Received: filepath='{re.escape(str(folder))}'"):
        kerasmulti.ParallelModelCheckpoint(str(folder))


def test_a_filled_in_filepath_that_is_a_folder_fails_naming_it(tmp_path):
    _, parallel, x, y = _setup()
    (tmp_path / "2.keras").mkdir()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "{epoch}.keras"))
    with pytest.raises(IsADirectoryError, match=r"filled-in filepath '.*/2.keras' is a folder.*Received: filepath='.*/\{epoch\}.keras'"):
        parallel.fit(x, y, epochs=2, verbose=0, callbacks=[checkpoint])
    assert (tmp_path / "1.keras").is_file() and _no_temporaries(tmp_path)


def test_missing_folders_are_created(tmp_path):
    _, parallel, x, y = _setup()
    path = tmp_path / "a" / "b" / "m-{epoch}.keras"
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(str(path))])
    keras.models.load_model(str(tmp_path / "a" / "b" / "m-1.keras"))


BAD_ARGUMENTS = [
    # (arguments, keywords, error, message)
    ((), {}, TypeError, r"missing 1 required positional argument: 'filepath'"),  # Python's, as for ModelCheckpoint
    (("MODEL",), {}, TypeError, r"got a model but no filepath.*\(model, 'model.keras'\).*Received: template_model=<Sequential name=template"),
    ((None,), {}, TypeError, r"filepath must be a path.*Received: filepath=None"),
    ((keras.layers.Dense(1), "m.keras"), {}, TypeError, r"filepath must be a path \(after the model, if any\).*Received: filepath=<Dense"),
    (("m-{epoch.keras",), {}, ValueError, r"cannot fill in its filepath \(expected '}' before end of string\).*Received: filepath='m-{epoch.keras'"),
    (("m}.keras",), {}, ValueError, r"cannot fill in its filepath \(Single '}'.*Received: filepath='m}.keras'"),
    (("m-{loss:d}.keras",), {}, ValueError, r"\(Unknown format code 'd' for object of type 'float'\).*Received: filepath='m-{loss:d}.keras'"),
    (("m-{}.keras",), {}, ValueError, r"\(Format string contains positional fields\).*Received: filepath='m-{}.keras'"),
    (("m-{loss[0]}.keras",), {}, ValueError, r"\('float' object is not subscriptable\).*Received: filepath="),
    (("m.keras",), {"save_freq": 0}, ValueError, r"save_freq: it must be 'epoch' or a positive int.*Received: save_freq=0"),
    (("m.keras",), {"save_freq": "batch"}, ValueError, r"Received: save_freq='batch'"),
    (("m.keras",), {"save_freq": True}, ValueError, r"Received: save_freq=True"),
    (("m.keras",), {"monitor": 3}, TypeError, r"monitor must be a metric name.*Received: monitor=3"),
    (("m.keras",), {"verbose": "loud"}, ValueError, r"verbose must be 0 or 1.*Received: verbose='loud'"),
    (("m.keras",), {"verbose": 2}, ValueError, r"Received: verbose=2"),
    (("m.keras",), {"mode": "biggest"}, ValueError, r"mode must be 'min', 'max' or 'auto'.*Received: mode='biggest'"),
    (("m.keras",), {"initial_value_threshold": "low"}, TypeError, r"must be a finite number or None\. Received: initial_value_threshold='low'"),
    (("m.keras",), {"initial_value_threshold": float("nan")}, TypeError, r"finite number or None\. Received: initial_value_threshold=nan"),
    (("m.keras",), {"save_best_only": "no"}, TypeError, r"save_best_only must be True or False \(keep only the best file\)\. Received: save_best_only='no'$"),
    (("m.weights.h5",), {"save_weights_only": 1}, TypeError, r"save_weights_only must be True or False.*Received: save_weights_only=1$"),
    (("m.keras",), {"save_freq": None}, ValueError, r"save_freq: it must be 'epoch' or a positive int\. Received: save_freq=None$"),
    (("m.keras",), {"save_weights_only": True}, ValueError, r"must end in `.weights.h5`.*Received: filepath=m.keras"),  # Keras'
    (("m.txt",), {}, ValueError, r"must end in `.keras`.*Received: filepath=m.txt"),  # Keras'
]


@pytest.mark.parametrize("arguments, keywords, error, message", BAD_ARGUMENTS, ids=[m[:40] for *_, m in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_at_construction(tmp_path, monkeypatch, arguments, keywords, error, message):
    monkeypatch.chdir(tmp_path)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="template")
    arguments = tuple(model if a == "MODEL" else a for a in arguments)
    with pytest.raises(error, match=message):
        kerasmulti.ParallelModelCheckpoint(*arguments, **keywords)


def _batches_before(error, parallel, x, y, checkpoint, **fit):
    """Trains until `error` is raised; returns how many batches ran and whether an epoch ended."""
    seen = {"batches": 0, "epochs": 0}
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.update(batches=seen["batches"] + 1),
        on_epoch_end=lambda epoch, logs: seen.update(epochs=seen["epochs"] + 1),
    )
    with error:
        parallel.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[checkpoint, counter], **fit)
    return seen["batches"], seen["epochs"]


@pytest.mark.parametrize("validation", [True, False], ids=["validating", "not validating"])
def test_unknown_monitored_metric_is_refused_after_the_first_batch(tmp_path, validation):
    # Without validation data the names offered had val_ names, which would fail again.
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "m.keras"), monitor="val_acuracy", save_best_only=True)
    offered = "'val_mae', 'val_loss', 'mae', ..." if validation else "'mae', 'loss'"
    error = pytest.raises(
        ValueError, match=rf"not a metric this model reports \({re.escape(offered)}\)\. Name one.*Received: monitor='val_acuracy'"
    )
    fit = dict(validation_data=(x, y)) if validation else {}
    assert _batches_before(error, parallel, x, y, checkpoint, **fit) == (1, 0)


def test_a_monitor_another_callback_adds_needs_an_explicit_mode_and_the_error_says_so(tmp_path):
    class Score(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["val_f1"] = [0.5, 0.9, 0.7][epoch]

    model, parallel, x, y = _setup()
    path = str(tmp_path / "f1.keras")
    checkpoint = kerasmulti.ParallelModelCheckpoint(path, monitor="val_f1", save_best_only=True)
    error = pytest.raises(ValueError, match=r"\.\.\.\)\. Name one, or pass mode='min' or 'max' if a callback adds it\. Received: monitor='val_f1'$")
    assert _batches_before(error, parallel, x, y, checkpoint, validation_data=(x, y)) == (1, 0)
    best = {}

    class Keep(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                best["predictions"] = model.predict(x, verbose=0)

    checkpoint = kerasmulti.ParallelModelCheckpoint(path, monitor="val_f1", mode="max", save_best_only=True)
    parallel.fit(x, y, epochs=3, verbose=0, validation_data=(x, y), callbacks=[Score(), checkpoint, Keep()])
    assert checkpoint.best == 0.9
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), best["predictions"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, save_freq, why", [
    ("{val_loss}", 1, "this model does not report"),  # batch-level saves see the batch's logs, without val_ metrics
    ("{mea}", 2, "this model does not report"),
    ("{batch}", "epoch", "saves at an epoch's end do not have"),  # Keras fills batch in only for batch-level saves
])
def test_a_field_the_logs_never_have_is_refused_after_the_first_batch(tmp_path, name, save_freq, why):
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / f"m-{name}.keras"), save_freq=save_freq)
    missing = name.strip("{}")
    error = pytest.raises(ValueError, match=rf"filepath names \['{missing}'\], which {why}.*Received: filepath=")
    assert _batches_before(error, parallel, x, y, checkpoint, validation_data=(x, y)) == (1, 0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["min", "max", "auto"])
def test_the_best_checkpoint_every_few_batches_is_saved_as_keras_would_at_an_epochs_end(tmp_path, mode):
    # Keras 3.15's ModelCheckpoint sets its comparison at an epoch's end only: its second
    # batch-level save crashed (TypeError: 'NoneType' object is not callable).
    _, parallel, x, y = _setup()
    path = tmp_path / "best-{epoch:02d}-{batch}.keras"
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(path), monitor="loss", mode=mode, save_best_only=True, save_freq=2)
    losses = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))
    parallel.fit(x, y, batch_size=5, epochs=2, verbose=0, callbacks=[recorder, checkpoint])
    better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)
    expected, best = [], None
    for step in range(1, len(losses), 2):  # every second batch: 3 saves in each epoch of 6 batches
        if best is None or better(losses[step], best):
            best = losses[step]
            expected.append(f"best-{step // 6 + 1:02d}-{step % 6 + 1}.keras")  # Keras counts batches from 1
    assert sorted(os.listdir(tmp_path)) == sorted(expected) and len(expected) >= 1


def test_an_epoch_field_no_log_has_is_refused_at_the_first_save(tmp_path):
    # Another callback may add it to the epoch's logs (next test): the epoch's end is the first sure moment.
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "m-{val_acc}.keras"))
    error = pytest.raises(ValueError, match=r"names \['val_acc'\], which this epoch's logs do not have.*Received: filepath=")
    assert _batches_before(error, parallel, x, y, checkpoint, validation_data=(x, y)) == (3, 0)
    assert os.listdir(tmp_path) == []


def test_fields_other_callbacks_add_to_the_epoch_logs_fill_the_filepath_in_as_keras_does(tmp_path):
    # LearningRateScheduler adds learning_rate to the epoch's logs; a callback listed first, a score of its own.
    class Score(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["val_f1"] = 0.5 + 0.1 * epoch

    _, parallel, x, y = _setup()
    paths = {name: str(tmp_path / name / "m-{epoch:02d}-{val_f1:.3f}-{learning_rate:.4f}.keras") for name in ("keras", "ours")}
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 / (epoch + 1))
    checkpoints = {
        "keras": keras.callbacks.ModelCheckpoint(paths["keras"], monitor="val_f1", mode="max", save_best_only=True),
        "ours": kerasmulti.ParallelModelCheckpoint(paths["ours"], monitor="val_f1", mode="max", save_best_only=True),
    }
    parallel.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[Score(), schedule, *checkpoints.values()])
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "keras")) == [
        "m-01-0.500-0.0100.keras", "m-02-0.600-0.0050.keras"
    ]


def test_a_val_field_without_validation_data_fails_at_the_first_save(tmp_path):
    # val_ metrics appear at the end of an epoch, with validation data: Keras' first save is the first chance.
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "m-{val_loss:.2f}.keras"))
    error = pytest.raises(ValueError, match=r"names \['val_loss'\], which this epoch's logs do not have.*Received: filepath=")
    assert _batches_before(error, parallel, x, y, checkpoint) == (3, 0)
    assert os.listdir(tmp_path) == []


def test_fields_from_the_epoch_logs_fill_the_filepath_in(tmp_path):
    _, parallel, x, y = _setup()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "{epoch:02d}-{val_loss:.2f}-{mae:.1%}.keras"))
    history = parallel.fit(x, y, epochs=2, verbose=0, validation_data=(x, y), callbacks=[checkpoint])
    logs = history.history
    expected = [f"{e + 1:02d}-{logs['val_loss'][e]:.2f}-{logs['mae'][e]:.1%}.keras" for e in range(2)]
    assert sorted(os.listdir(tmp_path)) == expected


@pytest.mark.parametrize("failure", [
    lambda temporary: PermissionError(13, "Permission denied", temporary),
    lambda temporary: OSError(f"Unable to create file (unable to open file: name = '{temporary}', errno = 28)"),  # h5py's
], ids=["os", "h5py"])
def test_a_failed_save_names_the_users_path_not_the_temporary(tmp_path, monkeypatch, failure):
    model, parallel, x, y = _setup()
    path = str(tmp_path / "m.keras")

    def broken_save(filepath, *args, **kwargs):
        raise failure(filepath)

    monkeypatch.setattr(model, "save", broken_save)
    with pytest.raises(OSError) as raised:
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path)])
    assert path in str(raised.value) and "kerasmulti-tmp" not in str(raised.value), raised.value
    assert _no_temporaries(tmp_path)


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


def _start_worker(folder, epochs, *extra, fault=None, interruptible=False):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **({_fault_points.ENV: fault} if fault else {})}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    return subprocess.Popen(
        [sys.executable, WORKER, str(folder), str(epochs), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        # A suite run in the background ignores SIGINT, and so would the worker.
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if interruptible else None,
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
    for attempt in range(4):  # each a new process: a new random moment, ~15 s each
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
    assert loaded == 4  # every kill came after a first checkpoint, which must survive it
    process = _start_worker(tmp_path, 1)
    assert process.wait(timeout=180) == 0
    assert _no_temporaries(tmp_path), "stale temporaries were not cleaned up"
    keras.models.load_model(str(path))


@pytest.mark.slow
# SIGKILL, and Ctrl-C (SIGINT) at a random moment of the next epoch: Python's
# KeyboardInterrupt stops fit wherever it lands, the backup stays whole.
@pytest.mark.parametrize(
    "stop, kind", [(signal.SIGKILL, ""), (signal.SIGINT, ""), (signal.SIGKILL, "--pipeline")],
    ids=["SIGKILL", "SIGINT", "SIGKILL, pipeline"],
)
def test_killed_training_resumes_and_ends_with_an_uninterrupted_runs_weights(tmp_path, stop, kind, seeded_data):
    epochs = 6
    given = [kind] if kind else []
    straight = tmp_path / "straight"
    process = _start_worker(straight, epochs, "--backup", *given, "--out", str(tmp_path / "straight.npz"))
    assert process.wait(timeout=300) == 0

    resumed = tmp_path / "resumed"
    process = _start_worker(resumed, epochs, "--backup", *given, interruptible=True)
    _wait_for(process, "epoch 3 done")
    if stop == signal.SIGINT:
        time.sleep(random.Random(seeded_data).uniform(0, 0.2))  # the test's printed seed replays it
    process.send_signal(stop)
    # Python's KeyboardInterrupt ends it by SIGINT; inside a C call TensorFlow can
    # turn it into another error first (exit 1). Either way the backup is whole.
    assert process.wait(timeout=120) in ((-stop,) if stop == signal.SIGKILL else (-stop, 1))
    assert (resumed / "backup").exists()
    process = _start_worker(resumed, epochs, "--backup", *given, "--out", str(tmp_path / "resumed.npz"))
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
    assert crashed.returncode == _fault_points.EXIT_CODE and "epoch 2 done" not in output, output
    resumed = _start_worker(tmp_path / "resumed", epochs, backup, "--out", str(tmp_path / "resumed.npz"))
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    expected, got = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    same = all(np.allclose(got[key], expected[key], rtol=1e-6, atol=1e-7) for key in expected.files)
    assert same is resumes_exactly


def _holds(path, arrays):
    """Whether the checkpoint at `path` loads and holds exactly `arrays`; else why not."""
    try:
        loaded = keras.models.load_model(str(path))
    except Exception as error:  # a torn file fails in zipfile, h5py or Keras, each its own way
        return f"does not load: {error!r}"
    return all(np.array_equal(np.asarray(w), arrays[f"arr_{i}"]) for i, w in enumerate(loaded.weights)) or "other weights"


@pytest.mark.slow
@pytest.mark.parametrize("keras_checkpoint, fault", [(False, "checkpoint:write:2"), (True, "checkpoint:write:5")], ids=["ours", "keras"])
def test_a_crash_during_a_save_leaves_the_previous_checkpoint_unlike_keras(tmp_path, keras_checkpoint, fault):
    # The process ends (as under SIGKILL) in the 2nd save, after batch 2. Ours
    # has written the new file under a temporary name and not renamed it yet;
    # Keras' ModelCheckpoint (the control) writes the target itself and is
    # past the 2nd of the model's 3 Dense layers. The checkpoint must still
    # be batch 1's, whole.
    control = ["--keras-checkpoint"] if keras_checkpoint else []
    crashed = _start_worker(tmp_path, 1, "--snapshots", *control, fault=fault)
    output, _ = crashed.communicate(timeout=300)
    assert crashed.returncode == _fault_points.EXIT_CODE, output
    assert sorted(glob.glob(str(tmp_path / "snapshot-*"))) == [str(tmp_path / "snapshot-1.npz")]  # it crashed in save 2
    holds = _holds(tmp_path / "ckpt.keras", np.load(tmp_path / "snapshot-1.npz"))
    assert (holds is True) is not keras_checkpoint, holds
    if not keras_checkpoint:
        assert len(glob.glob(str(tmp_path / ".*kerasmulti-tmp*"))) == 1  # the new file, never renamed in
        resumed = _start_worker(tmp_path, 1)
        assert resumed.wait(timeout=300) == 0
        assert _no_temporaries(tmp_path)


@pytest.mark.parametrize("make", [
    lambda: kerasmulti.ParallelModelCheckpoint("gs://bucket/model.keras"),
    lambda: kerasmulti.ParallelBackupAndRestore("s3://bucket/backup"),
])
def test_remote_paths_are_refused_before_training(make):
    with pytest.raises(ValueError, match=r"writes local files only.*mounted folder.*Received: (filepath|backup_dir)='(gs|s3)://"):
        make()


def test_only_this_hosts_dead_writers_temporaries_are_removed(tmp_path):
    from kerasmulti._src.utils import atomic as _atomic

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid names a writer that is gone
    target = str(tmp_path / "m.keras")
    here = _atomic.temporary_path(target).replace(f"{os.getpid()}@", f"{finished.pid}@")
    elsewhere = here.replace(f"@{socket.gethostname()}-", "@another-machine-")
    running = _atomic.temporary_path(target)
    dashed = _atomic.temporary_path(str(tmp_path / "ckpt.v-2")).replace(f"{os.getpid()}@", f"{finished.pid}@")
    hostless = str(tmp_path / f".m.keras.kerasmulti-tmp-{finished.pid}-0123abcd.keras")  # whose host is unknown
    for path in (here, elsewhere, running, dashed, hostless):
        open(path, "w").close()
    assert sorted(_atomic.remove_stale_temporaries(target)) == sorted([here, dashed])
    assert os.path.exists(elsewhere) and os.path.exists(running) and os.path.exists(hostless)


def _dead_pid():
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid names a writer that is gone
    return finished.pid


@pytest.mark.parametrize("name", ["x" * 249 + ".keras", "é" * 120 + ".keras", "w" * 244 + ".weights.h5"])
def test_a_temporary_fits_the_file_systems_name_limit_and_is_still_recognised(tmp_path, name, monkeypatch):
    # 255 bytes, the common limit, for the longest name Keras can write; é takes 2 bytes.
    from kerasmulti._src.utils import atomic as _atomic

    assert len(os.fsencode(name)) <= 255
    temporary = _atomic.temporary_path(str(tmp_path / name))
    base = os.path.basename(temporary)
    assert os.path.dirname(temporary) == str(tmp_path) and base.startswith("." + name[:100])
    assert len(os.fsencode(base)) <= 255 and base.endswith(".weights.h5" if "weights" in name else ".keras")
    # Writers that are gone left their own (a pid of more digits, above Linux's pid_max: the name cut shorter).
    stale = []
    for dead in (_dead_pid(), 9_999_999):
        with monkeypatch.context() as patch:
            patch.setattr(os, "getpid", lambda: dead)
            stale.append(_atomic.temporary_path(str(tmp_path / name)))
        open(stale[-1], "w").close()
    assert sorted(_atomic.remove_stale_temporaries(str(tmp_path / name))) == sorted(stale)


def test_a_checkpoint_with_the_longest_name_keras_writes_is_written(tmp_path):
    model, parallel, x, y = _setup()
    path = str(tmp_path / ("x" * 249 + ".keras"))
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(path, monitor="loss")])
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert _no_temporaries(tmp_path)


def test_a_link_is_written_through_as_keras_does(tmp_path):
    # The file it names is replaced (atomically, beside itself); the link stays a link to it.
    model, parallel, x, y = _setup()
    (tmp_path / "real").mkdir()
    # The file named may have no suffix (a content-addressed store's): Keras picks the format from the link's name.
    real, link = str(tmp_path / "real" / "blob"), str(tmp_path / "best.keras")
    parallel.save(real + ".keras")
    os.rename(real + ".keras", real)
    os.symlink(real, link)
    stale = _atomic_temporary(real).replace(f"{os.getpid()}@", f"{_dead_pid()}@")  # a killed writer's, beside the file
    open(stale, "w").close()
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(link, monitor="loss")])
    assert os.path.islink(link) and os.readlink(link) == real
    np.testing.assert_allclose(keras.models.load_model(link).predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert _no_temporaries(tmp_path) and _no_temporaries(tmp_path / "real")


def test_a_replaced_checkpoint_keeps_its_permissions_as_keras_in_place_write_does(tmp_path):
    # The temporary renamed over it had the umask's mode: a group-writable file lost group write (found by review).
    _, parallel, x, y = _setup()
    kept, new = str(tmp_path / "shared.keras"), str(tmp_path / "new.keras")
    parallel.save(kept)
    os.chmod(kept, 0o664)
    umask = os.umask(0o022)
    try:
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[kerasmulti.ParallelModelCheckpoint(p, monitor="loss") for p in (kept, new)])
    finally:
        os.umask(umask)
    assert os.stat(kept).st_mode & 0o777 == 0o664
    assert os.stat(new).st_mode & 0o777 == 0o644  # a new file: the umask's, as Keras'


def test_a_loop_of_links_is_refused_and_left_as_it_is(tmp_path):
    _, parallel, x, y = _setup()
    first, second = tmp_path / "a.keras", tmp_path / "b.keras"
    os.symlink(second, first)
    os.symlink(first, second)
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(first), monitor="loss")
    with pytest.raises(OSError, match=r"could not write '.*a\.keras' \(Too many levels of symbolic links\).*Received: "):
        parallel.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
    assert os.readlink(first) == str(second) and os.readlink(second) == str(first)
    assert sorted(os.listdir(tmp_path)) == ["a.keras", "b.keras"]


def _atomic_temporary(target):
    from kerasmulti._src.utils import atomic as _atomic

    return _atomic.temporary_path(target)


def test_killed_writers_temporaries_in_folders_the_filepath_fills_in_are_removed_when_training_starts(tmp_path):
    _, parallel, x, y = _setup()
    dead = _dead_pid()
    stale = []
    for folder in ("1", "7"):  # 7: a folder this run does not write
        (tmp_path / folder).mkdir()
        stale.append(_atomic_temporary(str(tmp_path / folder / "m.keras")).replace(f"{os.getpid()}@", f"{dead}@"))
        open(stale[-1], "w").close()
    running = _atomic_temporary(str(tmp_path / "7" / "m.keras"))  # this process's: a write in flight
    open(running, "w").close()
    checkpoint = kerasmulti.ParallelModelCheckpoint(str(tmp_path / "{epoch}" / "m.keras"), monitor="loss")
    parallel.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
    assert not any(os.path.exists(path) for path in stale) and os.path.exists(running)
    keras.models.load_model(str(tmp_path / "1" / "m.keras"))


class _PressesCtrlC:
    """An object whose finalizer presses Ctrl-C, where Python would lose the KeyboardInterrupt."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # bytecode to run Python's signal handler on, inside the finalizer


@pytest.mark.parametrize("presses", [1, 2, "then the write fails"])
def test_ctrl_c_during_a_write_is_held_until_the_write_ends_and_a_second_one_stops_it(tmp_path, presses):
    # Keras' save runs zipfile's finalizer; a Ctrl-C landing there used to be lost and training went on.
    from kerasmulti._src.utils import atomic as _atomic

    target = tmp_path / "m.json"
    target.write_text("old")

    def save(path):
        with open(path, "w") as f:
            f.write("new")
        _PressesCtrlC()  # dropped at once: its finalizer runs here
        if presses == 2:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
        if presses == "then the write fails":  # the user asked to stop: that wins over the failure
            raise OSError(28, "No space left on device")

    # A suite run in the background ignores SIGINT; a user's Python raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _atomic.write(str(target), save, "test", "target")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    # One press: the write ends first, then stops. Two: it stops at once, the old file kept.
    assert target.read_text() == ("new" if presses == 1 else "old") and _no_temporaries(tmp_path)
