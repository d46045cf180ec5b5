"""parallel_predict: equal to model.predict row for row, streamed, resumable."""

from simulated import DEVICES

import io
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src.utils import fault_points as _fault_points

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "predict_to_file.py")


def _two_outputs(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, name="features")(hidden), keras.layers.Dense(1, name="score")(hidden)])


def _data(rows):
    return np.random.default_rng().normal(size=(rows, 6)).astype("float32")


def _assert_same(expected, got):
    for e, g in zip(keras.tree.flatten(expected), keras.tree.flatten(got)):
        assert np.shape(g) == np.shape(e)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, DEVICES - 1, DEVICES, 10, 37])
def test_returns_model_predict_row_for_row(rows):
    model, x = _two_outputs(), _data(rows)
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0))


def test_dict_and_list_inputs():
    left, right = keras.Input((4,), name="left"), keras.Input((2,), name="right")
    model = keras.Model({"left": left, "right": right}, keras.layers.Dense(2)(keras.layers.concatenate([left, right])))
    rng = np.random.default_rng()
    x = {"left": rng.normal(size=(11, 4)).astype("float32"), "right": rng.normal(size=(11, 2)).astype("float32")}
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=3, verbose=0))


def test_h5py_dataset_and_memory_mapped_npy_inputs(tmp_path):
    model, x = _two_outputs(), _data(23)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = x
    with h5py.File(tmp_path / "in.h5", "r") as f:
        got = kerasmulti.parallel_predict(model, f["x"], batch_size=5, verbose=0)
    _assert_same(model.predict(x, verbose=0), got)
    np.save(tmp_path / "in.npy", x)
    mapped = np.load(tmp_path / "in.npy", mmap_mode="r")
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, mapped, batch_size=5, verbose=0))


def test_tf_data_and_pydataset_inputs():
    model, x = _two_outputs(), _data(17)
    expected = model.predict(x, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, np.zeros(17))).batch(5)
    _assert_same(expected, kerasmulti.parallel_predict(model, dataset, verbose=0))

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[i * 5 : (i + 1) * 5]

        def on_epoch_begin(self):
            self.calls.append("begin")

        def on_epoch_end(self):
            self.calls.append("end")

    batches, keras_batches = Batches(), Batches()
    _assert_same(expected, kerasmulti.parallel_predict(model, batches, verbose=0))
    model.predict(keras_batches, verbose=0)
    # As model.predict calls them (a PyDataset may open its files at the beginning, close them at the end).
    assert batches.calls == keras_batches.calls[-2:] == ["begin", "end"]


def test_streams_into_hdf5_one_dataset_per_output(tmp_path):
    model, x = _two_outputs(), _data(29)
    path = str(tmp_path / "features.h5")
    names = np.array([f"row-{i}" for i in range(29)], dtype="S")
    assert kerasmulti.parallel_predict(model, x, batch_size=4, output=path, verbose=0, extra={"filenames": names}) == path
    features, score = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], features, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f["score"][:], score, rtol=1e-5, atol=1e-6)
        assert f.attrs["kerasmulti_rows_done"] == 29
        assert list(f["filenames"][:]) == list(names)
    assert [n for n in os.listdir(tmp_path)] == ["features.h5"]


class _Crashing(keras.utils.PyDataset):
    """Yields the rows of `x` in batches of 4, and dies at batch `crash_at`.

    `requested` lists the batches read to predict them (on parallel_predict's
    reader thread), not those read before, to count rows and fingerprint.
    """

    def __init__(self, x, crash_at=None, size=4):
        super().__init__()
        self.x, self.crash_at, self.size, self.requested = x, crash_at, size, []

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, i):
        if threading.current_thread().name == "kerasmulti-reader":
            self.requested.append(i)
            if i == self.crash_at:
                raise RuntimeError("the job died")
        return self.x[i * self.size : (i + 1) * self.size]


def test_the_same_call_resumes_where_the_file_stopped(tmp_path):
    model, x = _two_outputs(), _data(30)
    path = str(tmp_path / "out.h5")
    with pytest.raises(RuntimeError, match="the job died"):
        kerasmulti.parallel_predict(model, _Crashing(x, crash_at=5), output=path, verbose=0)
    with h5py.File(path, "r") as f:
        done = int(f.attrs["kerasmulti_rows_done"])
    assert 0 < done < 30
    again = _Crashing(x)
    kerasmulti.parallel_predict(model, again, output=path, verbose=0)
    assert min(again.requested) >= done // 4  # it did not start over
    features, score = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], features, rtol=1e-5, atol=1e-6)
        assert f.attrs["kerasmulti_rows_done"] == 30


def test_another_model_or_input_is_refused(tmp_path):
    model, x = _two_outputs(), _data(12)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, x, output=path, verbose=0)
    with pytest.raises(ValueError, match=r"different model.*Received: output="):
        kerasmulti.parallel_predict(_two_outputs(seed=1), x, output=path, verbose=0)
    with pytest.raises(ValueError, match=r"different input.*Received: output="):
        kerasmulti.parallel_predict(model, x + 1, output=path, verbose=0)


def test_a_file_that_is_not_hdf5_is_refused_as_not_ours_and_left_alone(tmp_path):
    # A mistyped output naming the user's model, say: choose another path, never "delete it".
    path = tmp_path / "model.keras"
    path.write_bytes(b"PK\x03\x04 a zip file, not hdf5")
    with pytest.raises(ValueError, match=r"model.keras' is not an HDF5 file, so parallel_predict\(\) did not write it\. Choose another output path\. Received: output="):
        kerasmulti.parallel_predict(_two_outputs(), _data(4), output=str(path), verbose=0)
    assert path.read_bytes() == b"PK\x03\x04 a zip file, not hdf5"


def test_an_empty_file_at_the_output_path_is_written_as_a_new_one(tmp_path):
    # A name reserved with `touch` or tempfile.NamedTemporaryFile: nothing in it to resume or to lose.
    model, x = _two_outputs(), _data(6)
    path = tmp_path / "out.h5"
    path.write_bytes(b"")
    expected = model.predict(x, verbose=0)
    kerasmulti.parallel_predict(model, x, output=str(path), verbose=0)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["features", "score"]
        for name, value in zip(["features", "score"], expected):
            np.testing.assert_allclose(f[name][()], value, rtol=1e-6, atol=1e-6)


def test_bad_gpus_are_refused_naming_parallel_predict():
    with pytest.raises(kerasmulti.DeviceError, match=r"^parallel_predict\(\) expects gpus as a positive int.*Received: gpus='a'$"):
        kerasmulti.parallel_predict(_two_outputs(), _data(4), gpus="a")


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "8", True])
def test_bad_batch_size_is_refused(batch_size):
    with pytest.raises(ValueError, match=f"Received: batch_size={batch_size!r}"):
        kerasmulti.parallel_predict(_two_outputs(), _data(4), batch_size=batch_size)


def test_unreadable_data_and_wrong_shapes_are_refused():
    for path in ("x.npy", pathlib.Path("x.npy")):  # the fix was about lists (found by review)
        with pytest.raises(TypeError, match=r"^parallel_predict\(\) reads arrays, not files\. Open it first: "
                           r"np\.load\(path, mmap_mode='r'\) for \.npy \(docs/inference\.md\)\. Received: data='x\.npy'$"):
            kerasmulti.parallel_predict(_two_outputs(), path)
    with pytest.raises(ValueError, match=r"do not fit model.*\(6,\).*Received: row_shapes=\(5,\)"):
        kerasmulti.parallel_predict(_two_outputs(), np.zeros((4, 5), "float32"))
    with pytest.raises(ValueError, match=r"same number of rows.*Received: rows per input \[3, 4\]"):
        kerasmulti.parallel_predict(_two_outputs(), [np.zeros((3, 6)), np.zeros((4, 6))])


def test_lists_of_numbers_generators_and_model_paths_are_refused_with_the_fix():
    model, x = _two_outputs(), _data(16)
    with pytest.raises(TypeError, match=r"numpy arrays \(or a list or dict of them\).*np\.asarray\(\.\.\.\).*Received: data=list holding float"):
        kerasmulti.parallel_predict(model, x.tolist(), verbose=0)

    def batches():
        for begin in range(0, 16, 4):
            yield x[begin : begin + 4]

    for steps in (None, 2):
        with pytest.raises(TypeError, match=r"cannot read a Python generator twice.*from_generator.*PyDataset.*Received: data=generator"):
            kerasmulti.parallel_predict(model, batches(), steps=steps, verbose=0)
    # The fix the message gives works, steps= included.
    wrapped = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, 6), tf.float32))
    _assert_same(model.predict(x[:8], verbose=0), kerasmulti.parallel_predict(model, wrapped, steps=2, verbose=0))
    with pytest.raises(TypeError, match=r"^parallel_predict\(\) predicts with a keras\.Model.*keras\.models\.load_model.*Received: model='model\.keras'$"):
        kerasmulti.parallel_predict("model.keras", x, verbose=0)


@pytest.mark.parametrize("verbose", ["loud", 3, -1, 1.0, None])
def test_verbose_other_than_model_predicts_is_refused(verbose):
    with pytest.raises(ValueError, match=r"verbose as in model\.predict.*Received: verbose=" + re.escape(repr(verbose)) + "$"):
        kerasmulti.parallel_predict(_two_outputs(), _data(4), verbose=verbose)


def test_progress_bar_shows_rows_per_second_and_verbose_0_is_quiet(capsys):
    model, x = _two_outputs(), _data(40)
    kerasmulti.parallel_predict(model, x, batch_size=8, verbose=0)
    assert capsys.readouterr().out == ""
    kerasmulti.parallel_predict(model, x, batch_size=8, verbose=1)
    out = capsys.readouterr().out
    assert "40/40" in out and "rows/s" in out
    for verbose in (2, "auto", np.int64(0), False):
        kerasmulti.parallel_predict(model, x, batch_size=8, verbose=verbose)


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_a_valid_file_and_resumes(tmp_path, seeded_data):
    path = str(tmp_path / "out.h5")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    progress = []
    moments = random.Random(seeded_data)  # the test's printed seed replays the same moments
    for _ in range(5):
        process = subprocess.Popen([sys.executable, WORKER, path], stdout=subprocess.PIPE, text=True, env=env)
        assert process.stdout.readline().strip() == "started"
        time.sleep(moments.uniform(0.5, 2.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        if os.path.exists(path):
            with h5py.File(path, "r") as f:  # valid at every moment
                done = int(f.attrs["kerasmulti_rows_done"])
                assert f["features"].shape == (6000, 64)
            progress.append(done)
    assert progress and progress == sorted(progress), progress  # never goes back
    result = subprocess.run([sys.executable, WORKER, path, "--check"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["predict:rows", "predict:counter"])
def test_a_crash_between_the_writes_of_a_batch_resumes_with_every_row_right(tmp_path, point):
    # The process ends (as under SIGKILL) after batch 30's rows, or after its
    # counter: the counter never claims rows that are not on disk. (Written
    # counter first, the rows-point crash leaves it claiming missing rows,
    # and the check below fails: tried.)
    path = str(tmp_path / "out.h5")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", _fault_points.ENV: f"{point}:30"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    crashed = subprocess.run([sys.executable, WORKER, path], capture_output=True, text=True, env=env, timeout=300)
    assert crashed.returncode == _fault_points.EXIT_CODE, crashed.stdout + crashed.stderr[-3000:]
    with h5py.File(path, "r") as f:
        assert int(f.attrs["kerasmulti_rows_done"]) == (29 if point == "predict:rows" else 30) * 50
    del env[_fault_points.ENV]
    result = subprocess.run([sys.executable, WORKER, path, "--check"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_a_parallel_model_reuses_its_compiled_step_across_calls():
    model, x = _two_outputs(), _data(20)
    parallel = kerasmulti.parallelize(model, gpus=DEVICES)
    kerasmulti.parallel_predict(parallel, x, batch_size=8, verbose=0)
    step = parallel._kerasmulti_predict
    traces = step.experimental_get_tracing_count()
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(parallel, x, batch_size=8, verbose=0))
    assert parallel._kerasmulti_predict is step
    assert step.experimental_get_tracing_count() == traces


def test_a_plain_model_is_parallelized_once_per_devices_and_architecture():
    model, x = _two_outputs(), _data(20)
    layers = list(model.layers)
    kerasmulti.parallel_predict(model, x, batch_size=8, verbose=0)
    kerasmulti.parallel_predict(model, x, gpus=2, batch_size=8, verbose=0)
    (first, step), (second, _) = [(p, p._kerasmulti_predict) for p in _cached(model)]
    assert first._replica_devices != second._replica_devices
    traces = step.experimental_get_tracing_count()
    model.layers[1].kernel.assign(np.random.default_rng().normal(size=(6, 8)))  # weights are shared
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=8, verbose=0))
    assert _cached(model)[0] is first and step.experimental_get_tracing_count() == traces
    assert model.layers == layers and len(model.weights) == 6  # not a sub-layer


@pytest.mark.slow  # 7 s: CI runs it, the fast tier does not
def test_moved_or_quantized_variables_get_a_new_parallel_model():
    model, x = _two_outputs(), _data(16)
    kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0)
    # cpu_relocation gives the model new variables, which the training changes.
    parallel = kerasmulti.parallelize(model, gpus=2, cpu_relocation=True)
    parallel.compile("sgd", ["mse", "mse"])
    parallel.fit(x, [np.ones((16, 3)), np.ones((16, 1))], batch_size=8, epochs=2, verbose=0)
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0))
    model.quantize("int8")
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0))
    assert len(_cached(model)) == 1  # one per set of devices, replaced


def test_a_subclassed_model_saves_and_loads_the_same_after_parallel_predict(tmp_path):
    model, x = TwoDense(), _data(16)
    model(x[:1])
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0))
    assert _cached(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as weights:
        with h5py.File(io.BytesIO(weights.read()), "r") as f:
            paths = []
            f.visit(paths.append)
    assert paths and not [p for p in paths if "kerasmulti" in p or "parallel" in p], paths
    loaded = keras.saving.load_model(path, custom_objects={"TwoDense": TwoDense})
    _assert_same(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


@keras.saving.register_keras_serializable("kerasmulti_tests")
class TwoDense(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def test_a_grown_sequential_gets_a_new_parallel_model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    x = _data(12)
    kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0)
    model.add(keras.layers.Dense(2))
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, verbose=0))


def _cached(model):
    return [parallel for parallel, _ in model.__dict__.get("__kerasmulti_parallel_models", {}).values()]


def test_reader_thread_ends_when_prediction_fails():
    import threading

    model = _two_outputs()
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="do not fit model"):
        kerasmulti.parallel_predict(model, np.zeros((64, 5), "float32"), batch_size=4, verbose=0)

    class BadBatch(keras.utils.PyDataset):
        """Batch 5 has the wrong width: the prediction fails mid-stream."""

        def __len__(self):
            return 50

        def __getitem__(self, i):
            return np.zeros((4, 7 if i == 5 else 6), "float32")

    with pytest.raises(tf.errors.InvalidArgumentError, match="size-incompatible"):
        kerasmulti.parallel_predict(model, BadBatch(), verbose=0)
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name == "kerasmulti-reader"]
    assert not leftover


def test_empty_input_is_refused():
    with pytest.raises(ValueError, match=r"no rows.*Received: rows=0"):
        kerasmulti.parallel_predict(_two_outputs(), _data(0))


def test_a_finished_file_is_left_as_it_is_and_batching_does_not_change_the_input(tmp_path):
    model, x = _two_outputs(), _data(10)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, _Crashing(x), output=path, verbose=0)  # batches of 4, last of 2
    # The same rows batched differently are the same input: accepted, nothing left to read.
    again = _Crashing(x, size=3)
    kerasmulti.parallel_predict(model, again, output=path, verbose=0)
    assert again.requested == []
    features, _ = model.predict(x, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], features, rtol=1e-5, atol=1e-6)


def _uneven(x, sizes):
    """A tf.data pipeline of the rows of `x` in batches of `sizes` (as bucketing gives)."""
    starts = np.cumsum([0, *sizes])

    def batches():
        for begin, end in zip(starts[:-1], starts[1:]):
            yield x[begin:end]

    return tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, x.shape[1]), tf.float32))


def test_uneven_tf_data_batches_resume_without_losing_rows(tmp_path):
    model, x = _two_outputs(), _data(10)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, _uneven(x, [3, 5, 2]), output=path, verbose=0)
    with h5py.File(path, "r+") as f:  # as a kill after the second batch leaves it
        f.attrs["kerasmulti_rows_done"] = 8
        f["features"][8:] = 0
    kerasmulti.parallel_predict(model, _uneven(x, [3, 5, 2]), output=path, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], model.predict(x, verbose=0)[0], rtol=1e-5, atol=1e-6)
        assert f.attrs["kerasmulti_rows_done"] == 10


def test_batches_that_break_the_row_count_are_refused(tmp_path):
    model, x = _two_outputs(), _data(10)

    class Uneven(keras.utils.PyDataset):  # Keras wants every batch but the last full
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return x[[0, 3, 8][i] : [3, 8, 10][i]]

    with pytest.raises(ValueError, match=r"PyDataset batch 1 has 5 rows.*expects 3\. Make every batch but the last as large as the first\. Received: batch=1, rows=5"):
        kerasmulti.parallel_predict(model, Uneven(), verbose=0)

    class TooLong(keras.utils.PyDataset):  # batches of 4, 4 and 2 rows, then empty ones
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return x[4 * i : 4 * i + 4]

    with pytest.raises(ValueError, match=r"PyDataset batch 2 has 2 rows.*expects 4\. Make __len__ count only batches that hold rows \(batch 4 holds none\)\. Received"):
        kerasmulti.parallel_predict(model, TooLong(), verbose=0)  # before: it blamed batch 2 alone
    reads = []  # a pipeline that batches differently when read again

    def batches():
        reads.append(1)
        yield from _uneven(x, [3, 5, 2] if len(reads) == 1 else [5, 3, 2]).as_numpy_iterator()

    dataset = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, 6), tf.float32))
    # With output= the pipeline is read to count its rows, then to predict.
    with pytest.raises(ValueError, match=r"gave other batches when read again: batch 0 has 5 rows now and had 3.*Received: batch=0, rows=5"):
        kerasmulti.parallel_predict(model, dataset, verbose=0, output=str(tmp_path / "out.h5"))


def test_a_reshuffling_pipeline_is_refused_before_the_file_is_made(tmp_path):
    # Its rows would be written in another order than the input's, unnoticed.
    model, x = _two_outputs(), _data(16)
    path = tmp_path / "out.h5"
    reshuffled = tf.data.Dataset.from_tensor_slices(x).shuffle(16, seed=0).batch(4)
    with pytest.raises(ValueError, match=r"gave other batches when read again: batch 0 holds other values.*reshuffle_each_iteration=False.*Received: batch=0$"):
        kerasmulti.parallel_predict(model, reshuffled, output=str(path), verbose=0)
    assert not path.exists()
    # Shuffled once, in an order that every read repeats: written in that order.
    fixed = tf.data.Dataset.from_tensor_slices(x).shuffle(16, seed=0, reshuffle_each_iteration=False).batch(4)
    kerasmulti.parallel_predict(model, fixed, output=str(path), verbose=0)
    rows = np.concatenate(list(fixed.as_numpy_iterator()))
    assert not np.array_equal(rows, x)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["features"][:], model.predict(rows, verbose=0)[0], rtol=1e-5, atol=1e-6)


def test_a_batch_with_other_values_when_read_again_is_refused_before_it_is_written(tmp_path):
    model, x = _two_outputs(), _data(10)
    path = str(tmp_path / "out.h5")
    reads = []

    def batches():  # the second batch in another order after the first read, same rows
        reads.append(1)
        yield x[:3]
        yield x[3:8] if len(reads) == 1 else x[3:8][::-1]
        yield x[8:]

    dataset = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, 6), tf.float32))
    with pytest.raises(ValueError, match=r"gave other batches when read again: batch 1 holds other values.*Received: batch=1$"):
        kerasmulti.parallel_predict(model, dataset, output=path, verbose=0)
    with h5py.File(path, "r") as f:  # the batch before it is written, the refused one is not
        assert f.attrs["kerasmulti_rows_done"] == 3
        np.testing.assert_allclose(f["features"][:3], model.predict(x[:3], verbose=0)[0], rtol=1e-5, atol=1e-6)
        assert not f["features"][3:].any()


def test_an_input_that_ends_early_when_read_again_is_refused(tmp_path):
    model, x = _two_outputs(), _data(10)
    reads = []

    def batches():  # 3 batches when counted, 2 when read to predict
        reads.append(1)
        yield from _uneven(x, [3, 5, 2] if len(reads) == 1 else [3, 5]).as_numpy_iterator()

    dataset = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, 6), tf.float32))
    with pytest.raises(ValueError, match=r"gave 8 rows, but 10 were counted.*Received: rows=8, counted=10"):
        kerasmulti.parallel_predict(model, dataset, verbose=0, output=str(tmp_path / "out.h5"))


@pytest.mark.parametrize("output", [False, True], ids=["in memory", "to a file"])
def test_an_endless_repeat_behind_a_filter_is_refused_and_bounded_by_steps(tmp_path, output):
    # TensorFlow says UNKNOWN, not INFINITE: without the check the rows were counted forever.
    model, x = _two_outputs(), _data(8)
    endless = tf.data.Dataset.from_tensor_slices(x).repeat().filter(lambda row: True).batch(4)
    to = dict(output=str(tmp_path / "out.h5")) if output else {}
    with pytest.raises(ValueError, match=r"repeats forever.*Pass steps=.*Received: data.cardinality\(\)=UNKNOWN with an endless .repeat\(\)"):
        kerasmulti.parallel_predict(model, endless, verbose=0, **to)
    assert not (tmp_path / "out.h5").exists()
    bounded = kerasmulti.parallel_predict(model, endless, steps=3, verbose=0, **to)
    rows = h5py.File(bounded, "r")["score"][:] if output else bounded[1]
    assert len(rows) == 12
    # Bounded by the user's own take(), or a repeat with a count: taken as they are.
    for finite in (endless.take(2), tf.data.Dataset.from_tensor_slices(x).repeat(2).filter(lambda row: True).batch(4)):
        assert kerasmulti.parallel_predict(model, finite, verbose=0)[1].shape[0] in (8, 16)


def test_a_pipeline_tensorflow_counts_infinite_but_that_ends_is_predicted_as_keras_predicts_it():
    # sample_from_datasets stopping at its first empty input ends, though TensorFlow's count says INFINITE.
    model, x = _two_outputs(), _data(10)
    rows = tf.data.Dataset.from_tensor_slices(x)
    data = tf.data.Dataset.sample_from_datasets([rows.repeat(), rows], seed=1, stop_on_empty_dataset=True).batch(4)
    assert int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    expected = model.predict(data, verbose=0)
    _assert_same(expected, kerasmulti.parallel_predict(model, data, verbose=0))


def test_inputs_that_never_end_are_refused_at_once():
    model, x = _two_outputs(), _data(8)
    with pytest.raises(ValueError, match=r"never ends.*Received: data.cardinality\(\)=INFINITE"):
        kerasmulti.parallel_predict(model, tf.data.Dataset.from_tensor_slices(x).batch(4).repeat(), verbose=0)

    class Endless(keras.utils.PyDataset):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return x[:4]

    with pytest.raises(ValueError, match=r"without a length.*Received: data.num_batches=None"):
        kerasmulti.parallel_predict(model, Endless(), verbose=0)


def test_an_input_changed_between_its_first_and_last_rows_is_refused(tmp_path):
    model, x = _two_outputs(), _data(40)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, x, output=path, verbose=0)
    changed = x.copy()
    changed[17:23] += 1  # same size, same first and last rows
    with pytest.raises(ValueError, match=r"different input.*Received: output="):
        kerasmulti.parallel_predict(model, changed, output=path, verbose=0)


def test_inputs_that_model_predict_accepts_are_accepted(tmp_path):
    left, right = keras.Input((4,), name="left"), keras.Input((2,), name="right")
    model = keras.Model([left, right], keras.layers.Dense(2)(keras.layers.concatenate([left, right])))
    rng = np.random.default_rng()
    by_name = {"right": rng.normal(size=(9, 2)).astype("float32"), "left": rng.normal(size=(9, 4)).astype("float32")}
    _assert_same(model.predict(by_name, verbose=0), kerasmulti.parallel_predict(model, by_name, batch_size=4, verbose=0))

    single, x = _two_outputs(), _data(9)

    class Labelled(keras.utils.PyDataset):  # [x, y] lists, as Keras unpacks them
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return [x[i * 3 : (i + 1) * 3], np.zeros(3)]

    _assert_same(single.predict(x, verbose=0), kerasmulti.parallel_predict(single, Labelled(), verbose=0))

    class Scaled(keras.Model):  # its config cannot be serialised: fingerprinted without it
        def __init__(self, scale):
            super().__init__()
            self.scale, self.dense = scale, keras.layers.Dense(2)

        def call(self, inputs):
            return self.dense(inputs) * self.scale

    subclassed = Scaled(np.float32(2.0))
    subclassed(x[:1])
    path = str(tmp_path / "scaled.h5")
    kerasmulti.parallel_predict(subclassed, x, output=path, verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["output_0"][:], subclassed.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_bfloat16_outputs_are_stored_as_float32(tmp_path):
    model, x = _two_outputs(), _data(7)
    path = str(tmp_path / "out.h5")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        half = _two_outputs()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    kerasmulti.parallel_predict(half, x, output=path, verbose=0)
    expected = half.predict(x, verbose=0)[0]
    assert expected.dtype.name == "bfloat16"
    with h5py.File(path, "r") as f:
        assert f["features"].dtype == np.float32
        np.testing.assert_array_equal(f["features"][:], expected.astype("float32"))


def test_the_input_file_is_refused_as_output(tmp_path):
    model, x = _two_outputs(), _data(6)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["x"] = x
    with h5py.File(tmp_path / "data.h5", "r") as f:
        with pytest.raises(ValueError, match=r"would overwrite its input file.*Received: output="):
            kerasmulti.parallel_predict(model, f["x"], output=str(tmp_path / "data.h5"), verbose=0)
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ValueError, match=r"writes an HDF5 file, not numpy's format"):
        kerasmulti.parallel_predict(model, np.load(tmp_path / "x.npy", mmap_mode="r"), output=str(tmp_path / "x.npy"), verbose=0)
    os.rename(tmp_path / "x.npy", tmp_path / "x.bin")  # numpy's format under another name
    with pytest.raises(ValueError, match=r"would overwrite its input file"):
        kerasmulti.parallel_predict(model, np.load(tmp_path / "x.bin", mmap_mode="r"), output=str(tmp_path / "x.bin"), verbose=0)
    np.testing.assert_array_equal(np.load(tmp_path / "x.bin"), x)


def test_a_pipeline_is_read_once_when_results_come_back_in_memory(tmp_path):
    # As Keras' predict reads it; with output= its rows are counted (and
    # fingerprinted) first, so the file can be resumed.
    model, x = _two_outputs(), _data(23)
    reads = []

    def batches():
        for begin in range(0, len(x), 5):
            reads.append(begin)
            yield x[begin : begin + 5]

    spec = tf.TensorSpec((None, *x.shape[1:]), tf.float32)
    dataset = tf.data.Dataset.from_generator(batches, output_signature=spec)
    got = kerasmulti.parallel_predict(model, dataset, gpus=DEVICES, verbose=0)
    assert reads == [0, 5, 10, 15, 20]
    for g, e in zip(got, model.predict(x, verbose=0)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    reads.clear()
    kerasmulti.parallel_predict(model, dataset, gpus=DEVICES, verbose=0, output=str(tmp_path / "out.h5"))
    assert len(reads) > 5
    empty = tf.data.Dataset.from_tensor_slices(np.zeros((0, x.shape[1]), "float32")).batch(4)
    with pytest.raises(ValueError, match="no rows.*Received: rows=0"):
        kerasmulti.parallel_predict(model, empty, verbose=0)


def _endless(x, size):
    """A pipeline of batches of `x` that never ends and whose length TensorFlow cannot tell."""

    def batches():
        while True:
            for begin in range(0, len(x), size):
                yield x[begin : begin + size]

    return tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec((None, x.shape[1]), tf.float32))


class _Endless(keras.utils.PyDataset):
    """A PyDataset without a length: batch i holds rows 3i to 3i+2 of `x`, round and round."""

    def __init__(self, x):
        super().__init__()
        self.x = x

    @property
    def num_batches(self):
        return None

    def __getitem__(self, i):
        return np.roll(self.x, -3 * i, axis=0)[:3]


def test_steps_predicts_that_many_batches_of_an_endless_input(tmp_path):
    model, x = _two_outputs(), _data(10)
    repeated = tf.data.Dataset.from_tensor_slices(x).batch(4).repeat()
    assert int(repeated.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    assert int(_endless(x, 4).cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    # Batches of 4, 4 and 2 rows, round and round; the PyDataset's of 3.
    for data, steps, rows in ((repeated, 5, 18), (_endless(x, 4), 4, 14), (_Endless(x), 3, 9)):
        expected = model.predict(data, steps=steps, verbose=0)
        assert len(expected[0]) == rows
        _assert_same(expected, kerasmulti.parallel_predict(model, data, steps=steps, verbose=0))
        path = str(tmp_path / f"{steps}.h5")
        kerasmulti.parallel_predict(model, data, steps=steps, output=path, verbose=0)
        with h5py.File(path, "r") as f:
            _assert_same(expected, [f["features"][:], f["score"][:]])
            assert f.attrs["kerasmulti_rows_done"] == len(expected[0])


def test_steps_on_arrays_and_finite_inputs_as_in_keras():
    model, x = _two_outputs(), _data(10)
    _assert_same(model.predict(x, batch_size=4, steps=2, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, steps=2, verbose=0))
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(4)
    _assert_same(model.predict(dataset, steps=2, verbose=0), kerasmulti.parallel_predict(model, dataset, steps=2, verbose=0))
    # More steps than batches: all of it, as Keras gives (after a warning).
    with pytest.warns(UserWarning, match="ran out of data"):
        expected = model.predict(dataset, steps=9, verbose=0)
    _assert_same(expected, kerasmulti.parallel_predict(model, dataset, steps=9, verbose=0))
    _assert_same(model.predict(x, verbose=0), kerasmulti.parallel_predict(model, x, batch_size=4, steps=9, verbose=0))


def test_a_file_written_with_other_steps_is_another_input(tmp_path):
    model, x = _two_outputs(), _data(10)
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, x, batch_size=4, steps=1, output=path, verbose=0)
    with pytest.raises(ValueError, match=r"different input.*Received: output="):
        kerasmulti.parallel_predict(model, x, batch_size=4, steps=2, output=path, verbose=0)


@pytest.mark.parametrize("steps", [0, -1, 2.5, "3", True])
def test_bad_steps_are_refused(steps):
    with pytest.raises(ValueError, match=rf"steps as a positive int or None \(all\).*Received: steps={steps!r}"):
        kerasmulti.parallel_predict(_two_outputs(), _data(4), steps=steps)


def _sequences(lengths, width=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, width)).astype("float32") for n in lengths]


def _padded(rows, batch_size):
    """Sequences (or images) batched by tf.data's padded_batch: each batch padded to its longest."""
    spec = tf.TensorSpec((None,) * (rows[0].ndim - 1) + (rows[0].shape[-1],), tf.float32)
    return tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=spec).padded_batch(batch_size)


def _per_step(seed=0):
    """Per-step features (rows as long as the input) and a pooled vector (one shape)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((None, 3))
    steps = keras.layers.Dense(4, name="steps")(inputs)
    return keras.Model(inputs, [steps, keras.layers.GlobalAveragePooling1D(name="pooled")(steps)])


def _assert_same_ragged(expected, got):
    assert isinstance(got, tf.RaggedTensor) and got.shape.as_list() == expected.shape.as_list()
    assert got.ragged_rank == expected.ragged_rank and got.dtype == expected.dtype
    for e, g in zip(expected.nested_row_splits, got.nested_row_splits):
        np.testing.assert_array_equal(g, e)
    np.testing.assert_allclose(got.flat_values, expected.flat_values, rtol=1e-5, atol=1e-6)


def test_batches_of_different_lengths_come_back_as_model_predict_returns_them():
    model = _per_step()
    data = _padded(_sequences([2, 5, 3, 7, 1, 4, 6]), 3)  # batches padded to 5, 7 and 6 steps
    expected, got = model.predict(data, verbose=0), kerasmulti.parallel_predict(model, data, verbose=0)
    _assert_same_ragged(expected[0], got[0])
    assert isinstance(got[1], np.ndarray)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sizes, ragged_rank",
    [([(2, 3), (4, 1), (3, 3), (1, 2)], 1), ([(2, 3), (2, 1), (2, 4), (2, 2)], 2)],
    ids=["heights-differ", "widths-differ"],
)
def test_images_of_different_sizes_are_ragged_as_in_keras(sizes, ragged_rank):
    # Ragged up to the last dimension that differs between batches.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 2))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    rng = np.random.default_rng(0)
    data = _padded([rng.normal(size=(*size, 2)).astype("float32") for size in sizes], 2)
    expected = model.predict(data, verbose=0)
    assert expected.ragged_rank == ragged_rank
    _assert_same_ragged(expected, kerasmulti.parallel_predict(model, data, verbose=0))


def test_outputs_that_change_shape_are_refused_before_the_file_is_made(tmp_path):
    model, path = _per_step(), tmp_path / "out.h5"
    data = _padded(_sequences([2, 5, 3, 7, 1, 4, 6]), 3)
    with pytest.raises(ValueError, match=r"Output 'steps' has rows of shape \(5, 4\) in the first batch but \(7, 4\) from row 3.*holds one row shape.*output=None.*Received: output="):
        kerasmulti.parallel_predict(model, data, output=str(path), verbose=0)
    assert not path.exists()
    # Outputs of one shape from batches of several (bucketing) are written as they are.
    pooled = keras.Model(model.inputs, model.outputs[1])
    kerasmulti.parallel_predict(pooled, data, output=str(path), verbose=0)
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["pooled"][:], pooled.predict(data, verbose=0), rtol=1e-5, atol=1e-6)


class _Lengths(keras.utils.PyDataset):
    """Batches of 2 sequences each, of the given lengths."""

    def __init__(self, lengths):
        super().__init__()
        self.batches = [np.stack(_sequences([n, n], seed=i)) for i, n in enumerate(lengths)]

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def test_a_pydataset_whose_outputs_change_shape_is_refused_before_writing_that_batch(tmp_path):
    model, path = _per_step(), tmp_path / "out.h5"
    # Its last batch is read before predicting, its middle ones only when predicted.
    with pytest.raises(ValueError, match=r"\(4, 4\) in the first batch but \(6, 4\) from row 6"):
        kerasmulti.parallel_predict(model, _Lengths([4, 4, 4, 6]), output=str(path), verbose=0)
    assert not path.exists()
    data = _Lengths([4, 4, 5, 4])
    for _ in range(2):  # the same refusal on the same rows every time, the rows before kept
        with pytest.raises(ValueError, match=r"\(4, 4\) in the first batch but \(5, 4\) from row 4.*Received: output="):
            kerasmulti.parallel_predict(model, data, output=str(path), verbose=0)
        with h5py.File(path, "r") as f:
            assert f.attrs["kerasmulti_rows_done"] == 4
            np.testing.assert_allclose(f["steps"][:4], model.predict(np.concatenate(data.batches[:2]), verbose=0)[0], rtol=1e-5, atol=1e-6)
            assert not f["steps"][4:].any()  # nothing of the refused batch


def test_single_values_and_text_are_refused():
    model = _two_outputs()
    with pytest.raises(ValueError, match=r"got a 0-d array\. Add a batch axis.*np.expand_dims\(x, 0\).*Received: shape=\(\)"):
        kerasmulti.parallel_predict(model, np.float32(3))
    with pytest.raises(ValueError, match=r"Input 0 of model .* takes float32 numbers, but the data holds text.*Received: dtype=<U1"):
        kerasmulti.parallel_predict(model, np.full((4, 6), "a"))
    with pytest.raises(ValueError, match=r"holds Python objects.*Received: dtype=object"):
        kerasmulti.parallel_predict(model, np.full((4, 6), None, dtype=object))


def test_unbatched_pipelines_are_refused_as_predict_refuses_them(tmp_path):
    rows = tf.data.Dataset.from_tensor_slices(_data(8))
    with pytest.raises(ValueError, match=r"parallel_predict\(\) got a Dataset of single rows\. Batch it: dataset\.batch\(32\)\. Received: element shape=\(6,\)"):
        kerasmulti.parallel_predict(_two_outputs(), rows, verbose=0)
    inputs = keras.Input((1,))
    scalar_model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    values = tf.data.Dataset.from_tensor_slices(np.arange(8, dtype="float32"))
    with pytest.raises(ValueError, match=r"got a batch that is a single value\. Batch the input: dataset\.batch\(32\)\. Received: batch shape=\(\)"):
        kerasmulti.parallel_predict(scalar_model, values, output=str(tmp_path / "out.h5"), verbose=0)  # before: TypeError from len()
    assert not (tmp_path / "out.h5").exists()


def test_a_pipeline_that_gives_nothing_when_read_again_is_refused(tmp_path):
    model, x = _two_outputs(), _data(12)
    once = (x[i : i + 4] for i in range(0, 12, 4))  # one pass only: counting the rows uses it up
    pipeline = tf.data.Dataset.from_generator(lambda: once, output_signature=tf.TensorSpec((None, 6), tf.float32))
    with pytest.raises(ValueError, match=r"The input gave 0 rows, but 12 were counted before\. Make it give the same rows on each read\. Received: rows=0, counted=12"):
        kerasmulti.parallel_predict(model, pipeline, output=str(tmp_path / "out.h5"), verbose=0)  # before: a bare StopIteration


def _batch_mean(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.ops.mean(keras.layers.Dense(3)(inputs), axis=0, keepdims=True))


def test_a_model_that_reduces_over_its_rows_is_refused_batch_by_batch_also_after_a_step_for_any_batch_size(tmp_path):
    # A call on 2 rows leaves a step traced for any batch size (no rows to check while
    # tracing): each later batch came back as one row per replica, and into a file too.
    model, x = _batch_mean(), _data(20)
    kerasmulti.parallel_predict(model, x[:DEVICES], verbose=0)  # one row each: no rows mixed, nothing to see
    message = r"A batch of \d+ row\(s\) gave an output without one row per input row, so its rows are not the input's.*or use model\.predict\. Received: output shape \(\d, 3\)"
    with pytest.raises(ValueError, match=message):
        kerasmulti.parallel_predict(model, x, batch_size=10, verbose=0)
    with pytest.raises(ValueError, match=message):
        kerasmulti.parallel_predict(model, tf.data.Dataset.from_tensor_slices(x).batch(10), verbose=0)
    for _ in range(2):  # before: every call wrote some rows and moved the file's counter on
        with pytest.raises(ValueError, match=message):
            kerasmulti.parallel_predict(model, x, batch_size=10, output=str(tmp_path / "out.h5"), verbose=0)
        assert not (tmp_path / "out.h5").exists()


def test_an_output_squeezed_to_one_axis_is_written_as_model_predict_returns_it(tmp_path):
    # The file's layout came from 2 sample rows: one per replica, which squeeze() made a scalar.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.ops.squeeze(keras.layers.Dense(1)(inputs)))
    x = _data(24)
    expected = model.predict(x, batch_size=8, verbose=0)
    assert expected.shape == (24,)
    for fresh in (True, False):  # a fresh step, and the step the call before kept
        path = tmp_path / f"out-{fresh}.h5"
        kerasmulti.parallel_predict(model, x, batch_size=8, output=str(path), verbose=0)
        with h5py.File(path, "r") as f:
            np.testing.assert_allclose(f[next(iter(f))][...], expected, rtol=1e-5, atol=1e-6)


def test_a_damaged_hdf5_input_is_named(tmp_path):
    x = _data(40)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(10, 6), compression="gzip")
    data = bytearray((tmp_path / "in.h5").read_bytes())
    with h5py.File(tmp_path / "in.h5", "r") as f:
        offset = f["x"].id.get_chunk_info(2).byte_offset  # rows 20 to 29
    data[offset : offset + 64] = bytes(64)
    (tmp_path / "in.h5").write_bytes(bytes(data))
    with h5py.File(tmp_path / "in.h5", "r") as f:
        with pytest.raises(ValueError, match=r"Rows 20 to 30 of '/x' could not be read: damaged file.*Rewrite it.*Received: input='.*in.h5'"):
            kerasmulti.parallel_predict(_two_outputs(), f["x"], batch_size=10, verbose=0)


@pytest.mark.parametrize("wrap", [False, True], ids=["parallel_predict", "parallelize"])
def test_a_compiled_models_metrics_and_steps_are_left_as_found(wrap):
    # Wrapping compiled the template again: its metrics' state was gone ("has not yet been
    # built") and its train_function dropped, as if it had never trained.
    rng = np.random.default_rng()
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before, step, optimizer = model.get_metrics_result(), model.train_function, model.optimizer
    if wrap:
        kerasmulti.parallelize(model, gpus=DEVICES).predict(x, verbose=0)
    else:
        kerasmulti.parallel_predict(model, x, verbose=0)
    assert {k: float(v) for k, v in model.get_metrics_result().items()} == {k: float(v) for k, v in before.items()}
    assert model.train_function is step and model.optimizer is optimizer


@pytest.mark.parametrize("batch", [2, 4])
def test_a_stateful_rnn_on_one_device_writes_what_model_predict_gives(tmp_path, batch):
    # The file's layout came from a run on 2 sample rows: the RNN's state moved on before the first
    # batch (every row wrong), or, with its batch size fixed at 4, TensorFlow refused the 2 rows.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3, 2), batch_size=batch), keras.layers.SimpleRNN(3, stateful=True)])
    x = np.random.default_rng().random((8, 3, 2)).astype("float32")
    model.layers[0].reset_states()
    expected = model.predict(x, batch_size=batch, verbose=0)
    model.layers[0].reset_states()
    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, x, batch_size=batch, gpus=1, output=path, verbose=0)
    with h5py.File(path, "r") as f:
        (name,) = [key for key in f if isinstance(f[key], h5py.Dataset)]
        np.testing.assert_allclose(f[name][:], expected, rtol=1e-6, atol=1e-6)


def test_the_refusals_of_a_model_name_parallel_predict():
    # They named parallelize(), which the user never called.
    with pytest.raises(ValueError, match=r"^parallel_predict\(\) needs a built model.*Received: model='.*' with built=False"):
        kerasmulti.parallel_predict(keras.Sequential([keras.layers.Dense(2)]), np.ones((4, 3), "float32"), verbose=0)
    stateful = keras.Sequential([keras.Input((3, 2), batch_size=4), keras.layers.SimpleRNN(3, stateful=True)])
    with pytest.raises(ValueError, match=r"^parallel_predict\(\) cannot split the stateful layer"):
        kerasmulti.parallel_predict(stateful, np.ones((8, 3, 2), "float32"), batch_size=4, gpus=2, verbose=0)


def test_an_index_past_an_embeddings_rows_is_refused_as_parallelize_refuses_it(tmp_path):
    # TensorFlow's own error named a row of one replica's share, several pages long.
    keras.utils.set_random_seed(2)
    tokens = keras.Input((4,), dtype="int32")
    model = keras.Model(tokens, keras.layers.Dense(2)(keras.layers.Flatten()(keras.layers.Embedding(10, 3)(tokens))))
    x = np.random.default_rng().integers(0, 10, size=(50, 4)).astype("int32")
    x[37, 2] = 50
    for output in (None, str(tmp_path / "out.h5")):
        with pytest.raises(ValueError, match=r"^parallel_predict\(\) got index 50 for Embedding '.*' \(rows 0 to 9\). Raise input_dim"):
            kerasmulti.parallel_predict(model, x, batch_size=16, output=output, verbose=0)
    x[37, 2] = 9
    np.testing.assert_allclose(kerasmulti.parallel_predict(model, x, batch_size=16, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_inputs_keras_takes_with_a_last_axis_of_1_added_or_dropped_or_a_key_more_are_taken():
    # Refused with "Reshape the data" (and, for the key, row shapes that did not name it), where
    # model.predict takes them: Keras adds or drops a last axis of 1, and ignores a dict's other keys.
    rng = np.random.default_rng()
    column = keras.Input((1,))
    one = keras.Model(column, keras.layers.Dense(2)(column))
    x = rng.random((10,)).astype("float32")
    np.testing.assert_allclose(kerasmulti.parallel_predict(one, x, batch_size=4, verbose=0), one.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    row = keras.Input((4,))
    four = keras.Model(row, keras.layers.Dense(2)(row))
    x = rng.random((10, 4, 1)).astype("float32")
    np.testing.assert_allclose(kerasmulti.parallel_predict(four, x, batch_size=4, verbose=0), four.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    named = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(keras.layers.Concatenate()([a, b])))
    data = {"a": rng.random((9, 4)).astype("float32"), "b": rng.random((9, 2)).astype("float32"), "id": np.arange(9)}
    expected = named.predict({"a": data["a"], "b": data["b"]}, verbose=0)
    for given in (data, tf.data.Dataset.from_tensor_slices(data).batch(4)):
        np.testing.assert_allclose(kerasmulti.parallel_predict(named, given, batch_size=4, verbose=0), expected, rtol=1e-6, atol=1e-6)
    # Only a last axis of 1: other axes must still fit (Keras would fail inside one replica's call).
    for model, rows, takes in ((four, (5, 1), r"\(4,\)"), (one, (3,), r"\(1,\)")):
        with pytest.raises(ValueError, match=rf"do not fit model '.*', which takes {takes}. Reshape the data"):
            kerasmulti.parallel_predict(model, np.ones((6, *rows), "float32"), verbose=0)


def test_a_text_column_beside_the_inputs_is_the_same_input_when_made_again(tmp_path):
    # pandas' df["file"].to_numpy() is an object array: its fingerprint hashed the strings' addresses,
    # so the same column made again (a resume in a new process) was "a different input".
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(keras.layers.Concatenate()([a, b])))
    rng = np.random.default_rng()
    x = {"a": rng.random((20, 4)).astype("float32"), "b": rng.random((20, 2)).astype("float32")}

    def files():  # new str objects each time
        return np.array(["".join(["img", str(i), ".png"]) for i in range(20)], dtype=object)

    path = str(tmp_path / "out.h5")
    kerasmulti.parallel_predict(model, {**x, "file": files()}, batch_size=8, output=path, verbose=0)
    assert kerasmulti.parallel_predict(model, {**x, "file": files()}, batch_size=8, output=path, verbose=0) == path
    other = files()
    other[3] = "img99.png"
    with pytest.raises(ValueError, match="different input"):
        kerasmulti.parallel_predict(model, {**x, "file": other}, batch_size=8, output=path, verbose=0)
    # Through tf.data, whose batches are hashed to be recognised when read again: they were not.
    dataset = tf.data.Dataset.from_tensor_slices({**x, "file": np.array([f"img{i}.png" for i in range(20)])}).batch(8)
    kerasmulti.parallel_predict(model, dataset, output=str(tmp_path / "dataset.h5"), verbose=0)
    with h5py.File(tmp_path / "dataset.h5", "r") as f:
        (name,) = [key for key in f if isinstance(f[key], h5py.Dataset)]
        np.testing.assert_allclose(f[name][:], model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
