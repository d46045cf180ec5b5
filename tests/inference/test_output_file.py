"""parallel_predict's HDF5 file: paths it refuses or makes, damage, bookkeeping out of the way."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import errno
import os
import shutil

import h5py
import numpy as np
import pytest
from test_inference import _data
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
        assert sorted(f.attrs) == ["kerasmulti_input", "kerasmulti_model", "kerasmulti_rows", "kerasmulti_rows_done"]
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
