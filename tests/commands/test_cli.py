"""The kerasmulti command: demo, devices, predict, and its one-line errors."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _kerasmulti(*args, cwd=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "kerasmulti", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_devices_lists_simulated_devices():
    result = _kerasmulti("--simulate", "3", "devices")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


def test_devices_names_the_variable_when_kerasmulti_simulate_devices_is_not_a_count():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERASMULTI_SIMULATE_DEVICES": "abc"}
    result = subprocess.run([sys.executable, "-m", "kerasmulti", "devices"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "KERASMULTI_SIMULATE_DEVICES must be a positive int, the number of logical CPU devices. Received: KERASMULTI_SIMULATE_DEVICES='abc'" in result.stderr


def test_demo_trains_saves_and_checks_the_reload(tmp_path):
    result = _kerasmulti("demo", "--epochs", "2", "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "Devices (2): /device:CPU:0, /device:CPU:1" in out
    assert "sub-batches of 64 on /device:CPU:0, 64 on /device:CPU:1" in out
    assert "epoch 2/2: loss" in out and "test accuracy" in out and "samples/s" in out
    assert re.search(r"median of 5 epochs each; per epoch \d+\.\d\dx to \d+\.\d\dx", out)
    assert "predictions match" in out
    assert "UserWarning" not in result.stderr, result.stderr[-3000:]  # none from the demo's own code
    saved = keras.models.load_model(str(tmp_path / "out" / "digits_convnet.keras"))
    from kerasmulti._src.commands import demo as _demo

    # The file holds the model whose accuracy was printed, not one the throughput's epochs trained on.
    _, (x_test, y_test) = _demo._digits()
    accuracy = float(np.mean(np.argmax(saved.predict(x_test, verbose=0), axis=1) == y_test))
    assert f"test accuracy: {accuracy:.4f}" in out


def test_the_demo_reports_the_sub_batches_a_batch_larger_than_the_data_really_gets():
    from kerasmulti._src.commands import demo as _demo

    devices = ["/device:CPU:0", "/device:CPU:1"]
    assert _demo._sub_batches(128, 1437, devices) == "Each batch of 128 is split into sub-batches of 64 on /device:CPU:0, 64 on /device:CPU:1"
    assert _demo._sub_batches(100000, 1437, devices) == (
        "Each batch of 1437 (the batch size 100000 clipped to the 1437 training rows) is split into sub-batches of "
        "719 on /device:CPU:0, 718 on /device:CPU:1"
    )


def test_the_demo_says_when_other_processes_were_busy(capsys):
    from kerasmulti._src.commands import demo as _demo

    _demo._report_throughput([100.0, 110.0], [150.0, 140.0], 2, others=1.5)
    out = capsys.readouterr().out
    assert "1.38x" in out and "per epoch 1.27x to 1.50x" in out
    assert "other processes kept 1.5 of" in out and "lower and noisier" in out
    _demo._report_throughput([100.0], [150.0], 2, others=0.1)
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("command", [["demo"], ["predict", "m.keras", "x.npy", "--output", "o.h5"]])
def test_more_devices_than_exist_are_refused_with_the_flags_that_fix_it(command, tmp_path):
    for name in ("m.keras", "x.npy"):  # there: predict checks its paths first
        (tmp_path / name).touch()
    result = _kerasmulti(*command, "--gpus", "5", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert (
        "kerasmulti: error: --gpus 5 is more than the 2 devices there are (/device:CPU:0, /device:CPU:1). "
        f"Pass --gpus 2, or put --simulate 5 before {command[0]}. Received: --gpus=5"
    ) in result.stderr


def test_more_gpus_than_exist_do_not_suggest_simulated_cpus():
    import argparse

    from kerasmulti._src.commands import cli as _cli

    with pytest.raises(ValueError, match=r"^--gpus 3 is more than the 2 devices there are \(/device:GPU:0, /device:GPU:1\)\. Pass --gpus 2\. Received: --gpus=3$"):
        _cli._check_gpus(argparse.Namespace(gpus=3, command="demo"), ["/device:GPU:0", "/device:GPU:1"])


def test_demo_refuses_an_output_that_is_a_file_before_training(tmp_path):
    (tmp_path / "model").write_text("not a folder")
    result = _kerasmulti("demo", "--output", str(tmp_path / "model"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "epoch" not in result.stdout
    assert f"is a file. Pass a folder (it is made if missing). Received: output='{tmp_path / 'model'}'" in result.stderr
    assert (tmp_path / "model").read_text() == "not a folder"
    under = _kerasmulti("demo", "--output", str(tmp_path / "model" / "sub"))  # a folder under that file
    assert under.returncode == 2 and "Traceback" not in under.stderr and "epoch" not in under.stdout
    assert f"cannot be made (Not a directory). Pass a folder this user can write. Received: output='{tmp_path / 'model' / 'sub'}'" in under.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("predict")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5, name="emb")]
    )
    model.save(folder / "m.keras")
    x = np.random.default_rng().random((37, 8, 8, 3)).astype("float32")
    np.save(folder / "x.npy", x)
    with h5py.File(folder / "x.h5", "w") as f:
        f["images"] = x
        f["labels"] = np.zeros(37)
    (folder / "images").mkdir()
    for i in range(9):
        keras.utils.save_img(str(folder / "images" / f"im{i}.png"), np.random.default_rng().random((12, 10, 3)) * 255)
    np.save(folder / "zero.npy", np.float32(3))
    np.save(folder / "text.npy", np.full((4, 8, 8, 3), "a"))
    return folder, model, x


def test_predict_from_npy_and_h5(files):
    folder, model, x = files
    shutil.copy(folder / "x.h5", folder / "UPPER.H5")  # suffixes in either case, as image files' are
    for source, extra in (("x.npy", []), ("UPPER.H5", ["--dataset", "images"])):
        out = folder / f"{source}.out.h5"
        result = _kerasmulti("--simulate", "2", "predict", "m.keras", source, "--output", str(out), "--batch-size", "8", *extra, cwd=folder)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "wrote predictions for 37 rows" in result.stdout
        with h5py.File(out, "r") as f:
            np.testing.assert_allclose(f["emb"][:], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_says_whether_it_wrote_all_rows_resumed_or_found_the_file_complete(files, capsys):
    folder, model, x = files
    expected = model.predict(x, verbose=0)
    messages = []
    for interrupted_at in (None, None, 16):
        if interrupted_at is not None:  # as a killed run leaves it: rows after the counter are not final
            with h5py.File(folder / "said.h5", "r+") as f:
                f.attrs["kerasmulti_rows_done"] = interrupted_at
                f["emb"][interrupted_at:] = 0.0
        assert _predict(folder, "m.keras", "x.npy", output="said.h5") == 0
        messages.append(capsys.readouterr().out.strip().splitlines()[-1])
        with h5py.File(folder / "said.h5", "r") as f:
            np.testing.assert_allclose(f["emb"][:], expected, rtol=1e-5, atol=1e-6)
    output = folder / "said.h5"
    assert messages == [
        f"wrote predictions for 37 rows to {output}",
        f"{output} already held predictions for all 37 rows; nothing was written",
        f"resumed at row 16: wrote predictions for the other 21 of 37 rows to {output}",
    ]


def test_predict_loads_a_compiled_legacy_h5_model_without_its_training_settings(files):
    # Predicting needs no loss: Keras' load of a legacy .h5 compiled with "mse" fails to deserialise it.
    folder, model, x = files
    legacy = keras.models.clone_model(model)
    legacy.set_weights(model.get_weights())
    legacy.compile(optimizer="adam", loss="mse")
    legacy.save(folder / "legacy.h5")
    out = folder / "legacy.out.h5"
    result = _kerasmulti("predict", "legacy.h5", "x.npy", "--output", str(out), cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["emb"][:], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_from_an_image_folder_stores_file_names(files):
    folder, model, _ = files
    out = folder / "images.out.h5"
    result = _kerasmulti("predict", "m.keras", "images", "--output", str(out), cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(os.listdir(folder / "images"))
    images = np.stack([keras.utils.img_to_array(keras.utils.load_img(str(folder / "images" / n), target_size=(8, 8))) for n in names])
    with h5py.File(out, "r") as f:
        assert [n.decode() for n in f["filenames"][:]] == names
        np.testing.assert_allclose(f["emb"][:], model.predict(images, verbose=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope.keras", "x.npy"], "The model file 'nope.keras' does not exist. Received: model='nope.keras'"),
        (["x.npy", "x.npy"], "kerasmulti: error: MODEL is not a model file: pass a .keras or .h5 file, as model.save() writes. Received: model='x.npy'\n"),
        (["m.keras", "nope.npy"], "The input 'nope.npy' does not exist. Received: input='nope.npy'"),
        (["m.keras", "x.h5", "--dataset", "zz"], "'x.h5' has no dataset 'zz'; it holds ['images', 'labels']; pass the one to predict on with --dataset NAME. Received: dataset='zz'"),
        (["m.keras", "x.h5"], "Received: dataset=None"),
        (["m.keras", "x.npy", "--dataset", "images"], "--dataset is for HDF5 inputs, but 'x.npy' is a .npy file. Drop it. Received: dataset='images'"),
        (["m.keras", "m.keras"], "INPUT must be an .h5/.hdf5 file, an .npy file or a folder of images. Received: input='m.keras'"),
        (["m.keras", "x.h5", "--dataset", "labels"], "do not fit model"),
        (["m.keras", "zero.npy"], "got a 0-d array. Add a batch axis: np.expand_dims(x, 0). Received: shape=()"),
        (["m.keras", "text.npy"], "takes float32 numbers, but the data holds text. Convert it. Received: dtype=<U1"),
    ],
)
def test_predict_errors_are_one_line_with_a_non_zero_exit(files, args, message):
    folder, _, _ = files
    result = _kerasmulti("predict", *args, "--output", "bad.h5", cwd=folder)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(
    "output, message",
    [
        ("", "--output is empty. Name the HDF5 file for the results, e.g. --output features.h5. Received: --output=''"),
        ("{folder}", "--output is a folder. Name an HDF5 file in it, e.g. --output {folder}/features.h5. Received: --output='{folder}'"),
        ("{folder}/out.npy", "--output is an HDF5 file, not numpy's format. Name it e.g. --output {folder}/out.h5. Received: --output='{folder}/out.npy'"),
        ("{folder}/out.CSV", "--output is an HDF5 file, not CSV. Name it e.g. --output {folder}/out.h5. Received: --output='{folder}/out.CSV'"),
    ],
)
def test_predict_refuses_an_output_that_names_no_hdf5_file_in_the_commands_words(files, output, message):
    from kerasmulti._src.commands import cli as _cli
    from kerasmulti._src.commands import predict as _predict

    folder, _, _ = files
    args = _cli._parser().parse_args(["predict", str(folder / "m.keras"), str(folder / "x.npy"), "--output", output.format(folder=folder)])
    with pytest.raises(ValueError) as error:
        _predict.run(args)
    assert str(error.value) == message.format(folder=folder)


def test_predict_refuses_to_write_into_its_input(files):
    folder, _, x = files
    result = _kerasmulti("predict", "m.keras", "x.h5", "--dataset", "images", "--output", "x.h5", cwd=folder)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "would overwrite its input file" in result.stderr and "Received: output='x.h5'" in result.stderr
    with h5py.File(folder / "x.h5", "r") as f:
        np.testing.assert_array_equal(f["images"][:], x)


def test_predict_on_a_folder_without_images_and_a_non_image_model(files, tmp_path):
    folder, _, _ = files
    result = _kerasmulti("predict", str(folder / "m.keras"), str(tmp_path), "--output", str(tmp_path / "o.h5"))
    assert result.returncode == 2 and "holds no images" in result.stderr
    dense = tmp_path / "dense.keras"
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]).save(dense)
    result = _kerasmulti("predict", str(dense), str(folder / "images"), "--output", str(tmp_path / "o.h5"))
    assert result.returncode == 2 and "needs a model of one input (height, width, 1, 3 or 4 channels)" in result.stderr
    # Channels first, and two inputs: refused before any image is read, not with advice to reshape.
    keras.Sequential([keras.Input((3, 8, 8)), keras.layers.Flatten(), keras.layers.Dense(1)]).save(tmp_path / "first.keras")
    a, b = keras.Input((8, 8, 3)), keras.Input((8, 8, 3))
    keras.Model([a, b], keras.layers.Add()([a, b])).save(tmp_path / "two.keras")
    for model, takes in (("first.keras", "(3, 8, 8)"), ("two.keras", "[(8, 8, 3), (8, 8, 3)]")):
        with pytest.raises(ValueError, match=re.escape(f"'{tmp_path / model}' takes {takes}. Received: input=")):
            _predict(folder, tmp_path / model, "images", tmp_path / "o.h5")


def test_environment_variable_and_cli_threading_work_together():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERASMULTI_SIMULATE_DEVICES": "3"}
    result = subprocess.run(
        [sys.executable, "-m", "kerasmulti", "devices"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 3


def test_demo_without_scikit_learn_says_how_to_install_it(monkeypatch):
    import builtins

    from kerasmulti._src.commands import demo as _demo

    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("No module named 'sklearn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(SystemExit, match=r"scikit-learn is not installed.*pip install 'kerasmulti\[demo\]'"):
        _demo._digits()


@pytest.mark.parametrize("command, threads", [("devices", "0"), ("demo-threads", "1")])
def test_only_the_demo_pins_tensorflow_threads(command, threads):
    # 0 is TensorFlow's own choice; the demo pins one thread per simulated device.
    call = (
        "_cli._simulate_without_gpus(2, pin_threads=True)" if command == "demo-threads"
        else "_cli.main(['--simulate', '2', 'devices'])"
    )
    script = f"from kerasmulti._src.commands import cli as _cli\nimport tensorflow as tf\n{call}\nprint(tf.config.threading.get_intra_op_parallelism_threads())"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == threads


def _importtime(*args):
    """The command run with Python's import timing on: stderr lists every module it imported."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kerasmulti", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--help"], 0, "usage: kerasmulti"),
        (["predict", "--help"], 0, "usage: kerasmulti predict"),
        (["demo", "--batch-size", "0"], 2, "kerasmulti demo: error: argument --batch-size: must be a positive int. Received: '0'"),
        (["demo", "--epochs", "x"], 2, "argument --epochs: must be a positive int. Received: 'x'"),
        (["predict", "m.keras", "x.npy", "--output", "o.h5", "--batch-size", "-3"], 2, "argument --batch-size: must be a positive int. Received: '-3'"),
        (["predict", "m.keras"], 2, "the following arguments are required: input, --output"),
        (["--simulate", "0", "devices"], 2, "kerasmulti: error: argument --simulate: must be a positive int. Received: '0'"),
        (["--bogus"], 2, "kerasmulti: error: unrecognized arguments: --bogus"),
        (["--simulate", "2"], 2, "kerasmulti: error: the following arguments are required: command"),
        (["demo", "--gpus", "0"], 2, "kerasmulti demo: error: argument --gpus: must be a positive int. Received: '0'"),
        (["demo", "--help"], 0, "rows per global batch (default: 128)"),
        # A mistyped path: it took TensorFlow's start-up (~3 s and seven lines of its log) first.
        (["predict", "nope.keras", "x.npy", "--output", "o.h5"], 2,
         "kerasmulti: error: The model file 'nope.keras' does not exist. Received: model='nope.keras'\n"),
        (["predict", "nope.keras", "x.npy", "--output", "o.npy"], 2, "--output is an HDF5 file, not numpy's format."),
    ],
)
def test_help_and_argument_errors_answer_without_loading_tensorflow(args, code, message):
    result = _importtime(*args)
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    imported = re.findall(r"^import time:.*\| +(\S+)$", result.stderr, re.M)
    assert "argparse" in imported and "tensorflow" not in imported and "keras" not in imported


def test_ctrl_c_while_predicting_ends_in_one_line_with_exit_130_and_keeps_the_rows(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="out")])
    model.save(tmp_path / "m.keras")
    x = np.random.default_rng().random((20000, 4)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.h5"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    command = [sys.executable, "-m", "kerasmulti", "predict", "m.keras", "x.npy", "--output", str(out)]
    with open(tmp_path / "stdout", "w") as stdout:  # a progress bar, more than a pipe holds
        # SIGINT back to its default: a suite started in the background (`cmd &`)
        # ignores it, and Python then keeps ignoring it, as a shell would want.
        process = subprocess.Popen(
            [*command, "--batch-size", "1"], cwd=tmp_path, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 240
        while not out.exists():  # the file is made just before the first batch: predicting has begun
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.02)
        time.sleep(1)  # some rows written, one at a time
        process.send_signal(signal.SIGINT)
        stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 130, stderr[-3000:]
    # A Ctrl-C that lands inside TensorFlow's C code can come out as a SystemError
    # that Python prints there (seen on a busy machine); the command still ends as interrupted.
    assert "Traceback" not in stderr or "returned a result with an exception set" in stderr, stderr[-3000:]
    with h5py.File(out, "r") as f:  # valid, its counter short of the end
        done = int(f.attrs["kerasmulti_rows_done"])
        assert done < len(x)
    # The file is named only when it holds rows (a busy machine may not have written one yet).
    kept = f"kerasmulti: interrupted; the rows written so far stay in {out}: run the same command to go on"
    assert [line for line in stderr.splitlines() if "interrupted" in line] == [kept if done else "kerasmulti: interrupted; no rows were written yet"]
    result = subprocess.run([*command, "--batch-size", "5000"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["out"][:], model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


# 20 in the acceptance run (benchmarks/results/ctrl-c-2026-11-26.txt); fewer
# here to keep the suite short: each moment starts TensorFlow once.
MOMENTS = int(os.environ.get("KERASMULTI_CTRL_C_MOMENTS", "5"))


def test_ctrl_c_at_random_moments_of_predict_always_stops_it_and_the_same_command_finishes(tmp_path):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2, name="out")])
    model.save(tmp_path / "m.keras")
    x = np.random.default_rng().random((30000, 4)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    expected = model.predict(x, verbose=0)
    out = tmp_path / "out.h5"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    command = [sys.executable, "-m", "kerasmulti", "predict", "m.keras", "x.npy", "--output", str(out), "--batch-size", "20"]
    kept = f"kerasmulti: interrupted; the rows written so far stay in {out}: run the same command to go on"

    def start():
        stdout = open(tmp_path / "stdout", "w")  # a progress bar, more than a pipe holds
        return stdout, subprocess.Popen(
            command, cwd=tmp_path, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see the test above
        )

    # One whole run, timed, gives the span the moments are drawn from: start-up
    # (imports, loading the model), creating the file, predicting, the end.
    started = time.monotonic()
    stdout, process = start()
    assert process.wait(timeout=600) == 0, process.communicate()[1][-3000:]
    stdout.close()
    span = time.monotonic() - started
    os.remove(out)
    rng = np.random.default_rng()
    report, finished = [], False
    # While the interpreter starts (importing `site`, then the package) Ctrl-C
    # ends it Python's way, with a traceback, before any program can handle
    # it: the moments start after the longest of 3 such starts, measured here.
    starts = []
    for _ in range(3):
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "import kerasmulti"], check=True, env=env)
        starts.append(time.monotonic() - began)
    for moment in rng.uniform(max(starts), span, MOMENTS):
        if out.exists() and finished:
            os.remove(out)  # the job finished: the next moment interrupts a new one
        stdout, process = start()  # or resumes what the previous moment left, as a user would
        time.sleep(moment)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        stderr = process.communicate(timeout=300)[1]  # a hang fails here; the watchdog ends it in 5 s
        stdout.close()
        report.append(f"{moment:.2f} s: stopped {time.monotonic() - sent:.2f} s later, exit {process.returncode}")
        assert process.returncode in (130, 0), f"{report[-1]}\n{stderr[-3000:]}"
        finished = process.returncode == 0
        done = 0
        if out.exists():  # rows written so far are right, the rest not yet counted
            with h5py.File(out, "r") as f:
                done = int(f.attrs["kerasmulti_rows_done"])
                np.testing.assert_allclose(f["out"][:done], expected[:done], rtol=1e-5, atol=1e-6)
            report[-1] += f", {done} of {len(x)} rows done"
        if process.returncode == 130:
            assert "Traceback" not in stderr, stderr[-3000:]
            line = kept if done else "kerasmulti: interrupted; no rows were written yet"
            assert [text for text in stderr.splitlines() if "interrupted" in text] == [line], stderr[-3000:]
    print("\n".join(report))
    stdout, process = start()
    assert process.wait(timeout=600) == 0, process.communicate()[1][-3000:]
    stdout.close()
    with h5py.File(out, "r") as f:
        assert int(f.attrs["kerasmulti_rows_done"]) == len(x)
        np.testing.assert_allclose(f["out"][:], expected, rtol=1e-5, atol=1e-6)


def _ready_and_interrupted(code: str) -> subprocess.Popen:
    """A Python process running `code`, sent Ctrl-C once it printed "ready"."""
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGINT)
    return process


def test_ctrl_c_that_the_command_swallows_still_ends_it_with_exit_130():
    # TensorFlow swallowed a KeyboardInterrupt inside an import and the command ran on
    # (issue #26): the watchdog the first Ctrl-C starts ends it, with the one line.
    code = (
        "import signal, time\n"
        "from kerasmulti._src.commands import cli\n"
        "signal.signal(signal.SIGINT, cli._CtrlC('kerasmulti: interrupted'))\n"
        "try:\n"  # 'ready' is printed inside the try: the interrupt cannot land outside it
        "    print('ready', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "while True:\n"  # swallowed: the command runs on, as TensorFlow's did
        "    time.sleep(0.05)\n"
    )
    process = _ready_and_interrupted(code)
    stderr = process.communicate(timeout=120)[1]  # GRACE_S (5 s) then the exit; generous for a busy machine
    assert process.returncode == 130
    assert stderr.splitlines() == ["kerasmulti: interrupted"]


def test_a_second_ctrl_c_ends_the_command_at_once_also_while_the_watchdog_is_stuck():
    # The watchdog works out its line by reading predict's output file: behind h5py's lock,
    # held by a main thread stuck in a write, it waited, and a second Ctrl-C, which found the
    # line being said, raised another KeyboardInterrupt instead of ending the command.
    code = (
        "import signal, threading, time\n"
        "from kerasmulti._src.commands import cli\n"
        "cli.GRACE_S = 0.01\n"  # the watchdog starts at once
        "stuck = threading.Event()\n"
        "def message():\n"
        "    stuck.set()\n"
        "    threading.Event().wait()\n"  # as behind a lock that is never released
        "signal.signal(signal.SIGINT, cli._CtrlC(message))\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "stuck.wait()\n"
        "said = False\n"
        "while True:\n"  # the command runs on, swallowing every KeyboardInterrupt
        "    try:\n"
        "        if not said:\n"  # inside the try: the second Ctrl-C cannot land outside it
        "            said = True\n"
        "            print('stuck', flush=True)\n"
        "        time.sleep(600)\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
    )
    process = _ready_and_interrupted(code)
    assert process.stdout.readline() == "stuck\n"
    process.send_signal(signal.SIGINT)
    try:
        stderr = process.communicate(timeout=120)[1]  # generous for a busy machine: it used to run on
    finally:
        process.kill()
    assert process.returncode == 130
    assert stderr.splitlines() == ["kerasmulti: interrupted"]


def test_ctrl_c_before_the_command_set_its_handler_is_the_same_one_line(monkeypatch, capsys):
    from kerasmulti._src.commands import cli as _cli

    def interrupted_parser():
        raise KeyboardInterrupt  # Ctrl-C while the arguments are parsed

    monkeypatch.setattr(_cli, "_parser", interrupted_parser)
    assert _cli.main(["predict", "m.keras", "x.npy"]) == 130
    assert capsys.readouterr().err.splitlines() == ["kerasmulti: interrupted"]


def test_an_error_that_a_ctrl_c_became_inside_a_c_call_is_the_interrupt(monkeypatch, capsys):
    from kerasmulti._src.commands import cli as _cli

    def interrupted_in_c(args, ctrl_c):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            # What numpy's __array__ under tf.convert_to_tensor turned it into.
            raise SystemError("<built-in function __array__> returned a result with an exception set") from None

    monkeypatch.setattr(_cli, "_run_command", interrupted_in_c)
    assert _cli.main(["demo"]) == 130
    assert capsys.readouterr().err.splitlines() == ["kerasmulti: interrupted"]


@pytest.mark.parametrize("command", ["predict", "devices"])
def test_ctrl_c_while_tensorflow_loads_lets_the_import_finish_then_ends_with_130(command, monkeypatch, capsys, tmp_path):
    # Raised inside TensorFlow's import, the KeyboardInterrupt left it half loaded: the
    # process said its line, then ended killed by SIGINT (exit -2), in 3 of 60 tries.
    # `devices` had no handler at all: its Ctrl-C was Python's own.
    from kerasmulti._src.commands import cli as _cli

    loaded = []

    def loading(requested, pin_threads):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C halfway through the import
        loaded.append("the rest of the import")

    monkeypatch.setattr(_cli, "_simulate_without_gpus", loading)
    monkeypatch.chdir(tmp_path)
    for name in ("m.keras", "x.npy"):  # there: predict checks its paths before TensorFlow loads
        (tmp_path / name).touch()
    args = ["predict", "m.keras", "x.npy", "--output", str(tmp_path / "out.h5")] if command == "predict" else [command]
    assert _cli.main(args) == 130
    assert loaded == ["the rest of the import"]
    line = "kerasmulti: interrupted; no rows were written yet" if command == "predict" else "kerasmulti: interrupted"
    assert capsys.readouterr().err.splitlines() == [line]


def test_an_error_the_command_reports_after_ctrl_c_is_one_line_not_two(monkeypatch, capsys, tmp_path):
    from kerasmulti._src.commands import cli as _cli
    from kerasmulti._src.inference import output_file as _output_file

    monkeypatch.chdir(tmp_path)
    with h5py.File("out.h5", "w") as f:  # a run interrupted before, 3 rows done
        f.attrs[_output_file.PROGRESS] = 3
    for name in ("m.keras", "x.npy"):  # there, as the command checks before it loads anything
        open(name, "w").close()

    def load_interrupted(args):  # what predict's loading turned a Ctrl-C into
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(_cli, "_simulate_without_gpus", lambda *args, **kwargs: None)
    from kerasmulti._src.commands import predict as _predict

    def interrupted(args):
        try:
            load_interrupted(args)
        except KeyboardInterrupt:
            raise ValueError("could not read the model") from None

    monkeypatch.setattr(_predict, "run", interrupted)
    assert _cli.main(["predict", "m.keras", "x.npy", "--output", "out.h5"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "kerasmulti: interrupted; the rows written so far stay in out.h5: run the same command to go on"
    ]


def _interrupted(output_before=None):
    """A `_run_command` that Ctrl-C stops after it printed `output_before` (a progress bar's line, say)."""

    def run(args, ctrl_c):
        if output_before is not None:
            print(output_before, end="", flush=True)
        signal.raise_signal(signal.SIGINT)

    return run


def test_ctrl_c_before_predict_made_its_output_file_does_not_promise_rows_in_it(monkeypatch, capsys, tmp_path):
    from kerasmulti._src.commands import cli as _cli
    from kerasmulti._src.inference import output_file  # noqa: F401  (loaded, as in a run that began its file)

    monkeypatch.setattr(_cli, "_run_command", _interrupted())
    assert _cli.main(["predict", "m.keras", "x.npy", "--output", str(tmp_path / "never.h5")]) == 130
    assert capsys.readouterr().err.splitlines() == ["kerasmulti: interrupted; no rows were written yet"]
    with h5py.File(tmp_path / "begun.h5", "w") as f:  # made, no row done yet
        f.attrs["kerasmulti_rows_done"] = 0
    assert _cli.main(["predict", "m.keras", "x.npy", "--output", str(tmp_path / "begun.h5")]) == 130
    assert capsys.readouterr().err.splitlines() == ["kerasmulti: interrupted; no rows were written yet"]


def test_ctrl_c_during_a_progress_bar_puts_its_line_below_the_bar(monkeypatch, capsys):
    from kerasmulti._src.commands import cli as _cli

    monkeypatch.setattr(_cli, "_run_command", _interrupted("\r 3/10 ━━━━━━ 1s"))
    assert _cli.main(["demo"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "\r 3/10 ━━━━━━ 1s\n" and captured.err == "kerasmulti: interrupted\n"
    monkeypatch.setattr(_cli, "_run_command", _interrupted("a whole line\n"))
    assert _cli.main(["demo"]) == 130
    assert capsys.readouterr().out == "a whole line\n"  # no blank line where none is needed


def test_an_error_without_ctrl_c_is_not_taken_for_one(monkeypatch):
    from kerasmulti._src.commands import cli as _cli

    def failing(args, ctrl_c):
        raise SystemError("a real failure")

    monkeypatch.setattr(_cli, "_run_command", failing)
    with pytest.raises(SystemError, match="a real failure"):
        _cli.main(["demo"])


def test_a_command_that_ran_on_after_ctrl_c_reports_it_and_exits_130(monkeypatch, capsys):
    from kerasmulti._src.commands import cli as _cli

    def swallowing(args, ctrl_c):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # as TensorFlow did: the command then finished as if nothing happened
        return 0

    monkeypatch.setattr(_cli, "_run_command", swallowing)
    before = signal.getsignal(signal.SIGINT)  # ignored in a suite started in the background
    assert _cli.main(["demo"]) == 130
    assert capsys.readouterr().err.splitlines() == ["kerasmulti: interrupted"]
    assert signal.getsignal(signal.SIGINT) is before  # put back


def _predict(folder, model, source, output="out.h5", *flags):
    from kerasmulti._src.commands import cli as _cli
    from kerasmulti._src.commands import predict as _predict

    args = _cli._parser().parse_args(["predict", str(folder / model), str(folder / source), "--output", str(folder / output), *flags])
    return _predict.run(args)


def _damaged_inputs(folder, x):
    np.save(folder / "objects.npy", np.array([None, {}], dtype=object), allow_pickle=True)
    (folder / "garbage.npy").write_bytes(b"not an array at all")
    (folder / "short.npy").write_bytes((folder / "x.npy").read_bytes()[:300])
    (folder / "short.h5").write_bytes((folder / "x.h5").read_bytes()[:2000])
    (folder / "damaged.keras").write_bytes((folder / "m.keras").read_bytes()[:500])
    shutil.copytree(folder / "images", folder / "some_damaged", dirs_exist_ok=True)
    (folder / "some_damaged" / "im5.png").write_bytes(b"\x89PNG but nothing after")
    (folder / "a_folder").mkdir(exist_ok=True)
    import tensorflow as tf

    tf.saved_model.save(tf.Module(), str(folder / "saved_model"))


@pytest.mark.parametrize(
    "model, source, message",
    [
        ("m.keras", "objects.npy", "The input holds Python objects, which are never unpickled. Save numbers instead. Received: input='{folder}/objects.npy'"),
        ("m.keras", "garbage.npy", "The input is not a readable .npy file. Write it again with numpy.save. Received: input='{folder}/garbage.npy'"),
        ("m.keras", "short.npy", "not a readable .npy file. Write it again with numpy.save. Received: input='{folder}/short.npy'"),
        ("m.keras", "short.h5", "The input is not a readable HDF5 file. Write it again. Received: input='{folder}/short.h5'"),
        ("m.keras", "some_damaged", "An image could not be read (UnidentifiedImageError). Replace or remove it, and start a new output file. Received: image='{folder}/some_damaged/im5.png'"),
        ("saved_model", "x.npy", "is a TensorFlow SavedModel folder, which Keras 3 cannot load. Save it as .keras or use keras.layers.TFSMLayer. Received: model='{folder}/saved_model'"),
        ("a_folder", "x.npy", "'{folder}/a_folder' is a folder, not a model file. Pass a .keras or .h5 model file. Received: model="),
        # Said once: it was wrapped in "could not be loaded ... Pass a .keras or .h5 file", two Received: parts.
        ("damaged.keras", "x.npy", "'{folder}/damaged.keras' is not a readable .keras file"),
    ],
)
def test_damaged_inputs_and_wrong_models_are_named(files, model, source, message):
    folder, _, x = files
    _damaged_inputs(folder, x)
    with pytest.raises(ValueError) as error:
        _predict(folder, model, source)
    assert message.format(folder=folder) in str(error.value)
    assert "allow_pickle" not in str(error.value) and "BytesIO" not in str(error.value)
    assert str(error.value).count("Received:") == 1


def test_an_image_folder_without_pillow_says_how_to_install_it(files, monkeypatch):
    folder, _, _ = files
    monkeypatch.setitem(sys.modules, "PIL.Image", None)  # as if Pillow were not installed
    with pytest.raises(ValueError, match=r"Reading images needs Pillow: pip install 'kerasmulti\[images\]'\. Received: input="):
        _predict(folder, "m.keras", "images")


def _image_folder(folder, name, images):
    """A folder of 8x8 RGB PNGs (the model's size: read without resizing), `images` maps names to arrays."""
    (folder / name).mkdir(exist_ok=True)
    for image_name, array in images.items():
        keras.utils.save_img(str(folder / name / image_name), array, scale=False)
    return folder / name


def test_an_image_that_fails_while_decoded_or_is_too_large_is_named(files, monkeypatch):
    folder, _, _ = files
    rng = np.random.default_rng()
    images = _image_folder(folder, "exact", {f"p{i}.png": rng.integers(0, 256, (8, 8, 3)).astype("uint8") for i in range(3)})
    whole = (images / "p1.png").read_bytes()
    (images / "p1.png").write_bytes(whole[:-40])  # its header is read whole: only decoding the rows fails
    with pytest.raises(ValueError, match=r"An image could not be read \(OSError\)\. .* Received: image='.*exact/p1\.png'"):
        _predict(folder, "m.keras", "exact", "exact.h5")
    (images / "p1.png").write_bytes(whole)
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20)  # an 8x8 image is then over twice Pillow's limit, as a huge scan is
    with pytest.raises(ValueError, match=r"An image could not be read \(DecompressionBombError\)\. .* Received: image='.*exact/p0\.png'"):
        _predict(folder, "m.keras", "exact", "exact-bomb.h5")


def test_an_image_folder_leaves_out_hidden_files_says_what_else_it_left_out_and_refuses_names_that_are_not_utf8(files, capsys):
    folder, model, _ = files
    rng = np.random.default_rng()
    arrays = {name: rng.integers(0, 256, (8, 8, 3)).astype("uint8") for name in ("b.png", "A.JPG", "c.gif")}
    images = _image_folder(folder, "mixed", arrays)
    (images / "._b.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS's companion files: not images
    (images / "notes.txt").write_text("not an image")
    (images / "sub").mkdir()
    assert _predict(folder, "m.keras", "mixed", "mixed.h5") == 0
    err = capsys.readouterr().err
    assert "left out 2 entries of the folder that are not .png/.jpg/.jpeg/.bmp/.gif images (e.g. 'notes.txt')" in err
    with h5py.File(folder / "mixed.h5", "r") as f:
        assert [name.decode() for name in f["filenames"][:]] == ["A.JPG", "b.png", "c.gif"]  # code point order
        read = np.stack([keras.utils.img_to_array(keras.utils.load_img(str(images / n))) for n in ("A.JPG", "b.png", "c.gif")])
        np.testing.assert_allclose(f["emb"][:], model.predict(read, verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="--dataset is for HDF5 inputs, but .* is a folder of images. Drop it. Received: dataset='images'"):
        _predict(folder, "m.keras", "mixed", "mixed2.h5", "--dataset", "images")
    latin1 = os.fsencode(str(images)) + b"/caf\xe9.png"
    shutil.copy(images / "b.png", latin1)
    with pytest.raises(ValueError, match=r"An image's file name is not UTF-8 text. Rename it. Received: image=b'.*/mixed/caf\\xe9.png'"):
        _predict(folder, "m.keras", "mixed", "mixed3.h5")
    assert not (folder / "mixed3.h5").exists()


def test_a_model_named_filenames_output_is_refused_in_the_commands_words(files, tmp_path):
    folder, _, _ = files
    inputs = keras.Input((8, 8, 3))
    keras.Model(inputs, keras.layers.Dense(2, name="filenames")(keras.layers.GlobalAveragePooling2D()(inputs))).save(tmp_path / "f.keras")
    with pytest.raises(ValueError, match=r"The model has an output named 'filenames', .* Call parallel_predict\(\) in Python instead. Received: model="):
        _predict(folder, tmp_path / "f.keras", "images", tmp_path / "f.h5")


@pytest.mark.parametrize("which", ["output", "input", "model"])
def test_a_pipe_is_refused_where_a_file_is_expected_instead_of_waiting_for_a_writer(files, tmp_path, which):
    folder, model, _ = files
    os.mkfifo(tmp_path / "pipe")
    paths = {"model": folder / "m.keras", "input": folder / "x.npy", "output": tmp_path / "out.h5", which: tmp_path / "pipe"}
    with pytest.raises(ValueError, match=f"not a regular file.*\\(a pipe or a device\\).* Received: (--)?{which}="):
        _predict(folder, paths["model"], paths["input"], paths["output"])
    if which == "output":
        import kerasmulti

        with pytest.raises(ValueError, match="parallel_predict\\(\\)'s output is not a regular file .* Received: output="):
            kerasmulti.parallel_predict(model, np.zeros((4, 8, 8, 3), "float32"), output=tmp_path / "pipe")


CUSTOM_MODULE = """
import keras


@keras.saving.register_keras_serializable(package="kerasmulti_cli_test")
class Twice(keras.layers.Layer):
    def call(self, x):
        return 2 * x


@keras.saving.register_keras_serializable(package="kerasmulti_cli_test")
class Miswritten(Twice):
    def get_config(self):
        return {**super().get_config(), "factor": 2.0}  # an argument __init__ does not take
"""


def test_custom_layers_load_with_import_and_lambda_layers_with_unsafe_deserialization(files, tmp_path, monkeypatch):
    folder, _, x = files
    (tmp_path / "my_layers.py").write_text(CUSTOM_MODULE)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --import puts the module's folder first
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_layers

    custom = keras.Sequential([keras.Input((8, 8, 3)), my_layers.Twice(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    custom.save(tmp_path / "custom.keras")
    lambda_model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Lambda(lambda t: t * 3), keras.layers.Flatten(), keras.layers.Dense(3)])
    lambda_model.save(tmp_path / "lambda.keras")

    def forget():  # as in a fresh process, which has not run the module
        monkeypatch.delitem(keras.saving.get_custom_objects(), "kerasmulti_cli_test>Twice", raising=False)
        monkeypatch.delitem(sys.modules, "my_layers", raising=False)

    forget()
    with pytest.raises(ValueError, match=r"The model uses 'Twice', which Keras does not know. .*: --import MODULE. Received: model="):
        _predict(folder, tmp_path / "custom.keras", "x.npy", tmp_path / "c0.h5")
    monkeypatch.chdir(tmp_path)  # a module name is found from the working folder, as `python -m` finds it
    for i, module in enumerate(["my_layers", str(tmp_path / "my_layers.py")]):
        forget()
        assert _predict(folder, tmp_path / "custom.keras", "x.npy", tmp_path / f"c{i + 1}.h5", "--import", module) == 0
        _assert_holds(tmp_path / f"c{i + 1}.h5", custom.predict(x, verbose=0))
    keras.Sequential([keras.Input((8, 8, 3)), my_layers.Miswritten()]).save(tmp_path / "miswritten.keras")
    with pytest.raises(ValueError, match=r"could not be loaded as a Keras model \(TypeError: Unrecognized keyword arguments "
                                         r"passed to Miswritten: \{'factor': 2.0\}\)\. Load it in Python .* Received: model="):
        _predict(folder, tmp_path / "miswritten.keras", "x.npy", tmp_path / "c3.h5", "--import", "my_layers")
    with pytest.raises(ValueError, match=r"--import no_such_module failed \(ModuleNotFoundError: No module named 'no_such_module'\). Received: --import="):
        _predict(folder, tmp_path / "custom.keras", "x.npy", tmp_path / "c3.h5", "--import", "no_such_module")
    with pytest.raises(ValueError, match=r"The file to import, 'gone.py', does not exist or is a folder. Received: --import='gone.py'"):
        _predict(folder, tmp_path / "custom.keras", "x.npy", tmp_path / "c3.h5", "--import", "gone.py")

    with pytest.raises(ValueError, match=r"The model holds Python code \(a Lambda layer\), .* add --unsafe-deserialization. Received: model="):
        _predict(folder, tmp_path / "lambda.keras", "x.npy", tmp_path / "l0.h5")
    assert _predict(folder, tmp_path / "lambda.keras", "x.npy", tmp_path / "l1.h5", "--unsafe-deserialization") == 0
    _assert_holds(tmp_path / "l1.h5", lambda_model.predict(x, verbose=0))


def _assert_holds(path, expected):
    """The output file's one output dataset holds `expected`."""
    with h5py.File(path, "r") as f:
        (name,) = [name for name in f if not name.startswith("kerasmulti")]
        np.testing.assert_allclose(f[name][:], expected, rtol=1e-5, atol=1e-6)
