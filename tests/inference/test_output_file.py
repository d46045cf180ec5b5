"""parallel_predict's HDF5 file: paths it refuses or makes, damage, bookkeeping out of the way."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import errno
import os
import re
import shutil

import h5py
import keras
import numpy as np
import pytest
from test_inference import _Crashing, _data
from test_inference import _two_outputs as _model

import kerasmulti
from kerasmulti._src.inference import output_file as _output_file


def _assert_file_holds(path, model, x):
    features, score = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], features, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f["score"][:], score, rtol=1e-5, atol=1e-6)
        assert f.attrs["kerasmulti_rows_done"] == len(x)


def test_the_top_level_holds_the_outputs_alone(tmp_path):
    model, x = _model(), _data(9)
    path = tmp_path / "out.h5"
    kerasmulti.parallel_predict(model, x, batch_size=4, output=path, verbose=0)  # a PathLike too
    with h5py.File(path, "r") as f:
        assert list(f) == ["features", "score"]
        assert sorted(f.attrs) == ["kerasmulti_input", "kerasmulti_model", "kerasmulti_outputs", "kerasmulti_rows", "kerasmulti_rows_done"]
        assert list(f.attrs["kerasmulti_outputs"]) == ["features", "score"]
    _assert_file_holds(path, model, x)


def test_the_counter_is_rewritten_in_place(tmp_path):
    # What makes a kill safe: updating the counter changes its 8 bytes and
    # nothing else, as writing a row does. (Written as a string attribute
    # instead, the file grows by 6 KB and bytes change over 1.5 KB: tried.)
    path = str(tmp_path / "out.h5")
    _output_file.create(path, 100, [((3,), np.dtype("float32"))], ["features"], {"kerasmulti_model": "m"}, {})
    shutil.copy(path, tmp_path / "before.h5")
    with h5py.File(path, "r+") as f:
        _output_file.set_rows_done(f, 98765)
    before, after = (tmp_path / "before.h5").read_bytes(), open(path, "rb").read()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and changed and changed[-1] - changed[0] < 8, changed
    with h5py.File(path, "r") as f:
        assert _output_file.rows_done(f) == 98765


def test_a_file_of_the_earlier_layout_is_resumed(tmp_path):
    # Before: the counter was a dataset beside the outputs. Such a file, as a
    # kill after two batches left it, is resumed as it is.
    model, x = _model(), _data(20)
    path = str(tmp_path / "old.h5")
    kerasmulti.parallel_predict(model, x, batch_size=4, output=path, verbose=0)
    with h5py.File(path, "r+") as f:
        del f.attrs["kerasmulti_rows_done"]
        f.create_dataset("kerasmulti_rows_done", data=np.int64(8))
        f["features"][8:] = 0
        f["score"][8:] = 0
    kerasmulti.parallel_predict(model, x, batch_size=4, output=path, verbose=0)
    features, score = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        assert int(f["kerasmulti_rows_done"][()]) == 20 and "kerasmulti_rows_done" not in f.attrs
        np.testing.assert_allclose(f["features"][:], features, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f["score"][:], score, rtol=1e-5, atol=1e-6)


def test_a_missing_folder_is_made(tmp_path):
    model, x = _model(), _data(5)
    path = str(tmp_path / "new" / "deeper" / "out.h5")
    kerasmulti.parallel_predict(model, x, output=path, verbose=0)
    _assert_file_holds(path, model, x)


@pytest.mark.parametrize("output", ["", "folder/", "existing"])
def test_paths_that_name_no_file_are_refused(tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    message = r"empty output path.*Received: output=''" if not output else (
        rf"output is a folder.*output='{os.path.join(output, 'features.h5')}'.*Received: output='{output}'"
    )
    with pytest.raises(ValueError, match=message):
        kerasmulti.parallel_predict(_model(), _data(4), output=output, verbose=0)
    assert sorted(os.listdir(tmp_path)) == ["existing"]


def test_an_output_that_is_not_a_path_is_refused():
    with pytest.raises(TypeError, match=r"output must be an HDF5 file path or None.*Received: output=3"):
        kerasmulti.parallel_predict(_model(), _data(4), output=3, verbose=0)


def test_a_file_that_cannot_be_made_is_named_as_given(tmp_path):
    (tmp_path / "plain").write_text("a file, not a folder")
    path = str(tmp_path / "plain" / "out.h5")
    with pytest.raises(ValueError, match=r"could not create '.*plain/out.h5' \(Not a directory\).*Received: output=") as error:
        kerasmulti.parallel_predict(_model(), _data(4), output=path, verbose=0)
    assert "kerasmulti-tmp" not in str(error.value)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_file_that_cannot_be_written_is_named_as_given_not_its_temporary():
    with pytest.raises(ValueError, match=r"could not create '/proc/out.h5' \(.*\).*Received: output='/proc/out.h5'") as error:
        kerasmulti.parallel_predict(_model(), _data(4), output="/proc/out.h5", verbose=0)
    assert "kerasmulti-tmp" not in str(error.value)


def test_a_damaged_output_is_named_and_left_alone(tmp_path):
    model, x = _model(), _data(30)
    path = tmp_path / "out.h5"
    kerasmulti.parallel_predict(model, x, output=str(path), verbose=0)
    damaged = path.read_bytes()[: path.stat().st_size // 2]  # as a copy cut short leaves it
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=r"out.h5' is damaged \(not a readable HDF5 file\).*Delete or move it.*Received: output="):
        kerasmulti.parallel_predict(model, x, output=str(path), verbose=0)
    assert path.read_bytes() == damaged


def test_an_hdf5_file_parallel_predict_did_not_write_is_left_alone(tmp_path):
    path = tmp_path / "theirs.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 6))
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"parallel_predict\(\) did not write this HDF5 output file.*Received: output='.*theirs.h5'"):
        kerasmulti.parallel_predict(_model(), _data(4), output=str(path), verbose=0)
    assert path.read_bytes() == before


def test_the_file_gets_its_blocks_on_disk_when_it_is_made(tmp_path):
    # HDF5 only sets the size; a full disk would then fail a later batch (h5py crashed there, #26).
    path = str(tmp_path / "out.h5")
    _output_file.create(path, 200_000, [((16,), np.dtype("float32"))], ["features"], {"kerasmulti_model": "m"}, {})
    size = os.path.getsize(path)
    assert size > 200_000 * 16 * 4 and os.stat(path).st_blocks * 512 >= size


def _full_disk(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)


def test_a_full_disk_fails_before_the_first_row_and_leaves_no_file(tmp_path, monkeypatch):
    _full_disk(monkeypatch)
    with pytest.raises(ValueError, match=r"could not create '.*out.h5' \(No space left on device\).*Received: output="):
        kerasmulti.parallel_predict(_model(), _data(8), output=str(tmp_path / "out.h5"), verbose=0)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_on_resume_stops_before_writing_and_keeps_the_rows(tmp_path, monkeypatch):
    model, x = _model(), _data(20)
    path = tmp_path / "out.h5"
    kerasmulti.parallel_predict(model, x, batch_size=4, output=str(path), verbose=0)
    with h5py.File(path, "r+") as f:  # as an interrupted run leaves it
        _output_file.set_rows_done(f, 8)
    before = path.read_bytes()
    _full_disk(monkeypatch)
    with pytest.raises(ValueError, match=r"cannot resume: the disk is full.*Free space.*written rows stay\. Received: output='.*out.h5'"):
        kerasmulti.parallel_predict(model, x, batch_size=4, output=str(path), verbose=0)
    assert path.read_bytes() == before
    monkeypatch.undo()
    kerasmulti.parallel_predict(model, x, batch_size=4, output=str(path), verbose=0)
    _assert_file_holds(path, model, x)


def test_extra_is_checked_before_anything_is_written(tmp_path):
    model, x = _model(), _data(10)
    path = tmp_path / "out.h5"
    refused = [
        (ValueError, {"names": np.arange(3)}, r"extra 'names' has 3 rows, but 10 rows are predicted.*Received: extra\['names'\]\.shape=\(3,\), rows=10$"),
        (ValueError, {"names": np.int64(7)}, r"extra 'names' has no rows.*Received: extra\['names'\]\.shape=\(\), rows=10$"),
        (TypeError, ["a"], r"extra must be a dict of arrays.*Received: extra=\['a'\]$"),
        (ValueError, {"score": np.arange(10)}, r"extra \['score'\] has the name of a model output.*\['features', 'score'\].*Received: extra=\{'score': \.\.\.\}$"),
        (ValueError, {"a/b": np.arange(10)}, r"keys must be non-empty strings without '/'.*Received: extra=\{'a/b': \.\.\.\}$"),
        # h5py's own TypeError, with no fix, before.
        (ValueError, {"meta": np.array([{"id": i} for i in range(10)])}, r"extra 'meta' holds Python objects.*Pass numbers or text.*Received: extra\['meta'\]\.dtype=object$"),
        (ValueError, {"meta": np.array(["a", b"b"] * 5, dtype=object)}, r"extra 'meta' holds Python objects.*\(str or bytes, not both\)"),
    ]
    for error, extra, message in refused:
        with pytest.raises(error, match=message):
            kerasmulti.parallel_predict(model, x, output=path, extra=extra, verbose=0)
        assert not path.exists()
    # Without a file it would be dropped unseen.
    with pytest.raises(ValueError, match=r"stores extra= in the output file.*Received: output=None, extra=\{'names': \.\.\.\}$"):
        kerasmulti.parallel_predict(model, x, extra={"names": np.arange(10)}, verbose=0)
    kerasmulti.parallel_predict(model, x, extra={}, verbose=0)  # nothing to drop
    kerasmulti.parallel_predict(model, x, output=path, extra={"names": list(range(10))}, verbose=0)
    with h5py.File(path, "r") as f:
        assert list(f["names"][:]) == list(range(10))
    _assert_file_holds(path, model, x)
    # numpy's fixed-width text, which h5py refuses as it is, is stored as UTF-8 strings.
    texts = np.array([f"row {i} é" for i in range(10)])
    kerasmulti.parallel_predict(model, x, output=tmp_path / "texts.h5", extra={"names": texts}, verbose=0)
    with h5py.File(tmp_path / "texts.h5", "r") as f:
        assert list(f["names"].asstr()[:]) == list(texts)


def test_text_outputs_are_refused_for_a_file_and_returned_in_memory(tmp_path):
    # Variable-length strings are written into HDF5's heap, not in place: a kill could damage the file.
    inputs = keras.Input((1,), dtype="int64")
    model = keras.Model(inputs, keras.layers.StringLookup(vocabulary=["a", "b"], invert=True)(inputs))
    x = np.array([[1], [2], [0], [1]])
    np.testing.assert_array_equal(kerasmulti.parallel_predict(model, x, verbose=0), model.predict(x, verbose=0))
    with pytest.raises(ValueError, match=r"writes numbers to its file, but output '.*' holds text\. Pass output=None\. Received: dtype=object$"):
        kerasmulti.parallel_predict(model, x, output=tmp_path / "out.h5", verbose=0)
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("name, format_name", [("preds.NPY", "numpy's format"), ("preds.csv", "CSV"), ("preds.json", "JSON")])
def test_file_names_of_other_formats_are_refused_as_output(tmp_path, name, format_name):
    # Written anyway, preds.csv would be an HDF5 file that a CSV reader cannot read.
    with pytest.raises(ValueError, match=rf"writes an HDF5 file, not {format_name}\. Name it e\.g\. '.*preds\.h5'\. Received: output='.*{name}'$"):
        kerasmulti.parallel_predict(_model(), _data(4), output=str(tmp_path / name), verbose=0)
    assert os.listdir(tmp_path) == []


def _unnamed(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = hidden + keras.ops.abs(hidden)  # operations get names of their own too ("add_1")
    return keras.Model(inputs, [keras.layers.Dense(3)(hidden), keras.layers.Dense(1)(hidden)])


def test_the_same_model_built_again_in_the_process_resumes_the_file(tmp_path):
    # A notebook's cell run again after Ctrl-C: the layers get new names (dense_1 ...), not new numbers.
    model, x = _unnamed(0), _data(30)
    path = str(tmp_path / "out.h5")
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=4), output=path, verbose=0)
    again = _unnamed(0)
    assert again.output_names != model.output_names
    kerasmulti.parallel_predict(again, _Crashing(x), output=path, verbose=0)
    with h5py.File(path, "r") as f:
        assert f.attrs["kerasmulti_rows_done"] == 30 and sorted(f) == sorted(model.output_names)
        for name, expected in zip(model.output_names, model.predict(x, verbose=0)):
            np.testing.assert_allclose(f[name][:], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"different model"):  # other weights are another model still
        kerasmulti.parallel_predict(_unnamed(1), x, output=str(tmp_path / "out.h5"), verbose=0)


def test_a_resume_with_another_extra_is_refused_and_the_same_extra_resumes(tmp_path):
    model, x = _model(), _data(12)
    path = tmp_path / "out.h5"
    names = np.array([f"row {i}" for i in range(12)])
    scores = np.where(np.arange(12) % 3, np.linspace(0, 1, 12), np.nan)  # with missing values, the same again
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=1), output=path, extra={"names": names, "scores": scores}, verbose=0)
    for extra, begun in (({"names": names[::-1]}, "another"), ({"ids": np.arange(12)}, "no")):
        key = next(iter(extra))
        with pytest.raises(ValueError, match=rf"out\.h5' was begun with {begun} extra '{key}'\. Pass the same extra=, or delete the file\. Received: extra=\{{'{key}': \.\.\.\}}$"):
            kerasmulti.parallel_predict(model, _Crashing(x), output=path, extra=extra, verbose=0)
    kerasmulti.parallel_predict(model, _Crashing(x), output=path, extra={"names": list(names), "scores": scores.copy()}, verbose=0)
    with h5py.File(path, "r") as f:
        assert list(f["names"].asstr()[:]) == list(names) and sorted(f) == ["features", "names", "score", "scores"]
        np.testing.assert_array_equal(f["scores"][:], scores)
    _assert_file_holds(path, model, x)


def _replaced(f, name, values):
    del f[name]
    f[name] = values


def test_a_file_with_a_wrong_counter_or_a_missing_output_is_damaged(tmp_path):
    model, x = _model(), _data(10)
    for name, edit, reason in (
        ("big.h5", lambda f: f.attrs.modify("kerasmulti_rows_done", np.int64(10**6)), "its row counter, 1000000, is out of range"),
        ("negative.h5", lambda f: f.attrs.modify("kerasmulti_rows_done", np.int64(-5)), "its row counter, -5, is out of range"),
        ("missing.h5", lambda f: f.__delitem__("score"), "output 'score' is missing"),
        # These gave h5py's TypeError mid-run, or (more rows) resumed as if fine.
        ("text.h5", lambda f: f.attrs.__setitem__("kerasmulti_rows_done", "5"), "its row counter is not a whole number"),
        ("float.h5", lambda f: f.attrs.__setitem__("kerasmulti_rows_done", 5.7), "its row counter is not a whole number"),
        ("fewer.h5", lambda f: _replaced(f, "score", np.zeros((4, 1), "float32")), "output 'score' has 4 rows, not 10"),
        ("more.h5", lambda f: _replaced(f, "score", np.zeros((50, 1), "float32")), "output 'score' has 50 rows, not 10"),
    ):
        path = str(tmp_path / name)
        kerasmulti.parallel_predict(model, x, output=path, verbose=0)
        with h5py.File(path, "r+") as f:
            edit(f)
        with pytest.raises(ValueError, match=rf"{name}' is damaged \({re.escape(reason)}\), so parallel_predict\(\) cannot resume it\..*Received: output="):
            kerasmulti.parallel_predict(model, x, output=path, verbose=0)


def test_an_hdf5_dataset_whose_file_is_closed_is_refused(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = _data(4)
        dataset = f["x"]
    with pytest.raises(ValueError, match=r"got an h5py\.Dataset whose file is closed\. Keep the file open while it runs\. Received: data=<Closed HDF5 dataset>$"):
        kerasmulti.parallel_predict(_model(), dataset, verbose=0)


class _Bounds:
    """A plain object: a layer given one has a config Keras cannot serialise."""

    def __init__(self, low, high):
        self.low, self.high = low, high


class _Clip(keras.layers.Layer):
    def __init__(self, bounds, **kwargs):
        super().__init__(**kwargs)
        self.bounds = bounds

    def call(self, x):
        return keras.ops.clip(x, self.bounds.low, self.bounds.high)


def _clipped(activation, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = _Clip(_Bounds(-5.0, 5.0))(keras.layers.Dense(4, activation=activation)(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def test_a_model_whose_config_cannot_be_saved_is_still_told_apart_from_another(tmp_path):
    # Such a model was known by its class alone ("Functional"): one with another activation
    # and the same weights resumed the file, its rows mixed in with no word.
    model, other, x = _clipped("relu"), _clipped("sigmoid"), _data(30)
    other.set_weights(model.get_weights())
    with pytest.raises(NotImplementedError):
        model.get_config()
    path = str(tmp_path / "out.h5")
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=4), output=path, verbose=0)
    with pytest.raises(ValueError, match=r"different model"):
        kerasmulti.parallel_predict(other, _Crashing(x), output=path, verbose=0)
    kerasmulti.parallel_predict(_clipped("relu"), _Crashing(x), output=path, verbose=0)  # the same model again resumes it
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f[model.output_names[0]][:], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


_HOLD_OPEN = "import sys, time, h5py\nf = h5py.File(sys.argv[1], 'r')\nprint('open', flush=True)\ntime.sleep(120)\n"


@pytest.mark.parametrize("where", ["this process", "another process"])
def test_a_file_open_elsewhere_is_not_called_damaged(tmp_path, where):
    # h5py's lock error was taken for damage, with the advice to delete a file of good rows.
    import subprocess
    import sys

    model, x = _model(), _data(30)
    path = str(tmp_path / "out.h5")
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=4), output=path, verbose=0)
    if where == "this process":
        holder = h5py.File(path, "r")
    else:
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_OPEN, path], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "open"
    try:
        with pytest.raises(ValueError, match=r"is open elsewhere .*Close it there and rerun. Received: output="):
            kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0)
    finally:
        holder.close() if where == "this process" else holder.kill()
        if where != "this process":
            holder.wait()
    kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0)  # closed, it resumes
    _assert_file_holds(path, model, x)


def test_a_file_that_cannot_be_written_is_not_called_a_full_disk(tmp_path, monkeypatch):
    model, x = _model(), _data(30)
    path = str(tmp_path / "out.h5")
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=4), output=path, verbose=0)

    def refused(_):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(_output_file, "reserve", refused)  # as for a file of mode 444, for a user other than root
    with pytest.raises(ValueError, match=r"cannot be written \(Permission denied\). Make it writable, or choose another path"):
        kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0)
    # Finished, nothing is left to write: a file that cannot be written is read as it is (it was refused).
    monkeypatch.undo()
    kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0)
    monkeypatch.setattr(_output_file, "reserve", refused)
    assert kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0) == path
    _assert_file_holds(path, model, x)


def test_a_new_file_clears_the_temporary_a_killed_run_left_while_making_it(tmp_path, monkeypatch):
    # A run killed while it made (and reserved the blocks of) the file left that hidden temporary for good.
    import subprocess
    import sys

    from kerasmulti._src.utils import atomic as _atomic

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    path = str(tmp_path / "out.h5")
    with monkeypatch.context() as patch:
        patch.setattr(os, "getpid", lambda: finished.pid)
        left = _atomic.temporary_path(path)
    open(left, "wb").close()
    with monkeypatch.context() as patch:  # another user's, in a shared folder (/tmp), that cannot be removed
        patch.setattr(os, "getpid", lambda: finished.pid)
        theirs = _atomic.temporary_path(str(tmp_path / "theirs.h5"))
    open(theirs, "wb").close()
    remove = os.remove

    def refused(name, *args, **kwargs):
        if name == theirs:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), name)
        return remove(name, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refused)
    model, x = _model(), _data(10)
    kerasmulti.parallel_predict(model, x, output=path, verbose=0)
    assert sorted(os.listdir(tmp_path)) == sorted(["out.h5", os.path.basename(theirs)])
    _assert_file_holds(path, model, x)


def test_outputs_whose_names_hdf5_cannot_hold_are_stored_numbered(tmp_path):
    # HDF5 reads '/' as a group: "a" and "a/b" clashed ("Incompatible object (Dataset) already exists").
    class Paths(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs):
            h = self.dense(inputs)
            return {"a/b": h, "a": h * 2.0}

    model, x = Paths(), _data(9)
    model(x[:1])
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, x, batch_size=4, output=path, verbose=0)
    expected = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["output_0", "output_1"]
        for i, name in enumerate(sorted(expected)):  # in the order of the model's flattened outputs
            np.testing.assert_allclose(f[f"output_{i}"][:], expected[name], rtol=1e-5, atol=1e-6)
