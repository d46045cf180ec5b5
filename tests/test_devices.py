"""Device listing, simulation and every refusal of a bad device request."""

from simulated import DEVICES

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kerasmulti

CPUS = [f"/device:CPU:{i}" for i in range(DEVICES)]


def _model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_available_devices_are_the_simulated_cpus():
    assert kerasmulti.available_devices() == CPUS


def test_simulate_devices_again_with_same_count_is_harmless():
    assert kerasmulti.simulate_devices(DEVICES) == CPUS


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_simulate_devices_after_start_with_the_same_count_is_harmless():
    code = "import tensorflow as tf; tf.constant(1); import kerasmulti; print(kerasmulti.simulate_devices(1))"
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['/device:CPU:0']"


def test_simulate_devices_after_start_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"came too late.*KERASMULTI_SIMULATE_DEVICES=5.*Received: n=5"):
        kerasmulti.simulate_devices(5)


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_simulate_devices_leaves_threading_configurable():
    code = (
        "import kerasmulti, tensorflow as tf\n"
        "names = kerasmulti.simulate_devices(3)\n"
        "tf.config.threading.set_intra_op_parallelism_threads(1)  # fails once TensorFlow started\n"
        "print(names == kerasmulti.available_devices(), tf.config.threading.get_intra_op_parallelism_threads())"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "1"]


@pytest.mark.parametrize("n", [0, -2, 1.5, "2", True])
def test_simulate_devices_rejects_non_positive_int(n):
    with pytest.raises(ValueError, match=f"Received: n={n!r}"):
        kerasmulti.simulate_devices(n)


def _run_python(code, **env):
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_environment_variable_simulates_devices():
    result = _run_python("import kerasmulti; print(len(kerasmulti.available_devices()))", KERASMULTI_SIMULATE_DEVICES="4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_bad_environment_variable_is_refused():
    result = _run_python("import kerasmulti", KERASMULTI_SIMULATE_DEVICES="two")
    assert result.returncode != 0
    assert "Received: KERASMULTI_SIMULATE_DEVICES='two'" in result.stderr


@pytest.mark.parametrize(
    "gpus, expected",
    [(None, CPUS), (2, CPUS[:2]), ([2, 0], [CPUS[2], CPUS[0]]), ((1,), [CPUS[1]])],
)
def test_gpus_selects_devices(gpus, expected):
    assert kerasmulti.parallelize(_model(), gpus=gpus).replica_devices == expected


def test_numpy_ints_select_devices_like_ints():
    assert kerasmulti.parallelize(_model(), gpus=np.int64(2)).replica_devices == CPUS[:2]
    assert kerasmulti.parallelize(_model(), gpus=[np.int32(1)]).replica_devices == [CPUS[1]]


def test_too_many_gpus_on_a_gpu_machine_does_not_suggest_simulated_cpus(monkeypatch):
    from kerasmulti._src import devices as _devices

    monkeypatch.setattr(_devices, "available_devices", lambda: ["/device:GPU:0", "/device:GPU:1"])
    with pytest.raises(kerasmulti.DeviceError, match=r"asked for 4 devices but this machine has 2.*Pass gpus=2\. Received: gpus=4") as error:
        _devices.resolve_devices(gpus=4)
    assert "simulate_devices" not in str(error.value)


def test_devices_takes_tensorflow_names():
    parallel = kerasmulti.parallelize(_model(), devices=["/cpu:2", "/CPU:1"])
    assert parallel.replica_devices == [CPUS[2], CPUS[1]]


@pytest.mark.parametrize(
    "gpus, message",
    [
        (0, r"at least one device.*Received: gpus=0"),
        (-1, r"at least one device.*Received: gpus=-1"),
        (1.5, r"positive int.*Received: gpus=1.5"),
        ("2", r"positive int.*Received: gpus='2'"),
        (True, r"positive int.*Received: gpus=True"),
        (4, r"asked for 4 devices but this machine has 3 \(/device:CPU:0, /device:CPU:1, /device:CPU:2\).*simulate_devices\(4\).*Received: gpus=4"),
        ([0, 0], r"same device id twice.*Received: gpus=\[0, 0\]"),
        ([0, 5], r"id\(s\) \[5\] that do not exist.*ids 0 to 2.*Received: gpus=\[0, 5\]"),
        ([], r"non-empty list.*Received: gpus=\[\]"),
        ([0, "1"], r"non-empty list of int.*Received: gpus=\[0, '1'\]"),
    ],
)
def test_bad_gpus_are_refused(gpus, message):
    with pytest.raises(kerasmulti.DeviceError, match=message):
        kerasmulti.parallelize(_model(), gpus=gpus)


@pytest.mark.parametrize(
    "devices, message",
    [
        (["/gpu:0"], r"does not exist.*Known devices: /device:CPU:0.*Received: devices=\['/gpu:0'\]"),
        (["/cpu:1", "/device:CPU:1"], r"same device twice.*Received: devices="),
        ("/cpu:0", r"non-empty list.*Received: devices='/cpu:0'"),
        ([], r"non-empty list.*Received: devices=\[\]"),
        (["not a device"], r"does not exist.*Received: devices=\['not a device'\]"),
    ],
)
def test_bad_devices_are_refused(devices, message):
    with pytest.raises(kerasmulti.DeviceError, match=message):
        kerasmulti.parallelize(_model(), devices=devices)


def test_a_gpu_name_without_gpus_is_answered_with_the_simulated_cpu_names():
    # simulate_devices() makes CPU devices: '/gpu:0' can never exist here.
    with pytest.raises(
        kerasmulti.DeviceError,
        match=r"Without GPUs, use '/cpu:0' to '/cpu:2', or kerasmulti\.simulate_devices\(n\) for n CPU devices\. Received: device='/gpu:0'$",
    ):
        with kerasmulti.device_scope("/gpu:0"):
            pass


def test_a_missing_device_on_a_gpu_machine_is_answered_with_the_known_ones(monkeypatch):
    from kerasmulti._src import devices as _devices

    monkeypatch.setattr(_devices, "known_devices", lambda: ["/device:CPU:0", "/device:GPU:0"])
    with pytest.raises(kerasmulti.DeviceError, match=r"Known devices: /device:CPU:0, /device:GPU:0\. Use one of them\. Received: device='/gpu:1'$"):
        _devices.resolve_device("/gpu:1", "device_scope()")


def test_gpus_and_devices_together_are_refused():
    with pytest.raises(kerasmulti.DeviceError, match=r"either gpus= or devices=.*Received: gpus=2, devices=\['/cpu:0'\]"):
        kerasmulti.parallelize(_model(), gpus=2, devices=["/cpu:0"])


def test_device_error_is_a_value_error():
    assert issubclass(kerasmulti.DeviceError, ValueError)


def test_one_device_is_a_working_pass_through():
    keras.utils.set_random_seed(0)
    reference = _model()
    keras.utils.set_random_seed(0)
    template = _model()
    parallel = kerasmulti.parallelize(template, gpus=1)
    x = np.random.default_rng().normal(size=(9, 3)).astype("float32")
    y = np.random.default_rng().normal(size=(9, 2)).astype("float32")
    for m in (reference, parallel):
        m.compile(optimizer="sgd", loss="mse")
    np.testing.assert_allclose(
        reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"],
        parallel.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"],
        rtol=1e-6,
    )
    np.testing.assert_allclose(reference.predict(x, verbose=0), parallel.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_environment_variable_set_too_late_is_warned_about():
    code = (
        "import os, tensorflow as tf; tf.constant(1); "
        "os.environ['KERASMULTI_SIMULATE_DEVICES'] = '2'; import kerasmulti; "
        "print(len(kerasmulti.available_devices()))"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "1"
    assert "simulate_devices(2) came too late" in result.stderr and "Received: n=2" in result.stderr


@pytest.mark.parametrize("option, value", [("cpu_merge", "no"), ("cpu_relocation", 2)])
def test_options_that_are_not_bools_are_refused(option, value):
    # A string such as 'no' would count as True.
    with pytest.raises(TypeError, match=rf"parallelize\(\)'s {option} must be True or False \(.*\)\. Received: {option}={value!r}"):
        kerasmulti.parallelize(_model(), gpus=2, **{option: value})
